"""``OuterSync``'s round mapping (exchange number -> swarm round): learned from the first round,
kept through failures, and learned anew from a round that ran with this peer's contribution
as a later number (the rounds between failed for everybody: a lone peer restarted)."""

from __future__ import annotations

import optax
import pytest

import ravnest_jax as rj
from ravnest_jax.sync._schedule import Schedule


def test_the_mapping_follows_a_round_that_ran_as_a_later_number():
    s = Schedule(rj.diloco(optax.sgd(0.1), sync_every=10), 1, 5, 1.0)
    p = s.plan(0, 10, 0.0)
    assert p.expected is None
    p.learn_round(4, True)  # the first round ran as swarm round 4
    p = s.plan(0, 20, 0.0)
    assert p.expected == 5, p
    p.learn_round(5, False)  # failed as itself
    p = s.plan(0, 30, 0.0)
    assert p.expected == 6, p
    p.learn_round(9, False)  # failed as another number (missed): the recovery decides, not this
    p = s.plan(0, 40, 0.0)
    assert p.expected == 7 and s.swarm_base == (4, 0), (p, s.swarm_base)
    p.learn_round(9, True)  # ran with this peer's contribution as round 9: rounds 7 and 8 failed
    p = s.plan(0, 50, 0.0)
    assert p.expected == 10 and s.swarm_base == (9, 3), (p, s.swarm_base)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_the_state_digest_is_the_same_in_chunks_and_needs_no_leaf_sized_temporary():
    """The digest hashes a leaf chunk by chunk (wrap-around sums: the same value) so that its
    temporaries stay chunk-sized: XLA's plan of the whole-leaf version needed 4 uint32 lanes of
    the leaf's size (8x the params of (global_params, outer_state))."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ravnest_jax.sync._digest import CHUNK, _leaf_hash, device_digest

    rng = np.random.default_rng(0)
    for x in (
        jnp.asarray(rng.standard_normal(10_007), jnp.float32),
        jnp.asarray(rng.standard_normal(3001), jnp.bfloat16),
        jnp.asarray(rng.integers(0, 255, 5003), jnp.uint8),
        jnp.asarray(rng.standard_normal((37, 41)), jnp.float32),
    ):
        whole = _leaf_hash(x, 3, chunk=1 << 30)
        for chunk in (7, 1000, x.size - 1):
            np.testing.assert_array_equal(_leaf_hash(x, 3, chunk=chunk), whole, err_msg=f"{x.dtype} chunk {chunk}")
    big = (jnp.zeros(8 << 20, jnp.float32), jnp.zeros(8 << 20, jnp.float32))  # 16M values, 64 MB
    plan = jax.jit(device_digest).lower(big).compile().memory_analysis()
    # the lanes of one chunk (4 x CHUNK uint32, 64 MB) at most; the whole-leaf version: 8x, 512 MB
    assert plan.temp_size_in_bytes <= 17 * CHUNK, plan.temp_size_in_bytes
