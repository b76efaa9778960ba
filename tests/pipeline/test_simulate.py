"""All stages in one process (``rj.pipeline.simulate``): activation codecs (bytes and quality),
the asynchronous modes' weight versions."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import BATCH, batches, build, flat, optimizer  # noqa: E402

import ravnest_jax as rj  # noqa: E402

pytestmark = pytest.mark.integration  # compiles and trains stages: seconds


def test_int8_activations_cost_four_times_fewer_bytes_and_little_loss():
    from char_lm.model import ModelConfig, build_model, stage_split

    d, seq = 128, 64
    gd, params = build_model(ModelConfig(d_model=d, num_layers=2, num_heads=2, seq_len=seq), seed=0)
    split = stage_split(gd, params)
    plan = rj.pipeline.plan_stages(split, 2)

    def data(step):
        return np.random.default_rng([0, step]).integers(0, 256, (BATCH, seq + 1)).astype(np.int32)

    runs = {}
    for codec in ("fp32", "bf16", "int8"):
        runs[codec] = rj.pipeline.simulate(split, plan, optimizer(0.05), data, steps=8, micro_batches=4, codec=codec)
    per = {c: r.bytes_sent[0] / (8 * 4) for c, r in runs.items()}  # stage 0 sends one activation a micro-batch
    n = (BATCH // 4) * seq * d  # values per message
    assert 0 < per["fp32"] - 4 * n < 200, per  # 4 bytes a value, plus the wire header
    assert 0 < per["int8"] - (n + 2 * n // d) < 200, per  # 1 byte a value, a bf16 scale per token
    ratio = per["fp32"] / per["int8"]
    assert ratio >= 3.9, f"int8 sends {ratio:.3f}x fewer bytes than fp32 (want >= 3.9: 4 d / (d + 2), headers)"
    for codec in ("bf16", "int8"):
        got, want = np.asarray(runs[codec].losses), np.asarray(runs["fp32"].losses)
        assert np.max(np.abs(got / want - 1)) < 0.01, f"{codec} losses {got} vs fp32 {want}"
    assert not np.array_equal(runs["int8"].losses, runs["fp32"].losses)  # it did quantise


@pytest.mark.parametrize("mode", ["stash", "2bw"])
def test_async_modes_use_the_documented_weight_versions(mode):
    """With S = 3 and M = 4, check each forward's weight version against the schedule's rule and
    that the run trains (the loss on a repeated batch falls)."""
    split, _, _, vocab = build("char")
    plan = rj.pipeline.plan_stages(split, 3)
    seen: dict[tuple[int, int], int] = {}
    orig = rj.pipeline.StageWorker.forward

    def spy(self, g, x, targets=None):
        params = self._weights_for_forward(g)
        version = self.version if params is self.params else self.version - 1
        seen[(self.stage.lo, g)] = version
        return orig(self, g, x, targets)

    rj.pipeline.StageWorker.forward = spy
    try:
        same = batches(vocab)(0)
        res = rj.pipeline.simulate(split, plan, optimizer(0.05), lambda t: same, steps=4, micro_batches=4, mode=mode)
    finally:
        rj.pipeline.StageWorker.forward = orig
    M = 4
    for (lo, g), version in seen.items():
        step = g // M
        if mode == "2bw":
            assert version == max(step - 1, 0), (lo, g, version)
        else:  # stash: the newest version, which lags the step by at most one
            assert version in (step - 1, step) or (step == 0 and version == 0), (lo, g, version)
    stage0 = sorted(v - g // M for (lo, g), v in seen.items() if lo == 0)
    assert stage0[0] == -1, "stash: stage 0 forwards some micro-batches on the previous weights"
    assert res.losses[-1] < res.losses[0], res.losses


def test_lora_pipeline_trains_adapters_only():
    from _models import LLAMA

    from ravnest_jax.models import LoraConfig, load_pretrained, split_lora

    lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4)))
    split = rj.pipeline.transformer_split(lm)
    plan = rj.pipeline.plan_stages(split, 2)
    same = batches(96)(0)
    res = rj.pipeline.simulate(split, plan, optimizer(0.05), lambda t: same, steps=3, micro_batches=4, mode="stash")
    for w in res.workers:
        assert all("lora" in k for k in flat(w.params)), "only adapters are parameters"
        frozen_before = flat(split.stage(w.stage.lo, w.stage.hi).frozen)
        for k, v in flat(w.frozen).items():
            np.testing.assert_array_equal(v, frozen_before[k], err_msg=f"frozen {k} changed")
    assert res.losses[-1] < res.losses[0], res.losses


def test_predict_mode_forwards_early_micro_batches_on_predicted_weights():
    import jax

    split, _, _, vocab = build("char")
    plan = rj.pipeline.plan_stages(split, 3)
    checked = []
    orig = rj.pipeline.StageWorker.forward

    def spy(self, g, x, targets=None):
        w = self._weights_for_forward(g)
        if self.version < g // self.micro_batches and self._prev is not None:  # a step early
            want = jax.tree.map(lambda a, b: 2 * a - b, self.params, self._prev)
            for got, exp in zip(jax.tree.leaves(w), jax.tree.leaves(want)):
                np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=1e-6, atol=1e-7)
            checked.append((self.stage.lo, g))
        else:
            assert w is self.params
        return orig(self, g, x, targets)

    rj.pipeline.StageWorker.forward = spy
    try:
        rj.pipeline.simulate(split, plan, optimizer(0.05), batches(vocab), steps=4, micro_batches=4, mode="predict")
    finally:
        rj.pipeline.StageWorker.forward = orig
    # stages 0 and 1 run forwards a step early (from step 2 on: step 1's have no update to repeat)
    assert {lo for lo, _ in checked} == {plan.bounds[0][0], plan.bounds[1][0]}, checked


def test_a_deeper_schedule_is_exact_when_synchronous_and_trains_when_asynchronous():
    """``in_flight`` above S: the synchronous schedule still computes the unsplit step (the same
    losses and weights as depth S, bit for bit), and the asynchronous one runs without a
    deadlock (``simulate`` raises on one) with every forward at most one update behind."""
    import jax

    split, _, _, vocab = build("char")
    plan = rj.pipeline.plan_stages(split, 3)
    data = batches(vocab)
    ref = rj.pipeline.simulate(split, plan, optimizer(0.05), data, steps=2, micro_batches=4)
    deep = rj.pipeline.simulate(split, plan, optimizer(0.05), data, steps=2, micro_batches=4, in_flight=5)
    assert deep.losses == ref.losses, (deep.losses, ref.losses)
    for a, b in zip(ref.workers, deep.workers):
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    peak = {}
    orig = rj.pipeline.StageWorker.forward

    def spy(self, g, x, targets=None):
        assert self.version >= g // self.micro_batches - 1, (self.stage.lo, g, self.version)
        out = orig(self, g, x, targets)
        peak[self.stage.lo] = max(peak.get(self.stage.lo, 0), self.in_flight)
        return out

    rj.pipeline.StageWorker.forward = spy
    try:
        same = data(0)
        res = rj.pipeline.simulate(
            split, plan, optimizer(0.05), lambda t: same, steps=3, micro_batches=4, mode="async", in_flight=5
        )
    finally:
        rj.pipeline.StageWorker.forward = orig
    held = [peak[lo] for lo, _ in plan.bounds]
    # D = 5 over 3 stages: warm-ups 4, 2, 0 (spread evenly over the links)
    assert held == [5, 3, 0], f"micro-batches held per stage: {held} (the last stage's forward is its backward)"
    assert res.losses[-1] < res.losses[0], res.losses
