"""rj.diloco's round functions, the device digest and the device-side encode on arrays laid out
over 4 local devices: bit-identical to one device, and the layouts are kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import ravnest_jax as rj
from ravnest_jax import compress
from ravnest_jax.sync import device_digest, digest_hex

from ._model import init_params, mesh, param_shardings, place

CASES = [(layout, t) for layout in ("replicated", "fsdp") for t in (AxisType.Explicit, AxisType.Auto)]
IDS = [f"{layout}-{'explicit' if t == AxisType.Explicit else 'auto'}" for layout, t in CASES]


def _local(params, k):
    """Some local params a few steps away from the anchor."""
    return jax.tree.map(
        lambda x: x + 0.01 * jax.random.normal(jax.random.fold_in(jax.random.key(k), x.size), x.shape), params
    )


@pytest.mark.parametrize("layout,axis_type", CASES, ids=IDS)
def test_round_functions_are_layout_independent_and_keep_shardings(layout, axis_type):
    tx = rj.diloco(optax.adam(1e-2), sync_every=4)
    m = mesh(axis_type)
    sh = param_shardings(m, layout, init_params())
    p0 = init_params()
    state0 = tx.init(p0)
    local0, later0 = _local(p0, 1), _local(p0, 2)
    ps, local_s, later_s = (place(t, sh) for t in (p0, local0, later0))
    state_s = tx.init(ps)

    def two_rounds(state, local, later):
        snap = tx.round_start(local, state)
        mean = jax.tree.map(lambda g: 0.5 * g, snap.pseudo_gradient)
        params, state = tx.round_merge(later, state, mean, snap, alpha=0.25)
        snap = tx.round_start(params, state)
        state = tx.outer_step(state, snap.pseudo_gradient)
        return snap, params, state

    ref = jax.device_get(jax.jit(two_rounds)(state0, local0, later0))
    got = jax.jit(two_rounds)(state_s, local_s, later_s)
    snap, params, state = got
    for tree in (snap.pseudo_gradient, snap.params, params, state.global_params, state.outer_state[0].trace):
        assert jax.tree.map(lambda x: x.sharding, tree) == sh
    for a, b in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(a, b)
    assert int(state.rounds) == 2


@pytest.mark.parametrize("layout,axis_type", CASES, ids=IDS)
def test_digest_is_layout_independent(layout, axis_type):
    """Integer wrap-around sums over bitcast uint32 lanes: the same on 1 device and on 4 in
    any layout, whatever order XLA adds the shards' partial sums in."""
    tree = {"p": init_params(), "t": jnp.arange(12.0).reshape(4, 3).astype(jnp.bfloat16)}
    m = mesh(axis_type)
    sh = {"p": param_shardings(m, layout, tree["p"]), "t": param_shardings(m, layout, {"t": tree["t"]})["t"]}
    placed = place(tree, sh)
    one = digest_hex(device_digest(tree))
    assert digest_hex(device_digest(placed)) == one
    assert digest_hex(jax.jit(device_digest)(placed)) == one
    changed = place(dict(tree, t=tree["t"].at[3, 2].add(1)), sh)
    assert digest_hex(device_digest(changed)) != one


@pytest.mark.parametrize("codec", ["int4", "topk", "fp32"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_device_encode_of_sharded_leaves(codec, axis_type):
    """FSDP-sharded leaves: the same bytes as on one device, the residual keeps the layout and
    the large packed parts stay spread over the 4 devices (no device holds them whole)."""
    m = mesh(axis_type)
    k = jax.random.key(3)
    tree = {"a": jax.random.normal(k, (64, 32)), "b": jax.random.normal(jax.random.fold_in(k, 1), (256,))}
    sh = param_shardings(m, "fsdp", tree)
    res = jax.tree.map(lambda x: jnp.full(x.shape, 1e-3, jnp.float32), tree)
    enc = jax.jit(lambda t, r: compress.device_encode(t, codec, residual=r))
    packed1, res1 = enc(tree, res)
    packed4, res4 = enc(place(tree, sh), place(res, sh))
    assert compress.packed_to_bytes(jax.device_get(packed4)) == compress.packed_to_bytes(jax.device_get(packed1))
    for a, b in zip(jax.tree.leaves(jax.device_get(res4)), jax.tree.leaves(res1)):
        np.testing.assert_array_equal(a, b)
    if axis_type == AxisType.Explicit:  # on an automatic mesh XLA picks the output layouts
        assert jax.tree.map(lambda x: x.sharding, res4) == sh
        if codec != "topk":  # top-k is a sort over the whole leaf: its few outputs are replicated
            codes = [x for x in jax.tree.leaves(packed4) if x.ndim == 1 and x.size >= 256]
            assert codes and all(x.sharding.spec == P("data") for x in codes)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_round_start_moves_no_pseudo_gradient_between_devices(axis_type):
    """OuterSync's jitted round start (pseudo-gradient + int4 encode with error feedback) on FSDP
    params: the compiled program's only collectives carry a few scalars (finite flags) and the
    2 scales of the one leaf smaller than 4 blocks; no pseudo-gradient data moves between
    devices, and the packed parts of the large leaves come out spread over the 4 devices."""
    import re

    from ravnest_jax.sync._outer_sync import OuterSync
    from ravnest_jax.sync._pipeline import layout_of

    m = mesh(axis_type)
    k = jax.random.key(0)
    params = {"w1": jax.random.normal(k, (256, 128)), "b1": jnp.zeros(128), "w2": jax.random.normal(k, (128, 64))}
    params = place(params, param_shardings(m, "fsdp", params))
    tx = rj.diloco(optax.adam(1e-2), sync_every=2)
    state = tx.init(params)
    sync = OuterSync(tx, rj.testing.LocalRun("int4").swarm("p0"))  # only the start is compiled
    start = sync._fns.start(0, layout_of(params, state))
    residual = [jax.device_put(jnp.zeros(x.shape, jnp.float32), x.sharding) for x in jax.tree.leaves(params)]
    hlo = start.lower(params, state, residual, jax.random.key(1)).compile().as_text()
    moved = re.findall(
        r"= \w+\[([\d,]*)\]\S* (?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(", hlo
    )
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in moved]
    assert sizes and max(sizes) <= 2, sizes
    _, packed, new_res = start(params, state, residual, jax.random.key(1))
    big = [x for x in jax.tree.leaves(packed) if x.size >= 512]
    assert len(big) == 3 and all(x.sharding.spec == P("data") for x in big)
    assert [x.sharding for x in new_res] == [x.sharding for x in jax.tree.leaves(params)]
    sync.close()
