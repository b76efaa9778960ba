"""The rendezvous' relay for client-only peers (behind NAT or a firewall: no inbound port).

A client-only peer advertises ``{rendezvous}/relay/{run}/{peer}`` as its address. A request
another peer sends there is held by the rendezvous (store and forward) until the client-only
peer collects it with a long poll (an outbound request), hands it to its own server, and posts
the answer back; the rendezvous then answers the original request with it. The message itself is
signed end to end (the relay never sees the token-derived keys' ``extra`` and cannot alter a
body: the receiver checks the sender's signature, the sender checks the receiver's); the relay
checks its own hop proof (``X-RJ-Hop``) so that only members of the run can use it.

HTTP API (on the rendezvous):

``*    /relay/{run}/{peer}/v1/runs/{run}/...``  a request to a client-only peer (hop proof)
``GET  /v1/runs/{run}/relay/poll?wait=S``         the next request for the signer (200), or 204
``POST /v1/runs/{run}/relay/reply/{id}``           the answer to request ``id`` (signed)

On a join the rendezvous probes the peer's advertised address (:func:`probe`, ``GET
{address}/health``, at most ``probe_s`` seconds); the join answer's ``reachable: false`` tells a
peer that nobody can reach it there, and it then becomes client-only.

Bounded: at most ``max_queued_bytes`` of bodies held at once (503 beyond), and with
``rate_bytes_s`` a token bucket on the bytes relayed (both directions). Counted per run and
peer: messages, bytes in and out, and seconds from arrival to answer (``stats``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from typing import Any

import aiohttp
from aiohttp import web

from ..wire import _auth
from ..wire._http import read_signed, verify_request
from ..wire._relay import H_HEADERS, H_ID, H_METHOD, H_PATH, H_STATUS, forwarded_headers

log = logging.getLogger("ravnest_jax.swarm.rendezvous")

MAX_POLL_S = 30.0
ANSWER_S = 600.0  # how long a relayed request waits for its answer, seconds (504 after)


async def probe(session: aiohttp.ClientSession | None, address: str, peer: str, timeout_s: float) -> str | None:
    """The rendezvous' reachability probe of a joining peer: ``None`` when a peer answers
    ``GET {address}/health`` within ``timeout_s`` seconds as ``peer``, else why not (one
    line). No probe (``None``) when ``timeout_s`` is 0 or there is no session."""
    if timeout_s <= 0 or session is None:
        return None
    try:
        async with session.get(
            address.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s), ssl=False
        ) as r:
            if r.status != 200:
                return f"HTTP {r.status} from {address}/health"
            body = await r.json(content_type=None)
            if isinstance(body, dict) and body.get("peer_id") not in (None, peer):
                return f"another peer ({body.get('peer_id')}) answers at {address}"
    except TimeoutError:
        return f"no answer from {address} in {timeout_s:g} s"
    except aiohttp.ClientConnectorError as e:
        return str(e.os_error.strerror or e.os_error)
    except (aiohttp.ClientError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@dataclasses.dataclass
class _Message:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))
    answer: asyncio.Future[tuple[int, dict[str, str], bytes]] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclasses.dataclass
class RelayStats:
    """What the relay carried for one client-only peer (cumulative, since it joined)."""

    messages: int = 0
    failed: int = 0
    bytes_in: int = 0  # request bodies towards the peer
    bytes_out: int = 0  # answer bodies from the peer
    seconds: float = 0.0  # sum over messages of arrival -> answer

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 3)}


class _Bucket:
    """A token bucket of ``rate`` bytes/s (burst: one second's worth, at least one message)."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self.level = rate or 0.0
        self.t = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        async with self.lock:
            now = time.monotonic()
            self.level = min(self.rate, self.level + (now - self.t) * self.rate) - n
            self.t = now
            if self.level < 0:
                await asyncio.sleep(-self.level / self.rate)


class Relay:
    """Store-and-forward relay of one rendezvous (see the module docstring).

    Args:
      token: the run token (hop proofs and the client-only peers' signatures).
      is_relayed: ``is_relayed(run_id, peer_id)``: whether that peer is a live member of the
        run that registered the relay address (others get 404).
      max_queued_bytes: the most request bodies held at once, bytes (503 beyond).
      rate_bytes_s: bytes per second relayed at most, both directions together (``None``: no
        bound).
    """

    def __init__(
        self, token: bytes, is_relayed: Any, *, max_queued_bytes: int = 1 << 30, rate_bytes_s: float | None = None
    ):
        self.token, self.is_relayed = token, is_relayed
        self.max_queued_bytes = int(max_queued_bytes)
        self._bucket = _Bucket(rate_bytes_s)
        self._nonces = _auth.NonceCache()
        self._boxes: dict[tuple[str, str], asyncio.Queue[_Message]] = {}
        self._pending: dict[str, tuple[tuple[str, str], _Message]] = {}
        self.queued_bytes = 0
        self.stats: dict[tuple[str, str], RelayStats] = {}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/relay/{run_id}/{peer_id}/{tail:.*}", self._forward)
        app.router.add_get("/v1/runs/{run_id}/relay/poll", self._poll)
        app.router.add_post("/v1/runs/{run_id}/relay/reply/{msg_id}", self._reply)

    def run_stats(self, run_id: str) -> dict[str, Any]:
        """Per relayed peer of ``run_id``: its :class:`RelayStats` as a dict."""
        return {p: s.as_dict() for (r, p), s in sorted(self.stats.items()) if r == run_id}

    def drop(self, run_id: str, peer_id: str) -> None:
        """``peer_id`` left the run (or was evicted): its queued requests are answered 503 at
        once, and its stats are forgotten (they were kept for every relayed id ever seen)."""
        self.stats.pop((run_id, peer_id), None)
        self._boxes.pop((run_id, peer_id), None)
        for key, m in list(self._pending.values()):  # every queued request is pending too
            if key == (run_id, peer_id) and not m.answer.done():
                m.answer.set_exception(web.HTTPServiceUnavailable(text="the relayed peer left the run"))

    # ------------------------------------------------------------------ the sender's side
    async def _forward(self, request: web.Request) -> web.StreamResponse:
        run_id, peer_id, tail = (request.match_info[k] for k in ("run_id", "peer_id", "tail"))
        inner = "/" + tail
        if not inner.startswith(f"/v1/runs/{run_id}/"):
            raise web.HTTPNotFound(text="a relayed path must be under /v1/runs/{run}/ of the same run")
        try:
            _auth.hop_verify(
                self.token, request.headers, method=request.method, url_path=request.path, nonces=self._nonces
            )
        except _auth.AuthError as e:
            raise web.HTTPUnauthorized(text=f"unauthorized: {e}") from None
        if not self.is_relayed(run_id, peer_id):
            raise web.HTTPNotFound(text=f"{peer_id} is not a client-only peer of run {run_id}")
        size = request.content_length or 0
        if self.queued_bytes + size > self.max_queued_bytes:
            raise web.HTTPServiceUnavailable(text=f"relay full ({self.queued_bytes} bytes queued)")
        key = (run_id, peer_id)
        stats = self.stats.setdefault(key, RelayStats())
        self.queued_bytes += size
        t0 = time.monotonic()
        msg: _Message | None = None
        try:
            body = bytearray()
            # a request without a body (a GET) has no stream to read: aiohttp's empty stream
            # answers (b"", True) for ever, a loop that never yields (it stalled the rendezvous)
            while request.body_exists:
                chunk, _ = await request.content.readchunk()
                if not chunk:
                    break
                body += chunk
                if len(body) > size:
                    raise web.HTTPBadRequest(text="body longer than its Content-Length")
            await self._bucket.take(len(body))
            path = inner + (f"?{request.query_string}" if request.query_string else "")
            msg = _Message(request.method, path, forwarded_headers(request.headers), bytes(body))
            del body
            self._pending[msg.id] = (key, msg)
            await self._boxes.setdefault(key, asyncio.Queue()).put(msg)
            try:
                status, headers, data = await asyncio.wait_for(asyncio.shield(msg.answer), ANSWER_S)
            except TimeoutError:
                stats.failed += 1
                raise web.HTTPGatewayTimeout(text=f"the relayed peer did not answer in {ANSWER_S:.0f} s") from None
            except web.HTTPException:
                stats.failed += 1
                raise
            await self._bucket.take(len(data))
            stats.messages += 1
            stats.bytes_in += len(msg.body)
            stats.bytes_out += len(data)
            stats.seconds += time.monotonic() - t0
            return web.Response(status=status, headers=headers, body=data)
        finally:
            self.queued_bytes -= size
            if msg is not None:
                self._pending.pop(msg.id, None)
                if not msg.answer.done():  # the sender gave up: the peer skips it
                    msg.answer.cancel()
                msg.body = b""

    # ------------------------------------------------------------------ the client-only peer's side
    def _signed_by_member(self, request: web.Request) -> tuple[str, str, str]:
        run_id = request.match_info["run_id"]
        peer, body = verify_request(request, self.token, run_id, self._nonces)
        if not self.is_relayed(run_id, peer):
            raise web.HTTPNotFound(text=f"{peer} is not a client-only peer of run {run_id}")
        return run_id, peer, body

    async def _poll(self, request: web.Request) -> web.StreamResponse:
        run_id, peer, _ = self._signed_by_member(request)
        try:
            wait = min(max(float(request.query.get("wait", "20")), 0.0), MAX_POLL_S)
        except ValueError:
            raise web.HTTPBadRequest(text="wait must be a number of seconds") from None
        box = self._boxes.setdefault((run_id, peer), asyncio.Queue())
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await asyncio.wait_for(box.get(), left)
            except TimeoutError:
                break
            if msg.answer.done():  # its sender gave up meanwhile
                continue
            if request.transport is None or request.transport.is_closing():
                await box.put(msg)  # the poller is gone: keep it for the next poll
                raise web.HTTPServiceUnavailable(text="poller gone")
            headers = {
                H_ID: msg.id,
                H_METHOD: msg.method,
                H_PATH: msg.path,
                H_HEADERS: json.dumps(msg.headers, separators=(",", ":")),
            }
            return web.Response(status=200, headers=headers, body=msg.body)
        return web.Response(status=204)

    async def _reply(self, request: web.Request) -> web.Response:
        run_id, peer, claimed = self._signed_by_member(request)
        entry = self._pending.get(request.match_info["msg_id"])
        if entry is None or entry[0] != (run_id, peer):
            raise web.HTTPNotFound(text="no such relayed request (its sender gave up?)")
        _, msg = entry
        try:
            status = int(request.headers.get(H_STATUS, ""))
            headers = json.loads(request.headers.get(H_HEADERS, "{}"))
            if not (100 <= status <= 599 and isinstance(headers, dict)):
                raise ValueError
            headers = forwarded_headers({str(k): str(v) for k, v in headers.items()})
        except (TypeError, ValueError):
            raise web.HTTPBadRequest(text="bad relay answer headers") from None
        data = bytearray()
        await read_signed(request, claimed, self.max_queued_bytes, data.extend)
        if not msg.answer.done():
            msg.answer.set_result((status, headers, bytes(data)))
        return web.json_response({"ok": True})
