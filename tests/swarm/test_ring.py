"""The pipelined ring (``algorithm="ring"``) with several segments per part, in-process swarms
against a rendezvous process: exact fp32 means, identical digests, a lossy codec within its
bound, and a corrupt segment that costs one retry, not the round."""

from __future__ import annotations

import numpy as np
import pytest

from ravnest_jax.swarm import AllReduce, RoundFailed, Swarm, Timeouts
from ravnest_jax.swarm.peer._allreduce import part_bounds, ring_segments
from ravnest_jax.swarm.peer._ring import Ring
from ravnest_jax.swarm.wire._http import HTTPStatusError

from .conftest import TOKEN

pytestmark = pytest.mark.integration  # real processes: minutes in all

T = Timeouts(connect=2.0, part=3.0, grace=0.5, round=20.0, heartbeat=0.5, eviction=3.0)
SEG = 256  # bytes per segment: 64 floats, so a part of ~333 floats is 5-6 segments


def _inputs(n: int, size: int) -> list[tuple[dict, float]]:
    rng = np.random.default_rng(n)
    return [
        (
            {
                "w": rng.standard_normal((size // 3, 3)).astype(np.float32),
                "b": rng.standard_normal(size % 3 + 1).astype(np.float32),
            },
            1.0 + i,
        )
        for i in range(n)
    ]


def _run(url, n, size, cls=Swarm, codec="fp32", run_id=None, algorithm="ring", **kw):
    inputs = _inputs(n, size)
    swarms = [
        cls(
            url,
            run_id=run_id or f"ring{n}{codec}",
            token=TOKEN,
            listen="127.0.0.1:0",
            timeouts=T,
            peer_id=f"p{i}",
            algorithm=AllReduce(algorithm, segment_bytes=SEG if algorithm == "ring" else None),
            codec=codec,
            **kw,
        )
        for i in range(n)
    ]
    try:
        for s in swarms:
            s.start()
        swarms[0].wait_for_peers(n, timeout=10)
        futs = [s.all_reduce_async(x, weight=w) for s, (x, w) in zip(swarms, inputs)]
        res = [f.result(30) for f in futs]
    finally:
        for s in swarms:
            s.close()
    num = sum(w * np.concatenate([x["w"].ravel(), x["b"]]).astype(np.float64) for x, w in inputs)
    exp = num / sum(w for _, w in inputs)
    return res, exp, max(np.abs(np.concatenate([x["w"].ravel(), x["b"]])).max() for x, _ in inputs)


def _flat(out):
    return np.concatenate([out["w"].ravel(), out["b"]])


def test_ring_segments_cover_every_part_the_same_way():
    b = part_bounds(1001, 3)
    segs = ring_segments(b, SEG)
    assert all(len(s) == 6 for s in segs)  # ceil(334 / 64)
    for (lo, hi), s in zip(b, segs):
        assert s[0][0] == lo and s[-1][1] == hi
        assert all(x[1] == y[0] and x[1] > x[0] for x, y in zip(s, s[1:]))
    assert ring_segments(part_bounds(2, 3), SEG) == [[(0, 1)], [(1, 2)], [(2, 2)]]
    assert [len(s) for s in ring_segments(part_bounds(5_000_000, 4))] == [5] * 4  # 1 MiB


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_butterfly_counts_every_byte_it_sends(cluster, n):
    """The reduce-scatter parts and the all-gather result pushes: 2 (n - 1) / n of the payload
    each way (a push still in flight when its sender had every result was once left out)."""
    url = cluster.rendezvous()
    size = 30_001
    res, exp, _ = _run(url, n, size, algorithm="butterfly", run_id=f"bfly{n}")
    recs = [rec for _, rec in res]
    assert all(r.ok and r.algorithm == "butterfly" for r in recs), recs
    payload = 4 * (size // 3 * 3 + size % 3 + 1)
    for r in recs:
        assert 2 * (n - 1) / n * payload <= r.bytes_sent < 2 * (n - 1) / n * payload * 1.1, (r.bytes_sent, payload)
        assert 2 * (n - 1) / n * payload <= r.bytes_received < 2 * (n - 1) / n * payload * 1.1, r.bytes_received
    assert sum(r.bytes_sent for r in recs) == sum(r.bytes_received for r in recs), recs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_pipelined_ring_matches_numpy_weighted_mean(cluster, n):
    url = cluster.rendezvous()
    size = 1001
    res, exp, _ = _run(url, n, size)
    recs = [rec for _, rec in res]
    assert all(r.ok and r.attempts == 1 and r.algorithm == "ring" for r in recs)
    assert len({r.digest for r in recs}) == 1
    assert all(r.contributors == tuple(f"p{i}" for i in range(n)) for r in recs)
    assert recs[0].total_weight == sum(1.0 + i for i in range(n))
    outs = [_flat(o) for o, _ in res]
    assert len({o.tobytes() for o in outs}) == 1  # bit-identical on every peer
    np.testing.assert_allclose(outs[0], exp, rtol=1e-6, atol=1e-6)
    # each peer sends and receives 2 (n - 1) / n of the payload (plus message headers)
    payload = 4 * (size // 3 * 3 + size % 3 + 1)
    for r in recs:
        assert 2 * (n - 1) / n * payload <= r.bytes_received < 2 * (n - 1) / n * payload * 1.5
        assert 2 * (n - 1) / n * payload <= r.bytes_sent < 2 * (n - 1) / n * payload * 1.5


@pytest.mark.timeout(60)
def test_pipelined_ring_lossy_codec_within_bound(cluster):
    url = cluster.rendezvous()
    n = 3
    res, exp, m = _run(url, n, 3001, codec="int8")
    recs = [rec for _, rec in res]
    assert all(r.ok for r in recs) and len({r.digest for r in recs}) == 1
    got = _flat(res[0][0]).astype(np.float64)
    # the partial sums are quantised at each of the n - 1 hops, the mean once more: each error
    # is at most max|value| / 254 of a block, and a partial sum is at most (its weight) * m
    w = [1.0 + i for i in range(n)]
    bound = m / 254 * 1.02 * (sum(sum(w[:k]) for k in range(1, n)) / sum(w) + 1)
    err = np.abs(got - exp).max()
    assert 0 < err <= bound


def _with_ring(ring_class):
    """A Swarm whose ring is ``ring_class`` (a test subclass of the ring algorithm)."""
    return type("TestSwarm", (Swarm,), {"algorithms": {**Swarm.algorithms, "ring": ring_class}})


class _CorruptOnce(Ring):
    """Flips one byte of one reduce-scatter segment in the first attempt."""

    async def _send(self, st, addr, phase, step, j, data, weight, timeout, digest=None):
        if st.attempt == 0 and phase == "rs" and step == 0 and j == 1:
            raw = bytearray(data() if callable(data) else data)
            raw[len(raw) // 2] ^= 0xFF
            data = bytes(raw)
        return await super()._send(st, addr, phase, step, j, data, weight, timeout, digest)


@pytest.mark.timeout(60)
def test_pipelined_ring_corrupt_segment_costs_one_retry(cluster):
    url = cluster.rendezvous()
    res, exp, _ = _run(url, 3, 1001, cls=_with_ring(_CorruptOnce))
    recs = [rec for _, rec in res]
    assert all(r.ok and r.attempts == 2 for r in recs), recs
    assert len({r.digest for r in recs}) == 1
    np.testing.assert_allclose(_flat(res[0][0]), exp, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
def test_ring_peers_with_another_segment_size_refuse_each_other(cluster):
    url = cluster.rendezvous()
    t = Timeouts(connect=1.0, part=1.0, grace=0.3, round=4.0, heartbeat=0.5, eviction=3.0)
    a = Swarm(
        url,
        run_id="segs",
        token=TOKEN,
        listen="127.0.0.1:0",
        timeouts=t,
        peer_id="a",
        algorithm=AllReduce("ring", segment_bytes=SEG),
    )
    b = Swarm(
        url,
        run_id="segs",
        token=TOKEN,
        listen="127.0.0.1:0",
        timeouts=t,
        peer_id="b",
        algorithm=AllReduce("ring", segment_bytes=2 * SEG),
    )
    with a, b:
        a.wait_for_peers(2, timeout=10)
        x = {"x": np.ones(1000, np.float32)}
        futs = [a.all_reduce_async(x), b.all_reduce_async(x)]
        for f in futs:
            with pytest.raises(RoundFailed):
                f.result(30)
    with pytest.raises(ValueError):
        AllReduce("ring", segment_bytes=0)


class _Probe(Ring):
    """After its first segment of the first attempt is answered, sends it again (409), to a
    segment index out of range (400), and an oversize all-gather body (413); records the
    statuses."""

    statuses: dict[str, int]

    async def _send(self, st, addr, phase, step, j, data, weight, timeout, digest=None):
        sent = await super()._send(st, addr, phase, step, j, data, weight, timeout, digest)
        if st.attempt == 0 and phase == "rs" and step == 0 and j == 0:
            data = data() if callable(data) else data
            lo, hi = st.segments[0][0]
            big = b"\0" * (4 * (hi - lo) + (1 << 20) + 1)  # to a message not yet sent
            for name, ph, jj, body in [
                ("duplicate", "rs", 0, data),
                ("bad_segment", "rs", len(st.segments[0]), data),
                ("oversize", "ag", 0, big),
            ]:
                try:
                    await super()._send(st, addr, ph, step, jj, body, weight, timeout)
                    self.statuses[name] = 200
                except HTTPStatusError as e:
                    self.statuses[name] = e.status
        return sent


@pytest.mark.timeout(60)
def test_pipelined_ring_refuses_duplicate_bad_and_oversize_segments(cluster):
    url = cluster.rendezvous()
    _Probe.statuses = {}
    res, exp, _ = _run(url, 2, 1001, cls=_with_ring(_Probe))
    assert _Probe.statuses == {"duplicate": 409, "bad_segment": 400, "oversize": 413}
    recs = [rec for _, rec in res]
    assert all(r.ok and r.attempts == 1 for r in recs) and len({r.digest for r in recs}) == 1
    np.testing.assert_allclose(_flat(res[0][0]), exp, rtol=1e-6, atol=1e-6)
