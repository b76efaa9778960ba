"""The token-chunked MLP (``Transformer.mlp_chunk`` under ``remat`` ``"full"``): the same loss
and, within float32 rounding, the same gradients as the MLP on all tokens at once, scanned and
unrolled, int4 base, a sequence that does not divide into chunks; XLA's plan of a block whose
MLP dominates holds one chunk's MLP activations; chunking is off where activations are kept."""

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

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"


def _lm(layers: int, scan_layers: bool, quantize=None, **cfg_changes):
    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=layers, **cfg_changes)
    model = Transformer(cfg, nnx.Rngs(0), scan_layers=scan_layers)
    return split_lora(apply_lora(model, LoraConfig(rank=4), quantize=quantize))


def _adapters(lm):
    """Random adapters (B != 0: the adapters change the output)."""
    leaves, tree = jax.tree.flatten(lm.adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _loss(lm, mlp_chunk, remat="full"):
    def loss(adapters, frozen, tokens):
        model = lm.model(adapters, frozen, None)
        model.remat, model.mlp_chunk = remat, mlp_chunk
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


@pytest.mark.integration  # four compiles of a 2-layer step: ~30 s on 2 cores
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_chunked_mlp_gives_the_same_loss_and_gradients(scan_layers):
    lm = _lm(2, scan_layers, "int4")
    adapters = _adapters(lm)
    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))  # (2, 24): 23 positions a row
    v0, g0 = jax.jit(jax.value_and_grad(_loss(lm, None)))(adapters, lm.frozen, tokens)
    # 8 tokens: 4 positions of each row, 6 chunks, the last one padded
    v1, g1 = jax.jit(jax.value_and_grad(_loss(lm, 8)))(adapters, lm.frozen, tokens)
    assert float(v0) == float(v1), (float(v0), float(v1))
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        a, b = np.asarray(a), np.asarray(b)
        scale = float(np.abs(a).max())
        assert scale > 0, jax.tree_util.keystr(p)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(p))


@pytest.mark.integration  # two compiles: ~10 s on 2 cores
def test_xla_plan_holds_one_chunk_of_mlp_activations():
    """One block whose MLP is wide (intermediate 4096 for hidden 64) at 2 x 512 tokens: its
    float32 (tokens, intermediate) activations dominate the block's, and the chunked MLP's plan
    is well under the whole MLP's."""
    lm = _lm(1, True, intermediate_size=4096)
    tokens = jax.ShapeDtypeStruct((2, 513), jnp.int32)

    def temp(mlp_chunk):
        step = jax.jit(jax.grad(_loss(lm, mlp_chunk)))
        return step.lower(lm.adapters, lm.frozen, tokens).compile().memory_analysis().temp_size_in_bytes

    whole, chunked = temp(None), temp(256)
    mlp = 1024 * 4096 * 4  # one float32 (tokens, intermediate) array of the whole batch
    assert whole - chunked > 2 * mlp, (whole, chunked, mlp)


@pytest.mark.integration  # compiles two memory plans: ~4 s
def test_chunking_is_off_where_activations_are_kept():
    """The chunked MLP is a loop (``lax.map``) in the traced model, called on a model built
    outside the trace; with ``remat`` ``"none"`` or ``"dots"``, or ``mlp_chunk=None``, there is
    none (8 tokens: XLA's attention, no loop of its own)."""
    for scan_layers in (False, True):
        lm = _lm(1, scan_layers)
        model = lm.model(lm.adapters, lm.frozen, None)
        tokens = jnp.zeros((2, 8), jnp.int32)
        for remat, chunk, loops in (("none", 4, False), ("dots", 4, False), ("full", None, False), ("full", 4, True)):
            model.remat, model.mlp_chunk = remat, chunk
            jaxpr = str(jax.make_jaxpr(lambda t, m=model: m(t))(tokens))
            # the scanned model's layer loop is one scan of its own
            assert jaxpr.count("scan[") - scan_layers == loops, (scan_layers, remat, chunk)


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8"])
def test_a_bad_mlp_chunk_is_a_one_line_error(value):
    model = Transformer(dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=1), nnx.Rngs(0))
    with pytest.raises(ValueError, match="mlp_chunk"):
        model.mlp_chunk = value
