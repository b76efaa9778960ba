"""The README's code shape is all a user needs: two peers train, a third joins after two rounds,
downloads the state (served by OuterSync by itself) and ends with the same global state."""

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

from ravnest_jax.swarm._http import signed_json

from ._local import TOKEN, rendezvous_thread

pytestmark = pytest.mark.integration  # real peer processes

SCRIPT = str(Path(__file__).with_name("_readme_peer.py"))
TOTAL = 150


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
    with rendezvous_thread() as url:
        try:

            def start(name: str) -> None:
                logs.append(open(tmp_path / f"{name}.log", "w"))
                procs[name] = subprocess.Popen(
                    [sys.executable, SCRIPT, url, TOKEN, name, str(TOTAL)],
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
    # a joiner whose first train step compiles while the others begin the next round misses that
    # round (it was still on standby) and downloads once more; every later round is ok
    assert c["rounds"] >= 3 and c["failed_rounds"] <= 1 and c["resyncs"] == c["failed_rounds"], c
    assert a["failed_rounds"] == 0 and b["failed_rounds"] == 0, out
    assert a["last_state_digest"] == b["last_state_digest"] == c["last_state_digest"], out
