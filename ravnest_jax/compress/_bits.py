"""The bit-level primitives of the codecs, against an array namespace ``xp`` (``numpy`` or
``jax.numpy``): bfloat16 bits, code packing, E8M0 scales, the block absmax and the input bounds;
and topk's exact selection on the host (numpy, over the bits of ``|x|``). The leaf of
``compress``: it imports no other module of the package, and neither jax nor anything that does
(``_materialize`` imports ``jax.lax`` only when called with ``xp = jax.numpy``).
:mod:`._formats` (every codec's math) builds on it."""

from __future__ import annotations

import math
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
    u = u + ((((u >> 16) & 1) + 0x7FFF) if noise_bits is None else noise_bits)
    return (u >> 16).astype(xp.uint16)


def bf16_bits_ceil(xp: Any, x: Any) -> Any:
    """bfloat16 bits of the smallest bfloat16 ``>= x`` for finite ``0 <= x <= MAX_ABS``."""
    u = x.view(xp.uint32)
    return ((u + 0xFFFF) >> 16).astype(xp.uint16)


def bf16_bits_to_f32(xp: Any, bits: Any) -> Any:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def pack_codes(xp: Any, codes: Any, width: int) -> Any:
    """``(m * 8 / width,)`` uint8 codes below ``2**width`` (``width`` 4, 2 or 1) -> ``(m,)`` bytes;
    element ``8 / width * i + j`` in bits ``width * j ...`` of byte ``i`` (for width 1 the bytes of
    ``np.packbits(codes, bitorder="little")``).

    A byte's codes (4 at most) are read as one little-endian uint16 / uint32 word and folded with
    shifts and masks (for width 1, two such words, a nibble each): XLA:CPU vectorises that, while
    the strided form (``codes[0::2] | codes[1::2] << 4``, a gather of 8 columns) made the fused
    encodes several times slower (10x for the nibbles).
    """
    per, mask = 8 // width, (1 << width) - 1
    m = min(per, 4)  # codes per word
    c = codes.reshape(-1, per)
    out = None
    for half in range(per // m):
        w = c if m == per else c[:, m * half : m * half + m]
        u = (w.view(np.dtype(f"<u{m}")) if xp is np else w.view(xp.uint16 if m == 2 else xp.uint32)).reshape(-1)
        v = u & mask
        for j in range(1, m):  # code j of the word, at bit 8 j, moves to bit width j
            v = v | ((u >> ((8 - width) * j)) & (mask << (width * j)))
        out = v if half == 0 else out | (v << (m * width * half))
    return out.astype(xp.uint8)


def unpack_codes(xp: Any, packed: Any, width: int) -> Any:
    """Inverse of :func:`pack_codes`: ``(..., m)`` bytes -> ``(..., m * 8 / width)`` uint8 codes."""
    per, mask = 8 // width, (1 << width) - 1
    codes = xp.stack([(packed >> xp.uint8(width * j)) & xp.uint8(mask) for j in range(per)], axis=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per).astype(xp.uint8)


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


_TOPK_SAMPLE = 1 << 16
"""Sample size of :func:`np_topk_indices`' candidate threshold (leaves of more than 4 samples)."""


def np_topk_indices(x: Any, k: int) -> Any:
    """numpy: ascending indices of the ``k`` largest magnitudes ``|x|`` of a 1-D float32 array,
    ties broken toward lower indices (exact; the same selection as ``jax.lax.top_k``).

    Magnitudes are compared as the uint32 bit patterns of ``|x|`` (order-preserving for floats;
    a NaN ranks above everything, but NaN inputs are refused anyway). For long arrays the exact
    k-th largest magnitude ``T`` is found among *candidates*: the elements at or above a
    threshold read from a strided sample of 65536 magnitudes, placed 6 standard deviations of
    the sample count below the expected k-th largest, so that almost surely at least ``k``
    elements pass it. Then every element ``>= T`` is a candidate and ``T`` is exact; if fewer
    than ``k`` pass (a rare sample), the threshold is 0 and all elements are candidates. One
    pass over ``x`` in L2-sized chunks, then work on about ``1.25 k`` candidates.

    Args:
      x: 1-D float32 array (n,).
      k: ``1 <= k``; ``k >= n`` returns ``arange(n)``.

    Returns:
      ``(k,)`` int64 indices, strictly increasing.
    """
    n = x.shape[0]
    if k >= n:
        return np.arange(n)
    bits = x.view(np.uint32)
    t_lo = 0
    if n > 4 * _TOPK_SAMPLE:
        step = n // _TOPK_SAMPLE
        sample = bits[::step] & np.uint32(0x7FFFFFFF)
        s = sample.shape[0]
        mean = k * s / n
        j = min(s, int(mean + 6.0 * math.sqrt(mean) + 8))
        t_lo = int(np.partition(sample, s - j)[s - j])
    if t_lo:
        cand_parts = []
        mag = np.empty(min(n, 1 << 16), np.uint32)
        for a in range(0, n, 1 << 16):
            b = min(n, a + (1 << 16))
            m = mag[: b - a]
            np.bitwise_and(bits[a:b], np.uint32(0x7FFFFFFF), out=m)
            hit = np.flatnonzero(m >= t_lo)
            if hit.shape[0]:
                cand_parts.append(hit + a)
        cand = np.concatenate(cand_parts) if cand_parts else np.zeros(0, np.intp)
        if cand.shape[0] >= k:
            return _exact_topk(bits[cand] & np.uint32(0x7FFFFFFF), k, cand)
    return _exact_topk(bits & np.uint32(0x7FFFFFFF), k, None)


def _exact_topk(m: Any, k: int, cand: Any) -> Any:
    """Positions (in ``cand``, or plain indices) of the k largest of uint32 ``m``, ascending."""
    c = m.shape[0]
    t = np.partition(m, c - k)[c - k] if c > k else m.min()
    keep = m > t
    need = k - int(np.count_nonzero(keep))
    keep[np.flatnonzero(m == t)[:need]] = True
    idx = np.flatnonzero(keep)
    return idx if cand is None else cand[idx]
