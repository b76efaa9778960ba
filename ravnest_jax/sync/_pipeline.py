"""The rounds in flight of one :class:`~ravnest_jax.sync.OuterSync`: started at a boundary, run
beside training, waited for and merged when due; and where their arrays lie.

A round start is one jitted call (the pseudo-gradient, encoded on the device with error
feedback: :class:`RoundFunctions`, the DiLoCo math of :class:`~ravnest_jax.optim.DiLoCo` with the
device-side encode and the state digest, compiled once per fragment and layout) and a
non-blocking device-to-host copy; the exchange
(:func:`exchange`) runs on one worker thread (rounds in the same order on every peer): the
encoded pseudo-gradient to the host, into the swarm's all-reduce, and the mean back; the merge
(:meth:`RoundPipeline.finish`) is one jitted call. The training thread never waits here unless a
result is due and not in yet. The layout helpers (:func:`layout_of`, :func:`put_like`) keep each
array on the devices and with the sharding it had.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ravnest_jax import compress
from ravnest_jax.compress import Codec, message_nbytes
from ravnest_jax.optim import DiLoCo, RoundSnapshot
from ravnest_jax.swarm import RoundFailed

from ._digest import CHUNK, device_digest, digest_hex
from ._schedule import Plan

log = logging.getLogger("ravnest_jax.sync")


def mesh_of(tree: Any) -> Mesh | None:
    """The device mesh of the first leaf laid out over more than one device, else ``None``."""
    for x in jax.tree.leaves(tree):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.size > 1:
            return s.mesh
    return None


def layout_of(params: Any, state: Any) -> tuple | None:
    """A hashable description of how ``params`` and ``state`` lie on their mesh: ``(mesh,
    params treedef, params shardings, state treedef, state shardings)``, with ``None`` for a leaf
    that is not on that mesh (the compiler chooses); ``None`` when the params are on one device."""
    mesh = mesh_of(params)
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


def split_host(vec: np.ndarray, like: list) -> list[np.ndarray]:
    """A flat host vector cut into arrays shaped like ``like`` (views, C order)."""
    out, off = [], 0
    for x in like:
        n = int(np.prod(np.shape(x), dtype=np.int64))
        out.append(vec[off : off + n].reshape(np.shape(x)))
        off += n
    return out


def put_like(arrays: list, like: list) -> list:
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


#: jitted round functions shared by the drivers of one ``tx`` in a process (peers in threads of
#: one test, a driver rebuilt after a restart): the same function object, so jax traces and
#: compiles it once; the oldest entries go beyond _SHARED_MAX
_SHARED: dict[tuple, Callable] = {}
_SHARED_LOCK = threading.Lock()
_SHARED_MAX = 64


def _spread(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Dim 0 spread over every device of ``mesh`` when it divides evenly, else replicated."""
    if shape and shape[0] % mesh.size == 0:
        return NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return NamedSharding(mesh, P())


def encode_on_mesh(encode: Callable, mesh: Mesh | None, leaves: list, residual: Any, key: Any) -> tuple[Any, Any]:
    """``encode(leaves, residual, key)`` (a ``device_encode``) inside jit, for leaves laid out on
    ``mesh``: every device encodes the blocks of its own shards (XLA's partitioner) and the
    packed parts come out spread over the devices, so that the device-to-host copy takes one
    slice from each device and no device gathers the pseudo-gradient. (On a mesh with explicit
    axes ``device_encode`` lays its outputs out the same way itself.)"""
    if mesh is None or mesh.explicit_axes:
        return encode(leaves, residual, key)
    packed, new_res = encode(leaves, residual, key)
    return jax.lax.with_sharding_constraint(packed, jax.tree.map(lambda a: _spread(mesh, a.shape), packed)), new_res


class RoundFunctions:
    """Builds and caches the jitted round functions of one ``tx`` and codec.

    Every function is keyed by ``(kind, fragment, layout)``, with ``layout`` from
    :func:`~ravnest_jax.sync._pipeline.layout_of` (``None`` on one device); on a mesh the merged
    params and state come back with exactly the shardings they had.

    Args:
      tx: the :func:`rj.diloco` transformation.
      codec, codec_options: the device-side encode of the pseudo-gradient.
      keep_local_progress: the merge keeps the local progress since the boundary (every mode
        but ``"blocking"``).
      error_feedback_decay: beta: the residual carried into a round is ``beta * residual``.
      donate: the merge donates the params and the state it is given (their buffers hold the
        merged ones; the arrays passed in are deleted).
    """

    def __init__(
        self,
        tx: DiLoCo,
        codec: str,
        codec_options: dict,
        keep_local_progress: bool,
        error_feedback_decay: float = 1.0,
        donate: bool = False,
    ):
        self.tx, self.codec, self.codec_options = tx, codec, dict(codec_options)
        self.keep_local_progress = keep_local_progress
        self.error_feedback_decay = float(error_feedback_decay)
        self.donate = bool(donate)
        self.cache: dict[tuple, Callable] = {}  # (kind, fragment, layout) -> jitted function

    def frag(self, fragment: int) -> int | None:
        """The fragment as ``tx``'s round functions take it: ``None`` without fragments."""
        return None if self.tx.fragments == 1 else fragment

    @staticmethod
    def _shardings(layout: tuple | None) -> tuple[Any, Any]:
        if layout is None:
            return None, None
        return jax.tree.unflatten(layout[1], list(layout[2])), jax.tree.unflatten(layout[3], list(layout[4]))

    def _cached(self, kind: str, fragment: int, layout: tuple | None, build: Callable[[], Callable]) -> Callable:
        key = (kind, fragment, layout)
        fn = self.cache.get(key)
        if fn is None:
            shared = (self.tx, self.codec, tuple(sorted(self.codec_options.items())), self.keep_local_progress,
                      self.error_feedback_decay, self.donate, key)  # fmt: skip
            with _SHARED_LOCK:
                fn = _SHARED.get(shared)
                if fn is None:
                    fn = _SHARED[shared] = build()
                    while len(_SHARED) > _SHARED_MAX:
                        _SHARED.pop(next(iter(_SHARED)))
            self.cache[key] = fn
        return fn

    def start(self, fragment: int, layout: tuple | None) -> Callable:
        """``start(params, state, residual, key) -> (snapshot, packed, new_residual)``: the
        round's :class:`RoundSnapshot` and its pseudo-gradient encoded on the device (one packed
        leaf per pseudo-gradient leaf: blocks never straddle two leaves, so every shard of a leaf
        encodes on its own device), with error feedback when ``residual`` is given."""
        tx, frag, codec, opts = self.tx, self.frag(fragment), self.codec, self.codec_options
        mesh = None if layout is None else layout[0]
        beta = self.error_feedback_decay

        def build() -> Callable:
            def encode(leaves, residual, key):
                if residual is not None and beta != 1.0:
                    residual = [beta * r for r in residual]
                return compress.device_encode(leaves, codec, key=key, residual=residual, **opts)

            def start(params, state, residual, key):
                snap = tx.round_start(params, state, frag)
                leaves = list(jax.tree.leaves(snap.pseudo_gradient))
                packed, new_res = encode_on_mesh(encode, mesh, leaves, residual, key)
                return snap, packed, new_res

            return jax.jit(start)

        return self._cached("start", fragment, layout, build)

    def merge(self, fragment: int, layout: tuple | None) -> Callable:
        """``merge(params, state, mean_leaves, snapshot, alpha) -> (params, state, digest)``:
        ``tx.round_merge`` with the mean (a list of float32 leaves like the snapshot's
        pseudo-gradient) and the device digest of ``(global_params, outer_state)`` after it."""
        tx, frag, keep = self.tx, self.frag(fragment), self.keep_local_progress
        params_sh, state_sh = self._shardings(layout)
        donate = (0, 1) if self.donate else ()

        def build() -> Callable:
            def merge(params, state, mean_leaves, snap, alpha):
                mean = jax.tree.unflatten(jax.tree.structure(snap.pseudo_gradient), list(mean_leaves))
                params, state = tx.round_merge(
                    params, state, mean, snap, fragment=frag, alpha=alpha, keep_local_progress=keep
                )
                # on a mesh each leaf at once: a chunk's slice of a sharded leaf would gather it
                chunk = CHUNK if layout is None else 0
                return params, state, device_digest((state.global_params, state.outer_state), chunk=chunk)

            if layout is None:
                return jax.jit(merge, donate_argnums=donate)
            return jax.jit(merge, out_shardings=(params_sh, state_sh, None), donate_argnums=donate)

        return self._cached("merge", fragment, layout, build)

    def speculate(self, fragment: int, layout: tuple | None) -> Callable:
        """``speculate(params, state, snapshot) -> (params, anchor)``: ``tx.speculate`` (eager
        updates, arXiv 2502.12996)."""
        tx, frag = self.tx, self.frag(fragment)
        params_sh, _ = self._shardings(layout)

        def build() -> Callable:
            def speculate(params, state, snap):
                return tx.speculate(params, state, snap, frag)

            return jax.jit(speculate) if layout is None else jax.jit(speculate, out_shardings=(params_sh, None))

        return self._cached("speculate", fragment, layout, build)


def exchange(
    swarm: Any,
    packed: Any,
    weight: float,
    expected: int | None,
    state: tuple[int, str] | None,
    learn_round: Callable[[int, bool], None],
    *,
    fresh: bool = False,
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
      fresh: this driver's first exchange, with no round mapping (a peer that starts from its
        own initial state): first asks the rendezvous whether rounds were committed without it
        (:func:`rounds_without`), one request.

    Returns:
      ``(mean, record, payload_bytes, float32_bytes, seconds)``: the mean as float32 ``(n,)``,
      the swarm's ``RoundRecord``, this peer's encoded bytes, its float32 bytes, and the wall
      seconds from when the contribution was on the host until the mean was.

    Raises:
      compress.NonFiniteError: the pseudo-gradient holds NaN or infinity (this peer diverged).
      RoundFailed: the round failed on this peer.
      LateStart: ``fresh``, and the swarm committed rounds without this peer (it is behind).
    """
    if fresh and (late := rounds_without(swarm)):
        raise LateStart(
            f"round(s) {late[0]}..{late[-1]} of this run were committed without this peer before its first "
            "round (it started from its own initial state while no peer had trained yet, then took longer "
            "to start): its state is behind the swarm's; downloading the swarm's state"
        )
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
    # encode once: the device's message goes on the wire as it is, cut into parts; the rendezvous
    # compares the state with the other peers' (divergence)
    fut = swarm.all_reduce_packed_async(host, weight=weight, round=expected, state=state)
    del host
    try:
        mean, record = fut.result()
    except RoundFailed as e:  # the swarm round it ran as
        learn_round(int(e.record.round), False)
        raise
    learn_round(int(record.round), True)
    return np.asarray(mean, np.float32).reshape(-1), record, nbytes, 4 * n, time.perf_counter() - t0


class LateStart(RuntimeError):
    """A peer that started from its own initial state found, at its first round, rounds of the
    run committed without it (two fresh peers started together, and one took longer to compile):
    contributing against its initial anchor would split the swarm's state, so its first round
    fails and it downloads the swarm's state (``sync/_recovery.py``), as a joiner does. The
    message names the swarm rounds committed without it."""


def rounds_without(swarm: Any) -> list[int]:
    """The rounds the rendezvous reports committed (``ok``) without this peer among their
    contributors, ascending; ``[]`` when it cannot be asked (the round itself then tells)."""
    try:
        rounds = swarm.status().get("rounds", [])
    except Exception as e:  # noqa: BLE001 - a check that only spares a split state
        log.info("could not ask the rendezvous for its rounds: %r", e)
        return []
    me = swarm.peer_id
    return sorted(int(r["round"]) for r in rounds if r.get("outcome") == "ok" and me not in r.get("contributors", ()))


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


@dataclasses.dataclass
class Pending:
    """A round in flight.

    Attributes:
      seq: this driver's exchange number.
      fragment: the fragment it synchronises.
      step: the inner step of its boundary.
      due_step: the inner step it merges at (``step + tau``).
      snapshot: the round's :class:`RoundSnapshot`.
      spec_params: eager mode: the speculative anchor the params restarted from, else ``None``.
      future: the exchange's future (``None`` result on processes other than 0).
      started: ``time.perf_counter()`` at the boundary (seconds).
      done_at: ``time.perf_counter()`` when the result was in, set by the future's callback.
    """

    seq: int
    fragment: int
    step: int
    due_step: int
    snapshot: RoundSnapshot
    spec_params: Any
    future: concurrent.futures.Future
    started: float
    done_at: float | None = None


@dataclasses.dataclass
class Outcome:
    """What a round produced on this peer (:meth:`RoundPipeline.finish`).

    Attributes:
      mean: the averaged pseudo-gradient, float32 ``(n,)``, or ``None`` when the round failed.
      record: the swarm's ``RoundRecord`` (``None`` when failed, or not process 0).
      payload_bytes, float_bytes: this peer's encoded and float32 sizes (bytes).
      error: why the round failed (one line), else ``None``; ``exc`` the exception.
      stall_seconds: how long the device sat idle waiting for the result: the wait after the
        steps already dispatched had run (while they run, the accelerator is busy, not waiting).
      exchange_seconds: from when this peer's contribution reached the host (the device had
        run the boundary step and the encode) until the result was in.
    """

    mean: np.ndarray | None
    record: Any
    payload_bytes: int
    float_bytes: int
    error: str | None
    exc: BaseException | None
    stall_seconds: float
    exchange_seconds: float


class RoundPipeline:
    """Starts, waits for and merges rounds (see the module docstring).

    Args:
      tx: the :func:`rj.diloco` transformation.
      swarm: the exchange (``None`` on the processes other than 0 of a multi-process peer).
      fns: the jitted round functions.
      codec: the run's ``rj.Codec``: with ``error_feedback``, the codec's residual is carried
        into the fragment's next round (lossy codecs); ``seed``, the PRNG seed of stochastic
        rounding (folded with the exchange number).
      alpha: mixing weight of the merge.
      eager: eager rounds (the params restart from the speculative anchor at the boundary).
    """

    def __init__(self, tx: DiLoCo, swarm: Any, fns: RoundFunctions, codec: Codec, *, alpha: float, eager: bool):
        self.tx, self.swarm, self.fns = tx, swarm, fns
        self.alpha, self.eager = alpha, eager
        self.error_feedback = codec.error_feedback and fns.codec != "fp32"
        self._key = jax.random.key(codec.seed)
        self._processes = jax.process_count()
        self._leader = jax.process_index() == 0
        self.pending: collections.deque[Pending] = collections.deque()
        # per fragment: the error-feedback residual, a list of float32 leaves laid out like the
        # params (or a flat host vector restored from a checkpoint, cut into leaves at the next round)
        self.residual: dict[int, list | np.ndarray] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rj-sync")

    def compile(self, params: Any, state: Any) -> None:
        """Compiles every round function for these params and state (runs nothing)."""
        layout = layout_of(params, state)
        for fragment in range(self.tx.fragments):
            like = self.tx.fragment_leaves(params, self.fns.frag(fragment))
            f32 = [
                jax.ShapeDtypeStruct(np.shape(x), np.float32, sharding=None if layout is None else x.sharding)
                for x in like
            ]
            residual = f32 if self.error_feedback else None
            key = jax.random.fold_in(self._key, 0)
            start = self.fns.start(fragment, layout)
            snap, _, _ = jax.eval_shape(start, params, state, residual, key)
            start.lower(params, state, residual, key).compile()
            self.fns.merge(fragment, layout).lower(params, state, f32, snap, self.alpha).compile()
            if self.eager:
                self.fns.speculate(fragment, layout).lower(params, state, snap).compile()

    def _residual_for(self, fragment: int, params: Any) -> list | None:
        if not self.error_feedback:
            return None
        like = self.tx.fragment_leaves(params, self.fns.frag(fragment))
        residual = self.residual.get(fragment)
        if residual is None:
            return put_like([np.zeros(np.shape(x), np.float32) for x in like], like)
        if not isinstance(residual, list):  # restored from a checkpoint: a flat host vector
            return put_like(split_host(np.asarray(residual, np.float32), like), like)
        return residual

    def start(
        self, fragment: int, params: Any, state: Any, step: int, plan: Plan, last_state: tuple[int, str] | None
    ) -> Any:
        """Starts round ``plan.seq`` of ``fragment`` at inner step ``step``, merging at ``step +
        plan.tau``, with ``plan.weight`` (its swarm round ``plan.expected`` when known);
        ``last_state``: ``(swarm round, state digest)`` for the divergence check. Returns the
        params (eager mode: restarted from the speculative anchor; else unchanged).
        """
        layout = layout_of(params, state)
        key = jax.random.fold_in(self._key, plan.seq)
        started = time.perf_counter()
        snap, packed, new_res = self.fns.start(fragment, layout)(
            params, state, self._residual_for(fragment, params), key
        )
        if new_res is not None:
            self.residual[fragment] = new_res
        if self._processes > 1:
            # a peer over several processes: the packed parts (compressed) to every host, here,
            # in the training thread (a collective: all processes issue it in the same order)
            packed = multihost_utils.process_allgather(packed, tiled=True)
        else:
            for leaf in jax.tree.leaves(packed):
                leaf.copy_to_host_async()
        if self.swarm is not None:
            # the first exchange of a peer that started from its own initial state: behind a swarm
            # that committed rounds without it? (a peer over several processes cannot download)
            fresh = plan.seq == 0 and plan.expected is None and self._processes == 1
            future = self._pool.submit(
                exchange, self.swarm, packed, plan.weight, plan.expected, last_state, plan.learn_round, fresh=fresh
            )
        else:  # not process 0 of a multi-process peer: the mean comes from process 0 at the merge
            future = concurrent.futures.Future()
            future.set_result(None)
        p = Pending(plan.seq, fragment, step, step + plan.tau, snap, None, future, started)
        future.add_done_callback(lambda _: setattr(p, "done_at", time.perf_counter()))
        if self.eager:
            params, p.spec_params = self.fns.speculate(fragment, layout)(params, state, snap)
        self.pending.append(p)
        return params

    def finish(self, p: Pending, params: Any, state: Any) -> tuple[Outcome, Any, Any, str | None]:
        """Waits for round ``p`` and, when it worked, merges its mean (:meth:`merge`): the mean
        goes from the exchange into the jitted merge without leaving this pipeline.

        ``params``: outputs of the last step dispatched; the stall counts from when the device
        has run it (:func:`idle_since`), not from when the host, ahead of the device by the steps
        it queued, began to wait. Returns ``(outcome, params, state, state digest hex)``; a failed
        round (``outcome.error``) returns ``params`` and ``state`` unchanged and digest ``None``.
        """
        out = self._wait(p, params)
        if out.error is not None:
            return out, params, state, None
        params, state, digest = self.merge(p, params, state, out.mean)
        return out, params, state, digest

    def _wait(self, p: Pending, live: Any) -> Outcome:
        """Blocks until round ``p``'s exchange is over (a peer over several processes: shares
        process 0's outcome with the others); ``live``: see :meth:`finish`."""
        t0 = idle_since(p.future, live)
        mean = record = exc = error = exchange_seconds = None
        payload_bytes = float_bytes = 0
        try:
            if (result := p.future.result()) is not None:
                mean, record, payload_bytes, float_bytes, exchange_seconds = result
        except Exception as e:  # noqa: BLE001 - a failed round is reported, then resynced
            exc, error = e, f"{type(e).__name__}: {e}"
        if self._processes > 1:
            mean, error = share_result(self._leader, p.snapshot.pseudo_gradient, mean, error)
        now = time.perf_counter()
        if exchange_seconds is None:  # failed, or not process 0: from the boundary
            exchange_seconds = (p.done_at or now) - p.started
        return Outcome(mean, record, payload_bytes, float_bytes, error, exc, now - min(t0, now), exchange_seconds)

    def merge(self, p: Pending, params: Any, state: Any, mean: np.ndarray | None) -> tuple[Any, Any, str]:
        """Merges round ``p`` with ``mean`` (float32 ``(n,)``); ``mean=None``: with this peer's own
        pseudo-gradient (an eager round that found no live peer: a swarm of one). Returns
        ``(params, state, state digest hex)``."""
        snap = p.snapshot if p.spec_params is None else p.snapshot._replace(params=p.spec_params)
        like = jax.tree.leaves(p.snapshot.pseudo_gradient)
        # the same layout as the params
        mean_leaves = list(like) if mean is None else put_like(split_host(mean, like), like)
        params, state, digest = self.fns.merge(p.fragment, layout_of(params, state))(
            params, state, mean_leaves, snap, self.alpha
        )
        return params, state, digest_hex(digest)

    def residual_state(self, params: Any) -> dict[str, np.ndarray]:
        """Every fragment's residual as one flat float32 host vector in leaf order (zeros before
        its first round), by fragment number as a str: the checkpoint's ``residual``."""
        out = {}
        for f in range(self.tx.fragments):
            r = self.residual.get(f)
            if r is None:
                like = self.tx.fragment_leaves(params, self.fns.frag(f))
                r = np.zeros((sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in like),), np.float32)
            elif isinstance(r, list):  # per leaf, on the devices
                r = np.concatenate([np.ravel(a) for a in jax.device_get(r)] or [np.zeros((0,), np.float32)])
            out[str(f)] = np.asarray(r, np.float32)
        return out

    def load_residual(self, residual: dict) -> None:
        """Restores :meth:`residual_state`'s dict (flat host vectors, cut into leaves at the next
        round); all-zero ones are dropped."""
        self.residual = {int(f): np.asarray(r, np.float32) for f, r in residual.items() if np.any(np.asarray(r))}

    def close(self) -> None:
        """Abandons the rounds in flight (the swarm cancels an exchange when it closes)."""
        for p in self.pending:
            p.future.cancel()
        self.pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


def idle_since(future: concurrent.futures.Future, live: Any, poll: float = 0.002) -> float:
    """``time.perf_counter()`` from which the device waits for ``future``: when it has run the
    step that produced ``live`` (the host dispatches steps ahead of the device, which runs them
    meanwhile), or ``inf`` when ``future`` finished first (the device never waited). Polls every
    ``poll`` seconds while both are pending; arrays without ``is_ready`` count as ready."""
    leaves = [x for x in jax.tree.leaves(live) if hasattr(x, "is_ready")]
    while not future.done():
        if all(x.is_ready() for x in leaves[-1:]):  # one call's outputs are ready together
            return time.perf_counter()
        concurrent.futures.wait([future], timeout=poll)
    return float("inf")
