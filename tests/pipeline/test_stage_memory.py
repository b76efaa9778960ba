"""Stage sizing from abstract shapes: the micro-batches 1F1B keeps in flight, the stages'
bytes composed from one block equal to the whole model's split, the static need placement
uses, and ``ravnest-jax plan-memory --stages`` (70B int4 on four 24 GiB cards)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

pytest.importorskip("qwix")
from flax import nnx  # noqa: E402

from ravnest_jax.models import LoraConfig, Transformer, TransformerConfig, apply_lora, nbytes, split_lora  # noqa: E402
from ravnest_jax.pipeline import transformer_split  # noqa: E402
from ravnest_jax.pipeline._stage_memory import (  # noqa: E402
    StageMemory,
    in_flight_per_stage,
    plan_stage_memory,
    stage_need_bytes,
)

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"
GIB = 1024**3


@pytest.mark.parametrize("stages, depth, want", [(4, None, [4, 3, 2, 1]), (4, 7, [7, 5, 3, 1]), (1, None, [1])])
def test_in_flight_is_what_1f1b_keeps(stages, depth, want):
    assert in_flight_per_stage(stages, depth) == want


def _abstract_split(cfg, lora, quantize, dtype=jnp.bfloat16):
    def build():
        m = apply_lora(Transformer(cfg, nnx.Rngs(0), dtype=dtype, param_dtype=dtype), lora, quantize=quantize)
        m.remat = True
        return m

    return transformer_split(split_lora(nnx.eval_shape(build)))


@pytest.mark.parametrize(
    "quantize",
    [None, "int4", "nf4"],
)
@pytest.mark.integration  # ~5 s each: compiles a stage's step
def test_stages_from_one_block_equal_the_whole_split(quantize):
    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=4)
    lora = LoraConfig(rank=4)
    plan = plan_stage_memory(cfg, stages=2, lora=lora, quantize=quantize, micro_batch=2, seq_len=32)
    split = _abstract_split(cfg, lora, quantize)
    assert [(s.lo, s.hi) for s in plan.stages] == [(0, 3), (3, 6)]
    need = stage_need_bytes(split, [(s.lo, s.hi) for s in plan.stages])
    for s, static in zip(plan.stages, need):
        st = split.stage(s.lo, s.hi, check=False, load=False)
        assert s.base == nbytes(st.frozen)
        # adapters, AdamW's two moments (and a step count per unit), DiLoCo's anchor and momentum
        assert s.trainable == 5 * nbytes(st.params) + 4 * (s.hi - s.lo)
        assert static == s.base + s.trainable
        assert s.working_set > 0
    block = plan.units[1]
    # checkpointing: each block's bf16 input (and the int32 positions and RoPE frequencies)
    assert block.kept == 2 * 32 * cfg.hidden_size * 2 + 2 * 32 * 4 + cfg.head_dim // 2 * 4
    assert plan.stages[0].in_flight == 2 and plan.stages[0].activations == 2 * (plan.units[0].kept + 2 * block.kept)
    if quantize:
        assert plan.widths[quantize if quantize == "int4" else "uint4"] == 4


def test_stage_fits_leaves_the_reserve_of_the_pool():
    s = StageMemory(0, 0, 3, 1, base=17 * GIB, trainable=0, activations=0, working_set=0)
    assert s.fits(18 * GIB) and not s.fits(int(17.5 * GIB)) and s.headroom(20 * GIB) == pytest.approx(0.15)


def test_plan_rejects_bad_values_in_one_line():
    with pytest.raises(ValueError, match="stages=9"):
        plan_stage_memory(LLAMA, stages=9)
    with pytest.raises(ValueError, match="micro_batch"):
        plan_stage_memory(LLAMA, stages=2, micro_batch=0)
    with pytest.raises(ValueError, match="quantize='fp4'"):
        plan_stage_memory(LLAMA, stages=2, quantize="fp4")


@pytest.mark.integration  # a CLI process and a 70B block compiled: ~25 s on 2 cores
def test_70b_int4_four_stages_fit_24_gib_cards_at_0_9(tmp_path):
    out = tmp_path / "p.json"
    args = ["--config", "llama-3.1-70b", "--stages", "4", "--quantize", "int4", "--json", str(out)]
    env = {**__import__("os").environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    p = subprocess.run(
        [sys.executable, "-m", "ravnest_jax.cli", "plan-memory", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert "fits 4 x 24 GiB" in p.stdout and "headroom" in p.stdout, p.stdout
    d = json.loads(out.read_text())
    assert d["pool_bytes"] == int(0.9 * 24 * GIB) and d["widths"]["int4"] == 4
    assert [s["in_flight"] for s in d["stages"]] == [4, 3, 2, 1]
    assert min(s["headroom"] for s in d["stages"]) >= 0.10, d["stages"]


def test_a_diloco_optimizer_counts_its_anchor_once():
    import optax

    import ravnest_jax as rj
    from ravnest_jax.pipeline._stage_memory import unit_memory

    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=1)
    split = _abstract_split(cfg, LoraConfig(rank=4), None)
    plain = unit_memory(split, 1, tx=optax.adamw(1e-3))
    wrapped = unit_memory(split, 1, tx=rj.diloco(optax.adamw(1e-3), sync_every=10))
    assert plain.outer == 2 * plain.adapters > 0 and wrapped.outer == 0
    assert wrapped.optimizer + wrapped.outer >= plain.optimizer + plain.outer


@pytest.mark.integration  # a CLI process
def test_plan_memory_stages_says_what_a_stage_needs_and_how_to_raise_the_pool(tmp_path):
    args = ["--config", str(LLAMA), "--stages", "2", "--quantize", "nf4", "--batch", "2", "--seq-len", "64"]
    env = {k: v for k, v in __import__("os").environ.items() if "MEM_FRACTION" not in k}
    p = subprocess.run(
        [sys.executable, "-m", "ravnest_jax.cli", "plan-memory", *args, "--device-gib", "0.0005"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("does not fit 2 x 0.0005 GiB: stage "), p.stdout
    assert "MiB" in last and "takes 0.75 of the card" in last and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in last
