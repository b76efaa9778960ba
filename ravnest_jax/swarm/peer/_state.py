"""Global-state download between peers: a peer that joins, missed a round or diverged takes the
current state from a live peer.

``GET /v1/runs/{run}/state`` on a peer's server (signed like every request; the answer is signed
with the body digest) returns the opaque state bytes its training loop provides
(``Swarm.serve_state``; ``rj.OuterSync`` registers itself). The swarm never looks inside: the
sync layer serialises and checks. A :class:`StateTransfer` is one user of the transport.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from ravnest_jax.host_memory import release_free_heap

from ..wire import _auth
from ..wire._http import HTTPStatusError
from ..wire._types import SwarmError
from ._transport import Transport

log = logging.getLogger("ravnest_jax.swarm")

DEFAULT_MAX_STATE_BYTES = 64 << 30

StateProvider = Callable[[], "concurrent.futures.Future[bytes] | bytes | None"]


class StateTransfer:
    """Serves this peer's global state and downloads another peer's, over the transport.

    Args:
      transport: the peer's transport (the ``GET /state`` route is added here).
      avoid: returns the peers the last round found diverged (downloaded from last).

    A provider's future may take the round deadline (``transport.timeouts.round``).
    """

    def __init__(self, transport: Transport, avoid: Callable[[], set[str]]):
        self.transport, self._avoid = transport, avoid
        self.provider: StateProvider | None = None
        transport.route("GET", "/state", self._h_get_state)

    async def fetch(self, timeout: float, prefer: str | None = None) -> bytes | None:
        """See :meth:`Swarm.fetch_state` (runs on the loop)."""
        t, me = self.transport, self.transport.peer_id
        deadline = asyncio.get_running_loop().time() + timeout
        errors: list[str] = []
        others: list[dict] | None = None
        while True:
            # the members are asked anew every sweep: peers that left (a swarm that finished)
            # are not tried until the deadline
            try:
                members = await t.rendezvous("GET", "/peers", None, t.timeouts.connect * 2)
            except (TimeoutError, aiohttp.ClientError, OSError):
                if others is None:
                    raise
                members = None  # the rendezvous restarting: the last list stands
            if members is not None:
                others = [p for p in members["peers"] if p["peer_id"] != me and not p.get("standby")]
            if not others:
                if errors:
                    log.info("%s: no live peer left to download from: %s", me, errors[-3:])
                return None
            # most advanced first; a peer the last round found diverged only as a last resort
            avoid = self._avoid()
            # (and a client-only peer after the reachable ones: its state comes through the relay)
            others.sort(
                key=lambda p: (
                    p["peer_id"] != prefer if prefer else False,
                    p["peer_id"] in avoid,
                    bool(p.get("relayed")),
                    -int(p.get("last_round", -1)),
                    p["peer_id"],
                )
            )
            no_state = 0
            for p in others:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise SwarmError(f"no live peer delivered the state in {timeout} s: {errors[-3:]}")
                try:
                    buf = bytearray()
                    await t.get_stream(p["address"], "/state", left, DEFAULT_MAX_STATE_BYTES, None, buf.extend)
                    data = bytes(buf)
                    log.info("%s: downloaded the state (%d bytes) from %s", me, len(data), p["peer_id"])
                    return data
                except HTTPStatusError as e:
                    no_state += e.status == 404
                    errors.append(f"{p['peer_id']}: {e!r}")
                except (TimeoutError, aiohttp.ClientError, OSError, PermissionError) as e:
                    errors.append(f"{p['peer_id']}: {e!r}")
            if no_state == len(others):
                log.info("%s: no live peer has a state to download: %s", me, errors[-3:])
                return None
            await asyncio.sleep(min(0.5, max(deadline - asyncio.get_running_loop().time(), 0)))

    async def _h_get_state(self, request: web.Request) -> web.StreamResponse:
        self.transport.verify(request)
        provider = self.provider
        if provider is None:
            raise web.HTTPNotFound(text="this peer serves no state")
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(None, provider)
            if isinstance(out, concurrent.futures.Future):
                out = await asyncio.wait_for(asyncio.wrap_future(out), self.transport.timeouts.round)
        except TimeoutError:
            raise web.HTTPServiceUnavailable(text="state not ready in time") from None
        except Exception as e:  # noqa: BLE001 - reported to the requester
            log.warning("state provider failed: %r", e)
            raise web.HTTPServiceUnavailable(text="state provider failed") from None
        if not out:
            raise web.HTTPNotFound(text="this peer has no state yet")
        body = bytes(out)
        try:
            return await self.transport.serve(request, body, _auth.body_digest(body), "the state")
        finally:
            # the copies of a whole state are one-off buffers: give them back to the system
            # (the allocator keeps freed round buffers for reuse; RSS crept up by the state's
            # size in steps on a peer that served many joiners)
            del body, out
            loop.run_in_executor(None, release_free_heap)


__all__ = ["DEFAULT_MAX_STATE_BYTES", "StateProvider", "StateTransfer"]
