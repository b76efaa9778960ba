"""Chunked cross-entropy: the loss and gradients of the plain full-logits path (untied and tied
heads, LoRA and int4 bases, a sequence that does not divide by the chunk, a vocabulary that does
not divide by the block, a mask, a trained head), and XLA's plan holds no (batch, seq, vocab)
float32 buffer and, with a frozen head, no head-sized one."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("qwix")
from flax import nnx  # noqa: E402

from ravnest_jax.models import (  # noqa: E402
    LoraConfig,
    Transformer,
    TransformerConfig,
    apply_lora,
    chunked_cross_entropy,  # noqa: E402
    split_lora,
)

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"


def _random_adapters(adapters):
    """B != 0, so that the adapters change the output and get gradients through every path."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize(
    "tied, quantize, chunk, vocab_chunk",
    [
        pytest.param(
            False, None, 10, 40, marks=pytest.mark.integration
        ),  # 5 positions of each of the 2 rows; 96 tokens: blocks 0-39, 40-79, 56-95
        (True, None, 14, 25),  # 4 blocks, the last overlapping the third
        pytest.param(
            False, None, 10, None, marks=pytest.mark.integration
        ),  # the whole head per sequence chunk, under jax.checkpoint
        pytest.param(False, "int4", 128, 16384, marks=pytest.mark.integration),  # ~8 s of compiles each
        pytest.param(True, "int4", 8, 7, marks=pytest.mark.integration),
    ],
)
def test_equals_the_full_logits_loss_and_gradients(tied, quantize, chunk, vocab_chunk):
    lm, adapters, (tokens, targets, mask), (v0, g0), (hidden, gh0) = _full_logits_case(tied, quantize)

    def chunked(adapters):
        model = lm.model(adapters, lm.frozen)
        hidden = model(tokens, head=False)
        return chunked_cross_entropy(model, hidden, targets, mask, chunk_size=chunk, vocab_chunk=vocab_chunk)

    ((v1, count), g1) = jax.jit(jax.value_and_grad(chunked, has_aux=True))(adapters)
    assert float(count) == float(mask.sum())
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    for (p, a), c in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        scale = float(jnp.abs(a).max())  # float32 sums in another order: 1e-5 of the gradient's scale
        np.testing.assert_allclose(
            np.asarray(c), np.asarray(a), rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(p)
        )
    assert max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g0)) > 0

    # w.r.t. the hidden state itself
    model = lm.model(adapters, lm.frozen)
    gh1 = jax.jit(
        jax.grad(lambda h: chunked_cross_entropy(model, h, targets, mask, chunk_size=chunk, vocab_chunk=vocab_chunk)[0])
    )(hidden)
    np.testing.assert_allclose(np.asarray(gh1), np.asarray(gh0), rtol=1e-5, atol=1e-5 * float(jnp.abs(gh0).max()))


@functools.cache
def _full_logits_case(tied, quantize):
    """The model, its random adapters, the data (2 rows of 23 positions: no chunk size of the
    test divides it), the plain full-logits loss and its gradients w.r.t. the adapters, and the
    hidden state and the plain head's gradient w.r.t. it: once per model (two cases share one)."""
    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), tie_word_embeddings=tied)
    lm = split_lora(apply_lora(Transformer(cfg, nnx.Rngs(0)), LoraConfig(rank=4), quantize=quantize))
    adapters = _random_adapters(lm.adapters)
    b, t = 2, 23
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    tokens = jax.random.randint(k1, (b, t), 0, cfg.vocab_size)
    targets = jax.random.randint(k2, (b, t), 0, cfg.vocab_size)
    mask = (jax.random.uniform(k3, (b, t)) < 0.7).astype(jnp.float32)

    def plain(adapters):
        model = lm.model(adapters, lm.frozen)
        logits = model(tokens)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(nll * mask)

    model = lm.model(adapters, lm.frozen)
    hidden = jax.jit(lambda a: lm.model(a, lm.frozen)(tokens, head=False))(adapters)

    def head_plain(h):
        x = model.norm(h)
        logits = (model.embed_tokens.attend(x) if tied else model.lm_head(x)).astype(jnp.float32)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask)

    plain_out = jax.jit(jax.value_and_grad(plain))(adapters)
    return lm, adapters, (tokens, targets, mask), plain_out, (hidden, jax.jit(jax.grad(head_plain))(hidden))


def test_no_mask_counts_every_position_and_bad_input_is_one_line():
    cfg = TransformerConfig.from_hf(LLAMA)
    # zero weights: logits 0, so each position's loss is log(vocab) > 0; no random init to compile
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    model = nnx.merge(graphdef, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    hidden = jnp.ones((2, 9, cfg.hidden_size))
    targets = jnp.zeros((2, 9), jnp.int32)
    nll, count = chunked_cross_entropy(model, hidden, targets, chunk_size=4)
    assert float(count) == 18
    np.testing.assert_allclose(float(nll), 18 * np.log(cfg.vocab_size), rtol=1e-5)
    for kwargs, needle in [
        (dict(chunk_size=0), "chunk_size must be an int >= 1, got 0"),
        (dict(vocab_chunk=0), "vocab_chunk must be an int >= 1 or None, got 0"),
        (dict(loss_mask=jnp.ones((2, 8))), "loss_mask (2, 8) must have the targets' shape (2, 9)"),
    ]:
        with pytest.raises(ValueError) as e:
            chunked_cross_entropy(model, hidden, targets, **kwargs)
        assert needle in str(e.value)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize("tied", [False, True])
def test_a_trained_head_gets_the_full_logits_gradients(tied):
    """Every parameter differentiated (the head and the norm too), 96 tokens in blocks of 40."""
    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), tie_word_embeddings=tied)
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    b, t = 2, 11
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    hidden = jax.random.normal(k1, (b, t, cfg.hidden_size))
    targets = jax.random.randint(k2, (b, t), 0, cfg.vocab_size)
    mask = (jax.random.uniform(k3, (b, t)) < 0.8).astype(jnp.float32)

    def plain(params, h):
        model = nnx.merge(graphdef, params)
        x = model.norm(h)
        logits = (model.embed_tokens.attend(x) if tied else model.lm_head(x)).astype(jnp.float32)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask)

    def blocked(params, h):
        model = nnx.merge(graphdef, params)
        return chunked_cross_entropy(model, h, targets, mask, chunk_size=6, vocab_chunk=40)[0]

    v0, g0 = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(params, hidden)
    v1, g1 = jax.jit(jax.value_and_grad(blocked, argnums=(0, 1)))(params, hidden)
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    head = ("embed_tokens", "embedding") if tied else ("lm_head", "kernel")
    names = []
    for (p, a), c in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        names.append(jax.tree_util.keystr(p))
        scale = float(jnp.abs(a).max())
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-5, atol=1e-5 * scale, err_msg=names[-1])
    assert any(all(n in name for n in head) for name in names), names
    w = g1[0]["embed_tokens"]["embedding"] if tied else g1[0]["lm_head"]["kernel"]
    assert float(jnp.abs(w[...]).max()) > 0


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize("tied", [False, True])
def test_compiled_gradient_holds_no_whole_float32_logits(tied):
    """A 32k vocabulary at 2 x 512 positions: the whole float32 logits would be 128 MiB. With
    chunks of 64 tokens, XLA's temporaries of the loss and its gradient stay under three chunks'
    whole-vocabulary logits (24 MiB) on the whole-head path; in blocks of 4096 tokens, with the
    head frozen (LoRA), under three whole-vocabulary chunks' logits by a factor of 4 (no
    head-sized buffer either: the head is 8 MiB), and with the head trained under that plus the
    head's float32 gradient."""
    cfg = dataclasses.replace(
        TransformerConfig.from_hf(LLAMA), vocab_size=32768, num_hidden_layers=1, tie_word_embeddings=tied
    )
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    b, t = 2, 512
    hidden = jax.ShapeDtypeStruct((b, t, cfg.hidden_size), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)
    mask = jax.ShapeDtypeStruct((b, t), jnp.float32)
    logits, chunk = b * t * cfg.vocab_size * 4, 64 * cfg.vocab_size * 4  # 64 tokens: 32 positions x 2 rows
    head = cfg.hidden_size * cfg.vocab_size * 4

    def temp(vocab_chunk, argnums):
        def loss(params, h, tgt, m):
            model = nnx.merge(graphdef, params)
            return chunked_cross_entropy(model, h, tgt, m, chunk_size=64, vocab_chunk=vocab_chunk)[0]

        lowered = jax.jit(jax.value_and_grad(loss, argnums=argnums)).lower(params, hidden, targets, mask)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    whole, frozen, trained = temp(None, (0, 1)), temp(4096, 1), temp(4096, (0, 1))
    figures = f"temp: whole head {whole:,}, blocks frozen {frozen:,}, trained {trained:,}; logits {logits:,}, a chunk {chunk:,}, the head {head:,}"
    # the backward pass of a chunk holds its logits and their softmax: about two chunks
    assert whole < 3 * chunk < logits / 2, figures
    assert frozen < 3 * chunk / 4 and frozen < head, figures
    assert trained < 3 * chunk / 4 + head, figures
