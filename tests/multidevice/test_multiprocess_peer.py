"""A peer that spans two processes (jax.distributed over 127.0.0.1, gloo CPU collectives, 2 CPU
devices each) is one swarm member: process 0 talks to the swarm, process 1 gets the mean from
it. It trains in a swarm with a single-device peer of this process; both agree on every round."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from sync._local import PATIENT, TOKEN, rendezvous_thread

from ravnest_jax.swarm import Swarm

from .test_sharded_peer import _run_peer

pytestmark = pytest.mark.integration  # real processes: minutes in all

WORKER = Path(__file__).with_name("_mp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_two_process_peer_is_one_swarm_member():
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    procs: list[subprocess.Popen] = []
    with rendezvous_thread(PATIENT) as url:
        try:
            for pid in (0, 1):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(pid), str(port), url],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
            with Swarm(
                url, run_id="md-mp", token=TOKEN, codec="int4", listen="127.0.0.1:0", timeouts=PATIENT, peer_id="single"
            ) as swarm:
                swarm.wait_for_peers(2, timeout=120)
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    mine = pool.submit(_run_peer, swarm, 1).result(timeout=180)
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
                for f in (p.stdout, p.stderr):  # closed here, not by a later test's garbage collection
                    if f is not None:
                        f.close()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    res = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    ours = [m.state_digest for m in mine["metrics"]]
    assert len(ours) == 2 and all(m.group_size == 2 for m in mine["metrics"])
    for r in res:
        assert r["addressable_devices"] == 2 and r["failed"] == 0 and r["layout_kept"]
        assert r["compiles"] == [1, 1, 1]  # the inner step and each round function compiled once
        assert r["digests"] == ours  # both processes and the other peer: the same global state
    assert res[0]["group_sizes"] == [2, 2]
    assert res[0]["global_digest"] == res[1]["global_digest"]
    from ravnest_jax.sync import device_digest, digest_hex

    assert res[0]["global_digest"] == digest_hex(device_digest(jax.device_get(mine["state"].global_params)))
