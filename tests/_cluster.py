"""The one cluster harness of the real-process tests: a rendezvous process on a free loopback
port and peer processes of any command (:class:`Cluster`), each a :class:`Proc` whose stdout
JSON lines a reader thread collects; readiness is an event on a process' stdout (the
rendezvous' ``listening on`` line, a peer's ``ready``), never a sleep; every wait is bounded and
says the process' stderr log when it fails; :func:`cluster_of` reaps what it started and checks
that no child process or bound port is left. Special needs are methods: ``Proc.kill9`` and
``Proc.send_signal`` (SIGSTOP, SIGCONT), ``Cluster.restart_rendezvous`` (on the same port)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

#: the run token of a cluster's processes (``RAVNEST_TOKEN``) unless it is given another
TOKEN = "test-token-123"


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
        self.text: list[str] = []  # its stdout lines that are not JSON
        self._new = threading.Condition()
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
            except ValueError:  # a line of text (the rendezvous' "listening on ...")
                with self._new:
                    self.text.append(line)
                    self._new.notify_all()
                continue
            with self._new:
                self.all.append(ev)
                self._new.notify_all()
            self.events.put(ev)
        with self._new:  # the end of its output: a waiter sees it exited
            self._new.notify_all()

    def expect(self, event: str | Callable[[dict], bool], timeout: float, what: str | None = None) -> dict:
        """The next event (consumed: each event is seen once) named ``event``, or for which
        ``event(ev)`` is true."""
        match = (lambda ev: ev.get("event") == event) if isinstance(event, str) else event
        what = what or repr(event)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (self.p.poll() is not None and self.events.empty()):
                raise AssertionError(f"{self.name}: no {what} event within {timeout} s; stderr:\n{self.stderr()}")
            try:
                ev = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if match(ev):
                return ev

    def wait_for(self, pred: Callable[[dict], bool], timeout: float, what: str = "matching") -> dict:
        """The first event so far or to come (of all, not consumed: unlike :meth:`expect`)
        for which ``pred`` is true; woken by each new event."""
        return self._first(self.all, pred, timeout, what)

    def _first(self, items: list, pred: Callable, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        seen = 0
        with self._new:
            while True:
                for item in items[seen:]:
                    if pred(item):
                        return item
                seen = len(items)
                left = deadline - time.monotonic()
                if left <= 0 or not self._t.is_alive():
                    raise AssertionError(f"{self.name}: no {what} event within {timeout} s; stderr:\n{self.stderr()}")
                self._new.wait(min(left, 1.0))

    def expect_text(self, text: str, timeout: float) -> str:
        """The first line of its stdout (not JSON) that contains ``text``."""
        return self._first(self.text, lambda line: text in line, timeout, repr(text))

    @property
    def pid(self) -> int:
        return self.p.pid

    def poll(self) -> int | None:
        return self.p.poll()

    def send_signal(self, sig: int) -> None:
        """``sig`` to the process (SIGSTOP, SIGCONT, SIGINT ...), if it still runs."""
        if self.p.poll() is None:
            self.p.send_signal(sig)

    def drain(self, timeout: float) -> None:
        """After it exited: waits (up to ``timeout`` s) for the reader to take its last lines."""
        self._t.join(timeout)

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

    def reap(self, sig: int = signal.SIGTERM) -> None:
        """Stops it if it runs (``sig``, SIGKILL after 5 s) and closes its pipes and log."""
        if self.dump_on_reap and self.p.poll() is None and "rendezvous" not in self.name:
            self.p.send_signal(signal.SIGUSR1)  # stack dump into its stderr log
            time.sleep(0.2)  # the dump is written by the process' signal handler: no event to wait on
        if self.p.poll() is None:
            self.p.send_signal(sig)
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
    """A rendezvous and peer processes on 127.0.0.1 for one test, their logs in ``tmp``.

    Subclasses (the swarm's, the pipeline's, the sync tests') add how their peers are started;
    ``dump_on_reap``: a process still running at the end dumps its stack into its log first;
    ``reap_signal``: what stops such a process; ``rendezvous_flags``: added to every rendezvous."""

    dump_on_reap = False
    reap_signal = signal.SIGTERM
    rendezvous_flags: tuple[str, ...] = ()

    def __init__(self, tmp: Path, token: str = TOKEN):
        self.tmp, self.token = tmp, token
        self.started: list[Proc] = []  # every process, reaped at the end
        self.procs: dict[str, Proc] = {}  # the last one started under each name
        self.ports: set[int] = set()
        self.env = {**os.environ, "RAVNEST_TOKEN": token, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
        self.rv: Proc | None = None
        self.url = ""

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        """Starts any process of the cluster (its stderr in ``tmp/NAME.err``)."""
        p = Proc(name, list(argv), self.tmp, {**self.env, **(env or {})})
        p.dump_on_reap = self.dump_on_reap
        self.started.append(p)
        self.procs[name] = p
        return p

    def events(self, name: str) -> list[dict]:
        """Process ``name``'s JSON events so far (every one once it exited)."""
        p = self.procs[name]
        if p.poll() is not None:
            p.drain(10)
        return list(p.all)

    def wait_event(self, name: str, pred: Callable[[dict], bool], timeout: float) -> dict:
        """The first event of process ``name`` for which ``pred`` is true (:meth:`Proc.wait_for`)."""
        return self.procs[name].wait_for(pred, timeout)

    def rendezvous(
        self,
        port: int = 0,
        heartbeat: float | None = 0.5,
        eviction: float | None = 3.0,
        extra: tuple[str, ...] = (),
        scheme: str = "http",
        host: str = "127.0.0.1",
        wrap: tuple[str, ...] = (),
        timeout: float = 30.0,
    ) -> str:
        """Starts a rendezvous (``port`` 0: a free one; ``heartbeat``, ``eviction`` None: the
        command's defaults; ``wrap``: a command that runs it, e.g. ``("ip", "netns", "exec", NS)``)
        and returns its URL once it says it listens."""
        args = [*wrap, sys.executable, "-m", "ravnest_jax.cli", "rendezvous", "--host", host, "--port", str(port)]
        for flag, value in (("--heartbeat", heartbeat), ("--eviction", eviction)):
            args += [] if value is None else [flag, str(value)]
        # the reachability probe waits 10 s, not the command's 2: a peer whose server is slow to
        # answer on a loaded test machine would turn client-only, and a test that counts a round's
        # bytes or expects pushes would see pulls (a later --probe-timeout in the flags wins)
        args += ["--probe-timeout", "10", *self.rendezvous_flags, *extra]
        self.rv = p = self.spawn(f"rendezvous{len(self.started)}", args)
        line = p.expect_text("listening on ", timeout)
        p.port = int(line.rsplit(":", 1)[1])
        self.ports.add(p.port)
        self.url = f"{scheme}://{host}:{p.port}"
        return self.url

    def restart_rendezvous(self, gap: float = 0.0, **kw: object) -> str:
        """Kills the rendezvous (SIGKILL), waits for its port to be free, leaves the run without
        one for ``gap`` seconds (an outage the test wants), then starts a new one on the same
        port (``kw``: as :meth:`rendezvous`): the same URL."""
        assert self.rv is not None and self.rv.port is not None
        port = self.rv.port
        self.rv.kill9()
        deadline = time.monotonic() + 10
        while not port_is_free(port):  # the kernel frees it: no event to wait on
            assert time.monotonic() < deadline, "the port stays busy"
            time.sleep(0.05)
        time.sleep(gap)
        return self.rendezvous(port=port, **kw)  # type: ignore[arg-type]

    def ready(self, peers: list[Proc], timeout: float = 60) -> None:
        """Waits for each peer's ``ready`` event; its ``port`` (None: client-only) is checked at the end."""
        for p in peers:
            p.ready = p.expect("ready", timeout)
            p.port = p.ready["port"]
            if p.port is not None:
                self.ports.add(p.port)

    def close(self) -> None:
        for p in self.started:
            p.reap(self.reap_signal)

    def assert_nothing_left(self) -> None:
        """No child process of this test's process, no port of the cluster still bound."""
        deadline = time.monotonic() + 10
        while children(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)  # reaped already: grandchildren (a wrapped command's) on their way out
        left = children(os.getpid())
        assert not left, f"child processes left behind: {left}"
        busy = [p for p in self.ports if not port_is_free(p)]
        assert not busy, f"ports still bound: {busy}"


@contextlib.contextmanager
def cluster_of(cluster: Cluster) -> Iterator[Cluster]:
    """A fixture's body: the cluster, then every process reaped and nothing left behind."""
    try:
        yield cluster
    finally:
        cluster.close()
        cluster.assert_nothing_left()
