"""Robust aggregators: the clipped and the trimmed mean (math, then real swarms in threads)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ravnest_jax.swarm import Swarm, Timeouts
from ravnest_jax.swarm._allreduce import (
    ABSTAIN_BELOW,
    check_aggregator,
    clip_scales,
    squared_norm,
    trimmed_mean,
)
from ravnest_jax.swarm._votes import summed


def test_clip_scales_bounds_the_outlier_by_k_times_the_lower_median():
    norms = {"a": 1.0, "b": 1.2, "c": 0.9, "d": 1000.0}
    s = clip_scales(norms, sorted(norms), 2.0)
    # lower median of [0.9, 1.0, 1.2, 1000] is 1.0: bound 2.0, only d is over it
    assert s == {"d": pytest.approx(2.0 / 1000.0)}, s
    # two peers: the smaller norm bounds the larger one
    s2 = clip_scales({"a": 1.0, "b": 50.0}, ["a", "b"], 3.0)
    assert s2 == {"b": pytest.approx(3.0 / 50.0)}, s2
    # abstainers (zero norm, tiny weight) do not pull the median down
    s3 = clip_scales({"a": 0.0, "b": 1.0, "c": 1.5}, ["a", "b", "c"], 2.0)
    assert s3 == {}, s3
    assert clip_scales({"a": 0.0}, ["a"], 2.0) == {}


def test_check_aggregator_refuses_bad_knobs():
    check_aggregator("clipped_mean", 2.0, 1)
    for args in [
        ("median", 2.0, 1),
        ("mean", 0.5, 1),
        ("mean", float("nan"), 1),
        ("mean", 2.0, 0),
        ("mean", 2.0, True),
    ]:
        with pytest.raises(ValueError):
            check_aggregator(*args)


def test_squared_norm_is_float64_and_does_not_overflow():
    v = np.full(1000, 3e30, np.float32)  # float32 sum of squares would be inf
    assert squared_norm(v) == pytest.approx(1000 * (3e30) ** 2, rel=1e-6)
    x = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
    assert squared_norm(x, chunk=1000) == pytest.approx(float(np.dot(x.astype(np.float64), x)), rel=1e-5)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 7), trim=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_trimmed_mean_matches_a_sort_per_coordinate(n, trim, seed):
    rng = np.random.default_rng(seed)
    ids = [f"p{i}" for i in range(n)]
    parts = {c: (np.float32(1.0), rng.standard_normal(5).astype(np.float32)) for c in ids}
    mean, dropped = trimmed_mean(parts, ids, trim)
    b = min(trim, (n - 1) // 2)
    x = np.sort(np.stack([parts[c][1] for c in ids]).astype(np.float64), axis=0)
    np.testing.assert_allclose(mean, x[b : n - b].mean(axis=0), rtol=1e-5, atol=1e-6)
    assert mean.dtype == np.float32 and mean.shape == (5,)
    assert sum(dropped.values()) == 2 * b * 5, dropped


def test_trimmed_mean_leaves_abstainers_out_and_names_the_dropped():
    parts = {
        "a": (np.float32(1.0), np.array([1.0, 1.0], np.float32)),
        "b": (np.float32(1.0), np.array([2.0, 2.0], np.float32)),
        "c": (np.float32(1.0), np.array([3.0, 1e6], np.float32)),
        "z": (np.float32(1e-30), np.zeros(2, np.float32)),  # missed its round
    }
    assert 1e-30 < ABSTAIN_BELOW
    mean, dropped = trimmed_mean(parts, sorted(parts), 1)
    assert mean.tolist() == [2.0, 2.0], mean  # the median of a, b, c per coordinate
    assert dropped == {"a": 2, "c": 2}, dropped
    only_abstainers = {"z": parts["z"]}
    assert trimmed_mean(only_abstainers, ["z"], 1)[0].tolist() == [0.0, 0.0]


def test_rendezvous_sums_norms_over_owners():
    votes = {
        "a": {"sqnorms": {"a": 9.0, "b": 1.0}},
        "b": {"sqnorms": {"a": 16.0, "b": 3.0, "x": 5.0}},
        "c": {"sqnorms": {"a": "junk", "b": float("inf")}},  # not a finite number >= 0: 0
    }
    assert summed(votes, "sqnorms", ["a", "b"], root=True) == {"a": 5.0, "b": 2.0}
    assert summed({"a": {"trimmed": {"a": 3}}, "b": {"trimmed": {"a": 4}}}, "trimmed", ["a"]) == {"a": 7.0}


def test_ring_refuses_robust_aggregators():
    with pytest.raises(ValueError, match="butterfly"):
        Swarm("http://127.0.0.1:1", run_id="r", token="t", algorithm="ring", aggregator="clipped_mean")
    with pytest.raises(ValueError, match="aggregator"):
        Swarm("http://127.0.0.1:1", run_id="r", token="t", aggregator="median")


# ---------------------------------------------------------------------- real swarms (threads)
T = Timeouts(connect=2.0, part=5.0, grace=0.5, round=20.0, heartbeat=0.5, eviction=3.0)


def _round(url, run, vectors, weights, **kw):
    from .conftest import TOKEN

    ids = sorted(vectors)
    swarms = [
        Swarm(url, run_id=run, token=TOKEN, listen="127.0.0.1:0", timeouts=T, peer_id=p, **kw).__enter__() for p in ids
    ]
    try:
        swarms[0].wait_for_peers(len(ids), timeout=10)
        futs = [s.all_reduce_async({"x": vectors[p]}, weight=weights[p]) for s, p in zip(swarms, ids, strict=True)]
        return [f.result(30) for f in futs]
    finally:
        with concurrent.futures.ThreadPoolExecutor(len(swarms)) as ex:
            list(ex.map(lambda s: s.close(), swarms))


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_clipped_mean_over_a_real_butterfly_bounds_a_wild_peer(cluster):
    url = cluster.rendezvous()
    rng = np.random.default_rng(1)
    n = 1001  # parts of unequal length
    vec = {p: rng.standard_normal(n).astype(np.float32) for p in "abc"}
    vec["d"] = 1000 * rng.standard_normal(n).astype(np.float32)
    w = {"a": 1.0, "b": 2.0, "c": 1.0, "d": 1.0}
    out = _round(url, "clip", vec, w, aggregator="clipped_mean", clip_multiple=2.0)
    recs = [r for _, r in out]
    assert all(r.ok for r in recs) and len({r.digest for r in recs}) == 1, recs
    norms = {p: float(np.linalg.norm(v.astype(np.float64))) for p, v in vec.items()}
    bound = 2.0 * sorted(norms.values())[1]
    assert set(recs[0].clipped) == {"d"} and all(r.clipped == recs[0].clipped for r in recs), recs[0].clipped
    assert recs[0].clipped["d"] == pytest.approx(bound / norms["d"], rel=1e-6)
    scaled = {p: vec[p] * (bound / norms[p] if p == "d" else 1.0) for p in vec}
    exp = sum(w[p] * scaled[p].astype(np.float64) for p in vec) / sum(w.values())
    np.testing.assert_allclose(out[0][0]["x"], exp, rtol=1e-4, atol=1e-5)
    got = out[0][0]["x"]
    assert float(np.linalg.norm(got)) < 2.0 * bound, (float(np.linalg.norm(got)), bound)
    # the plain mean of the same contributions is dominated by d
    plain = _round(url, "plain", vec, w, aggregator="mean")
    assert float(np.linalg.norm(plain[0][0]["x"])) > 100 * float(np.linalg.norm(got))
    assert plain[0][1].clipped == {} and plain[0][1].ok


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_trimmed_mean_over_a_real_butterfly(cluster):
    url = cluster.rendezvous()
    rng = np.random.default_rng(2)
    vec = {p: rng.standard_normal(257).astype(np.float32) for p in "abcd"}
    vec["c"][:10] = 1e4  # one peer wild on a few coordinates
    out = _round(url, "trim", vec, dict.fromkeys("abcd", 1.0), aggregator="trimmed_mean", trim=1)
    recs = [r for _, r in out]
    assert all(r.ok for r in recs) and len({r.digest for r in recs}) == 1, recs
    x = np.sort(np.stack([vec[p] for p in "abcd"]).astype(np.float64), axis=0)
    np.testing.assert_allclose(out[2][0]["x"], x[1:3].mean(axis=0), rtol=1e-5, atol=1e-6)
    t = recs[0].trimmed
    assert t["c"] >= 10 / 257 and abs(sum(t.values()) - 2.0) < 1e-9, t  # 2 dropped per coordinate
