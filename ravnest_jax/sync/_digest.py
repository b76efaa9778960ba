"""A state digest computed on the device: a few integers leave it, not the params."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_MULS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


def _leaf_hash(x: jax.Array, salt: int) -> jax.Array:
    """Four uint32 lanes of a position-dependent hash of a leaf's bits (wrap-around sums)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    flat = x.reshape(-1)
    itemsize = flat.dtype.itemsize
    if itemsize == 8:
        bits = jax.lax.bitcast_convert_type(flat, jnp.uint32).reshape(-1)
    elif itemsize == 4:
        bits = jax.lax.bitcast_convert_type(flat, jnp.uint32)
    elif itemsize == 2:
        bits = jax.lax.bitcast_convert_type(flat, jnp.uint16).astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(flat, jnp.uint8).astype(jnp.uint32)
    idx = jnp.arange(bits.shape[0], dtype=jnp.uint32) + jnp.uint32((salt * 0x632BE5AB) % (1 << 32))
    lanes = []
    for i, m in enumerate(_MULS):
        v = (bits ^ (idx * jnp.uint32(m) + jnp.uint32(i))) * jnp.uint32(m | 1)
        v = v ^ (v >> 15)
        v = v * jnp.uint32(_MULS[(i + 1) % 4] | 1)
        lanes.append(jnp.sum(v, dtype=jnp.uint32))
    return jnp.stack(lanes)


@jax.jit
def device_digest(tree: Any) -> jax.Array:
    """uint32[4] digest of every leaf's bits, shapes and order (integer arithmetic only, so it is
    the same on every backend). Equal trees give equal digests; any changed bit changes it with
    overwhelming probability."""
    leaves = jax.tree.leaves(tree)
    acc = jnp.zeros(4, jnp.uint32)
    for i, leaf in enumerate(leaves):
        h = _leaf_hash(leaf, i + 1)
        acc = acc * jnp.uint32(0x01000193) + h + jnp.uint32(np.prod(np.shape(leaf), dtype=np.int64) % (1 << 32))
    return acc


def digest_hex(d: Any) -> str:
    """Hex string of a :func:`device_digest` result (32 hex chars)."""
    return "".join(f"{int(v):08x}" for v in np.asarray(d))
