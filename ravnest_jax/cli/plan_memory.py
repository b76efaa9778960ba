"""Device bytes of one LoRA / QLoRA fine-tuning peer (base, adapters, optimizer, anchor and outer
state, activations), from jax.eval_shape and XLA's plan of the compiled step; nothing is
allocated. Presets: llama-3.2-1b, llama-3.1-8b, llama-3.1-70b, qwen3-8b."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ._args import add_json, errors, fail

NAME = "plan-memory"
HELP = "device bytes of one LoRA/QLoRA fine-tuning peer, computed without allocating"


def run(args: argparse.Namespace) -> int:
    """Prints the plan of one peer (``--stages``: of each stage); exit status 2 on a bad input."""
    if args.devices < 1:
        return fail(f"--devices must be >= 1, got {args.devices}")
    with errors(ImportError, prefix="plan-memory needs the llm extra (pip install 'ravnest-jax[llm]'): "), errors():
        if args.devices > 1:  # CPU devices to compile the sharded step for, before jax starts
            import jax

            jax.config.update("jax_num_cpu_devices", args.devices)
        from ravnest_jax.models import LoraConfig, load_config, plan_json, plan_memory

        cfg = load_config(args.config)  # checked before anything traces
        lora = LoraConfig(
            rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=tuple(args.lora_targets), train_a=not args.frozen_a
        )
        if args.stages is not None:
            return _plan_stages(args, cfg, lora)
        plan = plan_memory(
            cfg,
            lora=lora,
            quantize=args.quantize,
            batch=args.batch,
            seq_len=args.seq_len,
            dtype=args.dtype,
            remat=args.remat,
            devices=args.devices,
            attention=args.attention,
            loss_chunk=args.loss_chunk,
            micro_batches=args.micro_batches,
        )
    q = args.quantize or args.dtype
    remat = "no remat" if args.remat == "none" else f"remat {args.remat}"
    remat += f", attention {args.attention}, loss chunk {args.loss_chunk}, micro-batches {args.micro_batches}"
    where = "" if args.devices == 1 else f", FSDP over {args.devices} devices (bytes of one)"
    print(
        f"{args.config}: LoRA rank {args.lora_rank}, base {q}, batch {args.batch} x {args.seq_len} tokens, "
        f"{args.dtype}, {remat}{where}"
    )
    print(plan.table())
    if args.device_gib:
        from ravnest_jax.models import POOL_RESERVE, allocator_pool_bytes

        card = int(args.device_gib * 1024**3)
        pool = allocator_pool_bytes(card)
        verdict = "fits" if plan.fits(card) else "does not fit"
        each = "" if args.devices == 1 else " on each device"
        print(
            f"{verdict} in the {pool / 1024**3:.2f} GiB pool JAX's allocator takes of {args.device_gib:g} GiB{each} "
            f"(leaving {POOL_RESERVE:.0%} of it; XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 raises the pool)"
        )
    if args.json:
        Path(args.json).write_text(
            plan_json(
                plan,
                config=str(args.config),
                quantize=args.quantize,
                batch=args.batch,
                seq_len=args.seq_len,
                dtype=args.dtype,
                remat=args.remat,
                attention=args.attention,
                loss_chunk=args.loss_chunk,
                micro_batches=args.micro_batches,
            )
            + "\n"
        )
    return 0


def _size(b: float) -> str:
    return f"{b / 1024**3:.2f} GiB" if b >= 1024**3 / 10 else f"{b / 1024**2:.2f} MiB"


def _plan_stages(args: argparse.Namespace, cfg, lora) -> int:
    """``plan-memory --stages S``: each pipeline stage's bytes against a card's allocator pool."""
    import dataclasses
    import json

    from ravnest_jax.models import POOL_RESERVE, allocator_pool_bytes  # the stage planner's reserve too
    from ravnest_jax.pipeline import plan_stage_memory, pool_message

    if args.devices != 1:
        return fail("--stages plans one device per stage: drop --devices")
    with errors():
        plan = plan_stage_memory(
            cfg,
            stages=args.stages,
            lora=lora,
            quantize=args.quantize,
            micro_batch=args.batch,
            seq_len=args.seq_len,
            dtype=args.dtype,
            in_flight=args.in_flight,
            remat=args.remat != "none",
        )
        card = int(args.device_gib * 1024**3)
        pool = allocator_pool_bytes(card)
    fraction = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or "0.75"
    widths = ", ".join(f"{k} {v} bits" for k, v in plan.widths.items())
    print(
        f"{args.config}: {args.stages} stages, LoRA rank {args.lora_rank}, base {args.quantize or args.dtype}, "
        f"micro-batch {args.batch} x {args.seq_len} tokens, {args.dtype}, {'no remat' if args.remat == 'none' else 'remat ' + args.remat}"
    )
    print(f"device widths measured here: {widths}; pool: {args.device_gib:g} GiB x {fraction} (JAX's allocator)")
    print(plan.table(pool))
    bad = [s for s in plan.stages if not s.fits(pool)]
    worst = min(s.headroom(pool) for s in plan.stages)
    if bad:
        s = max(bad, key=lambda s: s.total)
        print(
            f"does not fit {args.stages} x {args.device_gib:g} GiB: stage {s.stage} needs {_size(s.total)} "
            f"(with {POOL_RESERVE:.0%} of the pool free), the pool is {_size(pool)}; {pool_message()}"
        )
    else:
        print(
            f"fits {args.stages} x {args.device_gib:g} GiB with {worst:.1%} headroom in the pool (the least of the stages)"
        )
    if args.json:
        rows = [{**dataclasses.asdict(s), "total": s.total, "headroom": s.headroom(pool)} for s in plan.stages]
        out = dict(config=str(args.config), quantize=args.quantize, micro_batch=args.batch, seq_len=args.seq_len)
        out.update(dtype=args.dtype, device_bytes=card, pool_bytes=pool, widths=plan.widths, stages=rows)
        Path(args.json).write_text(json.dumps(out) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax plan-memory``."""
    p.add_argument("--config", required=True, help="config.json, a checkpoint directory, or a preset name")
    p.add_argument("--lora-rank", type=int, default=16, help="adapter rank (default 16)")
    p.add_argument("--lora-targets", nargs="+", default=["q", "k", "v", "o", "gate", "up", "down"], help="projections")
    p.add_argument("--frozen-a", action="store_true", help="A frozen, only B trains (default: both train)")
    p.add_argument("--quantize", choices=["int8", "int4", "nf4"], default=None, help="the frozen base's storage")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    p.add_argument(
        "--remat",
        choices=["full", "dots", "offload", "none"],
        default="full",
        help="gradient checkpointing of the step (default full: recompute each block)",
    )
    p.add_argument("--no-remat", dest="remat", action="store_const", const="none", help="the same as --remat none")
    p.add_argument(
        "--attention",
        choices=["auto", "cudnn", "chunked", "xla"],
        default="auto",
        help="the model's attention implementation (default auto; XLA's CPU plan: cudnn is a GPU's)",
    )
    p.add_argument("--loss-chunk", type=int, default=1024, help="tokens per cross-entropy chunk (default 1024)")
    p.add_argument("--micro-batches", type=int, default=1, help="gradient-accumulation slices of the batch (default 1)")
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="the peer's devices: bytes of one when the model lies FSDP-style over all of them "
        "(load_pretrained(mesh=)) and the batch is split (default 1)",
    )
    p.add_argument(
        "--stages",
        type=int,
        default=None,
        help="pipeline stages: one row per stage (base, adapters + optimizer + outer, activations of the "
        "micro-batches in flight, one block's working set) against the pool of a --device-gib card; "
        "--batch is the micro-batch",
    )
    p.add_argument("--in-flight", type=int, default=None, help="with --stages: the schedule's depth (default S)")
    p.add_argument(
        "--device-gib",
        type=float,
        default=24.0,
        help="say whether it fits in the pool JAX's allocator takes of a card of this much (default 24; "
        "the pool is XLA_PYTHON_CLIENT_MEM_FRACTION of it, 0.75 unless set)",
    )
    add_json(p, "the figures")
