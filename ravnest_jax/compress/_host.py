"""Host-side (numpy, jax-free) encoding and averaging of pseudo-gradient pytrees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _formats as F
from . import _tree
from ._errors import NonFiniteError
from ._wire import ALLOWED_DTYPES, DEFAULT_MAX_BYTES, LeafSpec, Packed, packed_to_bytes

__all__ = ["encode", "host_pack", "payload_ratio", "weighted_mean"]


def _leaf_array(leaf: Any, name: str) -> tuple[np.ndarray, str]:
    a = np.asarray(leaf)
    dtype = a.dtype.name
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(
            f"pseudo-gradient leaf {name!r} has dtype {dtype}; expected one of {', '.join(ALLOWED_DTYPES)}"
        )
    return a, dtype


_CHUNK = 1 << 17  # elements per numpy pass, so that the temporaries stay in the CPU caches
_F16_CHUNK = 1 << 16

_MAX_ABS_BITS = np.uint32(np.float32(F.MAX_ABS).view(np.uint32))
_HALF_MIN_NORMAL = np.float32(2.0**-14)
_HALF_MAX = np.float32(F.FP16_MAX)
_HALF_REBIAS = np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)  # exponent 127 -> 15, + 0xfff
_HALF_SUB_OFFSET = np.uint32(0x3F000000 + 0x400)  # bits(0.5) + the min normal half's bits


def _host_fp16(x: np.ndarray) -> tuple[bool, np.ndarray]:
    """fp16 parts of a flat float32 leaf: ``F.quantize``'s ``clip(x, -65504, 65504)`` cast to
    IEEE half bits (round half to even), by arithmetic on the float32 bits in chunks of 2**16
    elements with reused scratch arrays (numpy's own float32 -> float16 cast runs at ~0.45 GB/s
    on one core; this ~2.5x faster). The same bits as the cast (tested on every half, every
    midpoint between two halves and their neighbours, and random bit patterns).

    ``|x|`` is split into a normal part ``clip(|x|, 2**-14, 65504)``, rounded by integer
    arithmetic (exponent rebiased, ``0xfff`` plus the lowest kept mantissa bit added before the
    shift by 13: half to even), and a subnormal part ``min(|x|, 2**-14)``, rounded to a multiple
    of the half subnormal spacing ``2**-24`` by a float32 add of 0.5. Each part is exact where
    ``|x|`` lies in its range and contributes the smallest normal half's bits ``0x400`` where it
    does not, so their sum minus ``0x400`` is the magnitude's half bits; then the sign. No
    selects (numpy's masked copy is ~10x slower than an arithmetic pass). Needs float32
    subnormals not flushed to zero (numpy's default).

    Returns ``(ok, bits)``: ``ok`` False for NaN, Inf or ``|x| > 2**127`` (checked on the same
    ``|x|`` bits; then ``bits`` is garbage), ``bits`` a ``(n,)`` ``<u2`` array.
    """
    n = x.shape[0]
    out = np.empty(n, np.dtype("<u2"))
    m = min(n, _F16_CHUNK)
    a_buf, t_buf, l_buf = (np.empty(m, np.uint32) for _ in range(3))
    u = x.view(np.uint32)
    for i in range(0, n, _F16_CHUNK):
        j = min(n, i + _F16_CHUNK)
        k = j - i
        a, t, lo, ub, o = a_buf[:k], t_buf[:k], l_buf[:k], u[i:j], out[i:j]
        np.bitwise_and(ub, np.uint32(0x7FFFFFFF), out=a)  # |x|
        if int(a.max()) > _MAX_ABS_BITS:  # NaN bits lie above Inf's
            return False, out
        af, lof = a.view(np.float32), lo.view(np.float32)  # non-negative floats order as their bits
        np.minimum(af, _HALF_MIN_NORMAL, out=lof)  # the subnormal part
        np.add(lof, np.float32(0.5), out=lof)  # rounded to a multiple of 2**-24, half to even
        np.subtract(lo, _HALF_SUB_OFFSET, out=lo)  # its half bits minus 0x400
        np.clip(af, _HALF_MIN_NORMAL, _HALF_MAX, out=af)  # the normal part, saturated at 65504
        np.right_shift(a, np.uint32(13), out=t)
        np.bitwise_and(t, np.uint32(1), out=t)  # the lowest kept mantissa bit: ties to even
        np.add(t, a, out=t)
        np.add(t, _HALF_REBIAS, out=t)
        np.right_shift(t, np.uint32(13), out=t)  # its half bits (0x400 below 2**-14)
        np.add(t, lo, out=t)
        np.right_shift(ub, np.uint32(16), out=o, casting="unsafe")
        np.bitwise_and(o, np.uint16(0x8000), out=o)  # the sign
        np.bitwise_or(o, t, out=o, casting="unsafe")  # t < 2**15
    return True, out


def _host_quantize(cfg: F.CodecConfig, x: np.ndarray, noise: Any) -> tuple[bool, tuple[np.ndarray, ...]]:
    """``F.quantize`` with numpy, chunk by chunk for long leaves (blocks are independent, so the
    parts are the same as in one pass; only the stochastic noise is drawn chunk by chunk)."""
    n = x.shape[0]
    if cfg.codec == "fp16":
        ok, bits = _host_fp16(x)
        return ok, (bits,)
    if cfg.codec in ("fp32", "topk") or n <= 2 * _CHUNK:
        ok, parts = F.quantize(np, cfg, x, noise=noise, topk_indices=F.np_topk_indices)
        return bool(ok), tuple(parts)
    step = cfg.block_size * max(1, _CHUNK // cfg.block_size) if cfg.block_size else _CHUNK
    lengths = F.part_lengths(cfg.codec, n, cfg.block_size, 0)
    outs = [np.empty(length, dt) for length, dt in zip(lengths, F.part_dtypes(cfg.codec))]
    offs = [0] * len(outs)
    for i in range(0, n, step):
        ok, parts = F.quantize(np, cfg, x[i : i + step], noise=noise)
        if not bool(ok):
            return False, ()
        for j, p in enumerate(parts):
            outs[j][offs[j] : offs[j] + p.shape[0]] = p
            offs[j] += p.shape[0]
    return True, tuple(outs)


def host_pack(tree: Any, codec: str = "int4", *, seed: int | None = None, **options: Any) -> Packed:
    """numpy version of ``device_encode`` without error feedback: ``tree`` -> :class:`Packed`.

    Raises:
      NonFiniteError: a leaf holds NaN, Inf or ``|x| > 2**127`` (names the leaf).
      ValueError: bad codec or option, a non-float leaf, an unsupported container.
    """
    cfg = F.resolve(codec, **options)
    leaves, names, structure = _tree.flatten(tree)
    rng = np.random.default_rng(seed) if cfg.stochastic else None
    noise = (lambda shape: rng.random(shape, dtype=np.float32)) if rng is not None else None
    specs, parts, oks = [], [], []
    for leaf, name in zip(leaves, names):
        a, dtype = _leaf_array(leaf, name)
        x = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
        with np.errstate(invalid="ignore", over="ignore"):  # garbage parts are dropped if not ok
            ok, p = _host_quantize(cfg, x, noise)
        if not bool(ok):
            raise NonFiniteError(
                f"pseudo-gradient leaf {name!r} has NaN, Inf or |x| > 2**127 values; refusing to "
                "encode it (a diverged peer must not poison the swarm)",
                leaf=name,
            )
        k = F.topk_count(x.shape[0], cfg.fraction) if cfg.codec == "topk" else 0
        specs.append(LeafSpec(name, tuple(int(d) for d in a.shape), dtype, cfg.block_size, k))
        parts.append(p)
        oks.append(True)
    return Packed(cfg.codec, tuple(specs), structure, tuple(parts), tuple(oks))


def encode(
    tree: Any,
    codec: str = "int4",
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    seed: int | None = None,
    **options: Any,
) -> bytes:
    """Encodes a pytree of pseudo-gradient arrays into one self-describing message (host, numpy).

    The same math as the jitted ``device_encode``; for the deterministic codecs the bytes are
    identical to ``packed_to_bytes(device_encode(tree, codec, ...)[0])``.

    Args:
      tree: nested dicts (str keys), lists and tuples of array-likes (numpy arrays, jax arrays,
        scalars) with a float dtype: float32, bfloat16, float16 or float64 (cast to float32).
        Leaf names in the header are the ``/``-joined paths (``"layer0/w"``).
      codec: one of ``CODECS``: ``"fp32"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"int4"``,
        ``"fp4"``, ``"int2"``, ``"sign"``, ``"topk"``.
      max_bytes: refuse to build a larger message (bytes).
      seed: seed of numpy's PRNG for stochastic rounding (``stochastic=True``).
      **options: ``block_size`` (int8/int4/fp4/int2/sign; default 64/64/32/64/64; int2 and sign
        a power of two >= 8), ``fraction`` (topk, default
        0.01), ``stochastic`` (bf16/int8/int4/fp4, default False).

    Returns:
      The message bytes (see ``docs/compression.md`` for the layout and sizes).

    Raises:
      NonFiniteError: a leaf holds NaN, Inf or ``|x| > 2**127``; the message names the leaf.
      ValueError: unknown codec or option, an option that does not apply to the codec, a bad
        option value, a non-float leaf, a dict key that is not a str, duplicate leaf names, or a
        message above ``max_bytes``.
    """
    return packed_to_bytes(host_pack(tree, codec, seed=seed, **options), max_bytes=max_bytes)


def weighted_mean(items: Sequence[Any], weights: Sequence[float] | None = None) -> Any:
    """Weighted mean of several decoded pseudo-gradients, on the host in float32.

    ``mean = sum_i (w_i / W) * x_i`` with ``W = sum_i w_i``, accumulated in float32 in the given
    order (deterministic: the same inputs in the same order give the same bits on every peer).

    Args:
      items: a non-empty sequence of pytrees with identical structure and leaf shapes (as
        returned by ``decode``), or of flat arrays of one shape.
      weights: non-negative finite numbers with a positive sum, one per item (for example token
        counts); ``None`` for equal weights.

    Returns:
      A pytree (or an array) of float32 numpy arrays.

    Raises:
      ValueError: no items, a weight count mismatch, negative/non-finite weights, a zero sum, or
        items whose structure or shapes differ.
    """
    items = list(items)
    if not items:
        raise ValueError("weighted_mean needs at least one item")
    if weights is None:
        weights = [1.0] * len(items)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(items),):
        raise ValueError(f"expected {len(items)} weights, got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
        raise ValueError(f"weights must be finite, non-negative, with a positive sum; got {list(weights)}")
    wn = (w / w.sum()).astype(np.float32)
    flat = []
    structure = None
    for i, item in enumerate(items):
        leaves, _, st = _tree.flatten(item)
        if structure is None:
            structure = st
        elif st != structure:
            raise ValueError(f"item {i} has a different tree structure than item 0")
        flat.append(leaves)
    out = []
    for j in range(len(flat[0])):
        first = np.asarray(flat[0][j], dtype=np.float32)
        acc = first * wn[0]
        tmp = None  # one scratch array per leaf instead of a new temporary per item
        for i in range(1, len(items)):
            x = np.asarray(flat[i][j], dtype=np.float32)
            if x.shape != first.shape:
                raise ValueError(f"leaf {j} of item {i} has shape {x.shape}, item 0 has {first.shape}")
            if wn[i] != 0:
                if tmp is None:
                    tmp = np.empty_like(acc)
                np.multiply(x, wn[i], out=tmp)
                acc += tmp
        out.append(acc)
    return _tree.unflatten(structure, out)


def payload_ratio(codec: str, n: int, **options: Any) -> float:
    """Payload bytes per float32 byte for one leaf of ``n`` elements (without the header)."""
    cfg = F.resolve(codec, **options)
    k = F.topk_count(n, cfg.fraction) if cfg.codec == "topk" else 0
    return F.payload_nbytes(cfg.codec, n, cfg.block_size, k) / max(1, 4 * n)
