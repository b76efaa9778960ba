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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec, algorithm", [("fp32", "butterfly"), ("int4", "butterfly"), ("fp32", "ring")])
def test_a_peer_that_missed_its_round_abstains_with_nothing(codec, algorithm):
    """A missed round in which another peer contributed is not one of those; the stale peer
    abstains explicitly (weight 0): the round's mean is the other peer's alone, and in the
    butterfly it sends its part owners no values (only the mean of the part it owns)."""
    tree = {"w": np.ones(1000, np.float32)}
    with local_swarm(2, codec=codec, algorithm=algorithm) as (a, b):
        for _ in range(3):
            fa, fb = a.all_reduce_async(tree), b.all_reduce_async(tree)
            assert fa.result(60)[1].ok and fb.result(60)[1].ok
        fa = a.all_reduce_async({"w": np.full(1000, 5.0, np.float32)}, round=1)  # only a is stale
        fb = b.all_reduce_async(tree)
        with pytest.raises(RoundFailed) as e:
            fa.result(60)
        mean, rb = fb.result(60)
    ra = e.value.record
    assert "missed round 1" in (ra.error or "") and not ra.all_abstained, ra
    assert rb.ok and rb.total_weight == 1.0, rb  # a's weight is 0
    # b's own values, through the codec (fp32: exactly)
    np.testing.assert_allclose(mean["w"], 1.0, atol=0 if codec == "fp32" else 0.07)
    if algorithm == "butterfly":  # a sent the mean of its part only, b its part and its mean
        assert ra.bytes_sent < 0.6 * rb.bytes_sent, (ra.bytes_sent, rb.bytes_sent)
