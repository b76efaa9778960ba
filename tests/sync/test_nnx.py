"""flax nnx through OuterSync: an nnx model and nnx.Optimizer give the same rounds as the pytree
loop, nnx.state trees with Param wrappers work as pytrees, and the mismatched pair is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ravnest_jax as rj

from ._local import local_swarm


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)), jnp.float32)
Y = jnp.sum(X, axis=1, keepdims=True)
STEPS, H = 10, 3  # rounds start at steps 3, 6, 9 and merge one step later (tau = 1)


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _nnx_run() -> tuple[list[str], float]:
    model = Net(nnx.Rngs(0))
    tx = rj.diloco(optax.adam(1e-2), sync_every=H)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(_loss)(model, X, Y)
        opt.update(model, grads)
        return loss

    digests = []
    with local_swarm(1) as (sw,), rj.OuterSync(tx, sw, on_round=lambda m: digests.append(m.state_digest)) as sync:
        for _ in range(STEPS):
            loss = step(model, opt)
            assert sync(model, opt) == (model, opt)
        assert sync.step == STEPS
    assert int(opt.step.get_value()) == STEPS
    return digests, float(loss)


def _pytree_run(wrapped: bool) -> tuple[list[str], float]:
    """``wrapped``: params as ``nnx.state(model, nnx.Param)`` (Param variables as pytree nodes);
    else plain arrays (``nnx.as_pure``)."""
    model = Net(nnx.Rngs(0))
    graphdef = nnx.graphdef(model)
    params = nnx.state(model, nnx.Param)
    if not wrapped:
        params = nnx.as_pure(params)
    tx = rj.diloco(optax.adam(1e-2), sync_every=H)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p), X, Y))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    digests = []
    with local_swarm(1) as (sw,), rj.OuterSync(tx, sw, on_round=lambda m: digests.append(m.state_digest)) as sync:
        for _ in range(STEPS):
            params, state, loss = step(params, state)
            params, state = sync(params, state)
    return digests, float(loss)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.timeout(120)
def test_an_nnx_model_and_optimizer_round_like_the_pytree_loop():
    nnx_digests, nnx_loss = _nnx_run()
    for wrapped in (False, True):
        digests, loss = _pytree_run(wrapped)
        assert len(digests) == 3 and all(digests), digests
        assert nnx_digests == digests, (wrapped, nnx_digests, digests)
        assert nnx_loss == loss, (wrapped, nnx_loss, loss)


def test_nnx_state_next_to_an_optimizer_state_is_refused_with_what_to_pass():
    model = Net(nnx.Rngs(0))
    tx = rj.diloco(optax.adam(1e-2), sync_every=H)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    with (
        rj.OuterSync(tx, rj.testing.LocalRun().swarm("p0")) as sync,
        pytest.raises(TypeError, match=r"sync\(model, optimizer\)"),
    ):
        sync(nnx.state(model, nnx.Param), opt.opt_state)
