"""Real-process fixtures of the pipeline tests: a rendezvous process and stage peer processes on
127.0.0.1, all reaped; no child process or bound port may be left behind."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TOKEN = "pipeline-test-token"


def children(pid: int) -> list[int]:
    """Live (non-zombie) child processes of ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d))
    return out


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Proc:
    """A child process whose stdout JSON lines are collected by a reader thread."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str]):
        self.name = name
        self.stderr_path = log_dir / f"{name}.err"
        self._err = open(self.stderr_path, "w")
        self.p = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env, start_new_session=True
        )
        self.events: queue.Queue[dict] = queue.Queue()
        self.all: list[dict] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                ev = {"event": "text", "text": line}
            self.all.append(ev)
            self.events.put(ev)

    def expect(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (self.p.poll() is not None and self.events.empty()):
                raise AssertionError(f"{self.name}: no {event!r} event within {timeout} s; stderr:\n{self.stderr()}")
            try:
                ev = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if ev.get("event") == event:
                return ev

    def stderr(self) -> str:
        self._err.flush()
        return self.stderr_path.read_text()[-6000:]

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout} s; stderr:\n{self.stderr()}") from None

    def kill9(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)

    def reap(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=10)
        self._t.join(timeout=5)
        if self.p.stdout:
            self.p.stdout.close()
        self._err.close()


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
