"""The 1F1B schedule and the balanced cut: pure Python, fast."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ravnest_jax.pipeline import balance, stage_ops
from ravnest_jax.pipeline._schedule import in_flight_bound


def _check(ops, stage, S, M, steps, mode):
    fwd, bwd, upd, in_flight, peak = [], [], [], set(), 0
    for op, n in ops:
        if op == "F":
            assert n not in in_flight and n not in fwd
            fwd.append(n)
            in_flight.add(n)
            peak = max(peak, len(in_flight))
        elif op == "B":
            assert n in in_flight, f"backward of {n} before its forward"
            in_flight.discard(n)
            bwd.append(n)
        else:
            assert all(g in bwd for g in range(n * M, (n + 1) * M)), f"update {n} before its backwards"
            upd.append(n)
            if mode == "sync":  # a flush: nothing of the next step forwarded before the update
                assert all(g < (n + 1) * M for g in fwd), f"sync: step {n + 1} forwarded before update {n}"
    G = steps * M
    assert fwd == list(range(G)) and bwd == list(range(G)) and upd == list(range(steps)) and not in_flight
    return peak


@given(S=st.integers(1, 6), M=st.integers(1, 8), steps=st.integers(1, 3))
def test_one_f_one_b_bounds_micro_batches_in_flight(S, M, steps):
    for stage, mode in itertools.product(range(S), ("sync", "async")):
        peak = _check(list(stage_ops(stage, S, M, steps, mode)), stage, S, M, steps, mode)
        assert peak <= S - stage, f"stage {stage} of {S} held {peak} micro-batches"
        if M >= S:
            assert peak == S - stage  # the warm-up fills the pipeline


def _run_cluster(S, M, steps, mode, depth):
    """Executes every stage's ops with the pipeline's data dependencies (a forward needs the
    previous stage's forward, a backward the next stage's backward): fails on a deadlock."""
    queues = [list(stage_ops(s, S, M, steps, mode, in_flight=depth)) for s in range(S)]
    pos, done = [0] * S, set()
    while any(pos[s] < len(queues[s]) for s in range(S)):
        moved = False
        for s in range(S):
            while pos[s] < len(queues[s]):
                op, n = queues[s][pos[s]]
                ready = (
                    (op == "F" and (s == 0 or ("F", s - 1, n) in done))
                    or (op == "B" and (s == S - 1 or ("B", s + 1, n) in done))
                    or op == "U"
                )
                if not ready:
                    break
                done.add((op, s, n))
                pos[s] += 1
                moved = True
        assert moved, (
            f"deadlock: S={S} M={M} depth={depth} {mode}, stages at {[q[i : i + 1] for q, i in zip(queues, pos)]}"
        )


@given(S=st.integers(1, 5), M=st.integers(1, 8), steps=st.integers(1, 3), extra=st.integers(0, 8))
def test_a_deeper_schedule_keeps_its_bounds_never_deadlocks_and_stays_one_update_ahead(S, M, steps, extra):
    depth = min(S + extra, max(S, M + 1))
    for stage, mode in itertools.product(range(S), ("sync", "async")):
        ops = list(stage_ops(stage, S, M, steps, mode, in_flight=depth))
        peak = _check(ops, stage, S, M, steps, mode)
        bound = in_flight_bound(stage, S, depth)
        assert peak <= bound, f"stage {stage} of {S}, depth {depth}: held {peak} > {bound}"
        if mode == "async" and stage < S - 1 and steps * M >= bound:
            assert peak == bound, f"stage {stage} of {S}, depth {depth}: the warm-up filled {peak} of {bound}"
        if depth > M + 1:
            continue  # the default depth S with fewer micro-batches: 1F1B as it always was
        updates = 0
        for op, n in ops:  # the asynchronous modes' weight versions assume at most one update behind
            updates += op == "U"
            if op == "F":
                assert updates >= n // M - 1, f"stage {stage}: forward of {n} (step {n // M}) after {updates} updates"
        _run_cluster(S, M, steps, mode, depth)


def test_a_deeper_schedule_runs_more_forwards_first():
    ops = list(stage_ops(0, 3, 8, 1, "async", in_flight=6))
    assert ops[:7] == [("F", g) for g in range(6)] + [("B", 0)], ops[:8]  # 6 in flight, then 1F1B
    assert list(stage_ops(2, 3, 8, 1, "async", in_flight=6))[:2] == [("F", 0), ("B", 0)]  # the last stage: F, B


@pytest.mark.parametrize("bad", [2, 10, 4.0, True])
def test_depth_out_of_range_is_a_value_error(bad):
    with pytest.raises(ValueError, match="in_flight"):
        list(stage_ops(0, 3, 8, 1, "async", in_flight=bad))


def test_async_schedule_has_no_flush():
    ops = list(stage_ops(0, 3, 4, 2, "async"))
    # stage 0 forwards micro-batches of step 1 before the update of step 0
    assert ops.index(("F", 4)) < ops.index(("U", 0)), ops


def test_schedule_rejects_bad_input():
    with pytest.raises(ValueError):
        list(stage_ops(3, 3, 4, 1, "sync"))
    with pytest.raises(ValueError):
        list(stage_ops(0, 3, 0, 1, "sync"))
    with pytest.raises(ValueError):
        list(stage_ops(0, 3, 4, 1, "fast"))


def _brute(costs, S):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), S - 1):
        b = (0, *cuts, n)
        m = max(sum(costs[b[i] : b[i + 1]]) for i in range(S))
        best = m if best is None else min(best, m)
    return best


@given(costs=st.lists(st.integers(0, 100), min_size=1, max_size=8), S=st.integers(1, 8))
def test_balance_is_optimal_and_contiguous(costs, S):
    if S > len(costs):
        with pytest.raises(ValueError):
            balance(costs, S)
        return
    bounds = balance(costs, S)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(lo < hi for lo, hi in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    got = max(sum(costs[lo:hi]) for lo, hi in bounds)
    assert got == _brute(costs, S), (costs, S, bounds)


def test_balance_rejects_bad_costs():
    with pytest.raises(ValueError):
        balance([1.0, -1.0], 1)
    with pytest.raises(ValueError):
        balance([1.0, float("nan")], 1)
    with pytest.raises(ValueError):
        balance([1.0], 0)


def _timed(S: int, M: int, steps: int, depth: int, t_f: float, t_b: float, link: float) -> list[float]:
    """Each stage's busy / wall when it runs its ``stage_ops`` (async) with forwards of ``t_f``
    and backwards of ``t_b`` seconds (the last stage's forward is both), every activation and
    activation-gradient taking ``link`` seconds to its neighbour: a discrete-event model of the
    schedule alone (no transfers share a link; nothing else costs time)."""
    ops = [list(stage_ops(s, S, M, steps, "async", in_flight=depth)) for s in range(S)]
    arrive: dict[tuple[str, int, int], float] = {}
    pos, clock, busy, first = [0] * S, [0.0] * S, [0.0] * S, [None] * S
    moved = True
    while moved:
        moved = False
        for s in range(S):
            while pos[s] < len(ops[s]):
                op, g = ops[s][pos[s]]
                last = s == S - 1
                if op == "U":
                    pos[s] += 1
                    continue
                if op == "F":
                    need, dur = (0.0 if s == 0 else arrive.get(("act", s - 1, g))), (t_f + t_b if last else t_f)
                else:
                    need, dur = (0.0, 0.0) if last else (arrive.get(("grad", s + 1, g)), t_b)
                if need is None:
                    break
                start = max(clock[s], need)
                first[s] = start if first[s] is None else first[s]
                clock[s], busy[s] = start + dur, busy[s] + dur
                if op == "F" and not last:
                    arrive[("act", s, g)] = clock[s] + link
                if op == "B" and s > 0:
                    arrive[("grad", s, g)] = clock[s] + link
                pos[s] += 1
                moved = True
    assert all(p == len(o) for p, o in zip(pos, ops)), "deadlock"
    return [b / (c - f) for b, c, f in zip(busy, clock, first)]


@pytest.mark.parametrize("S", [2, 3, 4])
def test_the_depth_covers_the_round_trip_of_every_link(S):
    """A stage's forward of micro-batch g + d shares a 1F1B cycle with its backward of g, where
    d = w_s - w_{s+1} is the warm-up difference to the next stage, so the activation of g + d and
    its gradient must cross the link and back within d slots: d T >= T + 2 L. With the depth
    the docs' rule gives, D = 1 + (S - 1) ceil(1 + 2 L / T), every pair has that many slots and
    the stages never wait once the pipeline is full; with 1F1B's depth S they wait every slot."""
    t_f, t_b, link = 0.056, 0.112, 0.05  # T = 0.168 s, L = 50 ms (1 Gbit/s: a 4 MB message, 10 ms delay)
    T, M, steps = t_f + t_b, 8, 40
    depth = 1 + (S - 1) * math.ceil(1 + 2 * link / T)
    assert depth <= M + 1
    util = _timed(S, M, steps, depth, t_f, t_b, link)
    # fill and drain are ~a round trip each, out of steps * M = 320 slots
    assert min(util) > 0.97, f"S={S} depth {depth}: utilisation {util}"
    plain = _timed(S, M, steps, S, t_f, t_b, link)
    assert max(plain) < 0.8, f"S={S} depth S: utilisation {plain}"
