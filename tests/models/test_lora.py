"""LoRA / QLoRA with qwix on the nnx transformer: adapters start as the identity, only adapters
train, the streamed quantised load equals quantising in memory, merged weights equal the adapted
forward pass and round-trip through Hugging Face files, dropout only in training steps, and
one-line errors."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("qwix")
pytest.importorskip("safetensors")
from flax import nnx  # noqa: E402

from ravnest_jax.models import (  # noqa: E402
    LoraConfig,
    apply_lora,
    load_pretrained,
    save_pretrained,
    split_lora,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llm"
LLAMA = FIXTURES / "llama"


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.load(LLAMA / "tokens.npy"))


@pytest.fixture(scope="module")
def base_logits(tokens):
    return np.asarray(load_pretrained(LLAMA)(tokens))


def _forward(lm, adapters, tokens, key=None):
    """The adapted model's logits, jitted (the eager qwix path dispatches op by op)."""
    return np.asarray(jax.jit(lambda a, f, t, k: lm.model(a, f, k)(t))(adapters, lm.frozen, tokens, key))


def _loss(lm, adapters, frozen, tokens, key=None):
    logits = lm.model(adapters, frozen, key)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _train(lm, tokens, steps=15, lr=1e-2):
    tx = optax.adam(lr)
    adapters, opt = lm.adapters, tx.init(lm.adapters)

    @jax.jit
    def step(adapters, opt, frozen, key):
        loss, g = jax.value_and_grad(lambda a: _loss(lm, a, frozen, tokens, key))(adapters)
        u, opt = tx.update(g, opt, adapters)
        return optax.apply_updates(adapters, u), opt, loss

    for i in range(steps):
        adapters, opt, _ = step(adapters, opt, lm.frozen, jax.random.key(i) if lm.lora.dropout else None)
    return adapters


def _randomize(adapters, seed=1):
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(rank=0), "rank"),
        (dict(alpha=0.0), "alpha"),
        (dict(dropout=1.0), "dropout"),
        (dict(targets=("q", "attn")), "unknown LoRA target 'attn'"),
        (dict(targets=()), "at least one"),
    ],
)
def test_config_rejects_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LoraConfig(**kw)


def test_config_accepts_short_and_long_names():
    assert LoraConfig(targets=("q", "v_proj", "q_proj")).targets == ("q_proj", "v_proj")


@pytest.mark.integration
def test_fresh_adapters_leave_the_model_unchanged_and_count_right(tokens, base_logits):
    cfg = LoraConfig(rank=4, train_a=False)
    lm = split_lora(load_pretrained(LLAMA, lora=cfg))
    got = _forward(lm, lm.adapters, tokens)
    np.testing.assert_allclose(got, base_logits, atol=1e-6)
    c = load_pretrained(LLAMA).config
    q, kv, o, f = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.hidden_size,
        c.intermediate_size,
    )
    outs = [q, kv, kv, o, f, f, c.hidden_size]  # q, k, v, o, gate, up, down
    assert lm.num_adapter_params == c.num_hidden_layers * cfg.rank * sum(outs)
    ins = [c.hidden_size] * 3 + [q] + [c.hidden_size] * 2 + [f]
    with_a = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4)))  # the default trains A too
    assert with_a.num_adapter_params == lm.num_adapter_params + c.num_hidden_layers * cfg.rank * sum(ins)


@pytest.mark.integration
def test_adapters_depend_on_the_seed_only():
    a = nnx.state(load_pretrained(LLAMA, lora=LoraConfig(rank=4, seed=3)), nnx.LoRAParam)
    b = nnx.state(load_pretrained(LLAMA, lora=LoraConfig(rank=4, seed=3)), nnx.LoRAParam)
    c = nnx.state(load_pretrained(LLAMA, lora=LoraConfig(rank=4, seed=4)), nnx.LoRAParam)
    la, lb, lc = jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)
    assert all(np.array_equal(x, y) for x, y in zip(la, lb))
    assert any(not np.array_equal(x, z) for x, z in zip(la, lc))


@pytest.mark.integration
@pytest.mark.parametrize("quantize", [None, "int4"])
def test_streamed_load_equals_adapting_in_memory(tokens, quantize):
    cfg = LoraConfig(rank=4, targets=("q", "v", "down"))
    streamed = load_pretrained(LLAMA, lora=cfg, quantize=quantize)
    in_memory = apply_lora(load_pretrained(LLAMA), cfg, quantize=quantize)
    for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(streamed)), nnx.to_flat_state(nnx.state(in_memory))):
        assert x.get_value().dtype == y.get_value().dtype, p
        np.testing.assert_array_equal(np.asarray(x.get_value(), np.float32), np.asarray(y.get_value(), np.float32))
    a, b = split_lora(streamed), split_lora(in_memory)
    np.testing.assert_array_equal(_forward(a, a.adapters, tokens), _forward(b, b.adapters, tokens))


@pytest.mark.integration
@pytest.mark.parametrize("quantize, bits, tol", [("int8", 8, 0.02), ("int4", 4, 0.25)])
def test_quantized_base_is_stored_in_low_bits_and_close(tokens, base_logits, quantize, bits, tol):
    lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4), quantize=quantize))
    kinds = {str(v.get_value().dtype) for p, v in nnx.to_flat_state(lm.frozen) if "qvalue" in map(str, p)}
    assert kinds == {quantize}, kinds
    # stacked layers (scan_layers): one leaf per projection, its first axis the layer
    n_q = sum(v.get_value().shape[0] for p, v in nnx.to_flat_state(lm.frozen) if "qvalue" in map(str, p))
    assert n_q == 7 * 2, n_q  # every projection of both layers; the embeddings and head stay float
    got = _forward(lm, lm.adapters, tokens)
    rel = float(np.abs(got - base_logits).max() / np.abs(base_logits).max())
    assert 0 < rel < tol, f"{quantize}: max |logits - float logits| / max |logits| = {rel:.4f}"


@pytest.mark.integration
@pytest.mark.parametrize("quantize", ["int4"])
def test_merged_weights_equal_the_adapted_model_and_round_trip(tmp_path, tokens, quantize):
    cfg = LoraConfig(rank=4, alpha=16.0)
    lm = split_lora(load_pretrained(LLAMA, lora=cfg, quantize=quantize))
    adapters = _randomize(lm.adapters)
    want = _forward(lm, adapters, tokens)
    merged = lm.merged(adapters)
    np.testing.assert_allclose(np.asarray(merged(tokens)), want, atol=2e-5)
    back = load_pretrained(save_pretrained(merged, tmp_path / "merged"))
    np.testing.assert_allclose(np.asarray(back(tokens)), want, atol=2e-5)


@pytest.mark.integration
def test_only_adapters_train_and_the_loss_falls(tokens):
    lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4, train_a=False)))
    before = float(_loss(lm, lm.adapters, lm.frozen, tokens))
    adapters = _train(lm, tokens)
    after = float(_loss(lm, adapters, lm.frozen, tokens))
    assert after < before - 0.1, (before, after)
    # the frozen A: no A among the adapters, the frozen state untouched
    assert all(str(p[-1]).endswith("_lora_b") for p, _ in nnx.to_flat_state(adapters))


@pytest.mark.integration
def test_dropout_applies_in_training_steps_only(tokens):
    lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4, dropout=0.5)))
    adapters = _randomize(lm.adapters)
    ev1, ev2 = _forward(lm, adapters, tokens), _forward(lm, adapters, tokens)
    tr1, tr2 = _forward(lm, adapters, tokens, jax.random.key(0)), _forward(lm, adapters, tokens, jax.random.key(1))
    np.testing.assert_array_equal(ev1, ev2)
    assert np.abs(tr1 - ev1).max() > 1e-4 and np.abs(tr1 - tr2).max() > 1e-4
    _train(lm, tokens, steps=2)  # a jitted step with dropout compiles and runs


@pytest.mark.integration
def test_bf16_compute_with_float32_adapters(tokens):
    lm = split_lora(load_pretrained(LLAMA, dtype=jnp.bfloat16, lora=LoraConfig(rank=4), quantize="int4"))
    assert {x.dtype for x in jax.tree.leaves(lm.adapters)} == {jnp.dtype(jnp.float32)}
    out = _forward(lm, _randomize(lm.adapters), tokens)
    assert out.dtype == np.float32 and bool(np.isfinite(out).all())


def test_errors_are_one_line():
    with pytest.raises(ValueError, match="quantize='int3'"):
        load_pretrained(LLAMA, quantize="int3")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        split_lora(load_pretrained(LLAMA))
    with pytest.raises(ValueError, match="quantize='fp4'"):
        apply_lora(load_pretrained(LLAMA), LoraConfig(), quantize="fp4")
