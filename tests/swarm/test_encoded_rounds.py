"""Encode once: a contribution already encoded (``Swarm.all_reduce_packed_async``, what
``rj.OuterSync`` hands the swarm) goes on the wire as it is, cut into parts on block
boundaries; the bytes are the message's own, the results equal on every peer."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from ravnest_jax import compress
from ravnest_jax.compress import Codec
from ravnest_jax.compress._wire import message_nbytes
from ravnest_jax.swarm import AllReduce, Swarm, Timeouts
from ravnest_jax.swarm.wire._codec import PartLayout, part_chunks
from ravnest_jax.swarm.wire._manifest import swarm_settings

from .conftest import TOKEN

T = Timeouts(connect=2.0, part=10.0, grace=0.5, round=30.0, heartbeat=0.5, eviction=5.0)


def _trees(ids, seed):
    rng = np.random.default_rng(seed)
    return {
        p: {
            "emb": rng.standard_normal((50, 33)).astype(np.float32),
            "blocks": [
                rng.standard_normal(1001).astype(np.float32) * 0.01,
                rng.standard_normal((7, 9)).astype(np.float32),
            ],
        }
        for p in ids
    }


def _run(url, run, packed, weights, aggregator="mean", rounds=1, codec=None, **swarm_kw):
    ids = sorted(packed)
    swarms = [
        Swarm(
            url,
            run_id=run,
            token=TOKEN,
            listen="127.0.0.1:0",
            timeouts=T,
            peer_id=p,
            codec=codec or packed[p].codec,
            algorithm=AllReduce(aggregator=aggregator),
            **swarm_kw,
        ).__enter__()
        for p in ids
    ]
    try:
        swarms[0].wait_for_peers(len(ids), timeout=10)
        out = []
        for _ in range(rounds):
            futs = [s.all_reduce_packed_async(packed[p], weight=weights[p]) for s, p in zip(swarms, ids)]
            out.append([f.result(60) for f in futs])
        return out
    finally:
        with concurrent.futures.ThreadPoolExecutor(len(swarms)) as ex:
            list(ex.map(lambda s: s.close(), swarms))


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_an_encoded_contribution_is_averaged_as_its_own_bytes(cluster, codec):
    ids = ["a", "b", "c"]
    trees = _trees(ids, 1)
    packed = {p: compress.host_pack(trees[p], codec) for p in ids}
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    (results,) = _run(cluster.rendezvous(), f"enc-{codec}", packed, weights)
    means = [m for m, _ in results]
    recs = [r for _, r in results]
    assert all(r.ok and r.contributors == tuple(ids) for r in recs), recs
    assert len({r.digest for r in recs}) == 1, recs
    for m in means[1:]:
        np.testing.assert_array_equal(m, means[0])  # bit-identical on every peer
    # the weighted mean of what every peer's message decodes to (leaf order = the messages')
    dec = {p: compress.decode(compress.packed_to_bytes(packed[p])) for p in ids}
    flat = {p: np.concatenate([_leaf(dec[p], s.name) for s in packed[p].specs]) for p in ids}
    want = sum(np.float64(weights[p]) * flat[p] for p in ids) / sum(weights.values())
    tol = 1e-6 if codec == "fp32" else 0.08 * np.abs(want).max()
    np.testing.assert_allclose(means[0], want, atol=tol)
    # bytes: every part a peer sends is a slice of its own message (payload unchanged), and
    # every result part the message of the mean in the same pieces
    layout = PartLayout.of(packed["a"])
    bounds = layout.bounds(3)
    for k, p in enumerate(ids):
        parts = sum(len(b"".join(map(bytes, part_chunks(packed[p], layout, *bounds[j])))) for j in range(3) if j != k)
        lo, hi = bounds[k]
        pieces = [np.zeros(b - a, np.float32) for _, a, b in layout.pieces(lo, hi)]
        result = message_nbytes(compress.host_pack(pieces, codec))
        assert recs[k].bytes_sent == parts + 2 * result, (p, recs[k].bytes_sent, parts, result)
    payload = sum(len(b"".join(map(bytes, part_chunks(packed["a"], layout, lo, hi)))) for lo, hi in bounds)
    assert (
        payload
        - sum(
            compress.read_header(b"".join(map(bytes, part_chunks(packed["a"], layout, lo, hi)))).header_nbytes
            for lo, hi in bounds
        )
        == packed["a"].nbytes
    )


def _leaf(tree, name):
    node = tree
    for key in name.split("/"):
        node = node[int(key)] if isinstance(node, list) else node[key]
    return np.ravel(node)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_clipped_member_is_summed_again_from_its_pulled_part(cluster):
    """The clipped mean sums the parts as they arrive, as if nobody were clipped; when the
    decision clips a member, every owner pulls the kept members' parts again and sums anew:
    the result is the clipped mean, equal on every peer."""
    ids = ["a", "b", "c", "d"]
    trees = _trees(ids, 2)
    trees["d"] = {"emb": trees["d"]["emb"] * 1000, "blocks": [x * 1000 for x in trees["d"]["blocks"]]}
    packed = {p: compress.host_pack(trees[p], "fp32") for p in ids}
    (results,) = _run(cluster.rendezvous(), "enc-clip", packed, dict.fromkeys(ids, 1.0), aggregator="clipped_mean")
    recs = [r for _, r in results]
    assert all(r.ok and set(r.clipped) == {"d"} for r in recs), recs
    assert len({r.digest for r in recs}) == 1
    flat = {p: np.concatenate([_leaf(trees[p], s.name) for s in packed[p].specs]) for p in ids}
    s = np.float32(recs[0].clipped["d"])
    want = (flat["a"] + flat["b"] + flat["c"] + (flat["d"] * s)) / 4
    np.testing.assert_allclose(results[0][0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_sign_owners_carry_what_the_encode_of_the_mean_dropped(cluster):
    """The 1-bit ``sign`` codec loses about a third of the mean's energy in the all-gather's
    encode. With the owners' error feedback (``Codec(mean_ef=True)``) the residual goes into the
    next round's mean: the same contributions, averaged over rounds, converge to their true
    mean (the running error shrinks like 1 / rounds); without it every round repeats the same
    error. Results equal on every peer either way, and round 1 is the same (nothing carried)."""
    ids = ["a", "b", "c"]
    trees = _trees(ids, 3)
    packed = {p: compress.host_pack(trees[p], "sign") for p in ids}
    weights = dict.fromkeys(ids, 1.0)
    dec = {p: compress.decode(compress.packed_to_bytes(packed[p])) for p in ids}
    flat = {p: np.concatenate([_leaf(dec[p], s.name) for s in packed[p].specs]) for p in ids}
    want = sum(np.float64(flat[p]) for p in ids) / 3
    rounds = 6
    runs = {}
    for mef in (True, False):
        codec = Codec("sign", mean_ef=mef)  # off by default
        res = _run(cluster.rendezvous(), f"sign-{mef}", packed, weights, rounds=rounds, codec=codec)
        for r in res:
            assert all(rec.ok for _, rec in r), [rec for _, rec in r]
            assert len({rec.digest for _, rec in r}) == 1, [rec.digest for _, rec in r]
            for m, _ in r[1:]:
                np.testing.assert_array_equal(m, r[0][0])
        runs[mef] = [r[0][0].astype(np.float64) for r in res]
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    norm = np.linalg.norm(want)
    one = np.linalg.norm(runs[False][0] - want) / norm
    errs = {mef: np.linalg.norm(np.mean(runs[mef], axis=0) - want) / norm for mef in runs}
    assert one > 0.2, f"the sign encode of the mean should lose much of it: relative error {one:.3f}"
    assert errs[False] == pytest.approx(one, rel=1e-6), errs  # every round the same result
    assert errs[True] < 0.6 * one, f"averaged over {rounds} rounds: {errs}, one round: {one:.3f}"
    # and each round is what an owner with error feedback sends: its part's mean plus what the
    # last round's encode dropped, encoded in the part's pieces
    layout = PartLayout.of(packed["a"])
    residual = np.zeros(layout.n, np.float32)
    for t, got in enumerate(runs[True]):
        target = want.astype(np.float32) + residual
        sent = np.empty_like(target)
        for lo, hi in layout.bounds(3):
            pieces, base = [], lo
            for _, a, b in layout.pieces(lo, hi):
                pieces.append(target[base : base + b - a])
                base += b - a
            sent[lo:hi] = np.concatenate(compress.decode(compress.packed_to_bytes(compress.host_pack(pieces, "sign"))))
        residual = target - sent
        off = np.linalg.norm(got - sent) / norm
        assert off < 1e-3, f"round {t}: the swarm's mean is {off:.2e} (relative) from the owners' error feedback"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_mean_goes_back_in_its_own_codec(cluster):
    """``Swarm(codec=Codec("sign", mean="int2"))``: the parts go up as slices of each peer's
    1-bit message, the owners send the mean back in 2-bit ``int2`` (same block size, so the same
    parts and pieces): the result is the owners' ``int2`` encode of the mean of the decoded
    contributions, equal on every peer, and each peer's bytes are its sign parts plus its int2
    result part to each other member."""
    ids = ["a", "b", "c"]
    trees = _trees(ids, 4)
    opts = {"block_size": 256}
    packed = {p: compress.host_pack(trees[p], "sign", **opts) for p in ids}
    codec = Codec("sign", mean="int2", **opts)
    (results,) = _run(cluster.rendezvous(), "enc-mean-codec", packed, dict.fromkeys(ids, 1.0), codec=codec)
    means, recs = [m for m, _ in results], [r for _, r in results]
    assert all(r.ok and r.contributors == tuple(ids) for r in recs), recs
    assert len({r.digest for r in recs}) == 1, recs
    for m in means[1:]:
        np.testing.assert_array_equal(m, means[0])
    dec = {p: compress.decode(compress.packed_to_bytes(packed[p])) for p in ids}
    flat = {p: np.concatenate([_leaf(dec[p], s.name) for s in packed[p].specs]) for p in ids}
    want = (sum(np.float64(flat[p]) for p in ids) / 3).astype(np.float32)
    layout = PartLayout.of(packed["a"])
    bounds = layout.bounds(3)
    sent = np.empty_like(want)
    for k, p in enumerate(ids):
        lo, hi = bounds[k]
        pieces, base = [], lo
        for _, a, b in layout.pieces(lo, hi):
            pieces.append(want[base : base + b - a])
            base += b - a
        result = compress.host_pack(pieces, "int2", **opts)
        sent[lo:hi] = np.concatenate(compress.decode(compress.packed_to_bytes(result)))
        parts = sum(len(b"".join(map(bytes, part_chunks(packed[p], layout, *bounds[j])))) for j in range(3) if j != k)
        assert recs[k].bytes_sent == parts + 2 * message_nbytes(result), (p, recs[k].bytes_sent, parts)
    off = np.linalg.norm(means[0] - sent) / np.linalg.norm(want)
    assert off < 1e-3, f"the swarm's mean is {off:.2e} (relative) from the owners' int2 encode of the mean"
    # and it is int2's (4 levels a block), not sign's (2): finer than a sign encode of the mean
    one_bit = compress.decode(compress.packed_to_bytes(compress.host_pack({"m": want}, "sign", **opts)))["m"]
    assert np.linalg.norm(means[0] - want) < 0.8 * np.linalg.norm(one_bit - want)


def test_a_mean_codec_is_checked_and_in_the_round_manifest():
    """A mean codec must pair with the codec (block codecs of one block size) and the butterfly;
    peers with another mean codec have another round manifest (they refuse each other)."""
    url = "http://127.0.0.1:1"
    kw = {"run_id": "r", "token": "t", "listen": None}
    for bad, match in [
        ({"name": "fp32", "mean": "int2"}, "block codecs"),
        ({"name": "sign", "mean": "topk"}, "block codecs"),
        ({"name": "sign", "mean": "nope"}, "unknown mean codec"),
        ({"name": "int8", "mean": "int2", "block_size": 6}, "block_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            Codec(**bad)
    with pytest.raises(ValueError, match="butterfly"):
        Swarm(url, **kw, codec=Codec("sign", mean="int2"), algorithm="ring")
    with pytest.raises(ValueError, match="butterfly"):
        Swarm(url, **kw, codec=Codec("sign", mean_ef=True), algorithm="ring")
    plain = Swarm(url, **kw, codec="sign")
    same = Swarm(url, **kw, codec=Codec("sign", mean="sign"))
    split = Swarm(url, **kw, codec=Codec("sign", mean="int2"))
    assert plain._algorithm.wire() == same._algorithm.wire() == "sign/butterfly/clipped_mean:2.0"
    assert split._algorithm.wire() == "sign>int2/butterfly/clipped_mean:2.0"
    assert same.codec == plain.codec and split.codec.mean_name == "int2" and plain.codec.mean_name == "sign"
    assert swarm_settings(split)["mean_codec"] == "int2" != swarm_settings(plain)["mean_codec"]
