"""Real-process fixtures for swarm tests: a rendezvous and peers on 127.0.0.1, all reaped."""

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
WORKER = HERE / "_worker.py"
TOKEN = "test-token-123"


def _children(pid: int) -> list[int]:
    """Live (non-zombie) child processes of ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
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
        self.port: int | None = None
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
            if left <= 0:
                raise AssertionError(f"{self.name}: no {event!r} event within {timeout} s; stderr:\n{self.stderr()}")
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if ev.get("event") == event:
                return ev

    def expect_log(self, text: str, timeout: float) -> None:
        """Wait until ``text`` appears in the process' stderr log (polled every 20 ms)."""
        deadline = time.monotonic() + timeout
        while True:
            self._err.flush()
            if text in self.stderr_path.read_text():
                return
            if time.monotonic() > deadline or self.p.poll() is not None:
                raise AssertionError(f"{self.name}: {text!r} not logged within {timeout} s; stderr:\n{self.stderr()}")
            time.sleep(0.02)

    def stderr(self) -> str:
        self._err.flush()
        return self.stderr_path.read_text()[-4000:]

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
        if self.p.poll() is None and self.name != "rendezvous" and "rendezvous" not in self.name:
            self.p.send_signal(signal.SIGUSR1)  # stack dump into its stderr log
            time.sleep(0.2)
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

    def rounds(self) -> list[dict]:
        return [e for e in self.all if e.get("event") == "round"]


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
