"""A part owner's streaming reduction: every member's part added into the result buffer as it
arrives, in a fixed order, so that no part is ever held whole and the sum has the same bits on
every run.

The butterfly all-reduce used to keep every received part (decoded, weighted) until the gather
vote and then reduce them: a part-sized float32 buffer per member (for 2 peers and 1 GiB, half a
GiB beside the result). :class:`Fold` adds each grid chunk (``compress._parts``) of a member's
part into the owner's slice of the round's output buffer as soon as every member before it in
sorted-id order has added that chunk: the same float32 operations in the same order as
reducing whole parts (``s_c = w_c * x_c``, then ``((s_0 + s_1) + s_2) + ...``; the reference in
``tests/swarm/test_fold.py``), so the result is
bit-identical to the old one, whatever the order the bytes arrive in. A chunk that cannot be
added yet (an earlier member is slower) waits in a small queue; when members arrive at similar
rates the queues stay short.

A member whose part fails after some of its chunks were added makes the sum *dirty*: it must be
recomputed from the members the gather vote keeps (the butterfly pulls their parts again).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ._allreduce import squared_norm


class Fold:
    """The sum ``sum_c s_c (w_c x_c)`` of one part over members in sorted-id order.

    Args:
      acc: float32 ``(plen,)``: where the sum goes (the owner's slice of the output buffer).
      grid: the part's grid chunks ``[(a, b), ...]`` (``PartLayout.chunk_grid``).
      order: the members that may contribute (any order; sorted here).
      own_id: this peer's id (in ``order``), whose chunks come from ``own_chunk``.
      own_chunk: ``own_chunk(a, b)`` -> this peer's unweighted float32 values of ``[a, b)``
        (may be a view: it is never written).
      own_weight: this peer's weight.
      scales: contributor -> factor (< 1) its weighted values are multiplied by (the clipped
        mean's decision), or ``None``.
      norms: also sum each member's squared L2 norm (unweighted), chunk by chunk.
    """

    def __init__(
        self,
        acc: np.ndarray,
        grid: Sequence[tuple[int, int]],
        order: Iterable[str],
        own_id: str,
        own_chunk: Callable[[int, int], np.ndarray],
        own_weight: np.float32,
        scales: dict[str, float] | None = None,
        norms: bool = False,
    ):
        self.acc, self.grid = acc, list(grid)
        self.order = sorted(set(order))
        self.own_id, self.own_chunk = own_id, own_chunk
        self.weights: dict[str, np.float32] = {own_id: np.float32(own_weight)}
        self.scales = {c: np.float32(s) for c, s in (scales or {}).items()}
        self.norms = norms
        self.sqnorms: dict[str, float] = {}
        self.folded = {c: 0 for c in self.order}  # chunks of each member added into acc
        self.queued: dict[str, deque[np.ndarray]] = {c: deque() for c in self.order}
        self.arrived = {c: 0 for c in self.order}  # chunks of each member received
        self.dirty = False
        self.abstained: set[str] = set()  # members whose part had weight 0 (out of the order)
        if norms and own_id in self.folded:
            self.sqnorms[own_id] = sum(squared_norm(own_chunk(a, b)) for a, b in self.grid)
        self._drain()  # this peer's own values, as far as the order allows now

    # ------------------------------------------------------------------ members
    def expect(self, member: str, weight: np.float32) -> None:
        """A member's part started to arrive, with its weight; weight 0: an abstainer's part,
        which carries no values: the member leaves the order (:attr:`abstained`), adding nothing."""
        self.weights[member] = np.float32(weight)
        if self.norms:
            self.sqnorms[member] = 0.0
        if not weight > 0 and member in self.folded and member != self.own_id:
            self.abstained.add(member)
            self._remove(member)

    def add(self, member: str, j: int, values: np.ndarray) -> None:
        """Grid chunk ``j`` of ``member``'s part (unweighted float32, owned: written in place).
        Chunks of one member come in order."""
        if member not in self.queued:  # dropped meanwhile
            return
        if j != self.arrived[member]:
            raise ValueError(f"chunk {j} of {member} out of order (expected {self.arrived[member]})")
        self.arrived[member] += 1
        if self.norms:
            self.sqnorms[member] += squared_norm(values)
        self._scale(member, values, values)
        self.queued[member].append(values)
        self._drain()

    def failed(self, member: str) -> None:
        """``member``'s part failed (cut off, refused, late): it is no longer in the sum. When
        some of its chunks were added already, the sum is dirty."""
        if member not in self.folded or member == self.own_id:
            return
        if self.folded[member]:
            self.dirty = True
        self._remove(member)

    def keep_only(self, members: Iterable[str]) -> None:
        """The final members: the others leave the sum (dirty if one of them was added in part);
        what waited behind them is added now."""
        keep = set(members)
        for c in [c for c in self.order if c not in keep]:
            if self.folded[c]:
                self.dirty = True
            self._remove(c)
        self._drain()

    def _remove(self, member: str) -> None:
        self.order.remove(member)
        del self.folded[member], self.queued[member], self.arrived[member]
        self._drain()

    # ------------------------------------------------------------------ the sum
    @property
    def complete(self) -> bool:
        """Every member in the order has added every chunk (and the sum is not dirty)."""
        n = len(self.grid)
        return not self.dirty and all(v == n for v in self.folded.values())

    def _scale(self, member: str, values: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out = values * w_c (* s_c)`` in float32 (a weight of 1 and no factor: a copy, the
        same bits); returns ``out``."""
        w, s = self.weights[member], self.scales.get(member)
        if w != 1 or s is not None:
            np.multiply(values, w, out=out)
            if s is not None:
                np.multiply(out, s, out=out)
        elif out is not values:
            np.copyto(out, values)
        return out

    def _fold_one(self, member: str, pos: int, values: np.ndarray) -> None:
        j = self.folded[member]
        a, b = self.grid[j]
        dst = self.acc[a:b]
        if pos == 0:
            np.copyto(dst, values)
        else:
            np.add(dst, values, out=dst)
        self.folded[member] = j + 1

    def _drain(self) -> None:
        if self.dirty:
            for q in self.queued.values():
                q.clear()  # nothing more is added to a dirty sum: free what waited
            return
        n = len(self.grid)
        limit = n  # chunks the previous member has added (everything for the first)
        for pos, c in enumerate(self.order):
            if c == self.own_id:
                while self.folded[c] < limit:
                    j = self.folded[c]
                    a, b = self.grid[j]
                    own = self.own_chunk(a, b)
                    if pos == 0:  # the first in the order: scaled straight into the sum
                        self._scale(c, own, self.acc[a:b])
                        self.folded[c] = j + 1
                    else:
                        self._fold_one(c, pos, self._scale(c, own, np.empty_like(own)))
            else:
                q = self.queued[c]
                while q and self.folded[c] < limit:
                    self._fold_one(c, pos, q.popleft())
            limit = self.folded[c]

    def total_weight(self, members: Iterable[str]) -> np.float32:
        """``sum_c w_c`` in float32, in sorted-id order (as the whole-part reference)."""
        total = np.float32(0.0)
        for c in sorted(members):
            total = np.float32(total + np.float32(self.weights[c]))
        return total
