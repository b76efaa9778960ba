"""Placement of stages on peers from their reports (pure Python)."""

from __future__ import annotations

import pytest

from ravnest_jax.pipeline import place


def _r(peer, memory=None, mbit=None):
    return {"peer": peer, "memory": memory, "mbit": mbit}


def test_fills_clusters_and_keeps_standbys():
    reports = [_r(f"p{i}") for i in range(5)]
    p = place(reports, [10, 10], clusters=2, standbys=1)
    assert p.clusters == 2 and len(p.slots) == 4 and len(p.standbys) == 1
    assert sorted(p.slots.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # every peer computes the same placement whatever order it sees the reports in
    assert place(list(reversed(reports)), [10, 10], clusters=2, standbys=1) == p
    assert p.of("p4") == ("standby", None, p.standbys["p4"])
    assert p.of("nobody") == ("none", None, None)


def test_memory_and_bandwidth_decide_who_holds_what():
    reports = [_r("small", 4e9, 1000), _r("big", 24e9, 100), _r("fast", 12e9, 1000), _r("slow", 12e9, 10)]
    p = place(reports, [10e9, 8e9, 3e9], clusters=1)
    assert p.slots["fast"] == (0, 1)  # the middle stage (two neighbours) on the best link that holds it
    assert p.slots["slow"] == (0, 0)  # the least memory that holds the largest end stage (best fit)
    assert p.slots["small"] == (0, 2)
    assert p.standbys == {"big": 0}  # the largest device stands by for the largest stage
    with pytest.raises(ValueError, match="no peer has memory for stage 0"):
        place(reports, [30e9, 1, 1])
    with pytest.raises(ValueError, match="cannot form"):
        place(reports, [1, 1, 1], clusters=2)


def test_a_refusal_names_the_stage_its_bytes_and_the_pool():
    gib = 1024**3
    reports = [_r("a", 18 * gib), _r("b", 18 * gib)]  # 24 GiB cards at JAX's default 0.75
    with pytest.raises(ValueError, match=r"stage 1: it needs 20\.00 GiB, the largest pool .* 18\.00 GiB") as e:
        place(reports, [gib, 20 * gib])
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in str(e.value) and "\n" not in str(e.value)
