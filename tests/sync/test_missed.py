"""When every member of a round missed its own expected round (each abstains), the round says
so (``RoundRecord.all_abstained``), so that the peers learn the round mapping anew instead
of downloading each other's state in turn (two stale peers did so forever in the chaos
benchmark)."""

from __future__ import annotations

import numpy as np
import pytest

from ravnest_jax.swarm import RoundFailed

from ._local import local_swarm

pytestmark = pytest.mark.integration  # a real swarm in threads


@pytest.mark.timeout(120)
def test_a_round_where_every_member_missed_says_nobody_contributed():
    tree = {"w": np.ones(1000, np.float32)}
    with local_swarm(2) as (a, b):
        for _ in range(3):  # rounds 0, 1, 2 as usual
            fa, fb = a.all_reduce_async(tree), b.all_reduce_async(tree)
            assert fa.result(60)[1].ok and fb.result(60)[1].ok
        # both peers expect round 1 (stale mappings): the swarm is at round 3, where both abstain
        fa, fb = a.all_reduce_async(tree, round=1), b.all_reduce_async(tree, round=1)
        records = []
        for f in (fa, fb):
            with pytest.raises(RoundFailed) as e:
                f.result(60)
            records.append(e.value.record)
    for r in records:
        assert r.round == 3 and "no peer contributed" in (r.error or "") and r.all_abstained, r
    # a missed round in which another peer contributed is not one of those
    with local_swarm(2) as (a, b):
        for _ in range(3):
            fa, fb = a.all_reduce_async(tree), b.all_reduce_async(tree)
            assert fa.result(60)[1].ok and fb.result(60)[1].ok
        fa, fb = a.all_reduce_async(tree, round=1), b.all_reduce_async(tree)  # only a is stale
        with pytest.raises(RoundFailed) as e:
            fa.result(60)
        assert fb.result(60)[1].ok
    assert "missed round 1" in (e.value.record.error or "") and not e.value.record.all_abstained, e.value.record
