"""Global-state download between peers: a peer that joins, missed a round or diverged takes the
current state from a live peer.

``GET /v1/runs/{run}/state`` on a peer's server (signed like every request; the answer is signed
with the body digest) returns the opaque state bytes its training loop provides
(``Swarm.serve_state``). The swarm never looks inside: the sync layer serialises and checks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from . import _auth
from ._allreduce import CHUNK
from ._codec import release_free_heap
from ._http import HTTPStatusError, stream_body
from ._types import SwarmError

log = logging.getLogger("ravnest_jax.swarm")

DEFAULT_MAX_STATE_BYTES = 64 << 30

StateProvider = Callable[[], "concurrent.futures.Future[bytes] | bytes | None"]


class _StateMixin:
    """Methods of :class:`~ravnest_jax.swarm.Swarm` for serving and fetching the global state."""

    _state_provider: StateProvider | None = None
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES

    # ------------------------------------------------------------------ caller thread
    def serve_state(self, provider: StateProvider | None) -> None:
        """Lets other peers download this peer's current global state.

        Args:
          provider: called (in a worker thread) for each authenticated request; returns the
            state bytes, or a ``concurrent.futures.Future`` of them (``rj.OuterSync
            .request_state`` does), or ``None`` when it has none. ``None`` stops serving.
        """
        self._state_provider = provider

    def fetch_state(self, timeout: float = 120.0) -> bytes | None:
        """Downloads the current global state from a live peer of the run.

        Tries the other live peers that train (not on standby), most advanced first (by their
        last round; peers the last round found diverged last), until one answers. A peer that
        has no state yet answers 404 at once; when every peer did, there is nobody to download
        from and the answer is ``None``.

        Args:
          timeout: overall deadline, seconds.

        Returns:
          The state bytes, or ``None`` when no other peer is live or none has a state.

        Raises:
          SwarmError: peers are live but none delivered a state before the deadline.
        """
        loop = self._loop  # type: ignore[attr-defined]
        if loop is None or self._closed:  # type: ignore[attr-defined]
            raise RuntimeError("Swarm is not running")
        # a task that close() cancels: Ctrl+C during a download ends it at once
        fut = asyncio.run_coroutine_threadsafe(self._tracked(self._afetch_state(timeout)), loop)  # type: ignore[attr-defined]
        try:
            return fut.result(timeout=timeout + 5)
        except concurrent.futures.CancelledError:
            raise SwarmError("the swarm closed during the state download") from None

    def round_outcome(self, round_: int) -> str:
        """The rendezvous' outcome of a round: ``"ok"``, ``"failed"``, ``"running"`` or
        ``"unknown"`` (too old, or the rendezvous restarted since). Raises SwarmError when the
        rendezvous cannot be reached."""
        st = self.status()
        for r in st.get("rounds", []):
            if r.get("round") == round_:
                return str(r.get("outcome"))
        return "unknown"

    def status(self) -> dict[str, Any]:
        """The run's status from the rendezvous (peers, membership version, recent rounds)."""
        loop = self._loop  # type: ignore[attr-defined]
        t = self.timeouts.connect * 2  # type: ignore[attr-defined]
        fut = asyncio.run_coroutine_threadsafe(self._rv("GET", "/status", None, t), loop)  # type: ignore[attr-defined]
        try:
            return fut.result(timeout=t + 5)
        except Exception as e:
            raise SwarmError(f"rendezvous unreachable: {e}") from e

    # ------------------------------------------------------------------ loop side
    async def _afetch_state(self, timeout: float) -> bytes | None:
        deadline = asyncio.get_running_loop().time() + timeout
        errors: list[str] = []
        others: list[dict] | None = None
        while True:
            # the members are asked anew every sweep: peers that left (a swarm that finished)
            # are not tried until the deadline
            try:
                members = await self._rv("GET", "/peers", None, self.timeouts.connect * 2)  # type: ignore[attr-defined]
            except (TimeoutError, aiohttp.ClientError, OSError):
                if others is None:
                    raise
                members = None  # the rendezvous restarting: the last list stands
            if members is not None:
                others = [
                    p
                    for p in members["peers"]
                    if p["peer_id"] != self.peer_id  # type: ignore[attr-defined]
                    and not p.get("standby")
                ]
            if not others:
                if errors:
                    log.info("%s: no live peer left to download from: %s", self.peer_id, errors[-3:])  # type: ignore[attr-defined]
                return None
            # most advanced first; a peer the last round found diverged only as a last resort
            avoid = getattr(self, "_diverged", set())
            others.sort(key=lambda p: (p["peer_id"] in avoid, -int(p.get("last_round", -1)), p["peer_id"]))
            no_state = 0
            for p in others:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise SwarmError(f"no live peer delivered the state in {timeout} s: {errors[-3:]}")
                try:
                    data = await self._get_state(p["address"], left)
                    log.info("%s: downloaded the state (%d bytes) from %s", self.peer_id, len(data), p["peer_id"])  # type: ignore[attr-defined]
                    return data
                except HTTPStatusError as e:
                    no_state += e.status == 404
                    errors.append(f"{p['peer_id']}: {e!r}")
                except (TimeoutError, aiohttp.ClientError, OSError, PermissionError) as e:
                    errors.append(f"{p['peer_id']}: {e!r}")
            if no_state == len(others):
                log.info("%s: no live peer has a state to download: %s", self.peer_id, errors[-3:])  # type: ignore[attr-defined]
                return None
            await asyncio.sleep(min(0.5, max(deadline - asyncio.get_running_loop().time(), 0)))

    async def _get_state(self, address: str, timeout: float) -> bytes:
        path = f"/v1/runs/{self.run_id}/state"  # type: ignore[attr-defined]
        headers = _auth.sign(self._token, method="GET", path=path, run_id=self.run_id, peer=self.peer_id)  # type: ignore[attr-defined]
        async with self._session.get(  # type: ignore[attr-defined]
            address.rstrip("/") + path,
            headers=headers,
            ssl=self._client_ssl,  # type: ignore[attr-defined]
            timeout=aiohttp.ClientTimeout(total=max(timeout, 0.05), sock_connect=self.timeouts.connect),  # type: ignore[attr-defined]
        ) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, (await resp.content.read(4096)).decode(errors="replace"))
            try:
                _auth.verify(self._token, resp.headers, method="RESPONSE", path=path, run_id=self.run_id)  # type: ignore[attr-defined]
            except _auth.AuthError as e:
                raise PermissionError(f"state answer not signed with the run token: {e}") from None
            if (resp.content_length or 0) > self.max_state_bytes:
                raise HTTPStatusError(502, "state larger than max_state_bytes")
            h = _auth.body_hasher()
            buf = bytearray()
            async for chunk, _ in resp.content.iter_chunks():
                h.update(chunk)
                buf += chunk
                if len(buf) > self.max_state_bytes:
                    raise HTTPStatusError(502, "state larger than max_state_bytes")
            if not _auth.digest_matches(resp.headers[_auth.H_BODY], h.hexdigest()):
                raise PermissionError("state does not match its signed digest")
            return bytes(buf)

    async def _h_get_state(self, request: web.Request) -> web.StreamResponse:
        self._auth_request(request)  # type: ignore[attr-defined]
        provider = self._state_provider
        if provider is None:
            raise web.HTTPNotFound(text="this peer serves no state")
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(None, provider)
            if isinstance(out, concurrent.futures.Future):
                out = await asyncio.wait_for(asyncio.wrap_future(out), self.timeouts.round)  # type: ignore[attr-defined]
        except TimeoutError:
            raise web.HTTPServiceUnavailable(text="state not ready in time") from None
        except Exception as e:  # noqa: BLE001 - reported to the requester
            log.warning("state provider failed: %r", e)
            raise web.HTTPServiceUnavailable(text="state provider failed") from None
        if not out:
            raise web.HTTPNotFound(text="this peer has no state yet")
        body = bytes(out)
        headers = _auth.sign(
            self._token,
            method="RESPONSE",
            path=request.path,
            run_id=self.run_id,  # type: ignore[attr-defined]
            peer=self.peer_id,
            body_digest=_auth.body_digest(body),
        )  # type: ignore[attr-defined]
        try:
            return await stream_body(request, headers, body, CHUNK)
        finally:
            # the copies of a whole state are one-off buffers: give them back to the system
            # (the allocator keeps freed round buffers for reuse; RSS crept up by the state's
            # size in steps on a peer that served many joiners)
            del body, out
            loop.run_in_executor(None, release_free_heap)


__all__ = ["DEFAULT_MAX_STATE_BYTES", "StateProvider"]
