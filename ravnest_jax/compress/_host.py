"""Host-side (numpy, jax-free) encoding and averaging of pseudo-gradient pytrees."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _formats as F
from . import _tree
from ._wire import ALLOWED_DTYPES, DEFAULT_MAX_BYTES, LeafSpec, Packed, check_finite_leaf, packed_to_bytes

_CHUNK = 1 << 17  # elements per numpy pass, so that the temporaries stay in the CPU caches


def _host_quantize(cfg: F.CodecConfig, x: np.ndarray, noise: Any) -> tuple[bool, tuple[np.ndarray, ...]]:
    """``F.quantize`` with numpy, chunk by chunk for long leaves (blocks are independent, so the
    parts are the same as in one pass; only the stochastic noise is drawn chunk by chunk)."""
    n = x.shape[0]
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


def pack_leaves(cfg: F.CodecConfig, tree: Any, asarray: Any, encode: Any) -> Packed:
    """The :class:`Packed` of ``tree`` (host or device arrays): ``encode(i, name, a)`` gives leaf
    ``i`` (``asarray(leaf)``, a float array) as ``(ok, parts)``.

    Raises:
      ValueError: a leaf of another dtype than :data:`ALLOWED_DTYPES`, or a tree ``_tree.flatten``
        refuses.
    """
    leaves, names, structure = _tree.flatten(tree)
    specs, parts, oks = [], [], []
    for i, (leaf, name) in enumerate(zip(leaves, names)):
        a = asarray(leaf)
        if a.dtype.name not in ALLOWED_DTYPES:
            raise ValueError(
                f"pseudo-gradient leaf {name!r} has dtype {a.dtype.name}; expected one of {', '.join(ALLOWED_DTYPES)}"
            )
        ok, p = encode(i, name, a)
        shape = tuple(int(d) for d in a.shape)
        specs.append(LeafSpec(name, shape, a.dtype.name, cfg.block_size, cfg.k(math.prod(shape))))
        parts.append(p)
        oks.append(ok)
    return Packed(cfg.codec, tuple(specs), structure, tuple(parts), tuple(oks))


def host_pack(tree: Any, codec: str = "int4", *, seed: int | None = None, **options: Any) -> Packed:
    """numpy version of ``device_encode`` without error feedback: ``tree`` -> :class:`Packed`.

    Raises:
      NonFiniteError: a leaf holds NaN, Inf or ``|x| > 2**127`` (names the leaf).
      ValueError: bad codec or option, a non-float leaf, an unsupported container.
    """
    cfg = F.resolve(codec, **options)
    rng = np.random.default_rng(seed) if cfg.stochastic else None
    noise = (lambda shape: rng.random(shape, dtype=np.float32)) if rng is not None else None

    def leaf(i: int, name: str, a: np.ndarray) -> tuple[bool, tuple[np.ndarray, ...]]:
        x = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
        with np.errstate(invalid="ignore", over="ignore"):  # garbage parts are dropped if not ok
            ok, p = _host_quantize(cfg, x, noise)
        check_finite_leaf(name, ok)
        return True, p

    return pack_leaves(cfg, tree, np.asarray, leaf)


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
      codec: one of ``CODECS``: ``"fp32"``, ``"bf16"``, ``"int8"``, ``"int4"``, ``"fp4"``,
        ``"int2"``, ``"sign"``, ``"topk"``.
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
    flat, structure = [], None
    for i, item in enumerate(items):
        leaves, _, st = _tree.flatten(item)
        if i and st != structure:
            raise ValueError(f"item {i} has a different tree structure than item 0")
        flat.append(leaves)
        structure = st
    out = []
    for j in range(len(flat[0])):
        first = np.asarray(flat[0][j], dtype=np.float32)
        acc = first * wn[0]
        tmp = np.empty_like(acc) if len(items) > 1 else None  # one scratch array per leaf, not per item
        for i in range(1, len(items)):
            x = np.asarray(flat[i][j], dtype=np.float32)
            if x.shape != first.shape:
                raise ValueError(f"leaf {j} of item {i} has shape {x.shape}, item 0 has {first.shape}")
            if wn[i] != 0:
                np.multiply(x, wn[i], out=tmp)
                acc += tmp
        out.append(acc)
    return _tree.unflatten(structure, out)


def payload_ratio(codec: str, n: int, **options: Any) -> float:
    """Payload bytes per float32 byte for one leaf of ``n`` elements (without the header)."""
    cfg = F.resolve(codec, **options)
    return F.payload_nbytes(cfg.codec, n, cfg.block_size, cfg.k(n)) / max(1, 4 * n)
