"""Real-process fixtures of the pipeline tests: a rendezvous process and stage peer processes on
127.0.0.1, all reaped; no child process or bound port may be left behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from _procs import Proc, children, port_is_free

HERE = Path(__file__).parent
TOKEN = "pipeline-test-token"


class PipeCluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.ports: set[int] = set()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
        self.url = ""

    def rendezvous(self, heartbeat: float = 0.5, eviction: float = 3.0) -> str:
        pf = self.tmp / "rv-port"
        args = [sys.executable, "-m", "ravnest_jax.cli", "rendezvous", "--host", "127.0.0.1", "--port", "0"]
        args += ["--port-file", str(pf), "--heartbeat", str(heartbeat), "--eviction", str(eviction)]
        p = Proc("rendezvous", args, self.tmp, {**self.env, "RAVNEST_TOKEN": TOKEN})
        self.procs.append(p)
        deadline = time.monotonic() + 30
        while not pf.exists() or not pf.read_text().strip():
            if p.p.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rendezvous did not start: {p.stderr()}")
            time.sleep(0.05)
        port = int(pf.read_text())
        self.ports.add(port)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def start(self, name: str, script: Path, *args: str) -> Proc:
        p = Proc(name, [sys.executable, str(script), "--url", self.url, "--token", TOKEN, *args], self.tmp, self.env)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            p.reap()


@pytest.fixture
def pipe_cluster(tmp_path: Path):
    c = PipeCluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
        deadline = time.monotonic() + 10
        while children(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = children(os.getpid())
        assert not left, f"child processes left behind: {left}"
        busy = [p for p in c.ports if not port_is_free(p)]
        assert not busy, f"ports still bound: {busy}"
