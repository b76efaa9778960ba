"""Where the arrays of a round lie: the device mesh of the params, a hashable description of
their layout (a key of the jitted round functions), and host <-> device copies that keep it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def mesh_of(tree: Any) -> Mesh | None:
    """The device mesh of the first leaf laid out over more than one device, else ``None``."""
    for x in jax.tree.leaves(tree):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.size > 1:
            return s.mesh
    return None


def layout_of(params: Any, state: Any) -> tuple | None:
    """A hashable description of how ``params`` and ``state`` lie on their mesh: ``(mesh,
    params treedef, params shardings, state treedef, state shardings)``, with ``None`` for a leaf
    that is not on that mesh (the compiler chooses); ``None`` when the params are on one device."""
    mesh = mesh_of(params)
    if mesh is None:
        return None

    def on_mesh(tree: Any) -> tuple:
        leaves, treedef = jax.tree.flatten(tree)
        sh = tuple(
            x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh else None
            for x in leaves
        )
        return treedef, sh

    return (mesh, *on_mesh(params), *on_mesh(state))


def _spread(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Dim 0 spread over every device of ``mesh`` when it divides evenly, else replicated."""
    if shape and shape[0] % mesh.size == 0:
        return NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return NamedSharding(mesh, P())


def encode_on_mesh(encode: Callable, mesh: Mesh | None, leaves: list, residual: Any, key: Any) -> tuple[Any, Any]:
    """``encode(leaves, residual, key)`` (a ``device_encode``) inside jit, for leaves laid out on
    ``mesh``: every device encodes the blocks of its own shards (XLA's partitioner) and the
    packed parts come out spread over the devices, so that the device-to-host copy takes one
    slice from each device and no device gathers the pseudo-gradient. (On a mesh with explicit
    axes ``device_encode`` lays its outputs out the same way itself.)"""
    if mesh is None or mesh.explicit_axes:
        return encode(leaves, residual, key)
    packed, new_res = encode(leaves, residual, key)
    return jax.lax.with_sharding_constraint(packed, jax.tree.map(lambda a: _spread(mesh, a.shape), packed)), new_res


def split_host(vec: np.ndarray, like: list) -> list[np.ndarray]:
    """A flat host vector cut into arrays shaped like ``like`` (views, C order)."""
    out, off = [], 0
    for x in like:
        n = int(np.prod(np.shape(x), dtype=np.int64))
        out.append(vec[off : off + n].reshape(np.shape(x)))
        off += n
    return out


def put_like(arrays: list, like: list) -> list:
    """Host arrays onto the devices with the layouts of ``like``: each device receives its own
    shard straight from the host. With devices of other processes in the layout (a peer over
    several processes), every process passes the same host arrays and fills its own devices."""
    out = []
    for a, x in zip(arrays, like):
        if not isinstance(x, jax.Array) or not x.committed:
            # placed like `like`: jit keys its cache on committedness, so committing an array
            # that was not would recompile the train step (and the other way round)
            out.append(jnp.asarray(a))
        elif x.sharding.is_fully_addressable:
            out.append(jax.device_put(a, x.sharding))
        else:
            a = np.asarray(a)
            out.append(jax.make_array_from_callback(a.shape, x.sharding, lambda idx, a=a: a[idx]))
    return out
