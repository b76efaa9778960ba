"""The ``assemble-adapters`` and ``merge-adapters`` commands of ``ravnest-jax`` (registered by
``ravnest_jax.cli``): a pipeline run's PEFT adapters joined from the parts its stage peers wrote on
several machines, and adapters merged into a checkpoint's float weights shard by shard
(docs/finetuning.md, "Export"; docs/pipeline.md, "Exporting a pipeline's adapters")."""

from __future__ import annotations

import argparse
import sys


def _cmd_assemble(args: argparse.Namespace) -> int:
    from ravnest_jax.models._peft_parts import assemble_peft_parts

    try:
        out = assemble_peft_parts(args.parts, args.out, remove_parts=False)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'adapter_config.json'} and {out / 'adapter_model.safetensors'}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from ravnest_jax.models._merge_files import merge_adapters_into_files

    try:
        out = merge_adapters_into_files(args.model, args.adapters, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the merged checkpoint to {out}")
    return 0


def add_adapters(sub: argparse._SubParsersAction) -> None:
    """Registers ``assemble-adapters`` and ``merge-adapters``."""
    a = sub.add_parser(
        "assemble-adapters",
        help="join the adapter parts of a pipeline run's stages into PEFT's adapter_model.safetensors",
        description="Join the parts that the stage peers of a pipeline run wrote "
        "(adapter_model.stage-<k>-of-<S>.safetensors, one a stage: --export-adapters / export.adapters) into "
        "PEFT's adapter_config.json and adapter_model.safetensors. Peers on one machine assemble them "
        "themselves; this is for parts written on several machines and copied to one.",
    )
    a.add_argument("out", help="the directory to write (new or without an assembled export)")
    a.add_argument("parts", nargs="+", help="part files, or directories holding them")
    a.set_defaults(func=_cmd_assemble)
    m = sub.add_parser(
        "merge-adapters",
        help="fold PEFT LoRA adapters into a checkpoint's float weights, one shard at a time",
        description="Write --model with the PEFT LoRA --adapters folded into its weights (W + alpha / r * B @ A, "
        "in float32, stored in W's dtype) to --out, one safetensors shard in memory at a time, on the CPU: "
        "what PEFT's merge_and_unload gives on the float model, for models larger than one machine's memory.",
    )
    m.add_argument("--model", required=True, help="the base checkpoint directory (Hugging Face safetensors)")
    m.add_argument("--adapters", required=True, help="the PEFT adapter directory")
    m.add_argument("--out", required=True, help="the directory to write (new or empty)")
    m.set_defaults(func=_cmd_merge)
