"""The main job split into pipeline stages (``main.py --stages S``): flag checks, and a local run
of 2 clusters x 2 stages whose summary reports each stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "char_lm" / "main.py")
sys.path.insert(0, str(ROOT / "examples"))

import char_lm  # noqa: E402

TINY = [
    "--d-model",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--eval-batches",
    "1",
]


@pytest.mark.parametrize(
    "bad,needle",
    [
        (["--local-peers", "3", "--stages", "2"], "multiple of --stages"),
        (["--stages", "2"], "applies to swarm peers"),
        (["--local-peers", "4", "--stages", "2", "--devices", "2"], "--devices"),
        (["--local-peers", "5", "--stages", "5", "--layers", "2"], "at most --layers + 2"),
        (["--local-peers", "4", "--stages", "2", "--micro-batches", "3"], "multiple of --micro-batches"),
        (["--local-peers", "4", "--standbys", "1"], "--standbys needs --stages"),
        (["--local-peers", "4", "--stages", "2", "--in-flight", "1"], "--in-flight (1) must be in [--stages"),
        (["--local-peers", "4", "--stages", "2", "--micro-batches", "4", "--in-flight", "6"], "= [2, 5]"),
        (["--local-peers", "2", "--stages", "2", "--checkpoint-dir", "{file}"], "is a file, not a directory"),
        (["--local-peers", "2", "--checkpoint-dir", "{file}"], "is a file, not a directory"),
        # the stage groups' rounds take --codec only: the other round flags are refused, not ignored
        (["--local-peers", "4", "--stages", "2", "--codec", "sign", "--mean-codec", "int2"], "--mean-codec is not"),
        (["--local-peers", "4", "--stages", "2", "--codec", "sign", "--mean-ef", "on"], "--mean-ef on is not"),
        (["--local-peers", "4", "--stages", "2", "--block-size", "512"], "--block-size is not"),
        (["--local-peers", "4", "--stages", "2", "--aggregator", "mean"], "--aggregator is not"),
        (["--local-peers", "4", "--stages", "2", "--ef-decay", "0.9"], "--ef-decay is not"),
    ],
)
def test_bad_stage_flags_are_one_line(bad, needle, capsys):
    if "{file}" in bad:  # a --checkpoint-dir that is a file (with or without --stages)
        bad = [str(Path(__file__)) if a == "{file}" else a for a in bad]
    with pytest.raises(SystemExit) as e:
        char_lm.parse_args(bad)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_two_clusters_of_two_stages(tmp_path):
    out = tmp_path / "summary.json"
    # (the standby's takeover is tests/pipeline/test_clusters.py's; a fifth process here would
    # cost the suite a minute)
    # a depth above 1F1B's (3 micro-batches in flight on stage 0, not 2): through real processes
    args = ["--local-peers", "4", "--stages", "2", "--in-flight", "3", "--max-steps", "12", "--sync-every", "4"]
    args += [*TINY, "--no-progress", "--log-every", "4", "--summary-json", str(out)]
    r = subprocess.run(
        [sys.executable, EXAMPLE, *args],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "round digests identical within every stage group: yes" in r.stdout, r.stdout[-3000:]
    s = json.loads(out.read_text())
    assert s["pipeline"] and s["round_digests_equal"] and not s["failed_peers"], s["failed_peers"]
    roles = sorted(p["role"] for p in s["peers"])
    assert roles == ["active"] * 4, roles
    assert [st["stage"] for st in s["stages"]] == [0, 1]
    for st in s["stages"]:
        assert 0 < st["utilisation"] <= 1 and abs(st["bubble_fraction"] + st["utilisation"] - 1) < 1e-9, st
        assert st["activation_bytes_sent"] > 0 and st["outer_rounds"] == 3, st
    evals = s["stages"][1]["eval_loss_end"]
    assert len(evals) == 2 and all(0 < e < 6 for e in evals), evals
    # each peer's round log, plotted per stage group by ravnest-jax report
    logs = {
        (p["stage"], p["peer"]): [(r["step"], r["train_loss"] is not None) for r in p["round_log"]] for p in s["peers"]
    }
    want = {1: [(4, True), (8, True), (12, True)], 0: [(4, False), (8, False), (12, False)]}  # the last stage's loss
    assert all(v == want[stage] for (stage, _), v in logs.items()), logs
    from ravnest_jax.cli import main

    assert main(["report", str(out)]) == 0
    pngs = {k: (tmp_path / f"summary.{k}.png") for k in ("loss", "utilisation", "bytes")}
    assert all(p.is_file() and p.stat().st_size > 10_000 for p in pngs.values()), pngs
