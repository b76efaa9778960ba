"""Helpers shared by the sync benchmarks: an emulated network link (a throttling TCP proxy in its
own process), an in-process rendezvous, free ports and machine info.

The link emulation is outside the code under test: peers talk plain TCP to the proxy, which
forwards to the real peer port. Each *direction* of each emulated link is a FIFO line with a
rate (bits/s) and a one-way delay (RTT/2): a chunk read at ``t`` finishes transmission at
``done = max(done_prev, t) + 8 * len / rate`` (serialisation, shared by every connection that
uses that direction) and is written to the other side at ``done + delay``. The proxy reads
eagerly (no TCP back-pressure across it; the sender's writes complete at once, the receiver
gets the bytes at the emulated time). The TCP handshake itself is not delayed (connections are
kept alive by aiohttp, so it is paid rarely).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import platform
import socket
import threading
import time
from collections.abc import Iterator

CHUNK = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    with contextlib.suppress(OSError):
        info["loadavg_at_start"] = os.getloadavg()
    with contextlib.suppress(Exception):
        import jax

        info.update(jax=jax.__version__, backend=jax.default_backend(), devices=[str(d) for d in jax.devices()])
    return info


# --------------------------------------------------------------------------------- the proxy
def _proxy_main(routes, link, ready_q, stop_ev) -> None:  # pragma: no cover - child process
    """routes: list of (target_port, fwd_line, rev_line); link: mp.Array [rate_bps, delay_s]
    per line index (2 values each). Puts the list of listening ports on ready_q."""

    done = {}  # line -> time its last byte leaves the sender

    def schedule(line: int, nbytes: int, t: float) -> float:
        rate, delay = link[2 * line], link[2 * line + 1]
        start = max(done.get(line, 0.0), t)
        finish = start + (8.0 * nbytes / rate if rate > 0 else 0.0)
        done[line] = finish
        return finish + delay

    async def pump(reader, writer, line: int) -> None:
        q: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                while True:
                    data = await reader.read(CHUNK)
                    now = time.monotonic()
                    if not data:
                        await q.put((now + link[2 * line + 1], None))
                        return
                    await q.put((schedule(line, len(data), now), data))
            except (ConnectionError, OSError):
                await q.put((time.monotonic(), None))

        task = asyncio.ensure_future(read())
        try:
            while True:
                due, data = await q.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    with contextlib.suppress(Exception):
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            task.cancel()
            with contextlib.suppress(Exception):
                writer.close()

    async def handle(c_reader, c_writer, target: int, fwd: int, rev: int) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            c_writer.close()
            return
        await asyncio.gather(pump(c_reader, s_writer, fwd), pump(s_reader, c_writer, rev))

    async def main() -> None:
        servers, ports = [], []
        for target, fwd, rev in routes:
            srv = await asyncio.start_server(lambda r, w, t=target, f=fwd, v=rev: handle(r, w, t, f, v), "127.0.0.1", 0)
            servers.append(srv)
            ports.append(srv.sockets[0].getsockname()[1])
        ready_q.put(ports)
        while not stop_ev.is_set():
            await asyncio.sleep(0.2)
        for s in servers:
            s.close()

    asyncio.run(main())


class LinkEmulator:
    """A throttling TCP proxy process. ``routes``: ``(target_port, fwd_line, rev_line)``; lines
    are numbered 0..n_lines-1 and share their rate/delay state across routes (a physical
    direction of a link). ``set(line, mbit, rtt_ms)`` changes a line at once."""

    def __init__(self, routes: list[tuple[int, int, int]], n_lines: int):
        ctx = mp.get_context("spawn")
        self._link = ctx.Array("d", [0.0] * (2 * n_lines), lock=False)
        self._stop = ctx.Event()
        q = ctx.Queue()
        self._proc = ctx.Process(
            target=_proxy_main, args=(routes, self._link, q, self._stop), daemon=True, name="link-emulator"
        )
        self._proc.start()
        self.ports: list[int] = q.get(timeout=60)
        self.n_lines = n_lines
        self.frozen: set[int] = set()  # lines set_all leaves alone

    def set(self, line: int, mbit: float, rtt_ms: float) -> None:
        self._link[2 * line] = mbit * 1e6
        self._link[2 * line + 1] = rtt_ms / 2000.0

    def set_all(self, mbit: float, rtt_ms: float) -> None:
        for i in range(self.n_lines):
            if i not in self.frozen:
                self.set(i, mbit, rtt_ms)

    def close(self) -> None:
        self._stop.set()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)


# ----------------------------------------------------------------------------- rendezvous
@contextlib.contextmanager
def rendezvous_thread(token: str, port: int = 0, heartbeat: float = 1.0, eviction: float = 10.0) -> Iterator[int]:
    """A real rendezvous on 127.0.0.1 in a thread of this process; yields its port."""
    from ravnest_jax.swarm import serve_rendezvous as serve

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready = threading.Event()
    bound: list[int] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(
            serve(
                "127.0.0.1",
                port,
                token,
                heartbeat_s=heartbeat,
                eviction_s=eviction,
                ready=lambda p: (bound.append(p), ready.set()),
                stop=stop,
            )
        )

    t = threading.Thread(target=run, name="rendezvous", daemon=True)
    t.start()
    if not ready.wait(30):
        raise RuntimeError("rendezvous did not start")
    try:
        yield bound[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(20)
        loop.close()
