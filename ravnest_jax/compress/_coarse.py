"""The coarse codecs, int2 and sign: 2 and 1 bits per element with a bfloat16 scale per block
taken from the block's mean ``|x|`` (the math of ``_formats``, against an array namespace ``xp``,
numpy or ``jax.numpy``, with the same bits from both; imports neither jax nor anything that does).

int2 (a 2-bit midrise grid) and sign (the scaled sign of EF-SignSGD, arXiv 1901.09847) are for
1000x-class reductions of DiLoCo rounds; see ``docs/compression.md``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._bits import TINY, _materialize, bf16_bits_ceil, bf16_bits_to_f32, f32_to_bf16_bits


def u32_words(xp: Any, b: Any) -> Any:
    """``(m, 4)`` uint8 -> ``(m,)`` little-endian uint32 words (a bitcast, no arithmetic)."""
    return (b.view(np.dtype("<u4")) if xp is np else b.view(xp.uint32)).reshape(-1)


def pack_bits(xp: Any, bits: Any) -> Any:
    """``(8m,)`` uint8 bits (0 or 1) -> ``(m,)`` bytes; element ``8i + j`` in bit ``j`` (the bytes
    of ``np.packbits(bits, bitorder="little")``). Each group of 4 bits is read as one
    little-endian uint32 (bits at 0, 8, 16, 24) and folded with shifts and masks: XLA vectorises
    that; a strided gather of the 8 columns made its encode several times slower."""
    b = bits.reshape(-1, 8).astype(xp.uint8)
    out = None
    for half in range(2):
        u = u32_words(xp, b[:, 4 * half : 4 * half + 4])
        v = (u & 0x1) | ((u >> 7) & 0x2) | ((u >> 14) & 0x4) | ((u >> 21) & 0x8)
        v = v << (4 * half) if half else v
        out = v if out is None else out | v
    return out.astype(xp.uint8)


def unpack_bits(xp: Any, packed: Any) -> Any:
    """Inverse of :func:`pack_bits`: ``(..., m)`` bytes -> ``(..., 8m)`` bits (uint8 0 or 1)."""
    bits = xp.stack([(packed >> xp.uint8(j)) & xp.uint8(1) for j in range(8)], axis=-1)
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8).astype(xp.uint8)


def pack_crumbs(xp: Any, codes: Any) -> Any:
    """``(4m,)`` uint8 2-bit codes (< 4) -> ``(m,)`` bytes; element ``4i + j`` in bits ``2j, 2j+1``
    (four codes read as one little-endian uint32 and folded, as :func:`pack_bits`)."""
    u = u32_words(xp, codes.reshape(-1, 4).astype(xp.uint8))
    return ((u & 0x3) | ((u >> 6) & 0xC) | ((u >> 12) & 0x30) | ((u >> 18) & 0xC0)).astype(xp.uint8)


def unpack_crumbs(xp: Any, packed: Any) -> Any:
    """Inverse of :func:`pack_crumbs`: ``(..., m)`` bytes -> ``(..., 4m)`` codes 0..3."""
    codes = xp.stack([(packed >> xp.uint8(2 * j)) & xp.uint8(3) for j in range(4)], axis=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 4).astype(xp.uint8)


def int2_code_values(xp: Any, codes: Any) -> Any:
    """int2 code 0..3 -> float32 value before scaling: -1.5, -0.5, 0.5, 1.5 (a midrise grid)."""
    return codes.astype(xp.float32) - xp.float32(1.5)


INT2_STEP = 1.25
"""int2's step in multiples of the block's mean ``|x|``: about the MSE-optimal 4-level uniform
quantiser of a Gaussian (step 0.996 sigma, Max 1960) with sigma = sqrt(pi / 2) mean |x|."""


def sign_code_values(xp: Any, bits: Any) -> Any:
    """sign codec bit -> float32 value before scaling: 1 -> +1.0, 0 -> -1.0."""
    return bits.astype(xp.float32) * xp.float32(2.0) - xp.float32(1.0)


def block_mean_abs(xp: Any, xb: Any, n: int) -> Any:
    """``(nb, B)`` float32 (``B`` a power of two; the leaf's ``n`` elements, then zero padding) ->
    ``(nb,)`` mean of ``|x|`` over each block's elements of the leaf (the last block's padding is
    not counted). The sum runs in a fixed pairwise order (halves added elementwise) and is scaled
    by a float32 reciprocal computed in Python, so numpy and XLA give the same bits (a library
    sum's order, and XLA's rewrite of a division, differ between them). Each ``|x|`` is scaled by
    ``1 / B`` first (exact), so the sum cannot overflow for ``|x| <= MAX_ABS``."""
    nb, B = xb.shape
    a = xp.abs(xb) * xp.float32(1.0 / B)
    while a.shape[1] > 1:
        h = a.shape[1] // 2
        a = a[:, :h] + a[:, h:]
    last = n - (nb - 1) * B
    fix = xp.where(xp.arange(nb) == nb - 1, xp.float32(B / last), xp.float32(1.0))
    return a[:, 0] * fix.astype(xp.float32)


def quantize_sign(xp: Any, xb: Any, n: int) -> tuple[Any, Any]:
    """Scaled sign (EF-SignSGD, arXiv 1901.09847, per block): bit ``x >= 0``, value ``+-s`` with
    ``s`` the block's mean ``|x|`` (the scale that minimises the block's squared error for those
    signs) rounded to bfloat16; blocks with ``s < TINY`` send ``s = 0``. -> (scale bits, code bytes)."""
    s = block_mean_abs(xp, xb, n)
    s = xp.where(s < TINY, 0.0, s).astype(xp.float32)
    s_bits = f32_to_bf16_bits(xp, s)
    bits = (xb >= 0).astype(xp.uint8).reshape(-1)
    return s_bits, pack_bits(xp, bits)


def quantize_int2(xp: Any, xb: Any, n: int) -> tuple[Any, Any]:
    """2-bit midrise grid per block: step ``d = INT2_STEP * mean |x|`` rounded up to bfloat16,
    values ``(q + 0.5) d`` for ``q = floor(x / d)`` clipped to ``[-2, 1]`` (stored ``q + 2``);
    blocks with ``d < TINY`` send ``d = 0``. -> (step bits, code bytes)."""
    d = block_mean_abs(xp, xb, n) * xp.float32(INT2_STEP)
    d = xp.where(d < TINY, 0.0, d).astype(xp.float32)
    d_bits = bf16_bits_ceil(xp, d)
    d = bf16_bits_to_f32(xp, d_bits)
    inv = xp.where(d > 0, xp.float32(1.0) / xp.where(d > 0, d, xp.float32(1.0)), 0.0).astype(xp.float32)
    d_bits, inv = _materialize(xp, (d_bits, inv))
    q = xp.clip(xp.floor(xb * inv[:, None]), -2.0, 1.0)
    codes = (q + xp.float32(2.0)).astype(xp.uint8).reshape(-1)
    return d_bits, pack_crumbs(xp, codes)
