"""`Swarm`: one peer of a run, with its own aiohttp server and event loop in a background thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import math
import secrets
import socket
import ssl as _ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import aiohttp
import aiohttp.http_exceptions
import numpy as np
from aiohttp import web

from . import _auth
from ._allreduce import (
    CHUNK,
    RING_SEGMENT_BYTES,
    contributors_tag,
    manifest_digest,
    max_message_bytes,
    mean_of_scaled,
    part_bounds,
    ring_segments,
)
from ._codec import (
    NonFiniteError,
    PartDecoder,
    WireFormatError,
    check_codec,
    decode_part,
    encode_part,
    tune_host_allocator,
)
from ._http import HTTPStatusError, json_response, signed_json
from ._preflight import from_environment
from ._state import _StateMixin
from ._types import PeerInfo, RoundFailed, RoundRecord, SwarmError, Timeouts, flatten, result_digest

log = logging.getLogger("ravnest_jax.swarm")

H_WEIGHT = "X-RJ-Weight"
ABSTAIN_WEIGHT = 1e-30  # w + 1e-30 == w in float32 for any weight w >= 1e-22
H_MANIFEST = "X-RJ-Manifest"
H_CONTRIB = "X-RJ-Contributors"  # tag of the contributor set a pushed result part was reduced over
ALGORITHMS = ("butterfly", "ring")
RING_INFLIGHT = 4  # ring PUTs in flight per peer at most (the others wait, not yet encoded)
SLOW_CHUNK = 256 * 1024  # chunk size when ``_send_chunk_delay`` is set (tests)
READ_BUFSIZE = 1 << 22  # bytes buffered per connection before reading pauses
MAX_EARLY_PARTS = 64  # part requests at most that wait for this peer to begin their round
GC_GENERATION = 1  # collected after every round (cheap: young objects only)


class _Attempt:
    """This peer's state for one attempt of one round (as a part owner)."""

    def __init__(self, round_: int, attempt: int):
        self.round, self.attempt = round_, attempt
        self.entered = asyncio.Event()
        self.complete = asyncio.Event()
        self.group: tuple[str, ...] = ()
        self.me = -1
        self.lo = self.hi = 0
        self.manifest = ""
        self.codec = ""
        self.received: dict[str, tuple[np.float32, np.ndarray]] = {}  # sender -> (w, w * x)
        self.receiving: set[str] = set()
        self.closed = False
        # all-gather: result parts pushed to us, by (part, contributor tag) -> (vec, digest)
        self.results: dict[tuple[int, str], tuple[np.ndarray, str]] = {}
        self.result_arrived = asyncio.Event()
        self.gather_closed = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.bounds: list[tuple[int, int]] = []
        self.algorithm = "butterfly"
        self.part_shas: dict[int, str] = {}
        # ring: segments[c][j] = (lo, hi) of segment j of part c; messages by (phase, step, j)
        self.segments: list[list[tuple[int, int]]] = [[(0, 0)]]
        self.ring_inbox: dict[tuple[str, int, int], tuple[Any, ...]] = {}
        self.ring_seen: set[tuple[str, int, int]] = set()  # every message stored (409 again)
        self.ring_receiving: set[tuple[str, int, int]] = set()
        self._ring_events: dict[tuple[str, int, int], asyncio.Event] = {}

    def ring_event(self, phase: str, step: int, seg: int) -> asyncio.Event:
        return self._ring_events.setdefault((phase, step, seg), asyncio.Event())


def _why(e: BaseException | None) -> str:
    """One short line for a connection error (aiohttp's repr spans a screen)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return str(e.os_error.strerror or e.os_error)
    return "no answer" if e is None else f"{type(e).__name__}: {e}"


class _RoundFail(Exception):
    def __init__(self, message: str, total_weight: float = 0.0):
        super().__init__(message)
        self.total_weight = total_weight


class Swarm(_StateMixin):
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
      codec: wire codec of parts and results, one of :func:`available_codecs` (``"fp32"`` is
        exact; lossy codecs quantise each part and again the all-gathered mean); default
        ``"fp32"``.
      codec_options: options of the codec (e.g. ``{"block_size": 64}``, ``{"fraction": 0.01}``
        for ``topk``), see ``docs/compression.md``.
      listen: ``"host:port"`` to bind; port 0 picks a free port (see :attr:`port`); default
        ``"0.0.0.0:0"``.
      advertise: base URL other peers use to reach this one (default: ``http://`` + the local
        address that routes to the rendezvous + the bound port). Set it behind NAT.
      timeouts: deadlines, see :class:`Timeouts`.
      algorithm: ``"butterfly"`` (default: reduce-scatter to part owners, then all-gather) or
        ``"ring"`` (2(n - 1) neighbour steps; any failure retries the whole attempt without the
        peers that did not vote). All peers of a run must use the same one.
      ring_segment_bytes: the pipelined ring cuts every part into segments of about this many
        float32 bytes (default 1 MiB), each its own message; part of the ring's round manifest,
        so all peers of a run must use the same value.
      peer_id: this peer's id (default: random); rounds order peers by id.
      ssl: server-side ``ssl.SSLContext`` (serve HTTPS; then advertise an ``https://`` URL).
      client_ssl: passed to aiohttp as ``ssl=`` for outgoing requests (an ``SSLContext`` that
        trusts the peers' certificates, or ``None`` for the defaults).
      info: a small JSON-serialisable dict (at most 4096 bytes as JSON) this peer publishes
        through the rendezvous; other peers see it as :attr:`PeerInfo.info`. Used to agree on a
        common checkpoint when a whole swarm restarts. Change it with :meth:`set_info`.

    Raises:
      ValueError: bad arguments (unknown codec, empty token, bad listen address), or a required
        one (``rendezvous_url``, ``run_id``, ``token``) neither given nor in the environment.
      SwarmError: on ``__enter__``/``start`` if the rendezvous cannot be reached in time.
    """

    def __init__(
        self,
        rendezvous_url: str | None = None,
        *,
        run_id: str | None = None,
        token: str | bytes | None = None,
        codec: str | None = None,
        codec_options: dict[str, Any] | None = None,
        listen: str | None = None,
        advertise: str | None = None,
        timeouts: Timeouts | None = None,
        peer_id: str | None = None,
        algorithm: str = "butterfly",
        ring_segment_bytes: int = RING_SEGMENT_BYTES,
        ssl: _ssl.SSLContext | None = None,
        client_ssl: Any = None,
        info: dict[str, Any] | None = None,
        _send_chunk_delay: float = 0.0,
        _serve_delay: float = 0.0,
    ):
        rendezvous_url, run_id, token, codec, listen, peer_id = from_environment(
            rendezvous_url, run_id, token, codec, listen, peer_id
        )
        check_codec(codec, codec_options)
        self.codec_options = dict(codec_options or {})
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        if not (isinstance(ring_segment_bytes, int) and ring_segment_bytes >= 4):
            raise ValueError(f"ring_segment_bytes must be an int >= 4, got {ring_segment_bytes!r}")
        self.ring_segment_bytes = ring_segment_bytes
        if not run_id or "/" in run_id:
            raise ValueError("run_id must be non-empty and contain no '/'")
        self.rendezvous_url = rendezvous_url.rstrip("/")
        self.run_id = run_id
        self._token = token.encode() if isinstance(token, str) else bytes(token)
        if not self._token:
            raise ValueError("token must not be empty")
        self.codec = codec
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen must be 'host:port', got {listen!r}")
        self._listen = (host.strip("[]"), int(port))
        self._advertise = advertise
        self.timeouts = timeouts or Timeouts()
        self.peer_id = peer_id or secrets.token_hex(8)
        self._ssl = ssl
        self._client_ssl = client_ssl
        self._send_chunk_delay = _send_chunk_delay  # test hooks: a slow sender / part owner
        self._serve_delay = _serve_delay
        self.port: int | None = None
        self.address: str | None = None
        tune_host_allocator()  # round buffers reused from the heap, not mapped afresh each round
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._attempts: dict[tuple[int, int], _Attempt] = {}
        self._last_round = -1
        self._current_round = -1
        self._early_parts = 0  # requests waiting for this peer to begin their round
        self._next: dict[str, Any] | None = None  # the next round, handed out with a commit
        self._diverged: set[str] = set()  # peers the last round found diverged: no state source
        self._scratch = np.empty(0, np.float32)  # own weighted part + the mean, reused
        self._nonces = _auth.NonceCache()
        self._closed = False
        self._info: dict[str, Any] = {}
        self.set_info(info or {})

    @property
    def info(self) -> dict[str, Any]:
        """A copy of the JSON object this peer publishes (see ``info`` and :meth:`set_info`)."""
        return dict(self._info)

    def set_info(self, info: dict[str, Any]) -> None:
        """Replaces the JSON object this peer publishes (see ``info``); the rendezvous has it
        after the next heartbeat (at once when called before the swarm starts).

        Raises:
          ValueError: ``info`` is not a dict that serialises to at most 4096 bytes of JSON.
        """
        try:
            size = len(json.dumps(info, separators=(",", ":"))) if isinstance(info, dict) else -1
        except (TypeError, ValueError) as e:
            raise ValueError(f"info must be JSON-serialisable: {e}") from None
        if not 0 <= size <= 4096:
            raise ValueError("info must be a dict of at most 4096 bytes as JSON")
        self._info = dict(info)

    # ------------------------------------------------------------------ lifecycle (caller thread)
    def __enter__(self) -> Swarm:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the server, the loop thread and join the run. Blocks until joined."""
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

        Args:
          tree: nested dict/list/tuple of float32 numpy arrays (any shapes). Copied on entry.
          weight: this peer's weight (> 0, finite), e.g. its number of tokens.

        Returns:
          ``(mean_tree, record)``: a tree of float32 arrays with the input's structure and
          shapes, holding ``sum_i w_i x_i / sum_i w_i`` over ``record.contributors``; it is
          bit-identical on every peer that gets it (``record.digest``).

        Raises:
          RoundFailed: the round could not complete on this peer (``.record.ok`` is False).
          TypeError / ValueError: a leaf is not float32, holds NaN/inf, or a bad weight.
        """
        return self.all_reduce_async(tree, weight=weight).result(
            timeout=self.timeouts.round + self.timeouts.connect + 30
        )

    def all_reduce_async(
        self, tree: Any, *, weight: float = 1.0, round: int | None = None, state: tuple[int, str] | None = None
    ) -> concurrent.futures.Future[tuple[Any, RoundRecord]]:
        """Like :meth:`all_reduce` but returns at once with a ``concurrent.futures.Future``.

        The future's result is ``(mean_tree, record)``; it raises :class:`RoundFailed`. Rounds
        run one at a time in call order.

        ``round``: the round this contribution belongs to, when the caller keeps its own
        schedule (``rj.OuterSync`` does). If the swarm has moved past it (this peer was too late)
        the future fails at once with :class:`RoundFailed` instead of mixing the contribution
        into a later round. ``None``: the next round.

        ``state``: ``(round, digest)``, the digest (a string of 1-128 chars) of this peer's
        global state after it merged that earlier round (``rj.OuterSync`` sends its
        ``RoundMetrics.state_digest``). The rendezvous compares the digests of the round's
        peers: a peer whose digest differs from the one most peers hold has diverged; its
        contribution is left out of the mean (butterfly; a ring cannot leave it out) and its
        own round fails (``RoundFailed``, ``record.diverged`` names it), so that it downloads
        the state again. ``record.diverged`` lists such peers on every peer.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("Swarm is not running (use it as a context manager)")
        w = float(weight)
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weight must be finite and > 0, got {weight!r}")
        if state is not None:
            if not (
                isinstance(state, tuple)
                and len(state) == 2
                and isinstance(state[0], int)
                and isinstance(state[1], str)
                and 0 < len(state[1]) <= 128
            ):
                raise ValueError(f"state must be (round: int, digest: str of 1-128 chars), got {state!r}")
            state = (int(state[0]), state[1])
        names, leaves, unflatten = flatten(tree)
        if not leaves:
            raise ValueError("tree has no leaves")
        vec = np.concatenate([np.ravel(x) for x in leaves]).astype(np.float32, copy=False)
        if not np.isfinite(vec).all():
            raise ValueError("tree holds NaN or infinity")
        shapes = [x.shape for x in leaves]
        wire = f"{self.codec}/{self.algorithm}" + (f"/{self.ring_segment_bytes}" if self.algorithm == "ring" else "")
        manifest = manifest_digest(names, shapes, wire)
        sizes = [x.size for x in leaves]
        offsets = np.cumsum([0] + sizes)

        out: concurrent.futures.Future[tuple[Any, RoundRecord]] = concurrent.futures.Future()
        inner = asyncio.run_coroutine_threadsafe(self._round(vec, np.float32(w), manifest, round, state), self._loop)

        def done(f: concurrent.futures.Future[tuple[np.ndarray, RoundRecord]]) -> None:
            try:
                res, rec = f.result()
            except BaseException as e:  # noqa: BLE001 - forwarded to the caller
                out.set_exception(e)
                return
            parts = [res[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]
            out.set_result((unflatten(parts), rec))

        inner.add_done_callback(done)
        return out

    def ready(self) -> concurrent.futures.Future[Any]:
        """Tells the rendezvous that this peer trains now (returns at once).

        A process that joins a run which has had rounds is on *standby* (in no new round's
        group) until it first asks for a round, so that downloading the state or restoring a
        checkpoint costs the running peers nothing. Calling this once the state is loaded ends
        the standby early: the next round that is created includes this peer, so that it is
        not late for the first round of its schedule. ``rj.OuterSync`` calls it on its first
        step. Failures are logged, not raised (the first begin ends the standby anyway).

        Returns:
          A ``concurrent.futures.Future`` of the rendezvous' answer.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("Swarm is not running (use it as a context manager)")

        async def go() -> Any:
            try:
                return await self._rv("POST", "/ready", self._hello(), self.timeouts.connect * 2)
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
        if self._loop is None or self._closed:
            raise RuntimeError("Swarm is not running")
        fut = asyncio.run_coroutine_threadsafe(self._rv("GET", "/peers", None, self.timeouts.connect * 2), self._loop)
        try:
            data = fut.result(timeout=self.timeouts.connect * 2 + 5)
        except Exception as e:
            raise SwarmError(f"rendezvous unreachable: {e}") from e
        return [
            PeerInfo(
                p["peer_id"], p["address"], p["last_round"], p["seconds_since_heartbeat"], dict(p.get("info") or {})
            )
            for p in data["peers"]
        ]

    def wait_for_peers(self, n: int, timeout: float = 60.0) -> list[PeerInfo]:
        """Block until at least ``n`` live peers (this one included) are registered.

        Returns the peers. Raises ``TimeoutError`` after ``timeout`` seconds.
        """
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

    # ------------------------------------------------------------------ loop side: start/stop
    async def _astart(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, ssl=self._client_ssl if self._client_ssl is not None else True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect),
            read_bufsize=READ_BUFSIZE,
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._round_lock = asyncio.Lock()
        self._ring_slots = asyncio.Semaphore(RING_INFLIGHT)
        # (round, attempt) -> members the rendezvous says left; set when that grows
        self._gone: dict[tuple[int, int], set[str]] = {}
        self._gone_event = asyncio.Event()
        app = web.Application(client_max_size=1 << 20)
        base = "/v1/runs/{run_id}/rounds/{round}/{attempt}"
        app.router.add_put(base + "/parts/{part}", self._h_put_part)
        app.router.add_put(base + "/results/{part}", self._h_put_result)
        app.router.add_put(base + "/ring/{phase}/{step}/{seg}", self._h_put_ring)
        app.router.add_get("/health", self._h_health)
        app.router.add_get("/v1/runs/{run_id}/state", self._h_get_state)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=1.0, read_bufsize=READ_BUFSIZE
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._listen[0], self._listen[1], ssl_context=self._ssl, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            raise SwarmError(f"cannot listen on {self._listen[0]}:{self._listen[1]}: {e.strerror or e}") from None
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.address = self._advertise or self._guess_address()
        deadline = time.monotonic() + self.timeouts.part + self.timeouts.connect
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                await self._rv("POST", "/join", self._hello(), self.timeouts.connect * 2)
                break
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = e
                await asyncio.sleep(0.2)
            except (HTTPStatusError, PermissionError) as e:
                raise SwarmError(f"the rendezvous refused to register us: {e}") from e
        else:
            raise SwarmError(
                f"rendezvous {self.rendezvous_url} unreachable for {self.timeouts.part + self.timeouts.connect:.0f} s: "
                f"{_why(last)} (is `ravnest-jax rendezvous` running there?)"
            )
        self._spawn(self._heartbeat_loop())

    async def _astop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self._rv("POST", "/leave", {"peer_id": self.peer_id}, self.timeouts.connect)
        except Exception:  # noqa: BLE001 - the rendezvous may be gone
            pass
        for st in self._attempts.values():
            st.closed = st.gather_closed = True
            st.entered.set()
            st.result_arrived.set()
        await self._runner.cleanup()
        await self._session.close()
        # let the connector's transports finish closing before the loop stops (aiohttp's
        # graceful-shutdown advice); otherwise they are reported as unclosed at GC time
        await asyncio.sleep(0.1)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _guess_address(self) -> str:
        scheme = "https" if self._ssl is not None else "http"
        host = self._listen[0]
        if host in ("0.0.0.0", "::", ""):
            u = urllib.parse.urlsplit(self.rendezvous_url)
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((u.hostname or "127.0.0.1", u.port or 80))  # no packet is sent
                    host = s.getsockname()[0]
            except OSError:
                host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{self.port}"

    def _hello(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "address": self.address, "last_round": self._last_round, "info": self._info}

    async def _rv(self, method: str, path: str, payload: Any, total: float, round_: int | None = None) -> Any:
        return await signed_json(
            self._session,
            self.rendezvous_url,
            method,
            f"/v1/runs/{self.run_id}{path}",
            token=self._token,
            run_id=self.run_id,
            peer=self.peer_id,
            payload=payload,
            round_=round_,
            ssl=self._client_ssl,
            timeout=aiohttp.ClientTimeout(total=max(total, 0.05), sock_connect=self.timeouts.connect),
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.timeouts.heartbeat)
            try:
                r = await self._rv(
                    "POST", "/heartbeat", self._hello(), min(self.timeouts.heartbeat * 2, self.timeouts.eviction)
                )
                self._note_left(r.get("left"))
                if r.get("registered"):
                    log.info("%s: re-registered with the rendezvous (epoch %s)", self.peer_id, r.get("epoch"))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep beating; the next one re-registers
                log.debug("%s: heartbeat failed: %r", self.peer_id, e)

    def _note_left(self, left: Any) -> None:
        """Members of running attempts that left the run (from a heartbeat answer)."""
        if not isinstance(left, list):
            return
        changed = False
        for item in left:
            if isinstance(item, list) and len(item) == 3 and all(isinstance(x, int) for x in item[:2]):
                key = (int(item[0]), int(item[1]))
                if key in self._attempts and str(item[2]) not in self._gone.setdefault(key, set()):
                    self._gone[key].add(str(item[2]))
                    changed = True
        for key in [k for k in self._gone if k not in self._attempts]:
            del self._gone[key]
        if changed:
            self._gone_event.set()
            self._gone_event = asyncio.Event()

    def _gone_wait(self) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self._gone_event.wait())

    # ------------------------------------------------------------------ server handlers
    async def _h_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    def _auth_request(self, request: web.Request, extra: str = "") -> tuple[str, str]:
        if request.match_info.get("run_id") != self.run_id:
            raise web.HTTPNotFound(text="unknown run")
        try:
            peer, _, body = _auth.verify(
                self._token,
                request.headers,
                method=request.method,
                path=request.path,
                run_id=self.run_id,
                nonces=self._nonces,
                extra=extra,
            )
        except _auth.AuthError as e:
            raise web.HTTPUnauthorized(text=f"unauthorized: {e}") from None
        return peer, body

    def _route_ints(self, request: web.Request) -> tuple[int, int, int]:
        try:
            return (
                int(request.match_info["round"]),
                int(request.match_info["attempt"]),
                int(request.match_info["part"]),
            )
        except ValueError:
            raise web.HTTPBadRequest(text="round, attempt and part must be integers") from None

    async def _wait_entered(self, r: int, a: int) -> _Attempt:
        st = self._attempts.get((r, a))
        if st is None and r > max(self._current_round, self._last_round) + 2:
            # Further ahead than this peer has seen: a new process (joined, restarted) learns the
            # swarm's round number only from its own begin, which may answer a moment after a
            # faster member's part arrives. Wait for it (bounded in time and in number of such
            # requests) rather than refuse the part and be dropped from the round as unreachable.
            if self._early_parts >= MAX_EARLY_PARTS:
                raise web.HTTPConflict(text=f"round {r} is not open here")
            self._early_parts += 1
            try:
                until = time.monotonic() + self.timeouts.part
                while (
                    r > max(self._current_round, self._last_round) + 2
                    and (r, a) not in self._attempts
                    and time.monotonic() < until
                ):
                    await asyncio.sleep(0.01)
            finally:
                self._early_parts -= 1
            st = self._attempts.get((r, a))
        if st is None:
            if r <= self._last_round or r > max(self._current_round, self._last_round) + 2:
                raise web.HTTPConflict(text=f"round {r} is not open here")
            st = self._attempts[(r, a)] = _Attempt(r, a)
        if not st.entered.is_set():
            try:
                await asyncio.wait_for(st.entered.wait(), self.timeouts.part)
            except TimeoutError:
                raise web.HTTPConflict(text=f"round {r} attempt {a} not started here") from None
        if st.closed and not st.group:
            raise web.HTTPConflict(text="peer is closing")
        return st

    async def _read_part(
        self, request: web.Request, st: _Attempt, dec: PartDecoder, claimed: str, limit: int, stop: Callable[[], bool]
    ) -> np.ndarray:
        """Stream a signed part body into ``dec``: one pass that hashes (the signed body digest)
        and decodes each chunk as the socket delivers it (no re-chunking, no whole-body copy).
        Maps every failure to the HTTP error the sender gets."""
        h = _auth.body_hasher()
        try:
            async for chunk, _ in request.content.iter_chunks():
                h.update(chunk)
                dec.feed(chunk)
                if stop():
                    raise web.HTTPConflict(text="too late")
            if not _auth.digest_matches(claimed, h.hexdigest()):
                raise web.HTTPUnauthorized(text="body does not match its signed digest")
            return dec.finish()
        except (WireFormatError, NonFiniteError) as e:
            if dec.nbytes > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=dec.nbytes) from None
            raise web.HTTPBadRequest(text=f"bad part: {e}") from None
        except (
            aiohttp.ClientPayloadError,
            ConnectionError,
            asyncio.IncompleteReadError,
            aiohttp.http_exceptions.HttpProcessingError,
        ) as e:
            # the sender vanished mid-body (killed, network gone): nothing was stored
            log.info("%s: body from %s cut off: %r", self.peer_id, request.headers.get(_auth.H_PEER), e)
            raise web.HTTPBadRequest(text="body cut off") from None

    async def _h_put_part(self, request: web.Request) -> web.Response:
        weight_s = request.headers.get(H_WEIGHT, "")
        manifest = request.headers.get(H_MANIFEST, "")
        sender, claimed = self._auth_request(request, extra=f"{weight_s}|{manifest}")
        r, a, k = self._route_ints(request)
        try:
            w = np.float32(float(weight_s))
        except ValueError:
            raise web.HTTPBadRequest(text="bad weight") from None
        if not (np.isfinite(w) and w > 0):
            raise web.HTTPBadRequest(text="weight must be finite and > 0")
        st = await self._wait_entered(r, a)
        if k != st.me:
            raise web.HTTPBadRequest(text=f"this peer owns part {st.me}, not {k}")
        if sender not in st.group or sender == self.peer_id:
            raise web.HTTPForbidden(text="sender is not in this round's group")
        if manifest != st.manifest:
            raise web.HTTPBadRequest(text="part does not match the round manifest (leaf names, shapes or codec differ)")
        if st.closed:
            raise web.HTTPConflict(text="too late: the reduce-scatter of this attempt is over")
        if sender in st.received or sender in st.receiving:
            raise web.HTTPConflict(text="duplicate part")
        length = st.hi - st.lo
        limit = max_message_bytes(length)
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        st.receiving.add(sender)
        try:
            dec = PartDecoder(name=f"part{k}", length=length, codec=st.codec, max_bytes=limit)
            vec = await self._read_part(request, st, dec, claimed, limit, lambda: st.closed)
            if st.closed:
                raise web.HTTPConflict(text="too late: the reduce-scatter of this attempt is over")
            np.multiply(vec, w, out=vec)  # weighted in place, once (the decoder's own array)
            st.received[sender] = (w, vec)
            st.bytes_in += dec.nbytes
            if len(st.received) == len(st.group):
                st.complete.set()
        finally:
            st.receiving.discard(sender)
        return json_response(request, self._token, self.run_id, self.peer_id, {"ok": True})

    async def _h_put_result(self, request: web.Request) -> web.Response:
        """All-gather: owner k pushes its reduced part k, tagged with the contributor set it
        was reduced over; kept until this peer knows the round's contributors."""
        tag = request.headers.get(H_CONTRIB, "")
        manifest = request.headers.get(H_MANIFEST, "")
        sender, claimed = self._auth_request(request, extra=f"{tag}|{manifest}")
        r, a, k = self._route_ints(request)
        st = await self._wait_entered(r, a)
        if not 0 <= k < len(st.group) or k == st.me:
            raise web.HTTPBadRequest(text=f"bad result part {k}")
        if sender != st.group[k]:
            raise web.HTTPForbidden(text="only the owner of a part pushes its result")
        if manifest != st.manifest or st.algorithm != "butterfly" or not 1 <= len(tag) <= 64:
            raise web.HTTPBadRequest(text="result does not match the round manifest")
        if st.gather_closed:
            raise web.HTTPConflict(text="too late: the all-gather of this attempt is over")
        if (k, tag) in st.results:
            raise web.HTTPConflict(text="duplicate result part")
        lo, hi = st.bounds[k]
        limit = max_message_bytes(hi - lo)
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        dec = PartDecoder(name=f"result{k}", length=hi - lo, codec=st.codec, max_bytes=limit)
        vec = await self._read_part(request, st, dec, claimed, limit, lambda: st.gather_closed)
        if st.gather_closed:
            raise web.HTTPConflict(text="too late: the all-gather of this attempt is over")
        st.results[(k, tag)] = (vec, claimed)
        st.bytes_in += dec.nbytes
        st.result_arrived.set()
        return json_response(request, self._token, self.run_id, self.peer_id, {"ok": True})

    # ------------------------------------------------------------------ client side of a round
    def _url(self, group_addr: str, r: int, a: int, kind: str, k: int) -> tuple[str, str]:
        path = f"/v1/runs/{self.run_id}/rounds/{r}/{a}/{kind}/{k}"
        return group_addr.rstrip("/") + path, path

    async def _send_part(
        self, st: _Attempt, addr: str, k: int, data: bytes, digest: str, weight: np.float32, timeout: float
    ) -> int:
        url, path = self._url(addr, st.round, st.attempt, "parts", k)
        weight_s = repr(float(weight))
        return await self._put(
            st,
            url,
            path,
            data,
            digest,
            f"{weight_s}|{st.manifest}",
            {H_WEIGHT: weight_s, H_MANIFEST: st.manifest},
            timeout,
        )

    async def _push_result(self, st: _Attempt, addr: str, data: bytes, digest: str, tag: str, timeout: float) -> int:
        if self._serve_delay:  # test hook: a part owner slow to deliver its result
            await asyncio.sleep(self._serve_delay)
        url, path = self._url(addr, st.round, st.attempt, "results", st.me)
        return await self._put(
            st,
            url,
            path,
            data,
            digest,
            f"{tag}|{st.manifest}",
            {H_CONTRIB: tag, H_MANIFEST: st.manifest},
            timeout,
            slow=False,
        )

    async def _put(
        self,
        st: _Attempt,
        url: str,
        path: str,
        data: bytes,
        digest: str,
        extra: str,
        extra_headers: dict[str, str],
        timeout: float,
        slow: bool = True,
    ) -> int:
        """One signed, streamed PUT of ``data`` (whose body digest is ``digest``) over the
        session's keep-alive connections; returns the bytes sent once the receiver answered."""
        headers = _auth.sign(
            self._token,
            method="PUT",
            path=path,
            run_id=self.run_id,
            peer=self.peer_id,
            round_=st.round,
            body_digest=digest,
            extra=extra,
        )
        headers.update(extra_headers)
        headers["Content-Length"] = str(len(data))
        headers["Content-Type"] = "application/octet-stream"
        delay = self._send_chunk_delay if slow else 0.0  # test hook: slow uploads of parts

        async def body() -> Any:
            mv = memoryview(data)
            step = CHUNK if not delay else SLOW_CHUNK  # tests: a slow sender, chunk by chunk
            for off in range(0, len(data), step):
                if delay:
                    await asyncio.sleep(delay)
                yield mv[off : off + step]

        async with self._session.put(
            url,
            data=body(),
            headers=headers,
            ssl=self._client_ssl,
            timeout=aiohttp.ClientTimeout(total=max(timeout, 0.05), sock_connect=self.timeouts.connect),
        ) as resp:
            text = await resp.content.read(4096)
            if resp.status != 200:
                raise HTTPStatusError(resp.status, text.decode(errors="replace"))
        return len(data)

    async def _vote(
        self, r: int, epoch: str, a: int, phase: str, data: dict[str, Any], deadline: float
    ) -> dict[str, Any]:
        payload = {"peer_id": self.peer_id, "epoch": epoch, "attempt": a, "phase": phase, "data": data}
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _RoundFail(f"no {phase} decision from the rendezvous before the round deadline ({last!r})")
            try:
                return await self._rv("POST", f"/rounds/{r}/vote", payload, left, round_=r)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = e  # rendezvous down or restarting: try again until the deadline
                await asyncio.sleep(min(0.25, max(left, 0)))
            except (HTTPStatusError, PermissionError) as e:
                raise _RoundFail(f"rendezvous refused the {phase} vote: {e}") from e

    async def _begin(self, deadline: float, expected: int | None = None) -> dict[str, Any]:
        after = self._last_round if expected is None else expected - 1
        payload = {
            **self._hello(),
            "after": after,
            "part_s": self.timeouts.part,
            "grace_s": self.timeouts.grace,
            "max_attempts": self.timeouts.max_attempts,
            "expect": expected is not None,
        }
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _RoundFail(f"no round from the rendezvous before the deadline ({last!r})")
            payload["wait_s"] = max(left - 0.5, 0.0)
            try:
                res = await self._rv("POST", "/rounds/begin", payload, left)
                if res.get("missed") is not None:
                    raise _RoundFail(f"missed round {expected}: round {res['missed']} runs without this peer")
                if res.get("round") is not None:
                    return res
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = e
                await asyncio.sleep(min(0.25, max(left, 0)))
            except (HTTPStatusError, PermissionError) as e:
                raise _RoundFail(f"rendezvous refused the round: {e}") from e

    async def _round(
        self,
        vec: np.ndarray,
        weight: np.float32,
        manifest: str,
        expected: int | None = None,
        state: tuple[int, str] | None = None,
    ) -> tuple[np.ndarray, RoundRecord]:
        me = asyncio.current_task()
        if me is not None:  # so that close() cancels a round in flight
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        async with self._round_lock:
            t0 = time.monotonic()
            deadline = t0 + self.timeouts.round
            stats = {"sent": 0, "received": 0}
            r, attempts, group = -1, 0, ()
            diverged: tuple[str, ...] = ()
            arrive: asyncio.Task[Any] | None = None
            try:
                nxt, self._next = self._next, None
                if (
                    nxt is not None
                    and self.peer_id in nxt["group"]
                    and int(nxt["round"]) > self._last_round
                    and (expected is None or expected == int(nxt["round"]))
                ):
                    # the rendezvous handed us this round's group with the last commit: start at
                    # once; the begin request only marks our arrival (it starts the round's
                    # clock) and, when its answer comes, tightens our part deadline
                    begin = nxt
                    # (left to finish in the background: cancelling it would close a
                    # keep-alive connection to the rendezvous)
                    arrive = self._spawn(
                        self._arrival(min(deadline, time.monotonic() + self.timeouts.part), int(nxt["round"]))
                    )
                else:
                    begin = await self._begin(deadline, expected)
                r, epoch = int(begin["round"]), str(begin["epoch"])
                log.debug(
                    "%s: round %d attempt %s with %s, %.3f s after the call%s",
                    self.peer_id,
                    r,
                    begin.get("attempt"),
                    begin.get("group"),
                    time.monotonic() - t0,
                    " (handed with the last commit)" if begin is nxt else "",
                )
                missed = expected is not None and r != expected
                if missed:
                    # Too late for `expected`; this peer is in round r's group, so it takes part
                    # as an abstainer (zeros, a weight that vanishes next to any real one in
                    # float32) rather than make the others wait out the part deadline; then it
                    # reports the miss.
                    vec = np.zeros_like(vec)
                    weight = np.float32(ABSTAIN_WEIGHT)
                a, group = int(begin["attempt"]), tuple(begin["group"])
                log.debug(
                    "%s: in round %d attempt %d",
                    self.peer_id,
                    r,
                    a,
                    extra={"rj_event": "round_begin", "rj_round": r, "rj_attempt": a},
                )
                addresses = dict(begin.get("addresses") or {})
                addresses[self.peer_id] = self.address or ""
                self._current_round = r
                part_left = float(begin.get("part_left", self.timeouts.part))
                while True:
                    attempts += 1
                    out = await self._attempt(
                        r, a, group, addresses, epoch, vec, weight, manifest, deadline, stats, part_left, arrive, state
                    )
                    arrive = None  # its answer only matters to the first attempt
                    if out[0] == "retry":
                        a, group = out[1], tuple(out[2])
                        part_left = self.timeouts.part
                        log.info("%s: round %d retry %d with %s", self.peer_id, r, a, group)
                        if self.peer_id not in group:
                            raise _RoundFail("left out of the retry group (too late)")
                        continue
                    _, res, contributors, total, digest, diverged = out
                    if missed:
                        # total_weight tells the caller whether anybody contributed: only
                        # abstainers (every member missed its round) means no peer is ahead
                        nobody = float(total) < 1e-20
                        raise _RoundFail(
                            f"missed round {expected}: the swarm is at round {r}"
                            + (" (no peer contributed to it)" if nobody else ""),
                            total_weight=float(total),
                        )
                    if self.peer_id in diverged:
                        raise _RoundFail(
                            f"diverged: this peer's global state after round {state[0] if state else '?'} "
                            "differs from the swarm's; its contribution was left out"
                        )
                    rec = RoundRecord(
                        round=r,
                        ok=True,
                        attempts=attempts,
                        group=group,
                        contributors=tuple(contributors),
                        total_weight=float(total),
                        bytes_sent=stats["sent"],
                        bytes_received=stats["received"],
                        seconds=time.monotonic() - t0,
                        digest=digest,
                        codec=self.codec,
                        algorithm=self.algorithm,
                        diverged=tuple(diverged),
                    )
                    return res, rec
            except _RoundFail as e:
                rec = RoundRecord(
                    round=r,
                    ok=False,
                    attempts=attempts,
                    group=group,
                    contributors=(),
                    total_weight=e.total_weight,
                    bytes_sent=stats["sent"],
                    bytes_received=stats["received"],
                    seconds=time.monotonic() - t0,
                    digest="",
                    codec=self.codec,
                    algorithm=self.algorithm,
                    error=str(e),
                    diverged=tuple(diverged),
                )
                raise RoundFailed(rec) from None
            finally:
                if r >= 0:
                    self._last_round = max(self._last_round, r)
                for key in [key for key in self._attempts if key[0] <= self._last_round]:
                    st = self._attempts.pop(key)
                    st.closed = st.gather_closed = True
                    st.received.clear()
                    st.results.clear()
                    st.result_arrived.set()
                # a round leaves reference cycles (tasks, exceptions and their frames) that hold
                # payload-sized buffers; collect the young generations now so RSS stays flat
                gc.collect(GC_GENERATION)

    async def _attempt(
        self,
        r: int,
        a: int,
        group: tuple[str, ...],
        membership: dict[str, str],
        epoch: str,
        vec: np.ndarray,
        weight: np.float32,
        manifest: str,
        deadline: float,
        stats: dict[str, int],
        part_left: float | None = None,
        arrive: asyncio.Task[Any] | None = None,
        state: tuple[int, str] | None = None,
    ) -> tuple[Any, ...]:
        if self.peer_id not in group:
            raise _RoundFail("not in the round's group")
        n = len(group)
        st = self._attempts.get((r, a)) or _Attempt(r, a)
        self._attempts[(r, a)] = st
        st.group, st.me, st.manifest, st.codec = group, group.index(self.peer_id), manifest, self.codec
        bounds = part_bounds(vec.size, n)
        st.bounds = bounds
        st.lo, st.hi = bounds[st.me]
        st.algorithm = self.algorithm
        if self.algorithm == "ring":
            st.segments = ring_segments(bounds, self.ring_segment_bytes)
            st.entered.set()
            return await self._ring_attempt(st, membership, epoch, vec, weight, deadline, stats, state)
        plen = st.hi - st.lo
        if self._scratch.size < 2 * plen:  # reused from round to round: its pages stay mapped
            self._scratch = np.empty(2 * plen, np.float32)
        own = np.multiply(vec[st.lo : st.hi], weight, out=self._scratch[:plen])
        st.received[self.peer_id] = (weight, own)
        if len(st.received) == n:
            st.complete.set()
        st.entered.set()

        # phase 1: reduce-scatter (push part k to owner k) -------------------------------------
        part_s = self.timeouts.part if part_left is None else min(part_left, self.timeouts.part)
        t_part = min(time.monotonic() + part_s, deadline)
        sends = {}
        for k, owner in enumerate(group):
            if k == st.me or owner not in membership:
                continue
            lo, hi = bounds[k]
            data = encode_part(f"part{k}", vec[lo:hi], self.codec, **self.codec_options)
            sends[owner] = asyncio.ensure_future(
                self._send_part(
                    st, membership[owner], k, data, _auth.body_digest(data), weight, t_part - time.monotonic()
                )
            )
            del data
        complete = asyncio.ensure_future(st.complete.wait())
        gone = self._gone_wait()
        try:
            while not complete.done():
                left = t_part - time.monotonic()
                if left <= 0 or set(group) - set(st.received) <= self._gone.get((r, a), set()):
                    break  # the deadline, or every part still missing is from a member that left
                if gone.done():
                    gone = self._gone_wait()
                waits = {complete, gone} | ({arrive} if arrive is not None and not arrive.done() else set())
                done, _ = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if arrive is not None and arrive in done:
                    t_part = min(t_part, self._arrived(arrive, r, t_part))
        finally:
            complete.cancel()
            gone.cancel()
        st.closed = True
        # Optimistic all-gather: an owner that holds every member's part reduces over the whole
        # group and pushes the result now, while the gather vote decides the contributors; the
        # pushed parts carry the contributor set's tag, so one reduced over another set than the
        # decided one is never used (the owner then reduces and pushes again).
        mine: dict[str, Any] = {}
        if len(st.received) == n:
            self._reduce_and_push(st, group, membership, deadline, mine)
        vote: dict[str, Any] = {"received": sorted(st.received)}
        if state is not None:
            vote["state"] = list(state)
        log.debug(
            "%s: round %d attempt %d: gather vote, parts from %d of %d",
            self.peer_id,
            r,
            a,
            len(st.received),
            n,
            extra={"rj_event": "gather_vote", "rj_round": r, "rj_attempt": a},
        )
        gather = await self._vote(r, epoch, a, "gather", vote, deadline)
        log.debug(
            "%s: round %d attempt %d: gather decision %s",
            self.peer_id,
            r,
            a,
            gather.get("decision"),
            extra={"rj_event": "gather_decided", "rj_round": r, "rj_attempt": a, "rj_decision": gather.get("decision")},
        )
        for t in sends.values():
            if not t.done():
                t.cancel()
        for owner, t in sends.items():
            try:
                stats["sent"] += await t
            except asyncio.CancelledError:
                pass
            except Exception as e:  # noqa: BLE001 - the votes decide what counts
                log.info("%s: part to %s failed: %r", self.peer_id, owner, e)
        try:
            if gather["decision"] == "retry":
                return ("retry", gather["attempt"], gather["group"])
            if gather["decision"] != "ok":
                raise _RoundFail(gather.get("reason", "round failed"))
            contributors = list(gather["contributors"])
            diverged = tuple(str(d) for d in gather.get("diverged") or ())
            self._diverged = set(diverged)
            missing = [c for c in contributors if c not in st.received]
            if missing:  # cannot happen with an honest rendezvous
                raise _RoundFail(f"contributors {missing} not received here")
            tag = contributors_tag(contributors)
            if mine.get("tag") != tag:  # the optimistic result is not the round's
                for t in mine.get("pushes", ()):
                    t.cancel()
                mine.clear()
                self._reduce_and_push(st, tuple(contributors), membership, deadline, mine)
            st.received.clear()

            # phase 2: all-gather (result parts pushed to us by their owners) ------------------
            out = mine.pop("out")
            shas = {st.me: mine["digest"]}
            t_gather = min(time.monotonic() + self.timeouts.part, deadline)
            others = [k for k in range(n) if k != st.me]
            while True:
                have = [k for k in others if (k, tag) in st.results]
                left = t_gather - time.monotonic()
                if (
                    len(have) == len(others)
                    or left <= 0
                    or {group[k] for k in others if k not in have} <= self._gone.get((r, a), set())
                ):
                    break  # complete, the deadline, or the owners still missing left the run
                st.result_arrived.clear()
                arrived = asyncio.ensure_future(st.result_arrived.wait())
                gone = self._gone_wait()
                try:
                    await asyncio.wait({arrived, gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    arrived.cancel()
                    gone.cancel()
            st.gather_closed = True
            for k in have:
                lo, hi = bounds[k]
                part, shas[k] = st.results[(k, tag)]
                out[lo:hi] = part
            st.results.clear()
            failed_owners = sorted(group[k] for k in others if k not in have)
            ok = not failed_owners
            if not ok:
                log.info("%s: all-gather: no result part from %s", self.peer_id, failed_owners)
            for t in mine.get("pushes", ()):  # delivered, or the commit vote says otherwise
                if t.done() and not t.cancelled() and t.exception() is None:
                    stats["sent"] += t.result()
            stats["received"] += st.bytes_in
            st.bytes_in = 0
            # the result is a pure function of the encoded result parts: hash their digests
            digest = result_digest([shas[k] for k in range(n)]) if ok else ""
            commit = await self._vote(
                r, epoch, a, "commit", {"ok": ok, "digest": digest, "failed_owners": failed_owners}, deadline
            )
            if commit["decision"] == "retry":
                return ("retry", commit["attempt"], commit["group"])
            if commit["decision"] != "commit":
                raise _RoundFail(commit.get("reason", "round failed"))
            self._next = commit.get("next")
            if not ok:  # pragma: no cover - the rendezvous commits only if everyone is ok
                raise _RoundFail("all-gather failed here")
            return ("ok", out, contributors, mine["total"], digest, diverged)
        finally:
            st.gather_closed = True
            for t in mine.get("pushes", ()):
                if not t.done():
                    t.cancel()

    async def _arrival(self, deadline: float, r: int) -> dict[str, Any]:
        """Tells the rendezvous this member is at round ``r`` (handed out with the last commit):
        the round's part clock starts. Returns the answer (``{}`` when none came)."""
        payload = {**self._hello(), "after": r - 1, "arrive": r}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return {}
            try:
                return await self._rv("POST", "/rounds/begin", payload, left)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                log.debug("%s: arrival at round %d: %r", self.peer_id, r, e)
                await asyncio.sleep(min(0.25, max(left, 0)))
            except Exception as e:  # noqa: BLE001 - only a hint; the votes decide
                log.info("%s: arrival at round %d refused: %r", self.peer_id, r, e)
                return {}

    def _arrived(self, arrive: asyncio.Task[Any], r: int, t_part: float) -> float:
        """The part deadline after the answer to our begin (arrival) request of round ``r``."""
        res = arrive.result()
        if res.get("round") != r:  # the round ended already (a fast peer) or was retried
            log.debug("%s: rendezvous answered round %s to our arrival in %d", self.peer_id, res.get("round"), r)
            return t_part
        return time.monotonic() + float(res.get("part_left", self.timeouts.part))

    def _reduce_and_push(
        self,
        st: _Attempt,
        contributors: tuple[str, ...],
        membership: dict[str, str],
        deadline: float,
        mine: dict[str, Any],
    ) -> None:
        """Reduce own part over ``contributors``, encode it once, and push it to every other
        member (tasks in ``mine["pushes"]``); ``mine`` also gets the tag, digest, total weight
        and the round's output buffer with this part filled in."""
        plen = st.hi - st.lo
        mean, total = mean_of_scaled(st.received, contributors, out=self._scratch[plen : 2 * plen])
        tag = contributors_tag(contributors)
        data = encode_part(f"result{st.me}", mean, self.codec, **self.codec_options)
        digest = _auth.body_digest(data)
        out = np.empty(st.bounds[-1][1], dtype=np.float32)
        if self.codec == "fp32":  # lossless: decode(encode(mean)) == mean bit for bit
            out[st.lo : st.hi] = mean
        else:
            out[st.lo : st.hi] = decode_part(data, name=f"result{st.me}", length=st.hi - st.lo, codec=self.codec)
        del mean
        t_end = min(time.monotonic() + self.timeouts.part, deadline)
        mine.update(
            tag=tag,
            digest=digest,
            total=total,
            out=out,
            pushes=[
                asyncio.ensure_future(self._push_result(st, membership[g], data, digest, tag, t_end - time.monotonic()))
                for k, g in enumerate(st.group)
                if k != st.me and g in membership
            ],
        )

    # ------------------------------------------------------------------ ring variant
    async def _h_put_ring(self, request: web.Request) -> web.Response:
        """One segment of one ring step from the left neighbour, streamed into its decoder."""
        weight_s = request.headers.get(H_WEIGHT, "")
        manifest = request.headers.get(H_MANIFEST, "")
        sender, claimed = self._auth_request(request, extra=f"{weight_s}|{manifest}")
        phase = request.match_info["phase"]
        try:
            r, a, step, j = (
                int(request.match_info["round"]),
                int(request.match_info["attempt"]),
                int(request.match_info["step"]),
                int(request.match_info["seg"]),
            )
            w = np.float32(float(weight_s))
        except ValueError:
            raise web.HTTPBadRequest(text="bad round, attempt, step, segment or weight") from None
        if phase not in ("rs", "ag") or not (np.isfinite(w) and w > 0):
            raise web.HTTPBadRequest(text="bad phase or weight")
        st = await self._wait_entered(r, a)
        n = len(st.group)
        if st.algorithm != "ring" or manifest != st.manifest:
            raise web.HTTPBadRequest(text="part does not match the round manifest")
        if sender != st.group[(st.me - 1) % n]:
            raise web.HTTPForbidden(text="only the left neighbour sends ring messages")
        if not 0 <= step < n - 1 or not 0 <= j < len(st.segments[0]):
            raise web.HTTPBadRequest(text="bad ring step or segment")
        key = (phase, step, j)
        if key in st.ring_seen or key in st.ring_receiving or st.closed:
            raise web.HTTPConflict(text="duplicate or late ring message")
        c = (st.me - 1 - step) % n if phase == "rs" else (st.me - step) % n
        lo, hi = st.segments[c][j]
        limit = max_message_bytes(hi - lo)
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        dec = PartDecoder(name=f"ring{phase}{c}.{j}", length=hi - lo, codec=st.codec, max_bytes=limit)
        h = _auth.body_hasher()
        # all-gather messages are forwarded unchanged to the right, except at the last step
        raw = bytearray() if phase == "ag" and step < n - 2 else None
        st.ring_receiving.add(key)
        try:
            async for chunk, _ in request.content.iter_chunks():
                h.update(chunk)
                dec.feed(chunk)
                if raw is not None:
                    raw += chunk
                if st.closed:
                    raise web.HTTPConflict(text="too late")
            if not _auth.digest_matches(claimed, h.hexdigest()):
                raise web.HTTPUnauthorized(text="body does not match its signed digest")
            vec = dec.finish()
        except (WireFormatError, NonFiniteError) as e:
            if dec.nbytes > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=dec.nbytes) from None
            raise web.HTTPBadRequest(text=f"bad ring message: {e}") from None
        except (
            aiohttp.ClientPayloadError,
            ConnectionError,
            asyncio.IncompleteReadError,
            aiohttp.http_exceptions.HttpProcessingError,
        ):
            raise web.HTTPBadRequest(text="body cut off") from None
        finally:
            st.ring_receiving.discard(key)
        if st.closed:
            raise web.HTTPConflict(text="too late")
        st.ring_seen.add(key)
        st.ring_inbox[key] = (w, vec, raw if raw is not None else b"", h.hexdigest())
        st.bytes_in += dec.nbytes
        st.ring_event(phase, step, j).set()
        return json_response(request, self._token, self.run_id, self.peer_id, {"ok": True})

    async def _ring_send(
        self,
        st: _Attempt,
        addr: str,
        phase: str,
        step: int,
        j: int,
        data: Any,
        weight: np.float32,
        timeout: float,
        digest: str | None = None,
    ) -> int:
        """One signed PUT of segment ``j`` of ring step ``step``; ``data`` is the encoded bytes
        or a function that encodes them (called once a send slot is free, so that at most
        ``RING_INFLIGHT`` encoded messages wait per peer); ``digest``: its body digest when
        known (a forwarded message: no second hash pass)."""
        path = f"/v1/runs/{self.run_id}/rounds/{st.round}/{st.attempt}/ring/{phase}/{step}/{j}"
        weight_s = repr(float(weight))
        t_end = time.monotonic() + timeout
        async with self._ring_slots:
            if callable(data):
                data = data()
            return await self._put(
                st,
                addr.rstrip("/") + path,
                path,
                data,
                digest or _auth.body_digest(data),
                f"{weight_s}|{st.manifest}",
                {H_WEIGHT: weight_s, H_MANIFEST: st.manifest},
                t_end - time.monotonic(),
            )

    async def _ring_phase(self, st: _Attempt, t_end: float, segment: Callable[..., Any], stats: dict[str, int]) -> None:
        """Run ``segment(j, send)`` for every segment j concurrently (the pipeline: segment j
        moves on to its next step as soon as its own message of this step has arrived) until
        all are done and every PUT they started (``send(coro)``) was answered. Raises the first
        failure of any of them, or ``asyncio.TimeoutError`` at ``t_end``; cancels the rest."""
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[BaseException] = loop.create_future()
        sends: list[asyncio.Future[int]] = []

        def watch(t: asyncio.Future[Any]) -> None:
            if not t.cancelled() and t.exception() is not None and not failed.done():
                failed.set_result(t.exception())  # type: ignore[arg-type]

        def send(coro: Any) -> None:
            t = asyncio.ensure_future(coro)
            t.add_done_callback(watch)
            sends.append(t)

        tasks = [asyncio.ensure_future(segment(j, send)) for j in range(len(st.segments[0]))]
        for t in tasks:
            t.add_done_callback(watch)
        try:
            while True:
                pending = [t for t in (*tasks, *sends) if not t.done()]
                if failed.done():
                    raise failed.result()
                if not pending:
                    return
                left = t_end - time.monotonic()
                if left <= 0:
                    raise TimeoutError("ring phase deadline")
                await asyncio.wait([failed, *pending], timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # a segment task that ends while we cancel may still start a send: repeat until
            # every task is done (segment tasks start no sends once done, so this ends)
            while rest := [t for t in (*tasks, *sends) if not t.done()]:
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)
            stats["sent"] += sum(t.result() for t in sends if not t.cancelled() and t.exception() is None)

    async def _ring_attempt(
        self,
        st: _Attempt,
        membership: dict[str, str],
        epoch: str,
        vec: np.ndarray,
        weight: np.float32,
        deadline: float,
        stats: dict[str, int],
        state: tuple[int, str] | None = None,
    ) -> tuple[Any, ...]:
        """Pipelined ring: every part is cut into S segments (``st.segments``), each segment its
        own encoded message and PUT; segment j of step s + 1 leaves as soon as segment j of step
        s has arrived (and, in the reduce-scatter, been added), while later segments of step s
        are still on the wire. Per element the float32 arithmetic is the unsegmented ring's."""
        r, a, group, n, i = st.round, st.attempt, st.group, len(st.group), st.me
        right = membership.get(group[(i + 1) % n], "")
        segs = st.segments
        out = np.empty(vec.size, dtype=np.float32)
        shas: dict[tuple[int, int], str] = {}
        own: dict[int, bytes] = {}
        totals: dict[int, np.float32] = {}
        opts = self.codec_options

        def wait(phase: str, s: int, j: int, t_end: float) -> Any:
            return asyncio.wait_for(st.ring_event(phase, s, j).wait(), max(t_end - time.monotonic(), 0))

        t_rs = min(time.monotonic() + self.timeouts.part, deadline)

        async def reduce_scatter(j: int, send: Callable[[Any], None]) -> None:
            # partial weighted sums of segment j of one part, passed to the right, n - 1 steps
            c = i
            lo, hi = segs[c][j]
            num = vec[lo:hi] * weight
            acc_w = weight
            for s in range(n - 1):
                send(
                    self._ring_send(
                        st,
                        right,
                        "rs",
                        s,
                        j,
                        lambda c=c, num=num: encode_part(f"ringrs{c}.{j}", num, self.codec, **opts),
                        acc_w,
                        t_rs - time.monotonic(),
                    )
                )
                await wait("rs", s, j, t_rs)
                in_w, in_num, _, _ = st.ring_inbox.pop(("rs", s, j))
                c = (i - s - 1) % n
                lo, hi = segs[c][j]
                num = np.multiply(vec[lo:hi], weight)
                np.add(in_num, num, out=num)  # in_num + w * x, as the unsegmented ring
                acc_w = np.float32(in_w + weight)
            mean = np.divide(num, acc_w, out=num)
            data = encode_part(f"ringag{c}.{j}", mean, self.codec, **opts)
            lo, hi = segs[c][j]
            out[lo:hi] = (
                mean
                if self.codec == "fp32"
                else decode_part(data, name=f"ringag{c}.{j}", length=hi - lo, codec=self.codec)
            )
            shas[(c, j)] = _auth.body_digest(data)
            own[j], totals[j] = (data, shas[(c, j)]), acc_w

        complete = True
        try:
            await self._ring_phase(st, t_rs, reduce_scatter, stats)
        except (TimeoutError, aiohttp.ClientError, HTTPStatusError, PermissionError, OSError) as e:
            log.info("%s: ring reduce-scatter failed: %r", self.peer_id, e)
            complete = False
        vote: dict[str, Any] = {"received": list(group) if complete else [], "ring": True}
        if state is not None:
            vote["state"] = list(state)
        gather = await self._vote(r, epoch, a, "gather", vote, deadline)
        if gather["decision"] == "retry":
            return ("retry", gather["attempt"], gather["group"])
        if gather["decision"] != "ok":
            raise _RoundFail(gather.get("reason", "round failed"))
        diverged = tuple(str(d) for d in gather.get("diverged") or ())
        self._diverged = set(diverged)
        if not complete:  # cannot happen with an honest rendezvous
            raise _RoundFail("ring: gather decided ok without this peer's parts")
        total = totals[0]

        # all-gather: forward the encoded final segments unchanged as they arrive, n - 1 steps
        t_ag = min(time.monotonic() + self.timeouts.part, deadline)

        async def all_gather(j: int, send: Callable[[Any], None]) -> None:
            cur, sha = own.pop(j)
            for s in range(n - 1):
                send(self._ring_send(st, right, "ag", s, j, cur, np.float32(1.0), t_ag - time.monotonic(), sha))
                await wait("ag", s, j, t_ag)
                _, part, cur, sha = st.ring_inbox.pop(("ag", s, j))
                k = (i - s) % n
                lo, hi = segs[k][j]
                out[lo:hi] = part
                shas[(k, j)] = sha

        ok = True
        try:
            await self._ring_phase(st, t_ag, all_gather, stats)
        except (TimeoutError, aiohttp.ClientError, HTTPStatusError, PermissionError, OSError) as e:
            log.info("%s: ring all-gather failed: %r", self.peer_id, e)
            ok = False
        stats["received"] += st.bytes_in
        st.bytes_in = 0
        digest = result_digest([shas[(k, j)] for k in range(n) for j in range(len(segs[0]))]) if ok else ""
        commit = await self._vote(r, epoch, a, "commit", {"ok": ok, "digest": digest, "failed_owners": []}, deadline)
        st.ring_inbox.clear()
        if commit["decision"] == "retry":
            return ("retry", commit["attempt"], commit["group"])
        if commit["decision"] != "commit":
            raise _RoundFail(commit.get("reason", "round failed"))
        return ("ok", out, list(group), total, digest, diverged)


async def _raise(e: BaseException) -> None:
    raise e
