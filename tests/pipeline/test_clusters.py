"""Clusters of stage peers (real processes) averaged with DiLoCo per stage, placement, and a
stage peer killed with -9 while a standby waits."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "_stage_worker.py"

pytestmark = pytest.mark.integration


def _rounds(proc) -> dict[int, str]:
    return {e["round"]: e["digest"] for e in proc.all if e.get("event") == "round" and e.get("ok")}


@pytest.mark.slow  # default suite: the takeover test below and the example's 2 x 2 clusters test
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


def test_kill_9_a_stage_peer_a_standby_takes_over(pipe_cluster):
    """5 peers placed as 2 clusters x 2 stages + 1 standby; the stage-1 peer of cluster 0 is
    killed with -9 mid-run. Cluster 0's pipeline stops within one deadline, the standby takes
    stage 1 over with the state downloaded from cluster 1's stage-1 peer, the cut step is
    replayed, cluster 1 trains on meanwhile, and the standby's digest is the group's within 2
    rounds."""
    pipe_cluster.rendezvous(heartbeat=0.5, eviction=3.0)
    common = ["--stages", "2", "--expected-peers", "5", "--clusters", "2", "--standbys", "1"]
    common += ["--steps", "40", "--diloco", "4", "--pad", "0.03", "--recv-timeout", "4"]
    procs = [pipe_cluster.start(f"p{i}", WORKER, *common, "--peer-id", f"p{i}") for i in range(5)]
    placed = {p.name: p.expect("placed", timeout=240) for p in procs}
    roles = collections.Counter(e["role"] for e in placed.values())
    assert roles == {"active": 4, "standby": 1}, placed
    by_slot = {(e["cluster"], e["stage"]): p for p in procs if (e := placed[p.name])["role"] == "active"}
    standby = next(p for p in procs if placed[p.name]["role"] == "standby")
    victim, partner, replica = by_slot[(0, 1)], by_slot[(0, 0)], by_slot[(1, 1)]
    # kill once stage 1 of cluster 0 has merged a round
    deadline = time.monotonic() + 240
    while not _rounds(victim):
        assert time.monotonic() < deadline and victim.p.poll() is None, victim.stderr()
        time.sleep(0.1)
    victim.kill9()
    t_kill = time.time()
    active = standby.expect("active", timeout=120)
    assert (active["cluster"], active["stage"]) == (0, 1) and active["joined"] == "joined", active
    for p in procs:
        if p is not victim:
            p.expect("done", timeout=240)
            assert p.wait(30) == 0, f"{p.name}: {p.stderr()}"
    # cluster 0's stage 0 noticed within one deadline (4 s) plus the abort and went on in a new epoch
    m = next(e for e in partner.all if e.get("event") == "done")["metrics"]
    assert m["recoveries"] >= 1 and m["replayed_steps"] >= 1, m
    assert m["break_times"][0] - t_kill <= 4.0 + 1.0, f"broke {m['break_times'][0] - t_kill:.1f} s after the kill"
    # cluster 1 kept training while cluster 0 waited for the standby
    resumed = min(e["t"] for e in standby.all if e.get("event") == "step")
    c1_steps = [e for e in by_slot[(1, 1)].all if e.get("event") == "step" and t_kill < e["t"] < resumed]
    assert c1_steps, f"cluster 1 made no step between the kill ({t_kill:.1f}) and the takeover ({resumed:.1f})"
    # the standby's global state joins the group's within 2 of its rounds
    mine, theirs = _rounds(standby), _rounds(replica)
    common_rounds = sorted(set(mine) & set(theirs))
    assert common_rounds, f"no common round: standby {sorted(mine)}, replica {sorted(theirs)}"
    first_equal = next((r for r in sorted(mine) if theirs.get(r) == mine[r]), None)
    assert first_equal is not None and sorted(mine).index(first_equal) <= 1, (mine, theirs)
    assert all(mine[r] == theirs[r] for r in common_rounds if r >= first_equal), (mine, theirs)
