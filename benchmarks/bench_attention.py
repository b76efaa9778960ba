#!/usr/bin/env python3
"""Attention memory: XLA's compiled plan (``memory_analysis().temp_size_in_bytes``) of one
attention layer's forward + backward (``jax.grad`` of a scalar of the output w.r.t. q, k, v),
``"xla"`` (materialises the scores) against ``"chunked"`` (``ravnest_jax.models.attention``),
at several sequence lengths, the chunked kernel at several chunk sizes, and what each layer of
the tiny Llama fixture's remat LoRA step adds with either (XLA gives every ``while`` loop's
carried buffers their own allocation, so in the unrolled layer loop the chunked kernel's loops
cost a few q-sized buffers per layer). Compiles only (no execution): a minute or two on 2 cores. ``"cudnn"`` needs an NVIDIA GPU and is not measured here.

Writes ``benchmarks/results/attention_cpu.json`` (machine, command, every row).

    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --heads 32 --kv-heads 8 --head-dim 128 --seq 1024 2048 4096 8192
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import machine_info  # noqa: E402

from ravnest_jax.models import attention  # noqa: E402


def temp_bytes(impl: str, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, chunk: int, dtype) -> dict:
    def loss(q, k, v, seg):
        out = attention(q, k, v, segment_ids=seg, implementation=impl, chunk_size=chunk).astype(jnp.float32)
        return jnp.sum(out * out)

    s = jax.ShapeDtypeStruct
    args = (
        s((batch, seq, heads, head_dim), dtype),
        s((batch, seq, kv_heads, head_dim), dtype),
        s((batch, seq, kv_heads, head_dim), dtype),
        s((batch, seq), jnp.int32),
    )
    t0 = time.perf_counter()
    fwd = jax.jit(lambda q, k, v, seg: attention(q, k, v, segment_ids=seg, implementation=impl, chunk_size=chunk))
    fwd_bytes = fwd.lower(*args).compile().memory_analysis().temp_size_in_bytes
    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().memory_analysis().temp_size_in_bytes
    return {
        "implementation": impl,
        "seq": seq,
        "chunk": chunk if impl == "chunked" else None,
        "forward_temp_bytes": int(fwd_bytes),
        "forward_backward_temp_bytes": int(both),
        "compile_s": round(time.perf_counter() - t0, 2),
    }


def model_per_layer(impl: str, layers: tuple[int, int] = (2, 4), batch: int = 2, seq: int = 512) -> dict:
    """XLA's plan of a LoRA training step (``jax.grad`` w.r.t. the adapters, remat on) of the
    tiny Llama fixture (``tests/fixtures/llm/llama``: hidden 64, 4 heads, 2 kv heads) at two
    depths: the bytes each further layer adds."""
    import dataclasses

    import optax
    from flax import nnx

    from ravnest_jax.models import LoraConfig, Transformer, TransformerConfig, apply_lora, split_lora

    cfg0 = TransformerConfig.from_hf(ROOT / "tests" / "fixtures" / "llm" / "llama")
    out = {}
    for n in layers:
        cfg = dataclasses.replace(cfg0, num_hidden_layers=n)
        lm = split_lora(apply_lora(Transformer(cfg, nnx.Rngs(0)), LoraConfig(rank=4)))

        def loss(adapters, frozen, tokens, lm=lm):
            model = lm.model(adapters, frozen)
            model.remat, model.attention = True, impl
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
        compiled = jax.jit(jax.grad(loss)).lower(lm.adapters, lm.frozen, tokens).compile()
        out[n] = int(compiled.memory_analysis().temp_size_in_bytes)
    lo, hi = layers
    return {
        "implementation": impl,
        "batch": batch,
        "seq": seq,
        "temp_bytes_by_layers": out,
        "per_layer_bytes": (out[hi] - out[lo]) / (hi - lo),
        "block_input_bytes": batch * seq * cfg0.hidden_size * 4,
    }


def loops_in_a_row(counts: tuple[int, ...] = (2, 4, 8)) -> dict:
    """XLA's temp bytes of ``n`` scans in a row, each over a 1 MiB float32 array (chunks as
    ``xs``, the result stacked), unrolled and inside a scan over ``n`` layers: whether separate
    loops share their buffers."""
    shape = jax.ShapeDtypeStruct((4096, 64), jnp.float32)

    def one(x):
        _, ys = jax.lax.scan(lambda c, xi: (c, jnp.tanh(xi) * 2), None, x.reshape(4, -1, 64))
        return ys.reshape(x.shape) + x

    out = {"array_bytes": 4096 * 64 * 4, "unrolled": {}, "in_a_scan_over_layers": {}}
    for n in counts:

        def unrolled(x, n=n):
            for _ in range(n):
                x = one(x)
            return x

        def scanned(x, n=n):
            return jax.lax.scan(lambda x, _: (one(x), None), x, None, length=n)[0]

        for name, fn in (("unrolled", unrolled), ("in_a_scan_over_layers", scanned)):
            out[name][n] = int(jax.jit(fn).lower(shape).compile().memory_analysis().temp_size_in_bytes)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument(
        "--chunk-sweep", type=int, nargs="*", default=[128, 256, 512, 1024], help="chunk sizes at --sweep-seq"
    )
    p.add_argument("--sweep-seq", type=int, default=4096)
    p.add_argument(
        "--no-model-layers", dest="model_layers", action="store_false", help="skip the tiny model's per-layer growth"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "attention_cpu.json")
    a = p.parse_args()
    dtype = jnp.dtype(a.dtype)
    shape = {"batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "dtype": a.dtype}
    rows = []
    for seq in a.seq:
        for impl in ("xla", "chunked"):
            r = temp_bytes(impl, a.batch, seq, a.heads, a.kv_heads, a.head_dim, a.chunk, dtype)
            r["one_head_f32_scores_bytes"] = seq * seq * 4
            rows.append(r)
            print(
                f"{impl:8s} seq {seq:6d}: forward {r['forward_temp_bytes'] / 2**20:9.1f} MiB, forward+backward "
                f"{r['forward_backward_temp_bytes'] / 2**20:9.1f} MiB (one head's f32 scores {seq * seq * 4 / 2**20:.0f} MiB)",
                flush=True,
            )
    sweep = []
    for chunk in a.chunk_sweep:
        r = temp_bytes("chunked", a.batch, a.sweep_seq, a.heads, a.kv_heads, a.head_dim, chunk, dtype)
        sweep.append(r)
        print(
            f"chunked seq {a.sweep_seq} chunk {chunk:5d}: forward+backward {r['forward_backward_temp_bytes'] / 2**20:.1f} MiB",
            flush=True,
        )
    per_layer = []
    if a.model_layers:
        for impl in ("xla", "chunked"):
            r = model_per_layer(impl)
            per_layer.append(r)
            print(
                f"tiny model, remat, {impl:8s}: {r['temp_bytes_by_layers']} bytes by layers, "
                f"{r['per_layer_bytes'] / r['block_input_bytes']:.2f} block inputs a layer",
                flush=True,
            )
    loops = loops_in_a_row()
    print(f"scans in a row (1 MiB each): unrolled {loops['unrolled']}, in a scan {loops['in_a_scan_over_layers']}")
    result = {
        "what": "XLA's compiled temp bytes of one attention's forward and forward+backward (jax.grad w.r.t. q, k, v)",
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "shape": shape,
        "rows": rows,
        "chunk_sweep": sweep,
        "model_per_layer_remat": per_layer,
        "scans_in_a_row_temp_bytes": loops,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
