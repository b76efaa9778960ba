"""Received activations decoded on the device, inside the stage's jitted step: the same losses,
gradients and params bit for bit as decoding them on the host first, with less on the host."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import BATCH, SEQ, batches, build, flat, optimizer  # noqa: E402

import ravnest_jax as rj  # noqa: E402
from ravnest_jax.compress import encode  # noqa: E402
from ravnest_jax.swarm.peer._activations import encoded_activation  # noqa: E402


@pytest.mark.integration  # six 3-stage pipelines compile: a minute on 2 busy cores
@pytest.mark.parametrize(("codec", "mode"), [("int8", "sync"), ("bf16", "predict"), ("fp32", "sync")])
def test_decoding_on_the_device_changes_no_bit(codec, mode):
    """Three stages of the char-LM, two steps of four micro-batches: losses, every stage's
    params and last gradients equal to the host-decoding run, bit for bit."""
    split, _, _, vocab = build("char", layers=3)
    plan = rj.pipeline.plan_stages(split, 3)
    runs = {
        dev: rj.pipeline.simulate(
            split,
            plan,
            optimizer(0.05),
            batches(vocab),
            steps=2,
            micro_batches=4,
            mode=mode,
            codec=codec,
            keep_grads=True,
            decode_on_device=dev,
        )
        for dev in (False, True)
    }
    assert runs[True].losses == runs[False].losses, (runs[True].losses, runs[False].losses)
    assert runs[True].bytes_sent == runs[False].bytes_sent
    for a, b in zip(runs[True].workers, runs[False].workers):
        for k, v in flat(b.params).items():
            np.testing.assert_array_equal(flat(a.params)[k], v, err_msg=k)
        for k, v in flat(b.last_grads).items():
            np.testing.assert_array_equal(flat(a.last_grads)[k], v, err_msg=k)


@pytest.mark.integration  # 4 s of compiling (the stage's init) on 2 cores: the full suite, not the unit tier
def test_a_stage_takes_the_wire_parts_and_refuses_another_codec():
    split, _, _, vocab = build("char", layers=2)
    rows = BATCH // 2
    hidden = split.hidden(rows, SEQ)
    w = rj.pipeline.StageWorker(
        split.stage(2, split.num_units), optimizer(), num_stages=2, micro_batches=2, hidden=hidden, codec="int8"
    )
    x = np.random.default_rng(0).standard_normal(hidden.shape).astype(np.float32)
    enc = encoded_activation(
        encode({"x": x}, codec="int8", **w.codec_options), name="x", shape=hidden.shape, codec="int8"
    )
    parts = w.wire_parts(enc)
    assert [p.dtype for p in parts] == [np.uint16, np.uint8]  # bf16 scale bits, int8 codes
    assert sum(p.nbytes for p in parts) == enc.nbytes < x.nbytes / 3.5  # what went to the device
    bad = enc._replace(codec="bf16")
    with pytest.raises(ValueError, match=r"activation in bf16 .* this stage expects int8"):
        w.wire_parts(bad)
    with pytest.raises(ValueError, match=r"block 7"):
        w.wire_parts(enc._replace(block_size=7))
