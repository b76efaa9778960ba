"""Exactness tests of rj.diloco (arXiv 2311.08105) in float32.

Tolerances: float32 arithmetic of the outer step (``g - 1.0 * (g - l)``) differs from ``l`` by
rounding only, so comparisons use ``rtol=1e-5, atol=1e-6`` unless a test says "exact".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import ravnest_jax as rj

RTOL, ATOL = 1e-5, 1e-6


def _problem(seed=0, n_data=4, dim=8):
    """A small least-squares problem: params {w: (dim, 2), b: (2,)}, data per replica."""
    k = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(k, 3)
    params = {"w": jax.random.normal(k1, (dim, 2)) * 0.1, "b": jnp.zeros((2,))}
    xs = jax.random.normal(k2, (n_data, 16, dim))
    ys = jax.random.normal(k3, (n_data, 16, 2))
    return params, xs, ys


def _loss(params, x, y):
    pred = x @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2)


def _step(tx):
    def step(params, state, x, y):
        grads = jax.grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _assert_tree_close(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True, None])
def test_bad_sync_every_raises(bad):
    with pytest.raises(ValueError, match="sync_every"):
        rj.diloco(optax.sgd(0.1), sync_every=bad)


def test_bad_optimizers_raise():
    with pytest.raises(ValueError, match="inner"):
        rj.diloco(object(), sync_every=2)
    with pytest.raises(ValueError, match="outer"):
        rj.diloco(optax.sgd(0.1), object(), sync_every=2)


def test_update_requires_params():
    tx = rj.diloco(optax.sgd(0.1), sync_every=2)
    params, _, _ = _problem()
    with pytest.raises(ValueError, match="params"):
        tx.update(params, tx.init(params))


def test_default_outer_is_nesterov_07_09():
    params, xs, ys = _problem()
    g = jax.tree.map(jnp.ones_like, params)
    ref = optax.sgd(0.7, momentum=0.9, nesterov=True)
    u_ref, _ = ref.update(g, ref.init(params), params)
    outer = rj.diloco(optax.sgd(0.1), sync_every=1).outer
    u, _ = outer.update(g, outer.init(params), params)
    _assert_tree_close(u, u_ref, rtol=0, atol=0)


def test_init_does_not_alias_params():
    params = {"w": jnp.ones((4,))}
    state = rj.diloco(optax.sgd(0.1), sync_every=2).init(params)
    assert state.global_params["w"] is not params["w"]
    assert state.global_params["w"].unsafe_buffer_pointer() != params["w"].unsafe_buffer_pointer()


@pytest.mark.parametrize("sync_every", [1, 3, 7])
def test_one_replica_outer_sgd1_equals_inner_alone(sync_every):
    """(a) 1 replica, outer sgd(1.0): same params as the inner optimizer alone, for any H."""
    params, xs, ys = _problem(n_data=1)
    inner = optax.adam(1e-2)
    tx = rj.diloco(inner, optax.sgd(1.0), sync_every=sync_every, axis_name="replica")
    step = jax.jit(jax.vmap(_step(tx), in_axes=(0, 0, None, None), axis_name="replica"))
    ref_step = jax.jit(_step(inner))
    p = rj.replicate(params, 1)
    s = rj.replicate(tx.init(params), 1)
    p_ref, s_ref = params, inner.init(params)
    for _ in range(3 * sync_every + 1):
        p, s = step(p, s, xs[0], ys[0])
        p_ref, s_ref = ref_step(p_ref, s_ref, xs[0], ys[0])
    _assert_tree_close(rj.unreplicate(p), p_ref)
    assert int(rj.unreplicate(s).rounds) == (3 * sync_every + 1) // sync_every


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize("n", [2, 4])
def test_h1_sgd_equals_data_parallel_sgd(n):
    """(b) N replicas, H=1, inner sgd(lr), outer sgd(1.0) == synchronous DP SGD on mean grad."""
    params, xs, ys = _problem(n_data=n)
    lr = 0.05
    tx = rj.diloco(optax.sgd(lr), optax.sgd(1.0), sync_every=1, axis_name="replica")
    step = jax.jit(jax.vmap(_step(tx), axis_name="replica"))
    p = rj.replicate(params, n)
    s = rj.replicate(tx.init(params), n)

    @jax.jit
    def dp_step(params):
        grads = jax.vmap(jax.grad(_loss), in_axes=(None, 0, 0))(params, xs, ys)
        mean = jax.tree.map(lambda g: g.mean(0), grads)
        return jax.tree.map(lambda w, g: w - lr * g, params, mean)

    p_ref = params
    for _ in range(5):
        p, s = step(p, s, xs, ys)
        p_ref = dp_step(p_ref)
    for i in range(n):
        _assert_tree_close(rj.unreplicate(p, i), p_ref)


def test_outer_step_fires_exactly_at_multiples_of_h():
    """(c) rounds increments exactly at steps H, 2H, ...; between them params are local."""
    h, n = 4, 2
    params, xs, ys = _problem(n_data=n)
    tx = rj.diloco(optax.sgd(0.1), sync_every=h, axis_name="replica")
    step = jax.jit(jax.vmap(_step(tx), axis_name="replica"))
    p = rj.replicate(params, n)
    s = rj.replicate(tx.init(params), n)
    for t in range(1, 3 * h + 1):
        g_before = s.global_params
        p, s = step(p, s, xs, ys)
        rounds = int(s.rounds[0])
        assert rounds == t // h, (t, rounds)
        changed = not all(
            np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g_before), jax.tree.leaves(s.global_params))
        )
        assert changed == (t % h == 0), t
        replicas_agree = all(np.allclose(x[0], x[1]) for x in jax.tree.leaves(p))
        # replicas see different data: they agree only right after a round
        assert replicas_agree == (t % h == 0), t
        if t % h == 0:
            _assert_tree_close(p, s.global_params)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_vmap_equals_shard_map():
    """(d) the same math under vmap and under shard_map over 4 CPU devices."""
    n, h = 4, 3
    assert jax.device_count() >= n, "conftest forces 4 CPU devices"
    params, xs, ys = _problem(n_data=n)
    tx = rj.diloco(optax.adamw(1e-2), sync_every=h, axis_name="replica")
    p0 = rj.replicate(params, n)
    s0 = rj.replicate(tx.init(params), n)

    vstep = jax.jit(jax.vmap(_step(tx), axis_name="replica"))

    mesh = Mesh(np.array(jax.devices()[:n]), ("replica",))

    def per_device(p, s, x, y):
        # each shard holds one replica with a leading axis of size 1
        p, s, x, y = jax.tree.map(lambda a: a[0], (p, s, x, y))
        p, s = _step(tx)(p, s, x, y)
        return jax.tree.map(lambda a: a[None], (p, s))

    sstep = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("replica"), out_specs=P("replica")))
    pv, sv = p0, s0
    ps, ss = p0, s0
    for _ in range(2 * h + 1):
        pv, sv = vstep(pv, sv, xs, ys)
        ps, ss = sstep(ps, ss, xs, ys)
    _assert_tree_close(pv, ps)
    _assert_tree_close(sv.global_params, ss.global_params)
    assert int(ss.rounds[0]) == 2


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_host_driven_rounds_equal_axis_name_rounds():
    """axis_name=None + round_start/round_merge (tau=0) reproduces the in-process rounds."""
    n, h = 3, 2
    params, xs, ys = _problem(n_data=n)
    inner = optax.adamw(1e-2)
    tx_sim = rj.diloco(inner, sync_every=h, axis_name="replica")
    tx_host = rj.diloco(inner, sync_every=h)
    vstep = jax.jit(jax.vmap(_step(tx_sim), axis_name="replica"))
    hstep = jax.jit(jax.vmap(_step(tx_host)))
    start = jax.jit(jax.vmap(tx_host.round_start))
    merge = jax.jit(jax.vmap(tx_host.round_merge, in_axes=(0, 0, None, 0)))
    pv, sv = rj.replicate(params, n), rj.replicate(tx_sim.init(params), n)
    ph, sh = rj.replicate(params, n), rj.replicate(tx_host.init(params), n)
    for t in range(1, 2 * h + 1):
        pv, sv = vstep(pv, sv, xs, ys)
        ph, sh = hstep(ph, sh, xs, ys)
        assert int(sh.rounds[0]) == 0 or t > h
        if t % h == 0:
            snap = start(ph, sh)
            mean = jax.tree.map(lambda d: d.mean(0), snap.pseudo_gradient)
            ph, sh = merge(ph, sh, mean, snap)
    _assert_tree_close(ph, pv)
    _assert_tree_close(sh.global_params, sv.global_params)
    _assert_tree_close(sh.outer_state, sv.outer_state)


def test_round_merge_tau0_is_exactly_the_anchor_and_keeps_progress():
    params, xs, ys = _problem(n_data=1)
    tx = rj.diloco(optax.sgd(0.1), sync_every=2)
    step = jax.jit(_step(tx))
    p, s = params, tx.init(params)
    p, s = step(p, s, xs[0], ys[0])
    p, s = step(p, s, xs[0], ys[0])
    snap = jax.jit(tx.round_start)(p, s)
    merge = jax.jit(tx.round_merge)
    # tau = 0: merged params are bit-for-bit the new anchor
    p0, s0 = merge(p, s, snap.pseudo_gradient, snap)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(s0.global_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(s0.rounds) == 1
    # tau = 1: the local step taken since the snapshot is kept on top of the anchor
    p1, s1 = step(p, s, xs[0], ys[0])
    p1m, s1m = merge(p1, s1, snap.pseudo_gradient, snap)
    expected = jax.tree.map(lambda g, a, b: g + (a - b), s1m.global_params, p1, snap.params)
    _assert_tree_close(p1m, expected, rtol=0, atol=0)
    # alpha = 1 ignores the round for the local params
    pa, _ = jax.jit(functools.partial(tx.round_merge, alpha=1.0))(p1, s1, snap.pseudo_gradient, snap)
    _assert_tree_close(pa, p1, rtol=0, atol=0)
    with pytest.raises(ValueError, match="alpha"):
        tx.round_merge(p1, s1, snap.pseudo_gradient, snap, alpha=1.5)


def test_inner_state_kept_across_rounds():
    params, xs, ys = _problem(n_data=2)
    tx = rj.diloco(optax.adam(1e-2), sync_every=2, axis_name="replica")
    step = jax.jit(jax.vmap(_step(tx), axis_name="replica"))
    p, s = rj.replicate(params, 2), rj.replicate(tx.init(params), 2)
    for _ in range(4):
        p, s = step(p, s, xs, ys)
    adam_count = s.inner_state[0].count
    np.testing.assert_array_equal(np.asarray(adam_count), [4, 4])
    assert np.asarray(s.count).tolist() == [4, 4]


def test_no_recompilation_across_rounds():
    params, xs, ys = _problem(n_data=2)
    tx = rj.diloco(optax.adamw(1e-2), sync_every=2, axis_name="replica")
    step = jax.jit(jax.vmap(_step(tx), axis_name="replica"))
    p, s = rj.replicate(params, 2), rj.replicate(tx.init(params), 2)
    p, s = step(p, s, xs, ys)
    before = step._cache_size()
    for _ in range(6):
        p, s = step(p, s, xs, ys)
    assert step._cache_size() == before == 1


class _SignCodec:
    """A toy SimulatedCodec: keeps only the sign times the mean magnitude (tests the hook)."""

    def init(self, params):
        return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def compress(self, delta, state, key):
        def q(d, r):
            x = d + r
            y = jnp.sign(x) * jnp.mean(jnp.abs(x))
            return y, x - y

        out = jax.tree.map(q, delta, state)
        return (
            jax.tree.map(lambda t: t[0], out, is_leaf=lambda t: isinstance(t, tuple)),
            jax.tree.map(lambda t: t[1], out, is_leaf=lambda t: isinstance(t, tuple)),
        )

    def requantize(self, mean, key):
        return mean


def test_simulated_codec_hook_is_applied_and_keeps_state():
    params, xs, ys = _problem(n_data=2)
    tx = rj.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, axis_name="replica", codec=_SignCodec())
    plain = rj.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, axis_name="replica")
    step = jax.jit(jax.vmap(_step(tx), axis_name="replica"))
    pstep = jax.jit(jax.vmap(_step(plain), axis_name="replica"))
    p, s = rj.replicate(params, 2), rj.replicate(tx.init(params), 2)
    pp, ps = rj.replicate(params, 2), rj.replicate(plain.init(params), 2)
    for _ in range(2):
        p, s = step(p, s, xs, ys)
        pp, ps = pstep(pp, ps, xs, ys)
    # the codec changed the outcome and left a non-zero residual
    assert not np.allclose(np.asarray(p["w"]), np.asarray(pp["w"]))
    assert float(jnp.abs(s.codec_state["w"]).sum()) > 0
    with pytest.raises(ValueError, match="codec"):
        rj.diloco(optax.sgd(0.1), sync_every=2, codec=_SignCodec())
    with pytest.raises(ValueError, match="codec"):
        rj.diloco(optax.sgd(0.1), sync_every=2, axis_name="r", codec=object())


def _multi_leaf_problem(n_data=2):
    k = jax.random.key(3)
    ks = jax.random.split(k, 6)
    params = {f"w{i}": jax.random.normal(ks[i], (4, 4)) * 0.2 for i in range(4)}
    xs = jax.random.normal(ks[4], (n_data, 8, 4))
    ys = jax.random.normal(ks[5], (n_data, 8, 4))
    return params, xs, ys


def _deep_loss(params, x, y):
    h = x
    for i in range(4):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - y) ** 2)


def _deep_step(tx):
    def step(params, state, x, y):
        grads = jax.grad(_deep_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def test_fragment_schedule_and_validation():
    tx = rj.diloco(optax.sgd(0.1), sync_every=4, fragments=2)
    assert [tx.fragment_offset(f) for f in range(2)] == [0, 2]
    assert tx.fragment_leaf_ids(1, 5) == (1, 3)
    due = {t: tx.due_fragments(t) for t in range(1, 13)}
    assert due[4] == (0,) and due[6] == (1,) and due[8] == (0,) and due[10] == (1,)
    assert due[2] == () and due[5] == ()
    with pytest.raises(ValueError, match="fragments"):
        rj.diloco(optax.sgd(0.1), sync_every=2, fragments=3)
    with pytest.raises(ValueError, match="fragments"):
        rj.diloco(optax.sgd(0.1), sync_every=2, fragments=0)
    params, _, _ = _multi_leaf_problem()
    state = tx.init(params)
    assert isinstance(state.outer_state, tuple) and len(state.outer_state) == 2
    with pytest.raises(ValueError, match="fragment"):
        tx.round_start(params, state)  # fragment required with F > 1
    with pytest.raises(ValueError, match="fragment"):
        tx.round_start(params, state, fragment=2)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_fragments_axis_mode_equals_host_driven_and_touch_only_their_leaves():
    n, h, f_count = 2, 4, 2
    params, xs, ys = _multi_leaf_problem(n)
    inner = optax.adam(1e-2)
    tx_sim = rj.diloco(inner, sync_every=h, axis_name="replica", fragments=f_count)
    tx_host = rj.diloco(inner, sync_every=h, fragments=f_count)
    vstep = jax.jit(jax.vmap(_deep_step(tx_sim), axis_name="replica"))
    hstep = jax.jit(jax.vmap(_deep_step(tx_host)))
    pv, sv = rj.replicate(params, n), rj.replicate(tx_sim.init(params), n)
    ph, sh = rj.replicate(params, n), rj.replicate(tx_host.init(params), n)
    names = sorted(params)  # jax.tree.leaves order of a dict
    for t in range(1, 3 * h + 1):
        g_before = dict(sv.global_params)
        pv, sv = vstep(pv, sv, xs, ys)
        ph, sh = hstep(ph, sh, xs, ys)
        due = tx_host.due_fragments(t)
        for f in due:
            start = jax.jit(jax.vmap(functools.partial(tx_host.round_start, fragment=f)))
            merge = jax.jit(jax.vmap(functools.partial(tx_host.round_merge, fragment=f), in_axes=(0, 0, None, 0)))
            snap = start(ph, sh)
            mean = jax.tree.map(lambda d: d.mean(0), snap.pseudo_gradient)
            ph, sh = merge(ph, sh, mean, snap)
        for i, name in enumerate(names):
            changed = not np.array_equal(g_before[name], sv.global_params[name])
            assert changed == ((i % f_count) in due), (t, name)
    _assert_tree_close(ph, pv)
    _assert_tree_close(sh.global_params, sv.global_params)
    assert int(sv.rounds[0]) == int(sh.rounds[0]) == 5  # fragment 0 at 4, 8, 12; fragment 1 at 6, 10


def test_default_outer_is_nesterov_and_takes_its_two_knobs():
    g = {"w": jnp.asarray([1.0, -2.0, 0.5])}
    p = {"w": jnp.zeros(3)}

    def two_updates(tx):
        s = tx.init(p)
        u1, s = tx.update(g, s, p)
        u2, _ = tx.update(g, s, p)
        return np.asarray(u1["w"]), np.asarray(u2["w"])

    for kw, want in (
        ({}, optax.sgd(0.7, momentum=0.9, nesterov=True)),
        ({"momentum": 0.8}, optax.sgd(0.7, momentum=0.8, nesterov=True)),
        ({"learning_rate": 1.0, "momentum": 0.0}, optax.sgd(1.0)),
    ):
        for a, b in zip(two_updates(rj.default_outer(**kw)), two_updates(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=str(kw))
    # plain SGD with learning rate 1: the outer step is the mean pseudo-gradient itself
    np.testing.assert_allclose(two_updates(rj.default_outer(1.0, 0.0))[1], -np.asarray(g["w"]))
    for bad in ({"learning_rate": 0.0}, {"learning_rate": True}, {"momentum": 1.0}, {"momentum": -0.1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            rj.default_outer(**bad)
