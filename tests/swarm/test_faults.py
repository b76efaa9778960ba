"""Faults among real peer processes: kill -9, a hung peer, a wrong token, a rendezvous restart.

In each, the survivors finish, results agree (digests, contributors), nothing hangs, and the
``cluster`` fixture checks that no process or port is left behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from ._expect import check_round

pytestmark = pytest.mark.integration  # real processes: minutes in all

SIZE = 200_001  # floats: parts of 3 peers are ~267 kB, i.e. 2 streamed chunks


def _launch(cluster, peers, per_peer, rendezvous_extra=(), **common):
    cluster.rendezvous(eviction=4.0, extra=rendezvous_extra)
    procs = {
        pid: cluster.peer(pid, seed, weight=w, **{**common, **per_peer.get(pid, {})})
        for pid, (seed, w) in peers.items()
    }
    cluster.ready(list(procs.values()))
    for p in procs.values():
        p.expect("peers", 30)
    return procs


def _finish(procs, timeout=40):
    for p in procs.values():
        p.expect("done", timeout)
        assert p.wait(10) == 0, p.stderr()


def _round_events(procs, i):
    return {pid: p.rounds()[i] for pid, p in procs.items() if len(p.rounds()) > i}


PEERS3 = {"a": (1, 1.0), "b": (2, 2.0), "c": (3, 3.0)}


@pytest.mark.timeout(60)
def test_kill9_peer_while_it_sends(cluster):
    procs = _launch(cluster, PEERS3, {"c": {"send_delay": 1.0}}, size=SIZE, rounds=2, expect_peers=3, part_timeout=2.0)
    time.sleep(0.8)  # c is streaming its parts (1 s per chunk)
    procs["c"].kill9()
    t0 = time.monotonic()
    live = {k: v for k, v in procs.items() if k != "c"}
    _finish(live)
    for i in range(2):
        ev = _round_events(live, i)
        check_round(PEERS3, ev, i, SIZE, ["a", "b"])
    first = _round_events(live, 0)
    assert max(e["seconds"] for e in first.values()) < 2.0 + 0.5 + 2.5
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_kill9_part_owner_mid_round(cluster):
    # a and b stream slowly, so c (fast) has sent everything and is only a part owner when killed
    procs = _launch(
        cluster,
        PEERS3,
        {"a": {"send_delay": 0.6}, "b": {"send_delay": 0.6}},
        size=SIZE,
        rounds=2,
        expect_peers=3,
        part_timeout=2.5,
    )
    time.sleep(0.5)
    procs["c"].kill9()
    live = {k: v for k, v in procs.items() if k != "c"}
    _finish(live)
    ev0 = _round_events(live, 0)
    check_round(PEERS3, ev0, 0, SIZE, ["a", "b"])
    assert all(e["attempts"] == 2 for e in ev0.values())
    check_round(PEERS3, _round_events(live, 1), 1, SIZE, ["a", "b"])


@pytest.mark.timeout(60)
def test_kill9_part_owner_during_all_gather(cluster):
    """c dies after the gather vote, before serving its result part: the commit vote fails,
    a and b retry the round without c and agree."""
    procs = _launch(cluster, PEERS3, {"c": {"serve_delay": 3.0}}, size=SIZE, rounds=2, expect_peers=3, part_timeout=2.0)
    time.sleep(1.0)  # phase 1 takes well under a second; c now delays its result part
    procs["c"].kill9()
    live = {k: v for k, v in procs.items() if k != "c"}
    _finish(live)
    ev0 = _round_events(live, 0)
    check_round(PEERS3, ev0, 0, SIZE, ["a", "b"])
    assert all(e["attempts"] == 2 for e in ev0.values())
    # c is dead and was left out: the next round does not wait for it again
    ev1 = _round_events(live, 1)
    assert all(e["attempts"] == 1 and e["seconds"] < 2.0 for e in ev1.values())
    check_round(PEERS3, _round_events(live, 1), 1, SIZE, ["a", "b"])


@pytest.mark.timeout(60)
def test_unreachable_peer_is_left_out_not_everybody_else(cluster):
    """c advertises a dead address (think: behind NAT) and the rendezvous does not probe it
    (``--probe-timeout 0``; with the probe, c would turn client-only and take part, see
    test_client_only.py): it reaches the others, they cannot reach it. The round must go on
    among a and b, not shrink to c's contribution alone."""
    procs = _launch(
        cluster,
        PEERS3,
        {"c": {"advertise": "http://127.0.0.1:9"}},
        rendezvous_extra=("--probe-timeout", "0"),
        size=1001,
        rounds=2,
        expect_peers=3,
        part_timeout=1.5,
    )
    _finish(procs)
    live = {k: v for k, v in procs.items() if k != "c"}
    for i in range(2):
        check_round(PEERS3, _round_events(live, i), i, 1001, ["a", "b"])
    assert not any(e["ok"] for e in procs["c"].rounds())
    assert "could not reach" in procs["c"].rounds()[0]["error"] or "left out" in procs["c"].rounds()[0]["error"]


@pytest.mark.timeout(60)
def test_ring_survives_a_peer_killed_mid_round(cluster):
    peers = {"a": (1, 1.0), "b": (2, 2.0), "c": (3, 3.0), "d": (4, 4.0)}
    procs = _launch(
        cluster,
        peers,
        {"c": {"send_delay": 1.0}},
        size=SIZE,
        rounds=2,
        expect_peers=4,
        part_timeout=2.0,
        algorithm="ring",
        ring_segment_bytes=64 * 1024,
    )  # parts of ~200 kB: 4 segments
    time.sleep(0.8)
    procs["c"].kill9()
    live = {k: v for k, v in procs.items() if k != "c"}
    _finish(live)
    for i in range(2):
        ev = _round_events(live, i)
        check_round(peers, ev, i, SIZE, ["a", "b", "d"])
        assert all(e["algorithm"] == "ring" for e in ev.values())


@pytest.mark.timeout(90)
def test_ring_member_hung_past_its_eviction_costs_an_eviction_not_the_part_deadline(cluster):
    """SIGSTOP one member of a ring in its round: its neighbours stop waiting once the heartbeat
    answers name it evicted (4 s) and retry without it, not at the part deadline (20 s)."""
    procs = _launch(
        cluster, PEERS3, {}, size=SIZE, rounds=2, expect_peers=3, part_timeout=20.0, algorithm="ring", round_timeout=60
    )
    procs["c"].expect("round_begin", 30)
    os.kill(procs["c"].p.pid, signal.SIGSTOP)
    try:
        live = {k: v for k, v in procs.items() if k != "c"}
        for p in live.values():
            p.expect("round", 40)
    finally:
        procs["c"].kill9()
    _finish(live)
    ev0 = _round_events(live, 0)
    check_round(PEERS3, ev0, 0, SIZE, ["a", "b"])
    seconds = {k: e["seconds"] for k, e in ev0.items()}
    assert max(seconds.values()) < 20.0 - 6.0, (seconds, "waited for the part deadline")


def _agree_by_round(procs):
    by_round: dict[int, list[dict]] = {}
    for p in procs.values():
        for e in p.rounds():
            if e["ok"]:
                by_round.setdefault(e["round"], []).append(e)
    for r, evs in by_round.items():
        assert len({e["digest"] for e in evs}) == 1, r
        assert len({tuple(e["contributors"]) for e in evs}) == 1, r
    return by_round


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hung_before_vote", [False, True])
def test_hung_peer_past_the_deadline(cluster, hung_before_vote):
    """SIGSTOP one peer mid-round for longer than the part deadline, then resume it.

    hung_before_vote=False: c already holds every part it owns and voted, but its own uploads
    hang: it is left out of the contributors, yet everybody (c too) gets the same result.
    hung_before_vote=True: c hangs as a part owner before voting: a and b retry without it and
    finish; c, once resumed, gets a clear failed result and joins a later round.
    """
    slow = (
        {"a": {"send_delay": 0.5}, "b": {"send_delay": 0.5}, "c": {"send_delay": 0.5}}
        if hung_before_vote
        else {"c": {"send_delay": 0.5}}
    )
    procs = _launch(cluster, PEERS3, slow, size=SIZE, rounds=4, expect_peers=3, part_timeout=2.0, round_sleep=0.2)
    # stop c at the moment the case needs, whatever the load: once it voted (it holds every
    # part it owns), or as soon as it is in round 0 (its slow senders need >= 1 s to reach it)
    ev = procs["c"].expect("round_begin" if hung_before_vote else "gather_vote", 30)
    assert ev["round"] == 0 and ev["attempt"] == 0, ev
    if not hung_before_vote:  # the record precedes the vote request: wait until it arrived
        cluster.rv.expect_log("gather vote from c", 30)
    os.kill(procs["c"].p.pid, signal.SIGSTOP)
    try:
        # ...and resume it once a has the gather decision of round 0: past the part deadline (c's
        # uploads missed it; or c never voted), and with the whole all-gather window left for c
        # to push its result part (a fixed sleep made this depend on the machine's load)
        dec = procs["a"].expect("gather_decided", 30)
        assert dec["round"] == 0 and dec["attempt"] == 0, dec
    finally:
        os.kill(procs["c"].p.pid, signal.SIGCONT)
    _finish(procs)
    live = {k: v for k, v in procs.items() if k != "c"}
    ev0 = _round_events(live, 0)
    check_round(PEERS3, ev0, 0, SIZE, ["a", "b"])
    c0 = procs["c"].rounds()[0]
    if hung_before_vote:
        assert max(e["seconds"] for e in ev0.values()) < 2.0 + 0.5 + 3.5, ev0
        assert c0["ok"] is False and c0["round"] == 0 and "left out" in c0["error"], c0
    else:
        assert c0["ok"] and c0["digest"] == ev0["a"]["digest"], (c0, ev0)
        assert c0["contributors"] == ["a", "b"], (c0, ev0)
    by_round = _agree_by_round(procs)
    assert any(len(evs) == 3 and evs[0]["contributors"] == ["a", "b", "c"] for evs in by_round.values()), (
        "c never took part again"
    )


@pytest.mark.timeout(60)
def test_wrong_token_peer_is_refused_and_others_go_on(cluster):
    cluster.rendezvous()
    peers = {"a": (1, 1.0), "b": (2, 1.0)}
    procs = {pid: cluster.peer(pid, s, weight=w, size=101, rounds=2, expect_peers=2) for pid, (s, w) in peers.items()}
    bad = cluster.peer("evil", 9, token="wrong-token", size=101, rounds=1)
    assert bad.wait(30) != 0
    assert "401" in bad.stderr() or "refused" in bad.stderr()
    cluster.ready(list(procs.values()))
    _finish(procs)
    for i in range(2):
        check_round(peers, _round_events(procs, i), i, 101, ["a", "b"])


@pytest.mark.timeout(90)
def test_rendezvous_killed_and_restarted_during_a_run(cluster):
    url = cluster.rendezvous()
    peers = {"a": (1, 1.0), "b": (2, 2.0), "c": (3, 1.5)}
    procs = {
        pid: cluster.peer(
            pid, s, weight=w, size=1001, rounds=8, expect_peers=3, part_timeout=2.0, round_timeout=20, round_sleep=0.4
        )
        for pid, (s, w) in peers.items()
    }
    cluster.ready(list(procs.values()))
    for p in procs.values():
        p.expect("round", 30)
    assert cluster.restart_rendezvous(gap=1.0) == url  # kill -9, 1 s without it, the same port
    _finish(procs, timeout=60)
    for p in procs.values():
        assert len(p.rounds()) == 8
    by_round = _agree_by_round(procs)
    full = [r for r, evs in by_round.items() if len(evs) == 3 and len(evs[0]["contributors"]) == 3]
    assert full and max(full) > min(by_round), "training did not go on after the restart"
    last = procs["a"].rounds()[-1]
    assert last["ok"], last
