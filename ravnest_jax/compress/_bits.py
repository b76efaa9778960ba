"""The bit-level primitives of the codecs, against an array namespace ``xp`` (``numpy`` or
``jax.numpy``): bfloat16 bits, nibble packing, the code-value tables, the block absmax
and the input bounds. The leaf of ``compress``: it imports no other module of the package, and
neither jax nor anything that does (``_materialize`` imports ``jax.lax`` only when called with
``xp = jax.numpy``). :mod:`._formats` (every codec's math) and :mod:`._coarse` (int2, sign) build
on it."""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_ABS = 2.0**127
"""Largest accepted input magnitude. Larger values (and NaN, Inf) raise ``NonFiniteError``."""

TINY = 2.0**-100
"""Blocks whose absmax is below this are sent as zeros (keeps every scale a normal float)."""


def f32_to_bf16_bits(xp: Any, x: Any, noise_bits: Any = None) -> Any:
    """float32 -> bfloat16 bits (uint16): round-half-to-even, or stochastic with ``noise_bits``.

    ``noise_bits``: uint32 uniform in ``[0, 2**16)`` (stochastic rounding of the magnitude,
    unbiased). Inputs must satisfy ``|x| <= MAX_ABS`` (no overflow of the carry).
    """
    u = x.view(xp.uint32)
    if noise_bits is None:
        u = u + (((u >> 16) & 1) + 0x7FFF)
    else:
        u = u + noise_bits
    return (u >> 16).astype(xp.uint16)


def bf16_bits_ceil(xp: Any, x: Any) -> Any:
    """bfloat16 bits of the smallest bfloat16 ``>= x`` for finite ``0 <= x <= MAX_ABS``."""
    u = x.view(xp.uint32)
    return ((u + 0xFFFF) >> 16).astype(xp.uint16)


def bf16_bits_to_f32(xp: Any, bits: Any) -> Any:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def pack_nibbles(xp: Any, codes: Any) -> Any:
    """``(..., 2m)`` uint8 codes < 16 -> ``(2m * ... / 2,)`` bytes; element ``2i`` in the low nibble.

    Pairs are read as little-endian uint16 (``lo | hi << 8``) and folded to ``lo | hi << 4``: the
    same bytes as ``codes[..., 0::2] | codes[..., 1::2] << 4``, but XLA:CPU vectorises it (the
    strided form made the whole fused encode ~10x slower).
    """
    pairs = codes.reshape(-1, 2)
    u = (pairs.view(np.dtype("<u2")) if xp is np else pairs.view(xp.uint16)).reshape(-1)
    return ((u & 0x0F) | ((u >> 4) & 0xF0)).astype(xp.uint8)


def unpack_nibbles(xp: Any, packed: Any) -> Any:
    """Inverse of :func:`pack_nibbles`: ``(..., m)`` bytes -> ``(..., 2m)`` codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return xp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def int_code_values(xp: Any, codec: str, codes: Any) -> Any:
    """Integer code (uint8 as stored) -> float32 value before scaling.

    int8: the byte is a two's-complement int8 in ``[-127, 127]``; int4: the nibble is ``q + 8``
    with ``q`` in ``[-7, 7]``.
    """
    if codec == "int8":
        return codes.view(xp.int8).astype(xp.float32)
    return codes.astype(xp.float32) - 8.0


def e2m1_code_values(xp: Any, codes: Any) -> Any:
    """FP4 E2M1 code (4 bits: sign, 2 exponent, 1 mantissa) -> float32.

    Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7; bit 3 is the sign (OCP MX v1.0).
    """
    mag = (codes & 7).astype(xp.float32)
    v = xp.where(mag < 4, mag * 0.5, xp.where(mag < 7, mag - 2.0, 6.0))
    return xp.where((codes & 8) != 0, -v, v)


def e8m0_scale_values(xp: Any, codes: Any) -> Any:
    """E8M0 scale byte ``c`` -> ``2**(c - 127)`` float32 (code 0, a zero block, -> 0.0)."""
    c = codes.astype(xp.uint32)
    return xp.where(c > 0, (c << 23).view(xp.float32), 0.0).astype(xp.float32)


def _materialize(xp: Any, a: Any) -> Any:
    """Per-block values computed once: under XLA an optimisation barrier stops the compiler from
    fusing the block reduction into the per-element loop (recomputing it for every element, 3-10x
    slower on CPU). Identity for numpy; the values are unchanged either way."""
    if xp is np:
        return a
    from jax import lax  # only reached with xp = jax.numpy, so jax is already imported

    return lax.optimization_barrier(a)


def _block_absmax(xp: Any, xb: Any) -> Any:
    """``(nb, B)`` float32 -> ``(nb,)`` largest ``|x|`` of each block; NaN propagates (then the
    leaf is flagged, not encoded); ``-0.0`` counts as ``0.0``.

    numpy: the max of the uint32 bits of ``|x|`` (sign bit cleared; non-negative floats order as
    their bits, a NaN's bits lie above Inf's): one integer reduction instead of a max and a min,
    2.3x faster for B = 32. XLA: ``max(max, -min)`` (it fuses the float reductions into one
    vectorised pass; an integer reduction of the bitcast was 5x slower). The same values.
    """
    if xp is np:
        bits = xb.view(np.uint32) & np.uint32(0x7FFFFFFF)
        return np.max(bits, axis=1).view(np.float32)
    return xp.maximum(xp.max(xb, axis=1), -xp.min(xb, axis=1))
