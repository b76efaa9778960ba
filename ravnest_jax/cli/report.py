"""Write PNGs of a run next to its summary JSON (the main job's --summary-json: a local swarm's,
or one peer's with --rendezvous): loss per round, utilisation and stall seconds per peer, bytes
per round against data-parallel training."""

from __future__ import annotations

import argparse

from ._args import errors

NAME = "report"
HELP = "plot a run's summary JSON (loss, utilisation and stalls, bytes) as PNGs"


def run(args: argparse.Namespace) -> int:
    """Writes the PNGs and prints their paths; exit status 2 with one error line on a bad summary."""
    from ravnest_jax.tools import write_report

    with errors(ImportError, prefix="ravnest-jax report needs matplotlib (pip install matplotlib): "), errors():
        paths = write_report(args.summary, out_dir=args.out_dir)
    for p in paths:
        print(p)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax report``."""
    p.add_argument(
        "summary", help="the summary JSON of examples/char_lm/main.py --summary-json (a local swarm, or one peer)"
    )
    p.add_argument("--out-dir", default=None, help="where to write the PNGs (default: next to the summary)")
