"""Cutting a model into stages: the slices compose to the whole model, keep its parameter paths,
and the plan balances them."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import LLAMA, build, flat  # noqa: E402

import ravnest_jax as rj  # noqa: E402


def _chain(split, bounds, tokens):
    x = tokens
    for lo, hi in bounds:
        st = split.stage(lo, hi)
        x = jax.jit(st.apply)(st.params, st.frozen, x)
    return x


@pytest.mark.integration  # compiles every slice: seconds
@pytest.mark.parametrize("name", ["char", "llama"])
def test_stages_compose_to_the_whole_model(name):
    split, params, _, vocab = build(name)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (2, 12)), jnp.int32)
    whole = np.asarray(_chain(split, [(0, split.num_units)], tokens))
    held = {}
    for S in (2, split.num_units):
        plan = rj.pipeline.plan_stages(split, S)
        np.testing.assert_allclose(np.asarray(_chain(split, plan.bounds, tokens)), whole, rtol=1e-6, atol=1e-6)
        held = {}
        for lo, hi in plan.bounds:
            for k, v in flat(split.stage(lo, hi).params).items():
                assert k not in held, f"{k} held by two stages"
                held[k] = v
    want = flat(params)
    assert held.keys() == want.keys()  # every parameter once, at its path in the whole model
    for k in want:
        np.testing.assert_array_equal(held[k], want[k])


def test_plan_by_bytes_and_by_time():
    split, _, _, _ = build("char", layers=4)
    by_bytes = rj.pipeline.plan_stages(split, 3)
    assert by_bytes.by == "bytes" and by_bytes.num_stages == 3
    sizes = split.unit_nbytes()
    assert sum(by_bytes.costs) == sum(sizes) and max(by_bytes.costs) == pytest.approx(
        max(sum(sizes[lo:hi]) for lo, hi in by_bytes.bounds)
    )
    assert "stage 2" in by_bytes.describe() and by_bytes.imbalance >= 1.0
    by_time = rj.pipeline.plan_stages(split, 3, by="time", costs=[1.0, 1.0, 1.0, 1.0, 1.0, 3.0])
    assert by_time.bounds[-1] == (5, 6), by_time.bounds  # the expensive head alone
    with pytest.raises(ValueError, match="micro_batch"):
        rj.pipeline.plan_stages(split, 3, by="time")
    with pytest.raises(ValueError, match="stages need"):
        rj.pipeline.plan_stages(split, 7)


@pytest.mark.integration  # qwix traces the LoRA model: seconds
def test_lora_stage_trains_adapters_only():
    from ravnest_jax.models import LoraConfig, load_pretrained, split_lora

    lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4)))
    adapters = jax.tree.map(lambda a: a + 0.05, lm.adapters)  # B != 0: the adapters matter
    lm = lm._replace(adapters=adapters)
    split = rj.pipeline.transformer_split(lm)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 8)), jnp.int32)
    whole = jax.jit(lambda a, f, t: lm.model(a, f)(t))(lm.adapters, lm.frozen, tokens)
    plan = rj.pipeline.plan_stages(split, 2)
    np.testing.assert_allclose(np.asarray(_chain(split, plan.bounds, tokens)), np.asarray(whole), rtol=1e-5, atol=1e-5)
    st = split.stage(*plan.bounds[0])
    names = list(flat(st.params))
    assert names and all("lora" in n for n in names), names
    assert all("lora" not in n or "embed" in n for n in flat(st.frozen) if "kernel" in n and "lora" not in n)


def test_tied_embeddings_cannot_be_split():
    from flax import nnx

    from ravnest_jax.models import Transformer, TransformerConfig

    cfg = TransformerConfig.from_hf(Path(LLAMA).parent / "qwen3")
    assert cfg.tie_word_embeddings
    split = rj.pipeline.transformer_split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    with pytest.raises(ValueError, match="ties its input embedding"):
        split.stage(0, 2)
    split.stage(0, split.num_units)  # one stage holds both ends: fine
