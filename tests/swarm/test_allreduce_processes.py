"""All-reduce among real peer processes on 127.0.0.1: exact fp32 means, identical digests."""

from __future__ import annotations

import pytest

from ._expect import check_round

pytestmark = pytest.mark.integration  # real processes: minutes in all


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "n,algorithm", [(2, "butterfly"), (4, "butterfly"), (8, "butterfly"), (3, "ring"), (8, "ring")]
)
def test_all_reduce_matches_numpy_weighted_mean(cluster, n, algorithm):
    cluster.rendezvous()
    size, rounds = 1001, 2
    peers = {f"p{i}": (10 + i, 1.0 + i) for i in range(n)}  # id -> (seed, weight)
    procs = {
        pid: cluster.peer(
            pid, seed, weight=w, rounds=rounds, size=size, expect_peers=n, part_timeout=10, algorithm=algorithm
        )
        for pid, (seed, w) in peers.items()
    }
    cluster.ready(list(procs.values()))
    for p in procs.values():
        p.expect("done", 60)
        assert p.wait(10) == 0
    for i in range(rounds):
        events = {pid: p.rounds()[i] for pid, p in procs.items()}
        assert {e["round"] for e in events.values()} == {i}
        assert all(e["attempts"] == 1 and e["algorithm"] == algorithm for e in events.values())
        check_round(peers, events, i, size, sorted(peers))
        assert events["p0"]["total_weight"] == pytest.approx(sum(w for _, w in peers.values()))


# worst-case |result - exact mean| / max|input| after two quantisations (parts, then the
# all-gathered mean), from the per-codec bounds of docs/compression.md
LOSSY_BOUND = {
    "bf16": 2 * 2.0**-8,
    "int8": 2 / 254 * 1.02,
    "int4": 2 / 14 * 1.02,
    "fp4": 0.5,
    "topk": 2.0,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", sorted(LOSSY_BOUND))
def test_lossy_codecs_within_bound_and_identical(cluster, codec):
    import numpy as np

    from ._expect import expected_mean, flat_input

    cluster.rendezvous()
    size = 2001
    peers = {f"p{i}": (20 + i, 1.0 + i) for i in range(3)}
    procs = {
        pid: cluster.peer(pid, seed, weight=w, rounds=1, size=size, expect_peers=3, codec=codec, part_timeout=10)
        for pid, (seed, w) in peers.items()
    }
    cluster.ready(list(procs.values()))
    for p in procs.values():
        p.expect("done", 40)
        assert p.wait(10) == 0
    events = {pid: p.rounds()[0] for pid, p in procs.items()}
    assert all(e["ok"] for e in events.values())
    assert len({e["digest"] for e in events.values()}) == 1
    assert all(e["contributors"] == sorted(peers) for e in events.values())
    exp = expected_mean(list(peers.values()), 0, size)
    got = np.load(events["p0"]["result_file"]).astype(np.float64)
    m = max(np.abs(flat_input(s, 0, size)).max() for s, _ in peers.values())
    assert np.abs(got - exp).max() <= LOSSY_BOUND[codec] * m
    if codec != "topk":
        assert np.abs(got - exp).max() > 0  # it really was lossy
