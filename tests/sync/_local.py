"""A real rendezvous and real rj.Swarm peers on 127.0.0.1, in this process (threads), for the
driver tests. Real aiohttp servers, real HTTP; only the processes are shared."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from ravnest_jax.swarm import Swarm, Timeouts
from ravnest_jax.swarm import serve_rendezvous as serve

TOKEN = "sync-test-token"
FAST = Timeouts(connect=2.0, part=8.0, grace=0.5, round=30.0, heartbeat=0.3, eviction=1.5, max_attempts=3)
# for peers whose every round must include everyone (a multi-process peer under load): a part
# deadline long enough that a slow process is waited for, never left out
PATIENT = Timeouts(connect=5.0, part=60.0, grace=1.0, round=180.0, heartbeat=0.5, eviction=30.0, max_attempts=3)


@contextlib.contextmanager
def rendezvous_thread(timeouts: Timeouts = FAST) -> Iterator[str]:
    """Runs a rendezvous on 127.0.0.1 (free port) in a thread; yields its URL."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready = threading.Event()
    port: list[int] = []

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            await serve(
                "127.0.0.1",
                0,
                TOKEN,
                heartbeat_s=timeouts.heartbeat,
                eviction_s=timeouts.eviction,
                ready=lambda p: (port.append(p), ready.set()),
                stop=stop,
            )

        loop.run_until_complete(main())

    t = threading.Thread(target=run, name="rendezvous", daemon=True)
    t.start()
    assert ready.wait(20), "rendezvous did not start"
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(20)
        loop.close()


@contextlib.contextmanager
def local_swarm(
    n: int, *, codec: str = "fp32", run_id: str = "sync-test", timeouts: Timeouts = FAST, algorithm: str = "butterfly"
) -> Iterator[list[Swarm]]:
    """``n`` started peers of one run (ids p0, p1, ...), closed on exit."""
    with rendezvous_thread(timeouts) as url, contextlib.ExitStack() as stack:
        peers = [
            stack.enter_context(
                Swarm(
                    url,
                    run_id=run_id,
                    token=TOKEN,
                    codec=codec,
                    listen="127.0.0.1:0",
                    timeouts=timeouts,
                    peer_id=f"p{i}",
                    algorithm=algorithm,
                )
            )
            for i in range(n)
        ]
        peers[0].wait_for_peers(n, timeout=20)
        yield peers
