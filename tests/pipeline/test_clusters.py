"""Clusters of stage peers (real processes) averaged with DiLoCo per stage, placement, and a
stage peer killed with -9 while a standby waits."""

from __future__ import annotations

from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "_stage_worker.py"

pytestmark = pytest.mark.integration


def _rounds(proc) -> dict[int, str]:
    return {e["round"]: e["digest"] for e in proc.all if e.get("event") == "round" and e.get("ok")}


def test_two_clusters_of_two_stages_average_each_stage_with_diloco(pipe_cluster):
    pipe_cluster.rendezvous()
    procs = {}
    for c in range(2):
        for s in range(2):
            args = ["--stages", "2", "--stage", str(s), "--cluster", str(c), "--steps", "8", "--diloco", "2"]
            procs[(c, s)] = pipe_cluster.start(f"c{c}s{s}", WORKER, *args)
    for p in procs.values():
        p.expect("done", timeout=300)
        assert p.wait(30) == 0, p.stderr()
    for s in range(2):
        a, b = _rounds(procs[(0, s)]), _rounds(procs[(1, s)])
        assert len(a) == 4 and a.keys() == b.keys(), f"stage {s}: rounds {sorted(a)} vs {sorted(b)}"
        assert a == b, f"stage {s}: digests differ per round: {a} vs {b}"
    # the two stage groups are different runs with different params: their digests differ
    assert set(_rounds(procs[(0, 0)]).values()).isdisjoint(_rounds(procs[(0, 1)]).values())
    # each cluster trained on its own data: their last losses differ
    last = {c: [e["loss"] for e in procs[(c, 1)].all if e.get("event") == "step"][-1] for c in range(2)}
    assert last[0] != last[1], last
