"""The transport: authenticated, streamed messages between the peers of one run and to its
rendezvous, over one aiohttp client session and this peer's aiohttp server.

Every request and answer is signed with the run token (HMAC-SHA256 over method, path, run, peer,
nonce and the SHA-256 of the body, see ``_auth.py``). Binary bodies stream both ways: a sender
yields its buffer in chunks (no copy), a receiver hashes and decodes each chunk as the socket
delivers it (:meth:`Transport.read_stream`, the one body reader of the butterfly, the ring and
the pipeline activations). The all-reduce algorithms, the state transfer and the pipeline
activations are users of this layer; none of them signs, hashes or opens connections itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import ssl as _ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import aiohttp.http_exceptions
from aiohttp import web

from ..wire import _auth, _relay
from ..wire._codec import NonFiniteError, WireFormatError
from ..wire._http import HTTPStatusError, json_response, read_signed, serve_body, signed_json, verify_request
from ..wire._relay import relay_address
from ..wire._types import TLS, SwarmError, Timeouts
from ._allreduce import CHUNK

log = logging.getLogger("ravnest_jax.swarm")

READ_BUFSIZE = 1 << 22  # bytes buffered per connection before reading pauses
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def why(e: BaseException | None) -> str:
    """One short line for a connection error (aiohttp's repr spans a screen)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return str(e.os_error.strerror or e.os_error)
    return "no answer" if e is None else f"{type(e).__name__}: {e}"


class Transport:
    """Signed, streamed requests between this peer, the other peers of its run and the rendezvous.

    Args:
      rendezvous_url: base URL of the rendezvous (no trailing ``/``).
      run_id: the run; every path is under ``/v1/runs/{run_id}``.
      token: the run token (bytes, non-empty): signs and verifies every message.
      peer_id: this peer's id (the signer of what it sends).
      timeouts: the swarm's deadlines (seconds): ``connect`` of every connection here, the others
        for the parts of the peer that use this transport.
      listen: ``(host, port)`` to bind; port 0 picks a free one (see :attr:`port`); ``None``:
        client-only (no inbound port: the server listens on a private Unix socket only, and
        other peers reach this one through the rendezvous' relay, see :meth:`relay_pump`).
      tls: HTTPS (:class:`~ravnest_jax.swarm.TLS`: the server-side ``ssl.SSLContext`` or
        ``None``, the ``ssl=`` of outgoing requests, ``None``: aiohttp's defaults).
      advertise: the base URL other peers use to reach this one (default: guessed, see
        :meth:`start`).

    Routes are added with :meth:`route` before :meth:`start`. All methods but the constructor,
    :meth:`route` and :meth:`verify` run on the swarm's event loop.
    """

    def __init__(
        self,
        *,
        rendezvous_url: str,
        run_id: str,
        token: bytes,
        peer_id: str,
        timeouts: Timeouts,
        listen: tuple[str, int] | None,
        tls: TLS,
        advertise: str | None = None,
    ):
        self.rendezvous_url, self.run_id, self.peer_id = rendezvous_url, run_id, peer_id
        self.token = token
        self.timeouts = timeouts
        self._listen = listen
        self._ssl: _ssl.SSLContext | None = tls.server
        self.client_ssl = tls.client
        self._advertise = advertise
        self._nonces = _auth.NonceCache()
        self._routes: list[tuple[str, str, Handler]] = [("GET", "/health", self._h_health)]
        self.port: int | None = None
        self.address: str | None = None
        self.session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.client_only = listen is None  # reached through the relay (set again by become_client_only)
        self._unix_path: str | None = None
        self.relay_stats = {"messages": 0, "bytes_in": 0, "bytes_out": 0, "seconds": 0.0}

    # ------------------------------------------------------------------ server
    def route(self, method: str, path: str, handler: Handler) -> None:
        """Serve ``handler`` at ``path`` (relative to ``/v1/runs/{run_id}``, aiohttp route syntax)."""
        self._routes.append((method, "/v1/runs/{run_id}" + path, handler))

    async def start(self) -> None:
        """Opens the client session and binds the server.

        Raises:
          SwarmError: the listen address cannot be bound (one line naming it and why).
        """
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, ssl=self.client_ssl if self.client_ssl is not None else True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect),
            read_bufsize=READ_BUFSIZE,
        )
        app = web.Application(client_max_size=1 << 20)
        for method, path, handler in self._routes:
            app.router.add_route(method, path, handler)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=1.0, read_bufsize=READ_BUFSIZE
        )
        await self._runner.setup()
        if self._listen is None:  # client-only: a Unix socket in the abstract namespace (no file)
            self._unix_path = f"\0ravnest-jax-{os.getpid()}-{self.peer_id}-{secrets.token_hex(4)}"
            await web.UnixSite(self._runner, self._unix_path).start()
            self.address = relay_address(self.rendezvous_url, self.run_id, self.peer_id)
            return
        site = web.TCPSite(self._runner, self._listen[0], self._listen[1], ssl_context=self._ssl, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            raise SwarmError(f"cannot listen on {self._listen[0]}:{self._listen[1]}: {e.strerror or e}") from None
        server = site._server
        assert server is not None and server.sockets  # asyncio's or uvloop's Server
        self.port = server.sockets[0].getsockname()[1]
        self.address = self._advertise or self._guess_address()

    def become_client_only(self) -> None:
        """Nobody can reach this peer at its address (the rendezvous' probe said so): from now
        on it advertises its relay mailbox; :meth:`relay_pump` must run."""
        self.client_only = True
        self.address = relay_address(self.rendezvous_url, self.run_id, self.peer_id)

    async def stop(self) -> None:
        """Stops the server and closes the session (idempotent)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.session is not None:
            await self.session.close()
            self.session = None
            # let the connector's transports finish closing before the loop stops (aiohttp's
            # graceful-shutdown advice); otherwise they are reported as unclosed at GC time
            await asyncio.sleep(0.1)

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        """A request's deadline: ``total`` seconds (at least 50 ms), the connect deadline."""
        return aiohttp.ClientTimeout(total=max(total, 0.05), sock_connect=self.timeouts.connect)

    def _guess_address(self) -> str:
        host = self._listen[0]
        if host in ("0.0.0.0", "::", ""):
            u = urllib.parse.urlsplit(self.rendezvous_url)
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((u.hostname or "127.0.0.1", u.port or 80))  # no packet is sent
                    host = s.getsockname()[0]
            except OSError:
                host = "127.0.0.1"
        return self._url(host)

    def _url(self, host: str) -> str:
        """The base URL of this peer's server at ``host``."""
        return f"{'https' if self._ssl is not None else 'http'}://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def _h_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "peer_id": self.peer_id})

    # ------------------------------------------------------------------ client-only: the relay pump
    async def relay_pump(self, spawn: Callable[[Any], Any], concurrency: int = 64) -> None:
        """Collects the requests the rendezvous' relay holds for this peer (long polls, outbound
        only), hands each to this peer's own server and posts the answer back. Runs until
        cancelled; a failed poll is retried after a short pause."""
        assert self.session is not None
        if self._unix_path is not None:
            local = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self._unix_path))
            base = "http://localhost"
        else:
            host = self._listen[0] if self._listen and self._listen[0] not in ("0.0.0.0", "::", "") else "127.0.0.1"
            local = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=False))
            base = self._url(host)
        slots = asyncio.Semaphore(concurrency)
        poll = self.path("/relay/poll")
        try:
            while True:
                headers = self._sign("GET", poll)
                try:
                    async with self.session.get(
                        self.rendezvous_url + poll,
                        params={"wait": "20"},
                        headers=headers,
                        ssl=self.client_ssl,
                        timeout=self._timeout(40),
                    ) as resp:
                        if resp.status == 204:
                            continue
                        if resp.status != 200:
                            raise HTTPStatusError(resp.status, (await resp.content.read(4096)).decode(errors="replace"))
                        msg = (
                            resp.headers[_relay.H_ID],
                            resp.headers[_relay.H_METHOD],
                            resp.headers[_relay.H_PATH],
                            json.loads(resp.headers[_relay.H_HEADERS]),
                            await resp.read(),
                        )
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - the rendezvous restarting, a hiccup: poll again
                    log.debug("%s: relay poll failed: %r", self.peer_id, e)
                    await asyncio.sleep(0.5)
                    continue
                await slots.acquire()
                task = spawn(self._serve_relayed(local, base, *msg))
                task.add_done_callback(lambda _t: slots.release())
        finally:
            await local.close()

    async def _serve_relayed(
        self, local: aiohttp.ClientSession, base: str, mid: str, method: str, path: str, headers: dict, body: bytes
    ) -> None:
        """One relayed request: through this peer's own server, then its answer to the relay."""
        t0 = time.monotonic()
        try:
            async with local.request(
                method,
                base + path,
                headers=headers,
                data=body,
                timeout=aiohttp.ClientTimeout(total=self.timeouts.round),
            ) as resp:
                status, answer = resp.status, await resp.read()
                out_headers = _relay.forwarded_headers(resp.headers)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            status, answer, out_headers = 502, f"relayed request failed at the peer: {why(e)}".encode(), {}
        reply = self.path(f"/relay/reply/{mid}")
        signed = self._sign("POST", reply, body_digest=_auth.body_digest(answer))
        signed[_relay.H_STATUS] = str(status)
        signed[_relay.H_HEADERS] = json.dumps(out_headers, separators=(",", ":"))
        try:
            assert self.session is not None
            async with self.session.post(
                self.rendezvous_url + reply,
                data=answer,
                headers=signed,
                ssl=self.client_ssl,
                timeout=self._timeout(self.timeouts.round),
            ) as r:
                await r.read()
            st = self.relay_stats
            st["messages"] += 1
            st["bytes_in"] += len(body)
            st["bytes_out"] += len(answer)
            st["seconds"] += time.monotonic() - t0
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.info("%s: relay answer to %s failed: %s", self.peer_id, path, why(e))

    # ------------------------------------------------------------------ receiving
    def verify(self, request: web.Request, extra: str = "") -> tuple[str, str]:
        """Checks a request's run and signature; returns ``(sender peer id, claimed body digest)``.

        Raises:
          web.HTTPNotFound: another run's path. web.HTTPUnauthorized: a bad or replayed signature.
        """
        if request.match_info.get("run_id") != self.run_id:
            raise web.HTTPNotFound(text="unknown run")
        return verify_request(request, self.token, self.run_id, self._nonces, extra)

    async def read_stream(
        self,
        request: web.Request,
        dec: Any,
        claimed: str,
        limit: int,
        stop: Callable[[], bool],
        raw: bytearray | None = None,
        what: str = "part",
    ) -> tuple[Any, str]:
        """Streams a signed binary body into the decoder ``dec`` (``feed``/``finish``/``nbytes``:
        a ``PartDecoder``, ``RangeDecoder`` or ``ActivationDecoder``): one pass that hashes (the
        signed body digest) and feeds each chunk as the socket delivers it (no re-chunking, no
        whole-body copy); ``raw`` also gets the bytes (a message forwarded unchanged).

        Returns:
          ``(dec.finish(), hex digest of the body)`` (the digest equals the signed one).

        Raises (the HTTP error the sender gets):
          web.HTTPConflict: ``stop()`` became true (too late). web.HTTPUnauthorized: the body
          does not match its signed digest. web.HTTPRequestEntityTooLarge: over ``limit`` bytes.
          web.HTTPBadRequest: a malformed, non-finite, truncated or corrupt body, or one cut off
          mid-way.
        """

        def feed(chunk: memoryview) -> None:
            dec.feed(chunk)
            if raw is not None:
                raw.extend(chunk)
            if stop():
                raise web.HTTPConflict(text="too late")

        try:
            sha = await read_signed(request, claimed, limit, feed)
            return dec.finish(), sha
        except (WireFormatError, NonFiniteError) as e:
            raise web.HTTPBadRequest(text=f"bad {what}: {e}") from None
        except (
            aiohttp.ClientPayloadError,
            ConnectionError,
            asyncio.IncompleteReadError,
            aiohttp.http_exceptions.HttpProcessingError,
        ) as e:
            # the sender vanished mid-body (killed, network gone): nothing was stored
            log.info("%s: body from %s cut off: %r", self.peer_id, request.headers.get(_auth.H_PEER), e)
            raise web.HTTPBadRequest(text="body cut off") from None

    def reply(self, request: web.Request, payload: Any) -> web.Response:
        """A signed JSON answer to ``request``."""
        return json_response(request, self.token, self.run_id, self.peer_id, payload)

    async def serve(
        self, request: web.Request, body: Body, digest: str, what: str, header: tuple[str, str] | None = None
    ) -> web.StreamResponse:
        """A signed binary answer to ``request``: ``body`` (its digest ``digest``) streamed
        without copying; ``header``: ``(name, value)`` sent too, its value covered by the
        signature. A requester that goes away mid-body is one INFO line naming ``what``."""
        headers = self._sign("RESPONSE", request.path, body_digest=digest, extra=header[1] if header else "")
        headers.update([header] if header else [])
        return await serve_body(request, headers, body, CHUNK, me=self.peer_id, what=what)

    def _sign(self, method: str, path: str, **kw: Any) -> dict[str, str]:
        """This peer's signature headers of a request (or, ``"RESPONSE"``, an answer) to ``path``."""
        return _auth.sign(self.token, method=method, path=path, run_id=self.run_id, peer=self.peer_id, **kw)

    # ------------------------------------------------------------------ sending
    def path(self, rest: str) -> str:
        """The full path of ``rest`` under this run: ``/v1/runs/{run_id}{rest}``."""
        return f"/v1/runs/{self.run_id}{rest}"

    async def rendezvous(
        self, method: str, rest: str, payload: Any, total: float, round_: int | None = None, address: str | None = None
    ) -> Any:
        """One signed JSON request to the rendezvous (or to the peer at ``address``: the
        pipeline's abort); returns its verified JSON answer.

        Raises:
          HTTPStatusError: a non-200 answer. PermissionError: an answer not signed with the token.
          TimeoutError, aiohttp.ClientError, OSError: no answer in ``total`` seconds.
        """
        assert self.session is not None
        return await signed_json(
            self.session,
            address or self.rendezvous_url,
            method,
            self.path(rest),
            token=self.token,
            run_id=self.run_id,
            peer=self.peer_id,
            payload=payload,
            round_=round_,
            ssl=self.client_ssl,
            timeout=self._timeout(total),
        )

    async def body_chunks(self, data: Body, kind: str) -> AsyncIterator[memoryview]:
        """The chunks a PUT of ``data`` streams (views, no copy). ``kind`` names the message
        (``"part"``, ``"result"``, ``"ring"``); a test transport overrides this to send slowly."""
        for mv in as_buffers(data):
            for off in range(0, len(mv), CHUNK):
                yield mv[off : off + CHUNK]

    async def put(
        self,
        address: str,
        rest: str,
        data: Body,
        *,
        digest: str,
        round_: int,
        headers: dict[str, str],
        timeout: float,
        kind: str,
    ) -> int:
        """One signed, streamed PUT of ``data`` (bytes, or a message as a list of buffers, sent
        without copying; body digest ``digest``; ``headers``: sent, and their values, joined
        with ``|``, covered by the signature too) to the peer at ``address``, over the
        session's keep-alive connections.

        Returns:
          the bytes sent, once the receiver answered 200.

        Raises:
          HTTPStatusError: any other answer. TimeoutError, aiohttp.ClientError, OSError.
        """
        assert self.session is not None
        path, size = self.path(rest), body_nbytes(data)
        signed = self._sign("PUT", path, round_=round_, body_digest=digest, extra="|".join(headers.values()))
        signed.update(headers, **{"Content-Length": str(size), "Content-Type": "application/octet-stream"})
        async with self.session.put(
            self._hop("PUT", address, path, signed),
            data=self.body_chunks(data, kind),
            headers=signed,
            ssl=self.client_ssl,
            timeout=self._timeout(timeout),
        ) as resp:
            text = await resp.content.read(4096)
            if resp.status != 200:
                raise HTTPStatusError(resp.status, text.decode(errors="replace"))
        return size

    async def get_stream(
        self,
        address: str,
        rest: str,
        timeout: float,
        max_bytes: int,
        header: str | None,
        feed: Callable[[memoryview], None],
    ) -> tuple[str, str]:
        """One signed GET whose answer streams into ``feed`` chunk by chunk as it arrives (its
        signature checked before the first chunk, its body digest after the last).

        Returns:
          ``(hex digest of the body, value of the answer's header ``header`` or "")``.

        Raises:
          HTTPStatusError: a non-200 answer, or a body over ``max_bytes`` (502).
          PermissionError: an answer not signed with the run token, or a body that does not
          match its signed digest. TimeoutError, aiohttp.ClientError, OSError; what ``feed``
          raises.
        """
        assert self.session is not None
        path = self.path(rest)
        headers = self._sign("GET", path)
        async with self.session.get(
            self._hop("GET", address, path, headers),
            headers=headers,
            ssl=self.client_ssl,
            timeout=self._timeout(timeout),
        ) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, (await resp.content.read(4096)).decode(errors="replace"))
            value = resp.headers.get(header, "") if header else ""
            try:
                _auth.verify(self.token, resp.headers, method="RESPONSE", path=path, run_id=self.run_id, extra=value)
            except _auth.AuthError as e:
                raise PermissionError(f"answer not signed with the run token: {e}") from None
            if (resp.content_length or 0) > max_bytes:
                raise HTTPStatusError(502, f"answer larger than {max_bytes} bytes")
            h = _auth.body_hasher()
            n = 0
            async for chunk, _ in resp.content.iter_chunks():
                n += len(chunk)
                if n > max_bytes:
                    raise HTTPStatusError(502, f"answer larger than {max_bytes} bytes")
                h.update(chunk)
                feed(memoryview(chunk))
            if not _auth.digest_matches(resp.headers[_auth.H_BODY], h.hexdigest()):
                raise PermissionError("answer does not match its signed digest")
            return h.hexdigest(), value

    def _hop(self, method: str, address: str, path: str, signed: dict[str, str]) -> str:
        """The URL of ``path`` at the peer at ``address``; adds the hop signature (a relay checks
        it) to the request's ``signed`` headers."""
        url = address.rstrip("/") + path
        signed[_auth.H_HOP] = _auth.hop_sign(self.token, method, urllib.parse.urlsplit(url).path, signed)
        return url


Body = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]
"""A message to send: one buffer, or a list of buffers sent one after the other (no copy)."""


def as_buffers(data: Body) -> list[memoryview]:
    """``data`` as a list of byte memoryviews (views, no copy)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = [data]
    return [memoryview(b).cast("B") if memoryview(b).format != "B" else memoryview(b) for b in data]


def body_nbytes(data: Body) -> int:
    """Bytes of a message given as one buffer or a list of buffers."""
    return sum(len(b) for b in as_buffers(data))


def body_digest(data: Body) -> str:
    """The signed body digest of a message given as one buffer or a list of buffers."""
    h = _auth.body_hasher()
    for b in as_buffers(data):
        h.update(b)
    return h.hexdigest()
