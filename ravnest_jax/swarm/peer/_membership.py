"""This peer's membership of its run: registering with the rendezvous (and turning client-only
when the rendezvous cannot reach it) and the heartbeats that keep it a member."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from ..wire._http import HTTPStatusError
from ..wire._manifest import refusal_differences
from ..wire._types import ManifestMismatch, SwarmError
from ._rounds import Rounds
from ._transport import Transport, why

log = logging.getLogger("ravnest_jax.swarm")


async def heartbeat_loop(transport: Transport, rounds: Rounds, hello: Any) -> None:
    """Heartbeats to the rendezvous every ``timeouts.heartbeat`` seconds (the transport's) until
    cancelled; learns which members of running attempts left (their answers)."""
    timeouts = transport.timeouts
    while True:
        await asyncio.sleep(timeouts.heartbeat)
        try:
            r = await transport.rendezvous(
                "POST", "/heartbeat", hello(), min(timeouts.heartbeat * 2, timeouts.eviction)
            )
            rounds.note_left(r.get("left"))
            if r.get("registered"):
                log.info("%s: re-registered with the rendezvous (epoch %s)", transport.peer_id, r.get("epoch"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - keep beating; the next one re-registers
            log.debug("%s: heartbeat failed: %r", transport.peer_id, e)


async def join(transport: Transport, hello: Any) -> None:
    """Registers with the rendezvous (retried until the part + connect deadline). When the
    rendezvous' probe cannot reach this peer at its address, the peer turns client-only (a
    warning says so) and re-registers with its relay mailbox as its address.

    Raises:
      SwarmError: the rendezvous refuses this peer, or cannot be reached in time.
    """
    timeouts = transport.timeouts
    deadline = time.monotonic() + timeouts.part + timeouts.connect
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            # (the rendezvous probes our address meanwhile: up to a few seconds more)
            joined = await transport.rendezvous("POST", "/join", hello(), timeouts.connect * 2 + 3)
            break
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            last = e
            await asyncio.sleep(0.2)
        except (HTTPStatusError, PermissionError) as e:
            diffs = refusal_differences(getattr(e, "text", ""))
            if diffs is not None:  # the manifest declared before start differs from the run's
                raise ManifestMismatch(e.text, diffs) from None
            said = e.text if isinstance(e, HTTPStatusError) and e.status == 409 else e  # a line in words
            raise SwarmError(f"the rendezvous refused to register us: {said}") from e
    else:
        raise SwarmError(
            f"rendezvous {transport.rendezvous_url} unreachable for {timeouts.part + timeouts.connect:.0f} s: "
            f"{why(last)} (is `ravnest-jax rendezvous` running there?)"
        )
    if joined.get("reachable") is False and not transport.client_only:
        log.warning(
            "%s: the rendezvous cannot reach this peer at %s (%s): it takes part client-only, through the "
            "rendezvous' relay (pass --advertise with a reachable address, or --no-inbound to say so)",
            transport.peer_id,
            transport.address,
            joined.get("unreachable_because", "no answer"),
        )
        transport.become_client_only()
        await transport.rendezvous("POST", "/heartbeat", hello(), timeouts.connect * 2)
