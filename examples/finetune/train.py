#!/usr/bin/env python3
"""LoRA / QLoRA fine-tuning of a pretrained LLM across peers: one peer, as plain user code.

Loads a Hugging Face checkpoint (``config.json``, ``model.safetensors`` or shards,
``tokenizer.json``) with adapters on the chosen projections and, with ``--quantize int4``, the
frozen base in 4 bits (``rj.models.load_pretrained``; with ``--stages`` each stage peer reads
only its own layers' tensors: ``rj.pipeline.pretrained_split``); tokenises the text with the
checkpoint's tokenizer and packs it into sequences, one shard per peer (``rj.data.PackedTokens``),
or with ``--data`` reads jsonl / parquet records (TRL's formats, alpaca's), loss-masked to the
completion / assistant tokens and packed per document (``rj.data.PackedExamples``);
trains the adapters only with AdamW, and averages them every H steps over the swarm (``rj.diloco`` +
``rj.OuterSync``: rounds carry the adapters, nothing else); checkpoints adapters, optimizer and
data position (``rj.Checkpointer``) and resumes exactly; ``--export DIR`` writes the merged model
(adapters folded into the original float weights, or with ``--merge-into dequantized`` into the
quantised base they trained against) as a Hugging Face checkpoint, ``--export-adapters DIR`` the
adapters alone in PEFT's format (``rj.models.save_peft_adapters``); ``--devices N`` lays the base
and the adapters FSDP-style over N local devices (``load_pretrained(..., mesh=)``) and splits the
batch over them.
The step is the library's (``rj.models.make_train_step``): bf16 compute on accelerators with
float32 adapter masters, gradient checkpointing, chunked cross-entropy, donated state, optional
gradient accumulation (``--micro-batches``); the defaults are those of a real card (see
``--help``). Started by the launcher:

    ravnest-jax local --peers 4 -- python examples/finetune/train.py --checkpoint CKPT
    python examples/finetune/main.py --local-peers 4        # makes a tiny checkpoint first

Prints one JSON line at the end: steps, eval loss (nats per token) of the global adapters
before and after, rounds, bytes, the state digest (equal on every peer).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the finetune package is next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = ("auto", "float32", "bfloat16")
REMAT = ("full", "dots", "offload", "none")
ATTENTION = ("auto", "cudnn", "chunked", "xla")
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_MEM_FRACTION = 0.9
# the outer step of LoRA-DiLoCo (benchmarks/bench_lora_diloco.py, docs/finetuning.md)
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.5


def set_memory_fraction(argv: list[str] | None = None) -> str:
    """Sets ``XLA_PYTHON_CLIENT_MEM_FRACTION`` from ``--mem-fraction`` (else the environment's
    value, else 0.9) before jax is imported (JAX's allocator reads it when the backend starts;
    its own default, 0.75, leaves a quarter of a GPU unused). Returns the value in effect."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--mem-fraction", type=float, default=None)
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.mem_fraction is not None:
        os.environ[MEM_FRACTION] = str(known.mem_fraction)
    return os.environ.setdefault(MEM_FRACTION, str(DEFAULT_MEM_FRACTION))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ravnest_jax.models import QUANTIZE  # imports jax, does not start a backend

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--checkpoint", required=True, help="Hugging Face checkpoint directory (config, safetensors, tokenizer)"
    )
    p.add_argument(
        "--text", nargs="+", default=None, help="UTF-8 text files to train on (default: the stdlib's docs topics)"
    )
    p.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="jsonl / parquet datasets (files, directories or globs) in TRL's formats or alpaca's, instead of "
        "--text: loss only on the completion / assistant tokens, packed without crossing documents (docs/data.md)",
    )
    p.add_argument(
        "--data-format",
        choices=("auto", "text", "prompt_completion", "messages", "alpaca"),
        default="auto",
        help="record format of --data (default auto: from each record's fields)",
    )
    p.add_argument("--train-on-prompt", action="store_true", help="with --data: learn the prompt tokens too")
    p.add_argument(
        "--no-packing", action="store_true", help="with --data: one document a row, padded (default: packed)"
    )
    p.add_argument(
        "--overlong",
        choices=("split", "drop"),
        default="split",
        help="with --data: documents longer than --seq-len are split or dropped (default split)",
    )
    how_long = p.add_mutually_exclusive_group()
    how_long.add_argument("--max-steps", type=int, default=300, help="inner steps to train (default 300)")
    how_long.add_argument(
        "--epochs",
        type=float,
        help="instead of --max-steps: passes over this peer's data shard (fractions allowed), as steps once "
        "the data are read: ceil(epochs x the smallest shard's rows / --batch-size); with --stages a cluster's",
    )
    p.add_argument("--sync-every", type=int, default=20, help="H: inner steps per outer round (default 20)")
    p.add_argument("--overlap-steps", type=int, default=1, help="tau: steps a round overlaps; 0 blocks (default 1)")
    p.add_argument(
        "--outer-lr", type=float, default=OUTER_LR, help=f"the outer step's learning rate (default {OUTER_LR})"
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=OUTER_MOMENTUM,
        help=f"the outer step's Nesterov momentum in [0, 1); 0: plain SGD (default {OUTER_MOMENTUM})",
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate (default 3e-3)")
    p.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine", "linear"),
        default="constant",
        help="inner learning rate over --max-steps after the warm-up: constant, cosine or linear decay to 0 "
        "(default constant)",
    )
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up of the inner lr from 0 (default 0)")
    p.add_argument("--lora-rank", type=int, default=8, help="adapter rank (default 8)")
    p.add_argument("--lora-alpha", type=float, default=None, help="adapter alpha (default: 2 x rank)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="adapter dropout (default 0)")
    p.add_argument(
        "--lora-targets",
        nargs="+",
        default=["q", "k", "v", "o", "gate", "up", "down"],
        help="projections with adapters",
    )
    p.add_argument(
        "--frozen-a", action="store_true", help="freeze A, train B only (FFA-LoRA: exact averages, half the bytes)"
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE,
        default=None,
        help="store the frozen base quantised (QLoRA; default: unquantised, in --dtype)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="compute and base dtype; adapters stay float32 masters (default auto: bfloat16 on a GPU or TPU, "
        "which multiply it natively at half the memory; float32 on CPU, where bfloat16 is slower)",
    )
    p.add_argument(
        "--remat",
        choices=REMAT,
        default="full",
        help="gradient checkpointing: full recomputes each block in the backward pass, dots keeps its matmul "
        "outputs, offload moves block inputs to host memory, none keeps everything (default full: about a "
        "third more compute for a fraction of the activation memory, as peft and unsloth default to)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION,
        default="auto",
        help="attention implementation: cudnn (flash attention on NVIDIA GPUs), chunked (memory-efficient, "
        "any backend), xla (plain), auto (cudnn where it runs, else xla) (default auto)",
    )
    p.add_argument(
        "--loss-chunk",
        type=int,
        default=1024,
        help="positions per chunk of the cross-entropy: the whole (batch, seq, vocab) float32 logits are never "
        "held (default 1024)",
    )
    p.add_argument(
        "--no-donate",
        action="store_true",
        help="do not donate the adapters and optimizer state to the step (default: donated, updated in place)",
    )
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help=f"{MEM_FRACTION}: the share of an accelerator JAX's allocator takes (default: the environment "
        f"variable, else {DEFAULT_MEM_FRACTION}; JAX's own 0.75 leaves a quarter of the card unused)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="local devices of this peer: the base and adapters FSDP-style over them, the batch split "
        "(on a machine without accelerators this many CPU devices are made; default 1)",
    )
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the eval loss (default 4)")
    p.add_argument("--checkpoint-dir", default=None, help="save here between rounds; resume from it")
    p.add_argument("--fresh", action="store_true", help="start from step 0: checkpoints moved to DIR/previous-TIME/")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="inner steps between saves, at the first round boundary after (default: --sync-every)",
    )
    p.add_argument("--export", default=None, help="write the merged model here at the end (first peer only)")
    p.add_argument(
        "--merge-into",
        choices=("original", "dequantized"),
        default="original",
        help="with --export and --quantize: fold the adapters into the checkpoint's original float weights "
        "(read again from it; what PEFT's merge_and_unload on the float model gives) or into the dequantised "
        "quantised base they trained against (the merged model computes what the trained one did); "
        "docs/finetuning.md, Export (default original)",
    )
    p.add_argument(
        "--export-adapters",
        default=None,
        help="write the adapters here at the end in Hugging Face PEFT's format (adapter_config.json, "
        "adapter_model.safetensors; first peer only): PeftModel.from_pretrained(base, DIR) loads them",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the adapters and the data order (default 0)")
    p.add_argument(
        "--stages",
        type=int,
        default=1,
        help="cut the model into S pipeline stages, one peer each (the launcher's peers a multiple of S: "
        "peers / S clusters averaging each stage's adapters with DiLoCo; docs/pipeline.md)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="slices of the batch per step: gradient accumulation, one slice's activations at a time, the "
        "same step as the whole batch (default 1); with --stages the micro-batches in the pipeline (default 4)",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        default=None,
        help="with --stages: micro-batches the first stage holds (default: the stage count; up to "
        "--micro-batches + 1 hides slow links)",
    )
    p.add_argument(
        "--pipeline-mode",
        choices=["sync", "async", "stash", "predict", "2bw"],
        default="sync",
        help="with --stages: sync (exact) or async (no flush; only the adapters go stale)",
    )
    p.add_argument(
        "--activation-codec",
        choices=["fp32", "bf16", "int8", "int4", "fp4"],
        default="int8",
        help="with --stages: codec of activations and activation-gradients (default int8)",
    )
    args = p.parse_args(argv)
    if args.epochs is not None and not (0 < args.epochs < float("inf")):
        p.error(f"--epochs must be a number > 0, got {args.epochs}")
    if args.micro_batches is None:
        args.micro_batches = 4 if args.stages > 1 else 1
    names = ("max_steps", "sync_every", "batch_size", "seq_len", "lora_rank", "eval_batches", "devices")
    for name in (*names, "micro_batches", "loss_chunk"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_size % args.devices:
        p.error(f"--batch-size ({args.batch_size}) must be a multiple of --devices ({args.devices})")
    if args.mem_fraction is not None and not 0 < args.mem_fraction <= 1:
        p.error(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    if not args.outer_lr > 0:
        p.error(f"--outer-lr must be > 0, got {args.outer_lr}")
    if not 0 <= args.outer_momentum < 1:
        p.error(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    if args.stages == 1 and args.batch_size % (args.micro_batches * args.devices):
        p.error(
            f"--batch-size ({args.batch_size}) must be a multiple of --micro-batches x --devices "
            f"({args.micro_batches} x {args.devices}): each micro-batch is split over the devices"
        )
    if args.data and args.text:
        p.error("--data and --text: give one of them")
    if args.checkpoint_every is None:
        args.checkpoint_every = args.sync_every
    if args.checkpoint_every < 1 or args.warmup_steps < 0:
        p.error("--checkpoint-every must be >= 1 and --warmup-steps >= 0")
    if not 0 <= args.overlap_steps < args.sync_every:
        p.error("--overlap-steps must be in [0, --sync-every)")
    for flag, out in (("--export", args.export), ("--export-adapters", args.export_adapters)):
        if out and Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
            p.error(f"{flag}: {out} exists and is not an empty directory")
    if args.stages > 1:
        world = int(os.environ.get("RAVNEST_WORLD_SIZE", "1"))
        if world % args.stages:
            p.error(f"--stages {args.stages}: the launcher's peers ({world}) must be a multiple of it")
        if args.batch_size % args.micro_batches:
            p.error(f"--batch-size ({args.batch_size}) must be a multiple of --micro-batches ({args.micro_batches})")
        hi = max(args.stages, args.micro_batches + 1)
        if args.in_flight is not None and not args.stages <= args.in_flight <= hi:
            p.error(
                f"--in-flight ({args.in_flight}) must be in [--stages, --micro-batches + 1] = [{args.stages}, {hi}]"
            )
        if args.export:
            p.error(
                "--export is not supported with --stages: no peer holds the whole model; write the adapters "
                "(--export-adapters DIR), then ravnest-jax merge-adapters --model CHECKPOINT --adapters DIR --out OUT"
            )
        for flag, bad in (
            ("--lora-dropout", args.lora_dropout > 0),
            ("--devices", args.devices > 1),
            ("--attention other than auto", args.attention != "auto"),
        ):
            if bad:
                p.error(f"{flag} is not supported with --stages yet (docs/pipeline.md, limits)")
        if args.data and not args.no_packing:
            p.error(
                "--data with --stages needs --no-packing: the stages carry no segment ids, so one document a row "
                "(docs/pipeline.md, limits)"
            )
    if args.checkpoint_dir and Path(args.checkpoint_dir).expanduser().exists():
        if not Path(args.checkpoint_dir).expanduser().is_dir():
            p.error(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a directory")
    return args


def peer_mesh(n: int):
    """The peer's local devices as a mesh with one automatic ``"data"`` axis (XLA gathers each
    FSDP weight where it is used), or ``None`` for one device.

    Raises:
      ValueError: fewer than ``n`` local devices.
    """
    import jax
    from jax.sharding import AxisType

    if n == 1:
        return None
    devices = jax.local_devices()
    if len(devices) < n:
        raise ValueError(f"--devices {n}: this process has {len(devices)} local {jax.default_backend()} devices")
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=devices[:n])


def main(argv: list[str] | None = None) -> dict:
    """One peer of the fine-tuning example (``--help``); returns its summary. Ctrl+C and
    SIGTERM stop it (``StepGuard``, from here on: a stop that a callback swallows while the model
    loads or compiles still stops it at the first step).

    Raises:
      ValueError, SwarmError, CheckpointError: bad input, one line, before anything compiles.
      KeyboardInterrupt: stopped before training began.
    """
    with StepGuard() as guard:
        return _main(argv, guard)


def _main(argv: list[str] | None, guard: StepGuard) -> dict:
    set_memory_fraction(argv)  # before jax is imported
    args = parse_args(argv)
    import jax

    if args.devices > 1:
        try:  # CPU devices for --devices without accelerators; no effect on a GPU or TPU backend
            jax.config.update("jax_num_cpu_devices", args.devices)
        except RuntimeError:  # the backend is already up (a test calling main() in its process)
            pass
    import jax.numpy as jnp
    import numpy as np
    import optax

    import ravnest_jax as rj
    from finetune.tiny import text_documents
    from ravnest_jax.data import PackedTokens, eos_token_id, load_tokenizer, split_held_out, tokenize
    from ravnest_jax.models import (
        LoraConfig,
        TokenBatch,
        TransformerConfig,
        load_pretrained,
        save_peft_adapters,
        save_pretrained,
        split_lora,
    )

    # everything that can be wrong with the input is checked before anything compiles
    TransformerConfig.from_hf(args.checkpoint)  # ValueError naming the problem
    # the token, the listen port and the rendezvous, as rj.Swarm() below reads them: one line
    # (ValueError, SwarmError) in seconds, not a traceback once the model has loaded
    rj.swarm.preflight()
    tokenizer = load_tokenizer(args.checkpoint)
    lora = LoraConfig(
        rank=args.lora_rank,
        alpha=args.lora_alpha or 2.0 * args.lora_rank,
        dropout=args.lora_dropout,
        targets=tuple(args.lora_targets),
        train_a=not args.frozen_a,
        seed=args.seed,
    )
    rank, world = int(os.environ.get("RAVNEST_RANK", "0")), int(os.environ.get("RAVNEST_WORLD_SIZE", "1"))
    if args.data:  # records: masked, packed per document (TokenBatch fields)
        # with --stages one loader of every row: the clusters take turns through its batches
        data, eval_set = example_data(args, 0, 1) if args.stages > 1 else example_data(args, rank, world)
        to_batch = lambda b: TokenBatch(**b)  # noqa: E731
    else:
        tokens = tokenize(text_documents(args.text), tokenizer, eos_id=eos_token_id(args.checkpoint))
        train_tokens, held_out = split_held_out(tokens)
        data = PackedTokens(
            train_tokens, seq_len=args.seq_len, batch=args.batch_size, shard=rank, num_shards=world, seed=args.seed
        )
        evals = PackedTokens(held_out, seq_len=args.seq_len, batch=args.batch_size, seed=args.seed)
        eval_set = [evals.batch_at(i) for i in range(args.eval_batches)]
        to_batch = TokenBatch.from_windows

    shards = max(1, world // args.stages)  # --epochs: the smallest shard's rows (peers; with --stages clusters)
    total = data.stats["rows"] if args.data else (len(train_tokens) - 1) // args.seq_len
    if args.epochs is not None:
        args.max_steps = epoch_steps(args, total, shards)
    if args.dtype == "auto":
        args.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    mesh = peer_mesh(args.devices)
    remat = {"full": True, "none": False}.get(args.remat, args.remat)
    ckpt = None
    if args.checkpoint_dir and args.stages == 1:  # (a stage peer keeps its own, docs/pipeline.md)
        ckpt = open_checkpoints(args)
    if args.stages > 1:
        # the stage's tensors only: the split holds the model abstractly, the stage reads its slice
        split = rj.pipeline.pretrained_split(
            args.checkpoint, dtype=dtype, quantize=args.quantize, lora=lora, remat=remat, mesh=mesh
        )
        from finetune.stages import train_stages

        if args.data:  # one document a row, loss-masked: the pipeline's masked batches
            return train_stages(args, split, None, eval_set, records=data, cluster_rows=total / shards, lora=lora)
        return train_stages(args, split, train_tokens, np.stack(eval_set), cluster_rows=total / shards, lora=lora)
    # on a mesh: the frozen base and the adapters FSDP-style over the peer's devices
    lm = split_lora(
        load_pretrained(args.checkpoint, dtype=dtype, quantize=args.quantize, lora=lora, remat=remat, mesh=mesh)
    )
    frozen = lm.frozen
    tx = rj.diloco(
        optax.adamw(learning_rate(args), weight_decay=0.0), outer_optimizer(args), sync_every=args.sync_every
    )
    state = rj.models.init_opt_state(lm, tx)  # on a mesh laid out as the step keeps it
    knobs = dict(loss_chunk=args.loss_chunk, remat=remat, attention=args.attention)
    train_step = rj.models.make_train_step(
        lm, tx, micro_batches=args.micro_batches, donate=not args.no_donate, seed=args.seed + 1, **knobs
    )
    eval_loss = rj.models.make_eval_loss(lm, **knobs)
    put_batch = lambda b: b  # noqa: E731
    if mesh is not None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        split = NamedSharding(mesh, P("data"))
        put_batch = lambda b: jax.device_put(b, split)  # noqa: E731
    # the held-out batches stacked (n, batch, seq); on a mesh split along the batch axis
    eval_set = TokenBatch(*(np.stack(x) for x in zip(*(to_batch(w) for w in eval_set))))
    if mesh is not None:
        eval_set = jax.device_put(eval_set, NamedSharding(mesh, P(None, "data")))

    with (
        rj.Swarm() as swarm,
        rj.OuterSync(tx, swarm, overlap_steps=args.overlap_steps, samples_per_step=args.batch_size) as sync,
    ):
        # what the adapters' shapes do not show (alpha, dropout, a frozen A): saved, compared on resume
        mine = {"data": data.state(), "lora": lora_fingerprint(lora)}
        try:
            with guard.step():  # a restore cut by Ctrl+C floods orbax's threads with errors: held
                joined = rj.join_or_resume(swarm, sync, lm.adapters, state, checkpointer=ckpt, extra=mine)
            if joined.extra and "data" in joined.extra:
                data.load_state({k: int(v) for k, v in joined.extra["data"].items()})
            if joined.extra and "lora" in joined.extra and int(joined.extra["lora"]) != int(mine["lora"]):
                raise ValueError("lora settings differ from the checkpoint's (alpha, dropout, rank, targets, frozen A)")
        except ValueError as e:  # a checkpoint of other settings (LoRA, model, data): say what to do
            if ckpt is None or not str(e).startswith(("restore target", "data state has", "lora settings")):
                raise
            raise ValueError(f"{e} (--checkpoint-dir / checkpoint.dir {args.checkpoint_dir} {OTHER_SETTINGS})") from e
        adapters, state = joined.params, joined.state
        eval_start = float(eval_loss(state.global_params, frozen, eval_set))
        last_saved, loss, interrupted = joined.step, None, False
        try:
            while int(sync.step or joined.step) < args.max_steps:
                with guard.step():  # Ctrl+C waits for the step's end: no torn step, no batch skipped
                    step = int(sync.step or joined.step)
                    batch = put_batch(to_batch(data.next()))
                    adapters, state, metrics = train_step(adapters, state, frozen, batch, np.int32(step))
                    loss = metrics["loss"]  # read once at the end: no host round-trip per step
                    adapters, state = sync(adapters, state)  # counts; starts and merges rounds when due
                    if ckpt is not None and sync.step - last_saved >= args.checkpoint_every and not sync.pending:
                        extra = rj.checkpoint_extra(sync, adapters, {**mine, "data": data.state()})
                        ckpt.save(sync.step, params=adapters, opt_state=state, extra=extra)
                        last_saved = sync.step
        except KeyboardInterrupt:  # Ctrl+C: keep the last checkpoint, abandon a round in flight
            print(f"{swarm.peer_id}: interrupted at step {sync.step}", file=sys.stderr)
            interrupted = True
        if guard.torn:  # stopped inside a step (a second Ctrl+C, or a step past the grace)
            print(
                f"{swarm.peer_id}: the step in flight was cut: the last checkpoint (step {last_saved}) stands",
                file=sys.stderr,
            )
        if not interrupted:
            adapters, state = sync.flush(adapters, state)
        if (
            ckpt is not None
            and not guard.torn
            and sync.step is not None
            and sync.step > last_saved
            and not sync.pending
        ):
            extra = rj.checkpoint_extra(sync, adapters, {**mine, "data": data.state()})
            ckpt.save(sync.step, params=adapters, opt_state=state, extra=extra, force=True)
        summary = {
            "peer": swarm.peer_id,
            "how": joined.how,
            "interrupted": interrupted,
            "steps": int(sync.step or joined.step),
            "adapter_params": lm.num_adapter_params,
            "devices": args.devices,
            "train_loss": None if loss is None else float(loss),
            "eval_loss_start": eval_start,
            # none after a cut step: its state's buffers were donated to the step
            "eval_loss_end": None if guard.torn else float(eval_loss(state.global_params, frozen, eval_set)),
            "data_epochs": round(data.epoch, 4),
            "data_position": data.position,
            "round_payload_bytes": sorted({m.payload_bytes for m in sync.metrics if m.ok}),
            "round_digests": {str(m.swarm_round): m.state_digest for m in sync.metrics if m.ok},
            **sync.summary(),
        }
    if ckpt is not None:
        ckpt.close()
    if args.export and rank == 0 and not interrupted:
        out = save_pretrained(merged_model(args, lm, state.global_params, dtype, mesh), args.export)
        summary["merged_into"] = args.merge_into if args.quantize else "original"
        # the source's config (token ids, rope details) describes the merged model as well
        config = json.loads((Path(args.checkpoint) / "config.json").read_text())
        config["torch_dtype"] = json.loads((out / "config.json").read_text())["torch_dtype"]
        (out / "config.json").write_text(json.dumps(config, indent=2))
        # the tokenizer and what generate / transformers read beside it (chat template, BOS/EOS)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (Path(args.checkpoint) / name).is_file():
                shutil.copyfile(Path(args.checkpoint) / name, out / name)  # a new file's mode, not the source's
        summary["exported"] = str(out)
    if args.export_adapters and rank == 0 and not interrupted:
        out = save_peft_adapters(
            lm, state.global_params, args.export_adapters, base_model_name_or_path=str(Path(args.checkpoint).resolve())
        )
        summary["exported_adapters"] = str(out)
    print(json.dumps(summary), flush=True)
    return summary


def lora_fingerprint(lora):
    """CRC-32 of the LoRA settings that change what trained adapters mean (rank, alpha,
    dropout, targets, a frozen A; not the init seed), saved in each checkpoint's ``extra``."""
    import zlib

    import numpy as np

    text = f"{lora.rank}|{lora.alpha!r}|{lora.dropout!r}|{sorted(lora.targets)}|{lora.train_a}"
    return np.int64(zlib.crc32(text.encode()))


OTHER_SETTINGS = "was written with other settings: --fresh moves its checkpoints aside and starts over, or use another"


def open_checkpoints(args: argparse.Namespace):
    """This peer's :class:`rj.Checkpointer` of ``--checkpoint-dir``, opened before the model
    loads so that a directory with nothing left to train is one line, not a run of 0 steps.

    Raises:
      ValueError: its newest checkpoint is past ``--max-steps`` (one line: what to do).
    """
    import ravnest_jax as rj

    peer_dir = Path(args.checkpoint_dir) / os.environ.get("RAVNEST_PEER_ID", ".")
    ckpt = rj.Checkpointer(peer_dir, max_to_keep=3, fresh=args.fresh)
    newest = ckpt.latest_step()
    if newest is not None and newest > args.max_steps:
        ckpt.close()
        raise ValueError(
            f"--checkpoint-dir / checkpoint.dir {args.checkpoint_dir}: its newest checkpoint is step {newest}, "
            f"past the {args.max_steps} steps to train (--max-steps / optim.steps): raise them to go on, "
            "--fresh to start over, or use another directory"
        )
    if newest is not None and newest == args.max_steps:
        print(
            f"{peer_dir}: already trained to step {newest} (--max-steps / optim.steps): nothing to train",
            file=sys.stderr,
        )
    return ckpt


def quiet_interrupts(unraisable) -> None:
    """``sys.unraisablehook`` that drops a KeyboardInterrupt a callback swallowed (XLA's gc
    callback: Python prints it as "Exception ignored in ..."): the guard recorded it and stops."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


class StepGuard:
    """Holds Ctrl+C (SIGINT) and SIGTERM while a step is in flight, so that a stop never tears
    one: the adapters and optimizer state are donated to the jitted step (their old buffers
    are gone once it is dispatched) and the batch is taken from the loader before it, so a
    stop raised mid-step left a checkpoint that cannot be written or a data position one batch
    ahead of its step. A signal between steps stops at once; one inside :meth:`step` is raised
    when the step ends. A second signal, or a step that does not end within ``grace`` seconds
    (a round the merge waits for), stops at once: :attr:`torn` is then true and the step's
    state must not be saved (the last checkpoint stands).

    Outside the main thread (where Python runs signal handlers) it does nothing."""

    def __init__(self, grace: float = 10.0):
        self.grace, self.inside, self.requested, self.torn = grace, False, False, False
        self._old: dict = {}
        self._timer = None

    def __enter__(self) -> StepGuard:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._on_signal)
            self._old_hook = sys.unraisablehook
            sys.unraisablehook = quiet_interrupts
            # a stop the handler before this one saw (``ravnest-jax finetune``'s, while jax
            # imported), swallowed since by a callback: it still stops the peer, now
            if any(getattr(old, "stop_requested", False) for old in self._old.values()):
                self.__exit__()
                raise KeyboardInterrupt
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self._timer is not None:
            self._timer.cancel()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._old:
            sys.unraisablehook = self._old_hook

    def _on_signal(self, signum, frame) -> None:
        import signal
        import threading

        if self.inside and not self.requested:
            self.requested = True  # raised when the step ends
            # past the grace, a signal to the main thread itself: it wakes a wait there (EINTR)
            main = threading.main_thread().ident
            self._timer = threading.Timer(self.grace, signal.pthread_kill, (main, signal.SIGINT))
            self._timer.daemon = True
            self._timer.start()
            return
        self.torn, self.requested = self.inside, True
        raise KeyboardInterrupt

    def step(self):
        """The context of one step: a stop requested inside it raises KeyboardInterrupt at its end."""
        import contextlib

        @contextlib.contextmanager
        def held():
            if self.requested:  # a stop raised earlier and swallowed (an XLA gc callback ignores it)
                raise KeyboardInterrupt
            self.inside = True
            try:
                yield
            finally:
                self.inside = False
            if self.requested:
                if self._timer is not None:
                    self._timer.cancel()
                raise KeyboardInterrupt

        return held()


def epoch_steps(args: argparse.Namespace, rows: int, shards: int) -> int:
    """``--epochs`` as steps, ``ceil(epochs x (rows // shards) / --batch-size)``, for ``rows`` rows
    (documents, packed rows, text windows) over ``shards`` (the peers; with ``--stages`` the
    clusters): the smallest shard's, so every peer runs as many. ValueError: warm-up too long."""
    import math

    steps = max(1, math.ceil(args.epochs * (rows // shards) / args.batch_size - 1e-9))
    if args.warmup_steps >= steps:
        raise ValueError(
            f"--warmup-steps (optim.warmup) {args.warmup_steps} must be below the {steps} steps of --epochs "
            f"(optim.epochs) {args.epochs:g} ({rows // shards} rows a shard, {args.batch_size} a step)"
        )
    return steps


def merged_model(args: argparse.Namespace, lm, adapters, dtype, mesh=None):
    """What ``--export`` writes: ``adapters`` folded into the checkpoint's original float weights
    (``--merge-into original``, read again from ``--checkpoint`` in ``dtype``, laid out on the
    peer's ``mesh``; PEFT's ``merge_and_unload`` on the float model) or into the base the run
    trained against (``lm.merged``: with ``--quantize`` the dequantised quantised kernels).
    Without ``--quantize`` the two are the same weights: the model's own are used."""
    from ravnest_jax.models import load_pretrained

    if args.quantize is None or args.merge_into == "dequantized":
        return lm.merged(adapters)
    return lm.merged(adapters, base=load_pretrained(args.checkpoint, dtype=dtype, mesh=mesh, scan_layers=False))


def outer_optimizer(args: argparse.Namespace):
    """The outer step: Nesterov SGD at ``--outer-lr`` with ``--outer-momentum``
    (``rj.optim.default_outer``; momentum 0 is plain SGD, and with lr 1 plain averaging)."""
    import ravnest_jax as rj

    return rj.optim.default_outer(args.outer_lr, args.outer_momentum)


def learning_rate(args: argparse.Namespace):
    """The inner lr: ``--lr`` as a float (constant, no warm-up) or an optax schedule of the step
    (``--warmup-steps`` linear from 0, then ``--lr-schedule`` over the rest of ``--max-steps``)."""
    import optax

    if args.lr_schedule == "constant" and args.warmup_steps == 0:
        return args.lr
    rest = max(1, args.max_steps - args.warmup_steps)
    after = {
        "constant": optax.constant_schedule(args.lr),
        "cosine": optax.cosine_decay_schedule(args.lr, rest),
        "linear": optax.linear_schedule(args.lr, 0.0, rest),
    }[args.lr_schedule]
    if args.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(0.0, args.lr, args.warmup_steps)
    return optax.join_schedules([warm, after], [args.warmup_steps])


def example_data(args: argparse.Namespace, rank: int, world: int):
    """``--data``: the records tokenised (``rj.data.load_examples``: chat template, masks), a
    seeded held-out share of at least one batch of documents, the rest packed
    (``rj.data.PackedExamples``, shard ``rank`` of ``world``). Returns ``(data, eval_batches)``:
    the loader and up to ``--eval-batches`` held-out batches (dicts of ``(batch, seq_len)``
    arrays, one document a row).

    Raises:
      ValueError: a malformed record, too few documents for a held-out batch, a shard with
        fewer rows than one batch.
    """
    from ravnest_jax.data import PackedExamples, load_examples, load_tokenizer, load_tokenizer_config, split_examples

    examples = load_examples(args.data, args.checkpoint, format=args.data_format, train_on_prompt=args.train_on_prompt)
    if len(examples) < 2 * args.batch_size:
        raise ValueError(
            f"--data: {len(examples)} documents; at least 2 x --batch-size ({2 * args.batch_size}) are needed "
            "(one batch of them is held out for the eval loss)"
        )
    fraction = min(0.5, max(0.05, (args.batch_size + 0.5) / len(examples)))
    train, held = split_examples(examples, fraction, seed=args.seed)
    pad = load_tokenizer_config(args.checkpoint).pad_token
    pad_id = load_tokenizer(args.checkpoint).token_to_id(pad) if pad is not None else None
    kw = dict(seq_len=args.seq_len, batch=args.batch_size, overlong=args.overlong, seed=args.seed, pad_id=pad_id or 0)
    data = PackedExamples(train, packing=not args.no_packing, shard=rank, num_shards=world, **kw)
    why = {"no_loss": "have no completion / assistant token", "dropped_overlong": "are longer than --seq-len"}
    skipped = [f"{data.stats[k]} {text}" for k, text in why.items() if data.stats[k]]
    if skipped and rank == 0:  # records that teach nothing: say so, once
        print(
            f"--data: of {data.stats['examples']} training documents {' and '.join(skipped)} "
            "(skipped: nothing to learn from them)",
            file=sys.stderr,
        )
    evals = PackedExamples(held, packing=False, **kw)
    n = min(args.eval_batches, max(1, len(evals.rows) // args.batch_size))
    return data, [evals.batch_at(i) for i in range(n)]


if __name__ == "__main__":
    set_memory_fraction()  # before anything imports jax
    import ravnest_jax as rj

    rj.enable_compilation_cache()  # a restarted peer loads its compiled steps (RAVNEST_COMPILE_CACHE=0: off)
    try:
        main()
    except (ValueError, rj.swarm.SwarmError, rj.checkpoint.CheckpointError) as e:  # bad input: one line
        sys.exit(f"error: {e}")
