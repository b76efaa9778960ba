"""A peer that stops cleanly costs the others at most one part deadline (in fact about one
heartbeat): the rendezvous drops it from the running attempt and tells the members."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration  # real processes: minutes in all

PART = 8.0  # the part deadline: a leave must cost less than this


def _start(cluster, peers: dict[str, dict]):
    cluster.rendezvous(eviction=30.0)  # eviction would take 30 s: only the leave can help
    procs = {
        pid: cluster.peer(pid, i + 1, expect_peers=len(peers), part_timeout=PART, size=20_001, **kw)
        for i, (pid, kw) in enumerate(peers.items())
    }
    cluster.ready(list(procs.values()))
    for p in procs.values():
        p.expect("peers", 30)
    return procs


@pytest.mark.timeout(90)
def test_a_peer_that_leaves_between_rounds_costs_no_part_deadline(cluster):
    # b leaves after 2 rounds; the round after was already created with b in its group (it is
    # handed out with the commit of the last round)
    procs = _start(cluster, {"a": {"rounds": 5, "round_sleep": 0.3}, "b": {"rounds": 2, "round_sleep": 0.3}})
    procs["b"].expect("done", 60)
    assert procs["b"].wait(20) == 0, procs["b"].stderr()
    procs["a"].expect("done", 60)
    rounds = procs["a"].rounds()
    assert [r["ok"] for r in rounds] == [True] * 5, rounds
    after = rounds[2]
    assert after["seconds"] < PART, (after, procs["a"].stderr())
    assert after["contributors"] == ["a"], after
    assert all(r["contributors"] == ["a", "b"] for r in rounds[:2]), rounds


@pytest.mark.timeout(90)
def test_a_peer_stopped_mid_round_costs_no_part_deadline(cluster):
    # b streams its parts slowly (0.5 s per chunk) and is stopped (SIGTERM: a clean leave)
    # while it sends in round 1
    procs = _start(cluster, {"a": {"rounds": 4, "round_sleep": 0.2}, "b": {"rounds": 4, "send_delay": 0.5}})
    ev = procs["b"].expect("round_begin", 30)
    while ev["round"] < 1:
        ev = procs["b"].expect("round_begin", 30)
    procs["b"].p.terminate()
    assert procs["b"].wait(20) == 0, procs["b"].stderr()
    procs["a"].expect("done", 60)
    rounds = procs["a"].rounds()
    assert all(r["ok"] for r in rounds), rounds
    hit = [r for r in rounds if r["contributors"] == ["a"]][0]
    assert hit["round"] == 1 and hit["seconds"] < PART, (hit, procs["a"].stderr())
