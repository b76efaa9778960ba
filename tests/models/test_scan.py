"""Layers under one ``jax.lax.scan`` (``scan_layers``): the stacked model computes what the
per-layer model computes (logits, loss, gradients, with LoRA and an int4 base, under every
``remat`` policy), loads and saves the same Hugging Face checkpoints, starts from the same
adapters; gradient checkpointing lowers XLA's temp bytes under the scan; bad ``remat`` values
are refused."""

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

import ravnest_jax as rj  # noqa: E402
from ravnest_jax.models import (  # noqa: E402
    REMAT,
    LoraConfig,
    Transformer,
    TransformerConfig,
    apply_lora,
    load_pretrained,
    save_pretrained,
    split_lora,
    stack_layers,
    unstack_layers,
)

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"
LAYERS = 2  # a scan of 2 layers against 2 per-layer blocks: stacking order, per-layer slices


def _cfg(layers: int = LAYERS) -> TransformerConfig:
    return dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=layers)


def _per_layer(state) -> dict:
    """``{path in the per-layer model: array}`` of a state of either form."""
    out = {}
    for p, v in nnx.to_flat_state(state):
        p, v = tuple(p), np.asarray(v.get_value())
        if p[0] == "layers" and not isinstance(p[1], int):
            for i in range(v.shape[0]):
                out[(p[0], i, *p[1:])] = v[i]
        else:
            out[p] = v
    return out


@functools.cache
def _lms(quantize):
    """The per-layer and the scanned model with the same LoRA (built once: the tests only read
    them)."""
    lora = LoraConfig(rank=4)
    return [
        split_lora(apply_lora(Transformer(_cfg(), nnx.Rngs(0), scan_layers=s), lora, quantize=quantize))
        for s in (False, True)
    ]


def _same_adapters(lm, values: dict):
    """``lm``'s adapters set to ``values`` (per-layer paths), stacked where ``lm`` stacks."""
    flat = []
    for p, v in nnx.to_flat_state(lm.adapters):
        p = tuple(p)
        if p[0] == "layers" and not isinstance(p[1], int):
            flat.append((p, v.replace(jnp.stack([values[(p[0], i, *p[1:])] for i in range(LAYERS)]))))
        else:
            flat.append((p, v.replace(jnp.asarray(values[p]))))
    return nnx.from_flat_state(flat)


@pytest.mark.integration  # 4 s of compiling each on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize("quantize", [None, "int4"])
def test_stacked_adapters_start_equal_to_the_per_layer_ones(quantize):
    plain, scanned = _lms(quantize)
    a, b = _per_layer(plain.adapters), _per_layer(scanned.adapters)
    assert a.keys() == b.keys() and len(a) == 2 * 7 * LAYERS
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=".".join(map(str, k)))
    leaf = scanned.frozen["layers"]["self_attn"]["q_proj"]["kernel"]["array"]["qvalue"] if quantize else None
    assert leaf is None or (leaf.get_value().dtype == jnp.int4 and leaf.get_value().shape[0] == LAYERS)
    a, b = _per_layer(plain.frozen), _per_layer(scanned.frozen)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=".".join(map(str, k)))


@pytest.mark.integration  # six pairs of compiled gradient steps: ~60 s on 2 cores
@pytest.mark.parametrize("quantize", [None, "int4"])
@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scanned_logits_loss_and_gradients_equal_the_per_layer_model(quantize, remat):
    plain, scanned = _lms(quantize)
    # B != 0, so that the adapters change the output
    values = {
        k: 0.05 * np.cos(np.arange(v.size, dtype=np.float32).reshape(v.shape) + i)
        for i, (k, v) in enumerate(_per_layer(plain.adapters).items())
    }
    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))
    out = []
    for lm in (plain, scanned):

        def loss(adapters, frozen, lm=lm):
            model = lm.model(adapters, frozen)
            model.remat = remat
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), logits

        (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(_same_adapters(lm, values), lm.frozen)
        out.append((float(value), np.asarray(logits), _per_layer(grads)))
    (v0, l0, g0), (v1, l1, g1) = out
    assert abs(v0 - v1) <= 1e-5, (v0, v1)
    np.testing.assert_allclose(l1, l0, rtol=0, atol=1e-5)
    assert g0.keys() == g1.keys()
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=0, atol=1e-5, err_msg=".".join(map(str, k)))
    assert max(float(np.abs(g).max()) for g in g0.values()) > 0


@pytest.mark.integration  # ~8 s of compiles
def test_offload_policy_runs_and_equals_no_remat_under_the_scan():
    """``"offload"`` on CPU: ``pinned_host`` is host memory like the device's, the step compiles
    and runs; the gradients are those without checkpointing."""
    model = Transformer(_cfg(2), nnx.Rngs(0), scan_layers=True)
    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))

    def grads(remat):
        def loss(m):
            m.remat = remat
            return m(tokens).mean()

        return _per_layer(nnx.grad(loss)(model))

    g0, g1 = grads("none"), grads("offload")
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=0, atol=1e-6, err_msg=".".join(map(str, k)))


@pytest.mark.integration  # compiles the scanned and the per-layer model: ~4 s
def test_stack_and_unstack_round_trip_and_keep_the_logits():
    model = Transformer(_cfg(), nnx.Rngs(0))
    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))
    want = np.asarray(model(tokens))
    before = _per_layer(nnx.state(model))
    stack_layers(model)
    assert model.scan_layers and nnx.state(model)["layers"]["mlp"]["up_proj"]["kernel"].get_value().shape[0] == LAYERS
    np.testing.assert_allclose(np.asarray(model(tokens)), want, rtol=0, atol=1e-5)
    unstack_layers(model)
    assert not model.scan_layers and len(model.layers) == LAYERS
    after = _per_layer(nnx.state(model))
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_hugging_face_round_trip_of_a_scanned_load(tmp_path):
    model = load_pretrained(LLAMA)  # scanned by default
    assert model.scan_layers and model.remat == "full"
    save_pretrained(model, tmp_path / "out")
    assert model.scan_layers  # saving does not change the model's form
    again = load_pretrained(tmp_path / "out", scan_layers=False)
    a, b = _per_layer(nnx.state(model)), _per_layer(nnx.state(again))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=".".join(map(str, k)))
    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))
    np.testing.assert_allclose(np.asarray(model(tokens)), np.load(LLAMA / "logits.npy"), rtol=0, atol=1e-4)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_merged_adapters_of_a_scanned_model_equal_the_per_layer_ones():
    plain, scanned = _lms("int4")
    values = {k: 0.05 * np.ones_like(v) for k, v in _per_layer(plain.adapters).items()}
    a = plain.merged(_same_adapters(plain, values))
    b = scanned.merged(_same_adapters(scanned, values))
    assert b.scan_layers and not a.scan_layers
    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))
    np.testing.assert_allclose(np.asarray(b(tokens)), np.asarray(a(tokens)), rtol=0, atol=1e-5)


@pytest.mark.integration  # two compiles of a 4-layer step at 512 tokens: ~20 s on 2 cores
def test_remat_lowers_compiled_temp_bytes_under_the_scan():
    """``jax.checkpoint`` on the scan's body holds on CPU too: XLA cannot merge the backward
    loop's recomputation into the forward loop."""
    lm = split_lora(apply_lora(Transformer(_cfg(4), nnx.Rngs(0), scan_layers=True), LoraConfig(rank=4)))
    tokens = jax.ShapeDtypeStruct((2, 513), jnp.int32)

    def temp(remat):
        def loss(adapters, frozen, tokens):
            model = lm.model(adapters, frozen)
            model.remat = remat
            return model(tokens[:, :-1]).mean()

        c = jax.jit(jax.grad(loss)).lower(lm.adapters, lm.frozen, tokens).compile()
        return c.memory_analysis().temp_size_in_bytes

    none, full = temp("none"), temp("full")
    assert full < 0.6 * none, f"temp bytes: remat='full' {full}, remat='none' {none}"


@pytest.mark.parametrize("bad", ["yes", "Full", 1, "selective"])
def test_a_bad_remat_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="remat=") as e:
        Transformer(_cfg(1), nnx.Rngs(0), remat=bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="remat="):
        load_pretrained(LLAMA, remat=bad)
    with pytest.raises(ValueError, match="remat="):
        rj.pipeline.transformer_split(Transformer(_cfg(1), nnx.Rngs(0)), remat=bad)
    model = Transformer(_cfg(1), nnx.Rngs(0))
    model.remat = bad  # switched on a built model: refused at the call
    with pytest.raises(ValueError, match="remat="):
        model(jnp.zeros((1, 4), jnp.int32))
    assert set(REMAT) == {"none", "full", "dots", "offload"}


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_each_scanned_layer_draws_its_own_dropout_keys():
    """Layer ``i`` of the scan draws the adapters' dropout from its module's key folded with
    ``i``: the scanned model equals the per-layer model given those keys, and not the per-layer
    model whose layers all share one key."""
    lora = LoraConfig(rank=4, dropout=0.5)
    lm = split_lora(apply_lora(Transformer(_cfg(2), nnx.Rngs(0), scan_layers=True), lora))
    adapters = jax.tree.map(lambda x: x + 0.1, lm.adapters)  # B != 0: the dropout shows
    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))
    key = jax.random.key(7)
    got = np.asarray(lm.model(adapters, lm.frozen, key)(tokens))

    def per_layer(fold: bool):
        m = unstack_layers(nnx.clone(lm.model(adapters, lm.frozen, key)))
        for i, block in enumerate(m.layers):
            for _, module in nnx.iter_modules(block):
                rngs = getattr(module, "qwix_rngs", None)
                if rngs is not None:
                    k = rngs.dropout.key.get_value()
                    module.qwix_rngs = nnx.Rngs(dropout=jax.random.fold_in(k, i) if fold else k)
        return np.asarray(m(tokens))

    np.testing.assert_allclose(got, per_layer(True), rtol=0, atol=1e-5)
    assert np.abs(got - per_layer(False)).max() > 1e-3
