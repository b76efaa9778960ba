"""The main job (`examples/char_lm/main.py --local-peers N`) leaves nothing behind: Ctrl+C on the
launcher, or the launcher killed with SIGKILL, stops the rendezvous and every peer process, frees
their ports and leaves no temporary files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _procfs import alive, descendants, listening_sockets, still_listening

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
        procs = descendants(launcher.pid)
        assert len(procs) >= 3, procs  # the rendezvous and two peers
        sockets = listening_sockets(procs)
        assert len(sockets) >= 3, sockets  # the rendezvous' and each peer's server
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
        while any(alive(p) for p in procs) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        assert not [p for p in procs if alive(p)], "processes left behind"
        assert not (left := still_listening(sockets)), f"ports still listening, and who holds them: {left}"
        assert not list(tmp.iterdir()), list(tmp.iterdir())
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        launcher.stdout.close()
