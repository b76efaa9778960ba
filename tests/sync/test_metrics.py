"""rj.OuterSync's per-round records stay bounded over any number of rounds, and its summary still
counts every round (a long-running peer's memory must not grow with its rounds)."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import optax

import ravnest_jax as rj
from ravnest_jax.sync import _metrics


def test_metrics_keep_the_last_rounds_and_the_summary_counts_all(monkeypatch) -> None:
    monkeypatch.setattr(_metrics, "METRICS_KEPT", 5)
    params = {"w": jnp.ones(4)}
    tx = rj.diloco(optax.sgd(0.1), sync_every=1)
    state = tx.init(params)
    seen: list[rj.sync.RoundMetrics] = []
    # a run of one in-process peer: the mean is its own contribution, 4 float32 (16 bytes) a round
    swarm = rj.testing.LocalRun().swarm("me")
    swarm.start()
    sync = rj.OuterSync(tx, swarm, overlap_steps=0, on_round=seen.append)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
        return optax.apply_updates(params, updates), state

    with sync:
        for _ in range(12):
            params, state = sync(*step(params, state))
        summary = sync.summary()
    assert len(seen) == 12 and all(m.ok for m in seen), [m.error for m in seen]
    assert [m.round for m in sync.metrics] == [m.round for m in seen[-5:]], (sync.metrics, seen)
    assert summary["rounds"] == 12 and summary["failed_rounds"] == 0, summary
    assert summary["bytes_sent"] == 12 * 16 and summary["bytes_received"] == 12 * 16, summary
    assert summary["last_state_digest"] == seen[-1].state_digest != "", summary
    want_util = sum(m.compute_utilisation for m in seen) / 12
    assert abs(summary["compute_utilisation"] - want_util) < 1e-12, (summary, want_util)
    assert summary["mean_overlap_steps"] == 0.0 and summary["clipped_rounds"] == 0, summary
    stats = sync.swarm.info["stats"]  # published after every round, from the totals
    assert stats["rounds_ok"] == 12 and stats["round"] == 11 and stats["bytes_sent"] == 12 * 16, stats
    swarm.close()


def test_totals_match_the_rounds_they_counted() -> None:
    base = dict(
        fragment=0, step=0, merged_at_step=1, swarm_round=0, group_size=2, payload_bytes=8, codec_ratio=0.5,
        exchange_seconds=0.1, stall_seconds=0.0, result_digest="r", state_digest="s", overlap_steps=1,
    )  # fmt: skip
    ok = _metrics.RoundMetrics(
        round=0, ok=True, bytes_sent=10, bytes_received=20, compute_utilisation=0.5, **base, needed_overlap_steps=3
    )
    clipped = dataclasses.replace(ok, round=1, compute_utilisation=1.0, clipped={"p": 0.5}, state_digest="t")
    failed = dataclasses.replace(ok, round=2, ok=False, bytes_sent=0, bytes_received=0, error="x")
    totals, kept = _metrics.Totals(), []
    for m in (ok, clipped, failed):
        totals.add(m, kept)
    s = _metrics.summarize(totals, failed_rounds=1, resyncs=0, stall_seconds=0.0)
    assert kept == [ok, clipped, failed]
    assert s["rounds"] == 2 and s["bytes_sent"] == 20 and s["bytes_received"] == 40, s
    assert s["compute_utilisation"] == 0.75 and s["mean_overlap_steps"] == 1.0, s
    assert s["clipped_rounds"] == 1 and s["max_needed_overlap_steps"] == 3 and s["last_state_digest"] == "t", s


def test_a_stall_counts_from_when_the_device_ran_the_dispatched_steps():
    """The host dispatches steps ahead of the device; while the device runs them it is busy, not
    waiting for the network: the stall counts from when they are done (idle_since)."""
    import concurrent.futures
    import math

    import jax.numpy as jnp

    from ravnest_jax.sync._pipeline import idle_since

    live = {"w": jnp.ones(4) * 2}
    live["w"].block_until_ready()
    pending: concurrent.futures.Future = concurrent.futures.Future()
    t = idle_since(pending, live)  # the device has nothing queued: idle from now, the round still out
    assert math.isfinite(t) and not pending.done(), t
    pending.set_result(None)
    assert idle_since(pending, live) == math.inf  # the result came first: the device never waited
    other: concurrent.futures.Future = concurrent.futures.Future()
    assert math.isfinite(idle_since(other, {"x": 1.0}))  # no device arrays: idle from now
