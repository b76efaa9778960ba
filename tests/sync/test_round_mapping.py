"""``OuterSync``'s round mapping (exchange number -> swarm round): learned from the first round,
kept through failures, and learned anew from a round that ran with this peer's contribution
as a later number (the rounds between failed for everybody: a lone peer restarted)."""

from __future__ import annotations

import optax

import ravnest_jax as rj
from ravnest_jax.sync._schedule import Schedule


def test_the_mapping_follows_a_round_that_ran_as_a_later_number():
    s = Schedule(rj.diloco(optax.sgd(0.1), sync_every=10), 1, 5, 1.0, None)
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
