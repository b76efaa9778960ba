"""A QLoRA run's merged export, both ways (``LoraModel.merged``; docs/finetuning.md, Export): into
the dequantised base the adapters trained against (the merged model computes what the adapted
quantised model computes, to float rounding), or into the checkpoint's original float weights
(``base=``: each kernel the float kernel plus the adapters' delta, as PEFT's ``merge_and_unload``
on the float model; off from the trained model by the quantisation error). On the tiny checkpoint
(tests/fixtures/llm/finetune) with int4 and nf4 bases, adapters trained 20 steps on the committed
chat data, logits compared on held-out conversations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("qwix")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import ravnest_jax as rj  # noqa: E402
from ravnest_jax.data import PackedExamples, load_examples, split_examples  # noqa: E402
from ravnest_jax.models import LoraConfig, TokenBatch, load_pretrained, split_lora  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "tests" / "fixtures" / "llm" / "finetune"
CHAT = ROOT / "examples" / "recipes" / "data" / "tiny_chat.jsonl"
STEPS = 20

pytestmark = pytest.mark.integration  # trains 20 steps per base and compiles four models: seconds


@pytest.fixture(scope="module")
def held_out():
    """``(train rows, eval batch)``: the chat data packed 4 x 64 for training; 16 held-out
    conversations one a row (TokenBatch fields)."""
    train, held = split_examples(load_examples([CHAT], CKPT, format="messages"), 0.1, seed=0)
    rows = PackedExamples(train, seq_len=64, batch=4, seed=0)
    return rows, PackedExamples(held, seq_len=64, batch=16, packing=False, seed=0).batch_at(0)


@pytest.fixture(scope="module", params=["int4", "nf4"])
def trained(request, held_out):
    """``(lm, adapters, logits)``: the tiny checkpoint per layer with a ``request.param`` base and
    rank-4 adapters on every projection, trained ``STEPS`` AdamW steps at lr 3e-3 (float32), and
    that adapted quantised model's logits on the held-out batch."""
    rows, ev = held_out
    lm = split_lora(
        load_pretrained(
            CKPT, dtype=jnp.float32, quantize=request.param, lora=LoraConfig(rank=4, alpha=8.0), scan_layers=False
        )
    )
    tx = optax.adamw(3e-3, weight_decay=0.0)
    step = rj.models.make_train_step(lm, tx, donate=False)
    adapters, state = lm.adapters, tx.init(lm.adapters)
    for i in range(STEPS):
        adapters, state, _ = step(adapters, state, lm.frozen, TokenBatch(**rows.batch_at(i)), np.int32(i))
    return lm, adapters, np.asarray(lm.model(adapters, lm.frozen)(jnp.asarray(ev["tokens"])))


def _max_diff(a, b, ev) -> float:
    real = ev["segment_ids"] > 0  # the conversations' tokens, not the padding after them
    return float(np.abs(np.asarray(a) - np.asarray(b))[real].max())


def _flat(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_dequantized_merge_computes_the_trained_model(trained, held_out):
    lm, adapters, want = trained
    ev = held_out[1]
    merged = lm.merged(adapters)
    assert not any("lora" in k or "array" in k for k in _flat(merged)), "a plain float model"
    got = merged(jnp.asarray(ev["tokens"]))
    # float32 rounding of x (W + s A B) against x W + s (x A) B: measured 4.9e-6 (int4), 8.2e-6 (nf4)
    assert _max_diff(got, want, ev) < 1e-4


def test_original_merge_is_the_float_weights_plus_the_adapter_delta(trained, held_out):
    lm, adapters, want = trained
    ev = held_out[1]
    original = _flat(load_pretrained(CKPT, dtype=jnp.float32, scan_layers=False))
    merged = lm.merged(adapters, base=load_pretrained(CKPT, dtype=jnp.float32, scan_layers=False))
    got = _flat(merged)
    assert got.keys() == original.keys()
    trained_ab = {**_flat_state(lm.frozen), **_flat_state(adapters)}
    folded = 0
    for k, w in original.items():
        a, b = trained_ab.get(k + "_lora_a"), trained_ab.get(k + "_lora_b")
        if a is None:
            np.testing.assert_array_equal(got[k], w, err_msg=k)  # embeddings, norms, head: as they were
            continue
        np.testing.assert_allclose(got[k], w + lm.lora.scale * (a @ b), rtol=0, atol=1e-6, err_msg=k)
        folded += 1
    assert folded == 2 * 7  # 2 layers x q, k, v, o, gate, up, down
    # off from the trained model by the quantisation error: the merge 0.94 (int4) and 1.15 (nf4),
    # the quantised base's own against the float model's logits 0.89 and 0.77 (logits up to 8.8)
    tokens = jnp.asarray(ev["tokens"])
    quantised_base = lm.model(lm.adapters, lm.frozen)(tokens)  # the initial adapters: every B zero
    base_error = _max_diff(load_pretrained(CKPT, dtype=jnp.float32)(tokens), quantised_base, ev)
    off = _max_diff(merged(tokens), want, ev)
    assert 0.5 * base_error < off < 5 * base_error, (off, base_error)


def test_train_py_merges_as_told(trained):
    """examples/finetune/train.py's ``--merge-into``: ``dequantized`` is ``lm.merged(adapters)``,
    ``original`` (the default) folds into the float weights read again from ``--checkpoint``."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    from finetune.train import merged_model, parse_args

    lm, adapters, _ = trained
    argv = ["--checkpoint", str(CKPT), "--quantize", "int4"]
    assert parse_args(argv).merge_into == "original"
    deq = _flat(merged_model(parse_args([*argv, "--merge-into", "dequantized"]), lm, adapters, jnp.float32))
    for k, v in _flat(lm.merged(adapters)).items():
        np.testing.assert_array_equal(deq[k], v, err_msg=k)
    orig = _flat(merged_model(parse_args(argv), lm, adapters, jnp.float32))
    base = load_pretrained(CKPT, dtype=jnp.float32, scan_layers=False)
    for k, v in _flat(lm.merged(adapters, base=base)).items():
        np.testing.assert_array_equal(orig[k], v, err_msg=k)


def _flat_state(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
