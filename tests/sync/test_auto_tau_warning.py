"""``overlap_steps="auto"``'s "the step waits ... raise staleness_budget" warning: only on
sustained evidence (3 of the last 4 rounds' exchanges outlasted what tau = cap hides), never after
one slow round; at most once every 50 rounds."""

from __future__ import annotations

import logging
import time

from ravnest_jax.sync._schedule import AutoTau

SLOW, FAST = 2.0, 1e-4  # exchange seconds; the inner steps take about 0.2 ms (cap 5: ~1 ms hidden)


def _rounds(caplog, exchanges: list[float], cap: int = 5) -> tuple[AutoTau, list[str], list[int]]:
    """Drives an AutoTau as OuterSync does: choose at each round start, the exchange in before the
    next; 100 steps of real time between round starts. Returns the warnings and at which round."""
    tau, step = AutoTau(cap), 0
    caplog.clear()
    tau.choose(step, 0.0)
    at = []
    for i, x in enumerate(exchanges):
        time.sleep(0.02)
        step += 100
        tau.exchanges.append(x)
        n = len(caplog.records)
        tau.choose(step, 0.0)
        at += [i] * (len(caplog.records) - n)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return tau, warnings, at


def test_one_slow_round_is_not_warned_about(caplog):
    caplog.set_level(logging.INFO, logger="ravnest_jax.sync")
    tau, warnings, _ = _rounds(caplog, [FAST, FAST, SLOW, FAST, FAST, FAST, FAST, FAST])
    assert warnings == [], warnings
    tau, warnings, _ = _rounds(caplog, [FAST, SLOW, FAST])
    assert tau.needed > tau.cap, tau.needed  # the metric still says what hiding the slow one takes
    assert warnings == [], warnings


def test_two_slow_rounds_of_four_are_not_warned_about(caplog):
    caplog.set_level(logging.INFO, logger="ravnest_jax.sync")
    _, warnings, _ = _rounds(caplog, [SLOW, FAST, SLOW, FAST, FAST, SLOW, FAST, SLOW, FAST])
    assert warnings == [], warnings


def test_three_slow_rounds_of_four_warn_once(caplog):
    caplog.set_level(logging.INFO, logger="ravnest_jax.sync")
    _, warnings, at = _rounds(caplog, [FAST, SLOW, FAST, SLOW, SLOW] + [SLOW] * 10)
    assert len(warnings) == 1 and at == [4], (warnings, at)  # the third slow round of four; then quiet
    w = warnings[0]
    assert "in 3 of the last 4 rounds" in w and "median 2.00 s" in w and "auto tau at 5" in w, w
    waits = float(w.split("waits about ")[1].split(" s")[0])
    assert 1.5 < waits <= 2.0, w


def test_sustained_but_small_waits_are_not_warned_about(caplog, monkeypatch):
    """Every exchange outlasts what tau = cap hides, but the wait is under 5 % of a round's steps
    (utilisation >= 0.95): nothing to act on, no warning; at 10 % the warning comes."""
    import types

    from ravnest_jax.sync import _schedule

    clock = [0.0]
    monkeypatch.setattr(_schedule, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    caplog.set_level(logging.INFO, logger="ravnest_jax.sync")
    for wait, warned in ((0.02, False), (0.10, True)):  # seconds per round of 1 s of steps
        tau, step = AutoTau(5), 0
        caplog.clear()
        tau.choose(step, 0.0)
        for _ in range(6):
            clock[0] += 1.0  # 100 steps of 10 ms: cap 5 hides 0.05 s
            step += 100
            tau.exchanges.append(0.05 + wait)
            tau.choose(step, 0.0)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert tau.needed > tau.cap, tau.needed  # the exchanges did outlast the overlap
        assert bool(warnings) == warned, (wait, warnings)
