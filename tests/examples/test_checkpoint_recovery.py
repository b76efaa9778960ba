"""Checkpoint recovery a user can read, with the real command (`examples/char_lm/main.py`) and
real orbax checkpoints: every checkpoint of a peer corrupt is one `error:` line (at most 5 lines
of stderr, no traceback flood) and a non-zero exit; running the same command again is refused
in one line until `--fresh`, which starts from step 0; a corrupt newest checkpoint under
`--local-peers` is skipped with a warning on the console, prefixed with the peer's name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from _cluster import Cluster, cluster_of

pytestmark = pytest.mark.integration  # real processes and training: a minute or two in all

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "char_lm" / "main.py")
TOKEN = "0123456789abcdef0123456789abcdef"
TINY = [
    "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "4",
    "--eval-batches", "1", "--lr", "1e-2", "--schedule-steps", "200", "--sync-every", "5", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_bytes(b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:40]))
    return path


@pytest.fixture(scope="module")
def good_checkpoints(tmp_path_factory, text: Path) -> Path:
    """A local swarm of one peer trained 15 steps with checkpoints: ``<root>/peer0/<step>``."""
    root = tmp_path_factory.mktemp("ckpt")
    run = subprocess.run(
        [sys.executable, MAIN, "--local-peers", "1", "--max-steps", "15", "--text", str(text), *TINY]
        + ["--checkpoint-dir", str(root / "ck"), "--summary-json", str(root / "s.json")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    steps = sorted(int(p.name) for p in (root / "ck" / "peer0").iterdir() if p.name.isdigit())
    assert len(steps) >= 2, steps
    return root / "ck"


def _truncate_all(step_dir: Path) -> None:
    """Halves every data file of a step's items (orbax's OCDBT chunks under ``d/``)."""
    files = [f for f in step_dir.rglob("*") if f.is_file() and f.parent.name == "d"]
    assert files, step_dir
    for f in files:
        os.truncate(f, f.stat().st_size // 2)


@pytest.fixture
def rendezvous(tmp_path: Path):
    """A real rendezvous on 127.0.0.1 (the shared cluster's); yields its URL."""
    with cluster_of(Cluster(tmp_path, token=TOKEN)) as c:
        yield c.rendezvous(heartbeat=None, eviction=None, extra=("--quiet",), timeout=60)


def _peer(url: str, ckpt: Path, text: Path, run_id: str, *extra: str) -> subprocess.CompletedProcess:
    """One peer of the main job (``main.py --rendezvous``) as a user runs it."""
    return subprocess.run(
        [sys.executable, MAIN, "--rendezvous", url, "--run-id", run_id, "--listen", "127.0.0.1:0"]
        + ["--max-steps", "10", "--text", str(text), "--checkpoint-dir", str(ckpt), "--json-events", *TINY, *extra],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "RAVNEST_TOKEN": TOKEN},
    )


@pytest.mark.timeout(600)
def test_all_corrupt_is_one_line_then_refused_until_fresh(
    tmp_path: Path, good_checkpoints: Path, text: Path, rendezvous: str
) -> None:
    ckpt = tmp_path / "peer0"
    shutil.copytree(good_checkpoints / "peer0", ckpt)
    steps = sorted((int(p.name) for p in ckpt.iterdir() if p.name.isdigit()), reverse=True)
    for s in steps:
        _truncate_all(ckpt / str(s))

    run = _peer(rendezvous, ckpt, text, "r1")
    lines = run.stderr.splitlines()
    assert run.returncode != 0, run.stderr
    assert len(lines) <= 5 and "Traceback" not in run.stderr, f"{len(lines)} lines of stderr:\n{run.stderr[:3000]}"
    (error,) = [ln for ln in lines if ln.startswith("error: ")]
    tried = ", ".join(str(s) for s in steps)
    assert f"no readable checkpoint in {ckpt}: tried steps {tried}" in error and "--fresh" in error, error
    assert sorted(p.name for p in ckpt.iterdir() if "corrupt" in p.name) == sorted(f"{s}.corrupt" for s in steps)

    again = _peer(rendezvous, ckpt, text, "r2")  # the same command: refused, not a silent step 0
    assert again.returncode != 0 and again.stderr.count("\n") == 1, again.stderr
    assert again.stderr.startswith("error: checkpoint directory") and "--fresh" in again.stderr, again.stderr

    fresh = _peer(rendezvous, ckpt, text, "r3", "--fresh")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    start = next(json.loads(ln) for ln in fresh.stdout.splitlines() if '"event": "start"' in ln)
    assert start["step"] == 0, start
    (kept,) = [p for p in ckpt.iterdir() if p.name.startswith("previous-")]
    assert sorted(p.name for p in kept.iterdir()) == sorted(f"{s}.corrupt" for s in steps), list(kept.iterdir())
    assert "fresh start in" in fresh.stderr and str(kept) in fresh.stderr, fresh.stderr


@pytest.mark.timeout(600)
def test_corrupt_newest_under_local_peers_is_a_prefixed_warning(
    tmp_path: Path, good_checkpoints: Path, text: Path
) -> None:
    root = tmp_path / "ck"
    shutil.copytree(good_checkpoints, root)
    steps = sorted(int(p.name) for p in (root / "peer0").iterdir() if p.name.isdigit())
    _truncate_all(root / "peer0" / str(steps[-1]))
    run = subprocess.run(
        [sys.executable, MAIN, "--local-peers", "1", "--max-steps", "20", "--text", str(text), *TINY]
        + ["--checkpoint-dir", str(root), "--summary-json", str(tmp_path / "s.json")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    warned = [ln for ln in run.stderr.splitlines() if ln.startswith("[peer0] WARNING CorruptCheckpointWarning")]
    assert len(warned) == 1, run.stderr
    assert f"checkpoint step {steps[-1]} " in warned[0] and f"resumed from step {steps[-2]}" in warned[0], warned
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["peers"][0]["resumed_from_step"] == steps[-2], doc["peers"][0]
