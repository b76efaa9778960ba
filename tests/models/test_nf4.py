"""QLoRA's NormalFloat4 base (``quantize="nf4"``, arXiv 2305.14314): stored as 4-bit level
indices with one absmax scale per block of 64 (of the largest block dividing the tiny fixture's
widths), logits close to the float model's (no further than int4's), a LoRA step that lowers the
loss, and a merge that dequantises it and round-trips through Hugging Face files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("qwix")
pytest.importorskip("safetensors")
from flax import nnx  # noqa: E402

from ravnest_jax.models import LoraConfig, TransformerConfig, load_pretrained, save_pretrained, split_lora  # noqa: E402
from ravnest_jax.models._lora import _tile_size  # noqa: E402

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.load(LLAMA / "tokens.npy"))


def _logits(lm, adapters, tokens):
    return np.asarray(jax.jit(lambda a, f, t: lm.model(a, f)(t))(adapters, lm.frozen, tokens))


@pytest.mark.parametrize(
    "hidden, inter, heads, head_dim, want",
    [(8192, 28672, 64, 128, 64), (4096, 14336, 32, 128, 64), (64, 112, 4, 16, 16), (96, 160, 4, 24, 32)],
)
def test_nf4_blocks_are_qloras_64_where_they_divide(hidden, inter, heads, head_dim, want):
    cfg = TransformerConfig(
        model_type="llama", vocab_size=32, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
    )  # fmt: skip
    assert _tile_size(cfg, "nf4") == want
    assert _tile_size(dataclasses.replace(cfg), "int8") is None


@pytest.mark.integration
def test_nf4_base_is_4_bit_levels_and_closer_than_int4(tokens):
    base = np.asarray(load_pretrained(LLAMA)(tokens))
    err = {}
    for q in ("int4", "nf4"):
        lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4), quantize=q))
        values = {str(v.get_value().dtype) for p, v in nnx.to_flat_state(lm.frozen) if str(p[-1]) == "qvalue"}
        assert values == {"int4" if q == "int4" else "uint4"}, values
        err[q] = float(np.abs(_logits(lm, lm.adapters, tokens) - base).max() / np.abs(base).max())
    # measured: int4 0.141, nf4 0.123 (max |logits - float logits| / max |float logits|)
    assert 0 < err["nf4"] < 0.2 and err["nf4"] <= err["int4"] * 1.05, err


@pytest.mark.integration
def test_nf4_lora_trains_and_merges_to_a_plain_checkpoint(tmp_path, tokens):
    lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4, alpha=16.0), quantize="nf4"))
    tx = optax.adam(1e-2)

    def loss(a, f):
        logits = lm.model(a, f)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(a, opt, f):
        value, g = jax.value_and_grad(loss)(a, f)
        u, opt = tx.update(g, opt, a)
        return optax.apply_updates(a, u), opt, value

    adapters, opt = lm.adapters, tx.init(lm.adapters)
    losses = []
    for _ in range(10):
        adapters, opt, value = step(adapters, opt, lm.frozen)
        losses.append(float(value))
    assert losses[-1] < losses[0] - 0.1, losses
    want = _logits(lm, adapters, tokens)
    merged = lm.merged(adapters)
    assert not any("qvalue" in map(str, p) for p, _ in nnx.to_flat_state(nnx.state(merged)))
    np.testing.assert_allclose(np.asarray(merged(tokens)), want, atol=2e-5)
    back = load_pretrained(save_pretrained(merged, tmp_path / "merged"))
    np.testing.assert_allclose(np.asarray(back(tokens)), want, atol=2e-5)
