"""The host-side driver of outer rounds: overlaps the swarm's all-reduce with inner steps.

The only layer that crosses between the jitted world and the swarm's event loop.

References:
  Douillard et al., DiLoCo, https://arxiv.org/abs/2311.08105
  Douillard et al., Streaming DiLoCo with overlapping communication, https://arxiv.org/abs/2501.18512
  Kale et al., Eager updates for overlapped communication and computation in DiLoCo,
  https://arxiv.org/abs/2502.12996
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, serialization
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ravnest_jax import compress
from ravnest_jax.optim import DiLoCo, DiLoCoState, RoundSnapshot

from . import _nnx
from ._digest import device_digest, digest_hex

log = logging.getLogger("ravnest_jax.sync")

__all__ = ["OuterSync", "RoundMetrics", "MODES"]

MODES = ("blocking", "delayed", "eager")


class Exchange(Protocol):
    """What :class:`OuterSync` needs from a swarm (``rj.Swarm`` provides it)."""

    codec: str

    def all_reduce_async(self, tree: Any, *, weight: float) -> concurrent.futures.Future: ...


@dataclasses.dataclass(frozen=True)
class RoundMetrics:
    """What one outer round cost and produced on this peer.

    Attributes:
      round: exchange number on this peer's schedule (0, 1, ...; one per fragment round).
      fragment: the fragment synchronised (0 without fragments).
      step: inner step at the round boundary.
      merged_at_step: inner step at which the result was merged (``step + overlap``).
      ok: the round produced a result that was merged.
      swarm_round: the swarm's round number (``-1`` if unknown).
      group_size: peers that contributed to the mean.
      bytes_sent: body bytes this peer sent in the exchange.
      bytes_received: body bytes it received.
      payload_bytes: encoded size of this peer's pseudo-gradient (bytes).
      codec_ratio: ``payload_bytes`` / float32 size of the pseudo-gradient.
      exchange_seconds: wall time from the round boundary until the result was in (seconds).
      overlap_steps: tau of this round: inner steps from its boundary to its merge (chosen per
        round with ``overlap_steps="auto"``).
      stall_seconds: time the training loop blocked waiting for this round (seconds).
      compute_utilisation: ``1 - stall / wall`` over the inner steps since the previous round.
      result_digest: digest of the averaged pseudo-gradient (equal on every contributor).
      state_digest: digest of the global params and outer state after the merge (equal on every
        live peer when they agree).
      error: why the round failed, else ``None``.
    """

    round: int
    fragment: int
    step: int
    merged_at_step: int
    ok: bool
    swarm_round: int
    group_size: int
    bytes_sent: int
    bytes_received: int
    payload_bytes: int
    codec_ratio: float
    exchange_seconds: float
    stall_seconds: float
    compute_utilisation: float
    result_digest: str
    state_digest: str
    error: str | None = None
    overlap_steps: int = 0


@dataclasses.dataclass
class _Pending:
    seq: int
    fragment: int
    step: int
    due_step: int
    snapshot: RoundSnapshot
    spec_params: Any  # eager: the speculative anchor leaves the params restarted from
    future: concurrent.futures.Future
    started: float
    done_at: list  # [perf_counter when the result was in], set by the future's callback
    payload_bytes: int = 0
    float_bytes: int = 0


def _report_summary(summary: dict) -> None:
    """Under ``ravnest-jax local``: one JSON line of :meth:`OuterSync.summary` to the launcher's
    pipe (``$RAVNEST_SUMMARY_FD``). Elsewhere nothing."""
    fd = os.environ.get("RAVNEST_SUMMARY_FD")
    if not fd:
        return
    try:
        os.write(int(fd), (json.dumps(summary) + "\n").encode())
    except (OSError, ValueError, TypeError):  # not our launcher's pipe
        pass


def _check_plain(params: Any, state: Any) -> None:
    """Raises TypeError when the params and the state's anchor differ in tree structure (the
    round functions need one). The common cause: ``nnx.state(model)`` (``Param`` variables) with
    an ``nnx.Optimizer``'s state (``OptVariable`` wrappers over the same arrays)."""
    anchor = getattr(state, "global_params", None)
    if anchor is None or jax.tree.structure(anchor) == jax.tree.structure(params):
        return
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if any(is_var(x) for x in jax.tree.leaves((params, anchor), is_leaf=is_var)):
        raise TypeError(
            "params and state.global_params differ in their nnx variable wrappers (nnx.state(model) "
            "next to an nnx.Optimizer's state): call sync(model, optimizer) with the nnx.Module and its "
            "nnx.Optimizer(model, rj.diloco(...), wrt=nnx.Param)"
        )
    raise TypeError(
        f"params and state.global_params differ in tree structure: {jax.tree.structure(params)} vs "
        f"{jax.tree.structure(anchor)}: pass the state tx.init(params) made for these params"
    )


def _mesh_of(tree: Any) -> Mesh | None:
    """The device mesh of the first leaf laid out over more than one device, else ``None``."""
    for x in jax.tree.leaves(tree):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.size > 1:
            return s.mesh
    return None


def _layout(params: Any, state: Any) -> tuple | None:
    """A hashable description of how ``params`` and ``state`` lie on their mesh: ``(mesh,
    params treedef, params shardings, state treedef, state shardings)``, with ``None`` for a leaf
    that is not on that mesh (the compiler chooses); ``None`` when the params are on one device."""
    mesh = _mesh_of(params)
    if mesh is None:
        return None

    def on_mesh(tree: Any) -> tuple:
        leaves, treedef = jax.tree.flatten(tree)
        sh = tuple(
            x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh else None
            for x in leaves
        )
        return treedef, sh

    return (mesh, *on_mesh(params), *on_mesh(state))


def _spread(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Dim 0 spread over every device of ``mesh`` when it divides evenly, else replicated."""
    if shape and shape[0] % mesh.size == 0:
        return NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return NamedSharding(mesh, P())


def _encode_on_mesh(encode: Callable, mesh: Mesh | None, leaves: list, residual: Any, key: Any) -> tuple[Any, Any]:
    """``encode(leaves, residual, key)`` (a ``device_encode``) inside jit, for leaves laid out on
    ``mesh``: every device encodes the blocks of its own shards (XLA's partitioner) and the
    packed parts come out spread over the devices, so that the device-to-host copy takes one
    slice from each device and no device gathers the pseudo-gradient. (On a mesh with explicit
    axes ``device_encode`` lays its outputs out the same way itself.)"""
    if mesh is None or mesh.explicit_axes:
        return encode(leaves, residual, key)
    packed, new_res = encode(leaves, residual, key)
    return jax.lax.with_sharding_constraint(packed, jax.tree.map(lambda a: _spread(mesh, a.shape), packed)), new_res


def _split_host(vec: np.ndarray, like: list) -> list[np.ndarray]:
    """A flat host vector cut into arrays shaped like ``like`` (views, C order)."""
    out, off = [], 0
    for x in like:
        n = int(np.prod(np.shape(x), dtype=np.int64))
        out.append(vec[off : off + n].reshape(np.shape(x)))
        off += n
    return out


def _put_like(arrays: list, like: list) -> list:
    """Host arrays onto the devices with the layouts of ``like``: each device receives its own
    shard straight from the host. With devices of other processes in the layout (a peer over
    several processes), every process passes the same host arrays and fills its own devices."""
    out = []
    for a, x in zip(arrays, like):
        if not isinstance(x, jax.Array) or not x.committed:
            # placed like `like`: jit keys its cache on committedness, so committing an array
            # that was not would recompile the train step (and the other way round)
            out.append(jnp.asarray(a))
        elif x.sharding.is_fully_addressable:
            out.append(jax.device_put(a, x.sharding))
        else:
            a = np.asarray(a)
            out.append(jax.make_array_from_callback(a.shape, x.sharding, lambda idx, a=a: a[idx]))
    return out


class OuterSync:
    """Drives DiLoCo outer rounds over a swarm, overlapped with inner steps.

    Call it after every train step: ``params, state = sync(params, state)``. On most steps it
    only counts. At a round boundary it takes the pseudo-gradient with the jitted round
    functions of ``tx``, encodes it on the device with the swarm's codec (with error feedback),
    starts a non-blocking device-to-host copy, hands the encoded bytes to the swarm's background
    loop and returns at once. When the averaged result is due it is merged with the jitted merge
    function; if it is not in yet, the step blocks and the stall is counted.

    Modes:

    - ``"blocking"``: plain DiLoCo; the round is exchanged and applied at the boundary step
      (``overlap_steps`` must be 0).
    - ``"delayed"``: Streaming DiLoCo's overlap (arXiv 2501.18512): the result is merged
      ``overlap_steps`` (tau) inner steps after the boundary, keeping the local progress made
      meanwhile, mixed with ``alpha``. With tau = 0 it equals ``"blocking"`` exactly.
    - ``"eager"`` (arXiv 2502.12996): at the boundary the local pseudo-gradient stands in for
      the average (the params restart from the speculative anchor at once); when the true
      average arrives tau steps later the anchor is recomputed from it and the local progress
      since the boundary is rebased onto it. The global state stays identical on all peers.

    With ``tx.fragments > 1`` each fragment has its own rounds (``tx.due_fragments``), in the same
    order on every peer. With ``sync_every_seconds`` rounds start by wall time instead of every
    H steps (one fragment only); contributions are weighted by samples processed.

    Args:
      tx: the :func:`rj.diloco` transformation (``axis_name=None``).
      swarm: an ``rj.Swarm`` (or anything with ``codec`` and ``all_reduce_async(tree, weight)``).
      mode: one of ``"blocking"``, ``"delayed"``, ``"eager"``.
      overlap_steps: tau, inner steps between a round's boundary and its merge; ``0 <= tau <
        sync_every / fragments`` (the steps to the next round start). ``"auto"``: chosen at
        each round start so that the exchange hides behind the inner steps: ``tau =
        ceil(1.25 * t_x / t_s)`` within ``[1, max_overlap_steps]``, where ``t_x`` is the longest
        of the last 4 exchanges (boundary to result in, seconds) and ``t_s`` the mean inner-step
        time since the previous round start (stalls excluded); tau = 1 until a round has
        completed. Peers may then merge at different steps; the global state stays identical
        (the merge's global params and outer state do not depend on tau), only each peer's
        local progress differs, and runs are no longer bit-reproducible. Not for a peer over
        several processes.
      max_overlap_steps: upper bound of ``"auto"``, ``1 <= cap <`` the steps between round
        starts; default ``max(1, sync_every // 10)``. A larger tau merges staler averages: in
        ``benchmarks/bench_convergence.py`` (H = 50) tau = 1 cost +0.4 % eval loss against
        blocking DiLoCo, tau = 5 +0.9 %, and tau of about 25 some +4 % in the example; raise
        the cap for utilisation on slow links, keep it for quality.
      alpha: mixing weight of the local params at the merge, in ``[0, 1]``.
      error_feedback: carry the codec's quantisation residual into the fragment's next round.
      codec_options: options of the device-side encode (``block_size``, ``fraction``); must
        match the swarm's codec options.
      samples_per_step: this peer's samples per inner step (the weight of its contribution is
        samples processed since its last round).
      sync_every_seconds: start a round every this many seconds of wall time instead of every
        ``tx.sync_every`` steps (heterogeneous peers).
      on_round: callback ``f(RoundMetrics)`` after every round (called from the training thread).
      resync: ``f() -> bytes | None`` that downloads the current state from a live peer, used
        after a failed round; default: the swarm's ``fetch_state`` when it has one.
      seed: PRNG seed of stochastic rounding.
      codec: the swarm's codec. Needed only on the processes of a peer that spans several
        processes (``jax.distributed``) other than process 0: they pass ``swarm=None`` and
        encode with process 0 (docs/multi-device.md); elsewhere it must equal ``swarm.codec``.

    A peer may span several processes (hosts) joined by ``jax.distributed``: every process runs
    the same training loop and the same ``OuterSync`` calls; only process 0 holds the swarm. At
    a round boundary the processes encode the pseudo-gradient on their devices and gather the
    packed (compressed) parts to the host of every process (``process_allgather``); process 0
    sends them to the swarm; when the round is due it broadcasts the mean to the others
    (``broadcast_one_to_all``) and every process merges its own shards. A multi-process peer
    does not serve or download state (no resync): a failed round is skipped.

    Raises:
      ValueError: a bad mode, overlap, alpha, samples_per_step, sync_every_seconds, a tx with
        ``axis_name`` set, a swarm without ``all_reduce_async`` (``None`` is accepted only on the
        processes other than 0 of a multi-process peer, with ``codec``), a ``codec`` that is not
        the swarm's.
    """

    def __init__(
        self,
        tx: DiLoCo,
        swarm: Exchange,
        *,
        mode: str = "delayed",
        overlap_steps: int | str = 1,
        max_overlap_steps: int | None = None,
        alpha: float = 0.0,
        error_feedback: bool = True,
        codec_options: dict | None = None,
        samples_per_step: float = 1.0,
        sync_every_seconds: float | None = None,
        on_round: Callable[[RoundMetrics], None] | None = None,
        resync: Callable[[], bytes | None] | None = None,
        seed: int = 0,
        codec: str | None = None,
    ):
        if not isinstance(tx, DiLoCo):
            raise ValueError("tx must be the transformation returned by rj.diloco")
        if tx.axis_name is not None:
            raise ValueError("tx: OuterSync drives rounds from the host; build it with axis_name=None")
        self._processes = jax.process_count()
        self._leader = jax.process_index() == 0
        if swarm is None and not (self._processes > 1 and not self._leader):
            raise ValueError(
                "swarm must be an rj.Swarm; None only on the processes other than 0 of a peer that "
                "spans several processes (jax.distributed)"
            )
        if swarm is None and codec is None:
            raise ValueError("codec must be given with swarm=None (the codec of process 0's swarm)")
        if swarm is not None and not hasattr(swarm, "all_reduce_async"):
            raise ValueError("swarm must provide all_reduce_async(tree, weight=...) (an rj.Swarm)")
        if swarm is not None and codec is not None and codec != getattr(swarm, "codec", "fp32"):
            raise ValueError(f"codec {codec!r} is not the swarm's codec {getattr(swarm, 'codec', 'fp32')!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        auto = overlap_steps == "auto"
        gap = tx.sync_every // tx.fragments if tx.fragments > 1 else tx.sync_every
        if auto:
            if mode == "blocking":
                raise ValueError("overlap_steps='auto' does not apply to mode='blocking' (tau = 0)")
            if self._processes > 1:
                raise ValueError(
                    "overlap_steps='auto' needs a peer of one process (every process "
                    "of a multi-process peer must merge at the same step)"
                )
            if gap < 2:
                raise ValueError(f"overlap_steps='auto' needs at least 2 steps between rounds, got {gap}")
            if max_overlap_steps is None:
                max_overlap_steps = max(1, min(gap - 1, tx.sync_every // 10))
            if (
                isinstance(max_overlap_steps, bool)
                or not isinstance(max_overlap_steps, int)
                or not 1 <= max_overlap_steps < gap
            ):
                raise ValueError(
                    f"max_overlap_steps must be an int in [1, {gap - 1}] (below the steps "
                    f"between rounds), got {max_overlap_steps!r}"
                )
        else:
            if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or overlap_steps < 0:
                raise ValueError(f"overlap_steps must be an int >= 0 or 'auto', got {overlap_steps!r}")
            if max_overlap_steps is not None:
                raise ValueError("max_overlap_steps applies only to overlap_steps='auto'")
            if mode == "blocking" and overlap_steps != 0:
                raise ValueError("overlap_steps must be 0 in mode='blocking'")
            if mode == "eager" and overlap_steps < 1:
                raise ValueError("overlap_steps must be >= 1 in mode='eager' (tau = 0 is 'blocking')")
            if sync_every_seconds is None and overlap_steps >= gap:
                raise ValueError(
                    f"overlap_steps ({overlap_steps}) must be smaller than the steps between rounds "
                    f"({gap} = sync_every / fragments)"
                )
        if not (isinstance(alpha, (int, float)) and 0.0 <= float(alpha) <= 1.0):
            raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
        if not (
            isinstance(samples_per_step, (int, float)) and math.isfinite(samples_per_step) and samples_per_step > 0
        ):
            raise ValueError(f"samples_per_step must be a finite number > 0, got {samples_per_step!r}")
        if sync_every_seconds is not None:
            if not (isinstance(sync_every_seconds, (int, float)) and sync_every_seconds > 0):
                raise ValueError(f"sync_every_seconds must be > 0, got {sync_every_seconds!r}")
            if tx.fragments > 1:
                raise ValueError("sync_every_seconds works with fragments=1 only")
        self.tx = tx
        self.swarm = swarm
        compress.tune_host_allocator()  # round buffers reused from the heap (see its docstring)
        self.mode = mode
        self.overlap_steps: int | str = overlap_steps if mode != "blocking" else 0
        self.max_overlap_steps = max_overlap_steps if auto else None
        # "auto": exchange times (boundary to result in) of the last rounds, and the clock of the
        # previous round start (perf_counter, step, total stall) for the inner-step time
        self._exchange_history: collections.deque[float] = collections.deque(maxlen=4)
        self._tau_clock: tuple[float, int, float] | None = None
        self._step_seconds: float | None = None
        # (swarm round, state digest) after the last merged round: sent with the next exchange
        self._last_state: tuple[int, str] | None = None
        self._state_digest: str | None = None
        self.alpha = float(alpha)
        self.error_feedback = bool(error_feedback)
        self.codec = codec if swarm is None else getattr(swarm, "codec", "fp32")
        self.codec_options = dict(codec_options or {})
        self.samples_per_step = float(samples_per_step)
        self.sync_every_seconds = sync_every_seconds
        self.on_round = on_round
        self._resync_fn = resync if resync is not None else getattr(swarm, "fetch_state", None)
        self._key = jax.random.key(seed)
        self._lossy = self.codec not in ("fp32",)

        self.step: int | None = None  # inner steps taken (== state.count), known after 1st call
        self.rounds_started = 0
        self.metrics: list[RoundMetrics] = []
        self.stall_seconds = 0.0
        self.failed_rounds = 0
        self.resyncs = 0
        self._pending: collections.deque[_Pending] = collections.deque()
        # per fragment: the error-feedback residual, a list of float32 leaves laid out like the
        # params (or a flat host vector restored from a checkpoint, cut into leaves at the next round)
        self._residual: dict[int, list | np.ndarray] = {}
        self._last_round_step: dict[int, int] = {}
        self._window_start = time.perf_counter()
        self._window_stall = 0.0
        self._round_clock = time.monotonic()
        self._first_step = 0
        # swarm round of logical exchange `seq` is base + (seq - seq_base), once known: a late
        # peer then fails fast instead of mixing an old pseudo-gradient into a later round
        self._swarm_base: tuple[int, int] | None = None
        # one worker: exchanges run one at a time, in the same order on every peer
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rj-sync")
        # serialises served states; downloads run on their own thread, so that a peer that
        # downloads while another downloads from it still serves (two peers resyncing from each
        # other each waited out the other's download before)
        self._state_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rj-state")
        self._fetch_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rj-fetch")
        self._lock = threading.Lock()
        self._state_request: list[concurrent.futures.Future] = []
        self._closed = False
        self._readied = False
        self._jit_cache: dict[tuple, Callable] = {}
        # this driver serves its own state to peers that join or resync (a multi-process peer
        # does not: its state lives on several hosts)
        self._serving = self._processes == 1 and callable(getattr(swarm, "serve_state", None))
        if self._serving:
            swarm.serve_state(self.request_state)

    # ------------------------------------------------------------------ jitted pieces
    def _fn(self, name: str, fragment: int, layout: tuple | None = None) -> Callable:
        """The jitted round function ``name`` for ``fragment`` and a params/state ``layout``
        (from :func:`_layout`; ``None`` on one device): on a mesh the merged params and state
        come back with exactly the shardings they had."""
        key = (name, fragment, layout)
        fn = self._jit_cache.get(key)
        if fn is not None:
            return fn
        tx = self.tx
        frag = None if tx.fragments == 1 else fragment
        codec, opts = self.codec, self.codec_options
        mesh = None if layout is None else layout[0]
        params_sh = state_sh = None
        if layout is not None:
            params_sh = jax.tree.unflatten(layout[1], list(layout[2]))
            state_sh = jax.tree.unflatten(layout[3], list(layout[4]))

        if name == "start":

            def encode(leaves, residual, key):
                return compress.device_encode(leaves, codec, key=key, residual=residual, **opts)

            def start(params, state, residual, key):
                # one packed leaf per pseudo-gradient leaf (blocks never straddle two leaves, so
                # every shard of a leaf encodes on its own device); the host concatenates them
                snap = tx.round_start(params, state, frag)
                leaves = list(jax.tree.leaves(snap.pseudo_gradient))
                packed, new_res = _encode_on_mesh(encode, mesh, leaves, residual, key)
                return snap, packed, new_res

            fn = jax.jit(start)
        elif name == "merge":
            keep = self.mode != "blocking"

            def merge(params, state, mean_leaves, snap, alpha):
                mean = jax.tree.unflatten(jax.tree.structure(snap.pseudo_gradient), list(mean_leaves))
                params, state = tx.round_merge(
                    params, state, mean, snap, fragment=frag, alpha=alpha, keep_local_progress=keep
                )
                return params, state, device_digest((state.global_params, state.outer_state))

            fn = jax.jit(merge) if layout is None else jax.jit(merge, out_shardings=(params_sh, state_sh, None))
        elif name == "speculate":

            def speculate(params, state, snap):
                spec = tx.outer_step(state, snap.pseudo_gradient, frag)
                g = (
                    spec.global_params
                    if frag is None
                    else [
                        jax.tree.leaves(spec.global_params)[i]
                        for i in tx.fragment_leaf_ids(fragment, len(jax.tree.leaves(params)))
                    ]
                )
                if frag is None:
                    new_params = jax.tree.map(lambda a, p: a.astype(p.dtype), g, params)
                else:
                    ids = tx.fragment_leaf_ids(fragment, len(jax.tree.leaves(params)))
                    leaves, treedef = jax.tree.flatten(params)
                    leaves = list(leaves)
                    for i, a in zip(ids, g):
                        leaves[i] = a.astype(leaves[i].dtype)
                    new_params = jax.tree.unflatten(treedef, leaves)
                # a separate buffer: the params may be donated by the next train step
                return new_params, jax.tree.map(lambda a: a + jnp.zeros_like(a), g)

            fn = jax.jit(speculate) if layout is None else jax.jit(speculate, out_shardings=(params_sh, None))
        else:  # pragma: no cover
            raise KeyError(name)
        self._jit_cache[key] = fn
        return fn

    # ------------------------------------------------------------------ public API
    def __call__(self, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        """Counts one inner step; starts, merges or waits for rounds when they are due.

        Args:
          params: the local params after this step's inner update.
          state: the :class:`DiLoCoState` after this step.

        Returns:
          ``(params, state)``, unchanged on most steps.

        With flax nnx, pass the model and its ``nnx.Optimizer(model, rj.diloco(...),
        wrt=nnx.Param)`` instead: ``sync(model, optimizer)`` updates both in place (and returns
        them); on steps with nothing due it only counts, as with pytrees.

        Raises:
          RuntimeError: called after :meth:`close`.
          TypeError: on the first call, when ``params`` and ``state.global_params`` differ in
            tree structure (for example ``nnx.state(model)`` next to an ``nnx.Optimizer``'s
            state: pass the model and the optimizer).
        """
        if self._closed:
            raise RuntimeError("OuterSync is closed")
        if _nnx.is_optimizer(state):
            return self._call_nnx(params, state)
        if self.step is None:
            if not isinstance(state, DiLoCoState):
                raise TypeError(
                    f"state must be the DiLoCoState of tx.init(params), got {type(state).__name__} (with flax "
                    "nnx: sync(model, optimizer) with the nnx.Optimizer itself)"
                )
            _check_plain(params, state)
            self.step = int(state.count) - 1  # one host read, on the first call only
            self._first_step = self.step
            self._round_clock = time.monotonic()
            self._mark_ready()
        elif not self._readied:
            self._mark_ready()
        self.step += 1
        step = self.step
        # merge what is due (oldest first), start what is due, merge what is due at once (tau=0)
        params, state = self._merge_due(params, state)
        for fragment in self._due(step):
            params, state = self._start(fragment, params, state)
        params, state = self._merge_due(params, state)
        # Serve a requested state only now, with no round in flight: the state of this step
        # after its round (if one was due) started and merged. Served before the round start,
        # the receiver would continue after this step and never start or merge that round.
        if self._state_request and not self._pending:
            self._serve_state(params, state)
        return params, state

    def _call_nnx(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        nxt = None if self.step is None else self.step + 1
        busy = (
            nxt is None
            or not self._readied
            or bool(self._state_request)
            or bool(self._pending and self._pending[0].due_step <= nxt)
            or (
                self.sync_every_seconds is not None
                and time.monotonic() - self._round_clock >= self.sync_every_seconds
                and not self._pending
            )
            or (self.sync_every_seconds is None and bool(self.tx.due_fragments(nxt)))
        )
        if not busy:  # most steps: count only, no tree walk
            self.step = nxt
            return model, optimizer
        params, state = _nnx.split(model, optimizer)
        params, state = self(params, state)
        _nnx.write_back(model, optimizer, params, state)
        return model, optimizer

    def _mark_ready(self) -> None:
        """The first step: tell the swarm this peer trains (ends a joiner's standby at once, so
        that the next round created includes it). Non-blocking."""
        self._readied = True
        ready = getattr(self.swarm, "ready", None)
        if ready is not None:
            try:
                ready()
            except RuntimeError:  # the swarm is not running: nothing to tell
                pass

    def _merge_due(self, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        while self._pending and self._pending[0].due_step <= self.step:
            params, state = self._finish(self._pending.popleft(), params, state)
        return params, state

    def warmup(self, params: Any, state: DiLoCoState) -> None:
        """Compiles the round functions ahead of time (they otherwise compile at the first round
        boundary, which would make this peer late for its first round). Runs nothing."""
        if _nnx.is_optimizer(state):
            params, state = _nnx.split(params, state)
        layout = _layout(params, state)
        for fragment in range(self.tx.fragments):
            like = self._ids(params, fragment)
            f32 = [
                jax.ShapeDtypeStruct(np.shape(x), jnp.float32, sharding=None if layout is None else x.sharding)
                for x in like
            ]
            residual = f32 if self.error_feedback and self._lossy else None
            key = jax.random.fold_in(self._key, 0)
            start = self._fn("start", fragment, layout)
            snap, _, _ = jax.eval_shape(start, params, state, residual, key)
            start.lower(params, state, residual, key).compile()
            self._fn("merge", fragment, layout).lower(params, state, f32, snap, self.alpha).compile()
            if self.mode == "eager":
                self._fn("speculate", fragment, layout).lower(params, state, snap).compile()

    def flush(self, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        """Waits for every round in flight and merges it now (for example before a checkpoint
        or at the end of training). Returns ``(params, state)`` (nnx: the model and optimizer,
        updated in place)."""
        if _nnx.is_optimizer(state):
            model, optimizer = params, state
            if self._pending:
                _nnx.write_back(model, optimizer, *self.flush(*_nnx.split(model, optimizer)))
            return model, optimizer
        while self._pending:
            params, state = self._finish(self._pending.popleft(), params, state)
        return params, state

    @property
    def global_state_digest(self) -> str | None:
        """Hex digest (32 characters) of ``(state.global_params, state.outer_state)`` after the
        last merged round: the value every live peer reports as ``RoundMetrics.state_digest``,
        computed inside the jitted merge (no extra device work or compilation). None before the
        first merge, and after ``load_state_dict`` or a state download until the next merge."""
        return self._state_digest

    @property
    def pending(self) -> int:
        """Rounds in flight (started, not merged)."""
        return len(self._pending)

    def summary(self) -> dict:
        """Totals so far: rounds, failures, resyncs, bytes, stall seconds, mean utilisation,
        mean overlap tau (steps). Means over no round are ``None`` (the dict is strict JSON)."""
        ok = [m for m in self.metrics if m.ok]
        return {
            "rounds": len(ok),
            "mean_overlap_steps": float(np.mean([m.overlap_steps for m in ok])) if ok else None,
            "failed_rounds": self.failed_rounds,
            "resyncs": self.resyncs,
            "bytes_sent": int(sum(m.bytes_sent for m in self.metrics)),
            "bytes_received": int(sum(m.bytes_received for m in self.metrics)),
            "stall_seconds": self.stall_seconds,
            "compute_utilisation": float(np.mean([m.compute_utilisation for m in ok])) if ok else None,
            "last_state_digest": ok[-1].state_digest if ok else "",
        }

    def state_dict(self, params: Any) -> dict:
        """The driver's own state for a checkpoint (a pytree of numpy values with a fixed
        structure for given params): the step, exchanges started, the swarm-round mapping and
        the error-feedback residual of every fragment (float32, zeros before its first round).

        Args:
          params: the params (only their shapes are read), or the nnx model.

        Raises:
          RuntimeError: rounds are in flight (call :meth:`flush` first, or save between rounds).
        """
        if isinstance(params, nnx.Module):
            params = nnx.as_pure(nnx.state(params, nnx.Param))
        if self._pending:
            raise RuntimeError("rounds are in flight: call flush(params, state) before state_dict()")
        residual = {}
        for f in range(self.tx.fragments):
            n = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in self._ids(params, f))
            r = self._residual.get(f)
            if r is None:
                residual[str(f)] = np.zeros((n,), np.float32)
            elif isinstance(r, list):  # per leaf, on the devices: one flat vector in leaf order
                host = jax.device_get(r)
                residual[str(f)] = (
                    np.concatenate([np.ravel(np.asarray(a, np.float32)) for a in host])
                    if host
                    else np.zeros((0,), np.float32)
                )
            else:
                residual[str(f)] = np.asarray(r, np.float32)
        base = self._swarm_base if self._swarm_base is not None else (-1, -1)
        return {
            "step": np.int64(-1 if self.step is None else self.step),
            "rounds_started": np.int64(self.rounds_started),
            "swarm_base": np.asarray(base, np.int64),
            "residual": residual,
        }

    def load_state_dict(self, d: dict, *, round_mapping: bool = True) -> None:
        """Restores what :meth:`state_dict` returned (for example from an ``rj.Checkpointer``).

        Args:
          d: the dict :meth:`state_dict` returned.
          round_mapping: keep the saved mapping from this driver's exchanges to the swarm's
            round numbers. Pass ``False`` when the whole swarm restarts from a common
            checkpoint (:func:`common_checkpoint_step`): the rendezvous may have numbered
            rounds on since, so the mapping is learned afresh from the first round, which every
            restarted peer enters together.
        """
        step = int(d["step"])
        self.step = None if step < 0 else step
        if self.step is not None:
            self._first_step = self.step
            self._last_round_step = {f: self.step for f in range(self.tx.fragments)}
        self.rounds_started = int(d["rounds_started"])
        base = [int(x) for x in np.asarray(d.get("swarm_base", (-1, -1))).reshape(-1)]
        self._swarm_base = (base[0], base[1]) if round_mapping and len(base) == 2 and base[0] >= 0 else None
        # flat host vectors; _start cuts them into leaves with the params' layouts
        self._residual = {
            int(f): np.asarray(r, np.float32) for f, r in d.get("residual", {}).items() if np.any(np.asarray(r))
        }
        self._pending.clear()
        self._last_state = None
        self._state_digest = None
        self._tau_clock = None

    def close(self) -> None:
        """Stops the background worker (rounds in flight are abandoned). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _report_summary(self.summary())
        for p in self._pending:
            p.future.cancel()
        self._pending.clear()
        for f in self._state_request:
            f.cancel()
        if self._serving:
            self.swarm.serve_state(None)  # the endpoint answers 404: requesters try another peer
        # an exchange in flight ends when the swarm closes (it cancels its rounds): do not wait
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._state_pool.shutdown(wait=False, cancel_futures=True)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> OuterSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state download
    def request_state(self) -> concurrent.futures.Future | None:
        """Asks for this peer's current global state as bytes (for a peer that joins or
        resyncs). Thread-safe; the future resolves after the next training step with no round in
        flight (also the first step of a driver that has not run yet). Used by the swarm's
        state endpoint. ``None`` once closed: the endpoint answers 404 at once, so that the
        requester tries another peer instead of waiting."""
        if self._closed:
            return None
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._state_request.append(fut)
        return fut

    def _serve_state(self, params: Any, state: DiLoCoState) -> None:
        with self._lock:
            requests, self._state_request = self._state_request, []
        if self._processes > 1:
            for r in requests:
                r.set_exception(RuntimeError("a peer over several processes does not serve its state"))
            return
        copy = jax.tree.map(
            lambda a: a + jnp.zeros_like(a) if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.number) else a,
            state,
        )
        # everything the message holds is taken now, in the training thread: the worker may run
        # after this peer started its next round (a rounds_started read there paired the state of
        # step s with the round counter of step s + 1, and the joiner contributed a pseudo-
        # gradient against a stale anchor to the wrong round)
        step, started, base = self.step, self.rounds_started, self._swarm_base

        def work():
            leaves = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(copy))]
            return serialization.msgpack_serialize(
                {
                    "format": "ravnest-state-v1",
                    "step": int(step),
                    "rounds_started": int(started),
                    "swarm_base": list(base) if base is not None else [],
                    "leaves": leaves,
                }
            )

        def done(f: concurrent.futures.Future) -> None:
            for r in requests:
                if r.done():  # cancelled by close(), or the requester gave up
                    continue
                try:
                    if f.cancelled() or f.exception() is not None:
                        r.set_exception(f.exception() if not f.cancelled() else RuntimeError("closed"))
                    else:
                        r.set_result(f.result())
                except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                    pass

        try:
            self._state_pool.submit(work).add_done_callback(done)
        except RuntimeError:  # closed meanwhile (close() runs on another thread)
            for r in requests:
                r.cancel()

    def load_state_bytes(self, data: bytes, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        """Replaces the local state with one downloaded from a peer (see :meth:`request_state`).

        The params restart from the downloaded global params; the inner optimizer state (with
        its schedule step), the outer state, the counters and this driver's step and round
        counters come from the peer. Error-feedback residuals restart at zero.

        With nnx, pass the model and optimizer: both are updated in place (and returned).

        Raises:
          ValueError: the bytes are not a state of this model and optimizer.
        """
        if _nnx.is_optimizer(state):
            model, optimizer = params, state
            params, state = self.load_state_bytes(data, *_nnx.split(model, optimizer))
            _nnx.write_back(model, optimizer, params, state, step=True)
            return model, optimizer
        like, treedef = jax.tree.flatten(state)
        try:
            d = serialization.msgpack_restore(data)
            if not isinstance(d, dict) or d.get("format") != "ravnest-state-v1":
                raise ValueError("not a ravnest state message")
            leaves = list(d["leaves"].values()) if isinstance(d["leaves"], dict) else list(d["leaves"])
            step, started = int(d["step"]), int(d["rounds_started"])
            base = d.get("swarm_base")
            base = list(base.values()) if isinstance(base, dict) else list(base or [])
            swarm_base = (int(base[0]), int(base[1])) if len(base) == 2 else None
        except Exception as e:  # noqa: BLE001 - reported as one clear error
            raise ValueError(f"downloaded state is malformed: {e}") from e
        if len(leaves) != len(like):
            raise ValueError(f"downloaded state has {len(leaves)} leaves, this model/optimizer has {len(like)}")
        for i, (a, b) in enumerate(zip(like, leaves)):
            if np.shape(a) != np.shape(b) or np.asarray(b).dtype != np.dtype(getattr(a, "dtype", np.asarray(a).dtype)):
                raise ValueError(
                    f"downloaded state leaf {i} is {np.asarray(b).dtype}{list(np.shape(b))}, "
                    f"expected {getattr(a, 'dtype', '?')}{list(np.shape(a))}: not this model/optimizer"
                )
        # each leaf goes back with the layout of the state it replaces (sharded peers stay sharded)
        new_state = jax.tree.unflatten(treedef, _put_like([np.asarray(b) for b in leaves], like))
        # a copy: params and the anchor must not share buffers (the train step may donate both)
        params = jax.tree.map(lambda g, p: jnp.array(g, dtype=p.dtype, copy=True), new_state.global_params, params)
        self.step, self.rounds_started = step, started
        self._swarm_base = swarm_base
        self._residual.clear()
        self._pending.clear()
        self._last_round_step = {f: step for f in range(self.tx.fragments)}
        self._round_clock = time.monotonic()
        self._last_state = None  # the next merged round's digest is the first one to compare
        self._state_digest = None
        self._tau_clock = None  # the step counter jumped
        del d, leaves
        compress.release_free_heap()  # the state's one-off host copies (see its docstring)
        return params, new_state

    # ------------------------------------------------------------------ rounds
    def _due(self, step: int) -> tuple[int, ...]:
        if self.sync_every_seconds is not None:
            if time.monotonic() - self._round_clock >= self.sync_every_seconds and not self._pending:
                self._round_clock = time.monotonic()
                return (0,)
            return ()
        return self.tx.due_fragments(step)

    def _start(self, fragment: int, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        seq = self.rounds_started
        self.rounds_started += 1
        residual = None
        layout = _layout(params, state)
        if self.error_feedback and self._lossy:
            like = self._ids(params, fragment)
            residual = self._residual.get(fragment)
            if residual is None:
                residual = _put_like([np.zeros(np.shape(x), np.float32) for x in like], like)
            elif not isinstance(residual, list):  # restored from a checkpoint: a flat host vector
                residual = _put_like(_split_host(np.asarray(residual, np.float32), like), like)
        key = jax.random.fold_in(self._key, seq)
        started = time.perf_counter()
        snap, packed, new_res = self._fn("start", fragment, layout)(params, state, residual, key)
        if new_res is not None:
            self._residual[fragment] = new_res
        if self._processes > 1:
            # a peer over several processes: the packed parts (compressed) to every host, here,
            # in the training thread (a collective: all processes issue it in the same order)
            packed = multihost_utils.process_allgather(packed, tiled=True)
        else:
            for leaf in jax.tree.leaves(packed):
                leaf.copy_to_host_async()
        steps_done = self.step - self._last_round_step.get(fragment, self._first_step)
        self._last_round_step[fragment] = self.step
        tau = self._choose_tau()
        weight = max(steps_done, 1) * self.samples_per_step
        expected = None if self._swarm_base is None else self._swarm_base[0] + (seq - self._swarm_base[1])
        if self.swarm is not None:
            future = self._pool.submit(self._exchange, packed, weight, expected, seq, self._last_state)
        else:  # not process 0 of a multi-process peer: the mean comes from process 0 at the merge
            future = concurrent.futures.Future()
            future.set_result(None)
        done_at: list = [None]
        future.add_done_callback(lambda _: done_at.__setitem__(0, time.perf_counter()))
        spec = None
        if self.mode == "eager":
            params, spec = self._fn("speculate", fragment, layout)(params, state, snap)
        pending = _Pending(
            seq=seq,
            fragment=fragment,
            step=self.step,
            due_step=self.step + tau,
            snapshot=snap,
            spec_params=spec,
            future=future,
            started=started,
            done_at=done_at,
        )
        self._pending.append(pending)
        return params, state

    def _choose_tau(self) -> int:
        """tau of the round starting now: the configured int, or with ``"auto"`` the inner steps
        that cover the recent exchanges (see the class docstring). Host-side arithmetic on a few
        floats, once per round."""
        if self.overlap_steps != "auto":
            return int(self.overlap_steps)
        now, step = time.perf_counter(), int(self.step)
        if self._tau_clock is not None:
            t0, s0, stall0 = self._tau_clock
            if step > s0:
                per_step = max(now - t0 - (self.stall_seconds - stall0), 0.0) / (step - s0)
                self._step_seconds = per_step if self._step_seconds is None else 0.5 * (self._step_seconds + per_step)
        self._tau_clock = (now, step, self.stall_seconds)
        cap = int(self.max_overlap_steps or 1)
        if not self._exchange_history or not self._step_seconds:
            return 1
        need = 1.25 * max(self._exchange_history) / max(self._step_seconds, 1e-6)
        return max(1, min(cap, math.ceil(need)))

    def _ids(self, params: Any, fragment: int) -> list:
        leaves = jax.tree.leaves(params)
        if self.tx.fragments == 1:
            return leaves
        return [leaves[i] for i in self.tx.fragment_leaf_ids(fragment, len(leaves))]

    def _exchange(
        self, packed: Any, weight: float, expected: int | None, seq: int, state: tuple[int, str] | None = None
    ) -> tuple[np.ndarray, Any, int, int, float]:
        """Background thread: device->host, bytes, all-reduce. Returns (mean, record, payload
        bytes, float32 bytes, seconds the result took)."""
        t0 = time.perf_counter()
        host = jax.device_get(packed)  # each device's slices of the packed parts, once
        # the message as buffers (no copy into one large bytes object) straight into the stream
        # decoder: this peer's own contribution decoded as every receiver decodes it
        chunks = compress.packed_to_chunks(host)  # raises NonFiniteError for a diverged peer
        dec = compress.StreamDecoder()
        for c in chunks:
            dec.feed(c)
        nbytes = dec.nbytes_received
        del chunks, host
        leaves = jax.tree.leaves(dec.finish())
        if len(leaves) == 1:  # one leaf: its flat view (fp32 leaves are views of the payload)
            vec = np.ravel(leaves[0])
        else:
            vec = np.concatenate([np.ravel(a) for a in leaves]) if leaves else np.zeros((0,), np.float32)
        del leaves
        kwargs: dict[str, Any] = {} if expected is None else {"round": expected}
        if state is not None:  # the rendezvous compares it with the other peers' (divergence)
            kwargs["state"] = state
        fut = self.swarm.all_reduce_async({"pg": vec}, weight=weight, **kwargs)
        try:
            mean, record = fut.result()
        except Exception as e:
            r = getattr(getattr(e, "record", None), "round", -1)
            if self._swarm_base is None and r is not None and r >= 0:
                self._swarm_base = (r, seq)
            raise
        if self._swarm_base is None and getattr(record, "round", -1) >= 0:
            self._swarm_base = (int(record.round), seq)
        return np.asarray(mean["pg"], np.float32), record, nbytes, 4 * vec.size, time.perf_counter() - t0

    def _finish(self, p: _Pending, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        t0 = time.perf_counter()
        error = None
        exc: BaseException | None = None
        try:
            result = p.future.result()
            mean, record, payload_bytes, float_bytes = (None, None, 0, 0) if result is None else result[:4]
        except Exception as e:  # noqa: BLE001 - a failed round is reported, then resynced
            exc = e
            error = f"{type(e).__name__}: {e}"
            mean = record = None
            payload_bytes = float_bytes = 0
        if self._processes > 1:
            mean, error = self._share_result(p, mean, error)
        stall = time.perf_counter() - t0
        self.stall_seconds += stall
        self._window_stall += stall
        now = time.perf_counter()
        wall = max(now - self._window_start, 1e-9)
        utilisation = max(0.0, 1.0 - self._window_stall / wall)
        self._window_start, self._window_stall = now, 0.0
        exchange_seconds = (p.done_at[0] or now) - p.started
        if error is None and record is not None:
            self._exchange_history.append(exchange_seconds)
        if error is None:
            snap = p.snapshot if p.spec_params is None else p.snapshot._replace(params=p.spec_params)
            like = jax.tree.leaves(p.snapshot.pseudo_gradient)
            mean_leaves = _put_like(_split_host(mean, like), like)  # the same layout as the params
            params, state, digest = self._fn("merge", p.fragment, _layout(params, state))(
                params, state, mean_leaves, snap, self.alpha
            )
            m = RoundMetrics(
                round=p.seq,
                fragment=p.fragment,
                step=p.step,
                merged_at_step=self.step,
                ok=True,
                swarm_round=int(getattr(record, "round", -1)),
                group_size=len(getattr(record, "contributors", ()) or ()),
                bytes_sent=int(getattr(record, "bytes_sent", 0)),
                bytes_received=int(getattr(record, "bytes_received", 0)),
                payload_bytes=payload_bytes,
                codec_ratio=payload_bytes / max(float_bytes, 1),
                exchange_seconds=exchange_seconds,
                stall_seconds=stall,
                compute_utilisation=utilisation,
                result_digest=str(getattr(record, "digest", "")),
                state_digest=digest_hex(digest),
                overlap_steps=self.step - p.step,
            )
            self._state_digest = m.state_digest
            if m.swarm_round >= 0:
                self._last_state = (m.swarm_round, m.state_digest)
        else:
            self.failed_rounds += 1
            log.warning("round %d (fragment %d) failed on this peer: %s", p.seq, p.fragment, error)
            m = RoundMetrics(
                round=p.seq,
                fragment=p.fragment,
                step=p.step,
                merged_at_step=self.step,
                ok=False,
                swarm_round=-1,
                group_size=0,
                bytes_sent=0,
                bytes_received=0,
                payload_bytes=0,
                codec_ratio=math.nan,
                exchange_seconds=exchange_seconds,
                stall_seconds=stall,
                compute_utilisation=utilisation,
                result_digest="",
                state_digest="",
                error=error,
                overlap_steps=self.step - p.step,
            )
            params, state = self._after_failure(p, exc, params, state)
        self.metrics.append(m)
        if self.on_round is not None:
            self.on_round(m)
        return params, state

    def _share_result(
        self, p: _Pending, mean: np.ndarray | None, error: str | None
    ) -> tuple[np.ndarray | None, str | None]:
        """A peer over several processes: process 0 tells the others whether the round worked
        and sends them the mean (two broadcasts, in the training thread of every process)."""
        ok = multihost_utils.broadcast_one_to_all(np.asarray([error is None], np.int32))
        if not int(np.asarray(ok).reshape(-1)[0]):
            return None, error or "the round failed on process 0 of this peer"
        n = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in jax.tree.leaves(p.snapshot.pseudo_gradient))
        buf = mean if self._leader else np.zeros((n,), np.float32)
        return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(buf, np.float32)), np.float32), None

    def _after_failure(
        self, p: _Pending, exc: BaseException | None, params: Any, state: DiLoCoState
    ) -> tuple[Any, DiLoCoState]:
        """A round failed here. If the other peers applied it (or this peer diverged), download
        the current state from a live peer, serving this peer's own state meanwhile so that
        peers waiting on each other never deadlock. Without a live peer, carry on alone: a
        delayed round is simply skipped (the next pseudo-gradient covers its steps); an eager
        round, whose speculative anchor the params already stand on, is applied with the local
        pseudo-gradient (a swarm of one)."""
        data = None
        record = getattr(exc, "record", None)
        if record is not None and 0.0 < getattr(record, "total_weight", 0.0) < 1e-20:
            # Every member of the round missed its own expected round (each abstained): no peer
            # is ahead to download from, and downloading from each other only swaps the states
            # (two peers restarted from stale checkpoints did so forever). Learn the round
            # mapping anew instead; if the states differ, the state digests of the next round
            # name the minority, which then resyncs from the majority.
            log.warning("round %d: every member missed it; the round mapping is learned anew", p.seq)
            self._swarm_base = None
            self._last_state = None
        elif self._resync_fn is not None and self._processes == 1 and self._needs_resync(exc):
            fetch = self._fetch_pool.submit(self._resync_fn)
            deadline = time.monotonic() + 300.0
            while not fetch.done() and time.monotonic() < deadline:
                if self._state_request:
                    self._serve_state(params, state)
                time.sleep(0.02)
            try:
                data = fetch.result(timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as e:  # noqa: BLE001 - no live peer: keep training alone
                log.warning("resync failed: %s; continuing with the local state", e)
            else:
                if data is None and self._swarm_base is not None:
                    # no other live peer: nobody to be inconsistent with. The rendezvous may
                    # number rounds past this peer's saved mapping (a peer resumed alone from a
                    # checkpoint); learn the mapping afresh instead of missing every round
                    log.info("no live peer to resync from: the round mapping is learned anew")
                    self._swarm_base = None
        if data:
            params, state = self.load_state_bytes(data, params, state)
            self.resyncs += 1
            log.info("resynced from a live peer at step %d", self.step)
            return params, state
        if p.spec_params is not None:
            snap = p.snapshot._replace(params=p.spec_params)
            own = list(jax.tree.leaves(p.snapshot.pseudo_gradient))
            params, state, _ = self._fn("merge", p.fragment, _layout(params, state))(
                params, state, own, snap, self.alpha
            )
        return params, state

    def _needs_resync(self, exc: BaseException | None) -> bool:
        """False only when the rendezvous says the round failed for everyone."""
        if isinstance(exc, compress.NonFiniteError):
            return True  # this peer diverged
        record = getattr(exc, "record", None)
        outcome = getattr(self.swarm, "round_outcome", None)
        if record is None or outcome is None or getattr(record, "round", -1) < 0:
            return True
        try:
            return outcome(record.round) != "failed"
        except Exception:  # noqa: BLE001 - rendezvous unreachable: try to resync
            return True
