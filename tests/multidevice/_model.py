"""A tiny MLP, its data and its train step, laid out over the 4 forced CPU devices of the suite
(tests/conftest.py): unsharded, replicated (data parallel) or FSDP-style (every leaf split along
its first axis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

DIM, HIDDEN, OUT, BATCH = 8, 32, 4, 16
LAYOUTS = ("replicated", "fsdp")


def init_params() -> dict:
    k = jax.random.key(0)
    return {
        "w1": jax.random.normal(k, (DIM, HIDDEN)) * 0.3,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(jax.random.fold_in(k, 1), (HIDDEN, OUT)) * 0.3,
    }


def batch(peer: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([peer, step])
    x = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), np.cos(x[:, 1]), x[:, 2] * x[:, 3], np.tanh(x[:, 4])], 1).astype(np.float32)
    return x, y


def loss(p, x, y, gather: bool = False):
    if gather:  # FSDP on a mesh with explicit axes: all-gather each weight where it is used
        p = jax.tree.map(lambda w: jax.sharding.reshard(w, NamedSharding(jax.typeof(w).sharding.mesh, P())), p)
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def mesh(axis_type: AxisType = AxisType.Explicit, devices: int = 4):
    return jax.make_mesh((devices,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:devices])


def param_shardings(m, layout: str, params: dict) -> dict:
    """Specs spelled as jit outputs spell them, so that ``==`` holds after a step: full rank
    (``P("data", None)``) on a mesh with explicit axes, trailing ``None`` dropped
    (``P("data")``, ``P()``) on one with automatic axes."""
    explicit = bool(m.explicit_axes)

    def one(x):
        dims = [None] * x.ndim if layout == "replicated" else ["data", *[None] * (x.ndim - 1)]
        if not explicit:
            while dims and dims[-1] is None:
                dims.pop()
        return NamedSharding(m, P(*dims))

    return jax.tree.map(one, params)


def place(tree, shardings):
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)


def state_on_mesh(state, m):
    """``tx.init`` leaves its scalars (step counts) on one device; a jitted step returns them on
    the mesh. Put them there from the start, so that the layouts never change (and nothing is
    compiled twice)."""
    return jax.tree.map(
        lambda x: x if getattr(x.sharding, "mesh", None) == m else jax.device_put(x, NamedSharding(m, P())), state
    )


def on_mesh(tree, m) -> object:
    """The shardings of ``tree``'s leaves that lie on mesh ``m`` (``None`` for the others)."""
    return jax.tree.map(lambda x: x.sharding if getattr(x.sharding, "mesh", None) == m else None, tree)


def make_step(tx, params=None, state=None, m=None, gather: bool = False):
    """The jitted inner step. With a mesh it keeps the layouts of ``params`` and ``state`` (on a
    mesh with automatic axes XLA would otherwise pick the output layouts)."""

    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y, gather)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    if m is None:
        return jax.jit(step)
    return jax.jit(step, out_shardings=(on_mesh(params, m), on_mesh(state, m), None))
