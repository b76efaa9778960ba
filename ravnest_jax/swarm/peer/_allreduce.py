"""Pure helpers of the all-reduce: part bounds, ring segments, manifests, part limits, norms."""

from __future__ import annotations

import dataclasses
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


def part_limit(codec: str, length: int) -> int:
    """The most bytes accepted for a part (or result part) of ``length`` elements."""
    return (8 if codec == "topk" else 4) * length + (1 << 20)


def contributors_tag(contributors: Sequence[str], clipped: Mapping[str, float] | None = None) -> str:
    """Short digest of a contributor set (sorted ids) and, for the clipped mean, the factors of
    the clipped ones: the tag a pushed result part carries, so that a part reduced over another
    set or other factors (an optimistic one) is never mixed in."""
    blob = "\n".join(sorted(contributors)).encode()
    if clipped:
        blob += b"\nclipped\n" + "\n".join(f"{c}={float(x)!r}" for c, x in sorted(clipped.items())).encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


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
ALGORITHMS = ("butterfly", "ring")
AGGREGATORS = ("mean", "clipped_mean")


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


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """How a round combines the peers' contributions: the algorithm and its knobs, one value.

    ``rj.Swarm(algorithm=rj.AllReduce("butterfly", aggregator="mean"))``; a name alone
    (``algorithm="ring"``) is ``AllReduce(name)``. Every peer of a run must use the same one
    (it is in the round manifest: a peer with another one is refused).

    Args:
      name: ``"butterfly"`` (default): a reduce-scatter to part owners, then an all-gather of
        the reduced parts (the butterfly all-reduce of hivemind/Moshpit SGD, arXiv 2103.03239);
        a failed owner retries the attempt without it. ``"ring"``: the pipelined ring
        all-reduce (2(n - 1) neighbour steps of segments; Patarasuk & Yuan 2009), which sums
        partial results hop by hop.
      aggregator: the butterfly's rule: ``"clipped_mean"`` (default: the weighted mean after a
        contribution whose L2 norm exceeds ``clip_multiple`` times the round's median norm is
        scaled down to that bound; the plain mean bit for bit while nobody is over it;
        centered clipping, arXiv 2012.10333) or ``"mean"`` (the weighted mean). The ring never
        holds one contributor's part: ``"mean"`` only.
      clip_multiple: the clipped mean's bound in multiples of the median norm (>= 1, default 2).
      segment_bytes: the ring's message size: every part is cut into segments of about this
        many float32 bytes (>= 4, default 1 MiB).

    Raises:
      ValueError: an unknown name or aggregator, a knob out of range, or a knob of the other
        algorithm (``segment_bytes`` with the butterfly; a robust aggregator or
        ``clip_multiple`` with the ring; ``clip_multiple`` with ``aggregator="mean"``).
    """

    name: str = "butterfly"
    aggregator: str | None = None
    clip_multiple: float | None = None
    segment_bytes: int | None = None

    def __post_init__(self) -> None:
        name, agg, k, seg = self.name, self.aggregator, self.clip_multiple, self.segment_bytes
        if name not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {name!r}")
        if agg is not None and agg not in AGGREGATORS:
            raise ValueError(f"aggregator must be one of {AGGREGATORS}, got {agg!r}")
        if k is not None and not (
            isinstance(k, (int, float)) and not isinstance(k, bool) and np.isfinite(k) and k >= 1.0
        ):
            raise ValueError(f"clip_multiple must be a finite number >= 1, got {k!r}")
        if name == "ring":
            if agg not in (None, "mean") or k is not None:
                raise ValueError(
                    f"aggregator={agg or 'clipped_mean'!r} needs algorithm='butterfly': the ring sums partial "
                    "results hop by hop and never holds one contributor's part"
                )
            if seg is None:
                seg = RING_SEGMENT_BYTES
            elif not (isinstance(seg, int) and not isinstance(seg, bool) and seg >= 4):
                raise ValueError(f"segment_bytes must be an int >= 4, got {seg!r}")
            agg = "mean"
        else:
            if seg is not None:
                raise ValueError("segment_bytes is the ring's knob (AllReduce('ring', segment_bytes=...))")
            agg = agg or "clipped_mean"
            if agg == "mean" and k is not None:
                raise ValueError("clip_multiple is the clipped mean's knob, not aggregator='mean''s")
            if agg == "clipped_mean":
                k = float(2.0 if k is None else k)
        object.__setattr__(self, "aggregator", agg)
        object.__setattr__(self, "clip_multiple", k)
        object.__setattr__(self, "segment_bytes", seg)

    @classmethod
    def of(cls, value: AllReduce | str | None) -> AllReduce:
        """``value`` as an :class:`AllReduce`: itself, ``AllReduce(name)`` for a name, the
        default (the butterfly with the clipped mean) for ``None``. Raises ``ValueError``/
        ``TypeError`` for anything else."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        raise TypeError(f"algorithm must be an rj.AllReduce or one of {ALGORITHMS}, got {type(value).__name__}")

    def manifest(self) -> tuple[str, str]:
        """``(algorithm, aggregator)`` as the round manifest names them, each with its knob:
        ``("ring:1048576", "mean")``, ``("butterfly", "clipped_mean:2.0")``."""
        algorithm = f"ring:{self.segment_bytes}" if self.name == "ring" else self.name
        aggregator = (
            f"clipped_mean:{self.clip_multiple!r}" if self.aggregator == "clipped_mean" else str(self.aggregator)
        )
        return algorithm, aggregator


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
