"""topk's exact selection on the host (numpy): the ``k`` largest magnitudes of a float32
vector, ties toward lower indices (the same selection as ``jax.lax.top_k``). Imports neither jax
nor anything that does; re-exported as ``_formats.np_topk_indices``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

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
