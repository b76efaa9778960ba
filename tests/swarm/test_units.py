"""Unit tests of the swarm's pure pieces: auth, part bounds, float32 reduction, wire checks."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ravnest_jax.swarm import Timeouts
from ravnest_jax.swarm.peer._allreduce import manifest_digest, part_bounds
from ravnest_jax.swarm.wire import _auth
from ravnest_jax.swarm.wire._codec import PartDecoder, WireFormatError, decode_part, encode_part
from ravnest_jax.swarm.wire._types import flatten


def test_import_swarm_does_not_import_jax():
    code = (
        "import sys, ravnest_jax.swarm, ravnest_jax.cli; assert 'jax' not in sys.modules, 'jax imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_top_level_exports_swarm_lazily():
    code = (
        "import sys, ravnest_jax as rj; s = rj.Swarm; r = rj.RoundRecord; "
        "assert 'jax' not in sys.modules; print(s.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "Swarm", out.stderr


def _headers(**kw):
    args = dict(
        method="PUT",
        path="/v1/runs/r/rounds/3/0/parts/1",
        run_id="r",
        peer="p",
        round_=3,
        body_digest="ab" * 32,
        extra="1.0|m",
    )
    args.update(kw)
    return _auth.sign("tok", **args)


def _verify(headers, token="tok", **kw):
    args = dict(method="PUT", path="/v1/runs/r/rounds/3/0/parts/1", run_id="r", extra="1.0|m")
    args.update(kw)
    return _auth.verify(token, headers, **args)


def test_auth_roundtrip():
    assert _verify(_headers()) == ("p", "3", "ab" * 32)


@pytest.mark.parametrize(
    "field,kw",
    [
        ("token", {"token": "other"}),
        ("method", {"method": "GET"}),
        ("path", {"path": "/v1/runs/r/rounds/4/0/parts/1"}),
        ("run", {"run_id": "x"}),
        ("extra", {"extra": "2.0|m"}),
    ],
)
def test_auth_rejects_any_change(field, kw):
    with pytest.raises(_auth.AuthError):
        _verify(_headers(), **kw)


@pytest.mark.parametrize(
    "header", [_auth.H_PEER, _auth.H_ROUND, _auth.H_BODY, _auth.H_SIG, _auth.H_TIME, _auth.H_NONCE]
)
def test_auth_rejects_tampered_or_missing_header(header):
    h = _headers()
    h[header] = h[header][:-1] + ("0" if h[header][-1] != "0" else "1")
    with pytest.raises(_auth.AuthError):
        _verify(h)
    del h[header]
    with pytest.raises(_auth.AuthError):
        _verify(h)


def test_auth_rejects_replay_and_stale_time():
    nonces = _auth.NonceCache()
    h = _headers()
    _verify(h, nonces=nonces)
    with pytest.raises(_auth.AuthError, match="replay"):
        _verify(h, nonces=nonces)
    with pytest.raises(_auth.AuthError, match="skew"):
        _verify(_headers(), max_skew_s=-1.0)
    with pytest.raises(ValueError):
        _auth.sign("", method="GET", path="/", run_id="r", peer="p")


@given(total=st.integers(0, 10_000), n=st.integers(1, 64))
def test_part_bounds_cover_everything_once(total, n):
    b = part_bounds(total, n)
    assert len(b) == n and b[0][0] == 0 and b[-1][1] == total
    assert all(lo <= hi and hi == b[i + 1][0] for i, (lo, hi) in enumerate(b[:-1]))
    assert max(hi - lo for lo, hi in b) - min(hi - lo for lo, hi in b) <= 1


def test_manifest_digest_depends_on_names_shapes_codec():
    base = manifest_digest(["a", "b"], [(2,), (3, 4)], "fp32")
    assert base != manifest_digest(["a", "c"], [(2,), (3, 4)], "fp32")
    assert base != manifest_digest(["a", "b"], [(2,), (4, 3)], "fp32")
    assert base != manifest_digest(["a", "b"], [(2,), (3, 4)], "int8")


def test_flatten_roundtrip_and_dtype_check():
    Pair = __import__("collections").namedtuple("Pair", "x y")
    tree = {
        "z": np.zeros((2, 3), np.float32),
        "a": [np.float32(1.0), Pair(np.ones(2, np.float32), np.ones(1, np.float32))],
    }
    names, leaves, unflatten = flatten(tree)
    assert names == ["/a/0", "/a/1/x", "/a/1/y", "/z"]
    back = unflatten(leaves)
    assert isinstance(back["a"][1], Pair) and back["z"].shape == (2, 3)
    with pytest.raises(TypeError, match="float32"):
        flatten({"a": np.zeros(2, np.float64)})


def test_timeouts_validation():
    with pytest.raises(ValueError):
        Timeouts(part=0)
    with pytest.raises(ValueError):
        Timeouts(heartbeat=5, eviction=2)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 3000), cut=st.integers(1, 1 << 16))
def test_part_decoder_streaming_any_chunking(n, cut):
    x = np.random.default_rng(n).standard_normal(n, dtype=np.float32)
    data = encode_part("part0", x, "fp32")
    dec = PartDecoder(name="part0", length=n, codec="fp32", max_bytes=len(data))
    for off in range(0, len(data), cut):
        dec.feed(data[off : off + cut])
    assert dec.finish().tobytes() == x.tobytes()


@given(garbage=st.binary(max_size=200))
def test_part_decoder_rejects_garbage(garbage):
    dec = PartDecoder(name="part0", length=10, codec="fp32", max_bytes=1000)
    with pytest.raises(WireFormatError):
        dec.feed(garbage)
        dec.finish()


def test_part_decoder_rejects_mismatch_truncation_and_excess():
    data = encode_part("part0", np.ones(10, np.float32), "fp32")
    for kw in ({"name": "part1"}, {"length": 11}, {"codec": "int8"}):
        args = {"name": "part0", "length": 10, "codec": "fp32", "max_bytes": 1000, **kw}
        with pytest.raises(WireFormatError):
            PartDecoder(**args).feed(data)
    dec = PartDecoder(name="part0", length=10, codec="fp32", max_bytes=1000)
    dec.feed(data[:-1])
    with pytest.raises(WireFormatError, match="truncated"):
        dec.finish()
    with pytest.raises(WireFormatError):
        dec = PartDecoder(name="part0", length=10, codec="fp32", max_bytes=len(data) + 4)
        dec.feed(data + b"\0\0\0\0")
    with pytest.raises(WireFormatError):
        PartDecoder(name="part0", length=10, codec="fp32", max_bytes=10).feed(data)


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4", "fp4", "topk"])
def test_lossy_part_roundtrip_keeps_shape(codec):
    x = np.random.default_rng(0).standard_normal(1000, dtype=np.float32)
    y = decode_part(encode_part("part3", x, codec), name="part3", length=1000, codec=codec)
    assert y.shape == (1000,) and y.dtype == np.float32 and np.isfinite(y).all()


def _two_peer_round(rv, peers=("a", "b")):
    import time as _time

    from ravnest_jax.swarm.rendezvous._rounds import _Peer, _Run

    run = _Run("r")
    now = _time.monotonic()
    for p in peers:
        run.peers[p] = _Peer(p, f"http://127.0.0.1:1/{p}", now, now)
    return run, rv._create_round(run, -1, {"part_s": 5.0, "grace_s": 1.0}, peers[0])


def _committed_two_peer_round(rv):
    """A two-peer round whose gather and commit votes all say yes (on a running loop: the
    commit creates the next round ahead)."""
    run, rnd = _two_peer_round(rv)
    att = rnd.attempts[0]
    att.votes["gather"] = {p: {"received": ["a", "b"]} for p in "ab"}
    rv._decide(run, rnd, att, "gather")
    att.votes["commit"] = {p: {"ok": True, "digest": "d"} for p in "ab"}
    rv._decide(run, rnd, att, "commit")
    return run, rnd, att


def test_late_owner_gets_one_retry_instead_of_a_one_contributor_round():
    """b reached the round late: its window was too short to receive a's part, while a got b's.
    The intersection would keep only b (the late one); the rendezvous retries once with both,
    and takes a second shortfall as it is."""
    from ravnest_jax.swarm import Rendezvous

    rv = Rendezvous("tok")
    run, rnd = _two_peer_round(rv)
    votes = {"a": {"received": ["a", "b"]}, "b": {"received": ["b"]}}
    att = rnd.attempts[0]
    att.votes["gather"] = dict(votes)
    rv._decide(run, rnd, att, "gather")
    d = att.decisions["gather"]
    assert d["decision"] == "retry" and d["group"] == ["a", "b"], d
    assert not any(e.standby for e in run.peers.values())  # nobody was left out
    att1 = rnd.attempts[1]
    att1.votes["gather"] = dict(votes)
    rv._decide(run, rnd, att1, "gather")
    assert att1.decisions["gather"] == {"decision": "ok", "contributors": ["b"]}


def test_commit_hands_out_the_next_round_whose_clock_starts_at_arrival():
    from ravnest_jax.swarm import Rendezvous

    async def go():
        rv = Rendezvous("tok")
        run, rnd, att = _committed_two_peer_round(rv)
        assert att.decisions["gather"] == {"decision": "ok", "contributors": ["a", "b"]}
        d = att.decisions["commit"]
        assert d["decision"] == "commit" and d["next"]["round"] == rnd.number + 1
        assert d["next"]["group"] == ["a", "b"] and d["next"]["epoch"] == rv.epoch
        nxt = run.rounds[rnd.number + 1].attempts[0]
        assert not nxt.started
        await asyncio.sleep(0.05)
        nxt.arrive()
        assert nxt.started and nxt.start >= nxt_created + 0.05 - 1e-3
        nxt.arrive()  # later arrivals do not move the clock
        return nxt

    import asyncio
    import time as _time

    nxt_created = _time.monotonic()
    asyncio.run(go())


def test_a_round_created_ahead_that_every_member_left_is_abandoned(caplog):
    """The end of a run (or a lone peer's process that died): the round created ahead at the
    last commit fails, and says it was abandoned, not that votes were missing; the rounds
    between a peer's last round and a later one count as failed for everybody. The
    rendezvous' log has one INFO line for the round that worked, none for the abandoned one."""
    from ravnest_jax.swarm import Rendezvous
    from ravnest_jax.swarm.rendezvous._rounds import failed_between

    async def go():
        rv = Rendezvous("tok")
        caplog.set_level("DEBUG", logger="ravnest_jax.swarm.rendezvous")
        run, rnd, _ = _committed_two_peer_round(rv)
        nxt = run.rounds[rnd.number + 1]
        assert not nxt.attempts[0].started
        assert not failed_between(run, rnd.number - 1, rnd.number + 2)  # rnd committed
        for p in "ab":
            run.peers.pop(p)
            rv._forget(run, p)
        d = nxt.attempts[0].decisions["gather"]
        assert nxt.outcome == "failed" and d["reason"].startswith("abandoned: every member left"), d
        # the peers see it fail; the status page tells it from a failure (not red at every run's end)
        shown = {r["round"]: r["outcome"] for r in rv.status.run_data(run)["rounds"]}
        assert shown[rnd.number] == "ok" and shown[nxt.number] == "abandoned", shown
        assert failed_between(run, rnd.number, rnd.number + 2) and not failed_between(run, rnd.number, rnd.number + 1)
        assert not failed_between(run, rnd.number, rnd.number + 3)  # an unknown round: not known to have failed
        loud = [f"{r.levelname} {r.getMessage()}" for r in caplog.records if r.levelno >= logging.INFO]
        assert loud == [f"INFO run {run.run_id}: round {rnd.number} ok, 2 contributors"], loud

    import asyncio

    asyncio.run(go())


def test_diverged_peers_is_the_minority_of_the_latest_common_round():
    from ravnest_jax.swarm.rendezvous._rounds import diverged_peers

    assert diverged_peers({}) == []
    assert diverged_peers({"a": [3, "x"], "b": None}) == []  # nothing to compare with
    assert diverged_peers({"a": [3, "x"], "b": [3, "x"], "c": [3, "x"]}) == []
    assert diverged_peers({"a": [3, "x"], "b": [3, "y"], "c": [3, "x"]}) == ["b"]
    assert diverged_peers({"a": [3, "y"], "b": [3, "x"], "c": [3, "x"], "d": None}) == ["a"]
    # a tie goes to the digest of the smallest peer id among the tied
    assert diverged_peers({"b": [3, "x"], "a": [3, "y"]}) == ["b"]
    assert diverged_peers({"a": [3, "x"], "b": [3, "y"], "c": [3, "z"], "d": [3, "z"]}) == ["a", "b"]
    # compared at the latest round that two peers report; another round is not comparable
    assert diverged_peers({"a": [4, "x"], "b": [4, "y"], "c": [4, "x"], "d": [2, "q"]}) == ["b"]
    assert diverged_peers({"a": [5, "x"], "b": [4, "y"], "c": [4, "y"]}) == []


def test_a_diverged_peer_is_left_out_of_the_contributors_and_named():
    from ravnest_jax.swarm import Rendezvous

    rv = Rendezvous("tok")
    run, rnd = _two_peer_round(rv, peers=("a", "b", "c"))
    att = rnd.attempts[0]
    att.votes["gather"] = {p: {"received": list("abc"), "state": [7, "d1" if p != "c" else "d2"]} for p in "abc"}
    rv._decide(run, rnd, att, "gather")
    assert att.decisions["gather"] == {"decision": "ok", "contributors": ["a", "b"], "diverged": ["c"]}
    # a ring cannot leave it out of the partial sums: it is only named
    rnd2 = rv._create_round(run, rnd.number, {"part_s": 5.0, "grace_s": 1.0}, "a")
    att2 = rnd2.attempts[0]
    att2.votes["gather"] = {
        p: {"received": list("abc"), "ring": True, "state": [7, "d1" if p != "c" else "d2"]} for p in "abc"
    }
    rv._decide(run, rnd2, att2, "gather")
    assert att2.decisions["gather"] == {"decision": "ok", "contributors": ["a", "b", "c"], "diverged": ["c"]}


def test_a_part_of_another_manifest_is_refused_and_warned_about_once_per_sender(caplog):
    """Peers of one run with another codec, mean codec or aggregator refuse each other's parts;
    the vote reports those only as parts that never arrived, so the owner names the sender and
    its own wire settings in one WARNING (once per sender, not once per round)."""
    from aiohttp import web

    from ravnest_jax.swarm.peer._attempt import refuse_other_manifest

    warned: set[str] = set()
    caplog.set_level("WARNING", logger="ravnest_jax.swarm")
    for sender in ["b", "b", "c", "b"]:
        with pytest.raises(web.HTTPBadRequest) as refused:
            refuse_other_manifest(warned, "a", sender, "sign>int2/butterfly/clipped_mean:2.0")
        assert "round manifest" in refused.value.text
    lines = [r.getMessage() for r in caplog.records if r.name == "ravnest_jax.swarm"]
    assert len(lines) == 2 and warned == {"b", "c"}
    assert "peer b sends parts of another round manifest" in lines[0] and "sign>int2/butterfly" in lines[0]
    assert "peer c " in lines[1]


def test_a_round_failed_before_its_number_names_no_round_minus_one():
    from ravnest_jax.swarm import RoundFailed, RoundRecord

    def rec(r):
        return RoundRecord(
            r, False, 1, ("a",), (), 0.0, 0, 0, 0.1, "", "int4", error="missed round 3: the swarm is at round 4"
        )

    assert str(RoundFailed(rec(-1))) == "missed round 3: the swarm is at round 4", str(RoundFailed(rec(-1)))
    assert str(RoundFailed(rec(7))) == "round 7 failed: missed round 3: the swarm is at round 4"
