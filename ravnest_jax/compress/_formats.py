"""The math of every codec, written once against an array namespace ``xp``.

``xp`` is ``numpy`` (host encode in :func:`ravnest_jax.compress.encode`, and the lookup tables of
the host decoder) or ``jax.numpy`` (jitted device encode, error feedback, simulation). Only
operations with identical IEEE semantics in both are used (elementwise float32 multiply and
divide, ``rint`` half-to-even, integer bit operations, ``view`` bitcasts, max/min reductions), so
a deterministic encode produces the same bytes on the host and on the device.

This module imports neither jax nor anything that does.

Per-leaf layout. A leaf of ``n`` elements is flattened (C order) to float32; the blockwise codecs
pad it with zeros to ``nb = ceil(n / B)`` blocks of ``B`` elements. The *parts* of a leaf, in wire
order, are:

========  ==========================================  ======================================
codec     parts (dtype, length)                       payload bytes
========  ==========================================  ======================================
fp32      values ``<f4`` (n)                          ``4 n``
bf16      values ``<u2`` bfloat16 bits (n)            ``2 n``
int8      scales ``<u2`` bf16 (nb), codes ``u1`` (nb B)  ``2 nb + nb B``
int4      scales ``<u2`` bf16 (nb), codes ``u1`` (nb B / 2)  ``2 nb + nb B / 2``
fp4       scales ``u1`` E8M0 (nb), codes ``u1`` (nb B / 2)   ``nb + nb B / 2``
int2      scales ``<u2`` bf16 (nb), codes ``u1`` (nb B / 4)  ``2 nb + nb B / 4``
sign      scales ``<u2`` bf16 (nb), bits ``u1`` (nb B / 8)   ``2 nb + nb B / 8``
topk      indices ``<u4`` (k), values ``<f4`` (k)      ``8 k``
========  ==========================================  ======================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _bits
from ._bits import MAX_ABS as MAX_ABS
from ._bits import _block_absmax as _block_absmax
from ._bits import np_topk_indices as np_topk_indices

CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "fp4", "int2", "sign", "topk")
"""Names of the codecs, as accepted by ``codec=`` everywhere."""

BLOCK_CODECS = ("int8", "int4", "fp4", "int2", "sign")
STOCHASTIC_CODECS = ("bf16", "int8", "int4", "fp4")
DEFAULT_BLOCK_SIZE = {"int8": 64, "int4": 64, "fp4": 32, "int2": 64, "sign": 64}
CODES_PER_BYTE = {"int8": 1, "int4": 2, "fp4": 2, "int2": 4, "sign": 8}
"""Elements whose codes share one payload byte, per block codec."""
MEAN_SCALED = ("int2", "sign")
"""Block codecs scaled by the block's mean ``|x|`` (block size a power of two >= 8)."""
MAX_BLOCK_SIZE = 1 << 16
DEFAULT_TOPK_FRACTION = 0.01

INT2_STEP = 1.25
"""int2's step in multiples of the block's mean ``|x|``: about the MSE-optimal 4-level uniform
quantiser of a Gaussian (step 0.996 sigma, Max 1960) with sigma = sqrt(pi / 2) mean |x|."""


class CodecConfig(NamedTuple):
    """Static configuration of a codec (hashable; a jit static argument).

    Attributes:
      codec: one of :data:`CODECS`.
      block_size: elements per block for int8/int4/fp4 (even, 2..65536) or int2/sign (a power of
        two, 8..65536), else 0.
      fraction: for topk, the fraction of elements sent (0 < fraction <= 1), else 0.0.
      stochastic: stochastic rounding (bf16, int8, int4, fp4 only).
    """

    codec: str
    block_size: int = 0
    fraction: float = 0.0
    stochastic: bool = False

    def k(self, n: int) -> int:
        """Elements sent of a leaf of ``n`` elements: :func:`topk_count` for topk, else 0."""
        return topk_count(n, self.fraction) if self.codec == "topk" else 0


def is_int(v: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def resolve(codec: str, **options: Any) -> CodecConfig:
    """Validates a codec name and its options; returns a :class:`CodecConfig`.

    Options: ``block_size`` (int8, int4, fp4, int2, sign; default 64, 64, 32, 64, 64),
    ``fraction`` (topk; default 0.01), ``stochastic`` (bf16, int8, int4, fp4; default False).

    Raises:
      ValueError: unknown codec, unknown option, an option that does not apply to the codec, or
        a bad value; the message names it.
    """
    if not isinstance(codec, str) or codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    for name in options:
        if name not in ("block_size", "fraction", "stochastic"):
            raise ValueError(f"unknown codec option {name!r} (known: block_size, fraction, stochastic)")
    block_size, fraction = options.get("block_size"), options.get("fraction")
    stochastic = options.get("stochastic", False)
    if block_size is not None and codec not in BLOCK_CODECS:
        raise ValueError(f"option 'block_size' does not apply to codec {codec!r}")
    if fraction is not None and codec != "topk":
        raise ValueError(f"option 'fraction' does not apply to codec {codec!r}")
    if not isinstance(stochastic, (bool, np.bool_)):
        raise ValueError(f"option 'stochastic' must be a bool, got {stochastic!r}")
    stochastic = bool(stochastic)
    if stochastic and codec not in STOCHASTIC_CODECS:
        raise ValueError(
            f"option 'stochastic' does not apply to codec {codec!r} "
            f"(stochastic rounding exists for {', '.join(STOCHASTIC_CODECS)})"
        )
    if codec in BLOCK_CODECS:
        block_size = DEFAULT_BLOCK_SIZE[codec] if block_size is None else block_size
        if not is_int(block_size) or not block_size_ok(codec, int(block_size)):
            also = ", a power of two >= 8" if codec in MEAN_SCALED else ""
            raise ValueError(
                f"option 'block_size' of codec {codec!r} must be an even int in [2, {MAX_BLOCK_SIZE}]{also}, "
                f"got {block_size!r}"
            )
        return CodecConfig(codec, int(block_size), 0.0, stochastic)
    if codec == "topk":
        fraction = DEFAULT_TOPK_FRACTION if fraction is None else fraction
        if not ((is_int(fraction) or isinstance(fraction, (float, np.floating))) and 0.0 < float(fraction) <= 1.0):
            raise ValueError(f"option 'fraction' must be a number in (0, 1], got {fraction!r}")
        return CodecConfig(codec, 0, float(fraction), False)
    return CodecConfig(codec, 0, 0.0, stochastic)


# ----------------------------------------------------------------------------- sizes


def block_size_ok(codec: str, block_size: int) -> bool:
    """Whether ``block_size`` is valid for block codec ``codec``: an even int in [2, 65536]; for
    int2 and sign also a power of two >= 8 (whole code bytes per block, and the scale's
    fixed-order sum)."""
    if not (2 <= block_size <= MAX_BLOCK_SIZE and block_size % 2 == 0):
        return False
    return codec not in MEAN_SCALED or (block_size >= 8 and block_size & (block_size - 1) == 0)


def mean_codec_options(codec: str, mean_codec: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options of the mean's codec when the contributions are in ``codec`` with ``options``:
    both must be block codecs (``BLOCK_CODECS``) of one block size (the contribution's, default
    included), so that the parts of a round are cut on blocks of both; or the same codec.

    Raises:
      ValueError: ``mean_codec`` is unknown, not a block codec, or cannot take the block size.
    """
    if mean_codec == codec:
        return dict(options or {})
    if not isinstance(mean_codec, str) or mean_codec not in CODECS:
        raise ValueError(f"unknown mean codec {mean_codec!r}; a mean codec is one of {', '.join(BLOCK_CODECS)}")
    if codec not in BLOCK_CODECS or mean_codec not in BLOCK_CODECS:
        raise ValueError(
            f"mean codec {mean_codec!r} with codec {codec!r}: a mean codec of its own needs block codecs on both "
            f"sides ({', '.join(BLOCK_CODECS)})"
        )
    opts = dict(options or {})
    opts.setdefault("block_size", DEFAULT_BLOCK_SIZE[codec])
    if not block_size_ok(mean_codec, int(opts["block_size"])):
        raise ValueError(f"block_size {opts['block_size']} is not valid for the mean codec {mean_codec!r}")
    return opts


def num_blocks(n: int, block_size: int) -> int:
    """``ceil(n / block_size)``: blocks of a leaf of ``n`` elements."""
    return -(-n // block_size)


def topk_count(n: int, fraction: float) -> int:
    """Elements topk sends for a leaf of ``n`` elements: ``min(n, max(1, ceil(fraction n)))``.

    0 for an empty leaf.
    """
    return 0 if n == 0 else min(n, max(1, math.ceil(fraction * n - 1e-9)))


def part_lengths(codec: str, n: int, block_size: int, k: int) -> tuple[int, ...]:
    """Element counts of the parts of one leaf (see the module docstring)."""
    if codec in ("fp32", "bf16"):
        return (n,)
    if codec == "topk":
        return (k, k)
    nb = num_blocks(n, block_size)
    return (nb, nb * block_size // CODES_PER_BYTE[codec])


_U1, _U2 = np.dtype("u1"), np.dtype("<u2")
_PART_DTYPES = {
    "fp32": (np.dtype("<f4"),),
    "bf16": (_U2,),
    "fp4": (_U1, _U1),
    "topk": (np.dtype("<u4"), np.dtype("<f4")),
    **{c: (_U2, _U1) for c in ("int8", "int4", "int2", "sign")},
}


def part_dtypes(codec: str) -> tuple[np.dtype, ...]:
    """Little-endian wire dtypes of the parts of one leaf."""
    return _PART_DTYPES[codec]


def payload_nbytes(codec: str, n: int, block_size: int, k: int) -> int:
    """Exact payload bytes of one leaf (Python ints, no overflow)."""
    return sum(length * dt.itemsize for length, dt in zip(part_lengths(codec, n, block_size, k), _PART_DTYPES[codec]))


# ----------------------------------------------------------------------------- quantize


def in_range(xp: Any, x: Any) -> Any:
    """True iff every element is finite with ``|x| <= MAX_ABS`` (NaN -> False). ``x``: 1-D f32."""
    if x.shape[0] == 0:
        return xp.asarray(True)
    if xp is np:  # two reads, no temporary array
        return (xp.max(x) <= MAX_ABS) & (xp.min(x) >= -MAX_ABS)
    # XLA fuses the abs into one reduction (half the time of max and min); max propagates NaN
    return xp.max(xp.abs(x)) <= MAX_ABS


def _blocks(xp: Any, x: Any, block_size: int) -> Any:
    """1-D float32 ``(n,)`` -> zero-padded ``(nb, B)``."""
    nb = num_blocks(x.shape[0], block_size)
    pad = nb * block_size - x.shape[0]
    return (xp.concatenate([x, xp.zeros((pad,), xp.float32)]) if pad else x).reshape(nb, block_size)


_ROUND_MAGIC = 1.5 * 2.0**23  # y + M rounds y to an integer (half to even) for |y| <= 2**22
_ROUND_MAGIC_BITS = 0x4B400000  # bits of M; bits(M + q) = bits(M) + q for small integers q


def _round_to_int(xp: Any, y: Any, noise: Any) -> Any:
    """Nearest integer of float32 ``|y| <= 2**22`` as int32: half-to-even, or ``floor(y + noise)``.

    Half-to-even via the float32 add of 1.5 * 2**23 and a bitcast: two exact IEEE ops that
    vectorise in XLA and numpy alike (``rint`` lowers to a scalar libm call in XLA:CPU).
    """
    if noise is None:
        return (y + xp.float32(_ROUND_MAGIC)).view(xp.int32) - _ROUND_MAGIC_BITS
    return xp.floor(y + noise).astype(xp.int32)


def _zero_tiny(xp: Any, s: Any) -> Any:
    """Block statistics below ``TINY`` set to 0 (the block is sent as zeros), float32."""
    return xp.where(s < _bits.TINY, 0.0, s).astype(xp.float32)


def _ceil_scale(xp: Any, s: Any) -> tuple[Any, Any]:
    """Block scales ``s >= 0`` rounded up to bfloat16 -> (bits, float32 reciprocal of the rounded
    scale, 0 for a zero one), computed once per block (``_materialize``)."""
    bits = _bits.bf16_bits_ceil(xp, s)
    s = _bits.bf16_bits_to_f32(xp, bits)
    inv = xp.where(s > 0, xp.float32(1.0) / xp.where(s > 0, s, xp.float32(1.0)), 0.0).astype(xp.float32)
    return _bits._materialize(xp, (bits, inv))


def _quantize_int(xp, cfg, xb, amax, noise):
    qmax = 127 if cfg.codec == "int8" else 7
    # multiply by the rounded reciprocal (XLA rewrites division by a constant this way; numpy must
    # do the same to produce the same bytes); the clip absorbs the 1-ulp difference
    s_bits, inv = _ceil_scale(xp, _zero_tiny(xp, amax) * xp.float32(1.0 / qmax))
    y = xp.clip(xb * inv[:, None], -qmax, qmax)
    if noise is None:
        # the stored byte straight from the rounding add: bits(y + M + c) = bits(M) + c + q, and
        # bits(M) ends in a zero byte, so the low byte is q + c (mod 256): int8's two's-complement
        # q (c = 0) or int4's q + 8 (c = 8; M + 8 is even, so ties still go to even q). Two
        # passes fewer than rounding to int32 and converting.
        c = 0.0 if cfg.codec == "int8" else 8.0
        codes = (y + xp.float32(_ROUND_MAGIC + c)).view(xp.uint32).astype(xp.uint8)
    else:
        q = xp.clip(_round_to_int(xp, y, noise), -qmax, qmax)
        codes = q.astype(xp.int8).view(xp.uint8) if cfg.codec == "int8" else (q + 8).astype(xp.uint8)
    if cfg.codec == "int4":
        codes = _bits.pack_codes(xp, codes, 4)
    return s_bits, codes.reshape(-1)


def _block_mean_abs(xp: Any, xb: Any, n: int) -> Any:
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


def _quantize_coarse(xp: Any, codec: str, xb: Any, n: int) -> tuple[Any, Any]:
    """int2 and sign, the codecs scaled by the block's mean ``|x|`` (1000x-class reductions of
    DiLoCo rounds; docs/compression.md) -> (scale bits, code bytes); blocks whose scale is below
    ``TINY`` send 0.

    sign (the scaled sign of EF-SignSGD, arXiv 1901.09847, per block): bit ``x >= 0``, value
    ``+-s`` with ``s`` the block's mean ``|x|`` (the scale that minimises the block's squared error
    for those signs) rounded to bfloat16. int2 (a 2-bit midrise grid): step ``d = INT2_STEP *
    mean |x|`` rounded up to bfloat16, values ``(q + 0.5) d`` for ``q = floor(x / d)`` clipped to
    ``[-2, 1]`` (stored ``q + 2``)."""
    s = _block_mean_abs(xp, xb, n)
    if codec == "sign":
        bits = (xb >= 0).astype(xp.uint8).reshape(-1)
        return _bits.f32_to_bf16_bits(xp, _zero_tiny(xp, s)), _bits.pack_codes(xp, bits, 1)
    d_bits, inv = _ceil_scale(xp, _zero_tiny(xp, s * xp.float32(INT2_STEP)))
    q = xp.clip(xp.floor(xb * inv[:, None]), -2.0, 1.0)
    return d_bits, _bits.pack_codes(xp, (q + xp.float32(2.0)).astype(xp.uint8).reshape(-1), 2)


def _quantize_fp4(xp, cfg, xb, amax, noise):
    zero = amax < _bits.TINY
    v = xp.where(zero, xp.float32(1.0), amax * xp.float32(1.0 / 6.0)).astype(xp.float32)
    vb = v.view(xp.uint32)
    # e = ceil(log2(v)) from the bits (v is a normal float): exponent + (mantissa != 0)
    e = ((vb >> 23) & 0xFF).astype(xp.int32) - 127 + ((vb & 0x7FFFFF) != 0).astype(xp.int32)
    s_code = xp.where(zero, 0, e + 127).astype(xp.uint8)
    inv = ((254 - (e + 127)).astype(xp.uint32) << 23).view(xp.float32)  # 2**-e, exact
    inv = xp.where(zero, 0.0, inv).astype(xp.float32)  # zero blocks: all codes 0
    s_code, inv = _bits._materialize(xp, (s_code, inv))
    y = xb * inv[:, None]  # exact: power-of-two scaling, |y| <= 6 (up to the rounding of amax / 6)
    a = xp.abs(y)
    # numpy's round half to even by compares: the same codes, several times faster
    mag = _e2m1_round_nearest_even(np, a) if noise is None and xp is np else _e2m1_round(xp, a, noise)
    codes = mag | ((y < 0).astype(xp.uint8) * xp.uint8(8))  # numpy's uint8 << is ~3x slower
    return s_code, _bits.pack_codes(xp, codes, 4).reshape(-1)


def _e2m1_round(xp: Any, a: Any, noise: Any) -> Any:
    """float32 magnitudes ``a >= 0`` (``<= 6`` up to rounding) -> uint8 E2M1 magnitude codes
    0..7: half to even (``noise=None``) or ``floor(. + noise)``, saturating at code 7.

    E2M1 grid: spacing 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]. m = round(a / spacing) and the
    code of m * spacing is m + (0, 2, 4) in those ranges (codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6).
    """
    lt2 = a < 2.0
    lt4 = a < 4.0
    inv_step = xp.where(lt2, xp.float32(2.0), xp.where(lt4, xp.float32(1.0), xp.float32(0.5)))
    m = _round_to_int(xp, a * inv_step, noise)
    off = xp.where(lt2, xp.int32(0), xp.where(lt4, xp.int32(2), xp.int32(4)))
    return xp.minimum(m + off, xp.int32(7)).astype(xp.uint8)


# Round-half-to-even on the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7): the code of
# a is the number of these decision points it passes. Between two grid values the midpoint goes
# to the one with the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
# 5 -> 4), hence ``>`` at the midpoints below an even code and ``>=`` below an odd one; above 6
# everything is 6 (code 7).
_E2M1_DECISIONS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _e2m1_round_nearest_even(xp: Any, a: Any) -> Any:
    """float32 magnitudes ``a >= 0`` -> uint8 E2M1 magnitude codes 0..7 (round half to even,
    saturating at code 7): the codes of ``_e2m1_round(xp, a, None)`` (tested on every float32 in
    [1/8, 8) and around each decision point) with compares and uint8 adds only, 7x faster in
    numpy than its float round and int32 selects. The host encoder's path; XLA runs
    ``_e2m1_round`` (it fuses that into a faster loop). NaN -> 0."""
    mag = None
    for t, inclusive in _E2M1_DECISIONS:
        hit = ((a >= xp.float32(t)) if inclusive else (a > xp.float32(t))).astype(xp.uint8)
        mag = hit if mag is None else mag + hit
    return mag


def quantize(
    xp: Any,
    cfg: CodecConfig,
    x: Any,
    noise: Callable[[tuple[int, ...]], Any] | None = None,
    topk_indices: Callable[[Any, int], Any] | None = None,
) -> tuple[Any, tuple[Any, ...]]:
    """Encodes one flat float32 leaf into its parts.

    Args:
      xp: ``numpy`` or ``jax.numpy``.
      cfg: a :class:`CodecConfig`.
      x: 1-D float32 array, ``(n,)``.
      noise: for stochastic rounding, ``noise(shape) -> float32 uniform [0, 1)``; ``None`` for
        round-half-to-even.
      topk_indices: for topk, ``f(x, k) -> indices``: the ascending indices of the k largest
        magnitudes ``|x|``, ties broken toward lower indices (exact; the numpy
        :func:`np_topk_indices` and the device implementations differ only in speed).

    Returns:
      ``(ok, parts)``: ``ok`` a bool scalar, False if any element is NaN, Inf or above
      ``MAX_ABS`` (then the parts are garbage and must not be sent); ``parts`` as in the module
      docstring.
    """
    codec = cfg.codec
    if codec in ("fp32", "bf16", "topk"):
        ok = in_range(xp, x)
        if codec == "fp32":
            return ok, (x,)
        if codec == "bf16":
            nbits = (noise(x.shape) * 65536.0).astype(xp.uint32) if cfg.stochastic and noise is not None else None
            return ok, (_bits.f32_to_bf16_bits(xp, x, nbits),)
        k = cfg.k(x.shape[0])
        if k == 0:
            return ok, (xp.zeros((0,), xp.uint32), xp.zeros((0,), xp.float32))
        idx = topk_indices(x, k).astype(xp.uint32)
        return ok, (idx, x[idx])
    if x.shape[0] == 0:
        return xp.asarray(True), (xp.zeros((0,), xp.uint16 if codec != "fp4" else xp.uint8), xp.zeros((0,), xp.uint8))
    xb = _blocks(xp, x, cfg.block_size)
    amax = _block_absmax(xp, xb)  # NaN propagates: ok is False
    ok = xp.max(amax) <= MAX_ABS
    nz = noise(xb.shape) if (cfg.stochastic and noise is not None) else None
    if codec in ("int8", "int4"):
        return ok, _quantize_int(xp, cfg, xb, amax, nz)
    if codec in MEAN_SCALED:
        return ok, _quantize_coarse(xp, codec, xb, x.shape[0])
    return ok, _quantize_fp4(xp, cfg, xb, amax, nz)


def dequantize(xp: Any, cfg: CodecConfig, parts: tuple[Any, ...], n: int) -> Any:
    """Decodes the parts of one leaf to a flat float32 array ``(n,)`` (generic ``xp`` version).

    The host decoder (:mod:`._decode`) computes the same values with lookup tables built from
    :func:`code_values`, so the math exists once.
    """
    codec = cfg.codec
    if codec == "fp32":
        return parts[0].astype(xp.float32)
    if codec == "bf16":
        return _bits.bf16_bits_to_f32(xp, parts[0])
    if codec == "topk":
        idx, vals = parts
        if xp is not np:
            return xp.zeros((n,), xp.float32).at[idx].set(vals)
        out = np.zeros((n,), np.float32)
        out[idx.astype(np.intp)] = vals
        return out
    if n == 0:
        return xp.zeros((0,), xp.float32)
    s_raw, codes = parts
    s = _bits.e8m0_scale_values(xp, s_raw) if codec == "fp4" else _bits.bf16_bits_to_f32(xp, s_raw)
    vals = code_values(xp, codec, codes)
    return (vals.reshape(s_raw.shape[0], -1) * s[:, None]).reshape(-1)[:n]


def code_values(xp: Any, codec: str, codes: Any) -> Any:
    """A block codec's code bytes ``(..., m)`` -> their float32 values before scaling,
    ``(..., m * CODES_PER_BYTE[codec])`` in element order (the host decoder's lookup tables are
    this function of every byte).

    int8: the byte is a two's-complement int8 in ``[-127, 127]``; int4: the nibble is ``q + 8``
    with ``q`` in ``[-7, 7]``; fp4: an E2M1 nibble (bit 3 the sign; magnitudes 0, 0.5, 1, 1.5, 2,
    3, 4, 6 for codes 0..7, OCP MX v1.0); int2: codes 0..3 are -1.5, -0.5, 0.5, 1.5 (a midrise
    grid); sign: bit 1 is +1.0, bit 0 is -1.0.
    """
    if codec == "int8":
        return codes.view(xp.int8).astype(xp.float32)
    c = _bits.unpack_codes(xp, codes, 8 // CODES_PER_BYTE[codec])
    if codec == "int4":
        return c.astype(xp.float32) - 8.0
    if codec == "int2":
        return c.astype(xp.float32) - xp.float32(1.5)
    if codec == "sign":
        return c.astype(xp.float32) * xp.float32(2.0) - xp.float32(1.0)
    mag = (c & 7).astype(xp.float32)
    v = xp.where(mag < 4, mag * 0.5, xp.where(mag < 7, mag - 2.0, 6.0))
    return xp.where((c & 8) != 0, -v, v)
