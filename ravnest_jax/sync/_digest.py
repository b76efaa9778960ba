"""A state digest computed on the device: a few integers leave it, not the params."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_MULS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


CHUNK = 1 << 22
"""Elements hashed per step: a leaf's lanes are summed chunk by chunk, so that a digest needs
a few chunk-sized temporaries, not four leaf-sized ones (it did: 8x the params of a merge's
``(global_params, outer_state)`` on XLA's CPU plan). The sums wrap around, so the chunking does
not change the value."""


def _lanes(bits: jax.Array, idx: jax.Array) -> jax.Array:
    """The four uint32 lane sums of ``bits`` (uint32) at positions ``idx`` (uint32)."""
    lanes = []
    for i, m in enumerate(_MULS):
        v = (bits ^ (idx * jnp.uint32(m) + jnp.uint32(i))) * jnp.uint32(m | 1)
        v = v ^ (v >> 15)
        v = v * jnp.uint32(_MULS[(i + 1) % 4] | 1)
        lanes.append(jnp.sum(v, dtype=jnp.uint32))
    return jnp.stack(lanes)


def _bits(flat: jax.Array) -> jax.Array:
    """A 1-D array's bits as uint32 values (two per element of 8 bytes, one per smaller one)."""
    unsigned = {8: jnp.uint32, 4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[flat.dtype.itemsize]
    return jax.lax.bitcast_convert_type(flat, unsigned).astype(jnp.uint32).reshape(-1)


def _leaf_hash(x: jax.Array, salt: int, chunk: int = CHUNK) -> jax.Array:
    """Four uint32 lanes of a position-dependent hash of a leaf's bits (wrap-around sums),
    about ``chunk`` values at a time (the leaf is sliced, then converted: no leaf-sized copy;
    ``chunk <= 0``: the whole leaf at once)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    flat = x.reshape(-1)
    per = 2 if flat.dtype.itemsize == 8 else 1  # uint32 values per element
    n = flat.shape[0]
    step = max(1, chunk // per) if chunk > 0 else n  # elements per chunk
    base = (salt * 0x632BE5AB) % (1 << 32)
    full = n // step if n > step else 0
    acc = jnp.zeros(4, jnp.uint32)
    if full:

        def body(c: jax.Array, acc: jax.Array) -> jax.Array:
            start = c * step
            bits = _bits(jax.lax.dynamic_slice_in_dim(flat, start, step))
            idx = jnp.arange(step * per, dtype=jnp.uint32) + (start.astype(jnp.uint32) * per + jnp.uint32(base))
            return acc + _lanes(bits, idx)

        acc = jax.lax.fori_loop(0, full, body, acc)
    if n - full * step or not full:
        bits = _bits(flat[full * step :])
        idx = jnp.arange(bits.shape[0], dtype=jnp.uint32) + jnp.uint32((full * step * per + base) % (1 << 32))
        acc = acc + _lanes(bits, idx)
    return acc


@functools.partial(jax.jit, static_argnames="chunk")
def device_digest(tree: Any, chunk: int = CHUNK) -> jax.Array:
    """uint32[4] digest of every leaf's bits, shapes and order (integer arithmetic only, so it is
    the same on every backend). Equal trees give equal digests; any changed bit changes it with
    overwhelming probability. ``chunk``: values hashed per step (:data:`CHUNK`; the same digest
    for any value); 0: each leaf at once, for leaves sharded over a mesh (a chunk's dynamic
    slice of a sharded leaf would gather it on every device)."""
    leaves = jax.tree.leaves(tree)
    acc = jnp.zeros(4, jnp.uint32)
    for i, leaf in enumerate(leaves):
        h = _leaf_hash(leaf, i + 1, chunk)
        acc = acc * jnp.uint32(0x01000193) + h + jnp.uint32(np.prod(np.shape(leaf), dtype=np.int64) % (1 << 32))
    return acc


def digest_hex(d: Any) -> str:
    """Hex string of a :func:`device_digest` result (32 hex chars)."""
    return "".join(f"{int(v):08x}" for v in np.asarray(d))
