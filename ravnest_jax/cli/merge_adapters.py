"""Write --model with the PEFT LoRA --adapters folded into its weights (W + alpha / r * B @ A, in
float32, stored in W's dtype) to --out, one safetensors shard in memory at a time, on the CPU:
what PEFT's merge_and_unload gives on the float model, for models larger than one machine's
memory."""

from __future__ import annotations

import argparse

from ._args import errors

NAME = "merge-adapters"
HELP = "fold PEFT LoRA adapters into a checkpoint's float weights, one shard at a time"


def run(args: argparse.Namespace) -> int:
    """Writes the merged checkpoint; exit status 2 with one error line on bad inputs."""
    from ravnest_jax.models import merge_adapters_into_files

    with errors():
        out = merge_adapters_into_files(args.model, args.adapters, args.out)
    print(f"wrote the merged checkpoint to {out}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax merge-adapters``."""
    p.add_argument("--model", required=True, help="the base checkpoint directory (Hugging Face safetensors)")
    p.add_argument("--adapters", required=True, help="the PEFT adapter directory")
    p.add_argument("--out", required=True, help="the directory to write (new or empty)")
