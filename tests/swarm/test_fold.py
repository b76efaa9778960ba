"""The part owner's streaming sum (swarm/peer/_fold.py): bit-identical to reducing whole parts in
sorted order, whatever order the chunks arrive in; dirty when a member fails half-way."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ravnest_jax.swarm.peer._allreduce import squared_norm
from ravnest_jax.swarm.peer._fold import Fold


def _queued_bytes(fold: Fold) -> int:
    """Bytes of chunks waiting to be added (the memory the fixed order costs)."""
    return sum(v.nbytes for q in fold.queued.values() for v in q)


def _grid(n: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def mean_of_scaled(scaled, members):
    """The reference: float32 ``sum_c s_c / sum_c w_c`` over ``members`` in sorted-id order
    (``((s_0 + s_1) + s_2) + ...``), where ``scaled[c] = (w_c, s_c)`` holds the weighted part
    ``s_c = w_c * x_c``: how whole parts were reduced before the streaming sum."""
    order = sorted(members)
    acc = scaled[order[0]][1].copy()
    for c in order[1:]:
        np.add(acc, scaled[c][1], out=acc)
    total = np.float32(0.0)
    for c in order:
        total = np.float32(total + np.float32(scaled[c][0]))
    np.divide(acc, total, out=acc)
    return acc, total


def _reference(parts, weights, members, scales=None):
    scaled = {}
    for c in members:
        s = np.multiply(parts[c], np.float32(weights[c]))
        if scales and c in scales:
            s = np.multiply(s, np.float32(scales[c]))
        scaled[c] = (np.float32(weights[c]), s)
    return mean_of_scaled(scaled, members)


def _feed(fold, parts, grid, members, order):
    """Delivers the chunks of ``members`` (not the owner's) in the interleaving ``order``."""
    nxt = dict.fromkeys(members, 0)
    for c in order:
        j = nxt[c]
        a, b = grid[j]
        fold.add(c, j, parts[c][a:b].copy())
        nxt[c] = j + 1


@settings(max_examples=60, deadline=None)
@given(
    n_members=st.integers(1, 6),
    n=st.integers(1, 400),
    step=st.integers(1, 64),
    owner=st.integers(0, 5),
    seed=st.integers(0, 2**16),
    clip=st.booleans(),
)
def test_any_arrival_order_gives_the_bits_of_the_whole_part_reduction(n_members, n, step, owner, seed, clip):
    rng = np.random.default_rng(seed)
    ids = [f"p{i}" for i in range(n_members)]
    me = ids[owner % n_members]
    parts = {c: (rng.standard_normal(n) * rng.uniform(0.1, 100)).astype(np.float32) for c in ids}
    weights = {c: np.float32(rng.uniform(0.5, 10)) for c in ids}
    scales = {ids[-1]: 0.25} if clip else None
    grid = _grid(n, step)
    acc = np.full(n, np.nan, np.float32)
    fold = Fold(acc, grid, ids, me, lambda a, b: parts[me][a:b], weights[me], scales, norms=True)
    others = [c for c in ids if c != me]
    for c in others:
        fold.expect(c, weights[c])
    order = [c for c in others for _ in grid]
    rng.shuffle(order)
    _feed(fold, parts, grid, others, order)
    assert fold.complete and _queued_bytes(fold) == 0
    total = fold.total_weight(ids)
    got = np.divide(acc, total)
    want, want_total = _reference(parts, weights, ids, scales)
    assert total == want_total
    np.testing.assert_array_equal(got, want)
    for c in ids:  # chunked norms: the same value up to float rounding
        assert fold.sqnorms[c] == pytest.approx(squared_norm(parts[c]), rel=1e-5)


def test_a_member_that_never_sends_holds_back_only_those_after_it():
    n, grid = 10, _grid(10, 2)
    parts = {c: np.arange(n, dtype=np.float32) + i for i, c in enumerate("abc")}
    acc = np.zeros(n, np.float32)
    fold = Fold(acc, grid, "abc", "c", lambda a, b: parts["c"][a:b], np.float32(1))
    fold.expect("b", np.float32(1))
    _feed(fold, parts, grid, ["b"], ["b"] * len(grid))
    # a (first in order) never sent: b's and c's chunks wait
    assert not fold.complete and _queued_bytes(fold) == parts["b"].nbytes
    fold.keep_only(["b", "c"])  # a left out before it sent anything: not dirty
    assert fold.complete and not fold.dirty
    np.testing.assert_array_equal(acc, parts["b"] + parts["c"])


def test_a_member_failing_half_way_makes_the_sum_dirty():
    n, grid = 8, _grid(8, 2)
    parts = {c: np.ones(n, np.float32) for c in "ab"}
    fold = Fold(np.zeros(n, np.float32), grid, "ab", "b", lambda a, b: parts["b"][a:b], np.float32(1))
    fold.expect("a", np.float32(1))
    fold.add("a", 0, parts["a"][:2].copy())  # a is first: its chunk 0 is added at once
    fold.failed("a")
    assert fold.dirty and not fold.complete
    fold2 = Fold(np.zeros(n, np.float32), grid, "ab", "a", lambda a, b: parts["a"][a:b], np.float32(1))
    fold2.expect("b", np.float32(1))
    fold2.add("b", 0, parts["b"][:2].copy())  # a (the owner) folded everything already
    fold2.failed("b")
    assert fold2.dirty
    fold3 = Fold(np.zeros(n, np.float32), grid, "abc", "c", lambda a, b: parts["b"][a:b], np.float32(1))
    fold3.expect("b", np.float32(1))
    fold3.add("b", 0, parts["b"][:2].copy())  # b waits behind a: nothing of it was added
    fold3.failed("b")
    assert not fold3.dirty and _queued_bytes(fold3) == 0


def test_an_abstainer_first_in_the_order_adds_nothing_and_the_next_member_starts_the_sum():
    """An abstainer's part (weight 0, no values) leaves the order: the next member in sorted-id
    order writes the sum's first values (the output buffer holds the previous round's garbage),
    the total weight is the others', and the owner's sum is complete without it."""
    n, rng = 1000, np.random.default_rng(3)
    grid = _grid(n, 128)
    parts = {c: rng.standard_normal(n).astype(np.float32) for c in "bc"}
    weights = {"b": 2.0, "c": 3.0}
    acc = np.full(n, 7.0, np.float32)  # garbage from an earlier round
    fold = Fold(acc, grid, "abc", "c", lambda a, b: parts["c"][a:b], np.float32(3.0))
    fold.expect("a", np.float32(0.0))
    fold.expect("b", np.float32(2.0))
    _feed(fold, parts, grid, "b", ["b"] * len(grid))
    assert fold.complete and fold.abstained == {"a"} and fold.order == ["b", "c"], (fold.order, fold.abstained)
    total = fold.total_weight("abc")
    ref, ref_total = _reference(parts, weights, "bc")
    assert total == ref_total, (total, ref_total)
    assert (acc / total).tobytes() == ref.tobytes()
    fold.failed("a")  # a late failure of the abstainer's (empty) request does not dirty the sum
    assert fold.complete
