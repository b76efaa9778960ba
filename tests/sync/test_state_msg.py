"""The state message's head and the resync download that waits for a state past the failed
round (a peer that missed a round created ahead downloaded the state it already had, and missed
the same round again: seen in the restart soak)."""

from __future__ import annotations

import numpy as np
from flax import serialization

from ravnest_jax.sync._state_msg import StateServer, peek_counters


def _msg(step: int, started: int) -> bytes:
    return serialization.msgpack_serialize(
        {
            "format": "ravnest-state-v1",
            "step": step,
            "rounds_started": started,
            "swarm_base": [],
            "leaves": [np.ones(4)],
        }
    )


def test_peek_reads_the_counters_without_the_leaves():
    assert peek_counters(_msg(241, 25)) == (241, 25)
    assert peek_counters(b"not msgpack") is None
    assert peek_counters(serialization.msgpack_serialize({"leaves": [1]})) is None


def test_fetch_past_asks_again_until_the_state_is_past_the_round():
    answers = [_msg(235, 24), _msg(238, 24), _msg(241, 25)]
    served = []
    server = StateServer()
    try:
        got = server.fetch_past(lambda: answers.pop(0), lambda: served.append(1), seq=24, timeout=30)
        assert peek_counters(got) == (241, 25) and not answers, (peek_counters(got), len(answers))
        # no state is past the round before the deadline: the last one is taken
        got = server.fetch_past(lambda: _msg(239, 24), lambda: None, seq=24, timeout=0.3)
        assert peek_counters(got) == (239, 24)
        assert server.fetch_past(lambda: None, lambda: None, seq=24) is None  # nobody to ask
    finally:
        server.close()
