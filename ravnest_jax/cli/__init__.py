"""Command line: ``ravnest-jax <command>``. Commands: ``rendezvous``, ``status``, ``local``,
``plan-memory``, ``generate``, ``plan``, ``report``, ``finetune``, ``assemble-adapters``,
``merge-adapters``.

One module of this package a command (``plan-memory`` in ``plan_memory``, ...), each with
``NAME``, ``HELP`` (the line of ``ravnest-jax --help``), its description in ``--help`` as its
module docstring, ``add_arguments(parser)`` and ``run(args)``; :func:`build_parser` registers the
modules of :data:`COMMANDS`. What they share (argument types, options, the run token, the one-line
``error:``) is in ``_args``. The commands' logic lives in the lower layers (``tools``, ``models``,
``recipe``, ``launch``, ``swarm``): the modules here parse, call and print.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import (
    assemble_adapters,
    finetune,
    generate,
    local,
    merge_adapters,
    plan,
    plan_memory,
    rendezvous,
    report,
    status,
)
from ._args import CommandError

#: the command modules, in the order ``ravnest-jax --help`` lists their commands
COMMANDS = (rendezvous, status, local, plan_memory, generate, plan, report, finetune, assemble_adapters, merge_adapters)


def build_parser() -> argparse.ArgumentParser:
    """The ``ravnest-jax`` parser, with the subparser of every command of :data:`COMMANDS`: its
    ``NAME``, its ``HELP``, its module docstring as the description (``USAGE`` and ``FORMATTER``
    where it sets them), ``add_arguments(parser)`` and ``run(args)``."""
    p = argparse.ArgumentParser(prog="ravnest-jax", description="ravnest_jax: decentralized DiLoCo training.")
    sub = p.add_subparsers(dest="command_name", required=True, metavar="COMMAND")
    for command in COMMANDS:
        parser = sub.add_parser(
            command.NAME,
            help=command.HELP,
            description=command.__doc__,
            usage=getattr(command, "USAGE", None),
            formatter_class=getattr(command, "FORMATTER", argparse.HelpFormatter),
        )
        command.add_arguments(parser)
        parser.set_defaults(func=command.run)
    p.command_parsers = sub.choices  # type: ignore[attr-defined]  # main(): a typo is told by its command
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ravnest-jax``. Returns the process exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's usage and its name, not the top level's (``ravnest-jax [-h] COMMAND``)
        parser.command_parsers[args.command_name].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        try:
            status = int(args.func(args) or 0)
        except CommandError as e:  # the command's one-line failure
            print(f"error: {e}", file=sys.stderr)
            status = e.status
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return status
    except BrokenPipeError:  # stdout closed early (``... | head``): stop quietly, as ``cat`` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141


__all__ = ["COMMANDS", "build_parser", "main"]
