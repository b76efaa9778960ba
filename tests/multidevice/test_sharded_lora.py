"""``load_pretrained(..., mesh=...)``: the frozen base (float or qwix-quantised) and the adapters
laid out FSDP-style over the 4 forced CPU devices of the suite, streamed one tensor shard at a
time; the same model as on one device, each device holding a quarter of the bytes; and a LoRA
peer on that mesh trains and syncs its adapters through rj.OuterSync like a single-device peer
(a real rendezvous and peers on 127.0.0.1)."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sync._local import PATIENT, local_swarm

import ravnest_jax as rj
from ravnest_jax.sync import OuterSync

from ._model import state_on_mesh

pytest.importorskip("qwix")
from ravnest_jax.models import LoraConfig, load_pretrained, split_lora  # noqa: E402

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"
LORA = LoraConfig(rank=4)

pytestmark = pytest.mark.integration  # loads and compiles the model on 4 devices: ~20 s a test


def _mesh(n: int = 4):
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def _nbytes(x) -> int:
    return x.size * jax.dtypes.itemsize_bits(x.dtype) // 8


@pytest.mark.parametrize("devices, quantize", [(4, "int4"), (3, None)])
def test_sharded_load_equals_the_one_device_load_and_splits_the_bytes(quantize, devices):
    """Every leaf equal bit for bit to the single-device load; a leaf is split over all
    devices along an axis that divides by their number (each device holds 1/N of its bytes) or,
    when no axis divides, replicated; with 4 devices (every width of the fixture divides) each
    device holds exactly a quarter of the model; logits equal the single-device model's."""
    mesh = _mesh(devices)
    one = split_lora(load_pretrained(LLAMA, lora=LORA, quantize=quantize))
    lm = split_lora(load_pretrained(LLAMA, lora=LORA, quantize=quantize, mesh=mesh))
    per_device = dict.fromkeys(mesh.devices.flat, 0)
    total = expected = 0
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path((lm.frozen, lm.adapters)), jax.tree.leaves((one.frozen, one.adapters))
    ):
        name = jax.tree_util.keystr(path)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=name)
        assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh, (name, x.sharding)
        shards = x.addressable_shards
        assert {s.device for s in shards} == set(mesh.devices.flat), name
        if x.sharding.spec == P():
            # a scanned model's stacked leaf (layers, ...): the layer axis is never split
            dims = x.shape[1:] if "['layers']['" in name else x.shape
            assert all(d % devices for d in dims), f"{name} {x.shape} replicated though an axis divides"
            expected += _nbytes(x)
        else:
            assert all(_nbytes(s.data) * devices == _nbytes(x) for s in shards), (name, x.sharding)
            expected += _nbytes(x) // devices
        for s in shards:
            per_device[s.device] += _nbytes(s.data)
        total += _nbytes(x)
    assert set(per_device.values()) == {expected} and expected < total, (per_device, expected, total)
    if devices == 4:
        assert expected * 4 == total, (expected, total)
    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))
    got = jax.jit(lambda a, f, t: lm.model(a, f)(t))(lm.adapters, lm.frozen, tokens)
    want = jax.jit(lambda a, f, t: one.model(a, f)(t))(one.adapters, one.frozen, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


def test_a_mesh_with_explicit_axes_or_not_a_mesh_is_one_line():
    explicit = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="automatic axes"):
        load_pretrained(LLAMA, mesh=explicit)
    with pytest.raises(ValueError, match="jax.sharding.Mesh"):
        load_pretrained(LLAMA, mesh="data")


H, STEPS, BATCH, SEQ = 2, 5, 4, 16  # rounds start at steps 2 and 4


def _batch(peer: int, step: int) -> np.ndarray:
    return np.random.default_rng([peer, step]).integers(0, 96, (BATCH, SEQ + 1), dtype=np.int32)


def _run_lora_peer(swarm, data_peer: int, mesh=None, *, overlap: int = 0, inner=None, ready=None) -> dict:
    """A QLoRA peer (int4 base, rank-4 adapters) as the docs write it: ``H`` steps, then an
    adapters-only round through OuterSync; on ``mesh`` the base and adapters FSDP-style and the
    batch split over the devices."""
    lm = split_lora(load_pretrained(LLAMA, lora=LORA, quantize="int4", mesh=mesh))
    tx = rj.diloco(inner or optax.adam(1e-2), sync_every=H)
    adapters, state = lm.adapters, tx.init(lm.adapters)
    put = lambda t: t  # noqa: E731
    layouts = None
    if mesh is not None:
        state = state_on_mesh(state, mesh)
        data = NamedSharding(mesh, P("data"))
        put = lambda t: jax.device_put(t, data)  # noqa: E731
        shardings = jax.tree.map(lambda x: x.sharding, (adapters, state))
        layouts = (*shardings, None)

    def step(adapters, state, frozen, tokens):
        def loss_fn(a):
            logits = lm.model(a, frozen)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(adapters)
        updates, state = tx.update(grads, state, adapters)
        return optax.apply_updates(adapters, updates), state, loss

    train_step = jax.jit(step, out_shardings=layouts)
    jax.block_until_ready(train_step(adapters, state, lm.frozen, put(_batch(data_peer, 0))))  # compile first
    with OuterSync(tx, swarm, overlap_steps=overlap) as sync:
        sync.warmup(adapters, state)
        if ready is not None:  # every peer compiled: their rounds meet in one group
            ready.wait(timeout=240)
        for t in range(STEPS):
            adapters, state, _ = train_step(adapters, state, lm.frozen, put(_batch(data_peer, t)))
            adapters, state = sync(adapters, state)
        adapters, state = sync.flush(adapters, state)
        metrics = [m for m in sync.metrics if m.ok]
        compiles = [train_step._cache_size()] + [fn._cache_size() for fn in sync._fns.cache.values()]
    return {
        "adapters": adapters,
        "state": state,
        "metrics": metrics,
        "compiles": compiles,
        "shardings": jax.tree.map(lambda x: x.sharding, lm.adapters),
        "initial": jax.device_get(lm.adapters),
        "encoded": len(rj.compress.encode([np.asarray(x) for x in jax.tree.leaves(lm.adapters)], "fp32")),
    }


@pytest.mark.slow  # a swarm of two LoRA peers: ~70 s on 2 cores; the suite's budget is spent
@pytest.mark.timeout(400)
def test_a_sharded_qlora_peer_trains_and_syncs_like_a_one_device_peer():
    """A swarm of two QLoRA peers on the same batches, delayed tau = 1: one with its int4 base
    and adapters FSDP-style over 4 devices (batch split), one on one device. Every round's
    global adapters agree bit for bit (state digest); each round carries the adapters' encoded
    message, nothing of the base; the adapters, anchor and moments keep their
    layouts and everything compiles once; the two peers' local adapters stay equal up to
    float32 summation order (rtol 2e-4, atol 1e-5: XLA adds the partial sums of split matmuls
    in another order, docs/multi-device.md).

    SGD with momentum as the inner optimizer: Adam divides by the root of the second moment,
    which turns the rounding-level gradients of ``A`` while ``B`` is still near zero into steps
    of up to the learning rate in either direction (measured: one element of 448 off by 2e-4
    after 5 Adam steps), though the global state agrees bit for bit with Adam too. The fp32
    codec: with int4 and error feedback a pseudo-gradient element that differs by rounding may
    fall into the neighbouring bucket, and the peers' residuals (so their local adapters, not
    the global ones) then differ by more than rounding (measured: 3 of 256 elements by 2e-5)."""
    inner = optax.sgd(0.5, momentum=0.9)
    ready = threading.Barrier(2)
    with local_swarm(2, codec="fp32", run_id="lora-mixed", timeouts=PATIENT) as peers:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            kw = dict(overlap=1, inner=inner, ready=ready)
            f0 = pool.submit(_run_lora_peer, peers[0], 0, _mesh(), **kw)
            f1 = pool.submit(_run_lora_peer, peers[1], 0, **kw)
            got, ref = f0.result(timeout=350), f1.result(timeout=350)
    d0 = [m.state_digest for m in got["metrics"]]
    d1 = [m.state_digest for m in ref["metrics"]]
    assert len(d0) == STEPS // H and d0 == d1, (d0, d1)
    assert all(m.group_size == 2 for m in got["metrics"] + ref["metrics"])
    assert got["compiles"] == ref["compiles"] == [1, 1, 1], (got["compiles"], ref["compiles"])
    payload = {m.payload_bytes for m in got["metrics"] + ref["metrics"]}
    assert payload == {ref["encoded"]}, (payload, ref["encoded"])
    for tree in (got["adapters"], got["state"].global_params, got["state"].inner_state[0].trace):
        assert jax.tree.map(lambda x: x.sharding, tree) == got["shardings"]
    a, b = (
        jax.device_get((got["state"].global_params, got["adapters"])),
        jax.device_get((ref["state"].global_params, ref["adapters"])),
    )
    for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0])):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-5)  # values up to ~0.3
    moved = max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(ref["initial"])))
    assert moved > 1e-3, moved  # the rounds moved the global adapters
