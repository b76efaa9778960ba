"""Checkpoints of stage peers: a stage peer killed with -9 and started again on its checkpoint
directory resumes, its cluster goes on from the newest step every stage has (the survivors roll
back to it from their own checkpoints), and the result is exactly the uninterrupted training."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_processes import RTOL, WORKER, assert_matches, reference  # noqa: E402

import ravnest_jax as rj  # noqa: E402
from ravnest_jax.pipeline._peer import cluster_step  # noqa: E402


def test_cluster_step_is_the_newest_step_every_stage_has():
    # all at the same step: that step
    assert cluster_step([{"resume": 6}, {"resume": 6, "ckpt": [3, 6]}]) == 6
    # a restarted stage at its checkpoint 6, the survivor at 8 with 3, 6 saved: back to 6
    assert cluster_step([{"resume": 8, "ckpt": [3, 6]}, {"resume": 6, "ckpt": [3, 6]}]) == 6
    # the newest common one, not the oldest
    assert (
        cluster_step([{"resume": 9, "ckpt": [3, 6, 9]}, {"resume": 6, "ckpt": [6]}, {"resume": 9, "ckpt": [6, 9]}]) == 6
    )
    # no common step (a standby that downloaded its state, no checkpoints): the largest resume
    assert cluster_step([{"resume": 8, "ckpt": [3, 6]}, {"resume": 0}]) == 8
    assert cluster_step([{"resume": 4}, {"resume": 0}]) == 4
    # a stage that cannot go back bounds it from below
    assert cluster_step([{"resume": 7}, {"resume": 6, "ckpt": [3, 6]}]) == 7


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_bad_checkpoint_options_are_refused_before_anything_starts(tmp_path):
    from _models import build, optimizer

    split, _, _, _ = build("char")
    plan = rj.pipeline.plan_stages(split, 2)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    common = dict(stage=0, micro_batches=2, rendezvous_url="http://127.0.0.1:9", run_id="r", token="t" * 16)
    with pytest.raises(ValueError, match="is a file"):
        rj.pipeline.StagePeer(split, plan, optimizer(0.1), checkpoint_dir=a_file, **common)
    with pytest.raises(ValueError, match="checkpoint_every"):
        rj.pipeline.StagePeer(split, plan, optimizer(0.1), checkpoint_dir=tmp_path / "c", checkpoint_every=0, **common)
    with pytest.raises(ValueError, match="max_to_keep"):
        rj.pipeline.StagePeer(split, plan, optimizer(0.1), checkpoint_dir=tmp_path / "c", max_to_keep=1, **common)


def _stage0_peer_beside(tmp_path, saved_stage: int, units_of, num_stages: int):
    """An unstarted stage-0 peer of a 2-stage char-LM plan whose checkpoint directory holds one
    checkpoint of stage ``saved_stage``, recorded as units ``units_of(lo, hi)`` of
    ``num_stages`` stages (``lo, hi``: the plan's bounds of that stage)."""
    from _models import build, optimizer

    split, _, _, _ = build("char")
    plan = rj.pipeline.plan_stages(split, 2)
    lo, hi = plan.bounds[saved_stage]
    st = split.stage(lo, hi)
    meta = {"units": list(units_of(lo, hi)), "num_stages": num_stages}
    with rj.Checkpointer(tmp_path / "ck" / f"stage{saved_stage}", metadata=meta) as c:
        c.save(3, params=st.params, opt_state=optimizer(0.1).init(st.params))
    return rj.pipeline.StagePeer(
        split,
        plan,
        optimizer(0.1),
        stage=0,
        micro_batches=2,
        rendezvous_url="http://127.0.0.1:9",
        run_id="r",
        token="t" * 16,
        peer_id="p0",
        checkpoint_dir=tmp_path / "ck",
    )


@pytest.mark.integration  # builds two stage peers: ~4 s
def test_a_checkpoint_of_other_units_is_refused_before_compiling(tmp_path, monkeypatch):
    peer = _stage0_peer_beside(tmp_path, 0, lambda lo, hi: (lo, hi + 1), 3)
    compiled = []
    real = rj.pipeline.StageWorker.compile
    monkeypatch.setattr(rj.pipeline.StageWorker, "compile", lambda self, *a: compiled.append(a) or real(self, *a))
    try:
        with pytest.raises(
            ValueError, match=r"of units \[0, 3\] of 3 stages; this peer's stage 0 holds units \[0, 2\]"
        ):
            peer.prepare(4, 8)
    finally:
        peer.close()
    assert compiled == [], "compiled before the checkpoint was checked"


@pytest.mark.integration
def test_kill_9_a_stage_peer_and_restart_it_loses_no_step(pipe_cluster, tmp_path):
    """One cluster of 2 stage peers (sync schedule, checkpoints every 3 steps). Stage 1 is
    killed with -9 after step 7; stage 0 finds the pipeline broken within its deadline and
    waits; stage 1 is started again on its checkpoint directory. The cluster goes on from the
    newest step both stages saved (stage 0 rolls back to it), and after 12 steps every
    parameter and every loss from the restart on equal the unsplit model's uninterrupted
    training (float32, rtol 1e-5)."""
    pipe_cluster.rendezvous()
    steps = 12
    common = ["--stages", "2", "--steps", str(steps), "--checkpoint-every", "3", "--recv-timeout", "4"]

    def start(s: int, name: str):
        out = tmp_path / f"stage{s}.npz"
        args = [*common, "--stage", str(s), "--out", str(out), "--checkpoint-dir", str(tmp_path / f"ck{s}")]
        return out, pipe_cluster.start(name, WORKER, *args, "--pad", "0.03")

    (out0, p0), (_, p1) = start(0, "stage0"), start(1, "stage1")
    p1.wait_for(lambda e: e.get("event") == "step" and e["step"] >= 7, 240, "step >= 7")
    p1.kill9()
    killed_at = max(e["step"] for e in p1.all if e.get("event") == "step")
    out1, p1b = start(1, "stage1-again")
    ref_losses, _, ref_params = reference("char", steps)
    for p in (p0, p1b):
        p.expect("done", timeout=240)
        assert p.wait(30) == 0, f"{p.name}: {p.stderr()}"
    m0 = next(e for e in p0.all if e.get("event") == "done")["metrics"]
    m1 = next(e for e in p1b.all if e.get("event") == "done")["metrics"]
    resumed = m1["restored_steps"]
    assert len(resumed) == 1 and resumed[0] % 3 == 0 and resumed[0] <= killed_at + 1, (resumed, killed_at)
    assert m0["recoveries"] >= 1, m0
    assert m0["restored_steps"] == resumed, (m0, resumed)  # stage 0 was ahead: it rolled back
    r1 = dict(np.load(out1))
    np.testing.assert_allclose(r1["losses"], ref_losses[resumed[0] :], rtol=RTOL, err_msg="losses after the restart")
    for r in (dict(np.load(out0)), r1):
        for key, got in r.items():
            kind, _, name = key.partition("/")
            if kind == "param":
                assert_matches(f"param {name}", got, ref_params[name])


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_a_stage_without_checkpoints_beside_other_stages_ones_says_so(tmp_path, caplog):
    """A peer placed on another stage than before (another placement or plan) finds no
    checkpoint of its stage but some of another: it says so once and starts without them."""
    import logging

    peer = _stage0_peer_beside(tmp_path, 1, lambda lo, hi: (lo, hi), 2)
    try:
        with caplog.at_level(logging.WARNING, logger="ravnest_jax.pipeline"):
            peer.prepare(4, 8)
    finally:
        peer.close()
    said = [r.getMessage() for r in caplog.records if "holds checkpoints of stage1" in r.getMessage()]
    assert len(said) == 1 and "stage 0 starts without them" in said[0], [r.getMessage() for r in caplog.records]
    assert peer.step == 0 and peer.resumed_from is None, (peer.step, peer.resumed_from)
