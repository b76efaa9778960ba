#!/usr/bin/env python3
"""Attention memory: XLA's compiled plan (``memory_analysis().temp_size_in_bytes``) of one
attention layer's forward + backward (``jax.grad`` of a scalar of the output w.r.t. q, k, v),
``"xla"`` (materialises the scores) against ``"chunked"`` (``ravnest_jax.models.attention``),
at several sequence lengths, and the chunked kernel at several chunk sizes. Compiles only (no
execution): seconds on 2 cores. ``"cudnn"`` needs an NVIDIA GPU and is not measured here.

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
    result = {
        "what": "XLA's compiled temp bytes of one attention's forward and forward+backward (jax.grad w.r.t. q, k, v)",
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "shape": shape,
        "rows": rows,
        "chunk_sweep": sweep,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
