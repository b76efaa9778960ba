"""The README's code shape is all a user needs: two peers train, a third joins after two rounds,
downloads the state (served by OuterSync by itself) and ends with the same global state; the
rendezvous' status page shows the three peers and their rounds meanwhile (and nothing without
the token)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from ravnest_jax.swarm import Timeouts
from ravnest_jax.swarm.wire._http import signed_json

from ._local import TOKEN, rendezvous_thread

pytestmark = pytest.mark.integration  # real peer processes

SCRIPT = str(Path(__file__).with_name("_readme_peer.py"))
TOTAL = 150
# nothing here tests failure detection: a peer slowed by a loaded machine (CI) is waited for
STEADY = Timeouts(connect=5.0, part=30.0, grace=1.0, round=120.0, heartbeat=0.5, eviction=10.0, max_attempts=3)


def _ok_rounds(url: str) -> int:
    async def ask() -> dict:
        async with aiohttp.ClientSession() as s:
            return await signed_json(
                s,
                url,
                "GET",
                "/v1/runs/readme/status",
                token=TOKEN.encode(),
                run_id="readme",
                peer="test",
                timeout=aiohttp.ClientTimeout(total=5),
            )

    try:
        return sum(r["outcome"] == "ok" for r in asyncio.run(ask())["rounds"])
    except Exception:  # noqa: BLE001 - no run yet
        return 0


@pytest.mark.timeout(300)
def test_readme_code_a_third_peer_joins_and_agrees(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
    procs, logs = {}, []
    with rendezvous_thread(STEADY) as url:
        try:

            def start(name: str) -> None:
                logs.append(open(tmp_path / f"{name}.log", "w"))
                procs[name] = subprocess.Popen(
                    [sys.executable, SCRIPT, url, TOKEN, name, str(TOTAL), str(tmp_path / "c.joined")],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=logs[-1],
                    text=True,
                )

            start("a")
            start("b")
            deadline = time.monotonic() + 120
            while _ok_rounds(url) < 2:
                assert time.monotonic() < deadline, "the first two peers did not finish 2 rounds"
                assert all(p.poll() is None for p in procs.values()), (tmp_path / "a.log").read_text()[-3000:]
                time.sleep(0.1)
            start("c")
            page = _watch_status_page(url, procs)
            out = {}
            for name, p in procs.items():
                stdout, _ = p.communicate(timeout=200)
                assert p.returncode == 0, (name, (tmp_path / f"{name}.log").read_text()[-3000:])
                out[name] = json.loads(stdout.strip().splitlines()[-1])
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.communicate()
            for f in logs:
                f.close()
    a, b, c = out["a"], out["b"], out["c"]
    assert a["start_step"] == b["start_step"] == 0, out
    assert c["start_step"] >= 20, c  # it took the swarm's progress (downloaded state)
    # a joiner whose first train step compiles while the others begin the next round (it was still
    # on standby) takes the state past that round on its first step, before its first round: no
    # failed round, no resync
    assert c["rounds"] >= 3 and c["failed_rounds"] == 0 and c["resyncs"] == 0, c
    assert a["failed_rounds"] == 0 and b["failed_rounds"] == 0, out
    assert a["last_state_digest"] == b["last_state_digest"] == c["last_state_digest"], out
    # the status page showed the three peers, their steps and a round of all three with its loss
    peers = {p["peer_id"]: p for p in page["peers"]}
    assert all(peers[n]["step"] > 0 and peers[n]["utilisation"] is not None for n in "abc"), peers
    full = [r for r in page["rounds"] if r["outcome"] == "ok" and sorted(r["contributors"]) == ["a", "b", "c"]]
    assert full and full[-1]["train_loss"] is not None and 0 < full[-1]["train_loss"] < 6, page["rounds"]


def _get(url: str, headers: dict) -> tuple[int, str]:
    async def go() -> tuple[int, str]:
        async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
            return r.status, await r.text()

    return asyncio.run(go())


def _watch_status_page(url: str, procs: dict) -> dict:
    """Polls the rendezvous' status data (as the page does) until it shows all three peers with
    their stats and an ok round of all three with a mean train loss; also checks that without
    the token neither the page nor its data shows anything of the run."""
    status, body = _get(url + "/runs/readme/data", {})
    assert status == 401 and '"a"' not in body, (status, body)
    status, body = _get(url + "/runs/readme", {})
    assert "readme" not in body and 'name="token"' in body, body[:500]
    deadline, d = time.monotonic() + 150, {}
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        status, body = _get(url + "/runs/readme/data", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, (status, body)
        d = json.loads(body)
        peers = {p["peer_id"]: p for p in d["peers"]}
        stats_in = set(peers) == {"a", "b", "c"} and all((peers[n]["step"] or 0) > 0 for n in "abc")
        full = [r for r in d["rounds"] if r["outcome"] == "ok" and sorted(r["contributors"]) == ["a", "b", "c"]]
        if stats_in and full and full[-1]["train_loss"] is not None:
            return d
        time.sleep(0.2)
    raise AssertionError(f"the status page never showed the three peers and a full round: {d}")
