"""Child processes of the real-process tests (swarm, pipeline): JSON-lines readers, the live
children of a process, free ports; every fixture built on them reaps what it started."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path


def children(pid: int) -> list[int]:
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
    """A child process whose stdout JSON lines are collected by a reader thread.

    ``dump_on_reap``: a peer that is still running when reaped first gets SIGUSR1 (its stack
    dump into the stderr log, for a test that failed), then SIGTERM."""

    dump_on_reap = False

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
            if left <= 0 or (self.p.poll() is not None and self.events.empty()):
                raise AssertionError(f"{self.name}: no {event!r} event within {timeout} s; stderr:\n{self.stderr()}")
            try:
                ev = self.events.get(timeout=min(left, 0.5))
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
        if self.dump_on_reap and self.p.poll() is None and "rendezvous" not in self.name:
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
