"""benchmarks/bench_lora_gpu.py: its formulas (model FLOPs, adapter count, device peaks), the
step-0 loss check, and ``--dry-run`` end to end (every case, every field)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_lora_gpu as bench  # noqa: E402

# fields an ok case must carry as finite positive numbers (trace_s/compile_s: ours only; mfu: known GPUs)
REQUIRED = ("load_s", "step_s", "tokens_per_s", "peak_bytes", "flops", "model_flops", "loss0")


def _dry_run_env() -> dict[str, str]:
    """The environment of a ``--dry-run``: no shared compilation cache (the script measures its
    compile times), and XLA's CPU compiles cheap (its children inherit it): its tiny programs run
    in microseconds, optimising them was most of the dry run's minute (tests/models/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    return env


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("NVIDIA GeForce RTX 3090", 71e12),
        ("cpu", None),
        (None, None),
    ],
)
def test_peak_by_device_name(name, peak):
    assert bench.peak_bf16_flops(name) == peak


def test_lora_params_match_the_library():
    """The formula's adapter count is what load_pretrained(lora=...) makes for the same shape."""
    import jax.numpy as jnp
    from flax import nnx

    from ravnest_jax.models import LoraConfig, Transformer, TransformerConfig, apply_lora, split_lora

    cfg = TransformerConfig.from_hf(bench.hf_config("tiny-8b"))
    lora = LoraConfig(rank=bench.RANK, alpha=bench.ALPHA)
    model = nnx.eval_shape(lambda: apply_lora(Transformer(cfg, nnx.Rngs(0), dtype=jnp.float32), lora))  # shapes only
    assert split_lora(model).num_adapter_params == bench.lora_params(bench.SHAPES["tiny-8b"])


@pytest.mark.parametrize("shape, billions", [("llama-3.2-1b", 1.24), ("llama-3.1-8b", 8.03)])
def test_model_flops_near_four_n_t(shape, billions):
    """A LoRA step costs about 4 N T (no weight gradients of the frozen base): the formula gives
    that within the adapters' and attention's share, for the real models' parameter counts."""
    cfg = bench.SHAPES[shape]
    tokens = 4 * 2048
    flops = bench.model_flops(cfg, batch=4, seq=2048)
    # N here counts the head's matmul even when tied, not the embedding lookup
    n = billions * 1e9 - (0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * cfg["hidden_size"])
    assert 1.0 < flops / (4 * n * tokens) < 1.25
    # attention grows with the square of the sequence, the rest linearly
    assert bench.model_flops(cfg, 4, 4096) > 2 * flops


def test_loss0_check_compares_bf16_cases_per_model():
    rows = [
        {"case": "a", "model": "m", "status": "ok", "loss0": 11.70, "quantize": None},
        {"case": "b", "model": "m", "status": "ok", "loss0": 11.72, "quantize": None},
        {"case": "c", "model": "m", "status": "ok", "loss0": 13.0, "quantize": "int4"},  # other weights
        {"case": "d", "model": "m", "status": "timeout", "loss0": None, "quantize": None},
        {"case": "e", "model": "n", "status": "ok", "loss0": 11.0, "quantize": None},  # alone: no pair
    ]
    out = bench.loss0_check(rows)
    assert set(out) == {"m"}
    assert set(out["m"]["loss0"]) == {"a", "b"}
    assert out["m"]["max_abs_diff"] == pytest.approx(0.02)


def test_cases_cover_the_issue():
    names = {c["case"]: c for c in bench.cases(bench.GPU)}
    assert set(names) == {
        "ours-1b-bf16-lora",
        "ours-1b-int4-qlora",
        "ours-1b-nf4-qlora",
        "ours-8b-qlora-22gib",
        "theirs-1b-bf16-lora",
        "theirs-1b-nf4-qlora",
    }
    assert names["ours-8b-qlora-22gib"]["cap_bytes"] == 22 * 2**30
    assert all((c["seq"], c["batch"]) == (2048, 4) for c in names.values())


@pytest.mark.integration
def test_dry_run_writes_every_field(tmp_path):
    """``--dry-run`` on CPU: every case in its own process, the JSON complete, ok cases with
    finite positive numbers; the reference side ok where torch+transformers+peft import."""
    env = _dry_run_env()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_lora_gpu.py"), "--dry-run", "--out", str(tmp_path)]
    cmd += ["--ckpt-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "lora_gpu.json").read_text())
    assert doc["dry_run"] and doc["command"] and doc["machine"]["backend"] == "cpu"
    got = {r["case"]: r for r in doc["cases"]}
    assert set(got) == {c["case"] for c in bench.cases(bench.DRY)}
    for r in doc["cases"]:
        assert set(bench.FIELDS) <= set(r), r["case"]
        # a busy machine may run the last cases past the deadline: never an error
        assert r["status"] in ("ok", "timeout") or r["status"].startswith("skipped: "), (r["case"], r.get("log_tail"))
        if r["status"] != "ok":
            continue
        for k in REQUIRED + (("trace_s", "compile_s") if r["side"] == "ours" else ("compile_s",)):
            assert isinstance(r[k], int | float) and math.isfinite(r[k]) and r[k] > 0, (r["case"], k, r[k])
        assert r["mfu"] is None  # a CPU has no bf16 peak in the table
        assert r["flops_source"] in ("xla_cost_analysis", "formula")
    for name in ("ours-1b-bf16-lora", "ours-1b-int4-qlora", "ours-8b-qlora-22gib"):
        assert got[name]["status"] == "ok", got[name]
    # random init: the step-0 loss is about ln(vocab) on random tokens
    assert abs(got["ours-1b-bf16-lora"]["loss0"] - math.log(256)) < 0.2
    if got["theirs-1b-bf16-lora"]["status"] == "ok":  # same weights, same tokens: the same loss
        assert doc["loss0_check"]["tiny-1b"]["max_abs_diff"] < 0.02
    assert (tmp_path / "lora_gpu.png").stat().st_size > 0
    assert "ours-1b-bf16-lora" in (tmp_path / "lora_gpu.md").read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_dry_run_overlap(tmp_path):
    """``--dry-run --overlap`` (about 2.5 minutes here, hence slow): two peers through the
    throttling proxy, blocking and auto, every round merged, the summary's numbers present."""
    env = _dry_run_env()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_lora_gpu.py"), "--dry-run", "--overlap"]
    cmd += ["--out", str(tmp_path), "--ckpt-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=290, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "lora_overlap.json").read_text())
    assert doc["status"] == "ok" and len(doc["peers"]) == 2
    for p in doc["peers"]:
        assert set(p["modes"]) == {"blocking", "auto"}
        for name, m in p["modes"].items():
            assert m["rounds"] >= doc["config"]["rounds"] and m["failed_rounds"] == 0, (p["peer"], name)
            assert 0 < m["compute_utilisation"] <= 1 and m["stall_seconds"] >= 0
        assert p["modes"]["blocking"]["mean_overlap_steps"] == 0


def test_a_failing_child_is_one_error_line():
    """A child that raises comes back as ``error: <the exception's line>``, not a traceback."""
    status, result, tail = bench.run_child("no-such-kind", {}, 60, bench.child_env(dry_run=True))
    assert result is None
    assert status.startswith("error: ") and "KeyError" in status and "\n" not in status
    assert "Traceback" in tail
