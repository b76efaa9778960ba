"""``ravnest-jax local``: a swarm on this machine, torchrun-style.

Starts a rendezvous on 127.0.0.1 and N processes of any training script, hands each its
rendezvous URL, run id, token and peer id through environment variables (:data:`PEER_ENV`;
``rj.Swarm()`` reads them when its arguments are left out), streams the peers' output (each
line prefixed with the peer's name) under one progress line, and prints every peer's
``OuterSync.summary()`` when they are done.

Nothing is written to disk: the token travels in the environment, the summaries through a pipe
per peer (``RAVNEST_SUMMARY_FD``). The peers die with the launcher (``PR_SET_PDEATHSIG`` on
Linux, and ``--exit-with-parent`` for the rendezvous), so a crash of the launcher leaves no
process or port behind. Ctrl+C stops the peers (each saves what it saves on Ctrl+C) and prints
what they reported. No jax import here.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._compile_cache import OFF_ENV as _CACHE_OFF_ENV
from ._launch_env import assign_devices, compile_cache_env, describe_devices, visible_gpus

__all__ = ["PEER_ENV", "Launcher", "assign_devices", "run_local", "start_process", "stop_processes", "visible_gpus"]

#: environment variables each peer process gets (``RAVNEST_*`` read by ``rj.Swarm()``)
PEER_ENV = (
    "RAVNEST_RENDEZVOUS",
    "RAVNEST_RUN_ID",
    "RAVNEST_TOKEN",
    "RAVNEST_PEER_ID",
    "RAVNEST_LISTEN",
    "RAVNEST_CODEC",
    "RAVNEST_RANK",
    "RAVNEST_WORLD_SIZE",
    "RAVNEST_SUMMARY_FD",
)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """In the child before exec: its own process group (a terminal's Ctrl+C reaches only the
    launcher, which forwards exactly one SIGINT to each peer: a second one would interrupt the
    peer's own Ctrl+C handling, a checkpoint save say), and on Linux SIGTERM when the launcher
    dies (even by SIGKILL)."""
    os.setpgrp()
    # a launcher started where SIGINT is ignored (a background job of a script, some CI
    # runners) would pass SIG_IGN on through exec, and its peers would ignore the forwarded
    # SIGINT: they get the default
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_process(
    argv: Sequence[str], *, env: dict[str, str] | None = None, pass_fds: Sequence[int] = ()
) -> subprocess.Popen:
    """Starts one process of a local swarm as the launcher starts its peers: in its own process
    group (a terminal's Ctrl+C reaches only the launcher, which forwards one SIGINT, e.g. with
    :func:`stop_processes`), SIGINT at its default, SIGTERM when the launcher dies (Linux), stdin
    from ``/dev/null``, stdout and stderr as text pipes for the caller to read.

    Raises:
      OSError: the program cannot be started.
    """
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,  # its own process group: reading the terminal would stop it
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        pass_fds=tuple(pass_fds),
        preexec_fn=_die_with_parent,
    )


def stop_processes(
    procs: Sequence[subprocess.Popen], sig: int = signal.SIGTERM, timeout: float = 10.0, hurry: Callable | None = None
) -> list[subprocess.Popen]:
    """Sends ``sig`` to every process still running, waits up to ``timeout`` seconds in all (less
    once ``hurry()`` is true: another Ctrl+C, say), then kills (SIGKILL) those still running and
    reaps them. Returns the killed ones."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(sig)
    deadline = time.monotonic() + timeout
    for p in live:
        while p.poll() is None and time.monotonic() < deadline and not (hurry and hurry()):
            try:  # with a hurry() to watch, look again every 50 ms
                p.wait(timeout=max(min(deadline - time.monotonic(), 0.05 if hurry else 1e9), 0.01))
            except subprocess.TimeoutExpired:
                pass
    killed = [p for p in live if p.poll() is None]
    for p in killed:
        p.kill()
    for p in live:
        p.wait()
    return killed


class Launcher:
    """The processes of a local swarm, for ``ravnest-jax local`` and the examples' ``--local-peers``:
    a rendezvous on 127.0.0.1 and peers, started by :func:`start_process` (they die with the
    launcher); a thread per output stream keeps its last ``tail`` lines (``tails[name]``,
    ``tails[name + ":err"]``) and hands each line to ``on_line(name, line, err)``. Every process
    gets ``RAVNEST_RUN_ID`` and ``RAVNEST_TOKEN`` (default: 32 random hex digits)."""

    def __init__(self, run_id: str, *, token: str | None = None, tail: int = 40):
        self.run_id, self.token, self._tail = run_id, token or secrets.token_hex(16), tail
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAVNEST_TOKEN": self.token, "RAVNEST_RUN_ID": run_id}
        self.url: str | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.tails: dict[str, collections.deque] = {}
        self._threads: list[threading.Thread] = []

    def read(self, stream: Any, on_line: Callable[[str], None]) -> None:
        """Each line of ``stream`` (a text pipe) to ``on_line``, from a thread :meth:`close` joins."""

        def pump() -> None:
            with stream:
                for line in stream:
                    on_line(line)

        self._threads.append(threading.Thread(target=pump, daemon=True))
        self._threads[-1].start()

    def start(
        self, name: str, argv: Sequence[str], *, env: dict | None = None, on_line: Callable | None = None, pass_fds=()
    ) -> subprocess.Popen:
        """Starts process ``name`` (``env`` default: the launcher's) and the readers of its output."""
        p = self.procs[name] = start_process(argv, env=self.env if env is None else env, pass_fds=pass_fds)
        for stream, err in ((p.stdout, False), (p.stderr, True)):
            tail = self.tails.setdefault(name + (":err" if err else ""), collections.deque(maxlen=self._tail))

            def got(line: str, tail: collections.deque = tail, err: bool = err) -> None:
                tail.append(line)
                if on_line is not None:
                    on_line(name, line, err)

            self.read(stream, got)
        return p

    def start_rendezvous(self, *, heartbeat: float = 1.0, eviction: float = 5.0, timeout: float = 30.0) -> str:
        """Starts ``ravnest-jax rendezvous`` on a free port of 127.0.0.1 (it exits with the
        launcher); returns its URL once it says it listens, or raises RuntimeError with its output."""
        listening = threading.Event()

        def on_line(name: str, line: str, err: bool) -> None:
            if not err and self.url is None and "listening on " in line:
                self.url = line.split("listening on ", 1)[1].split()[0]
                listening.set()

        argv = [sys.executable, "-m", "ravnest_jax.cli", "rendezvous", "--host", "127.0.0.1", "--port", "0"]
        argv += ["--quiet", "--heartbeat", str(heartbeat), "--eviction", str(eviction), "--exit-with-parent"]
        rv = self.start("rendezvous", argv, on_line=on_line)
        deadline = time.monotonic() + timeout
        while not listening.wait(0.1):
            if rv.poll() is not None or time.monotonic() > deadline:
                said = "".join(self.tails["rendezvous"]) + "".join(self.tails["rendezvous:err"])
                raise RuntimeError("the rendezvous did not start:\n" + said)
        return str(self.url)

    def peer_env(self, name: str, rank: int, world_size: int) -> dict[str, str]:
        """Peer ``name``'s environment, :data:`PEER_ENV` as ``rj.Swarm()`` and the examples read it
        (a server on a free port of 127.0.0.1), and one XLA CPU thread unless ``XLA_FLAGS`` says
        otherwise (the peers share this machine's cores)."""
        env = {**self.env, "RAVNEST_RENDEZVOUS": str(self.url), "RAVNEST_PEER_ID": name, "RAVNEST_RANK": str(rank)}
        env.update(RAVNEST_LISTEN="127.0.0.1:0", RAVNEST_WORLD_SIZE=str(world_size))
        env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
        return env

    def peers(self) -> dict[str, subprocess.Popen]:
        return {n: p for n, p in self.procs.items() if n != "rendezvous"}

    def stop_peers(self, seconds: float, hurry: Callable | None = None, sig: int = signal.SIGINT) -> set[str]:
        """One ``sig`` (SIGINT: as Ctrl+C, each peer stops, saves and reports) to each live peer,
        :func:`stop_processes` with ``seconds`` and ``hurry``. Returns the names of the killed ones."""
        killed = stop_processes(list(self.peers().values()), sig, seconds, hurry)
        return {n for n, p in self.peers().items() if p in killed}

    def close(self, seconds: float = 2.0) -> None:
        """Stops what still runs (SIGTERM, SIGKILL after ``seconds``): the peers, then the
        rendezvous; then up to ``seconds`` for the readers to take the last lines."""
        stop_processes(list(self.peers().values()), timeout=seconds)
        stop_processes([p for n, p in self.procs.items() if n == "rendezvous"], timeout=seconds)
        deadline = time.monotonic() + seconds  # the readers end with the pipes
        for t in self._threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.01))


def check_command(command: Sequence[str]) -> list[str]:
    """The peer command, checked before anything starts: a ``.py`` first word, ``python`` and
    ``python3`` run with this Python (the launcher's, which has ravnest_jax: a venv need not be
    activated); the program and any ``.py`` script it names must exist.

    Raises:
      ValueError: no command, an unknown program, or a missing script (one line).
    """
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("no command: ravnest-jax local --peers N -- python train.py [ARGS]")
    if cmd[0].endswith(".py"):
        cmd = [sys.executable, *cmd]
    elif cmd[0] in ("python", "python3"):  # this interpreter (the one ravnest_jax is installed in)
        cmd = [sys.executable, *cmd[1:]]
    elif cmd[0] == "ravnest-jax":  # this installation's CLI, found without the venv on PATH
        cmd = [sys.executable, "-m", "ravnest_jax.cli", *cmd[1:]]
    elif shutil.which(cmd[0]) is None:
        raise ValueError(f"{cmd[0]}: no such program")
    if (
        Path(cmd[0]).name.startswith("python")
        and len(cmd) > 1
        and cmd[1].endswith(".py")
        and not Path(cmd[1]).is_file()
    ):
        raise ValueError(f"{cmd[1]}: no such file")
    return cmd


def _fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def _fmt_exit(code: int | None) -> str:
    """``0``, ``3`` or a signal's name (``SIGINT``) for a process killed by one."""
    if code is None:
        return "-"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return str(code)
    return str(code)


def _fmt_loss(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def print_summaries(summaries: dict[str, dict], codes: dict[str, int | None], write: Callable[[str], None]) -> bool:
    """A table of the peers' summaries and a line on their global state: compared among the peers
    that exited 0 (a peer that died reported the digest of its last round). Returns whether
    those digests are equal."""
    # the eval loss columns when a peer's summary has them (eval_loss_start / eval_loss_end)
    evals = any(isinstance(s.get("eval_loss_end"), (int, float)) for s in summaries.values())
    head = f" {'eval start':>10} {'eval end':>8}" if evals else ""
    write(
        f"{'peer':<10} {'exit':>7}{head} {'rounds':>6} {'failed':>6} {'resyncs':>7} {'sent':>10} {'stall s':>8}  digest"
    )
    for name in sorted(codes, key=lambda s: (len(s), s)):
        s = summaries.get(name, {})
        d = s.get("last_state_digest") or "-"
        stall = s.get("stall_seconds")
        ev = f" {_fmt_loss(s.get('eval_loss_start')):>10} {_fmt_loss(s.get('eval_loss_end')):>8}" if evals else ""
        write(
            f"{name:<10} {_fmt_exit(codes[name]):>7}{ev} {s.get('rounds', '-')!s:>6} {s.get('failed_rounds', '-')!s:>6} "
            f"{s.get('resyncs', '-')!s:>7} {_fmt_bytes(s.get('bytes_sent')):>10} "
            f"{'-' if stall is None else f'{stall:.1f}':>8}  {d[:16]}"
        )
    finished = [n for n, c in codes.items() if c == 0]
    runs = {summaries.get(n, {}).get("run_id") for n in finished}
    if len(runs) > 1 and None not in runs:
        # pipeline stages: each stage's group is its own run of DiLoCo; compare within each
        groups = {
            r: {summaries[n].get("last_state_digest") or None for n in finished if summaries[n].get("run_id") == r}
            for r in runs
        }
        equal = all(len(d) == 1 and None not in d for d in groups.values())
        write(
            f"global state of each of the {len(groups)} stage groups: "
            + (
                "identical on its peers"
                if equal
                else "NOT identical: " + ", ".join(f"{r}: {len(d)} digests" for r, d in sorted(groups.items()))
            )
        )
        return equal
    digests = {summaries.get(n, {}).get("last_state_digest") or None for n in finished}
    equal = len(digests) == 1 and None not in digests
    others = len(finished) < len(codes)
    if not finished:
        write("global state: no peer finished")
    elif digests == {None}:
        write("global state: no outer round completed")
    elif equal:
        write(
            f"global state: identical on the {len(finished)} peers that finished ({', '.join(finished)})"
            if others
            else "global state: identical on every peer"
        )
    else:
        write(f"global state: {len(digests - {None})} different digests among the {len(finished)} peers that finished")
    return equal


def run_local(
    command: Sequence[str],
    *,
    peers: int,
    codec: str | None = None,
    run_id: str | None = None,
    heartbeat: float = 1.0,
    eviction: float = 5.0,
    progress: bool = True,
    summary_json: str | None = None,
    stop_seconds: float = 30.0,
    devices_per_peer: int | None = None,
    compile_cache: bool | str = True,
) -> int:
    """Runs ``command`` as ``peers`` peer processes of one run, with a rendezvous on 127.0.0.1.

    Args:
      command: the peer program and its arguments (``["python", "train.py", ...]``; a first
        word ending in ``.py`` runs with this Python).
      peers: how many peer processes (int >= 1).
      codec: sets ``RAVNEST_CODEC`` (the swarm's wire codec) when given.
      run_id: the run id (default ``local-`` and 6 random hex digits).
      heartbeat: the rendezvous' heartbeat interval, seconds.
      eviction: the rendezvous evicts a silent peer after this long, seconds.
      progress: show one progress line (rounds, live peers) under the peers' output.
      summary_json: also write ``{"run_id", "command", "peers": {name: {"exit", "summary"}}}``
        there.
      stop_seconds: after Ctrl+C, how long the peers get to stop before they are killed.
      devices_per_peer: GPUs per peer (see :func:`assign_devices`: ``None`` splits the visible
        GPUs evenly, or shares them round-robin when there are more peers than GPUs); without
        a GPU it changes nothing (one line says so).
      compile_cache: ``True``: JAX's persistent compilation cache in the default directory (or
        ``JAX_COMPILATION_CACHE_DIR``); a path: there; ``False``: off (``RAVNEST_COMPILE_CACHE=0``,
        so ``rj.enable_compilation_cache()`` in the script does nothing either).

    Returns:
      The exit status: 0 when every peer exited 0, 130 after Ctrl+C, else 1 (with one peer,
      a status of its own below 126: that status, 2 for a refused input, say).

    Raises:
      ValueError: a bad command (see :func:`check_command`), ``peers`` < 1, or more devices
        asked for than there are, before anything starts.
    """
    cmd = check_command(command)
    gpus = visible_gpus()
    device_envs = assign_devices(peers, gpus, devices_per_peer)
    if compile_cache:
        cache_env = compile_cache_env(path=compile_cache if isinstance(compile_cache, str) else None)
    else:
        cache_env = {_CACHE_OFF_ENV: "0"}
    from tqdm.auto import tqdm

    progress = progress and sys.stderr.isatty()  # a log file gets plain lines, no redraws
    if threading.current_thread() is threading.main_thread():
        # Ctrl+C must reach this loop even where SIGINT was ignored when the launcher started
        # (Python then installs no KeyboardInterrupt handler): a background job of a script
        signal.signal(signal.SIGINT, signal.default_int_handler)

    run_id = run_id or f"local-{secrets.token_hex(3)}"
    launcher = Launcher(run_id)
    if not compile_cache:  # nor one the user's environment names
        launcher.env.pop("JAX_COMPILATION_CACHE_DIR", None)
    bar = tqdm(total=None, bar_format="{desc}", disable=not progress, dynamic_ncols=True, file=sys.stderr)
    lock = threading.Lock()

    def write(line: str, err: bool = False) -> None:
        with lock:
            if progress:
                bar.write(line, file=sys.stderr if err else sys.stdout)
            else:
                print(line, file=sys.stderr if err else sys.stdout, flush=True)

    summaries: dict[str, dict] = {}

    def summary_of(name: str) -> Callable[[str], None]:
        def got(line: str) -> None:
            try:
                summaries[name] = json.loads(line)
            except ValueError:
                pass

        return got

    interrupted = False
    peer_names = [f"peer{i}" for i in range(peers)]
    t0 = time.monotonic()
    try:
        url = launcher.start_rendezvous(heartbeat=heartbeat, eviction=eviction)
        write(
            f"rendezvous {url}, run {run_id}, codec {codec or 'as the script sets it'}: starting {peers} "
            f"peer{'s' if peers > 1 else ''} of: {' '.join(cmd)}"
        )
        if gpus or devices_per_peer is not None:
            write(describe_devices(device_envs, gpus, devices_per_peer))
        for i, name in enumerate(peer_names):
            r, w = os.pipe()
            env = {**launcher.peer_env(name, i, peers), "RAVNEST_SUMMARY_FD": str(w), **device_envs[i], **cache_env}
            if codec:
                env["RAVNEST_CODEC"] = codec
            launcher.start(
                name, cmd, env=env, on_line=lambda n, line, err: write(f"[{n}] {line.rstrip()}", err), pass_fds=(w,)
            )
            os.close(w)
            launcher.read(os.fdopen(r, "r"), summary_of(name))
        status = _Status(url, run_id, launcher.token)
        procs = launcher.peers()
        while any(p.poll() is None for p in procs.values()):
            refused = sorted(n for n, p in procs.items() if p.returncode == 2)
            if refused and len(refused) < len(procs):
                # exit status 2: a peer refused its input (one error line above); the others
                # would wait for it (a peer count to start with), so the run cannot go on
                write(f"{', '.join(refused)} refused its input (exit status 2): stopping the other peers", err=True)
                break
            if progress:
                bar.set_description_str(status.line(peers, time.monotonic() - t0), refresh=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        interrupted = True
        write(f"interrupted: stopping the peers (up to {stop_seconds:.0f} s; Ctrl+C again kills them now)", err=True)
    finally:
        try:
            launcher.stop_peers(stop_seconds)
        except KeyboardInterrupt:  # a second Ctrl+C: no more waiting
            interrupted = True
            write("killing the peers", err=True)
            launcher.stop_peers(5.0, sig=signal.SIGKILL)
        launcher.close(5.0)  # the rendezvous, and 5 s for the readers to end with the pipes
        bar.close()
    procs = launcher.peers()
    codes = {n: procs[n].returncode for n in peer_names if n in procs}
    # after Ctrl+C any exit is the interrupt's (it may land anywhere, an import say), not a failure
    failed = {} if interrupted else {n: c for n, c in codes.items() if c not in (0, None)}
    for n, c in failed.items():  # its output is on the console already, prefixed [name]
        how = f"was killed by {signal.Signals(-c).name}" if c < 0 else f"exited with status {c}"
        print(f"{n} {how}", file=sys.stderr)
    if codes and (summaries or not failed):  # no peer reported anything: the lines above say why
        print()
        print_summaries(summaries, codes, print)
    if summary_json:
        Path(summary_json).write_text(
            json.dumps(
                {
                    "run_id": run_id,
                    "command": cmd,
                    "interrupted": interrupted,
                    "peers": {n: {"exit": codes.get(n), "summary": summaries.get(n)} for n in peer_names},
                },
                indent=1,
            )
        )
    if interrupted:
        return 130
    if peers == 1 and failed and 0 < next(iter(failed.values())) < 126:
        return next(iter(failed.values()))  # a swarm of one: its peer's status (2: refused input)
    return 1 if failed or len(codes) < peers else 0


class _Status:
    """The rendezvous' view of the run, for the progress line (signed GET /status)."""

    def __init__(self, url: str, run_id: str, token: str):
        self.url, self.run_id, self.token = url, run_id, token.encode()
        self.last: dict = {}
        self._asked = 0.0

    def line(self, peers: int, elapsed: float) -> str:
        if time.monotonic() - self._asked > 1.0:
            self._asked = time.monotonic()
            try:
                self.last = self._ask()
            except Exception:  # noqa: BLE001 - a progress line only
                pass
        s = self.last
        live = len(s.get("peers", [])) if s else 0
        done = [r for r in s.get("rounds", []) if r.get("outcome") == "ok"] if s else []
        rnd = f"round {done[-1]['round']} done" if done else "no round yet"
        return f"{peers} peers ({live} live), {rnd}, {elapsed:.0f} s"

    def _ask(self) -> dict:
        import asyncio

        import aiohttp

        from ravnest_jax.swarm import signed_json

        async def go() -> Any:
            async with aiohttp.ClientSession() as s:
                return await signed_json(
                    s,
                    self.url,
                    "GET",
                    f"/v1/runs/{self.run_id}/status",
                    token=self.token,
                    run_id=self.run_id,
                    peer="launcher",
                    timeout=aiohttp.ClientTimeout(total=2),
                )

        return asyncio.run(go())
