"""Restart soak: peers of the main job (real processes, real rendezvous, real checkpoints), one of
them stopped with Ctrl+C and restarted from its checkpoint three times: 1 s after the stop, after
the others did 2 rounds without it, and in the middle of a round.

After every restart every peer's rounds are ok again within 2 rounds, the global state digests
of every round agree on every peer, no peer ever waits for a round longer than one part
deadline, and the run finishes on every peer.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from _cluster import Cluster, Proc, cluster_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "char_lm" / "main.py")
ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
H = 10
PART = 10.0  # the part deadline of every peer (seconds)
# long enough that a peer restarted the third time still has rounds left when the machine is
# loaded: its restart takes 15-25 s then, while the others go on (at 1000 steps the run ended
# one round after the third restart once, in 5 runs under load)
MAX_STEPS = 1400
PEER = [
    "--d-model",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--eval-batches",
    "1",
    "--lr",
    "1e-2",
    "--no-progress",
    "--sync-every",
    str(H),
    "--overlap-steps",
    "1",
    "--codec",
    "int8",
    "--part-timeout",
    str(PART),
    "--max-steps",
    str(MAX_STEPS),
    "--schedule-steps",
    str(MAX_STEPS),
    "--min-step-seconds",
    "0.03",
    "--log-every",
    str(H),
    "--json-events",
]


def _stop(p: Proc) -> int:
    """Ctrl+C, as in a terminal; returns the exit status."""
    p.send_signal(signal.SIGINT)
    return p.wait(60)


def _ok_rounds(p: Proc, n: int, timeout: float) -> None:
    have = [0]

    def pred(ev: dict) -> bool:
        have[0] += ev.get("event") == "round" and ev.get("ok") is True
        return have[0] >= n

    p.expect(pred, timeout, f"{n} ok rounds")


@pytest.mark.integration
@pytest.mark.timeout(600)
# 2 peers in the default run (the survivor trains alone while the victim is down); the 3-peer
# variant too with RAVNEST_SOAK_PEERS=2,3 (about 3 more minutes on 2 cores; 3 peers killed and
# restarted from checkpoints are in test_e2e_restart.py and benchmarks/bench_chaos.py)
@pytest.mark.parametrize("n", [int(x) for x in os.environ.get("RAVNEST_SOAK_PEERS", "2").split(",")])
def test_a_peer_restarted_three_times_rejoins_within_two_rounds(tmp_path, n):
    token = tmp_path / "token"
    token.write_text("soak-token\n")
    token.chmod(0o600)
    cluster = Cluster(tmp_path, token="soak-token")
    cluster.reap_signal = signal.SIGKILL  # a peer still running at the end is killed
    procs: list[Proc] = []
    with cluster_of(cluster):
        url = cluster.rendezvous(heartbeat=1, eviction=5, extra=("--token-file", str(token), "--quiet"), timeout=60)

        def start(i: int, gen: int) -> Proc:
            cmd = [sys.executable, EXAMPLE, "--rendezvous", url, "--run-id", "soak", "--token-file", str(token)]
            cmd += ["--listen", "127.0.0.1:0", "--checkpoint-dir", str(tmp_path / f"ckpt{i}"), "--data-seed", str(i)]
            p = cluster.spawn(f"peer{i}.{gen}", [*cmd, "--min-peers", str(n), *PEER], env=ENV)
            procs.append(p)
            return p

        peers = [start(i, 0) for i in range(n)]
        victim = peers[-1]
        _ok_rounds(victim, 3, 240)
        stops: list[float] = []
        for gen, how in enumerate(("1 s after the stop", "after 2 rounds", "mid-round"), start=1):
            if how == "mid-round":
                # the progress event of a round boundary comes right after the round started (it
                # merges one step later): stop it now, with the exchange in flight
                victim.expect(lambda ev: ev.get("event") == "progress" and ev["step"] % H == 0, 60, "a boundary")
            stops.append(time.time())
            assert _stop(victim) == 130, f"{how}: exit status"
            if how == "after 2 rounds":
                _ok_rounds(peers[0], 2, 60)
            else:
                time.sleep(1.0)  # the restart 1 s after the stop: the case itself, not a wait
            victim = start(n - 1, gen)
            started = victim.expect(lambda ev: ev.get("event") == "start", 240, "start")
            assert started["joined"] is True, (how, started)
            _ok_rounds(victim, 3, 120)
        for p in [*peers[:-1], victim]:
            p.expect(lambda ev: ev.get("event") == "result", 600, "its result")
            assert p.wait(60) == 0, p.stderr()

    restarts = [p for p in procs if p.name.endswith((".1", ".2", ".3"))]
    for p in procs:  # shown with -s: what each process saw
        rs = p.rounds()
        print(
            f"{p.name}: {len(rs)} rounds, failed {[(r['swarm_round'], r['error']) for r in rs if not r['ok']]}, "
            f"max stall {max((r['stall_seconds'] for r in rs), default=0):.2f} s"
        )
    # rounds ok again within 2 rounds of each restart: in every process, a failed round is one of
    # the first 2 after a stop or a start (by wall time)
    marks = sorted(stops + [next(e["t"] for e in p.all if e.get("event") == "start") for p in restarts])
    for p in procs:
        for i, r in enumerate(p.rounds()):
            if r["ok"]:
                continue
            before = [m for m in marks if m <= r["t"]]
            assert before, (p.name, i, r)
            since = [q for q in p.rounds() if before[-1] <= q["t"] <= r["t"]]
            assert len(since) <= 2, (p.name, i, r, "failed more than 2 rounds after a restart")
    for p in restarts:
        oks = [r["ok"] for r in p.rounds()]
        assert all(oks[2:]) and any(oks[:2]), (p.name, oks)
    # one global state per round, on every peer that merged it
    by_round: dict[int, set[str]] = {}
    for p in procs:
        for r in p.rounds():
            if r["ok"]:
                by_round.setdefault(r["swarm_round"], set()).add(r["state_digest"])
    split = {k: v for k, v in by_round.items() if len(v) > 1}
    assert not split, split
    # no wait longer than one part deadline
    stalls = sorted(((r["stall_seconds"], p.name, r["swarm_round"]) for p in procs for r in p.rounds()), reverse=True)
    # (one part deadline plus the rendezvous' grace: a peer late for a round is waited for that long)
    assert stalls[0][0] < PART + 1.0, stalls[:5]
    results = [next(e["result"] for e in p.all if e.get("event") == "result") for p in [*procs[: n - 1], procs[-1]]]
    assert len({r["final_global_digest"] for r in results}) == 1, [r["final_global_digest"] for r in results]
    assert all(r["end_step"] == MAX_STEPS for r in results), [r["end_step"] for r in results]
    # the restarted peer is the same peer each time (its id kept with its checkpoints)
    assert len({r["peer"] for r in results[-1:]} | {procs[n - 1].all[0].get("peer")}) == 1
