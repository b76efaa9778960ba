"""The memory planner against live bytes on CPU: parameters and optimizer state of the real
objects, and the temporary bytes XLA allocates for the real full-depth training step; and
the ``ravnest-jax plan-memory`` command; the scanned plan equal to the real scanned step."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

pytest.importorskip("qwix")
from flax import nnx  # noqa: E402

import ravnest_jax as rj  # noqa: E402
from ravnest_jax.models import (  # noqa: E402
    LoraConfig,
    TokenBatch,
    TransformerConfig,
    apply_lora,
    make_train_step,
    split_lora,
)
from ravnest_jax.models._plan import _static_bytes, by_layers, load_config, plan_memory  # noqa: E402
from ravnest_jax.models._scan import stack_layers  # noqa: E402

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"


def _bytes(tree) -> int:
    return sum(x.size * jax.dtypes.itemsize_bits(x.dtype) // 8 for x in jax.tree.leaves(tree))


def _live(cfg, lora, quantize, remat, batch, seq, scan_layers):
    """The real model (``scan_layers``: stacked as ``load_pretrained`` stacks it), its
    adapters and optimizer state, and the library's step compiled for them: bytes by part."""
    model = apply_lora(rj.models.Transformer(cfg, nnx.Rngs(0)), lora, quantize=quantize)
    if scan_layers:
        model = stack_layers(model)
    lm = split_lora(model)
    tx = rj.diloco(optax.adamw(1e-4), sync_every=100)
    state = tx.init(lm.adapters)
    step = make_train_step(lm, tx, remat=remat)
    tokens = TokenBatch.from_windows(jnp.zeros((batch, seq + 1), jnp.int32))
    compiled = step.lower(lm.adapters, state, lm.frozen, tokens, jnp.int32(0)).compile()
    return lm, {
        "base": _bytes(lm.frozen),
        "adapters": _bytes(lm.adapters),
        "optimizer": _bytes(state.inner_state),
        "outer": _bytes(state.global_params) + _bytes(state.outer_state),
        "activations": compiled.memory_analysis().temp_size_in_bytes,
    }


@pytest.mark.integration  # ~10 s each: compiles the real scanned step
@pytest.mark.parametrize("quantize", [None, "int4"])
def test_scanned_plan_equals_the_real_scanned_step(quantize):
    """The planner's scanned model (one layer wrapped by qwix, its stacked leaves given the
    real depth) compiles to the same step as the real model stacked as ``load_pretrained``
    stacks it: every byte figure equal (3 layers of the tiny Llama, 2 x 64 tokens)."""
    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=3)
    lora = LoraConfig(rank=4)
    plan = plan_memory(cfg, lora=lora, quantize=quantize, batch=2, seq_len=64, dtype="float32", remat=True)
    lm, live = _live(cfg, lora, quantize, True, 2, 64, scan_layers=True)
    assert {k: getattr(plan, k) for k in live} == live
    assert plan.adapter_params == lm.num_adapter_params


@pytest.mark.integration
@pytest.mark.parametrize("quantize", [None, "int4"])
@pytest.mark.parametrize("remat", [False, True], ids=["no-remat", "remat"])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_planner_within_5_percent_of_live_bytes(quantize, remat, scan_layers):
    """The planner (scanned: the whole depth compiled; unrolled: 3 and 4 layers compiled,
    extrapolated) against the real 6-layer model's objects and the library's step
    (``make_train_step``) compiled for them, at 256 tokens where activations are most of the
    bytes."""
    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=6)
    lora = LoraConfig(rank=4)
    batch, seq = 2, 256
    plan = plan_memory(
        cfg,
        lora=lora,
        quantize=quantize,
        batch=batch,
        seq_len=seq,
        dtype="float32",
        remat=remat,
        scan_layers=scan_layers,
    )
    lm, live = _live(cfg, lora, quantize, remat, batch, seq, scan_layers)
    planned = {k: getattr(plan, k) for k in live}
    for k in ("base", "adapters", "optimizer", "outer"):
        assert planned[k] == live[k], (k, planned, live)
    assert plan.base_params == cfg.num_params(), (plan.base_params, cfg.num_params())
    assert plan.adapter_params == lm.num_adapter_params, (plan.adapter_params, lm.num_adapter_params)
    act = abs(planned["activations"] - live["activations"]) / live["activations"]
    total = abs(plan.total - sum(live.values())) / sum(live.values())
    assert act < 0.05 and total < 0.05, f"planned {planned} vs live {live}: activations {act:.1%}, total {total:.1%}"


@pytest.mark.integration  # traces the qwix model at 1, 2 and 6 layers of Llama 3.2 1B's width: ~10 s
@pytest.mark.parametrize("quantize", [None, "int4"])
def test_parameter_bytes_from_two_layers_equal_the_whole_model(quantize):
    """Every layer is the same: the planner's parameter and optimizer figures, extrapolated
    from 1 and 2 layers, equal ``eval_shape`` of the whole model (here 6 layers of Llama 3.2
    1B), byte for byte."""
    cfg = dataclasses.replace(load_config("llama-3.2-1b"), num_hidden_layers=6)
    lora = LoraConfig(rank=16)
    whole = _static_bytes(cfg, lora, quantize, jnp.bfloat16)
    assert by_layers(lambda c: _static_bytes(c, lora, quantize, jnp.bfloat16), cfg) == whole
    assert whole["base_params"] == cfg.num_params(), (whole, cfg.num_params())


@pytest.mark.integration  # starts the command: a process that compiles
def test_plan_memory_command_prints_a_table_and_json(tmp_path, fast_compile_env):
    plans = {}
    for flags in ([], ["--remat", "none", "--loss-chunk", "64", "--micro-batches", "2"]):
        out = tmp_path / f"plan{len(flags)}.json"
        args = ["--config", str(LLAMA), "--lora-rank", "4", "--quantize", "int4", "--batch", "2", "--seq-len", "128"]
        p = subprocess.run(
            [sys.executable, "-m", "ravnest_jax.cli", "plan-memory", *args, *flags, "--json", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
            env=fast_compile_env,
        )
        assert p.returncode == 0, p.stderr
        assert "adapters" in p.stdout and "pool JAX's allocator takes of 24 GiB" in p.stdout, p.stdout
        d = json.loads(out.read_text())
        assert d["total"] == sum(d[k] for k in ("base", "adapters", "optimizer", "outer", "activations")) > 0
        plans[d["remat"]] = d
    assert plans["full"]["base"] == plans["none"]["base"], plans
    assert plans["full"]["activations"] < plans["none"]["activations"], plans
    assert (plans["none"]["loss_chunk"], plans["none"]["micro_batches"]) == (64, 2), plans


@pytest.mark.integration  # CLI processes: keeps the unit tier under 3 minutes
def test_plan_memory_command_rejects_bad_input_in_one_line(tmp_path, fast_compile_env):
    p = subprocess.run(
        [sys.executable, "-m", "ravnest_jax.cli", "plan-memory", "--config", str(tmp_path / "nope.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env=fast_compile_env,
    )
    assert p.returncode == 2 and p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_planner_per_device_on_a_4_device_mesh_within_10_percent(tmp_path):
    """``plan_memory(devices=4)`` against a real 4-device peer: the 4-layer model saved and
    loaded with ``load_pretrained(..., mesh=)`` (int4 base, remat), the bytes on one device of
    its frozen base, adapters and optimizer state, and XLA's plan for its compiled step with
    the batch split over the devices."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ravnest_jax.models import load_pretrained, save_pretrained

    cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_hidden_layers=4)
    lora = LoraConfig(rank=4)
    batch, seq, n = 4, 256, 4
    plan = plan_memory(cfg, lora=lora, quantize="int4", batch=batch, seq_len=seq, dtype="float32", devices=n)
    assert plan.devices == n

    ckpt = save_pretrained(rj.models.Transformer(cfg, nnx.Rngs(0)), tmp_path / "four")
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    lm = split_lora(load_pretrained(ckpt, lora=lora, quantize="int4", remat=True, mesh=mesh))
    tx = rj.diloco(optax.adamw(1e-4), sync_every=100)
    state = tx.init(lm.adapters)
    state = rj.models.init_opt_state(lm, tx)
    device = mesh.devices.flat[0]

    def on_device(tree) -> int:
        return sum(_bytes(s.data) for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)

    step = make_train_step(lm, tx)
    tokens = jax.device_put(
        TokenBatch.from_windows(jnp.zeros((batch, seq + 1), jnp.int32)), NamedSharding(mesh, P("data"))
    )
    compiled = step.lower(lm.adapters, state, lm.frozen, tokens, jnp.int32(0)).compile()
    live = {
        "base": on_device(lm.frozen),
        "adapters": on_device(lm.adapters),
        "optimizer": on_device(state.inner_state),
        "outer": on_device(state.global_params) + on_device(state.outer_state),
        "activations": compiled.memory_analysis().temp_size_in_bytes,
    }
    planned = {k: getattr(plan, k) for k in live}
    for k in ("base", "adapters", "optimizer"):
        assert planned[k] == live[k], (k, planned, live)
    # the outer state's step counters are replicated scalars on the mesh: a few bytes apart
    assert abs(planned["outer"] - live["outer"]) <= 16, (planned, live)
    assert 4 * live["base"] == _bytes(lm.frozen), (live, _bytes(lm.frozen))  # every width divides by 4
    act = abs(planned["activations"] - live["activations"]) / live["activations"]
    assert act < 0.10, f"planned {planned} vs live {live}: activations {act:.1%}"
