"""Pure helpers of the all-reduce: part bounds, ring segments, manifests, float32 reduction."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import msgpack
import numpy as np

CHUNK = 1 << 20  # bytes per streamed chunk (writes; reads take what the socket delivers)


def part_bounds(total: int, n: int) -> list[tuple[int, int]]:
    """Split ``total`` elements into ``n`` contiguous parts; the first ``total % n`` are 1 longer."""
    base, rem = divmod(total, n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + base + (1 if i < rem else 0)
        out.append((lo, hi))
        lo = hi
    return out


def manifest_digest(names: Sequence[str], shapes: Sequence[tuple[int, ...]], wire: str) -> str:
    """Digest of a round's manifest (hex, 32 chars): leaf names, shapes and ``wire``, the codec
    and algorithm (``"int8/butterfly"``): peers that disagree on any of them refuse each other."""
    blob = msgpack.packb([list(names), [list(map(int, s)) for s in shapes], wire])
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def max_message_bytes(length: int) -> int:
    """The largest message accepted for a part of ``length`` float32 elements, bytes."""
    return 4 * length + (1 << 20)


def contributors_tag(contributors: Sequence[str], clipped: Mapping[str, float] | None = None) -> str:
    """Short digest of a contributor set (sorted ids) and, for the clipped mean, the factors of
    the clipped ones: the tag a pushed result part carries, so that a part reduced over another
    set or other factors (an optimistic one) is never mixed in."""
    blob = "\n".join(sorted(contributors)).encode()
    if clipped:
        blob += b"\nclipped\n" + "\n".join(f"{c}={float(x)!r}" for c, x in sorted(clipped.items())).encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def mean_of_scaled(
    parts: Mapping[str, tuple[np.float32, np.ndarray]], contributors: Sequence[str], out: np.ndarray | None = None
) -> tuple[np.ndarray, np.float32]:
    """Float32 ``sum_c s_c / sum_c w_c`` over ``contributors`` in sorted-id order, where
    ``parts[c] = (w_c, s_c)`` holds the already weighted part ``s_c = w_c * x_c`` (float32).

    Leaves ``parts`` untouched (they may be needed again for another contributor set); the
    result goes to ``out`` (a float32 buffer of the parts' shape that the caller reuses from
    round to round: no fresh pages to fault in) or to a new array. Returns ``(mean,
    total_weight)``.
    """
    order = sorted(contributors)
    first = parts[order[0]][1]
    acc = np.empty_like(first) if out is None else out
    if len(order) == 1:
        np.copyto(acc, first)
    else:
        np.add(first, parts[order[1]][1], out=acc)
    for c in order[2:]:
        np.add(acc, parts[c][1], out=acc)
    total = np.float32(0.0)
    for c in order:
        total = np.float32(total + np.float32(parts[c][0]))
    np.divide(acc, total, out=acc)
    return acc, total


def weighted_mean(
    parts: Mapping[str, tuple[np.float32, np.ndarray]], contributors: Sequence[str]
) -> tuple[np.ndarray, np.float32]:
    """Float32 weighted mean of ``parts[c] = (w_c, x_c)`` over ``contributors`` in sorted-id
    order (each ``x_c * w_c`` rounded to float32 first, as the swarm does on arrival).

    The fixed order makes the result bit-identical wherever it is computed. Returns
    ``(mean, total_weight)``.
    """
    scaled = {c: (parts[c][0], np.multiply(parts[c][1], np.float32(parts[c][0]))) for c in contributors}
    return mean_of_scaled(scaled, contributors)


RING_SEGMENT_BYTES = 1 << 20  # float32 bytes per pipelined ring segment (default)


def ring_segments(
    bounds: Sequence[tuple[int, int]], segment_bytes: int = RING_SEGMENT_BYTES
) -> list[list[tuple[int, int]]]:
    """The pipelined ring's segments of every part: ``out[c][j] = (lo, hi)`` (absolute).

    Every part is cut into the same number S of contiguous segments (``part_bounds``), S =
    ceil(longest part / segment elements), at least 1 and at most the shortest part's length
    (no empty segment unless a part is empty). A pure function of the round's bounds and
    ``segment_bytes`` (which is part of the ring's manifest), so every peer agrees on it.
    """
    seg = max(1, int(segment_bytes) // 4)
    lengths = [hi - lo for lo, hi in bounds]
    s = max(1, min(-(-max(lengths) // seg), min(lengths)))
    return [[(lo + a, lo + b) for a, b in part_bounds(hi - lo, s)] for lo, hi in bounds]


# ---------------------------------------------------------------------- robust aggregation
AGGREGATORS = ("mean", "clipped_mean", "trimmed_mean")
ABSTAIN_BELOW = 1e-20  # weights under this are abstainers (zeros from a peer that missed its round)


def squared_norm(vec: np.ndarray, chunk: int = 1 << 18) -> float:
    """``sum(vec ** 2)`` of a float32 vector: float32 BLAS, and when that overflows, accumulated
    in float64 chunk by chunk (no overflow for any finite float32 values, no full-size
    temporary)."""
    with np.errstate(over="ignore"):
        fast = float(np.dot(vec, vec))  # float32 BLAS: one pass, no copy
    if np.isfinite(fast):
        return fast
    total = 0.0  # over float32's range: again in float64
    for lo in range(0, vec.size, chunk):
        c = vec[lo : lo + chunk].astype(np.float64)
        total += float(np.dot(c, c))
    return total


def check_aggregator(aggregator: str, clip_multiple: float, trim: int) -> None:
    """Raise ``ValueError`` (one line) for an unknown aggregator or a bad ``clip_multiple``/``trim``."""
    if aggregator not in AGGREGATORS:
        raise ValueError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")
    if not (isinstance(clip_multiple, (int, float)) and np.isfinite(clip_multiple) and clip_multiple >= 1.0):
        raise ValueError(f"clip_multiple must be a finite number >= 1, got {clip_multiple!r}")
    if not (isinstance(trim, int) and not isinstance(trim, bool) and trim >= 1):
        raise ValueError(f"trim must be an int >= 1, got {trim!r}")


def clip_scales(norms: Mapping[str, float], contributors: Sequence[str], clip_multiple: float) -> dict[str, float]:
    """The clipped mean's factor of every contributor: ``min(1, k * m / norm_c)``.

    ``norms[c]``: the L2 norm of contributor ``c``'s whole (unweighted) pseudo-gradient, summed
    from what every part owner measured; ``m``: the lower median of the non-zero norms (an
    abstainer, a peer that missed its round, sends zeros: it does not pull the median down), so
    that with two peers the smaller norm bounds the larger; ``k = clip_multiple``. A pure float64 function
    of the round's decision, so every owner applies the same factors. Returns only the factors
    below 1 (the clipped contributors).

    Centered-clipping family of robust aggregators (Karimireddy et al., arXiv 2012.10333);
    here the centre is 0 (the pseudo-gradient) and the radius follows the round's median norm.
    """
    real = sorted(float(norms[c]) for c in contributors if float(norms[c]) > 0)
    if not real:
        return {}
    bound = float(clip_multiple) * real[(len(real) - 1) // 2]
    return {c: bound / float(norms[c]) for c in sorted(contributors) if float(norms[c]) > bound}


def trimmed_mean(
    parts: Mapping[str, tuple[np.float32, np.ndarray]], contributors: Sequence[str], trim: int
) -> tuple[np.ndarray, dict[str, int]]:
    """Coordinate-wise trimmed mean of the unweighted parts ``parts[c] = (w_c, x_c)``.

    Per coordinate, the ``b`` largest and ``b`` smallest values among the contributors that are
    not abstainers (weight >= ``ABSTAIN_BELOW``) are dropped and the rest averaged (unweighted),
    ``b = min(trim, (n - 1) // 2)``: 2 contributors give their mean, 3 with ``trim=1`` their
    median. Abstainers only count when every contributor is one (then their plain mean, zeros).
    Float32, order-independent (values are sorted), so the result is the same wherever it is
    computed. Yin et al., "Byzantine-robust distributed learning", arXiv 1803.01498.

    Returns:
      ``(mean, dropped)``: float32 of the parts' shape, and ``dropped[c]``: the number of
      coordinates where contributor ``c``'s value was dropped (only contributors dropped at
      least once).
    """
    order = [c for c in sorted(contributors) if float(parts[c][0]) >= ABSTAIN_BELOW] or sorted(contributors)
    n = len(order)
    b = min(int(trim), (n - 1) // 2)
    if b == 0:
        acc = np.array(parts[order[0]][1], dtype=np.float32)
        for c in order[1:]:
            np.add(acc, parts[c][1], out=acc)
        return np.divide(acc, np.float32(n), out=acc), {}
    stack = np.stack([parts[c][1] for c in order])  # (n, P) float32
    idx = np.argsort(stack, axis=0, kind="stable")
    kept = np.take_along_axis(stack, idx[b : n - b], axis=0)
    del stack
    mean = np.divide(kept.sum(axis=0, dtype=np.float32), np.float32(n - 2 * b)).astype(np.float32)
    counts = np.bincount(np.concatenate([idx[:b].ravel(), idx[n - b :].ravel()]), minlength=n)
    return mean, {order[i]: int(k) for i, k in enumerate(counts) if k}
