"""The rendezvous' status page: read access (run token, read-only token, cookie), nothing of a run
without it, and the data a peer's published stats become. A real aiohttp server on 127.0.0.1;
peers are signed heartbeats, as ``rj.Swarm`` sends them."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from ravnest_jax.swarm.rendezvous._rendezvous import Rendezvous
from ravnest_jax.swarm.wire._http import signed_json

TOKEN, READ = "run-token-xyz", "read-only-abc"


async def _beat(s, url, peer, stats, run="exp1", token=TOKEN):
    payload = {"peer_id": peer, "address": f"http://127.0.0.1:1/{peer}", "last_round": stats.get("round", -1)}
    payload["info"] = {"stats": stats, "checkpoint_steps": [10]}
    return await signed_json(
        s,
        url,
        "POST",
        f"/v1/runs/{run}/heartbeat",
        token=token.encode(),
        run_id=run,
        peer=peer,
        payload=payload,
        timeout=aiohttp.ClientTimeout(total=5),
    )


@contextlib.asynccontextmanager
async def _server():
    rv = Rendezvous(TOKEN, read_token=READ)
    async with TestServer(rv.make_app(), host="127.0.0.1") as srv:
        yield rv, str(srv.make_url("")).rstrip("/")


def _run(body):
    async def go():
        async with _server() as server:
            await body(server)

    asyncio.run(go())


def test_without_a_token_nothing_of_a_run_is_shown():
    _run(_test_without_a_token_nothing_of_a_run_is_shown)


async def _test_without_a_token_nothing_of_a_run_is_shown(server):
    rv, url = server
    async with aiohttp.ClientSession() as s:
        await _beat(s, url, "alice", {"step": 40, "round": 3, "train_loss": 2.5})
        for path, headers in [
            ("/", {}),
            ("/runs/exp1", {}),
            ("/runs/exp1?token=wrong", {}),
            ("/runs/exp1", {"Authorization": "Bearer wrong"}),
            ("/runs/exp1", {"Authorization": f"Basic {TOKEN}"}),
        ]:
            async with s.get(url + path, headers=headers) as r:
                body = await r.text()
            assert "exp1" not in body and "alice" not in body, (path, r.status, body[:300])
            assert 'name="token"' in body, (path, body[:300])  # the login form
        for path in ("/data", "/runs/exp1/data", "/runs/exp1/data?token=" + TOKEN[:-1]):
            async with s.get(url + path) as r:
                body = await r.text()
            assert r.status == 401 and "alice" not in body and "exp1" not in body, (path, r.status, body)


def test_run_token_read_token_and_login_cookie_open_the_data():
    _run(_test_run_token_read_token_and_login_cookie_open_the_data)


async def _test_run_token_read_token_and_login_cookie_open_the_data(server):
    rv, url = server
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        await _beat(s, url, "alice", {"step": 40, "round": 3})
        for path, headers in [
            ("/data?token=" + TOKEN, {}),
            ("/data?token=" + READ, {}),
            ("/data", {"Authorization": f"Bearer {READ}"}),
        ]:
            async with s.get(url + path, headers=headers) as r:
                d = await r.json()
            assert r.status == 200 and [x["run_id"] for x in d["runs"]] == ["exp1"], (path, d)
        async with s.post(url + "/login", data={"token": "nope"}, allow_redirects=False) as r:
            assert r.status == 401 and "not this rendezvous" in await r.text()
        async with s.get(url + "/runs/exp1/data") as r:
            assert r.status == 401  # a failed login set nothing
        async with s.post(url + "/login", data={"token": READ}, allow_redirects=False) as r:
            assert r.status == 303, r.status
            cookie = r.cookies["ravnest_status"]
            assert READ not in cookie.value and cookie["httponly"], cookie.output()
        async with s.get(url + "/runs/exp1/data") as r:
            assert r.status == 200 and (await r.json())["peers"][0]["peer_id"] == "alice"
        async with s.get(url + "/runs/exp1") as r:
            page = await r.text()
        assert r.status == 200 and "/data" in page and "<script>" in page
        async with s.get(url + "/runs/nope/data") as r:
            assert r.status == 404
        async with s.post(url + "/logout", allow_redirects=False) as r:
            assert r.status == 303
        async with s.get(url + "/runs/exp1/data") as r:
            assert r.status == 401
    # the read-only token signs nothing: the swarm's API refuses it
    async with aiohttp.ClientSession() as s:
        with pytest.raises(Exception, match="401"):
            await _beat(s, url, "mallory", {"step": 1}, token=READ)


def test_the_data_is_what_the_peers_published():
    _run(_test_the_data_is_what_the_peers_published)


async def _test_the_data_is_what_the_peers_published(server):
    rv, url = server
    common = {"rounds_ok": 2, "rounds_failed": 0, "resyncs": 0, "bytes_received": 900, "exchange_s": 0.5}
    async with aiohttp.ClientSession() as s:
        await _beat(
            s,
            url,
            "a",
            {
                **common,
                "step": 30,
                "round": 2,
                "utilisation": 0.97,
                "bytes_sent": 1000,
                "link_mbit": 12.5,
                "stall_s": 0.2,
                "train_loss": 2.0,
                "last_error": None,
            },
        )
        await _beat(
            s,
            url,
            "b",
            {
                **common,
                "step": 31,
                "round": 2,
                "utilisation": 0.9,
                "bytes_sent": 2000,
                "train_loss": 3.0,
                "eval_loss": 3.5,
                "last_error": "RoundFailed: x",
            },
        )
        run = rv.runs["exp1"]
        from ravnest_jax.swarm.rendezvous._rounds import _Attempt, _Round

        run.rounds[2] = _Round(2, 0.0, 1.0, 1.0, 3, {0: _Attempt(0, ("a", "b", "c"), 0.0)}, "ok", ("a", "b"), "d2")
        run.rounds[3] = _Round(3, 0.0, 1.0, 1.0, 3, {0: _Attempt(0, ("a", "b"), 0.0)}, "failed", reason="why")
        async with s.get(url + "/runs/exp1/data", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            d = await r.json()
    peers = {p["peer_id"]: p for p in d["peers"]}
    assert set(peers) == {"a", "b"}, d
    assert peers["a"]["step"] == 30 and peers["a"]["utilisation"] == 0.97 and peers["a"]["link_mbit"] == 12.5, peers
    assert peers["b"]["last_error"] == "RoundFailed: x" and peers["b"]["bytes_sent"] == 2000, peers
    assert peers["a"]["checkpoint_steps"] == [10] and peers["a"]["eval_loss"] is None, peers
    r2, r3 = d["rounds"]
    assert r2["left_out"] == ["c"] and r2["contributors"] == ["a", "b"] and r2["reporting"] == 2, r2
    assert r2["train_loss"] == pytest.approx(2.5) and r2["eval_loss"] == pytest.approx(3.5), r2
    assert r3["outcome"] == "failed" and r3["reason"] == "why" and r3["left_out"] == [], r3


def test_garbage_stats_are_ignored_not_fatal():
    _run(_test_garbage_stats_are_ignored_not_fatal)


async def _test_garbage_stats_are_ignored_not_fatal(server):
    rv, url = server
    async with aiohttp.ClientSession() as s:
        await _beat(s, url, "a", {"round": "x", "train_loss": "NaN", "step": [1]})
        await _beat(s, url, "b", {"round": 5, "train_loss": True})
        async with s.get(url + f"/runs/exp1/data?token={TOKEN}") as r:
            d = await r.json()
    assert r.status == 200 and len(d["peers"]) == 2, d
    assert rv.runs["exp1"].reports == {}, rv.runs["exp1"].reports


def test_malformed_logins_and_headers_are_4xx_not_500():
    _run(_test_malformed_logins_and_headers_are_4xx_not_500)


async def _test_malformed_logins_and_headers_are_4xx_not_500(server):
    rv, url = server
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    async with aiohttp.ClientSession() as s:
        for body, headers in [
            (b"\xff\xfe=1", form),
            (bytes(range(256)) * 12, form),
            (b"--xx\r\nbroken", {"Content-Type": "multipart/form-data; boundary=xx"}),
            (b'{"token": "' + TOKEN.encode() + b'"}', {"Content-Type": "application/json"}),
        ]:
            async with s.post(url + "/login", data=body, headers=headers, allow_redirects=False) as r:
                text = await r.text()
            assert r.status in (400, 401) and "ravnest_status" not in r.headers.get("Set-Cookie", ""), (
                body[:20],
                r.status,
            )
            assert 'name="token"' in text, text[:200]
        async with s.get(url + "/data", headers={"Authorization": "bearer " + TOKEN}) as r:
            assert r.status == 200, r.status  # the scheme is case-insensitive
    # a header of raw non-UTF-8 bytes (aiohttp's client will not send one): a raw socket
    reader, writer = await asyncio.open_connection(*url.split("//")[1].split(":"))
    writer.write(b"GET /data HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
    await writer.drain()
    head = (await reader.read(200)).split(b"\r\n", 1)[0]
    writer.close()
    assert head.endswith(b"401 Unauthorized"), head
