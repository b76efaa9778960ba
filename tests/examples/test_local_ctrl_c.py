"""Ctrl+C keeps finished work: SIGINT to the process group of the main job
(`examples/char_lm/main.py --local-peers 2`), as a terminal sends it, while the peers compile,
mid-round and during their final eval: exit 130 within 5 s, the table and the summary JSON every
time (a row for every peer, those without a report saying why), and no process, listening port
or temporary file left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from _procfs import alive, descendants, listening_sockets, still_listening

pytestmark = pytest.mark.integration  # real processes: a minute or so each

ROOT = Path(__file__).resolve().parents[2]
PEERS = 2
TINY = [
    "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "4",
    "--lr", "1e-2", "--schedule-steps", "200", "--sync-every", "5", "--no-progress",
]  # fmt: skip
# the line of the main job's output that marks each moment (--no-progress prints them)
MOMENTS = {
    "compile": lambda line: line.startswith(f"all {PEERS} peers compiling"),
    "mid-round": lambda line: line.startswith("round ") and ": ok" in line,
    "final-eval": lambda line: line.startswith(f"final eval on all {PEERS} peers"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_prints_the_table_writes_the_summary_and_leaves_nothing(tmp_path: Path, moment: str) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = tmp_path / "text.txt"
    text.write_bytes(b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:40]))
    summary = tmp_path / "summary.json"
    if moment == "final-eval":  # training ends after 2 rounds; a long final eval: the last peer's
        # must still run when the SIGINT comes (the launcher's line follows its start). One jitted
        # map over the batches, 0.8 ms a batch on 2 cores: 600 batches (0.5 s) ended before the
        # SIGINT on a loaded CI machine; 8,000 (6 s, 34 MB of tokens a peer) leave 12 times that
        length = ["--max-steps", "10", "--eval-batches", "8000"]
    else:  # trains until interrupted
        length = ["--max-steps", "100000", "--eval-batches", "1", "--min-step-seconds", "0.05"]
    job = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "char_lm" / "main.py"), "--local-peers", str(PEERS)]
        + ["--text", str(text), "--summary-json", str(summary), *TINY, *length],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
        start_new_session=True,  # its own process group, as a terminal's job
    )
    try:
        seen = []
        for line in job.stdout:  # the moment, from the job's own output
            seen.append(line)
            if MOMENTS[moment](line):
                break
        else:
            raise AssertionError(f"the job ended before the {moment} moment:\n" + "".join(seen))
        procs = descendants(job.pid)
        sockets = listening_sockets(procs)
        assert len(procs) >= PEERS + 1, (moment, procs)  # the rendezvous and the peers
        t0 = time.monotonic()
        os.killpg(job.pid, signal.SIGINT)  # Ctrl+C in a terminal: the whole foreground group
        rest = job.stdout.read()
        job.wait(timeout=30)
        took = time.monotonic() - t0
        out = "".join(seen) + rest
        assert job.returncode == 130, (job.returncode, out)
        assert took <= 5.0, f"exit {took:.2f} s after SIGINT ({moment})\n{out}"
        assert "Traceback" not in rest, rest
        # the table: its header and a row for every peer, reported or not
        assert "| peer " in rest, rest
        for i in range(PEERS):
            assert f"| peer{i} " in rest, (i, rest)
        doc = json.loads(summary.read_text())
        assert doc["interrupted"] is True, doc
        reported = {r["peer"] for r in doc["peers"]}
        assert reported | set(doc["peers_without_report"]) == {f"peer{i}" for i in range(PEERS)}, doc
        if moment == "compile":  # nobody trained: each row says why there is no report
            assert not reported and all(
                w.startswith("no report: interrupted before its first round")
                for w in doc["peers_without_report"].values()
            ), doc["peers_without_report"]
        else:  # the peers were training: every one reported
            assert len(reported) == PEERS, doc["peers_without_report"]
        if moment == "mid-round":  # training interrupted: no final eval, and none said cut
            assert not any(r["eval_interrupted"] for r in doc["peers"]), doc["peers"]
            assert "eval end: interrupted" not in rest and "in the final eval" not in rest, rest
        if moment == "final-eval":  # training was done: figures kept, the eval marked interrupted
            assert all(r["end_step"] == 10 for r in doc["peers"]), [r["end_step"] for r in doc["peers"]]
            cut = [r["peer"] for r in doc["peers"] if r["eval_interrupted"]]
            assert cut and all(r["eval_loss_end"] is None for r in doc["peers"] if r["eval_interrupted"]), doc["peers"]
            assert "eval end: interrupted" in rest, rest
        # nothing left: processes, ports, temporary files
        assert not [p for p in procs if alive(p)], [p for p in procs if alive(p)]
        assert not (left := still_listening(sockets)), f"ports still listening, and who holds them: {left}"
        assert not list(tmp.iterdir()), list(tmp.iterdir())
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        job.stdout.close()
