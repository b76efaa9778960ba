"""Small helpers shared by the rendezvous and the peers: signed JSON requests and responses."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from . import _auth
from ._types import SwarmError

log = logging.getLogger("ravnest_jax.swarm")

JSON_LIMIT = 1 << 20  # bytes: every control message is far smaller


class HTTPStatusError(Exception):
    """The other side answered with an error status."""

    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:200]}")
        self.status, self.text = status, text


def json_response(
    request: web.Request, token: bytes, run_id: str, me: str, payload: Any, status: int = 200
) -> web.Response:
    """A JSON response signed with the run token (method ``RESPONSE``)."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    headers = _auth.sign(
        token,
        method="RESPONSE",
        path=request.path,
        run_id=run_id,
        peer=me,
        round_=request.headers.get(_auth.H_ROUND),
        body_digest=_auth.body_digest(body),
    )
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")


def verify_request(
    request: web.Request, token: bytes, run_id: str, nonces: _auth.NonceCache, extra: str = ""
) -> tuple[str, str]:
    """Checks ``request``'s signature (:func:`_auth.verify`); returns ``(sender peer id, claimed
    body digest)``.

    Raises:
      web.HTTPUnauthorized: a missing, malformed, stale, replayed or wrong signature.
    """
    try:
        peer, _, body = _auth.verify(
            token, request.headers, method=request.method, path=request.path, run_id=run_id, nonces=nonces, extra=extra
        )
    except _auth.AuthError as e:
        raise web.HTTPUnauthorized(text=f"unauthorized: {e}") from None
    return peer, body


async def read_signed(request: web.Request, claimed: str, limit: int, feed: Callable[[memoryview], Any]) -> str:
    """Streams ``request``'s body into ``feed`` as the socket delivers it, hashing it in the same
    pass (no re-chunking, no whole-body copy); returns its hex digest, equal to the signed one
    (``claimed``).

    Raises:
      web.HTTPRequestEntityTooLarge: over ``limit`` bytes. web.HTTPUnauthorized: the body does
      not match its signed digest. What ``feed`` raises.
    """
    h = _auth.body_hasher()
    n = 0
    # a request without a body (a GET) has no stream: aiohttp's empty stream answers
    # iter_chunks with (b"", True) for ever
    if request.body_exists:
        async for chunk, _ in request.content.iter_chunks():
            n += len(chunk)
            if n > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=n)
            h.update(chunk)
            feed(memoryview(chunk))
    if not _auth.digest_matches(claimed, h.hexdigest()):
        raise web.HTTPUnauthorized(text="body does not match its signed digest")
    return h.hexdigest()


async def read_json_body(request: web.Request, claimed_sha: str) -> Any:
    """Read a small JSON body (at most :data:`JSON_LIMIT` bytes) and check its digest.

    Raises ``web.HTTPRequestEntityTooLarge``, ``web.HTTPUnauthorized`` or ``web.HTTPBadRequest``.
    """
    if (request.content_length or 0) > JSON_LIMIT:
        raise web.HTTPRequestEntityTooLarge(max_size=JSON_LIMIT, actual_size=request.content_length or 0)
    chunks: list[memoryview] = []
    await read_signed(request, claimed_sha, JSON_LIMIT, chunks.append)
    if not chunks:
        return None
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        raise web.HTTPBadRequest(text="body is not JSON") from None


async def signed_json(
    session: aiohttp.ClientSession,
    base_url: str,
    method: str,
    path: str,
    *,
    token: bytes,
    run_id: str,
    peer: str,
    payload: Any = None,
    round_: int | None = None,
    timeout: aiohttp.ClientTimeout,
    ssl: Any = None,
) -> Any:
    """Send a signed JSON request, verify the signed JSON answer and return it.

    Raises:
      HTTPStatusError: the server answered with status >= 400.
      aiohttp.ClientError, asyncio.TimeoutError: transport failures.
      PermissionError: the answer is not signed with the run token.
    """
    body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
    headers = _auth.sign(
        token, method=method, path=path, run_id=run_id, peer=peer, round_=round_, body_digest=_auth.body_digest(body)
    )
    if body:
        headers["Content-Type"] = "application/json"
    async with session.request(
        method, base_url.rstrip("/") + path, data=body or None, headers=headers, timeout=timeout, ssl=ssl
    ) as resp:
        data = await resp.content.read(JSON_LIMIT + 1)
        if len(data) > JSON_LIMIT:
            raise HTTPStatusError(502, "answer too long")
        if resp.status >= 400:
            raise HTTPStatusError(resp.status, data.decode(errors="replace"))
        try:
            _auth.verify(token, resp.headers, method="RESPONSE", path=path, run_id=run_id)
        except _auth.AuthError as e:
            raise PermissionError(f"answer from {base_url} is not signed with the run token: {e}") from None
        if not _auth.digest_matches(resp.headers[_auth.H_BODY], _auth.body_digest(data)):
            raise PermissionError("answer body does not match its signature")
        return json.loads(data) if data else None


async def serve_body(
    request: web.Request, headers: dict[str, str], body: Any, chunk: int, *, me: str, what: str
) -> web.StreamResponse:
    """Answer ``request`` with ``body`` (application/octet-stream: bytes, or a message as a list
    of buffers, not copied) in ``chunk``-byte writes, with the given (signed) headers. A
    requester that goes away mid-body (it died, or gave up) is one INFO line naming it and
    ``what`` was being sent, not aiohttp's traceback of the write."""
    buffers = [memoryview(b).cast("B") for b in ([body] if isinstance(body, (bytes, bytearray, memoryview)) else body)]
    resp = web.StreamResponse(headers=headers)
    resp.content_length = total = sum(len(b) for b in buffers)
    resp.content_type = "application/octet-stream"
    try:
        await resp.prepare(request)
        for mv in buffers:
            for off in range(0, len(mv), chunk):
                await resp.write(mv[off : off + chunk])
        await resp.write_eof()
        return resp
    except ConnectionError as e:
        who = request.headers.get(_auth.H_PEER, "a peer")
        log.info("%s: %s went away mid-download of %s (%d bytes): %s: %s", me, who, what, total, type(e).__name__, e)
        return web.Response(status=499)  # never sent (the connection is gone): aiohttp lets it be


def ask_once(
    url: str,
    run_id: str,
    token: bytes,
    peer: str,
    method: str,
    rest: str,
    payload: Any,
    timeout: float,
    ssl: Any,
    *,
    retry: bool = False,
) -> Any:
    """One signed request to the rendezvous' ``/v1/runs/{run_id}{rest}`` from a swarm that has
    not started (its own short-lived session); the verified JSON answer. ``retry``: connection
    failures are retried until ``timeout`` seconds (a rendezvous that is starting).

    Raises:
      SwarmError: no answer within ``timeout`` seconds, the token refused (401), an error
        answer, or an answer not signed with the token (one line naming the URL).
    """

    async def ask() -> Any:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                left = max(deadline - time.monotonic(), 0.1)
                try:
                    return await signed_json(
                        session,
                        url,
                        method,
                        f"/v1/runs/{run_id}{rest}",
                        token=token,
                        run_id=run_id,
                        peer=peer,
                        payload=payload,
                        ssl=ssl,
                        timeout=aiohttp.ClientTimeout(total=min(left, 5.0) if retry else timeout),
                    )
                except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                    if not retry or time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))

    try:
        return asyncio.run(ask())
    except HTTPStatusError as e:
        if e.status == 401:
            raise SwarmError(
                f"the rendezvous at {url} refused our token (HTTP 401): "
                "every peer and the rendezvous need the same run token"
            ) from None
        raise SwarmError(f"the rendezvous at {url} answered {e}") from None
    except PermissionError as e:
        raise SwarmError(f"{url} is not a rendezvous of this run token: {e}") from None
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise SwarmError(f"rendezvous {url} unreachable after {timeout:.0f} s: {why}") from None
