"""One round's exchange between the device and the swarm, run beside training: the encoded
pseudo-gradient to the host, into the swarm's all-reduce, and the mean back; and what a peer
over several processes shares of it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ravnest_jax import compress
from ravnest_jax.compress import message_nbytes
from ravnest_jax.swarm import RoundFailed


def exchange(
    swarm: Any,
    packed: Any,
    weight: float,
    expected: int | None,
    state: tuple[int, str] | None,
    learn_round: Callable[[int, bool], None],
) -> tuple[np.ndarray, Any, int, int, float]:
    """Background thread: device -> host, the all-reduce, the mean.

    Encode once: the packed parts (each device's slices, copied to the host once) are the
    contribution the swarm cuts into parts and sends as they are (``Swarm.all_reduce_packed_async``);
    nothing is decoded or encoded again on the host.

    Args:
      swarm: the :class:`~ravnest_jax.sync.SwarmContract` (its codec is the one ``packed`` has).
      packed: the ``Packed`` parts from the device encode (their host copies already started).
      weight: this peer's weight (samples since its last round).
      expected: the swarm round this exchange belongs to, or ``None`` (not known yet).
      state: ``(swarm round, state digest)`` after the last merged round, or ``None``.
      learn_round: called with the swarm round number the round ran as (also when it failed).

    Returns:
      ``(mean, record, payload_bytes, float32_bytes, seconds)``: the mean as float32 ``(n,)``,
      the swarm's ``RoundRecord``, this peer's encoded bytes, its float32 bytes, and the wall
      seconds from when the contribution was on the host until the mean was.

    Raises:
      compress.NonFiniteError: the pseudo-gradient holds NaN or infinity (this peer diverged).
      RoundFailed: the round failed on this peer.
    """
    host = jax.device_get(packed)  # waits for the device to run the steps queued before the encode
    t0 = time.perf_counter()  # the exchange proper: from here (RoundMetrics.exchange_seconds)
    for spec, ok in zip(host.specs, host.ok, strict=True):
        if not bool(np.asarray(ok)):
            raise compress.NonFiniteError(
                f"pseudo-gradient leaf {spec.name!r} has NaN, Inf or |x| > 2**127 values; "
                "refusing to send it (a diverged peer must not poison the swarm)",
                leaf=spec.name,
            )
    n = sum(math.prod(s.shape) for s in host.specs)
    nbytes = message_nbytes(host)  # what this peer's message holds
    kwargs: dict[str, Any] = {} if expected is None else {"round": expected}
    if state is not None:  # the rendezvous compares it with the other peers' (divergence)
        kwargs["state"] = state
    # encode once: the device's message goes on the wire as it is, cut into parts
    fut = swarm.all_reduce_packed_async(host, weight=weight, **kwargs)
    del host
    return _result(fut, learn_round, nbytes, n, t0)


def _result(
    fut: Any, learn_round: Callable[[int, bool], None], nbytes: int, n: int, t0: float
) -> tuple[np.ndarray, Any, int, int, float]:
    try:
        mean, record = fut.result()
    except Exception as e:
        if isinstance(e, RoundFailed):  # the swarm round it ran as
            learn_round(int(e.record.round), False)
        raise
    learn_round(int(record.round), True)
    return np.asarray(mean, np.float32).reshape(-1), record, nbytes, 4 * n, time.perf_counter() - t0


def share_result(
    leader: bool, pseudo_gradient: Any, mean: np.ndarray | None, error: str | None
) -> tuple[np.ndarray | None, str | None]:
    """A peer over several processes: process 0 tells the others whether the round worked and
    sends them the mean, float32 ``(n,)`` with ``n`` the elements of ``pseudo_gradient`` (two
    broadcasts, in the training thread of every process). Returns ``(mean, error)``."""
    ok = multihost_utils.broadcast_one_to_all(np.asarray([error is None], np.int32))
    if not int(np.asarray(ok).reshape(-1)[0]):
        return None, error or "the round failed on process 0 of this peer"
    n = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in jax.tree.leaves(pseudo_gradient))
    buf = mean if leader else np.zeros((n,), np.float32)
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(buf, np.float32)), np.float32), None
