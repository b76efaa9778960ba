#!/usr/bin/env python3
"""Validates ``plan_memory`` (``ravnest-jax plan-memory``) against the full-depth compiled step.

    python benchmarks/validate_memory_plan.py --config llama-3.1-8b --quantize int4 --batch 4 --seq-len 2048
    python benchmarks/validate_memory_plan.py --config llama-3.2-1b --layers 8   # the model cut to 8 layers

The planner compiles the library's training step (``rj.models.make_train_step``, the step the
example runs) for the scanned model (``load_pretrained``'s default), built from one layer
wrapped by qwix whose stacked leaves it gives the real depth; with ``--no-scan-layers`` the
unrolled model cut to 3 and 4 layers, the activations extrapolated linearly in depth. Here the
step is built separately, as ``load_pretrained`` builds the model (qwix over every layer of the
per-layer model, then ``stack_layers``; minutes for 8B on 2 cores, nothing allocated), compiled,
and XLA's memory analysis of it is compared with the plan: the activations with its temporary
bytes, the plan's total with ``arguments + temporaries + outputs - aliased (donated)``. Appends one row per run to
``benchmarks/results/memory_plan_validation.json`` (machine, command, both figures, the errors)
and exits 1 when either is more than ``--tolerance`` (default 5%) apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _common import machine_info  # noqa: E402

GIB = 1024**3


def full_step(cfg, lora, quantize, dtype, batch, seq_len, remat, scan_layers, knobs):
    """The library's step of the whole model built as ``load_pretrained`` builds it (qwix
    applied to every layer of the per-layer model, then stacked with ``stack_layers``), as
    shapes, with ``rj.diloco(optax.adamw)``, lowered for a ``(batch, seq_len)`` batch."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import ravnest_jax as rj
    from ravnest_jax.models import LoraModel, TokenBatch, Transformer, make_train_step
    from ravnest_jax.models._lora import _trainable, _wrap
    from ravnest_jax.models._scan import stack_layers

    def build():
        return _wrap(Transformer(cfg, nnx.Rngs(0), dtype=dtype, param_dtype=dtype), lora, quantize)

    model = nnx.eval_shape(build)
    if scan_layers:
        stack_layers(model)
    graphdef, adapters, frozen = nnx.split(model, _trainable(lora), ...)
    adapters = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), adapters)
    lm = LoraModel(graphdef, adapters, frozen, lora, graphdef if lora.dropout > 0 else None)
    tx = rj.diloco(optax.adamw(1e-4), sync_every=100)
    step = make_train_step(lm, tx, remat=remat, dtype=dtype, **knobs)
    row = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    tokens = TokenBatch(row, row, jax.ShapeDtypeStruct(row.shape, jnp.float32), row, row)
    state = jax.eval_shape(tx.init, adapters)
    return step.lower(adapters, state, frozen, tokens, jax.ShapeDtypeStruct((), jnp.int32))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama-3.1-8b", help="a preset, config.json or checkpoint directory")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: all)")
    ap.add_argument("--quantize", choices=["int8", "int4", "nf4"], default=None)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--remat", choices=["full", "dots", "offload", "none"], default="full")
    ap.add_argument("--attention", choices=["auto", "cudnn", "chunked", "xla"], default=None)
    ap.add_argument("--loss-chunk", type=int, default=1024)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument(
        "--no-scan-layers", dest="scan_layers", action="store_false", help="the unrolled model (default: scanned)"
    )
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", default=str(HERE / "results" / "memory_plan_validation.json"))
    args = ap.parse_args()

    import jax.numpy as jnp

    from ravnest_jax.models import LoraConfig
    from ravnest_jax.models._plan import load_config, plan_memory, step_memory

    cfg = load_config(args.config)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    knobs = dict(attention=args.attention, loss_chunk=args.loss_chunk, micro_batches=args.micro_batches)
    t0 = time.perf_counter()
    plan = plan_memory(
        cfg,
        lora=lora,
        quantize=args.quantize,
        batch=args.batch,
        seq_len=args.seq_len,
        dtype=args.dtype,
        remat=args.remat,
        scan_layers=args.scan_layers,
        **knobs,
    )
    t1 = time.perf_counter()
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    lowered = full_step(cfg, lora, args.quantize, dtype, args.batch, args.seq_len, args.remat, args.scan_layers, knobs)
    full = step_memory(lowered.compile())
    t2 = time.perf_counter()
    act_err = (plan.activations - full["temp"]) / full["temp"]
    total_err = (plan.total - full["total"]) / full["total"]
    row = {
        "config": str(args.config),
        "layers": cfg.num_hidden_layers,
        "quantize": args.quantize,
        "lora_rank": args.lora_rank,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "dtype": args.dtype,
        "remat": args.remat,
        **knobs,
        "scan_layers": args.scan_layers,
        "plan": plan.as_dict(),
        "compiled_full_depth": full,
        "activations_error": round(act_err, 5),
        "total_error": round(total_err, 5),
        "within_tolerance": abs(act_err) <= args.tolerance and abs(total_err) <= args.tolerance,
        "plan_seconds": round(t1 - t0, 1),
        "full_compile_seconds": round(t2 - t1, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
    }
    print(
        f"{args.config} x{cfg.num_hidden_layers} {args.quantize or args.dtype} batch {args.batch} x {args.seq_len} "
        f"remat {args.remat}: plan total {plan.total / GIB:.2f} GiB (activations {plan.activations / GIB:.2f}), "
        f"compiled total {full['total'] / GIB:.2f} GiB (temp {full['temp'] / GIB:.2f}): "
        f"activations {100 * act_err:+.2f}%, total {100 * total_err:+.2f}%"
    )
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"benchmark": "memory_plan_validation", "rows": []}
    doc["rows"].append(row)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if row["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
