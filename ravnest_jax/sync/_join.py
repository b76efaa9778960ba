"""One call that starts a peer right: join a running swarm, resume from a checkpoint, or restart a
whole swarm from the checkpoint every peer has.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

from ravnest_jax.swarm import SwarmError

from . import _nnx
from ._restart import common_checkpoint_step, running_peers, wait_for_info

log = logging.getLogger("ravnest_jax.sync")

__all__ = ["Joined", "join_or_resume", "checkpoint_extra"]


class Joined(NamedTuple):
    """What :func:`join_or_resume` did.

    Attributes:
      params: the params to train on (with nnx: the model, updated in place).
      state: the ``rj.DiLoCoState`` (with nnx: the optimizer, updated in place).
      how: ``"fresh"`` (nothing to resume, nobody to join), ``"joined"`` (downloaded the state of
        a running swarm), ``"resumed"`` (this peer's own newest checkpoint) or ``"restarted"``
        (a whole-swarm restart from the newest checkpoint step every peer has).
      step: int, the inner step training continues from (``state.count``).
      resumed_from: int, the checkpoint step restored, or ``None``.
      extra: the restored ``extra`` target's values (your part of it, without ``"sync"``), or
        ``None`` when no checkpoint was restored.
    """

    params: Any
    state: Any
    how: str
    step: int
    resumed_from: int | None
    extra: dict | None


def checkpoint_extra(sync: Any, params: Any, extra: dict | None = None) -> dict:
    """The ``extra`` to save with a checkpoint so that :func:`join_or_resume` can resume it:
    ``{"sync": sync.state_dict(params), **extra}``. Call between rounds (``sync.pending == 0``,
    or after ``sync.flush``).

    Raises:
      ValueError: ``extra`` has a ``"sync"`` key.
      RuntimeError: rounds are in flight.
    """
    extra = dict(extra or {})
    if "sync" in extra:
        raise ValueError("extra must not have a 'sync' key: it holds the driver's state")
    return {"sync": sync.state_dict(params), **extra}


def join_or_resume(
    swarm: Any,
    sync: Any,
    params: Any,
    state: Any,
    *,
    checkpointer: Any = None,
    min_peers: int | None = None,
    extra: dict | None = None,
    timeout: float = 300.0,
    fetch_timeout: float = 120.0,
) -> Joined:
    """Starts this peer from the right state, before its first training step.

    In order:

    1. with a ``checkpointer`` (``rj.Checkpointer``): restores its newest readable checkpoint
       (saved with ``extra=rj.sync.checkpoint_extra(sync, params, ...)``), params, optimizer
       state and the driver's round counters, and publishes the checkpoint steps in the
       swarm's info (``checkpoint_steps``, shown by ``ravnest-jax status``);
    2. with ``min_peers > 1``: waits until that many peers have registered;
    3. if other peers are training (:func:`running_peers`): downloads their current global
       state (``Swarm.fetch_state``); it replaces the restored one, whose anchor is stale. If
       no peer delivers it, this peer goes on from its local state, with a warning;
    4. otherwise, with a checkpointer and ``min_peers > 1``: a whole swarm restarting; every
       peer continues from the newest checkpoint step all of them have
       (:func:`common_checkpoint_step`), and they wait for each other before the first step.

    The driver serves this peer's state to later joiners by itself (``rj.OuterSync`` registers
    ``request_state`` with the swarm), so after this call the loop is only ``train_step`` and
    ``sync``. A peer's id should survive a restart (``rj.persistent_peer_id``), so that the
    swarm sees the same peer come back.

    Args:
      swarm: a started ``rj.Swarm`` (inside its ``with``).
      sync: the ``rj.OuterSync`` of this swarm.
      params: the freshly initialised params (a pytree; its structure, shapes and dtypes are
        the restore target), or with flax nnx the ``nnx.Module``.
      state: ``tx.init(params)``, or with nnx the ``nnx.Optimizer(model, rj.diloco(...),
        wrt=nnx.Param)``.
      checkpointer: an ``rj.Checkpointer`` or ``None``.
      min_peers: peers to wait for before deciding (int >= 1); also the number of peers of a
        whole-swarm restart. Default: ``$RAVNEST_WORLD_SIZE`` when set (``ravnest-jax local``
        sets it: the peers it starts begin, or resume, together), else 1.
      extra: your own part of the checkpoint's ``extra`` target (for example a data position):
        the same dict you pass to :func:`checkpoint_extra`.
      timeout: seconds to wait for ``min_peers`` peers and for a whole-swarm restart's barrier.
      fetch_timeout: seconds to download a running swarm's state.

    Returns:
      A :class:`Joined`.

    Raises:
      ValueError: ``min_peers`` < 1; the checkpoint does not match ``params``/``state``/``extra``
        (``rj.Checkpointer.restore``), or a downloaded state is not of this model.
      TimeoutError: fewer than ``min_peers`` peers registered within ``timeout``.
      SwarmError: a whole-swarm restart without a common checkpoint step (the message lists
        every peer's steps).
      CheckpointError: no checkpoint in ``checkpointer``'s directory can be read.
      ManifestMismatch: this peer's settings differ from the run's (``OuterSync.declare_manifest``).
    """
    if min_peers is None:
        env = os.environ.get("RAVNEST_WORLD_SIZE", "")
        min_peers = int(env) if env.isdigit() and int(env) >= 1 else 1
    if not isinstance(min_peers, int) or min_peers < 1:
        raise ValueError(f"min_peers must be an int >= 1, got {min_peers!r}")
    nnx_objs = (params, state) if _nnx.is_optimizer(state) else None
    if nnx_objs is not None:
        params, state = _nnx.split(*nnx_objs)
    sync.declare_manifest(params)  # refused at the door (ManifestMismatch) before anything loads
    how, resumed_from, restored, got_extra = "fresh", None, None, None
    blank = None
    if checkpointer is not None:
        blank = checkpoint_extra(sync, params, extra)
        restored = checkpointer.restore(params=params, opt_state=state, extra=blank)
        if restored is not None:
            params, state = restored.params, restored.opt_state
            sync.load_state_dict(restored.extra["sync"])
            resumed_from, how = restored.step, "resumed"
            got_extra = {k: v for k, v in restored.extra.items() if k != "sync"}
            log.info("resumed from %s at step %d", checkpointer.directory, restored.step)
        swarm.set_info({**swarm.info, "checkpoint_steps": checkpointer.saved_steps()})
    if min_peers > 1:
        log.info("waiting up to %.0f s until %d peers have registered", timeout, min_peers)
        swarm.wait_for_peers(min_peers, timeout=timeout)
    data = None
    if running_peers(swarm, wait_seconds=2 * swarm.timeouts.heartbeat + 1.0):
        try:
            data = swarm.fetch_state(timeout=fetch_timeout)
        except SwarmError as e:
            log.warning("could not download the swarm's state (%s); continuing from the local state", e)
    ref = sync.run_initial or {}
    fresh = how == "fresh" and not data
    if fresh and ref.get("init") and ref["init"] != sync.initial_digest and ref["init_from"] != swarm.peer_id:
        # another seed than the run's first peer: take its state now, as a joiner (no failed round)
        log.info("the initial params differ from the run's (another seed?): taking %s's state", ref["init_from"])
        data = swarm.fetch_state(timeout=fetch_timeout, prefer=ref["init_from"])
    if data:
        params, state = sync.load_state_bytes(data, params, state)
        how = "joined"
    if how != "joined" and checkpointer is not None and min_peers > 1:
        common = common_checkpoint_step(swarm, checkpointer.all_steps(), num_peers=min_peers, timeout=timeout)
        if common is not None:
            if common != resumed_from:
                r = checkpointer.restore(common, params=params, opt_state=state, extra=blank)
                log.warning("whole-swarm restart: continuing from step %d, the newest checkpoint of every peer", common)
            else:
                r = restored
            params, state = r.params, r.opt_state
            sync.load_state_dict(r.extra["sync"], round_mapping=False)
            got_extra = {k: v for k, v in r.extra.items() if k != "sync"}
            resumed_from, how = common, "restarted"
            wait_for_info(swarm, "restarted_from", common, num_peers=min_peers, timeout=timeout)
    step = int(state.count)
    if nnx_objs is not None:
        _nnx.write_back(*nnx_objs, params, state, step=True)
        params, state = nnx_objs
    return Joined(params, state, how, step, resumed_from, got_extra)
