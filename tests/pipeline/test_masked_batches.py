"""Loss-masked batches through pipeline stages (``rj.data.PackedExamples(packing=False)``: one
document a row, the loss on its completion tokens): the stages compute the unsplit model's
masked step, the step's token mean over micro-batches of unequal token counts; packed rows
(several documents a row) are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import BATCH, LLAMA, SEQ, build, flat, optimizer  # noqa: E402

import ravnest_jax as rj  # noqa: E402
from ravnest_jax.data import Example, PackedExamples  # noqa: E402


def _examples(vocab: int, n: int = 24, seed: int = 0) -> list[Example]:
    """Documents of 4..SEQ + 1 tokens, the loss on their second half (a prompt and a completion)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = int(rng.integers(4, SEQ + 2))
        mask = np.zeros(size, bool)
        mask[size // 2 :] = True
        out.append(Example(rng.integers(0, vocab, size).astype(np.int32), mask, where=f"doc:{i}"))
    return out


@pytest.mark.integration  # compiles two stages and the unsplit model: seconds
def test_masked_batches_give_the_unsplit_models_masked_step():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    split, params, _, vocab = build("llama")
    data = PackedExamples(_examples(vocab), seq_len=SEQ, batch=BATCH, packing=False, seed=0)
    batch = data.batch_at(0)
    assert (batch["loss_mask"].reshape(4, -1).sum(1) != batch["loss_mask"].sum() / 4).any(), "equal counts"

    graphdef = nnx.split(rj.models.load_pretrained(LLAMA, scan_layers=False), nnx.Param)[0]  # the unsplit graph

    def masked_mean(p):
        logits = nnx.merge(graphdef, p)(jnp.asarray(batch["tokens"]))
        ce = rj.pipeline.token_cross_entropy(logits, (jnp.asarray(batch["targets"]), jnp.asarray(batch["loss_mask"])))
        return ce / batch["loss_mask"].sum()

    want_loss, want_grads = jax.value_and_grad(masked_mean)(params)
    plan = rj.pipeline.plan_stages(split, 2)
    res = rj.pipeline.simulate(
        split, plan, optimizer(0.05), lambda step: data.batch_at(step), steps=1, micro_batches=4, keep_grads=True
    )
    np.testing.assert_allclose(res.losses[0], float(want_loss), rtol=1e-5)
    want = flat(want_grads)
    got = {k: v for w in res.workers for k, v in flat(w.last_grads).items()}
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_packed_rows_are_refused_with_one_line():
    from ravnest_jax.pipeline._drive import read_batch

    packed = PackedExamples(_examples(96), seq_len=SEQ, batch=BATCH, packing=True, seed=0).batch_at(0)
    assert packed["segment_ids"].max() > 1
    with pytest.raises(ValueError, match=r"^batches\(0\): rows hold several documents .* packing=False\)\)$"):
        read_batch(packed, "batches(0)")
    one = PackedExamples(_examples(96), seq_len=SEQ, batch=BATCH, packing=False, seed=0).batch_at(0)
    inputs, targets, mask = read_batch(one)
    assert inputs.shape == targets.shape == mask.shape == (BATCH, SEQ) and mask.dtype == np.float32
    with pytest.raises(ValueError, match="needs tokens, targets and loss_mask; loss_mask missing"):
        read_batch({k: v for k, v in one.items() if k != "loss_mask"})
    shifted = {**one, "positions": one["positions"] + 1}
    with pytest.raises(ValueError, match="does not start at its row's first column"):
        read_batch(shifted)
