"""Client-only peers (no inbound port) through the rendezvous' relay: real processes and sockets."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time

import aiohttp
import numpy as np
import pytest
from _procfs import listening_sockets

from ravnest_jax.swarm import Swarm, Timeouts
from ravnest_jax.swarm.rendezvous._relay import Relay, RelayStats, _Bucket
from ravnest_jax.swarm.wire import _auth

from ._expect import check_round
from .conftest import TOKEN, Cluster

T = Timeouts(connect=2.0, part=5.0, grace=0.5, round=20.0, heartbeat=0.5, eviction=3.0)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_client_only_peer_takes_part_in_every_round(cluster: Cluster, tmp_path):
    cluster.rendezvous()
    size, rounds = 20_001, 10
    peers = {"p0": (30, 1.0), "p1": (31, 2.0), "p2": (32, 3.0)}  # p2 is client-only
    hold, serving = tmp_path / "joined", tmp_path / "serving"
    procs = {
        pid: cluster.peer(
            pid,
            seed,
            weight=w,
            rounds=rounds,
            size=size,
            expect_peers=3,
            part_timeout=10,
            **(
                {"listen": "none", "fetch_state": serving} if pid == "p2" else {"serve_state": True, "hold_until": hold}
            ),
        )
        for pid, (seed, w) in peers.items()
    }
    cluster.ready(list(procs.values()))
    ready = procs["p2"].ready
    assert ready["client_only"] and ready["port"] is None and "/relay/test/p2" in ready["address"], ready
    assert not listening_sockets({ready["pid"]}), "a client-only peer must not listen on any TCP port"
    assert set(listening_sockets({procs["p0"].ready["pid"]}).values()) == {procs["p0"].port}
    _joins_as_client_only(procs, serving, hold)
    for p in procs.values():
        p.expect("done", 90)
        assert p.wait(10) == 0, p.stderr()
    for i in range(rounds):
        events = {pid: p.rounds()[i] for pid, p in procs.items()}
        check_round(peers, events, i, size, sorted(peers))  # p2's contribution is in every mean


def _joins_as_client_only(procs: dict, serving, hold) -> None:
    """After the rounds, p0 and p1 serve a state (each says "holding" once it does; until then
    it may still be merging its last round, and a download would find no state); ``serving``
    then lets p2 (client-only) download it as a joiner does, by outbound requests only; then
    ``hold`` lets the servers leave."""
    for pid in ("p0", "p1"):
        procs[pid].expect("holding", 90)
    serving.write_text("")
    got = procs["p2"].expect("state", 60)
    assert got["bytes"] == len("state-of-p0;") * 1000 and got["head"].startswith(("state-of-p0;", "state-of-p1;")), got
    hold.write_text("")


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_unreachable_peer_turns_client_only_and_state_flows_both_ways(cluster: Cluster):
    url = cluster.rendezvous()
    dead = _closed_port()
    kw = dict(run_id="relay", token=TOKEN, timeouts=T)
    with (
        Swarm(url, listen="127.0.0.1:0", peer_id="a", **kw) as a,
        Swarm(url, listen="127.0.0.1:0", advertise=f"http://127.0.0.1:{dead}", peer_id="b", **kw) as b,
    ):
        assert not a.client_only
        assert b.client_only and b.address.endswith("/relay/relay/b"), b.address  # the probe found it unreachable
        peers = {p.peer_id: p for p in a.wait_for_peers(2, timeout=10)}
        deadline = time.monotonic() + 10
        while not peers["b"].relayed and time.monotonic() < deadline:  # its next heartbeat
            peers = {p.peer_id: p for p in a.peers()}
        assert peers["b"].relayed and not peers["a"].relayed, peers
        rng = np.random.default_rng(3)
        x = {p: rng.standard_normal(5000).astype(np.float32) for p in "ab"}
        fa, fb = a.all_reduce_async({"x": x["a"]}), b.all_reduce_async({"x": x["b"]})
        (_, reca), (rb, recb) = fa.result(30), fb.result(30)
        assert reca.ok and recb.ok and reca.digest == recb.digest and reca.contributors == ("a", "b")
        np.testing.assert_allclose(rb["x"], (x["a"] + x["b"]) / 2, rtol=1e-6, atol=1e-7)
        assert recb.clipped == {}, recb.clipped
        # b owns no part while a is reachable: it sent its part to a and pulled the result, so
        # nothing of the round went through the relay
        assert a.status()["relay"].get("b", {}).get("messages", 0) == 0, a.status()["relay"]
        assert recb.bytes_sent > 0 and recb.bytes_received > 0, recb
        # a joiner that is client-only downloads the state directly (outbound)
        a.serve_state(lambda: b"state-of-a" * 1000)
        assert b.fetch_state(timeout=10) == b"state-of-a" * 1000
        # and a state only the client-only peer has comes through the relay
        a.serve_state(None)
        b.serve_state(lambda: b"state-of-b" * 1000)
        assert a.fetch_state(timeout=10) == b"state-of-b" * 1000
        stats = a.status()["relay"]["b"]
        assert stats["messages"] == 1 and stats["bytes_out"] >= 10_000 and stats["failed"] == 0, stats
        deadline = time.monotonic() + 10  # b counts a message once its answer's POST returns
        while b.relay_stats["messages"] < stats["messages"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.relay_stats["messages"] == stats["messages"], (b.relay_stats, stats)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections are refused


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_relay_refuses_what_it_must(cluster: Cluster):
    url = cluster.rendezvous()
    kw = dict(run_id="relay", token=TOKEN, timeouts=T)
    with Swarm(url, listen="127.0.0.1:0", peer_id="a", **kw), Swarm(url, listen=None, peer_id="c", **kw):

        async def go() -> list[int]:
            out = []
            async with aiohttp.ClientSession() as s:
                inner = "/v1/runs/relay/state"
                signed = _auth.sign(TOKEN, method="GET", path=inner, run_id="relay", peer="a")
                hop = dict(signed)
                hop[_auth.H_HOP] = _auth.hop_sign(TOKEN, "GET", f"/relay/relay/c{inner}", signed)
                for path, headers in [
                    (f"/relay/relay/c{inner}", signed),  # no hop proof
                    (
                        f"/relay/relay/a{inner}",
                        {**signed, _auth.H_HOP: _auth.hop_sign(TOKEN, "GET", f"/relay/relay/a{inner}", signed)},
                    ),  # a is not relayed
                    ("/relay/relay/c/v1/runs/other/state", hop),  # another run's path
                    (f"/relay/relay/c{inner}", {**hop, _auth.H_HOP: "0" * 64}),  # a forged proof
                    ("/v1/runs/relay/relay/poll", {}),  # an unsigned poll
                ]:
                    async with s.get(url + path, headers=headers) as r:
                        out.append(r.status)
                reply = "/v1/runs/relay/relay/reply/nosuch"
                h = _auth.sign(TOKEN, method="POST", path=reply, run_id="relay", peer="c")
                async with s.post(url + reply, headers=h) as r:
                    out.append(r.status)
                # the real thing, once: c has no state to serve (404 from c itself, through the relay)
                fresh = _auth.sign(TOKEN, method="GET", path=inner, run_id="relay", peer="a")
                fresh[_auth.H_HOP] = _auth.hop_sign(TOKEN, "GET", f"/relay/relay/c{inner}", fresh)
                async with s.get(url + f"/relay/relay/c{inner}", headers=fresh) as r:
                    out.append(r.status)
                    body = await r.text()
                out.append(body)
            return out

        got = asyncio.run(go())
        assert got[:7] == [401, 404, 404, 401, 401, 404, 404], str(got)
        assert "serves no state" in got[7], got


def test_relay_bucket_holds_the_rate():
    async def go() -> float:
        b = _Bucket(1e6)  # 1 MB/s, a burst of 1 MB
        t0 = time.monotonic()
        for _ in range(4):
            await b.take(500_000)
        return time.monotonic() - t0

    elapsed = asyncio.run(go())
    assert elapsed >= 0.95, f"2 MB at 1 MB/s with a 1 MB burst took only {elapsed:.3f} s"


def test_relay_forgets_the_peers_that_left():
    """The relay's per-peer stats were kept for every relayed peer id ever seen: a rendezvous
    serving client-only peers that come and go with new ids grew without bound."""
    relay = Relay(b"token", lambda run, peer: True)
    for i in range(500):
        relay.stats[("run", f"p{i}")] = RelayStats(messages=1)
        if i >= 2:  # two stay
            relay.drop("run", f"p{i}")
    assert sorted(relay.run_stats("run")) == ["p0", "p1"], sorted(relay.stats)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_client_only_peer_behind_nat_in_network_namespaces(tmp_path):
    """Three network namespaces: ``wan`` (the rendezvous and two reachable peers), ``lan`` (one
    peer) and ``router`` between them, which masquerades the lan's traffic (iptables NAT) and
    forwards nothing new into it. The lan peer advertises its own address, which the rendezvous'
    probe cannot reach: it turns client-only and averages through the relay."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if not shutil.which("ip") or not shutil.which("iptables"):
        pytest.skip("needs the ip and iptables commands (iproute2, iptables) to build a NAT")
    tag = f"{os.getpid() % 100000}"
    lan, router, wan = f"rjl{tag}", f"rjr{tag}", f"rjw{tag}"

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, timeout=20)

    def in_ns(ns: str, *cmd: str) -> None:
        sh("ip", "netns", "exec", ns, *cmd)

    try:
        for ns in (lan, router, wan):
            sh("ip", "netns", "add", ns)
            in_ns(ns, "ip", "link", "set", "lo", "up")
        sh("ip", "link", "add", "rjl0", "netns", lan, "type", "veth", "peer", "name", "rjr0", "netns", router)
        sh("ip", "link", "add", "rjr1", "netns", router, "type", "veth", "peer", "name", "rjw0", "netns", wan)
        for ns, dev, addr in (
            (lan, "rjl0", "10.231.0.2/30"),
            (router, "rjr0", "10.231.0.1/30"),
            (router, "rjr1", "10.232.0.1/30"),
            (wan, "rjw0", "10.232.0.2/30"),
        ):
            in_ns(ns, "ip", "addr", "add", addr, "dev", dev)
            in_ns(ns, "ip", "link", "set", dev, "up")
        in_ns(lan, "ip", "route", "add", "default", "via", "10.231.0.1")
        in_ns(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        in_ns(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "rjr1", "-j", "MASQUERADE")
        in_ns(router, "iptables", "-A", "FORWARD", "-i", "rjr1", "-m", "state", "--state", "NEW", "-j", "DROP")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        _teardown_ns(lan, router, wan)
        pytest.skip(f"cannot build the NAT here: {getattr(e, 'stderr', b'').decode(errors='replace').strip()}")
    cluster = Cluster(tmp_path)
    try:
        wan_x, lan_x = ("ip", "netns", "exec", wan), ("ip", "netns", "exec", lan)
        cluster.rendezvous(host="10.232.0.2", wrap=wan_x, extra=("--probe-timeout", "1"))
        peers = {"p0": (40, 1.0), "p1": (41, 1.0), "p2": (42, 1.0)}
        rounds, hold, serving = 10, tmp_path / "joined", tmp_path / "serving"
        kw = dict(rounds=rounds, size=5001, expect_peers=3, part_timeout=10)
        serve = dict(serve_state=True, hold_until=hold)
        procs = {
            "p0": cluster.peer("p0", 40, wrap=wan_x, listen="10.232.0.2:0", **kw, **serve),
            "p1": cluster.peer("p1", 41, wrap=wan_x, listen="10.232.0.2:0", **kw, **serve),
            "p2": cluster.peer(
                "p2", 42, wrap=lan_x, listen="10.231.0.2:0", fetch_state=serving, **kw
            ),  # behind the NAT
        }
        for p in procs.values():
            p.ready = p.expect("ready", 60)
        assert procs["p2"].ready["client_only"], procs["p2"].ready  # the probe could not reach it
        assert not procs["p0"].ready["client_only"]
        _joins_as_client_only(procs, serving, hold)
        for p in procs.values():
            p.expect("done", 90)
        for i in range(rounds):
            check_round(peers, {pid: p.rounds()[i] for pid, p in procs.items()}, i, 5001, sorted(peers))
    finally:
        cluster.close()  # (ports inside the namespaces go with them)
        _teardown_ns(lan, router, wan)


def _teardown_ns(*namespaces: str) -> None:
    for ns in namespaces:  # deleting a namespace removes its veth ends and iptables rules
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def _rounds_in_threads(url, run, vectors, listen, rounds=2, **kw):
    """Starts one in-process Swarm per id of ``vectors`` (``listen[id]``: its listen value),
    runs ``rounds`` rounds of ``vectors``, returns every round's (results, records)."""
    import concurrent.futures

    ids = sorted(vectors)
    swarms = [
        Swarm(url, run_id=run, token=TOKEN, listen=listen[p], timeouts=T, peer_id=p, **kw).__enter__() for p in ids
    ]
    try:
        swarms[0].wait_for_peers(len(ids), timeout=10)
        out = []
        for _ in range(rounds):
            futs = [s.all_reduce_async({"x": vectors[p]}) for s, p in zip(swarms, ids, strict=True)]
            out.append([f.result(30) for f in futs])
        relay = swarms[0].status()["relay"]
        return out, relay
    finally:
        with concurrent.futures.ThreadPoolExecutor(len(swarms)) as ex:
            list(ex.map(lambda s: s.close(), swarms))


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_swarm_of_client_only_peers_averages_through_the_relay(cluster: Cluster):
    url = cluster.rendezvous()
    rng = np.random.default_rng(5)
    vec = {p: rng.standard_normal(3001).astype(np.float32) for p in "abc"}
    out, relay = _rounds_in_threads(url, "allrelay", vec, dict.fromkeys("abc"))
    exp = sum(v.astype(np.float64) for v in vec.values()) / 3
    for results in out:
        recs = [r for _, r in results]
        assert all(r.ok and r.contributors == ("a", "b", "c") for r in recs), recs
        assert len({r.digest for r in recs}) == 1, recs
        np.testing.assert_allclose(results[1][0]["x"], exp, rtol=1e-5, atol=1e-6)
    # nobody is reachable: every part and result went through the rendezvous
    assert set(relay) == {"a", "b", "c"} and all(s["messages"] >= 8 for s in relay.values()), relay


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_wild_client_only_peer_is_clipped_by_the_owners(cluster: Cluster):
    url = cluster.rendezvous()
    rng = np.random.default_rng(6)
    vec = {p: rng.standard_normal(3001).astype(np.float32) for p in "abc"}
    vec["c"] = vec["c"] * 1000  # the client-only one
    listen = {"a": "127.0.0.1:0", "b": "127.0.0.1:0", "c": None}
    out, relay = _rounds_in_threads(url, "wildrelay", vec, listen, rounds=1)
    recs = [r for _, r in out[0]]
    assert all(r.ok for r in recs) and len({r.digest for r in recs}) == 1, recs
    assert all(set(r.clipped) == {"c"} for r in recs), [r.clipped for r in recs]  # the puller knows too
    assert len({r.clipped["c"] for r in recs}) == 1 and recs[0].clipped["c"] < 0.01, recs[0].clipped
    # owners a and b; c pulled its results. The clip changed the sum the owners made on the fly:
    # each pulled c's part again, through the relay (one GET each: a relayed request without a
    # body, which once stalled the rendezvous' event loop for ever)
    assert relay.get("c", {}).get("messages", 0) == 2, relay


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_ring_with_a_client_only_member(cluster: Cluster):
    """The ring has no pull path: what a client-only member receives comes through the relay."""
    url = cluster.rendezvous()
    rng = np.random.default_rng(7)
    vec = {p: rng.standard_normal(4099).astype(np.float32) for p in "abc"}
    listen = {"a": "127.0.0.1:0", "b": None, "c": "127.0.0.1:0"}
    out, relay = _rounds_in_threads(url, "ringrelay", vec, listen, rounds=2, algorithm="ring")
    exp = sum(v.astype(np.float64) for v in vec.values()) / 3
    for results in out:
        recs = [r for _, r in results]
        assert all(r.ok and r.contributors == ("a", "b", "c") and r.algorithm == "ring" for r in recs), recs
        assert len({r.digest for r in recs}) == 1, recs
        for res, _ in results:
            np.testing.assert_allclose(res["x"], exp, rtol=1e-5, atol=1e-6)
    assert relay.get("b", {}).get("messages", 0) > 0 and set(relay) == {"b"}, relay
