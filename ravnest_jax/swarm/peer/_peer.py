"""`Swarm`: one peer of a run, with its own aiohttp server and event loop in a background thread.

Composed of a :class:`~ravnest_jax.swarm.peer._transport.Transport` (signed, streamed messages), a
round driver (:class:`~ravnest_jax.swarm.peer._rounds.Rounds`), one all-reduce algorithm
(``_butterfly.py`` or ``_ring.py``) and a :class:`~ravnest_jax.swarm.peer._state.StateTransfer`;
this class holds the lifecycle (loop thread, registration, heartbeats) and the public API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
import time
from typing import Any

import numpy as np

from ravnest_jax.host_memory import tune_host_allocator

from ..wire._codec import Codec, check_codec
from ..wire._manifest import ManifestDeclaration
from ..wire._types import TLS, PeerInfo, RoundRecord, SwarmError, Timeouts, check_info
from ._activations import ActivationLink
from ._allreduce import AllReduce, manifest_digest
from ._butterfly import Butterfly
from ._contrib import Contribution
from ._membership import heartbeat_loop, join
from ._preflight import from_environment
from ._ring import Ring
from ._rounds import Rounds
from ._state import StateProvider, StateTransfer
from ._transport import Transport

log = logging.getLogger("ravnest_jax.swarm")


class Swarm(ManifestDeclaration):
    """One peer of a DiLoCo swarm: averages pytrees of float32 arrays with the other peers.

    Starts an aiohttp server (the part owner side) and an asyncio loop in a background thread,
    registers with the rendezvous and heartbeats until closed. Use it as a context manager.

    Every argument left out of ``rendezvous_url``, ``run_id``, ``token``, ``codec``, ``listen``
    and ``peer_id`` is read from the environment when set there (``RAVNEST_RENDEZVOUS``,
    ``RAVNEST_RUN_ID``, ``RAVNEST_TOKEN`` or ``RAVNEST_TOKEN_FILE``, ``RAVNEST_CODEC``,
    ``RAVNEST_LISTEN``, ``RAVNEST_PEER_ID``): ``ravnest-jax local -- SCRIPT`` sets them for each
    peer process it starts, so a script written for it calls ``rj.Swarm()``.

    Args:
      rendezvous_url: base URL of the rendezvous, e.g. ``"http://10.0.0.1:8765"``.
      run_id: the run to join; peers of one run average with each other.
      token: the run token (shared secret; non-empty).
      codec: every codec setting of the run as one :class:`~ravnest_jax.Codec` value (the codec
        of parts, its options, the codec of the mean sent back and both error feedbacks;
        ``rj.OuterSync`` reads it from here), or a codec name for ``Codec(name)``; default
        ``"fp32"`` (exact). Lossy codecs quantise each part and again the all-gathered mean
        (docs/compression.md). In the round manifest: the same on all peers of a run.
      listen: ``"host:port"`` to bind (port 0: a free one, see :attr:`port`); ``None``/``"none"``:
        *client-only* (behind NAT): no inbound port, reached through the rendezvous' relay
        (``docs/swarm.md``; a peer the rendezvous cannot reach turns client-only, with a warning).
        Default ``"auto"``: ``$RAVNEST_LISTEN``, else ``"0.0.0.0:0"``.
      advertise: base URL other peers use to reach this one (default: ``http://`` + the local
        address that routes to the rendezvous + the bound port). Set it behind NAT.
      timeouts: deadlines, see :class:`Timeouts`.
      peer_id: this peer's id (default: random); rounds order peers by id.
      algorithm: how a round combines the contributions, one :class:`~ravnest_jax.AllReduce`
        value (the algorithm, its aggregator and knobs) or a name for ``AllReduce(name)``:
        ``"butterfly"`` (default, with the clipped mean: bounds what one faulty or malicious
        peer can do to the model, the plain mean bit for bit while nobody is over the bound)
        or ``"ring"`` (the plain mean). See ``docs/swarm.md``. In the round manifest: the same
        on all peers of a run.
      tls: HTTPS between the peers (:class:`~ravnest_jax.swarm.TLS`: the server context and
        the ``ssl=`` of outgoing requests); ``None``: plain HTTP.

    The small JSON object a peer publishes through the rendezvous (other peers see it as
    :attr:`PeerInfo.info`; a whole-swarm restart agrees on a checkpoint with it) is set with
    :meth:`set_info`.

    Raises:
      ValueError: bad arguments (unknown codec or algorithm, ``Codec.mean`` or
        ``Codec.mean_ef`` with the ring, empty token, bad listen address), or a required one
        (``rendezvous_url``, ``run_id``, ``token``) neither given nor in the environment.
      TypeError: ``algorithm`` or ``tls`` of the wrong type.
      SwarmError: on ``__enter__``/``start`` if the rendezvous cannot be reached in time.
    """

    transport_class: type[Transport] = Transport  # a test subclass may send slowly
    algorithms: dict[str, type[Butterfly] | type[Ring]] = {"butterfly": Butterfly, "ring": Ring}

    def __init__(
        self,
        rendezvous_url: str | None = None,
        *,
        run_id: str | None = None,
        token: str | bytes | None = None,
        codec: Codec | str | None = None,
        listen: str | None = "auto",
        advertise: str | None = None,
        timeouts: Timeouts | None = None,
        peer_id: str | None = None,
        algorithm: AllReduce | str = "butterfly",
        tls: TLS | None = None,
    ):
        rendezvous_url, run_id, token, codec, listen, peer_id = from_environment(
            rendezvous_url, run_id, token, codec, listen, peer_id
        )
        self.codec = codec = Codec.of(codec)
        check_codec(codec.name, codec.options)
        self.algorithm = algorithm = AllReduce.of(algorithm)
        if not isinstance(tls, (TLS, type(None))):
            raise TypeError(f"tls must be an rj.swarm.TLS or None, got {type(tls).__name__}")
        tls = tls or TLS()
        token_b, bind = _checked(run_id, token, listen, advertise)
        mean = _mean_settings(codec, algorithm.name)
        self._manifest: dict[str, Any] | None = None  # declared: sent with every hello
        self.rendezvous_url, self.run_id = rendezvous_url.rstrip("/"), run_id
        self.timeouts = timeouts or Timeouts()
        self.peer_id = peer_id or secrets.token_hex(8)
        tune_host_allocator()  # round buffers reused from the heap, not mapped afresh each round
        self.transport = self.transport_class(
            rendezvous_url=self.rendezvous_url,
            run_id=run_id,
            token=token_b,
            peer_id=self.peer_id,
            timeouts=self.timeouts,
            listen=bind,
            tls=tls,
            advertise=advertise,
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._rounds = Rounds(self.transport, codec.name, self._hello, self._spawn)
        args = (self.transport, self._rounds, codec.name, codec.options)
        self._algorithm: Butterfly | Ring = (
            self.algorithms["ring"](*args, algorithm.segment_bytes)
            if algorithm.name == "ring"
            else self.algorithms["butterfly"](*args, algorithm.aggregator, algorithm.clip_multiple, **mean)
        )
        self._rounds.algorithm = self._algorithm
        self._state = StateTransfer(self.transport, lambda: self._rounds.diverged)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._joined = False  # registered with the rendezvous (a leave is sent at close only then)
        self._info: dict[str, Any] = {}
        self._link: ActivationLink | None = None

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran (and :meth:`close` did not)."""
        return self._loop is not None and not self._closed

    @property
    def port(self) -> int | None:
        """The bound port (after :meth:`start`)."""
        return self.transport.port

    @property
    def client_only(self) -> bool:
        """Whether other peers reach this one through the rendezvous' relay (see ``listen``)."""
        return self.transport.client_only

    @property
    def relay_stats(self) -> dict[str, float]:
        """A client-only peer's relayed requests: ``messages``, ``bytes_in``/``bytes_out`` (request
        and answer bodies, bytes), ``seconds`` (handling time, summed)."""
        return dict(self.transport.relay_stats)

    @property
    def address(self) -> str | None:
        """The base URL other peers reach this one at (after :meth:`start`)."""
        return self.transport.address

    @property
    def info(self) -> dict[str, Any]:
        """A copy of the JSON object this peer publishes (:meth:`set_info`; ``{}`` until then)."""
        return dict(self._info)

    def set_info(self, info: dict[str, Any]) -> None:
        """Replaces the small JSON object this peer publishes through the rendezvous (other peers
        see it as :attr:`PeerInfo.info`; a whole-swarm restart agrees on a common checkpoint with
        it); the rendezvous has it after the next heartbeat (at once when called before the
        swarm starts).

        Raises:
          ValueError: ``info`` is not a dict that serialises to at most 4096 bytes of JSON.
        """
        check_info(info)
        self._info = dict(info)

    def activation_link(self, max_pending: int = 64) -> ActivationLink:
        """This peer's pipeline endpoint (``ravnest_jax.pipeline``: activations and their
        gradients to and from neighbouring stages); the first call must come before :meth:`start`
        (it adds a route), else ``RuntimeError``."""
        if self._link is None:
            if self._thread is not None:
                raise RuntimeError("activation_link() must be called before the swarm starts")
            self._link = ActivationLink(self.transport, lambda: self._loop, max_pending=max_pending)
        return self._link

    def __enter__(self) -> Swarm:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the server, the loop thread and join the run. Blocks until joined.

        Raises:
          RuntimeError: already started. SwarmError: the listen address cannot be bound, or the
          rendezvous cannot be reached or refuses to register this peer.
        """
        if self._thread is not None:
            raise RuntimeError("Swarm already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"swarm-{self.peer_id}", daemon=True)
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._astart(), self._loop)
        try:
            fut.result(timeout=self.timeouts.part + self.timeouts.connect + 5)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Leave the run, stop the server and the loop thread. Safe to call twice."""
        if self._closed or self._loop is None:
            return
        self._closed = True
        if self._link is not None:
            self._link.close()
        try:
            fut = asyncio.run_coroutine_threadsafe(self._astop(), self._loop)
            fut.result(timeout=self.timeouts.connect + 10)
        except Exception as e:  # pragma: no cover - best effort
            log.warning("swarm close: %r", e)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            assert self._thread is not None
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()

    def _run_loop(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    # ------------------------------------------------------------------ public API
    def all_reduce(self, tree: Any, *, weight: float = 1.0) -> tuple[Any, RoundRecord]:
        """Weighted mean of ``tree`` over the round's group; blocks until the round ends.

        The input is copied only where it must be: a single contiguous float32 leaf is used in
        place (with ``codec="fp32"`` its memory is what goes on the wire), several leaves are
        joined into one vector (one copy). The caller is blocked for the round, so it cannot
        change the input meanwhile; another thread must not either.

        Args:
          tree: nested dict/list/tuple of float32 numpy arrays (any shapes).
          weight: this peer's weight (> 0, finite), e.g. its number of tokens.

        Returns:
          ``(mean_tree, record)``: a tree of float32 arrays with the input's structure and
          shapes, holding ``sum_i w_i s_i x_i / sum_i w_i`` over ``record.contributors``,
          where ``s_i`` is 1 except for a contribution the clipped mean scaled down
          (``record.clipped``; ``aggregator="mean"``: always 1); it is bit-identical on
          every peer that gets it (``record.digest``).

        Raises:
          RoundFailed: the round could not complete on this peer (``.record.ok`` is False).
          TypeError / ValueError: a leaf is not float32, holds NaN/inf, or a bad weight.
        """
        return self.all_reduce_async(tree, weight=weight, copy=False).result(
            timeout=self.timeouts.round + self.timeouts.connect + 30
        )

    def all_reduce_async(
        self,
        tree: Any,
        *,
        weight: float = 1.0,
        round: int | None = None,
        state: tuple[int, str] | None = None,
        copy: bool = True,
    ) -> concurrent.futures.Future[tuple[Any, RoundRecord]]:
        """Like :meth:`all_reduce` but returns at once with a ``concurrent.futures.Future``.

        Its result is ``(mean_tree, record)``; it raises :class:`RoundFailed`. Rounds run in call order.
        ``round``: the round this contribution belongs to (``rj.OuterSync`` keeps its own schedule);
        if the swarm is past it, the future fails with :class:`RoundFailed` rather than mix it into
        a later round, unless all rounds since failed for everybody: then it runs in the current
        one (``record.round``). ``None``: the next round.

        ``state``: ``(round, digest)``, the digest (1-128 chars) of this peer's global state
        after it merged that earlier round (``RoundMetrics.state_digest``). A peer whose digest
        differs from the one most peers of the round hold has diverged: its contribution is
        left out (butterfly; a ring cannot) and its round fails (``record.diverged`` names it
        on every peer), so that it downloads the state again.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("Swarm is not running (use it as a context manager)")
        c = Contribution.of(tree, weight, state, codec=self.codec.name, codec_options=self.codec.options, copy=copy)
        return self._submit(c, round)

    def all_reduce_packed_async(
        self,
        packed: Any,
        *,
        weight: float = 1.0,
        round: int | None = None,
        state: tuple[int, str] | None = None,
    ) -> concurrent.futures.Future[tuple[np.ndarray, RoundRecord]]:
        """:meth:`all_reduce_async` of a contribution already encoded with this swarm's codec
        (a :class:`ravnest_jax.compress.Packed` of host numpy arrays, e.g. ``device_encode``'s
        output fetched with ``jax.device_get``): its parts go on the wire as they are, cut on
        the codec's block boundaries; nothing is decoded or encoded again.

        Its result is ``(mean, record)``, ``mean`` float32 ``(n,)``: the leaves raveled and
        concatenated in leaf order (every peer passes the same leaves and block size).

        Raises:
          ValueError: ``packed`` has another codec than the swarm, or a bad weight or state.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("Swarm is not running (use it as a context manager)")
        if packed.codec != self.codec.name:
            raise ValueError(
                f"the contribution is encoded with {packed.codec!r}, the swarm's codec is {self.codec.name!r}"
            )
        return self._submit(Contribution(packed, weight, state), round)

    def _submit(self, c: Contribution, round: int | None) -> concurrent.futures.Future[tuple[Any, RoundRecord]]:
        manifest = manifest_digest(c.names, c.shapes, f"{self._algorithm.wire()}/{c.layout.key()}")

        async def run() -> tuple[Any, RoundRecord]:
            mean, record = await self._rounds.run(c, manifest, round)
            return c.unflatten(mean), record  # the mean in the caller's tree structure

        return asyncio.run_coroutine_threadsafe(self._tracked(run()), self._loop)

    def ready(self) -> concurrent.futures.Future[Any]:
        """Tells the rendezvous that this peer trains now (returns at once).

        A process that joins a run which has had rounds is on *standby* (in no new round's
        group) until it first asks for a round, so that downloading the state or restoring a
        checkpoint costs the running peers nothing. Calling this once the state is loaded ends
        the standby early: the next round that is created includes this peer, so that it is
        not late for the first round of its schedule. ``rj.OuterSync`` calls it on its first
        step. Returns a ``concurrent.futures.Future`` of the rendezvous' answer; failures are
        logged, not raised (the first begin ends the standby anyway).
        """
        if self._loop is None or self._closed:
            raise RuntimeError("Swarm is not running (use it as a context manager)")

        async def go() -> Any:
            try:
                return await self.transport.rendezvous("POST", "/ready", self._hello(), self.timeouts.connect * 2)
            except Exception as e:  # noqa: BLE001 - only ends the standby early
                log.info("%s: ready: %r", self.peer_id, e)
                return None

        return asyncio.run_coroutine_threadsafe(self._tracked(go()), self._loop)

    async def _tracked(self, coro: Any) -> Any:
        """Runs ``coro`` as a task that :meth:`close` cancels (no task left pending at exit)."""
        me = asyncio.current_task()
        if me is not None:
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        return await coro

    def peers(self) -> list[PeerInfo]:
        """The live peers of the run, sorted by id (asks the rendezvous; raises SwarmError)."""
        return [PeerInfo.of(p) for p in self._ask("GET", "/peers", None)["peers"]]

    def wait_for_peers(self, n: int, timeout: float = 60.0) -> list[PeerInfo]:
        """Blocks until at least ``n`` live peers (this one included) are registered; returns
        them. Raises ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                peers = self.peers()
                if len(peers) >= n:
                    return peers
            except SwarmError as e:
                log.info("%s: waiting for peers: %r", self.peer_id, e)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"fewer than {n} peers after {timeout} s")
            time.sleep(0.1)

    def serve_state(self, provider: StateProvider | None) -> None:
        """Lets other peers download this peer's current global state: ``provider`` is called
        (in a worker thread) for each authenticated request and returns the state bytes, a
        ``concurrent.futures.Future`` of them (``rj.OuterSync.request_state``), or ``None`` when
        it has none; ``provider=None`` stops serving."""
        self._state.provider = provider

    def fetch_state(self, timeout: float = 120.0, *, prefer: str | None = None) -> bytes | None:
        """Downloads the current global state from a live peer of the run, trying the other
        training peers most advanced first (diverged ones last; ``prefer``, a peer id, before
        all) until one answers, within ``timeout`` seconds. Returns the state bytes, or ``None``
        when no other peer is live or none has a state (each answers 404 at once).

        Raises:
          SwarmError: peers are live but none delivered a state before the deadline, or the
            swarm closed meanwhile. RuntimeError: the swarm is not running.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("Swarm is not running")
        # a task that close() cancels: Ctrl+C during a download ends it at once
        fut = asyncio.run_coroutine_threadsafe(self._tracked(self._state.fetch(timeout, prefer)), self._loop)
        try:
            return fut.result(timeout=timeout + 5)
        except concurrent.futures.CancelledError:
            raise SwarmError("the swarm closed during the state download") from None

    def round_outcome(self, round_: int) -> str:
        """The rendezvous' outcome of a round: ``"ok"``, ``"failed"``, ``"running"`` or
        ``"unknown"`` (too old, or the rendezvous restarted since). Raises SwarmError when the
        rendezvous cannot be reached."""
        return next(
            (str(r.get("outcome")) for r in self.status().get("rounds", []) if r.get("round") == round_), "unknown"
        )

    def status(self) -> dict[str, Any]:
        """The run's status from the rendezvous (peers, membership version, recent rounds).

        Raises:
          SwarmError: the rendezvous cannot be reached, or has no such run (it restarted and no
          peer has rejoined it yet). RuntimeError: the swarm is not running.
        """
        return self._ask("GET", "/status", None)

    def _ask(self, method: str, rest: str, payload: Any, timeout: float | None = None) -> Any:
        """One rendezvous request from the caller's thread (SwarmError when it cannot be reached)."""
        if self._loop is None or self._closed:
            raise RuntimeError("Swarm is not running")
        t = self.timeouts.connect * 2 if timeout is None else timeout
        fut = asyncio.run_coroutine_threadsafe(self.transport.rendezvous(method, rest, payload, t), self._loop)
        try:
            return fut.result(timeout=t + 5)
        except Exception as e:
            raise SwarmError(f"rendezvous unreachable: {e}") from e

    # ------------------------------------------------------------------ loop side
    async def _astart(self) -> None:
        await self.transport.start()
        await join(self.transport, self._hello)
        self._joined = True
        if self.transport.client_only:
            self._spawn(self.transport.relay_pump(self._spawn))
        self._spawn(heartbeat_loop(self.transport, self._rounds, self._hello))

    async def _astop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:  # only once joined: a refused process must not make the live peer of its id leave
            if self._joined:
                await self.transport.rendezvous("POST", "/leave", {"peer_id": self.peer_id}, self.timeouts.connect)
        except Exception:  # noqa: BLE001 - the rendezvous may be gone
            pass
        self._rounds.close_all()
        await self.transport.stop()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t


def _mean_settings(codec: Codec, algorithm: str) -> dict[str, Any]:
    """``codec.mean`` and ``codec.mean_ef`` checked against the algorithm (``ValueError``: the
    ring sends partial sums in the one codec): the butterfly's keyword arguments for the mean."""
    if algorithm == "ring" and codec.mean is not None:
        raise ValueError("Codec.mean needs algorithm='butterfly' (the ring sends partial sums in the one codec)")
    if algorithm == "ring" and codec.mean_ef:
        raise ValueError("Codec.mean_ef needs algorithm='butterfly' (the ring re-encodes partial sums)")
    return {"mean_error_feedback": codec.mean_ef and codec.lossy, "mean_codec": codec.mean_name}


def _checked(
    run_id: str, token: str | bytes, listen: str | None, advertise: str | None
) -> tuple[bytes, tuple[str, int] | None]:
    """The checks of :class:`Swarm`'s other arguments; returns ``(token bytes, bind address or
    None)``. Raises ``ValueError`` (one line) for a bad one."""
    if not run_id or "/" in run_id:
        raise ValueError("run_id must be non-empty and contain no '/'")
    token_b = token.encode() if isinstance(token, str) else bytes(token)
    if not token_b:
        raise ValueError("token must not be empty")
    bind: tuple[str, int] | None = None
    if listen is not None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen must be 'host:port', 'none' or None, got {listen!r}")
        bind = (host.strip("[]"), int(port))
    elif advertise is not None:
        raise ValueError("advertise needs a listen address (a client-only peer is reached through the relay)")
    return token_b, bind
