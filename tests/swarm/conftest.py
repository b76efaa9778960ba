"""Real-process fixtures for swarm tests: a rendezvous and peers on 127.0.0.1, all reaped."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from _procs import Proc as _Proc
from _procs import children as _children
from _procs import port_is_free

HERE = Path(__file__).parent
WORKER = HERE / "_worker.py"
TOKEN = "test-token-123"


class Proc(_Proc):
    dump_on_reap = True  # a failed swarm test shows where each peer was


class Cluster:
    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.procs: list[Proc] = []
        self.ports: set[int] = set()
        self.env = {**os.environ, "RAVNEST_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
        self.rv: Proc | None = None
        self.url = ""

    def rendezvous(
        self,
        port: int = 0,
        heartbeat: float = 0.5,
        eviction: float = 3.0,
        extra: tuple[str, ...] = (),
        scheme: str = "http",
        host: str = "127.0.0.1",
        wrap: tuple[str, ...] = (),
    ) -> str:
        pf = self.tmp / f"rv-port-{len(self.procs)}"
        args = [
            *wrap,  # e.g. ("ip", "netns", "exec", NS): run it in a network namespace
            sys.executable,
            "-m",
            "ravnest_jax.cli",
            "rendezvous",
            "--host",
            host,
            "--port",
            str(port),
            "--port-file",
            str(pf),
            "--heartbeat",
            str(heartbeat),
            "--eviction",
            str(eviction),
            "--verbose",
            *extra,
        ]
        self.rv = p = Proc(f"rendezvous{len(self.procs)}", args, self.tmp, self.env)
        self.procs.append(p)
        deadline = time.monotonic() + 30
        while not pf.exists():
            if p.p.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rendezvous did not start: {p.stderr()}")
            time.sleep(0.05)
        p.port = int(pf.read_text())
        self.ports.add(p.port)
        self.url = f"{scheme}://{host}:{p.port}"
        return self.url

    def peer(self, peer_id: str, seed: int, wrap: tuple[str, ...] = (), **kw: object) -> Proc:
        args = [
            *wrap,
            sys.executable,
            str(WORKER),
            "--url",
            self.url,
            "--token",
            str(kw.pop("token", TOKEN)),
            "--peer-id",
            peer_id,
            "--seed",
            str(seed),
        ]
        kw.setdefault("out_dir", str(self.tmp))
        for k, v in kw.items():
            if v is True:  # a switch
                args.append(f"--{k.replace('_', '-')}")
            elif v is not False:
                args += [f"--{k.replace('_', '-')}", str(v)]
        p = Proc(peer_id, args, self.tmp, self.env)
        self.procs.append(p)
        return p

    def ready(self, peers: list[Proc], timeout: float = 60) -> None:
        for p in peers:
            p.ready = p.expect("ready", timeout)
            p.port = p.ready["port"]
            if p.port is not None:  # None: a client-only peer
                self.ports.add(p.port)

    def close(self) -> None:
        for p in self.procs:
            p.reap()


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
        deadline = time.monotonic() + 10
        while _children(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _children(os.getpid())
        assert not left, f"child processes left behind: {left}"
        busy = [p for p in c.ports if not port_is_free(p)]
        assert not busy, f"ports still bound: {busy}"
