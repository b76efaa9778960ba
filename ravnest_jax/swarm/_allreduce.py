"""Pure helpers of the butterfly all-reduce: part bounds, manifests, float32 reduction."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import msgpack
import numpy as np

CHUNK = 1 << 20  # bytes per streamed chunk


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


def weighted_mean(parts: Mapping[str, tuple[np.float32, np.ndarray]],
                  contributors: Sequence[str]) -> tuple[np.ndarray, np.float32]:
    """Float32 weighted mean of ``parts[c]`` over ``contributors`` in sorted-id order.

    The fixed order makes the result bit-identical wherever it is computed. Returns
    ``(mean, total_weight)``.
    """
    order = sorted(contributors)
    first = parts[order[0]][1]
    acc = np.zeros(first.shape, dtype=np.float32)
    total = np.float32(0.0)
    tmp = np.empty_like(acc)
    for c in order:
        w, x = parts[c]
        np.multiply(x, np.float32(w), out=tmp)
        acc += tmp
        total = np.float32(total + np.float32(w))
    acc /= total
    return acc, total
