"""Agreeing on a restart point: published peer info, `rj.sync.common_checkpoint_step` and
`rj.sync.running_peers`, over a real rendezvous and real swarms on 127.0.0.1 (in-process)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time

import numpy as np
import pytest

import ravnest_jax as rj
from ravnest_jax.swarm import Swarm, SwarmError

from ._local import FAST, TOKEN, local_swarm, rendezvous_thread

pytestmark = pytest.mark.integration  # real processes: minutes in all


def _agree(peers, steps, **kw):
    with concurrent.futures.ThreadPoolExecutor(len(peers)) as pool:
        futs = [
            pool.submit(rj.sync.common_checkpoint_step, s, st, num_peers=len(peers), timeout=20, **kw)
            for s, st in zip(peers, steps)
        ]
        return [f.result(timeout=40) for f in futs]


@pytest.mark.timeout(120)
def test_every_peer_gets_the_newest_common_step():
    with local_swarm(3) as peers:
        assert _agree(peers, [[5, 10, 15], [0, 5, 10], [10, 15, 20]]) == [10, 10, 10]
        # what a peer published is what the others see
        info = {p.peer_id: p.info for p in peers[0].peers()}
        assert info["p1"]["checkpoint_steps"] == [0, 5, 10]


@pytest.mark.timeout(120)
def test_wait_for_info_is_a_barrier():
    with local_swarm(2) as (a, b):
        with pytest.raises(TimeoutError, match="fewer than 2 peers"):
            rj.sync.wait_for_info(a, "ready", 7, num_peers=2, timeout=1.0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(rj.sync.wait_for_info, b, "ready", 7, num_peers=2, timeout=20)
            rj.sync.wait_for_info(a, "ready", 7, num_peers=2, timeout=20)
            other.result(timeout=20)


@pytest.mark.timeout(120)
def test_no_checkpoints_anywhere_is_a_fresh_start_and_disjoint_steps_raise():
    with local_swarm(2) as peers:
        assert _agree(peers, [[], []]) == [None, None]
    with local_swarm(2) as peers:
        with pytest.raises(SwarmError, match="no checkpoint step in common"):
            _agree(peers, [[5, 10], [15, 20]])
    with local_swarm(2) as peers:
        with pytest.raises(SwarmError, match="have none"):
            _agree(peers, [[5, 10], []])


@pytest.mark.timeout(120)
def test_bad_arguments_and_timeout():
    with local_swarm(1) as (p,):
        with pytest.raises(ValueError, match="num_peers"):
            rj.sync.common_checkpoint_step(p, [1], num_peers=0)
        with pytest.raises(ValueError, match="non-negative"):
            rj.sync.common_checkpoint_step(p, [-1], num_peers=1)
        with pytest.raises(TimeoutError, match="fewer than 2 peers"):
            rj.sync.common_checkpoint_step(p, [1], num_peers=2, timeout=1.0)
        with pytest.raises(ValueError, match="info"):
            p.set_info({"x": "y" * 5000})
        with pytest.raises(ValueError, match="JSON"):
            p.set_info({"x": object()})


@pytest.mark.timeout(120)
def test_running_peers_sees_a_training_swarm_but_not_a_dead_entry():
    with rendezvous_thread() as url, contextlib.ExitStack() as stack:
        a, b = (
            stack.enter_context(
                Swarm(url, run_id="r", token=TOKEN, listen="127.0.0.1:0", timeouts=FAST, peer_id=f"p{i}")
            )
            for i in range(2)
        )
        a.wait_for_peers(2, timeout=20)
        assert rj.sync.running_peers(a, wait_seconds=2) == []  # nobody has finished a round
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(s.all_reduce, {"x": np.ones(4, np.float32)}, weight=1.0) for s in (a, b)]
            [f.result(timeout=30) for f in futs]
        late = stack.enter_context(
            Swarm(url, run_id="r", token=TOKEN, listen="127.0.0.1:0", timeouts=FAST, peer_id="p9")
        )
        for _ in range(100):  # the rendezvous learns of finished rounds from the heartbeats
            if all(p.last_round >= 0 for p in late.peers() if p.peer_id != "p9"):
                break
            time.sleep(0.1)
        running = [p.peer_id for p in rj.sync.running_peers(late, wait_seconds=3)]
        assert running and set(running) <= {"p0", "p1"}, running

        # b stops heartbeating without leaving (as if killed): its entry stays until eviction,
        # yet it is not taken for a running peer
        async def silence():
            for t in asyncio_tasks(b):
                t.cancel()

        asyncio.run_coroutine_threadsafe(silence(), b._loop).result(timeout=10)
        a.close()
        b_entry = [p for p in late.peers() if p.peer_id == "p1"]
        assert b_entry and b_entry[0].last_round >= 0
        assert rj.sync.running_peers(late, wait_seconds=FAST.heartbeat * 3) == []


def asyncio_tasks(swarm):
    return [t for t in asyncio.all_tasks(swarm._loop) if "heartbeat_loop" in repr(t.get_coro())]


@pytest.mark.timeout(60)
def test_rendezvous_refuses_bad_info_with_400():
    import aiohttp

    from ravnest_jax.swarm.wire._http import signed_json

    async def join(url, info):
        async with aiohttp.ClientSession() as s:
            try:
                await signed_json(
                    s,
                    url,
                    "POST",
                    "/v1/runs/r/join",
                    token=TOKEN.encode(),
                    run_id="r",
                    peer="x",
                    payload={"peer_id": "x", "address": "http://127.0.0.1:9", "last_round": -1, "info": info},
                    timeout=aiohttp.ClientTimeout(total=10),
                )
            except Exception as e:  # noqa: BLE001
                return getattr(e, "status", repr(e))
            return 200

    with rendezvous_thread() as url:
        assert asyncio.run(join(url, {"checkpoint_steps": [1, 2]})) == 200
        assert asyncio.run(join(url, ["not", "an", "object"])) == 400
        assert asyncio.run(join(url, {"x": "y" * 5000})) == 400
