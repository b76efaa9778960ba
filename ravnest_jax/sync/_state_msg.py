"""The global state a peer serves to one that joins or resyncs: the message (msgpack of the
state's leaves and the driver's counters) and the server side that snapshots it between rounds
and serialises it beside training."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
from flax import serialization

from ravnest_jax import host_memory
from ravnest_jax.optim import DiLoCoState

from . import _nnx
from ._pipeline import put_like

FORMAT = "ravnest-state-v1"
log = logging.getLogger("ravnest_jax.sync")


def decode_state(data: bytes, like: list) -> tuple[list[np.ndarray], int, int, tuple[int, int] | None]:
    """Decodes and checks a state message against ``like`` (the leaves of this peer's state).

    Returns:
      ``(leaves, step, rounds_started, swarm_base)``: the state's leaves as host numpy arrays,
      in ``jax.tree.leaves`` order; the sender's inner step and exchanges started; ``(swarm
      round, exchange)`` of its round mapping, or ``None``.

    Raises:
      ValueError: not a state message, or one of another model/optimizer (leaf count, a leaf's
        shape or dtype differ), with one line naming the first difference.
    """
    try:
        d = serialization.msgpack_restore(data)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError("not a ravnest state message")
        leaves, base = list(d["leaves"]), list(d["swarm_base"])
        step, started = int(d["step"]), int(d["rounds_started"])
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
    return [np.asarray(b) for b in leaves], step, started, swarm_base


def peek_counters(data: bytes) -> tuple[int, int] | None:
    """``(step, rounds_started)`` of a state message, read from its head without decoding the
    leaves (they come last); ``None`` when the bytes are not a state message."""
    try:
        u = msgpack.Unpacker(io.BytesIO(data), raw=False)
        found: dict[str, int] = {}
        for _ in range(u.read_map_header()):
            key = u.unpack()
            if key in ("step", "rounds_started"):
                found[key] = int(u.unpack())
                if len(found) == 2:
                    return found["step"], found["rounds_started"]
            else:
                u.skip()
    except Exception:  # noqa: BLE001 - not ours: the full decode reports it
        return None
    return None


class StateServer:
    """Answers state requests of other peers (through ``Swarm.serve_state``) with this peer's
    state at a step with no round in flight.

    :meth:`request` (any thread) queues a request; the training thread calls :meth:`serve` at
    such a step: it copies the state on the device and takes the counters now, and a worker
    thread serialises it (the training loop does not wait for the device-to-host copy).
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rj-state")
        self._fetch_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rj-fetch")
        self._lock = threading.Lock()
        self._requests: list[concurrent.futures.Future] = []
        self.closed = False

    @property
    def wanted(self) -> bool:
        """A request is waiting."""
        return bool(self._requests)

    def request(self) -> concurrent.futures.Future | None:
        """A future of the state bytes; ``None`` once closed (the endpoint answers 404 at once)."""
        if self.closed:
            return None
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._requests.append(fut)
        return fut

    def serve(self, state: Any, step: int, rounds_started: int, swarm_base: tuple[int, int] | None) -> None:
        """Answers every waiting request with ``state`` and the driver's counters of this step."""
        with self._lock:
            requests, self._requests = self._requests, []
        copy = jax.tree.map(
            lambda a: a + jnp.zeros_like(a) if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.number) else a,
            state,
        )

        def work() -> bytes:
            leaves = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(copy))]
            return serialization.msgpack_serialize(
                {
                    "format": FORMAT,
                    "step": int(step),
                    "rounds_started": int(rounds_started),
                    "swarm_base": list(swarm_base) if swarm_base is not None else [],
                    "leaves": leaves,
                }
            )

        def done(f: concurrent.futures.Future) -> None:
            error = RuntimeError("closed") if f.cancelled() else f.exception()
            for r in requests:
                # a request cancelled by close(), or whose requester gave up, is done already
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    if error is not None:
                        r.set_exception(error)
                    else:
                        r.set_result(f.result())

        try:
            self._pool.submit(work).add_done_callback(done)
        except RuntimeError:  # closed meanwhile (close() runs on another thread)
            for r in requests:
                r.cancel()

    def fetch_past(self, fetch: Any, serve: Any, seq: int, timeout: float = 60.0) -> bytes | None:
        """Runs ``fetch()`` (a state download) on its own thread and returns its result, calling
        ``serve()`` meanwhile whenever a request waits: two peers that download from each other
        then both still serve (each waited out the other's download before).

        Asks again until the state downloaded is past this driver's exchange ``seq`` (its
        ``rounds_started > seq``), for ``timeout`` seconds at most; then returns the last one. A
        peer that missed a round created ahead (at the previous commit) may download from peers
        that have not started that round yet: their state is the one it already holds, and it
        would miss the same round again.

        Raises:
          whatever ``fetch`` raises; TimeoutError when one download takes over 300 seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            job = self._fetch_pool.submit(fetch)
            self._serve_until(job.done, time.monotonic() + 300.0, serve)
            data = job.result(timeout=0)
            counters = peek_counters(data) if data else None
            if counters is None or counters[1] > seq or time.monotonic() >= deadline:
                return data
            log.info("the state downloaded is from before round %d (step %d); asking again", seq, counters[0])
            self._serve_until(lambda: False, time.monotonic() + 0.25, serve)

    def _serve_until(self, done: Any, until: float, serve: Any) -> None:
        """Calls ``serve()`` whenever a request waits, until ``done()`` or ``time.monotonic()``
        reaches ``until``."""
        while not done() and time.monotonic() < until:
            if self.wanted:
                serve()
            time.sleep(0.02)

    def refuse(self, why: str) -> None:
        """Fails every waiting request (a peer over several processes serves no state)."""
        with self._lock:
            requests, self._requests = self._requests, []
        for r in requests:
            r.set_exception(RuntimeError(why))

    def close(self) -> None:
        self.closed = True
        for f in self._requests:
            f.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)


class StateExchange:
    """The part of ``rj.OuterSync`` that serves this peer's state to joiners and loads a
    downloaded one (:class:`StateServer`, :func:`decode_state`)."""

    def request_state(self) -> concurrent.futures.Future | None:
        """Asks for this peer's current global state as bytes (for a peer that joins or
        resyncs). Thread-safe; the future resolves after the next training step with no round in
        flight (also the first step of a driver that has not run yet). Used by the swarm's
        state endpoint. ``None`` once closed: the endpoint answers 404 at once, so that the
        requester tries another peer instead of waiting."""
        return None if self._closed else self._server.request()

    def _serve_state(self, params: Any, state: DiLoCoState) -> None:
        if self._processes > 1:
            self._server.refuse("a peer over several processes does not serve its state")
            return
        # the counters are taken now, in the training thread: a later read paired the state of
        # step s with the round counter of step s + 1, and the joiner contributed a pseudo-
        # gradient against a stale anchor to the wrong round
        self._server.serve(state, int(self.step or 0), self._schedule.rounds_started, self._schedule.swarm_base)

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
            return _nnx.through(lambda p, s: self.load_state_bytes(data, p, s), params, state, step=True)
        like, treedef = jax.tree.flatten(state)
        leaves, step, rounds_started, swarm_base = decode_state(data, like)
        # each leaf goes back with the layout of the state it replaces (sharded peers stay sharded)
        new_state = jax.tree.unflatten(treedef, put_like(leaves, like))
        # a copy: params and the anchor must not share buffers (the train step may donate both)
        params = jax.tree.map(lambda g, p: jnp.array(g, dtype=p.dtype, copy=True), new_state.global_params, params)
        self.step = step
        self._schedule.restart(step, rounds_started, swarm_base)
        self._rounds.residual.clear()
        self._pending.clear()
        self._last_state = None  # the next merged round's digest is the first one to compare
        # out of standby again (evicted and back, or missed): ready on the next step, and the
        # state downloaded again if a round ran without this peer meanwhile
        self._readied, self._downloaded = False, True
        self._state_digest = None
        del leaves
        host_memory.release_free_heap()  # the state's one-off host copies (see its docstring)
        return params, new_state
