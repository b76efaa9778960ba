"""The house rules of the code base: the parameter counts of ``rj.Swarm`` and ``rj.OuterSync``, and
the sync <-> swarm contract that ``rj.Swarm`` fulfils. (Modules are cut along concepts, checked
by tests/house/test_layering.py, not by line counts: issue 38.)"""

from __future__ import annotations

from pathlib import Path

import optax
import pytest

import ravnest_jax as rj
from ravnest_jax.sync._contract import MEMBERS, SwarmContract, check_contract

PKG = Path(rj.__file__).resolve().parent


def test_the_outer_loop_takes_at_most_10_parameters():
    """Issue 38: one codec value, no wall-time rounds, one staleness knob, eager instead of a
    mode string: OuterSync had 17 parameters, optax's MultiSteps takes 5."""
    import inspect

    names = list(inspect.signature(rj.OuterSync.__init__).parameters)[1:]
    assert len(names) <= 10, names


def test_the_swarm_takes_at_most_10_parameters():
    """Issue 38: the algorithm and its knobs one value (rj.AllReduce), TLS one value (rj.TLS),
    the published info through set_info: Swarm had 19 parameters."""
    import inspect

    names = list(inspect.signature(rj.Swarm.__init__).parameters)[1:]
    assert len(names) <= 10, names


def test_the_real_and_the_in_process_swarm_fulfil_the_whole_sync_contract():
    """Issue 38: one complete, required contract (no member optional, no getattr default)."""
    real = rj.Swarm("http://127.0.0.1:9", run_id="r", token="t")  # not started: no socket
    local = rj.testing.LocalRun().swarm("p0")
    for swarm in (real, local):
        assert isinstance(swarm, SwarmContract), type(swarm)
        missing = [m for m in MEMBERS if not hasattr(swarm, m)]
        assert not missing, (type(swarm).__name__, missing)
        check_contract(swarm)


def test_a_stand_in_with_only_an_all_reduce_is_refused_naming_what_it_lacks():
    class Fake:
        codec = "fp32"

        def all_reduce_packed_async(self, packed, *, weight, **kw):
            raise AssertionError

    assert not isinstance(Fake(), SwarmContract)
    tx = rj.diloco(optax.sgd(0.1), sync_every=4)
    with pytest.raises(TypeError) as e:
        rj.OuterSync(tx, Fake())
    msg = str(e.value)
    assert "\n" not in msg and "lacks peer_id, run_id, timeouts, started, ready," in msg, msg


def test_the_sync_layer_asks_the_swarm_nothing_through_getattr():
    """No ``getattr(swarm, ...)`` / ``hasattr(swarm, ...)`` in ``sync``: the contract is
    required, checked once (``check_contract``)."""
    import re

    hits = [
        f"{f.name}:{i}"
        for f in sorted((PKG / "sync").glob("*.py"))
        if f.name != "_contract.py"
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if re.search(r"\b(getattr|hasattr)\((self\.|sync\.)?swarm\b", line)
    ]
    assert not hits, hits
