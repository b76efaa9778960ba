"""What membership changes cost, with real peer processes of the README's shape
(``_member_peer.py``: rj.Swarm, rj.OuterSync, rj.join_or_resume) and a real rendezvous process:

- a peer hung (SIGSTOP) past the eviction time and resumed costs the others one eviction, and no
  part deadline after it comes back (it is on standby until it gave up its old exchange and
  resynced);
- a rendezvous killed (kill -9) and restarted on the same port: no failed round, no resync (no
  lost steps), equal digests: the peers' rounds begin again in its new epoch;
- a lone peer killed and restarted from its checkpoint: its first round is ok.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from _cluster import Cluster, Proc, cluster_of

pytestmark = pytest.mark.integration  # real processes

SCRIPT = str(Path(__file__).with_name("_member_peer.py"))
TOKEN = "membership-test-token"
EVICTION, PART = 3.0, 15.0


class Run(Cluster):
    """The shared cluster with ``_member_peer.py`` peers; a peer still running at the end is killed."""

    reap_signal = signal.SIGKILL
    rendezvous_flags = ("--verbose",)

    def __init__(self, tmp: Path):
        super().__init__(tmp, token=TOKEN)
        self.env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"

    def rendezvous(self, port: int = 0, eviction: float = EVICTION, **kw: object) -> str:  # type: ignore[override]
        return super().rendezvous(port=port, heartbeat=0.5, eviction=eviction)

    def peer(self, name: str, steps: int, *extra: str) -> Proc:
        cmd = [sys.executable, SCRIPT, self.url, TOKEN, name.split("-")[0], str(steps), "--part", str(PART), *extra]
        return self.spawn(name, cmd)

    def summary(self, name: str, timeout: float) -> dict:
        code = self.procs[name].wait(timeout)
        assert code == 0, f"{name} exited {code}: {self.procs[name].stderr()}"
        return next(e for e in self.events(name) if e.get("event") == "summary")


@pytest.fixture
def run(tmp_path):
    with cluster_of(Run(tmp_path)) as r:
        yield r


def _rounds(run: Run, name: str) -> list[dict]:
    return [e for e in run.events(name) if e.get("event") == "round"]


def _hang_c(run: Run, seconds: float, after_round: int, flags: tuple[str, ...] = ()) -> tuple:
    """Peers a, b, c (``flags``) in rounds of three until a's swarm round ``after_round``; c
    SIGSTOPped for ``seconds``, then SIGCONT; waits for c back in a round of three and a 3 rounds
    later; stops all. Returns ``(t_stop, t_cont, c's first round back, summaries)``."""
    stop = run.tmp / "stop"
    for n in "abc":
        run.peer(n, 100_000, "--stop-file", str(stop), *flags)
    for n in "abc":
        run.wait_event(n, lambda e: e.get("event") == "round" and e["ok"] and e["group"] == 3, 120)
    run.wait_event("a", lambda e: e.get("event") == "round" and e["ok"] and e["swarm_round"] >= after_round, 60)
    os.kill(run.procs["c"].pid, signal.SIGSTOP)
    t_stop = time.time()
    # c may have been stopped between a round's exchange and its merge, and then reports that
    # old round ok after SIGCONT: only a round past every round a had begun when c stopped
    # (a's last merged one, plus the one in flight) shows c back in the swarm's rounds
    last_before = max(e["swarm_round"] for e in _rounds(run, "a"))
    time.sleep(seconds)  # the hang (no event to wait on: the time is what it costs the others)
    os.kill(run.procs["c"].pid, signal.SIGCONT)
    t_cont = time.time()
    back = run.wait_event(
        "c",
        lambda e: e.get("event") == "round" and e["ok"] and e["swarm_round"] > last_before + 1 and e["group"] == 3,
        60,
    )
    run.wait_event(
        "a", lambda e: e.get("event") == "round" and e["ok"] and e["swarm_round"] >= back["swarm_round"] + 3, 60
    )
    stop.touch()
    return t_stop, t_cont, back, {n: run.summary(n, 60) for n in "abc"}


@pytest.mark.timeout(180)
def test_a_peer_hung_past_its_eviction_costs_one_eviction_not_a_part_deadline(run):
    """SIGSTOP one of 3 peers for 12 s (4 evictions, less than a part deadline), then SIGCONT:
    the other two stall about one eviction while it hangs, and no longer than one eviction plus
    one round at any step; it gives up its old round at once, comes back (standby until it
    resynced) and takes part in rounds of three again."""
    run.rendezvous()
    t_stop, t_cont, back, sums = _hang_c(run, 12.0, after_round=6)
    for n in "ab":
        rounds = _rounds(run, n)
        after = [e for e in rounds if e["t"] > t_stop]
        assert all(e["ok"] for e in rounds), (n, [e for e in rounds if not e["ok"]])
        # a round's period while all are well (H steps and the exchange)
        before = [e for e in rounds if e["t"] < t_stop]
        period = (before[-1]["t"] - before[1]["t"]) / max(len(before) - 2, 1)
        worst = max(e["stall"] for e in after)
        print(f"{n}: longest stall {worst:.2f} s (eviction {EVICTION} s, round {period:.2f} s), part {PART} s")
        assert worst <= EVICTION + 1.0 + period + 1.0, (n, worst, period, after)
        late = [e["stall"] for e in after if e["t"] > t_cont + 1.0]
        assert max(late, default=0.0) < EVICTION, (n, "a stall after c came back", late)
    c_rounds = [e for e in _rounds(run, "c") if e["t"] > t_cont]
    print(
        "c after SIGCONT:", [(round(e["t"] - t_cont, 2), e["ok"], e["swarm_round"], e["error"]) for e in c_rounds[:4]]
    )
    assert sum(not e["ok"] for e in c_rounds) <= 1, c_rounds  # its old round, given up
    # ... at once: the rendezvous' answer to its arrival says the round went on without it (not
    # after a part deadline of waiting for parts that never come)
    given_up = [e["t"] - t_cont for e in c_rounds if not e["ok"]]
    assert max(given_up, default=0.0) < PART - 5.0, (given_up, PART, c_rounds[:4])
    assert sums["c"]["resyncs"] >= 1, (sums["c"], c_rounds)
    # c took the swarm's state: its step counter at that round is a's
    a_step = {e["swarm_round"]: e["step"] for e in _rounds(run, "a")}
    assert back["group"] == 3 and back["step"] == a_step.get(back["swarm_round"]), (back, a_step)


def test_a_peer_hung_past_the_part_deadline_but_not_its_eviction_costs_one_part_deadline(run):
    """SIGSTOP one of 3 peers for 6 s (part deadline 2 s, eviction 12 s), then SIGCONT: the
    others wait out one part deadline (the retry without it) and no second one: back, it is in
    no new round's group until it resynced (it was left out of a round that went on)."""
    run.rendezvous(eviction=12.0)
    t_stop, t_cont, _, sums = _hang_c(run, 6.0, after_round=4, flags=("--part", "2", "--eviction", "12"))
    for n in "ab":
        after = [e for e in _rounds(run, n) if e["t"] > t_stop]
        long = [(round(e["t"] - t_stop, 1), round(e["stall"], 2), e["swarm_round"]) for e in after if e["stall"] > 1.5]
        print(n, "stalls over 1.5 s (s after SIGSTOP, stall, round):", long, "SIGCONT at", round(t_cont - t_stop, 1))
        assert len(long) <= 1, (n, long)
    assert sums["c"]["resyncs"] >= 1, sums["c"]


@pytest.mark.timeout(180)
def test_a_rendezvous_killed_and_restarted_costs_no_round(run):
    """kill -9 the rendezvous mid-run and restart it on the same port: the peers' rounds begin
    again in the new epoch from the round numbers the peers report: 0 failed rounds, 0 resyncs
    (no lost steps), and the same final digest on every peer."""
    run.rendezvous()
    for n in "abc":
        run.peer(n, 400, "--step-seconds", "0.04")
    run.wait_event("a", lambda e: e.get("event") == "round" and e["ok"] and e["swarm_round"] >= 3, 120)
    run.restart_rendezvous(gap=1.0)  # kill -9, its port free, 1 s without a rendezvous, the same port
    sums = {n: run.summary(n, 120) for n in "abc"}
    for n, s in sums.items():
        bad = [e for e in _rounds(run, n) if not e["ok"]]
        assert s["failed_rounds"] == 0 and s["resyncs"] == 0 and not bad, (n, s, bad)
        assert s["step"] == 400, (n, s)
    digests = {s["last_state_digest"] for s in sums.values()}
    assert len(digests) == 1, sums
    numbers = [e["swarm_round"] for e in _rounds(run, "a")]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers  # none lost, none skipped


@pytest.mark.timeout(180)
def test_a_lone_peer_killed_and_restarted_from_its_checkpoint_has_no_failed_round(run):
    """A lone peer killed (kill -9) after rounds past its last checkpoint and restarted from it:
    it is the only member of its round, so its own state is the run's: its first round is ok
    (before: a missed round, then the round mapping learned anew)."""
    run.rendezvous()
    ckpt, stop = str(run.tmp / "ckpt"), run.tmp / "stop"
    run.peer("a", 100_000, "--checkpoint-dir", ckpt)
    run.wait_event("a", lambda e: e.get("event") == "round" and e["ok"] and e["swarm_round"] >= 4, 120)
    run.wait_event("a", lambda e: e.get("event") == "round" and e["ok"] and e["step"] % 10 == 0 and e["step"] >= 60, 60)
    run.procs["a"].kill9()
    run.peer("a-restarted", 100_000, "--checkpoint-dir", ckpt, "--stop-file", str(stop))
    started = run.wait_event("a-restarted", lambda e: e.get("event") == "started", 120)
    assert started["how"] == "resumed", started
    run.wait_event(
        "a-restarted", lambda e: e.get("event") == "round" and e["ok"] and e["step"] >= started["step"] + 30, 60
    )
    stop.touch()
    s = run.summary("a-restarted", 60)
    rounds = _rounds(run, "a-restarted")
    assert rounds[0]["ok"] and s["failed_rounds"] == 0 and s["resyncs"] == 0, (s, rounds[:3])


@pytest.mark.timeout(180)
def test_peers_started_from_different_seeds_have_no_failed_round(run):
    """Two peers with other initial params (seeds 1 and 2), started together: the manifest is
    the same (values are not part of it), and the one whose initial state is not the run's
    takes the other's state before its first round, as a joiner: 0 failed rounds, 0 resyncs,
    equal digests (before: one round failed as "diverged", then a resync)."""
    run.rendezvous()
    run.peer("a", 60, "--seed", "1")
    run.peer("b", 60, "--seed", "2")
    sums = {n: run.summary(n, 150) for n in "ab"}
    hows = sorted(next(e for e in run.events(n) if e.get("event") == "started")["how"] for n in "ab")
    assert hows == ["fresh", "joined"], hows
    for n, s in sums.items():
        bad = [e for e in _rounds(run, n) if not e["ok"]]
        assert s["failed_rounds"] == 0 and s["resyncs"] == 0 and not bad, (n, s, bad)
    assert len({s["last_state_digest"] for s in sums.values()}) == 1, sums
