"""A peer's contribution to a round: checked, and encoded once.

What a round moves is an *encoded* contribution (a host :class:`~ravnest_jax.compress.Packed`:
per leaf, its payload arrays), cut into parts on codec block boundaries
(:class:`~ravnest_jax.compress._parts.PartLayout`): the part messages are views of its arrays.
``rj.OuterSync`` hands the swarm the message its device encoded (``Contribution(packed, ...)``:
nothing is decoded or encoded again on the host); ``Swarm.all_reduce`` of float32 arrays encodes
them once (:meth:`Contribution.of`; for ``fp32`` the arrays themselves are the payload).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..wire._codec import LeafSpec, Packed, PartLayout, RangeDecoder, host_pack, part_chunks
from ..wire._types import flatten

_FINITE_STEP = 1 << 18  # elements checked per pass (no input-sized temporary)


def _check_finite(vec: np.ndarray) -> bool:
    for lo in range(0, vec.size, _FINITE_STEP):
        c = vec[lo : lo + _FINITE_STEP]
        with np.errstate(invalid="ignore"):
            if not (np.isfinite(c.max()) and np.isfinite(c.min())):
                return False
    return True


def _checked(weight: Any, state: Any) -> tuple[np.float32, tuple[int, str] | None]:
    w = float(weight)
    if not (math.isfinite(w) and w > 0):
        raise ValueError(f"weight must be finite and > 0, got {weight!r}")
    if state is not None:
        if not (
            isinstance(state, tuple)
            and len(state) == 2
            and isinstance(state[0], int)
            and isinstance(state[1], str)
            and 0 < len(state[1]) <= 128
        ):
            raise ValueError(f"state must be (round: int, digest: str of 1-128 chars), got {state!r}")
        state = (int(state[0]), state[1])
    return np.float32(w), state


@dataclasses.dataclass(frozen=True)
class Contribution:
    """A peer's contribution to a round: ``Contribution(packed, weight, state)`` for one already
    encoded (``rj.OuterSync``: the device's message, fetched to the host; the mean comes back
    flat, leaf after leaf), :meth:`of` for float32 arrays.

    Attributes:
      packed: the encoded contribution (host numpy arrays): what goes on the wire.
      weight: the weight, finite and > 0 (float32 once checked).
      state: ``(round, state digest)`` or ``None``.
      vec: the float32 ``(n,)`` values when the contribution came as float32 arrays (the own
        part is read from it), else ``None`` (decoded from ``packed`` where needed).
      leaves: ``(names, shapes)`` of the caller's leaves (the round manifest) when they are not
        ``packed``'s own leaves.
      layout: its :class:`PartLayout` (where parts may be cut).
      names, shapes: the caller's leaves; offsets: ``(len(leaves) + 1,)`` int64 start offsets
        of the caller's leaves in the flat vector of :attr:`layout`'s ``n`` elements.

    Raises:
      ValueError: a weight that is not finite and > 0, a ``state`` that is not ``(int, str of
        1-128 chars)``.
    """

    packed: Packed
    weight: Any
    state: Any = None
    vec: np.ndarray | None = None
    leaves: tuple[list[str], list[tuple[int, ...]]] | None = None
    _unflatten: Callable[[list[np.ndarray]], Any] | None = None

    layout: PartLayout = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        weight, state = _checked(self.weight, self.state)
        if self.leaves is None:
            leaves = ([s.name for s in self.packed.specs], [tuple(s.shape) for s in self.packed.specs])
            object.__setattr__(self, "leaves", leaves)
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "layout", PartLayout.of(self.packed))

    @property
    def names(self) -> list[str]:
        return self.leaves[0]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return self.leaves[1]

    @property
    def offsets(self) -> np.ndarray:
        return np.cumsum([0] + [math.prod(s) for s in self.shapes])

    @classmethod
    def of(
        cls,
        tree: Any,
        weight: float,
        state: Any = None,
        *,
        codec: str = "fp32",
        codec_options: dict[str, Any] | None = None,
        copy: bool = True,
    ) -> Contribution:
        """Checks, flattens and encodes ``tree`` (nested dict/list/tuple of float32 arrays).

        The leaves are raveled into one float32 vector (a view of a single contiguous leaf when
        ``copy`` is False: the caller must not change it during the round) and encoded as one
        leaf with ``codec``: for ``fp32`` the vector is the payload (no copy).

        Raises:
          TypeError: a leaf is not a float32 array. ValueError: no leaves, NaN or infinity, a
          bad weight or state (the class's), a bad codec option.
        """
        _checked(weight, state)  # before any work
        names, leaves, unflatten = flatten(tree)
        if not leaves:
            raise ValueError("tree has no leaves")
        if len(leaves) == 1 and not copy:
            vec = np.ravel(leaves[0])
        else:
            vec = np.concatenate([np.ravel(x) for x in leaves])
        vec = vec.astype(np.float32, copy=False)
        if not _check_finite(vec):
            raise ValueError("tree holds NaN or infinity")
        if codec == "fp32":
            spec = LeafSpec("pg", (vec.size,), "float32", 0, 0)
            packed = Packed("fp32", (spec,), ("d", (("pg", 0),)), ((vec,),), (True,))
        else:
            packed = host_pack({"pg": vec}, codec, **(codec_options or {}))
        return cls(packed, weight, state, vec, (names, [x.shape for x in leaves]), unflatten)

    @property
    def n(self) -> int:
        """Elements of the flat contribution."""
        return self.layout.n

    def part(self, lo: int, hi: int) -> list[bytes | memoryview]:
        """The wire message of elements ``[lo, hi)`` (views of :attr:`packed`)."""
        return part_chunks(self.packed, self.layout, lo, hi)

    def chunk_reader(self, lo: int, hi: int) -> Callable[[int, int], np.ndarray]:
        """``read(a, b)``: the unweighted float32 values of elements ``[lo + a, lo + b)`` (a grid
        chunk of part ``[lo, hi)``), as every receiver decodes them; views of :attr:`vec` for
        fp32, else decoded from this part's own message a chunk at a time, as they are asked for."""
        if self.vec is not None and self.packed.codec == "fp32":
            vec = self.vec
            return lambda a, b: vec[lo + a : lo + b]
        return _OwnReader(self, lo, hi)

    def vector(self) -> np.ndarray:
        """The whole contribution as float32 ``(n,)``, as every receiver decodes it (the ring
        works on it)."""
        if self.vec is not None and self.packed.codec == "fp32":
            return self.vec
        out = np.empty(self.n, np.float32)
        dec = RangeDecoder(self.layout, 0, self.n, out=out)
        for c in self.part(0, self.n):
            dec.feed(c)
        dec.finish()
        return out

    def unflatten(self, vec: np.ndarray) -> Any:
        """A flat float32 mean back into the caller's tree structure (views), or the flat vector
        itself for an encoded contribution."""
        if self._unflatten is None:
            return vec
        o = self.offsets
        return self._unflatten([vec[o[i] : o[i + 1]] for i in range(len(o) - 1)])


class _OwnReader:
    """This peer's own part of an encoded contribution, decoded grid chunk by grid chunk as it
    is asked for (in order; asking for an earlier chunk starts a new pass): never more than a
    few chunks decoded at once, not the whole part."""

    _FEED = 1 << 18  # message bytes decoded per step

    def __init__(self, contrib: Contribution, lo: int, hi: int):
        self.contrib, self.lo, self.hi = contrib, lo, hi
        self.index = {ab: j for j, ab in enumerate(contrib.layout.chunk_grid(lo, hi))}
        self._restart()

    def _restart(self) -> None:
        self.ready: dict[int, np.ndarray] = {}
        self.next = 0  # the next chunk a caller may ask for without a new pass
        self.dec = RangeDecoder(self.contrib.layout, self.lo, self.hi, self.ready.__setitem__)
        self.pieces = iter(
            mv[i : i + self._FEED]
            for mv in (memoryview(c).cast("B") for c in self.contrib.part(self.lo, self.hi))
            for i in range(0, len(mv), self._FEED)
        )

    def __call__(self, a: int, b: int) -> np.ndarray:
        j = self.index[(a, b)]
        if j < self.next:
            self._restart()
        while j not in self.ready:
            self.dec.feed(next(self.pieces))
        for k in [k for k in self.ready if k < j]:
            del self.ready[k]
        self.next = j + 1
        return self.ready.pop(j)
