"""Robust aggregation: the clipped mean, and the AllReduce value that selects it (math, then real
swarms in threads)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

import ravnest_jax as rj
from ravnest_jax.swarm import AllReduce, Swarm, Timeouts
from ravnest_jax.swarm.peer._allreduce import clip_scales, squared_norm
from ravnest_jax.swarm.rendezvous._rounds import summed


def test_clip_scales_bounds_the_outlier_by_k_times_the_lower_median():
    norms = {"a": 1.0, "b": 1.2, "c": 0.9, "d": 1000.0}
    s = clip_scales(norms, sorted(norms), 2.0)
    # lower median of [0.9, 1.0, 1.2, 1000] is 1.0: bound 2.0, only d is over it
    assert s == {"d": pytest.approx(2.0 / 1000.0)}, s
    # two peers: the smaller norm bounds the larger one
    s2 = clip_scales({"a": 1.0, "b": 50.0}, ["a", "b"], 3.0)
    assert s2 == {"b": pytest.approx(3.0 / 50.0)}, s2
    # abstainers (zero norm, weight 0) do not pull the median down
    s3 = clip_scales({"a": 0.0, "b": 1.0, "c": 1.5}, ["a", "b", "c"], 2.0)
    assert s3 == {}, s3
    assert clip_scales({"a": 0.0}, ["a"], 2.0) == {}


def test_allreduce_value_resolves_defaults_and_refuses_bad_knobs():
    assert AllReduce() == AllReduce("butterfly", aggregator="clipped_mean", clip_multiple=2.0)
    assert AllReduce.of(None) == AllReduce() and AllReduce.of("ring") == AllReduce("ring")
    assert AllReduce("ring") == AllReduce("ring", aggregator="mean", segment_bytes=1 << 20)
    assert AllReduce(clip_multiple=3).clip_multiple == 3.0 and AllReduce(aggregator="mean").clip_multiple is None
    assert AllReduce().manifest() == ("butterfly", "clipped_mean:2.0")
    assert AllReduce("ring", segment_bytes=4096).manifest() == ("ring:4096", "mean")
    assert rj.AllReduce is AllReduce
    for kw, match in [
        (dict(name="tree"), "algorithm must be one of"),
        (dict(aggregator="median"), "aggregator must be one of"),
        (dict(aggregator="trimmed_mean"), "aggregator must be one of"),
        (dict(clip_multiple=0.5), "clip_multiple"),
        (dict(clip_multiple=float("nan")), "clip_multiple"),
        (dict(clip_multiple=True), "clip_multiple"),
        (dict(aggregator="mean", clip_multiple=3.0), "clipped mean's knob"),
        (dict(segment_bytes=4096), "the ring's knob"),
        (dict(name="ring", aggregator="clipped_mean"), "needs algorithm='butterfly'"),
        (dict(name="ring", clip_multiple=2.0), "needs algorithm='butterfly'"),
        (dict(name="ring", segment_bytes=0), "segment_bytes must be an int >= 4"),
        (dict(name="ring", segment_bytes=True), "segment_bytes must be an int >= 4"),
    ]:
        with pytest.raises(ValueError, match=match):
            AllReduce(**kw)
    with pytest.raises(TypeError, match="rj.AllReduce"):
        AllReduce.of(3)


def test_squared_norm_is_float64_and_does_not_overflow():
    v = np.full(1000, 3e30, np.float32)  # float32 sum of squares would be inf
    assert squared_norm(v) == pytest.approx(1000 * (3e30) ** 2, rel=1e-6)
    x = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
    assert squared_norm(x, chunk=1000) == pytest.approx(float(np.dot(x.astype(np.float64), x)), rel=1e-5)


def test_rendezvous_sums_norms_over_owners():
    votes = {
        "a": {"sqnorms": {"a": 9.0, "b": 1.0}},
        "b": {"sqnorms": {"a": 16.0, "b": 3.0, "x": 5.0}},
        "c": {"sqnorms": {"a": "junk", "b": float("inf")}},  # not a finite number >= 0: 0
    }
    assert summed(votes, "sqnorms", ["a", "b"], root=True) == {"a": 5.0, "b": 2.0}
    assert summed({"a": {"sqnorms": {"a": 3}}, "b": {"sqnorms": {"a": 4}}}, "sqnorms", ["a"]) == {"a": 7.0}


def test_swarm_takes_the_allreduce_value_or_a_name():
    s = Swarm("http://127.0.0.1:1", run_id="r", token="t", algorithm="ring")
    assert s.algorithm == AllReduce("ring") and s._algorithm.segment_bytes == 1 << 20
    s = Swarm("http://127.0.0.1:1", run_id="r", token="t", algorithm=AllReduce(clip_multiple=3.0))
    assert (s._algorithm.aggregator, s._algorithm.clip_multiple) == ("clipped_mean", 3.0)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        Swarm("http://127.0.0.1:1", run_id="r", token="t", algorithm="tree")
    with pytest.raises(TypeError, match="rj.AllReduce"):
        Swarm("http://127.0.0.1:1", run_id="r", token="t", algorithm=("ring",))
    with pytest.raises(TypeError):  # the knobs are the value's, not the swarm's
        Swarm("http://127.0.0.1:1", run_id="r", token="t", aggregator="mean")


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
    out = _round(url, "clip", vec, w, algorithm=AllReduce(aggregator="clipped_mean", clip_multiple=2.0))
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
    plain = _round(url, "plain", vec, w, algorithm=AllReduce(aggregator="mean"))
    assert float(np.linalg.norm(plain[0][0]["x"])) > 100 * float(np.linalg.norm(got))
    assert plain[0][1].clipped == {} and plain[0][1].ok
