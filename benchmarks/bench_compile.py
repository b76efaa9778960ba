#!/usr/bin/env python3
"""Trace and compile time of a jitted LoRA training step by depth, scanned and unrolled layers,
and XLA's temp bytes of the step per gradient checkpointing policy (not run in CI: minutes).

The step: ``jax.value_and_grad`` of the mean token cross-entropy over the adapters of a
``Transformer`` (LoRA rank 8 on every projection, float32, ``remat="full"``, the default) and
an ``optax.adamw`` update; tiny dims (hidden 256, 4 heads of 64, 2 kv heads, MLP 512, vocab
1024), batch 2 x 128 tokens. The model is abstract (``nnx.eval_shape``): nothing is
initialised or run, only ``jax.jit(step).trace(...)`` (Python tracing: ``trace_s``) and
``.lower().compile()`` (lowering to StableHLO and XLA's compile: ``compile_s``) are timed, in
wall seconds and in this process's CPU seconds (``*_cpu_s``: steadier on a shared machine).
Each case runs in its own subprocess (no cache shared between cases).

Memory: ``compile().memory_analysis().temp_size_in_bytes`` of the same step at 8 layers,
batch 2 x 512 tokens, for each ``remat`` policy, scanned and unrolled.

Writes ``benchmarks/results/compile_cpu.json`` (machine, command, per case ``trace_s``,
``compile_s``, the ratio 80/20 layers, the temp bytes).

    python benchmarks/bench_compile.py                  # 20 and 80 layers (about 10 minutes on 2 busy cores)
    python benchmarks/bench_compile.py --layers 4 8     # quick
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import machine_info  # noqa: E402


def _step(layers: int, scan: bool, remat: str, batch: int, seq: int):
    """The jitted step and its abstract arguments."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from ravnest_jax.models import LoraConfig, Transformer, TransformerConfig, apply_lora, split_lora, stack_layers

    cfg = TransformerConfig(
        model_type="llama",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        max_position_embeddings=4096,
    )

    def build():
        m = apply_lora(Transformer(cfg, nnx.Rngs(0)), LoraConfig(rank=8))
        return stack_layers(m) if scan else m

    lm = split_lora(nnx.eval_shape(build))
    tx = optax.adamw(1e-4)

    def step(adapters, opt_state, frozen, tokens):
        def loss(a):
            model = lm.model(a, frozen)
            model.remat = remat
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    opt_state = jax.eval_shape(tx.init, lm.adapters)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    return jax.jit(step), (lm.adapters, opt_state, lm.frozen, tokens)


def case(layers: int, scan: bool, remat: str) -> dict:
    """Times one case (in this process)."""
    step, args = _step(layers, scan, remat, 2, 128)
    t0, c0 = time.perf_counter(), time.process_time()
    traced = step.trace(*args)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = traced.lower().compile()
    t2, c2 = time.perf_counter(), time.process_time()
    return {
        "layers": layers,
        "scan_layers": scan,
        "remat": remat,
        "trace_s": round(t1 - t0, 3),
        "compile_s": round(t2 - t1, 3),
        "total_s": round(t2 - t0, 3),
        "trace_cpu_s": round(c1 - c0, 3),
        "compile_cpu_s": round(c2 - c1, 3),
        "total_cpu_s": round(c2 - c0, 3),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    }


def memory(layers: int, scan: bool, remat: str) -> dict:
    """XLA's temp bytes of the step at batch 2 x 512 tokens."""
    import warnings

    step, args = _step(layers, scan, remat, 2, 512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = step.lower(*args).compile()
    return {
        "layers": layers,
        "scan_layers": scan,
        "remat": remat,
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    }


def _child(kind: str, layers: int, scan: bool, remat: str) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, str(layers), str(int(scan)), remat]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        return {"layers": layers, "scan_layers": scan, "remat": remat, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs=2, default=(20, 80), help="the two depths compared")
    ap.add_argument("--memory-layers", type=int, default=8, help="depth of the temp-bytes comparison")
    ap.add_argument("--out", default=str(HERE / "results" / "compile_cpu.json"))
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, layers, scan, remat = args.child
        fn = case if kind == "time" else memory
        print(json.dumps(fn(int(layers), bool(int(scan)), remat)))
        return
    lo, hi = args.layers
    cases = []
    for scan in (True, False):
        for layers in (lo, hi):
            cases.append(_child("time", layers, scan, "full"))
            print(json.dumps(cases[-1]), flush=True)
    ratios = {}
    for scan in (True, False):
        by = {c["layers"]: c for c in cases if c["scan_layers"] == scan and "error" not in c}
        if lo in by and hi in by:
            ratios["scanned" if scan else "unrolled"] = {
                k: round(by[hi][k] / by[lo][k], 2)
                for k in ("trace_s", "compile_s", "total_s", "trace_cpu_s", "compile_cpu_s", "total_cpu_s")
            }
    mem = []
    for scan in (True, False):
        for remat in ("none", "full", "dots", "offload"):
            mem.append(_child("memory", args.memory_layers, scan, remat))
            print(json.dumps(mem[-1]), flush=True)
    result = {
        "machine": machine_info(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "step": "value_and_grad of token cross-entropy over LoRA rank-8 adapters + optax.adamw; hidden 256, "
        "4 heads x 64, 2 kv heads, MLP 512, vocab 1024, float32, remat='full'; batch 2 x 128 tokens",
        "cases": cases,
        f"ratio_{hi}_over_{lo}": ratios,
        "memory_step": f"the same step at {args.memory_layers} layers, batch 2 x 512 tokens",
        "temp_bytes_by_remat": mem,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
