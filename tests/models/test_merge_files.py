"""``ravnest-jax merge-adapters`` / ``merge_adapters_into_files``: PEFT adapters folded into a
checkpoint shard by shard equal the in-memory merge (``merge_peft_adapters``), in the checkpoint's
own dtype and shard layout; ``ravnest-jax assemble-adapters`` joins stage parts from several
directories. Real safetensors files of the tiny Llama fixture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from ravnest_jax.cli import main as cli_main
from ravnest_jax.models import (
    LoraConfig,
    load_pretrained,
    merge_peft_adapters,
    save_peft_adapters,
    save_peft_part,
    split_lora,
)
from ravnest_jax.pipeline import pretrained_split

LLAMA = Path(__file__).parents[1] / "fixtures" / "llm" / "llama"
LORA = LoraConfig(rank=4, alpha=8, targets=("q", "v", "down"))


def _trained(state: nnx.State) -> nnx.State:
    flat = []
    for path, var in nnx.to_flat_state(state):
        seed = sum(ord(c) for c in "/".join(map(str, path)))
        value = np.random.default_rng(seed).normal(scale=0.3, size=var.get_value().shape)
        flat.append((path, var.replace(jnp.asarray(value, jnp.float32))))
    return nnx.from_flat_state(flat)


def _sharded(tmp: Path, dtype=None) -> Path:
    """The fixture as two shards and an index (in ``dtype``, if given), as large checkpoints come."""
    root = tmp / "sharded"
    root.mkdir()
    tensors = load_file(str(LLAMA / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] if dtype is None else tensors[n].astype(dtype) for n in part}, str(root / file))
        weight_map |= dict.fromkeys(part, file)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copyfile(LLAMA / "config.json", root / "config.json")
    return root


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    lm = split_lora(load_pretrained(LLAMA, lora=LORA, scan_layers=False))
    return save_peft_adapters(lm, _trained(lm.adapters), tmp_path_factory.mktemp("peft") / "adapters")


def _kernels(model) -> dict:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_merging_shard_by_shard_equals_the_in_memory_merge(adapters, tmp_path):
    src = _sharded(tmp_path)
    assert (
        cli_main(["merge-adapters", "--model", str(src), "--adapters", str(adapters), "--out", str(tmp_path / "m")])
        == 0
    )
    out = tmp_path / "m"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    want = _kernels(merge_peft_adapters(load_pretrained(LLAMA, scan_layers=False), adapters))
    base = _kernels(load_pretrained(LLAMA, scan_layers=False))
    got = _kernels(load_pretrained(out, scan_layers=False))
    assert sorted(got) == sorted(want)
    changed = [k for k in want if not np.array_equal(want[k], base[k])]
    assert len(changed) == 2 * 3, changed  # 2 layers x (q, v, down)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_a_bfloat16_checkpoint_stays_bfloat16(adapters, tmp_path):
    src = _sharded(tmp_path, ml_dtypes.bfloat16)
    assert (
        cli_main(["merge-adapters", "--model", str(src), "--adapters", str(adapters), "--out", str(tmp_path / "m")])
        == 0
    )
    before = {
        **load_file(str(src / "model-00001-of-00002.safetensors")),
        **load_file(str(src / "model-00002-of-00002.safetensors")),
    }
    after = {
        **load_file(str(tmp_path / "m" / "model-00001-of-00002.safetensors")),
        **load_file(str(tmp_path / "m" / "model-00002-of-00002.safetensors")),
    }
    assert {v.dtype for v in after.values()} == {np.dtype(ml_dtypes.bfloat16)}
    name = "model.layers.1.self_attn.q_proj.weight"
    a = load_file(str(adapters / "adapter_model.safetensors"))
    delta = 2.0 * (
        a["base_model.model." + name.replace(".weight", ".lora_B.weight")]
        @ a["base_model.model." + name.replace(".weight", ".lora_A.weight")]
    )
    expect = (before[name].astype(np.float32) + delta).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(after[name], expect)
    assert np.array_equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])


def test_bad_input_is_one_line_and_writes_nothing(adapters, tmp_path, capsys):
    other = tmp_path / "other"
    lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4, alpha=8), scan_layers=False))
    save_peft_adapters(lm, lm.adapters, other)
    tensors = load_file(str(other / "adapter_model.safetensors"))
    bad = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(bad, str(other / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for argv, want in (
        (["--model", str(LLAMA), "--adapters", str(other), "--out", str(tmp_path / "o")], "adapted weights are not in"),
        (["--model", str(LLAMA), "--adapters", str(tmp_path), "--out", str(tmp_path / "o")], "adapters: no "),
        (
            ["--model", str(LLAMA), "--adapters", str(adapters), "--out", str(tmp_path / "full")],
            "not an empty directory",
        ),
        (
            ["--model", str(tmp_path / "nope"), "--adapters", str(adapters), "--out", str(tmp_path / "o")],
            "not a directory",
        ),
    ):
        assert cli_main(["merge-adapters", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and want in err[0], (argv, err)
        assert not (tmp_path / "o").exists()


def test_assemble_adapters_joins_parts_copied_from_two_machines(tmp_path, capsys):
    split = pretrained_split(LLAMA, lora=LORA)
    for k, (lo, hi) in enumerate([(0, 2), (2, 4)]):
        save_peft_part(_trained(split.stage(lo, hi).params), LORA, tmp_path / f"machine{k}", stage=k, num_stages=2)
    assert cli_main(["assemble-adapters", str(tmp_path / "out"), str(tmp_path / "machine0")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage 1 of 2 missing" in err[0], err
    assert (
        cli_main(["assemble-adapters", str(tmp_path / "out"), str(tmp_path / "machine0"), str(tmp_path / "machine1")])
        == 0
    )
    lm = split_lora(load_pretrained(LLAMA, lora=LORA, scan_layers=False))
    whole = save_peft_adapters(lm, _trained(lm.adapters), tmp_path / "whole")
    got, want = (
        load_file(str(tmp_path / "out" / "adapter_model.safetensors")),
        load_file(str(whole / "adapter_model.safetensors")),
    )
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}
