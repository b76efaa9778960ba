"""rj.diloco inside flax nnx, flax linen TrainState and plain pytrees: train a few steps, hit
the outer step, loss goes down."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import ravnest_jax as rj

N, H, STEPS = 2, 3, 7


def _data():
    k1, k2 = jax.random.split(jax.random.key(1))
    x = jax.random.normal(k1, (N, 32, 4))
    w = jnp.arange(8.0).reshape(4, 2) / 8
    y = jnp.tanh(x @ w) + 0.01 * jax.random.normal(k2, (N, 32, 2))
    return x, y


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_nnx_optimizer_vmapped_replicas():
    x, y = _data()
    model = NnxMLP(nnx.Rngs(0))
    tx = rj.diloco(optax.adam(1e-2), sync_every=H, axis_name="replica")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    vstep = jax.jit(jax.vmap(step, axis_name="replica"))
    states = rj.replicate(state, N)
    losses = []
    for _ in range(STEPS):
        states, loss = vstep(states, x, y)
        losses.append(float(loss.mean()))
    model, optimizer = nnx.merge(graphdef, rj.unreplicate(states))
    dstate = optimizer.opt_state
    assert int(dstate.rounds[...]) == STEPS // H
    assert int(dstate.count[...]) == STEPS
    assert losses[-1] < losses[0]
    # after the round at step 6 the replicas agreed; step 7 moved them apart again
    assert int(jax.tree.leaves(states)[0].shape[0]) == N


@pytest.mark.integration  # compiles a vmapped linen step: ~5 s
def test_linen_train_state_vmapped_replicas():
    x, y = _data()

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(nn.Dense(16)(x)))

    model = MLP()
    params = model.init(jax.random.key(0), x[0])["params"]
    tx = rj.diloco(optax.adam(1e-2), sync_every=H, axis_name="replica")
    ts = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(ts, x, y):
        def loss_fn(p):
            return jnp.mean((ts.apply_fn({"params": p}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(ts.params)
        return ts.apply_gradients(grads=grads), loss

    vstep = jax.jit(jax.vmap(step, axis_name="replica"))
    tss = rj.replicate(ts, N)
    losses = []
    for t in range(1, STEPS + 1):
        tss, loss = vstep(tss, x, y)
        losses.append(float(loss.mean()))
        if t % H == 0:  # right after a round all replicas hold the anchor
            for leaf in jax.tree.leaves(tss.params):
                np.testing.assert_allclose(leaf[0], leaf[1], rtol=1e-6, atol=1e-7)
    assert int(tss.opt_state.rounds[0]) == STEPS // H
    assert losses[-1] < losses[0]


def test_plain_pytree_host_driven_rounds():
    """axis_name=None: update takes inner steps only; round_start/round_merge do the round."""
    x, y = _data()
    params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros((2,))}
    tx = rj.diloco(optax.adam(1e-2), sync_every=H)

    @jax.jit
    def step(params, state, x, y):
        def loss_fn(p):
            return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    start, merge = jax.jit(tx.round_start), jax.jit(tx.round_merge)
    state = tx.init(params)
    losses = []
    for t in range(1, STEPS + 1):
        params, state, loss = step(params, state, x[0], y[0])
        losses.append(float(loss))
        if t % H == 0:
            snap = start(params, state)
            params, state = merge(params, state, snap.pseudo_gradient, snap)
    assert int(state.rounds) == STEPS // H and int(state.count) == STEPS
    assert losses[-1] < losses[0]
