"""Runs a fine-tuning recipe as one peer (docs/finetuning.md, 'The recipe command'). ravnest-jax
local --peers N -- ravnest-jax finetune RECIPE runs N peers on this machine; --rendezvous URL
joins a real swarm. The recipe is checked in full before anything loads (one line per problem,
exit status 2)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from ._args import add_token_file, errors, fail, non_negative_int, positive_int

NAME = "finetune"
HELP = "LoRA / QLoRA fine-tuning from a YAML recipe (one peer; under `local` a swarm)"

#: the flags that join a real swarm, and the variables the launcher sets for them (rj.Swarm() reads them)
_SWARM_ENV = (
    ("rendezvous", "RAVNEST_RENDEZVOUS"),
    ("run_id", "RAVNEST_RUN_ID"),
    ("token_file", "RAVNEST_TOKEN_FILE"),
    ("peer_id", "RAVNEST_PEER_ID"),
    ("listen", "RAVNEST_LISTEN"),
)


def _data_shard(rank: int | None, world_size: int | None, rendezvous: str | None) -> str | None:
    """Sets ``RAVNEST_RANK`` / ``RAVNEST_WORLD_SIZE`` (the data shard train.py reads) from
    ``--rank`` / ``--world-size``; at a ``--rendezvous`` they are required (without them every
    peer would read the same rows). Returns the problem in one line, or None."""
    if (rank is None) != (world_size is None):
        return "--rank and --world-size go together (this peer's data shard: peer R of N)"
    if rank is not None:
        if rank >= world_size:
            return f"--rank {rank} must be below --world-size {world_size}"
        os.environ["RAVNEST_RANK"], os.environ["RAVNEST_WORLD_SIZE"] = str(rank), str(world_size)
    elif rendezvous and not os.environ.get("RAVNEST_WORLD_SIZE"):
        return (
            "--rendezvous needs --rank R --world-size N: this peer's data shard (peer R of N reads every "
            "N-th row; give each peer its own R), else every peer trains on the same rows"
        )
    return None


def run(args: argparse.Namespace) -> int:
    """Checks the recipe (``--check``: prints it) and trains; exit status 2 with one line per
    problem, 1 without a readable checkpoint, 130 on Ctrl+C."""
    import json

    from ravnest_jax.recipe import load_recipe, recipe_dict, train_argv  # no jax import
    from ravnest_jax.recipe import run as run_recipe

    try:
        recipe = load_recipe(args.recipe, args.set or [], check_files=not args.no_file_check)
    except ValueError as e:
        for line in str(e).splitlines():
            fail(line)
        return 2
    if args.check:
        out = {"recipe": recipe_dict(recipe), "train_argv": train_argv(recipe)}
        if not args.no_file_check:  # every record read and checked (no jax, no tokenizer): file:line
            from ravnest_jax.data import scan

            try:
                out["data"] = scan(list(recipe.data.files), format=recipe.data.format)
            except ValueError as e:
                return fail(str(e))
        print(json.dumps(out, indent=1))
        return 0
    for flag, env in _SWARM_ENV:
        if getattr(args, flag):
            os.environ[env] = str(getattr(args, flag))
    if args.rendezvous and not (os.environ.get("RAVNEST_TOKEN") or os.environ.get("RAVNEST_TOKEN_FILE")):
        return fail("--rendezvous needs --token-file FILE (or $RAVNEST_TOKEN)")
    problem = _data_shard(args.rank, args.world_size, args.rendezvous)
    if problem:
        return fail(problem)
    if not os.environ.get("RAVNEST_RENDEZVOUS"):  # alone: a swarm of one, as `local --peers 1` makes it
        from ravnest_jax.launch import run_local

        sets = [a for item in args.set or [] for a in ("--set", item)] + (["--fresh"] if args.fresh else [])
        command = [sys.executable, "-m", "ravnest_jax.cli", "finetune", str(Path(args.recipe).resolve()), *sets]
        return run_local(command, peers=1, codec=recipe.outer.codec, progress=False)
    try:  # Ctrl+C from the first import on: exit status 130, no traceback
        with _RecordingStop.installed():
            from ravnest_jax.checkpoint import CheckpointError
            from ravnest_jax.swarm import SwarmError

            # ValueError: bad data or checkpoint, one line, before anything compiled; CheckpointError:
            # no readable checkpoint, or only corrupt ones (the fix: --fresh); TimeoutError: fewer
            # peers than the run's came (RAVNEST_WORLD_SIZE), one line
            with errors(ValueError, SwarmError, TimeoutError), errors(CheckpointError, status=1):
                run_recipe(recipe, fresh=args.fresh)
    except KeyboardInterrupt:
        return 130
    return 0


class _RecordingStop:
    """SIGINT and SIGTERM of a peer until train.py's ``StepGuard`` takes over: KeyboardInterrupt,
    and ``stop_requested`` set, which the guard reads from the handler it replaces: a stop that a
    callback swallows while jax imports (its gc callback ignores exceptions) still stops the peer
    instead of leaving it to train until the launcher kills it."""

    stop_requested = False

    def __call__(self, signum, frame) -> None:
        self.stop_requested = True
        raise KeyboardInterrupt

    @classmethod
    @contextlib.contextmanager
    def installed(cls) -> Iterator[None]:
        """Installed for the block (main thread only), with "Exception ignored" lines of a
        swallowed KeyboardInterrupt dropped; the handlers and the hook before are restored."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handler, prior_hook = cls(), sys.unraisablehook
        prior = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

        def quiet(unraisable) -> None:  # recorded above: not "Exception ignored in ..." lines
            if not isinstance(unraisable.exc_value, KeyboardInterrupt):
                prior_hook(unraisable)

        sys.unraisablehook = quiet
        try:
            yield
        finally:
            for sig, old in prior.items():
                signal.signal(sig, old)
            sys.unraisablehook = prior_hook


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax finetune``."""
    p.add_argument("recipe", help="the recipe YAML file (its paths are relative to it)")
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one key (the value is YAML: optim.steps=10, lora.targets=[q,v]); repeatable",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start from step 0: the earlier checkpoints of checkpoint.dir are moved to DIR/previous-TIME/ "
        "(needed when every checkpoint there is unreadable)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the recipe and every data record, print it and train.py's options; no run",
    )
    p.add_argument(
        "--no-file-check", action="store_true", help="with --check: do not require the recipe's files to exist"
    )
    p.add_argument("--rendezvous", default=None, metavar="URL", help="join this swarm's rendezvous")
    p.add_argument("--run-id", default=None, help="the run id at the rendezvous")
    add_token_file(p)
    p.add_argument("--peer-id", default=None, help="this peer's name (default: generated)")
    p.add_argument("--listen", default=None, metavar="HOST:PORT", help="where this peer listens for the others")
    p.add_argument(
        "--rank",
        type=non_negative_int,
        default=None,
        help="with --rendezvous: this peer's data shard, 0 .. WORLD_SIZE - 1 (peer R of N reads every N-th row)",
    )
    p.add_argument(
        "--world-size", type=positive_int, default=None, help="with --rendezvous: the number of data shards (peers)"
    )
