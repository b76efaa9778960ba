"""A pipeline's adapters exported stage by stage: the parts assemble into exactly the PEFT
directory an unsplit run writes (the tiny Llama checkpoint, real safetensors files)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from ravnest_jax.models import (
    LoraConfig,
    assemble_peft_parts,
    load_pretrained,
    save_peft_adapters,
    save_peft_part,
    split_lora,
)
from ravnest_jax.pipeline import pretrained_split

LLAMA = Path(__file__).parents[1] / "fixtures" / "llm" / "llama"
LORA = LoraConfig(rank=4, alpha=8)


def _trained(state: nnx.State) -> nnx.State:
    """Deterministic non-zero values for every adapter, a function of its path and shape only
    (so the whole model's and a stage's adapters of one layer get the same), standing in for
    training: ``B`` is zero at initialisation, which would hide a transposed ``B``."""
    flat = []
    for path, var in nnx.to_flat_state(state):
        seed = sum(ord(c) for c in "/".join(map(str, path)))
        shape = var.get_value().shape
        var = var.replace(jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    lm = split_lora(load_pretrained(LLAMA, lora=LORA, scan_layers=False))
    return save_peft_adapters(lm, _trained(lm.adapters), tmp_path_factory.mktemp("whole") / "adapters")


@pytest.fixture(scope="module")
def stages():
    split = pretrained_split(LLAMA, lora=LORA)  # units: prologue, layers.0, layers.1, epilogue
    return [split.stage(0, 2), split.stage(2, 4)]


def test_parts_written_in_one_directory_assemble_into_the_unsplit_export(whole, stages, tmp_path):
    out = tmp_path / "adapters"
    first = save_peft_part(_trained(stages[1].params), LORA, out, stage=1, num_stages=2)
    assert first is None, "one part of two is not an export yet"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_model.stage-1-of-2.safetensors"]
    done = save_peft_part(_trained(stages[0].params), LORA, out, stage=0, num_stages=2)
    assert done == out
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    got, want = load_file(str(out / "adapter_model.safetensors")), load_file(str(whole / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config == json.loads((whole / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"


def test_parts_from_several_machines_assemble_and_gaps_are_named(whole, stages, tmp_path):
    a, b = tmp_path / "machine-a", tmp_path / "machine-b"
    save_peft_part(_trained(stages[0].params), LORA, a, stage=0, num_stages=2)
    with pytest.raises(ValueError, match=r"stage 1 of 2 missing .*adapter_model\.stage-1-of-2"):
        assemble_peft_parts([a], tmp_path / "out")
    assert not (tmp_path / "out").exists(), "nothing is written before the parts are checked"
    save_peft_part(_trained(stages[1].params), LORA, b, stage=1, num_stages=2)
    out = assemble_peft_parts([a, b / "adapter_model.stage-1-of-2.safetensors"], tmp_path / "out")
    got, want = load_file(str(out / "adapter_model.safetensors")), load_file(str(whole / "adapter_model.safetensors"))
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}
    assert (a / "adapter_model.stage-0-of-2.safetensors").exists(), "parts outside the output are kept"
    with pytest.raises(ValueError, match="already holds an assembled"):
        assemble_peft_parts([a, b], out)


def test_parts_that_do_not_fit_together_are_refused(stages, tmp_path):
    save_peft_part(_trained(stages[0].params), LORA, tmp_path / "a", stage=0, num_stages=2)
    save_peft_part(_trained(stages[0].params), LORA, tmp_path / "b", stage=0, num_stages=2)
    with pytest.raises(ValueError, match="stage 0 is given twice"):
        assemble_peft_parts([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    other = LoraConfig(rank=4, alpha=16)
    save_peft_part(_trained(stages[1].params), other, tmp_path / "c", stage=1, num_stages=2)
    with pytest.raises(ValueError, match="other LoRA settings"):
        assemble_peft_parts([tmp_path / "a", tmp_path / "c"], tmp_path / "out")
    save_peft_part(_trained(stages[1].params), LORA, tmp_path / "d", stage=1, num_stages=3)
    with pytest.raises(ValueError, match="different stage counts"):
        assemble_peft_parts([tmp_path / "a", tmp_path / "d"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no stage parts"):
        assemble_peft_parts([tmp_path / "empty"], tmp_path / "out")
    with pytest.raises(ValueError, match=r"stage 2 is not in \[0, 2\)"):
        save_peft_part(_trained(stages[1].params), LORA, tmp_path / "e", stage=2, num_stages=2)
    assert not (tmp_path / "out").exists()


def test_a_frozen_a_is_read_from_the_stage_frozen_state(tmp_path):
    lora = LoraConfig(rank=4, alpha=8, train_a=False)
    split = pretrained_split(LLAMA, lora=lora)
    lm = split_lora(load_pretrained(LLAMA, lora=lora, scan_layers=False))
    whole = save_peft_adapters(lm, lm.adapters, tmp_path / "whole")
    for k, (lo, hi) in enumerate([(0, 2), (2, 4)]):
        st = split.stage(lo, hi)
        save_peft_part(st.params, lora, tmp_path / "parts", stage=k, num_stages=2, frozen=st.frozen)
    got = load_file(str(tmp_path / "parts" / "adapter_model.safetensors"))
    want = load_file(str(whole / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and any("lora_A" in k for k in got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert jax.tree.leaves(st.params), "the stage trains B"
