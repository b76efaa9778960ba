"""Gradient checkpointing (``remat=True``): the same gradients as without it, bit for bit, and
XLA's plan of the compiled step really holds one block's activations instead of every
block's (``jax.checkpoint``'s barrier is removed by XLA's CPU pipeline and the recomputation
merged back into the forward pass; ``recompute_in_backward`` is not)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("qwix")
from flax import nnx  # noqa: E402

from ravnest_jax.models import LoraConfig, Transformer, TransformerConfig, apply_lora, split_lora  # noqa: E402
from ravnest_jax.models._remat import recompute_in_backward  # noqa: E402

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"

pytestmark = pytest.mark.integration  # compiles training steps: 10-35 s each on 2 cores
#: remat against no remat is equal to the bit only when XLA optimises both (tests/models/conftest.py)
DEFAULT_XLA_COMPILES = True


def _lm(layers: int, quantize=None, dropout=0.0):
    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=layers)
    return split_lora(apply_lora(Transformer(cfg, nnx.Rngs(0)), LoraConfig(rank=4, dropout=dropout), quantize=quantize))


def _loss(lm, remat, attention="auto"):
    def loss(adapters, frozen, tokens, key):
        model = lm.model(adapters, frozen, key)
        model.remat, model.attention = remat, attention
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


@pytest.mark.parametrize("quantize, dropout", [("int4", 0.3)])  # float weights, int4 and keys all tied
def test_remat_gives_the_same_loss_and_gradients(quantize, dropout):
    lm = _lm(2, quantize, dropout)
    # B != 0, so that the adapters (and their dropout) change the output
    leaves, tree = jax.tree.flatten(lm.adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    adapters = jax.tree.unflatten(tree, [0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))
    key = jax.random.key(3) if dropout else None
    (v0, g0), (v1, g1) = (
        jax.jit(jax.value_and_grad(_loss(lm, remat)))(adapters, lm.frozen, tokens, key) for remat in (False, True)
    )
    assert float(v0) == float(v1), (float(v0), float(v1))
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))
    assert max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g0)) > 0


def _temp_bytes(lm, remat: bool, batch: int, seq: int) -> int:
    def step(adapters, frozen, tokens):
        return jax.grad(_loss(lm, remat, "xla"))(adapters, frozen, tokens, None)  # attention holding the scores

    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    return jax.jit(step).lower(lm.adapters, lm.frozen, tokens).compile().memory_analysis().temp_size_in_bytes


def test_remat_keeps_one_block_of_activations_in_xla_plan():
    """2 and 4 layers at 512 tokens, where the attention scores of a block (XLA's attention)
    dominate: without remat XLA's plan grows by a block's activations per layer, with it by the
    block's input."""
    batch, seq = 2, 512
    plain = {n: _temp_bytes(_lm(n), False, batch, seq) for n in (2, 4)}
    remat = {n: _temp_bytes(_lm(n), True, batch, seq) for n in (2, 4)}
    block_input = batch * seq * 64 * 4  # float32 (batch, seq, hidden)
    per_layer_plain = (plain[4] - plain[2]) / 2
    per_layer_remat = (remat[4] - remat[2]) / 2
    assert per_layer_plain > 20 * block_input, (plain, block_input)
    assert per_layer_remat <= 1.1 * block_input, f"remat grows by {per_layer_remat} a layer, block input {block_input}"
    assert remat[4] < 0.5 * plain[4], (remat, plain)


def test_jax_checkpoint_alone_is_undone_by_xla_on_cpu():
    """Why the model does not use ``jax.checkpoint``: on CPU its recomputation is merged back
    into the forward pass (the same temp bytes as without it); ``recompute_in_backward`` of
    the same blocks holds a fraction of that. If this starts failing, XLA's CPU pipeline keeps
    the barrier now and ``jax.checkpoint`` may do."""
    layers, n, d = 6, 2048, 256

    def block(w, x):
        return x + jnp.tanh(jnp.tanh(x @ w) @ w.T)

    def loss(ws, x, how):
        for i in range(layers):
            if how == "checkpoint":
                x = jax.checkpoint(block)(ws[i], x)
            elif how == "recompute":
                x = recompute_in_backward(block, ws[i], x)
            else:
                x = block(ws[i], x)
        return (x**2).sum()

    ws = jax.ShapeDtypeStruct((layers, d, d), jnp.float32)
    x = jax.ShapeDtypeStruct((n, d), jnp.float32)
    temp = {
        how: jax.jit(jax.grad(lambda w, x, how=how: loss(w, x, how))).lower(ws, x).compile().memory_analysis()
        for how in ("plain", "checkpoint", "recompute")
    }
    temp = {k: v.temp_size_in_bytes for k, v in temp.items()}
    assert temp["checkpoint"] > 0.9 * temp["plain"], temp
    assert temp["recompute"] < 0.6 * temp["plain"], temp
    wv = 0.05 * jax.random.normal(jax.random.key(0), (layers, d, d))
    xv = jax.random.normal(jax.random.key(1), (n, d))
    g = [jax.jit(jax.grad(lambda w, x, how=how: loss(w, x, how)))(wv, xv) for how in ("plain", "recompute")]
    np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(g[1]))
