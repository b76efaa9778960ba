"""The main job (`examples/char_lm/main.py --local-peers N`) leaves nothing behind: Ctrl+C on the
launcher, or the launcher killed with SIGKILL, stops the rendezvous and every peer process, frees
their ports and leaves no temporary files."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # real processes: minutes in all

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--d-model",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--eval-batches",
    "1",
    "--lr",
    "1e-2",
    "--schedule-steps",
    "200",
    "--sync-every",
    "5",
    "--min-step-seconds",
    "0.05",
    "--no-progress",
]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listening_ports(pids: set[int]) -> set[int]:
    """TCP ports in LISTEN state owned by these processes (from /proc/net/tcp*)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "kill-9"])
def test_launcher_stop_leaves_no_process_port_or_temp_file(tmp_path, how):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    import sysconfig  # a small real text (standard-library source) keeps start-up short

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = tmp_path / "text.txt"
    text.write_bytes(b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:40]))
    launcher = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "char_lm" / "main.py"),
            "--local-peers",
            "2",
            "--max-steps",
            "100000",
            "--text",
            str(text),
            *TINY,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        seen = []
        for line in launcher.stdout:  # the peers are training once a round is reported
            seen.append(line)
            if line.startswith("round ") and ": ok" in line:
                break
            assert time.monotonic() < deadline, "".join(seen)
        else:
            raise AssertionError("the launcher ended early:\n" + "".join(seen))
        procs = _descendants(launcher.pid)
        assert len(procs) >= 3, procs  # the rendezvous and two peers
        ports = _listening_ports(procs)
        assert len(ports) >= 3, ports  # the rendezvous' and each peer's server
        t0 = time.monotonic()
        if how in ("ctrl-c", "sigterm"):  # SIGTERM (kill, docker stop) stops like Ctrl+C
            launcher.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGTERM)
            launcher.wait(timeout=60)
            assert launcher.returncode == (130 if how == "ctrl-c" else 143)
            rest = launcher.stdout.read()
            assert "interrupted" in rest and "Traceback" not in rest, rest
        else:
            launcher.kill()
            launcher.wait(timeout=10)
        while any(_alive(p) for p in procs) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        assert not [p for p in procs if _alive(p)], "processes left behind"
        assert all(_refused(p) for p in ports), ports
        assert not list(tmp.iterdir()), list(tmp.iterdir())
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        launcher.stdout.close()
