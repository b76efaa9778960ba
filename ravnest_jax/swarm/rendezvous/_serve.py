"""Runs a :class:`~ravnest_jax.swarm.rendezvous._rendezvous.Rendezvous` as an aiohttp server (the
``ravnest-jax rendezvous`` command, the launchers and the tests use it)."""

from __future__ import annotations

import asyncio
import signal
import ssl as _ssl
from typing import Any

from aiohttp import web

from ._rendezvous import Rendezvous


async def serve(
    host: str,
    port: int,
    token: str | bytes,
    *,
    heartbeat_s: float = 2.0,
    eviction_s: float = 10.0,
    ssl_context: _ssl.SSLContext | None = None,
    ready: Any = None,
    stop: asyncio.Event | None = None,
    read_token: str | bytes = b"",
    probe_s: float = 2.0,
    relay_rate_bytes_s: float | None = None,
    relay_max_queued_bytes: int = 1 << 30,
) -> None:
    """Run a rendezvous until ``stop`` is set (or SIGINT/SIGTERM when ``stop`` is None).

    ``ready(bound_port)`` is called once the socket listens (``port=0`` picks a free port).
    """
    rv = Rendezvous(
        token,
        heartbeat_s=heartbeat_s,
        eviction_s=eviction_s,
        read_token=read_token,
        probe_s=probe_s,
        relay_rate_bytes_s=relay_rate_bytes_s,
        relay_max_queued_bytes=relay_max_queued_bytes,
    )
    runner = web.AppRunner(rv.make_app(), access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_address=True)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if ready is not None:
            ready(bound)
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
