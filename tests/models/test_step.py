"""The library's training step: the plain masked loss, gradient accumulation equal to one big
batch, bfloat16 compute with float32 adapter masters, dropout keyed by the step, one
compilation over many steps (donated state), layouts kept on a mesh, the eval loss."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("qwix")

import ravnest_jax as rj  # noqa: E402
from ravnest_jax.models import (  # noqa: E402
    LoraConfig,
    TokenBatch,
    init_opt_state,
    load_pretrained,
    make_eval_loss,
    make_train_step,
    split_lora,
)

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"


def _random_adapters(adapters, scale=0.05):
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _batch(b=4, t=13, vocab=96, seed=0, masked=True) -> TokenBatch:
    k1, k2 = jax.random.split(jax.random.key(seed))
    batch = TokenBatch.from_windows(jax.random.randint(k1, (b, t + 1), 0, vocab))
    if masked:  # a different number of counted tokens in every row
        mask = (jax.random.uniform(k2, (b, t)) < jnp.linspace(0.2, 0.9, b)[:, None]).astype(jnp.float32)
        batch = batch._replace(loss_mask=mask)
    return batch


@pytest.fixture(scope="module")
def lm():
    return split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4)))


@pytest.fixture(scope="module")
def sgd_step(lm):
    """One SGD step (lr 1, chunks of 8 tokens, nothing donated), compiled once for the module's
    tests of its loss and update (the metrics do not depend on the learning rate)."""
    return make_train_step(lm, optax.sgd(1.0), loss_chunk=8, donate=False)


def test_from_windows_shifts_and_counts_every_token():
    w = np.arange(12, dtype=np.int32).reshape(2, 6)
    b = TokenBatch.from_windows(w)
    assert isinstance(b.tokens, np.ndarray)  # numpy in, numpy out: one transfer to the device
    np.testing.assert_array_equal(b.tokens, w[:, :-1])
    np.testing.assert_array_equal(b.targets, w[:, 1:])
    np.testing.assert_array_equal(b.positions, [[0, 1, 2, 3, 4]] * 2)
    assert b.loss_mask.dtype == np.float32 and b.loss_mask.sum() == 10 and not b.segment_ids.any()
    with pytest.raises(ValueError, match="windows must be"):
        TokenBatch.from_windows(np.zeros((2, 1), np.int32))


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_loss_and_update_equal_the_plain_masked_step(lm):
    """One SGD step of the library's step against full float32 logits and optax's
    cross-entropy, mean over the masked tokens."""
    adapters = _random_adapters(lm.adapters)
    batch = _batch()

    def plain(a):
        logits = lm.model(a, lm.frozen)(batch.tokens)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets)
        return jnp.sum(nll * batch.loss_mask) / jnp.sum(batch.loss_mask)

    loss0, g0 = jax.jit(jax.value_and_grad(plain))(adapters)
    tx = optax.sgd(1.0)
    step = make_train_step(lm, tx, loss_chunk=4, donate=False)
    new, _, metrics = step(adapters, tx.init(adapters), lm.frozen, batch, jnp.int32(0))
    assert float(metrics["tokens"]) == float(batch.loss_mask.sum())
    np.testing.assert_allclose(float(metrics["loss"]), float(loss0), rtol=1e-5)
    for (p, a), n, g in zip(jax.tree_util.tree_leaves_with_path(adapters), jax.tree.leaves(new), jax.tree.leaves(g0)):
        scale = float(jnp.abs(g).max())
        np.testing.assert_allclose(
            np.asarray(a - n), np.asarray(g), rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(p)
        )


@pytest.mark.integration  # ~10 s each: compiles the accumulating step
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_accumulated_micro_batches_equal_one_big_batch(lm, sgd_step, micro_batches):
    adapters = _random_adapters(lm.adapters)
    batch = _batch(b=4)
    tx = optax.sgd(1.0)
    outs = []
    for step in (sgd_step, make_train_step(lm, tx, micro_batches=micro_batches, loss_chunk=8, donate=False)):
        outs.append(step(adapters, tx.init(adapters), lm.frozen, batch, jnp.int32(0)))
    (a1, _, m1), (am, _, mm) = outs
    np.testing.assert_allclose(float(mm["loss"]), float(m1["loss"]), rtol=1e-5)
    assert float(mm["tokens"]) == float(m1["tokens"])
    for x0, x1, xm in zip(jax.tree.leaves(adapters), jax.tree.leaves(a1), jax.tree.leaves(am)):
        g1, gm = np.asarray(x0 - x1), np.asarray(x0 - xm)
        np.testing.assert_allclose(gm, g1, rtol=1e-5, atol=1e-5 * float(np.abs(g1).max()))
    with pytest.raises(ValueError, match=r"batch \(4\) must be a multiple of micro_batches \(3\)"):
        make_train_step(lm, tx, micro_batches=3)(adapters, tx.init(adapters), lm.frozen, batch, jnp.int32(0))


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_compiles_once_over_steps_with_donated_state(lm):
    tx = rj.diloco(optax.adamw(1e-2), sync_every=2)
    adapters = jax.tree.map(jnp.copy, lm.adapters)
    state = tx.init(adapters)
    step = make_train_step(lm, tx, loss_chunk=8)
    losses = []
    for i in range(4):
        first = jax.tree.leaves(adapters)[0]
        adapters, state, metrics = step(adapters, state, lm.frozen, _batch(seed=i, masked=False), jnp.int32(i))
        assert first.is_deleted()  # donated: updated in place
        losses.append(float(metrics["loss"]))
    assert step._cache_size() == 1, step._cache_size()
    assert len(set(losses)) == 4 and all(np.isfinite(losses)), losses


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_bfloat16_compute_keeps_float32_masters_and_bfloat16_lora_matmuls():
    lm = split_lora(load_pretrained(LLAMA, dtype=jnp.bfloat16, lora=LoraConfig(rank=4)))
    assert {x.dtype for x in jax.tree.leaves(lm.adapters)} == {jnp.dtype(jnp.float32)}
    tx = optax.adamw(1e-3)
    step = make_train_step(lm, tx, donate=False)
    batch = _batch()
    adapters, state, metrics = step(lm.adapters, tx.init(lm.adapters), lm.frozen, batch, jnp.int32(0))
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    assert np.isfinite(float(metrics["loss"]))
    # every matmul with a weight (kernels, LoRA A and B, the head; forward and backward) runs
    # in bfloat16 (XLA's attention multiplies its float32 probabilities by bfloat16 values)
    jaxpr = step.trace(
        lm.adapters, tx.init(lm.adapters), lm.frozen, batch, jnp.int32(0)
    ).jaxpr  # top level: its compiler options
    dots = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general" and any(v.aval.ndim == 2 for v in eqn.invars):
                dots.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for sub in jax.extend.core.subjaxprs(jx):
            walk(sub)

    walk(jaxpr.jaxpr)
    assert dots and all(d == ("bfloat16", "bfloat16") for d in dots), sorted(set(dots))


@pytest.mark.integration  # two models, three compiles: ~25 s on 2 cores
def test_dropout_is_keyed_by_the_step():
    lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4, dropout=0.5)))
    adapters = _random_adapters(lm.adapters, 0.5)
    tx = optax.sgd(0.0)
    step = make_train_step(lm, tx, donate=False)
    batch = _batch()
    loss = {i: float(step(adapters, tx.init(adapters), lm.frozen, batch, jnp.int32(i))[2]["loss"]) for i in (0, 1)}
    again = float(step(adapters, tx.init(adapters), lm.frozen, batch, jnp.int32(0))[2]["loss"])
    assert loss[0] == again and loss[0] != loss[1], (loss, again)
    # the eval loss has no dropout: the model without the adapters' dropout
    ev = make_eval_loss(lm, loss_chunk=8)(adapters, lm.frozen, jax.tree.map(lambda x: x[None], batch))
    plain = make_eval_loss(split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=4))))(
        adapters, lm.frozen, jax.tree.map(lambda x: x[None], batch)
    )
    np.testing.assert_allclose(float(ev), float(plain), rtol=1e-6)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_eval_loss_is_token_weighted_over_batches(lm, sgd_step):
    adapters = _random_adapters(lm.adapters)
    batches = [_batch(seed=s) for s in (1, 2, 3)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *batches)
    ev = float(make_eval_loss(lm, loss_chunk=5)(adapters, lm.frozen, stacked))
    state = optax.sgd(1.0).init(adapters)
    ms = [sgd_step(adapters, state, lm.frozen, b, jnp.int32(0))[2] for b in batches]
    want = sum(float(m["loss"]) * float(m["tokens"]) for m in ms) / sum(float(m["tokens"]) for m in ms)
    np.testing.assert_allclose(ev, want, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(micro_batches=0), "micro_batches must be an int >= 1, got 0"),
        (dict(loss_chunk=0), "loss_chunk must be an int >= 1, got 0"),
        (dict(remat="some"), "remat='some': choose one of none, full, dots, offload"),
    ],
)
def test_bad_knobs_are_one_line_errors(lm, kwargs, needle):
    with pytest.raises(ValueError) as e:
        make_train_step(lm, optax.sgd(1.0), **kwargs)
    assert needle in str(e.value)


def test_stacked_adapters_and_their_optimizer_state_keep_the_layer_axis_whole():
    """A scanned model's adapters ``(layers, ...)`` and every tree shaped like them in an
    optimizer state are laid out as ``load_pretrained(..., mesh=)`` lays them out: the layer
    axis never split (``adapter_sharding(..., stacked=True)``), per-layer leaves as before."""
    from flax import nnx
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from ravnest_jax.models._step import adapter_layouts

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    adapters = nnx.State(
        {
            "layers": {"q_proj": {"kernel_lora_a": nnx.LoRAParam(jnp.zeros((4, 8, 4)))}},
            "unrolled": {"layers": {0: {"kernel_lora_a": nnx.LoRAParam(jnp.zeros((8, 4)))}}},
        }
    )
    state = jax.eval_shape(rj.diloco(optax.adamw(1e-2), sync_every=2).init, adapters)
    specs = [s.spec for s in jax.tree.leaves(adapter_layouts(mesh, state))]
    assert P(None, "data", None) in specs and P("data", None) in specs and P() in specs, specs
    stacked = adapter_layouts(mesh, adapters)["layers"]["q_proj"]["kernel_lora_a"].get_value()
    assert stacked.spec == P(None, "data", None), stacked  # not P("data"): the layer axis (4) divides too


@pytest.mark.integration  # loads on a 4-device mesh and compiles the FSDP step: ~20 s each
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_on_a_mesh_the_layouts_stay_and_nothing_compiles_twice(scan_layers, tmp_path):
    """Scanned, 4 layers: a stacked leaf's layer axis divides by the 4 devices, and stays
    whole. Unrolled, 2 layers (per-layer leaves: their number changes nothing of a layout)."""
    import dataclasses

    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ravnest_jax.models import TransformerConfig, save_pretrained

    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=4 if scan_layers else 2)
    ckpt = save_pretrained(rj.models.Transformer(cfg, nnx.Rngs(0)), tmp_path / "four")
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    lm = split_lora(load_pretrained(ckpt, lora=LoraConfig(rank=4), mesh=mesh, scan_layers=scan_layers))
    tx = rj.diloco(optax.adamw(1e-2), sync_every=2)
    adapters = lm.adapters
    state = init_opt_state(lm, tx)
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(state))
    layouts = jax.tree.map(lambda x: x.sharding, adapters)
    # the optimizer's moments lie like the adapters they follow (stacked: layer axis whole)
    assert jax.tree.map(lambda x: x.sharding, state.inner_state[0].mu) == layouts
    step = make_train_step(lm, tx, micro_batches=2, loss_chunk=8)
    split = NamedSharding(mesh, P("data"))
    for i in range(3):
        batch = jax.device_put(_batch(seed=i, b=8), split)
        adapters, state, metrics = step(adapters, state, lm.frozen, batch, jnp.int32(i))
        assert np.isfinite(float(metrics["loss"]))
    assert jax.tree.map(lambda x: x.sharding, adapters) == layouts
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(state))
    assert step._cache_size() == 1, step._cache_size()
