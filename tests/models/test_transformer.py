"""The nnx transformer against Hugging Face ``transformers`` (reference logits made once by
``tests/fixtures/make_llm_fixtures.py``, committed; no torch here), and Hugging Face checkpoints:
sharded loads, round trips through ``save_pretrained``, and one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

from ravnest_jax.models import TransformerConfig, load_pretrained, save_pretrained  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llm"
NAMES = ["llama", "qwen3", "qwen2"]


def _logits(model, d: Path) -> np.ndarray:
    return np.asarray(model(jnp.asarray(np.load(d / "tokens.npy"))))


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers_within_1e_4(name):
    d = FIXTURES / name
    model = load_pretrained(d)
    ref = np.load(d / "logits.npy")
    got = _logits(model, d)
    err = float(np.abs(got - ref).max())
    assert got.shape == ref.shape and err < 1e-4, f"{name}: max |logits - transformers| = {err:.2e}"


def test_config_reads_each_layout():
    llama = TransformerConfig.from_hf(FIXTURES / "llama")
    qwen3 = TransformerConfig.from_hf(FIXTURES / "qwen3")
    qwen2 = TransformerConfig.from_hf(FIXTURES / "qwen2")
    assert (llama.num_key_value_heads, llama.rope_scaling["rope_type"], llama.tie_word_embeddings) == (
        2,
        "llama3",
        False,
    )
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.tie_word_embeddings) == (True, 24, True)
    assert qwen2.attention_bias and not qwen2.qk_norm
    for cfg, name in ((llama, "llama"), (qwen3, "qwen3"), (qwen2, "qwen2")):
        n = sum(a.size for a in load_file(str(FIXTURES / name / "model.safetensors")).values())
        assert cfg.num_params() == n, (name, cfg.num_params(), n)


def test_a_sharded_checkpoint_loads_like_one_file(tmp_path):
    src = FIXTURES / "llama"
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / f), metadata={"format": "pt"})
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    got = _logits(load_pretrained(tmp_path), src)
    np.testing.assert_allclose(got, np.load(src / "logits.npy"), atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_save_pretrained_round_trips(tmp_path, name):
    src = FIXTURES / name
    model = load_pretrained(src)
    out = save_pretrained(model, tmp_path / "out")
    again = load_pretrained(out)
    np.testing.assert_array_equal(_logits(again, src), _logits(model, src))
    theirs, ours = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
    for k, v in ours.items():
        np.testing.assert_array_equal(v, theirs[k], err_msg=k)


def test_bfloat16_compute_stays_close():
    d = FIXTURES / "llama"
    got = _logits(load_pretrained(d, dtype=jnp.bfloat16), d)
    ref = np.load(d / "logits.npy")
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max() + 0.05


def _copy(tmp_path: Path, name: str = "llama") -> Path:
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def test_a_missing_tensor_is_named(tmp_path):
    d = _copy(tmp_path)
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_pretrained(d)


def test_a_misshaped_tensor_is_named(tmp_path):
    d = _copy(tmp_path)
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \[8, 64\].*needs \[32, 64\]"):
        load_pretrained(d)


def test_unsupported_architecture_and_missing_files_are_one_line(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_pretrained(d)
    with pytest.raises(ValueError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    e = _copy(tmp_path, "qwen3")
    (e / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_pretrained(e)
