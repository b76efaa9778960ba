"""All-reduce among real peer processes on 127.0.0.1: exact fp32 means, identical digests."""

from __future__ import annotations

import pytest

from ._expect import check_round


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_matches_numpy_weighted_mean(cluster, n):
    cluster.rendezvous()
    size, rounds = 1001, 2
    peers = {f"p{i}": (10 + i, 1.0 + i) for i in range(n)}  # id -> (seed, weight)
    procs = {pid: cluster.peer(pid, seed, weight=w, rounds=rounds, size=size, expect_peers=n,
                               part_timeout=10)
             for pid, (seed, w) in peers.items()}
    cluster.ready(list(procs.values()))
    for p in procs.values():
        p.expect("done", 60)
        assert p.wait(10) == 0
    for i in range(rounds):
        events = {pid: p.rounds()[i] for pid, p in procs.items()}
        assert {e["round"] for e in events.values()} == {i}
        assert all(e["attempts"] == 1 for e in events.values())
        check_round(peers, events, i, size, sorted(peers))
        assert events["p0"]["total_weight"] == pytest.approx(sum(w for _, w in peers.values()))
