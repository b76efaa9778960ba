"""End to end: the char-LM example's peers as real processes on 127.0.0.1 with a real
rendezvous process: training, a peer killed with SIGKILL, a peer joining mid-run, a peer whose
round failed (stopped past the deadline) resyncing."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ._example_peers import digests_by_step

pytestmark = pytest.mark.integration  # real processes: minutes in all


@pytest.mark.timeout(400)
def test_swarm_trains_survives_a_stall_a_kill_and_a_join(cluster):
    """One run of real peer processes (int4, overlapped rounds, tiny model):

    - eval loss goes down and the global-state digests of all peers agree after every round;
    - peer2 is stopped (SIGSTOP) past the part deadline: its round fails while the others commit
      it; after SIGCONT it downloads the state and agrees with the others again;
    - peer1 is killed with SIGKILL: the others go on after at most a timeout or two;
    - peer3, compiled and waiting, joins mid-run: it downloads the state and its digest matches
      the others' from its first round.
    """
    args = [
        "--max-steps",
        "110",
        "--sync-every",
        "5",
        "--codec",
        "int4",
        "--overlap-steps",
        "1",
        "--part-timeout",
        "3",
        "--min-step-seconds",
        "0.1",
    ]
    cue = cluster.tmp / "join-now"
    for i in range(3):
        cluster.start_peer(f"peer{i}", *args, "--min-peers", "3")
    cluster.start_peer("peer3", *args, "--join-when-exists", str(cue))  # compiles, then waits
    cluster.wait_event("peer2", lambda e: e.get("event") == "round" and e.get("ok"), 180)
    cluster.wait_event("peer2", lambda e: e.get("event") == "progress" and e["step"] % 5 == 3, 60)
    os.kill(cluster.procs["peer2"].pid, signal.SIGSTOP)
    time.sleep(4.5)  # past the part deadline, short of the eviction timeout
    os.kill(cluster.procs["peer2"].pid, signal.SIGCONT)
    cluster.wait_event("peer2", lambda e: e.get("event") == "round" and e.get("ok") is False, 60)
    cluster.wait_event("peer2", lambda e: e.get("event") == "round" and e.get("ok") and e["step"] >= 30, 60)
    cluster.procs["peer1"].send_signal(signal.SIGKILL)
    cluster.procs["peer1"].wait(10)
    cluster.wait_event("peer0", lambda e: e.get("event") == "round" and e["step"] >= 50, 60)
    cluster.wait_event("peer3", lambda e: e.get("event") == "ready", 120)
    cue.touch()
    res = {n: cluster.result(n, 240) for n in ("peer0", "peer2", "peer3")}
    r0, r2, joiner = res["peer0"], res["peer2"], res["peer3"]
    assert r0["failed_rounds"] == 0 and r0["rounds"] == 22
    assert r0["eval_loss_end"] < r0["eval_loss_start"] - 1.0
    assert r2["failed_rounds"] >= 1 and r2["resyncs"] >= 1, r2["round_log"]
    assert joiner["joined_running_swarm"] and joiner["start_step"] >= 50
    d0 = digests_by_step(r0)
    for r in (r2, joiner):  # every round a peer completed agrees with peer0's
        d = digests_by_step(r)
        assert d, "no round"
        for step, digest in d.items():
            assert d0[step] == digest, step
    assert r0["final_global_digest"] == r2["final_global_digest"] == joiner["final_global_digest"]
    sizes = [m["group_size"] for m in r0["round_log"] if m["ok"]]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    # the stall, the kill and the join cost peer0 a few part timeouts in all, not one per round
    assert sum(m["stall_seconds"] for m in r0["round_log"]) < 5 * (3 + 1.5), r0["round_log"]
