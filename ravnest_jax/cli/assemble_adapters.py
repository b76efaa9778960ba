"""Join the parts that the stage peers of a pipeline run wrote
(adapter_model.stage-<k>-of-<S>.safetensors, one a stage: --export-adapters / export.adapters)
into PEFT's adapter_config.json and adapter_model.safetensors. Peers on one machine assemble
them themselves; this is for parts written on several machines and copied to one."""

from __future__ import annotations

import argparse

from ._args import errors

NAME = "assemble-adapters"
HELP = "join the adapter parts of a pipeline run's stages into PEFT's adapter_model.safetensors"


def run(args: argparse.Namespace) -> int:
    """Writes the PEFT adapters; exit status 2 with one error line on bad parts."""
    from ravnest_jax.models import assemble_peft_parts

    with errors():
        out = assemble_peft_parts(args.parts, args.out, remove_parts=False)
    print(f"wrote {out / 'adapter_config.json'} and {out / 'adapter_model.safetensors'}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax assemble-adapters``."""
    p.add_argument("out", help="the directory to write (new or without an assembled export)")
    p.add_argument("parts", nargs="+", help="part files, or directories holding them")
