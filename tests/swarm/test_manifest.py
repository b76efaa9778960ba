"""The run manifest: settings that every peer of a run shares, checked at the door
(ravnest_jax/swarm/wire/_manifest.py, the rendezvous' ``_Run.admit``; docs/swarm.md, "The run
manifest")."""

from __future__ import annotations

import numpy as np
import pytest

import ravnest_jax as rj
from ravnest_jax.swarm import AllReduce, ManifestMismatch, Swarm, SwarmError, Timeouts
from ravnest_jax.swarm.rendezvous._rounds import _Run, differences
from ravnest_jax.swarm.wire._manifest import refusal_differences, refusal_line

from .conftest import TOKEN

T = Timeouts(connect=2.0, part=3.0, grace=0.5, round=15.0, heartbeat=0.5, eviction=3.0)
FP = {"leaves": 4, "elements": 1234, "sha256": "00ff"}


def test_differences_name_every_setting_with_both_values():
    mine = {"sync_every": 20, "codec": "int8", "params": FP, "fragments": 1}
    run = {"sync_every": 10, "codec": "int4", "params": {**FP, "elements": 99, "sha256": "abcd"}, "mode": "delayed"}
    assert differences(mine, run) == [
        "codec: this peer int8, the run int4",
        "fragments: this peer 1, the run none",
        "mode: this peer none, the run delayed",
        "params: this peer 4 leaves, 1,234 elements (fingerprint 00ff), the run 4 leaves, 99 elements "
        "(fingerprint abcd)",
        "sync_every: this peer 20, the run 10",
    ]
    assert differences(run, run) == []
    line = refusal_line(differences(mine, run))
    assert "\n" not in line and refusal_differences(line) == differences(mine, run)
    assert refusal_differences("HTTP 409: something else") is None


def test_the_first_peer_fixes_the_manifest_until_no_live_peer_holds_it():
    m = _Run("r")
    a, b = {"sync_every": 10}, {"sync_every": 20}
    assert m.manifest is None
    assert m.admit("p0", a, live={"p0"}) == [] and m.manifest == a
    assert m.admit("p1", a, live={"p0", "p1"}) == []
    # refused while a live peer holds the run's; a check changes nothing
    assert m.refusal("p2", b, live={"p0", "p1", "p2"}) == ["sync_every: this peer 20, the run 10"]
    assert m.admit("p2", b, live={"p0", "p1", "p2"}) == ["sync_every: this peer 20, the run 10"]
    assert m.manifest == a
    # a holder restarted with new settings while the other holder lives: refused
    assert m.admit("p0", b, live={"p0", "p1"}) != []
    # every holder gone (left or evicted): the next peer fixes a new one
    assert m.admit("p2", b, live={"p2"}) == [] and m.manifest == b
    assert m.admit("p0", a, live={"p0", "p2"}) != []
    assert _Run("other").admit("p0", a, live={"p0"}) == []  # runs are separate


def test_trainer_manifest_fingerprints_structure_shapes_and_dtypes_not_values():
    import jax.numpy as jnp
    import optax

    from ravnest_jax.sync._run_manifest import params_fingerprint

    p = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
    fp = params_fingerprint(p)
    assert fp["leaves"] == 2 and fp["elements"] == 16 and len(fp["sha256"]) == 16
    assert params_fingerprint({"w": jnp.ones((3, 4)), "b": jnp.ones(4)}) == fp  # values: no
    assert params_fingerprint({"w": jnp.zeros((3, 5)), "b": jnp.zeros(4)})["sha256"] != fp["sha256"]
    assert params_fingerprint({"w": jnp.zeros((3, 4), jnp.bfloat16), "b": jnp.zeros(4)})["sha256"] != fp["sha256"]
    assert params_fingerprint({"v": jnp.zeros((3, 4)), "b": jnp.zeros(4)})["sha256"] != fp["sha256"]

    tx = rj.diloco(optax.sgd(0.1), sync_every=12, fragments=3)
    with rj.OuterSync(tx, rj.testing.LocalRun().swarm("p0"), overlap_steps=2) as sync:
        from ravnest_jax.sync._run_manifest import trainer_manifest

        m = trainer_manifest(sync, p)
        assert m == {
            "params": fp,
            "sync_every": 12,
            "fragments": 3,
            "fragment_offsets": [0, 4, 8],
            "mode": "delayed",
            "overlap_steps": 2,
        }
        sync.declare_manifest(p)  # a swarm without declare_manifest: a no-op


def _swarm(url, pid, **kw):
    return Swarm(url, run_id="manifest", token=TOKEN, listen="127.0.0.1:0", timeouts=T, peer_id=pid, **kw)


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_peer_with_other_settings_is_refused_and_the_run_is_untouched(cluster):
    url = cluster.rendezvous()
    trainer = {"params": FP, "sync_every": 10}
    with _swarm(url, "a", codec="int4") as a:
        a.declare_manifest(trainer)
        # refused before it starts (a check: nothing registered), in one line with both values
        early = _swarm(url, "b", codec="int8", algorithm=AllReduce(aggregator="mean"))
        with pytest.raises(ManifestMismatch) as e:
            early.declare_manifest({**trainer, "sync_every": 20})
        msg = str(e.value)
        assert "\n" not in msg, msg
        for want in (
            "codec: this peer int8, the run int4",
            "aggregator: this peer mean, the run clipped_mean:2.0",
            "sync_every: this peer 20, the run 10",
        ):
            assert want in msg, (want, msg)
        assert [p.peer_id for p in a.peers()] == ["a"]
        # started, then declared: refused and dropped at once; its heartbeats do not come back
        with _swarm(url, "c", codec="int8") as c:
            assert {p.peer_id for p in a.peers()} == {"a", "c"}
            with pytest.raises(ManifestMismatch, match="codec: this peer int8, the run int4"):
                c.declare_manifest(trainer)
            assert [p.peer_id for p in a.peers()] == ["a"]
            with pytest.raises(SwarmError, match="409"):
                c.announce()  # a heartbeat, with its manifest: not registered again
            assert [p.peer_id for p in a.peers()] == ["a"]
        # declared before start while the run agreed, then the run fixed another: the join refuses
        late = _swarm(url, "d", codec="int4")
        late.declare_manifest(trainer)
        with _swarm(url, "e", codec="int4") as same:
            same.declare_manifest(trainer)  # the same settings: admitted
            assert {p.peer_id for p in a.peers()} == {"a", "e"}
        # (the run's holders changed between its check and its join: "e" is gone, "a" lives; a
        # stand-in for a setting the run fixed meanwhile: the manifest the join carries differs)
        late._manifest = {**late._manifest, "codec": "fp32"}
        with pytest.raises(ManifestMismatch, match="codec: this peer fp32, the run int4"):
            late.start()
        # the run goes on: a round of a alone
        out, rec = a.all_reduce({"x": np.ones(4, np.float32)}, weight=1.0)
        assert rec.ok and rec.contributors == ("a",), rec
    # every holder gone: a new run of the same id fixes new settings
    with _swarm(url, "f", codec="int8") as f:
        f.declare_manifest({**trainer, "sync_every": 20})


def test_the_run_s_initial_state_is_its_first_declarer_s_while_it_lives():
    m = _Run("r")
    a = {"sync_every": 10}
    assert m.init == {"init": None, "init_from": None}
    assert m.admit("p0", a, live={"p0"}, init="d0") == []
    assert m.admit("p1", a, live={"p0", "p1"}, init="d1") == []
    assert m.init == {"init": "d0", "init_from": "p0"}  # the first one's, not the latest
    assert m.admit("p2", a, live={"p1", "p2"}, init="d2") == []
    assert m.init == {"init": "d2", "init_from": "p2"}  # p0 gone: the next declarer's
    assert m.admit("p3", {"sync_every": 20}, live={"p3"}, init="d3") == []
    assert m.init == {"init": "d3", "init_from": "p3"}  # a new manifest, a new reference
