"""rj.OuterSync's behaviour: peers in threads of this process, over the in-process swarm
(``ravnest_jax.testing.LocalSwarm``: the unit tier) and, end to end, over real swarms
(rendezvous and peers on 127.0.0.1: the integration tier)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ravnest_jax as rj
from ravnest_jax._staleness import STALENESS_COST
from ravnest_jax.sync import OuterSync

from ._local import PATIENT, local_swarm

DIM = 6


def _init():
    k = jax.random.key(0)
    return {
        "w1": jax.random.normal(k, (DIM, 32)) * 0.3,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(jax.random.fold_in(k, 1), (32, 2)) * 0.3,
    }


def _batch(peer: int, step: int):
    rng = np.random.default_rng([peer, step])
    x = rng.normal(size=(16, DIM)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), np.cos(x[:, 1])], 1).astype(np.float32)
    return x, y


def _loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _make_step(tx):
    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


@functools.cache
def _tx_and_step(tx_items: tuple):
    """One ``tx`` and jitted step per setting, shared by the peers and the tests of a process:
    jax traces and compiles the step and the driver's round functions once (they are pure)."""
    tx = rj.diloco(optax.adam(2e-2), **dict(tx_items))
    return tx, _make_step(tx)


def _run_peer(swarm, peer, *, steps, tx_kwargs, sync_kwargs):
    tx, step = _tx_and_step(tuple(sorted(tx_kwargs.items())))
    params = _init()
    state = tx.init(params)
    losses = []
    kwargs = dict(sync_kwargs)
    keep = kwargs.pop("keep_local_progress", None)  # the merge variant, forced (white box)
    with OuterSync(tx, swarm, **kwargs) as sync:
        if keep is not None:
            sync._fns.keep_local_progress = keep
        for t in range(steps):
            params, state, loss = step(params, state, *_batch(peer, t))
            params, state = sync(params, state)
            losses.append(float(loss))
        params, state = sync.flush(params, state)
        return {
            "params": jax.device_get(params),
            "state": jax.device_get(state),
            "losses": losses,
            "metrics": list(sync.metrics),
            "summary": sync.summary(),
            "mode": sync.mode,
        }


@contextlib.contextmanager
def _in_process(n, codec="fp32", part=60.0):
    """``n`` started in-process peers (p0, p1, ...) of one run; ``part``: a round's deadline
    (seconds after its first contribution) for members that do not contribute."""
    run = rj.testing.LocalRun(codec, timeouts=rj.Timeouts(part=part))
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(run.swarm(f"p{i}")) for i in range(n)]


def _run_swarm(n, *, steps, codec="fp32", tx_kwargs, sync_kwargs, real=False):
    # every round must include every peer: deadlines a loaded machine cannot miss (a healthy
    # round never waits for them)
    with local_swarm(n, codec=codec, timeouts=PATIENT) if real else _in_process(n, codec) as peers:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futs = [
                pool.submit(_run_peer, s, i, steps=steps, tx_kwargs=tx_kwargs, sync_kwargs=sync_kwargs)
                for i, s in enumerate(peers)
            ]
            return [f.result(timeout=120) for f in futs]


def _assert_digests_agree(results, expected_rounds):
    per_peer = [[m.state_digest for m in r["metrics"] if m.ok] for r in results]
    # on failure, every round of every peer: which one differs, and whether its mean did
    log = [
        [
            (m.round, m.swarm_round, m.ok, m.error, m.group_size, m.result_digest[:8], m.state_digest[:8])
            for m in r["metrics"]
        ]
        for r in results
    ]
    assert all(len(d) == expected_rounds for d in per_peer), ([len(d) for d in per_peer], log)
    for d in per_peer[1:]:
        assert d == per_peer[0], log
    assert all(m.group_size == len(results) for r in results for m in r["metrics"]), log


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_tau0_equals_blocking_exactly_and_digests_agree():
    """The end-to-end check of the overlapped driver: 3 peers on loopback (real rendezvous and
    peer servers), a tiny model, 3 rounds: the loss goes down, the global-state digests agree
    after every round, and the overlapped rounds' merge (which keeps the local progress since
    the boundary) with tau=0 equals the blocking merge (``overlap_steps=0``) bit for bit."""
    common = dict(steps=12, tx_kwargs=dict(sync_every=4))
    blocking = _run_swarm(3, sync_kwargs=dict(overlap_steps=0), real=True, **common)
    assert {r["mode"] for r in blocking} == {"blocking"}, [r["mode"] for r in blocking]
    delayed0 = _run_swarm(3, sync_kwargs=dict(overlap_steps=0, keep_local_progress=True), real=True, **common)
    _assert_digests_agree(blocking, 3)
    _assert_digests_agree(delayed0, 3)
    # 3 peers, 3 rounds: the loss of the global params on held-out data goes down
    x, y = _batch(99, 0)
    before, after = float(_loss(_init(), x, y)), float(_loss(blocking[0]["state"].global_params, x, y))
    assert after < 0.7 * before, (before, after)
    for a, b in zip(blocking, delayed0):
        for x, y in zip(jax.tree.leaves((a["params"], a["state"])), jax.tree.leaves((b["params"], b["state"]))):
            np.testing.assert_array_equal(x, y)
    # right after the last round every peer stands on the same anchor
    for r in blocking:
        for x, y in zip(jax.tree.leaves(r["params"]), jax.tree.leaves(blocking[0]["state"].global_params)):
            np.testing.assert_array_equal(x, y)


@pytest.mark.integration  # 4.6 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.timeout(180)
def test_blocking_swarm_matches_vmap_simulation():
    """2 peers over the swarm (fp32) == 2 replicas under vmap with axis_name (up to the float32
    order of the mean)."""
    n, h, steps = 2, 3, 9
    swarm = _run_swarm(n, steps=steps, tx_kwargs=dict(sync_every=h), sync_kwargs=dict(overlap_steps=0))
    tx = rj.diloco(optax.adam(2e-2), sync_every=h, axis_name="replica")

    def one(params, state, x, y):
        grads = jax.grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    vstep = jax.jit(jax.vmap(one, axis_name="replica"))
    p, s = rj.replicate(_init(), n), rj.replicate(tx.init(_init()), n)
    for t in range(steps):
        xs, ys = zip(*[_batch(i, t) for i in range(n)])
        p, s = vstep(p, s, np.stack(xs), np.stack(ys))
    for i in range(n):
        for a, b in zip(jax.tree.leaves(swarm[i]["params"]), jax.tree.leaves(rj.unreplicate(p, i))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "tx_kwargs,sync_kwargs,codec,rounds",
    [
        (dict(sync_every=4), dict(overlap_steps=1), "fp32", 4),
        (dict(sync_every=4), dict(eager=True, overlap_steps=2, alpha=0.0), "int4", 4),
        pytest.param(
            dict(sync_every=4, fragments=2), dict(overlap_steps=1), "int4", 7, marks=pytest.mark.integration
        ),  # 3.6 s of compiles
    ],
    ids=["delayed-tau1", "eager-int4", "fragments-int4"],
)
def test_overlapped_modes_train_and_stay_consistent(tx_kwargs, sync_kwargs, codec, rounds):
    results = _run_swarm(3, steps=16, codec=codec, tx_kwargs=tx_kwargs, sync_kwargs=sync_kwargs)
    _assert_digests_agree(results, rounds)
    x_eval, y_eval = _batch(99, 0)
    before = float(_loss(_init(), x_eval, y_eval))
    for r in results:
        assert float(_loss(r["state"].global_params, x_eval, y_eval)) < 0.8 * before
        s = r["summary"]
        assert s["failed_rounds"] == 0 and s["bytes_sent"] > 0
    if codec == "int4":  # a tiny model: the ~100-byte header weighs; payload is 4 bits
        assert all(0.1 < m.codec_ratio < 0.9 for r in results for m in r["metrics"])
    # the global state is identical on every peer
    for r in results[1:]:
        for x, y in zip(jax.tree.leaves(r["state"].global_params), jax.tree.leaves(results[0]["state"].global_params)):
            np.testing.assert_array_equal(x, y)


def test_bad_config_raises_value_error():
    tx = rj.diloco(optax.sgd(0.1), sync_every=4)

    def Fake():  # noqa: N802 - a swarm that is never asked for a round
        return rj.testing.LocalRun().swarm("p0")

    with pytest.raises(ValueError, match="eager must be True or False"):
        OuterSync(tx, Fake(), eager="yes")
    with pytest.raises(ValueError, match="overlap_steps must be >= 1 with eager=True"):
        OuterSync(tx, Fake(), overlap_steps=0, eager=True)
    with pytest.raises(ValueError, match="overlap_steps"):
        OuterSync(tx, Fake(), overlap_steps=4)
    with pytest.raises(ValueError, match="alpha"):
        OuterSync(tx, Fake(), alpha=2.0)
    with pytest.raises(ValueError, match="axis_name"):
        OuterSync(rj.diloco(optax.sgd(0.1), sync_every=4, axis_name="r"), Fake())
    with pytest.raises(TypeError, match="lacks codec, peer_id, run_id.*declare_manifest: OuterSync needs an rj.Swarm"):
        OuterSync(tx, object())
    with pytest.raises(ValueError, match="samples_per_step"):
        OuterSync(tx, Fake(), samples_per_step=0)
    with pytest.raises(ValueError, match="overlap_steps"):
        OuterSync(tx, Fake(), overlap_steps="soon")
    assert OuterSync(tx, Fake(), overlap_steps=1).max_overlap_steps is None  # a fixed tau: no cap
    # the cap of "auto": the largest tau within the staleness budget (1 %: 0.116 H),
    # below the steps between round starts
    assert OuterSync(rj.diloco(optax.sgd(0.1), sync_every=50), Fake(), overlap_steps="auto").max_overlap_steps == 5
    h500 = rj.diloco(optax.sgd(0.1), sync_every=500)
    assert OuterSync(h500, Fake(), overlap_steps="auto").max_overlap_steps == 58
    assert OuterSync(h500, Fake(), overlap_steps="auto", staleness_budget=0.02).max_overlap_steps == 138
    assert OuterSync(h500, Fake(), overlap_steps="auto", staleness_budget=0.002).max_overlap_steps == 1
    with pytest.raises(ValueError, match="staleness_budget"):
        OuterSync(h500, Fake(), overlap_steps="auto", staleness_budget=1.5)
    assert (
        OuterSync(rj.diloco(optax.sgd(0.1), sync_every=50, fragments=5), Fake(), overlap_steps="auto").max_overlap_steps
        == 5
    )
    assert OuterSync(tx, Fake(), overlap_steps="auto").max_overlap_steps == 1


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_joining_peer_downloads_state_and_matches_from_its_first_round():
    """Two peers train; a third joins mid-run: it downloads the global state from a live peer,
    contributes from the next round on, and its state digest equals the others' from its first
    round."""
    import threading
    import time

    steps, h = 40, 4
    results: dict[int, dict] = {}
    with local_swarm(3) as peers:
        started = threading.Event()

        def peer(i, swarm, delay):
            time.sleep(delay)
            tx = rj.diloco(optax.adam(2e-2), sync_every=h)
            step = _make_step(tx)
            params = _init()
            state = tx.init(params)
            with OuterSync(tx, swarm, overlap_steps=1) as sync:
                swarm.serve_state(sync.request_state)
                joined = False
                if i == 2:
                    data = swarm.fetch_state(timeout=60)
                    assert data, "no state downloaded"
                    params, state = sync.load_state_bytes(data, params, state)
                    joined = True
                start = int(state.count)
                if i == 0:
                    started.set()
                t = start
                while t < steps:  # by the peer's step: a resync moves it (to the step it downloaded)
                    params, state, _ = step(params, state, *_batch(i, t))
                    params, state = sync(params, state)
                    t = sync.step + 1
                    time.sleep(0.05)  # slow enough for the joiner to arrive mid-run
                params, state = sync.flush(params, state)
                results[i] = {
                    "start": start,
                    "joined": joined,
                    "metrics": list(sync.metrics),
                    "global": jax.device_get(state.global_params),
                }

        # p2 is registered from the start (local_swarm), but only starts training later
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(peer, 0, peers[0], 0.0), pool.submit(peer, 1, peers[1], 0.0)]
            assert started.wait(60)
            futs.append(pool.submit(peer, 2, peers[2], 1.0))
            for f in futs:
                f.result(timeout=180)
    assert results[2]["joined"] and results[2]["start"] > 0
    by_step = {i: {m.step: m.state_digest for m in results[i]["metrics"] if m.ok} for i in results}
    joiner_steps = sorted(by_step[2])
    assert joiner_steps, "the joiner took part in no round"
    # on a loaded machine (FAST timeouts) p0 or p1 may miss a round and resync: the states are
    # compared on every step where all three merged a round
    common = [s for s in joiner_steps if s in by_step[0] and s in by_step[1]]
    assert len(common) >= 3, (joiner_steps, sorted(by_step[0]), sorted(by_step[1]))
    for s in common:
        assert by_step[2][s] == by_step[0][s] == by_step[1][s], s
    for x, y in zip(jax.tree.leaves(results[2]["global"]), jax.tree.leaves(results[0]["global"])):
        np.testing.assert_array_equal(x, y)


def test_prometheus_exporter_serves_round_metrics():
    import urllib.request

    from ravnest_jax.sync import PrometheusExporter, RoundMetrics

    m = RoundMetrics(
        round=3,
        fragment=0,
        step=40,
        merged_at_step=41,
        ok=True,
        swarm_round=3,
        group_size=4,
        bytes_sent=1000,
        bytes_received=2000,
        payload_bytes=500,
        codec_ratio=0.13,
        exchange_seconds=0.5,
        stall_seconds=0.25,
        compute_utilisation=0.97,
        result_digest="x",
        state_digest="y",
    )
    with PrometheusExporter(0) as prom:
        prom(m)
        prom(m._replace(ok=False) if hasattr(m, "_replace") else __import__("dataclasses").replace(m, ok=False))
        body = urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/metrics", timeout=10).read().decode()
    assert "ravnest_rounds_total 1.0" in body
    assert "ravnest_failed_rounds_total 1.0" in body
    assert "ravnest_bytes_sent_total 1000.0" in body
    assert "ravnest_group_size 4.0" in body
    assert "ravnest_compute_utilisation 0.97" in body


def test_a_contribution_weighs_the_samples_since_the_peers_last_round():
    """A round's weight is ``samples_per_step`` times the inner steps since this peer's last
    round of that fragment (a peer that joined mid-way or restarted weighs what it trained)."""
    from ravnest_jax.sync._schedule import Schedule

    tx = rj.diloco(optax.sgd(0.1), sync_every=4, fragments=2)
    sched = Schedule(tx, 1, 1, 16.0)
    sched.restart(2)  # resumed at step 2
    weights = [(f, step, sched.plan(f, step, 0.0).weight) for step in range(3, 13) for f in tx.due_fragments(step)]
    # fragment 0 at steps 4, 8, 12; fragment 1 at 6, 10 (offset 2): the first of each counts from step 2
    assert weights == [(0, 4, 32.0), (1, 6, 64.0), (0, 8, 64.0), (1, 10, 64.0), (0, 12, 64.0)], weights


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_auto_overlap_hides_the_exchange_and_keeps_the_state_identical():
    """overlap_steps="auto": each peer picks tau from its own exchange and step times (here
    5 ms steps, so a round on loopback takes several). Peer 0 caps tau at 9, peer 1 at 2, so the two merge
    at different steps; still every round's global state is identical. Once a round has been
    measured, peer 0 covers the exchange with its steps and rarely waits."""
    import time

    results = {}
    with local_swarm(2, codec="int4", timeouts=PATIENT) as peers:

        def peer(i, swarm, cap):
            tx = rj.diloco(optax.adam(2e-2), sync_every=10)
            step = _make_step(tx)
            params = _init()
            state = tx.init(params)
            # the staleness budget whose cap is ``cap`` at H = 10
            budget = STALENESS_COST[0] + STALENESS_COST[1] * (cap + 0.01) / 10
            with OuterSync(tx, swarm, overlap_steps="auto", staleness_budget=budget) as sync:
                assert sync.max_overlap_steps == cap, (budget, sync.max_overlap_steps)
                jax.block_until_ready(step(params, state, *_batch(i, 0)))  # compile outside the clock
                sync.warmup(params, state)
                for t in range(70):
                    params, state, _ = step(params, state, *_batch(i, t))
                    jax.block_until_ready(params)
                    time.sleep(0.005)
                    params, state = sync(params, state)
                params, state = sync.flush(params, state)
                results[i] = {"metrics": list(sync.metrics), "global": jax.device_get(state.global_params)}

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(peer, 0, peers[0], 9), pool.submit(peer, 1, peers[1], 2)]
            for f in futs:
                f.result(timeout=150)
    a, b = results[0]["metrics"], results[1]["metrics"]
    assert len(a) == len(b) == 7 and all(m.ok for m in a + b)
    assert [m.state_digest for m in a] == [m.state_digest for m in b]
    for x, y in zip(jax.tree.leaves(results[0]["global"]), jax.tree.leaves(results[1]["global"])):
        np.testing.assert_array_equal(x, y)
    a, b = a[:-1], b[:-1]  # the last round is merged by flush() at its boundary
    for m in a + b:
        assert m.overlap_steps == m.merged_at_step - m.step
    assert a[0].overlap_steps == b[0].overlap_steps == 1  # nothing measured yet
    assert all(1 <= m.overlap_steps <= 9 for m in a) and all(1 <= m.overlap_steps <= 2 for m in b)
    # what a round would have needed, reported uncapped: peer 1's cap of 2 binds where peer 0
    # needed more than 2 (the same loopback exchange, the same step time)
    assert all(m.needed_overlap_steps >= m.overlap_steps for m in a[1:] + b[1:]), (a, b)
    assert any(m.needed_overlap_steps > 2 for m in b[1:]), [m.needed_overlap_steps for m in b]
    taus = [m.overlap_steps for m in a[1:]]
    assert min(taus) >= 2 and any(t > 2 for t in taus), taus  # a round takes several 5 ms steps
    # covered: the training loop waited for far less than the exchanges took
    assert sum(m.stall_seconds for m in a[2:]) < 0.5 * sum(m.exchange_seconds for m in a[2:]), (
        [round(m.stall_seconds, 3) for m in a],
        [round(m.exchange_seconds, 3) for m in a],
    )


@pytest.mark.timeout(180)
def test_a_diverged_peer_is_left_out_and_resyncs():
    """Each round the peers send the digest of their global state after the previous round;
    the rendezvous compares them. Peer 2's global params are corrupted in memory after a merge:
    the next merge gives it another digest, the round after that leaves its contribution out
    and fails on it, and it downloads the state from a live peer; from then on it agrees."""
    import time

    tx, step = _tx_and_step((("sync_every", 4),))

    def peer(i, swarm):
        params = _init()
        state = tx.init(params)
        with OuterSync(tx, swarm, overlap_steps=1) as sync:
            for t in range(40):
                params, state, _ = step(params, state, *_batch(i, t))
                time.sleep(0.01)
                params, state = sync(params, state)
                if i == 2 and t == 9:  # a bit flip in the anchor (global params), after round 1 merged
                    g = dict(state.global_params)
                    g["b1"] = g["b1"].at[0].add(1e-3)
                    state = state._replace(global_params=g)
            params, state = sync.flush(params, state)
            return {"metrics": list(sync.metrics), "resyncs": sync.resyncs}

    with _in_process(3) as peers:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            res = [f.result(timeout=150) for f in [pool.submit(peer, i, s) for i, s in enumerate(peers)]]
    bad = res[2]["metrics"]
    log = [(m.round, m.swarm_round, m.ok, m.error) for m in bad]
    first = next(m for m in bad if not m.ok)
    assert "diverged" in first.error and first.round == 3, log  # found in the round after the bad merge
    assert res[2]["resyncs"] >= 1
    # the others completed every round; the one that found the divergence left peer 2 out
    for r in res[:2]:
        assert all(m.ok for m in r["metrics"])
        assert next(m for m in r["metrics"] if m.round == first.round).group_size == 2
        assert all(m.group_size == 3 for m in r["metrics"] if m.round < first.round)
    assert [m.state_digest for m in res[0]["metrics"]] == [m.state_digest for m in res[1]["metrics"]]
    # after its resync, every round peer 2 completes has the swarm's state again
    ref = {m.swarm_round: m.state_digest for m in res[0]["metrics"]}
    after = [m for m in bad if m.ok and m.round > first.round]
    assert len(after) >= 2, log
    assert all(m.state_digest == ref[m.swarm_round] for m in after), log


def test_served_state_is_the_state_of_the_step_it_was_asked_at():
    """The state message is built in a worker thread that may run after the training thread
    has moved on (here: started another round): its step, round counter and round mapping are
    all those of the moment it was served (a round counter read later paired the state of step
    s with the counter of step s + 1, and a joiner then fed a pseudo-gradient against a stale
    anchor into the wrong round)."""
    import threading

    from flax import serialization

    def Fake():  # noqa: N802 - a swarm that is never asked for a round
        return rj.testing.LocalRun().swarm("p0")

    tx = rj.diloco(optax.sgd(0.1), sync_every=4)
    params = _init()
    state = tx.init(params)
    with OuterSync(tx, Fake(), overlap_steps=1) as sync:
        sync.step, sync._schedule.rounds_started, sync._schedule.swarm_base = 29, 5, (3, 0)
        gate = threading.Event()
        sync._server._pool.submit(gate.wait, 10)  # the worker is busy ...
        fut = sync.request_state()
        sync._serve_state(params, state)
        sync.step, sync._schedule.rounds_started, sync._schedule.swarm_base = 30, 6, (4, 1)  # ... training goes on
        gate.set()
        d = serialization.msgpack_restore(fut.result(timeout=10))
    assert (int(d["step"]), int(d["rounds_started"])) == (29, 5)
    base = d["swarm_base"]
    assert [int(x) for x in (base.values() if isinstance(base, dict) else base)] == [3, 0]


@pytest.mark.timeout(180)
def test_sparse_rounds_with_decayed_error_feedback_stay_consistent():
    """SparseLoCo-style rounds over the real swarm (topk codec, error feedback with decay 0.9,
    outer plain SGD): every peer agrees on every round's state, and the anchor moved."""
    tx_kwargs = dict(sync_every=4, outer=rj.default_outer(1.0, 0.0))
    sync_kwargs = dict(overlap_steps=1)
    codec = rj.Codec("topk", error_feedback_decay=0.9)
    results = _run_swarm(3, steps=16, codec=codec, tx_kwargs=tx_kwargs, sync_kwargs=sync_kwargs)
    _assert_digests_agree(results, 4)
    moved = [
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(results[0]["state"].global_params), jax.tree.leaves(_init()))
    ]
    assert max(moved) > 0, moved
    assert all(r["summary"]["failed_rounds"] == 0 for r in results)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("eager,tau", [(False, 1), (True, 2)])
def test_a_donating_merge_gives_the_same_rounds_bit_for_bit(eager, tau):
    """OuterSync(donate=True): the merge reuses the buffers of the params and state it is given;
    the rounds, the global state and the params are exactly those of the merge that does not."""
    common = dict(steps=12, tx_kwargs=dict(sync_every=4))
    plain = _run_swarm(3, sync_kwargs=dict(eager=eager, overlap_steps=tau), **common)
    donated = _run_swarm(3, sync_kwargs=dict(eager=eager, overlap_steps=tau, donate=True), **common)
    _assert_digests_agree(donated, 3)
    for a, b in zip(plain, donated):
        assert [m.state_digest for m in a["metrics"]] == [m.state_digest for m in b["metrics"]]
        for x, y in zip(jax.tree.leaves((a["params"], a["state"])), jax.tree.leaves((b["params"], b["state"]))):
            np.testing.assert_array_equal(x, y)


def test_the_donating_merge_reuses_the_buffers_of_params_and_state():
    """XLA's plan of the merge: with donate=True its params and state outputs alias the inputs
    (no new buffers of their size), and the arrays passed in are deleted."""
    from ravnest_jax.sync._pipeline import RoundFunctions

    tx = rj.diloco(optax.adam(1e-3), sync_every=4)
    params = {"w": jnp.ones((256, 64), jnp.float32), "b": jnp.zeros(64, jnp.float32)}
    state = tx.init(params)
    nbytes = sum(x.nbytes for x in jax.tree.leaves((params, state)) if x.dtype == jnp.float32)
    outs = {}
    for donate in (False, True):
        fns = RoundFunctions(tx, "fp32", {}, True, donate=donate)
        p, s = jax.tree.map(jnp.copy, (params, state))
        snap, packed, _ = fns.start(0, None)(p, s, None, jax.random.key(0))
        mean = list(jax.tree.leaves(snap.pseudo_gradient))
        merge = fns.merge(0, None)
        plan = merge.lower(p, s, mean, snap, 0.0).compile().memory_analysis()
        outs[donate] = merge(p, s, mean, snap, 0.0)
        if donate:
            assert plan.alias_size_in_bytes >= nbytes, (plan.alias_size_in_bytes, nbytes)
            assert all(x.is_deleted() for x in jax.tree.leaves(p)), "the donated params are still alive"
        else:
            assert plan.alias_size_in_bytes == 0 and not any(x.is_deleted() for x in jax.tree.leaves(p))
    for x, y in zip(jax.tree.leaves(outs[False]), jax.tree.leaves(outs[True])):
        np.testing.assert_array_equal(x, y)
