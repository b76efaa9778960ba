"""ravnest_jax.testing.LocalSwarm: the sync contract in memory, with the real swarm's round
semantics as the driver sees them (weighted mean, divergence, standby, state download, outcomes)."""

from __future__ import annotations

import concurrent.futures

import jax.numpy as jnp
import numpy as np
import pytest

import ravnest_jax as rj
from ravnest_jax import compress
from ravnest_jax.testing import LocalRun


def _packed(x, codec="fp32"):
    """A contribution as OuterSync hands it over: the device encode, fetched to the host."""
    import jax

    return jax.device_get(compress.device_encode([jnp.asarray(x)], codec)[0])


def _round(swarms, xs, weights=None, **kw):
    weights = weights or [1.0] * len(swarms)
    futs = [
        s.all_reduce_packed_async(_packed(x, s.codec.name), weight=w, **kw)
        for s, x, w in zip(swarms, xs, weights, strict=True)
    ]
    return futs


def test_the_mean_is_the_weighted_float32_mean_in_peer_order_and_equal_everywhere():
    run = LocalRun()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(33).astype(np.float32) for _ in range(3)]
    with run.swarm("b") as b, run.swarm("a") as a, run.swarm("c") as c:
        futs = _round([b, a, c], [xs[1], xs[0], xs[2]], [2.0, 1.0, 3.0])
        out = [f.result(timeout=10) for f in futs]
    want = (np.float32(1.0) * xs[0] + np.float32(2.0) * xs[1] + np.float32(3.0) * xs[2]) / np.float32(6.0)
    for mean, rec in out:
        np.testing.assert_array_equal(mean, want)
        assert rec.ok and rec.round == 0 and rec.contributors == ("a", "b", "c") and rec.total_weight == 6.0, rec
    assert len({rec.digest for _, rec in out}) == 1 and out[0][1].bytes_sent == 4 * 33


def test_a_lossy_mean_codec_gives_the_mean_as_every_receiver_decodes_it():
    run = LocalRun(rj.Codec("int8", mean="int4"))
    xs = [np.linspace(-1, 1, 128, dtype=np.float32) * k for k in (1.0, 3.0)]
    with run.swarm("a") as a, run.swarm("b") as b:
        (ma, _), (mb, _) = (f.result(timeout=10) for f in _round([a, b], xs))
    sent = [np.asarray(compress.decode(compress.encode([x], "int8"))[0]) for x in xs]  # as received
    exact = (sent[0] + sent[1]) / np.float32(2.0)
    opts = compress.mean_codec_options("int8", "int4", {})
    want = np.asarray(compress.decode(compress.encode([exact], "int4", **opts))[0])
    np.testing.assert_array_equal(ma, mb)
    np.testing.assert_array_equal(ma, want)
    assert np.abs(ma - exact).max() > 0, "the mean did not go through the int4 mean codec"


def test_a_peer_whose_state_differs_from_the_majority_is_left_out_and_told():
    run = LocalRun()
    with run.swarm("a") as a, run.swarm("b") as b, run.swarm("c") as c:
        futs = [
            s.all_reduce_packed_async(_packed(np.full(4, v, np.float32)), weight=1.0, state=(3, d))
            for s, v, d in ((a, 1.0, "x"), (b, 3.0, "x"), (c, 100.0, "y"))
        ]
        (ma, ra), (mb, rb) = futs[0].result(timeout=10), futs[1].result(timeout=10)
        assert rb.digest == ra.digest, (ra, rb)
        with pytest.raises(rj.RoundFailed) as e:
            futs[2].result(timeout=10)
    assert ma.tolist() == mb.tolist() == [2.0] * 4 and ra.contributors == ("a", "b"), (ma, ra)
    assert ra.diverged == ("c",) and e.value.record.diverged == ("c",) and "diverged" in e.value.record.error
    assert a.round_outcome(0) == "ok" and a.round_outcome(7) == "unknown"


def test_left_out_rounds_and_rounds_that_fail_for_everybody():
    run = LocalRun()
    with run.swarm("a") as a, run.swarm("b") as b:
        run.leave_out("b")
        fa, fb = _round([a, b], [np.ones(4, np.float32), np.zeros(4, np.float32)])
        assert fa.result(timeout=10)[0].tolist() == [1.0] * 4
        with pytest.raises(rj.RoundFailed):
            fb.result(timeout=10)
        assert b.round_outcome(0) == "ok"  # the others applied it: b must resync
        run.leave_out(None)
        for f in _round([a, b], [np.ones(4, np.float32)] * 2):
            with pytest.raises(rj.RoundFailed, match="failed for everybody"):
                f.result(timeout=10)
        assert a.round_outcome(1) == "failed"
        # a contribution for a round that already ran without this peer is refused, not mixed in
        late = a.all_reduce_packed_async(_packed(np.ones(4, np.float32)), weight=1.0, round=0)
        with pytest.raises(rj.RoundFailed, match="past this round"):
            late.result(timeout=10)


def test_a_round_waits_for_every_active_peer_and_completes_when_one_closes():
    run = LocalRun()
    a, b = run.swarm("a"), run.swarm("b")
    a.start()
    b.start()
    fa = a.all_reduce_packed_async(_packed(np.ones(4, np.float32)), weight=1.0)
    assert not fa.done()  # b is active and has not contributed
    b.close()
    mean, rec = fa.result(timeout=10)
    assert rec.contributors == ("a",) and mean.tolist() == [1.0] * 4
    a.close()


def test_a_joiner_is_on_standby_until_ready_and_downloads_the_state():
    run = LocalRun()
    with run.swarm("a") as a:
        a.all_reduce_packed_async(_packed(np.ones(4, np.float32)), weight=1.0).result(timeout=10)
        served: concurrent.futures.Future = concurrent.futures.Future()
        a.serve_state(lambda: served)
        with run.swarm("j") as j:
            assert j.standby
            f = a.all_reduce_packed_async(_packed(np.ones(4, np.float32)), weight=1.0)
            assert f.result(timeout=10)[1].contributors == ("a",)  # not waited for
            served.set_result(b"state-bytes")
            assert j.fetch_state(timeout=5) == b"state-bytes" and a.fetch_state(timeout=5) is None
            assert j.ready().result(timeout=1) and not j.standby
            fa = a.all_reduce_packed_async(_packed(np.ones(4, np.float32)), weight=1.0)
            assert not fa.done()  # now j is waited for
            j.all_reduce_packed_async(_packed(np.ones(4, np.float32)), weight=1.0).result(timeout=10)
            assert fa.result(timeout=10)[1].contributors == ("a", "j")
            assert [p.peer_id for p in a.wait_for_peers(2, timeout=1)] == ["a", "j"]
            assert [r["outcome"] for r in a.status()["rounds"]] == ["ok", "ok", "ok"]


def test_the_run_manifest_is_the_first_one_declared():
    run = LocalRun()
    with run.swarm("a") as a, run.swarm("b") as b:
        assert a.declare_manifest({"h": 4}, init="d0") == {"init": "d0", "init_from": "a"}
        assert b.declare_manifest({"h": 4}, init="d1") == {"init": "d0", "init_from": "a"}
        with pytest.raises(rj.ManifestMismatch, match="settings differ from the run's: h"):
            b.declare_manifest({"h": 8})


def test_bad_input_is_refused_at_once():
    run = LocalRun("int8")
    with pytest.raises(ValueError, match="mean_ef"):
        LocalRun(rj.Codec("int8", mean_ef=True))
    s = run.swarm("a")
    with pytest.raises(RuntimeError, match="not running"):
        s.all_reduce_packed_async(_packed(np.ones(4, np.float32), "int8"), weight=1.0)
    with s:
        with pytest.raises(ValueError, match="encoded with 'fp32'"):
            s.all_reduce_packed_async(_packed(np.ones(4, np.float32)), weight=1.0)
        with pytest.raises(ValueError, match="weight"):
            s.all_reduce_packed_async(_packed(np.ones(4, np.float32), "int8"), weight=0.0)
        with pytest.raises(RuntimeError, match="already in the run"):
            run.swarm("a").start()


def test_a_member_missing_at_the_part_deadline_is_left_out_and_its_late_part_refused():
    run = LocalRun(timeouts=rj.Timeouts(part=0.2))
    with run.swarm("a") as a, run.swarm("b") as b:
        fa = a.all_reduce_packed_async(_packed(np.ones(4, np.float32)), weight=1.0)
        mean, rec = fa.result(timeout=10)  # b never came: the deadline ended the round
        assert rec.contributors == ("a",) and mean.tolist() == [1.0] * 4, rec
        late = b.all_reduce_packed_async(_packed(np.ones(4, np.float32)), weight=1.0, round=0)
        with pytest.raises(rj.RoundFailed, match="past this round"):
            late.result(timeout=10)
