"""The ``finetune`` command of ``ravnest-jax`` (registered by ``ravnest_jax.cli``): a recipe
(``ravnest_jax/recipe.py``) run as one peer of ``examples/finetune/train.py``; alone, under
``ravnest-jax local``, or at a real rendezvous (docs/finetuning.md, "The recipe command")."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ravnest_jax.tools._argtypes import checked as _checked
from ravnest_jax.tools._argtypes import positive_int as _positive_int


def _non_negative_int(value: str) -> int:
    return _checked(value, int, lambda v: v >= 0, "an integer >= 0")


def _data_shard(args: argparse.Namespace) -> str | None:
    """Sets ``RAVNEST_RANK`` / ``RAVNEST_WORLD_SIZE`` (the data shard train.py reads) from
    ``--rank`` / ``--world-size``; at a ``--rendezvous`` they are required (without them every
    peer would read the same rows). Returns the problem in one line, or None."""
    if (args.rank is None) != (args.world_size is None):
        return "--rank and --world-size go together (this peer's data shard: peer R of N)"
    if args.rank is not None:
        if args.rank >= args.world_size:
            return f"--rank {args.rank} must be below --world-size {args.world_size}"
        os.environ["RAVNEST_RANK"], os.environ["RAVNEST_WORLD_SIZE"] = str(args.rank), str(args.world_size)
    elif args.rendezvous and not os.environ.get("RAVNEST_WORLD_SIZE"):
        return (
            "--rendezvous needs --rank R --world-size N: this peer's data shard (peer R of N reads every "
            "N-th row; give each peer its own R), else every peer trains on the same rows"
        )
    return None


def _cmd_finetune(args: argparse.Namespace) -> int:
    import json

    from ravnest_jax.recipe import load_recipe, recipe_dict, run, train_argv  # no jax import

    try:
        recipe = load_recipe(args.recipe, args.set or [], check_files=not args.no_file_check)
    except ValueError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    if args.check:
        print(json.dumps({"recipe": recipe_dict(recipe), "train_argv": train_argv(recipe)}, indent=1))
        return 0
    # a real swarm: the same variables the launcher sets (rj.Swarm() reads them)
    for flag, env in (
        ("rendezvous", "RAVNEST_RENDEZVOUS"),
        ("run_id", "RAVNEST_RUN_ID"),
        ("token_file", "RAVNEST_TOKEN_FILE"),
        ("peer_id", "RAVNEST_PEER_ID"),
        ("listen", "RAVNEST_LISTEN"),
    ):
        if getattr(args, flag):
            os.environ[env] = str(getattr(args, flag))
    if args.rendezvous and not (os.environ.get("RAVNEST_TOKEN") or os.environ.get("RAVNEST_TOKEN_FILE")):
        print("error: --rendezvous needs --token-file FILE (or $RAVNEST_TOKEN)", file=sys.stderr)
        return 2
    problem = _data_shard(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not os.environ.get("RAVNEST_RENDEZVOUS"):  # alone: a swarm of one, as `local --peers 1` makes it
        from ravnest_jax.launch import run_local

        sets = [a for item in args.set or [] for a in ("--set", item)] + (["--fresh"] if args.fresh else [])
        command = [sys.executable, "-m", "ravnest_jax.cli", "finetune", str(Path(args.recipe).resolve()), *sets]
        return run_local(command, peers=1, codec=recipe.outer.codec, progress=False)
    from ravnest_jax.checkpoint._util import CheckpointError  # no orbax import

    try:
        run(recipe, fresh=args.fresh)
    except ValueError as e:  # bad data or checkpoint: one line, before anything compiled
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # no readable checkpoint, or only corrupt ones (the fix: --fresh)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def add_finetune(sub) -> None:
    """Registers ``finetune`` on the ``ravnest-jax`` subparsers ``sub``."""
    ft = sub.add_parser(
        "finetune",
        help="LoRA / QLoRA fine-tuning from a YAML recipe (one peer; under `local` a swarm)",
        description="Runs a fine-tuning recipe as one peer (docs/finetuning.md, 'The recipe command'). "
        "ravnest-jax local --peers N -- ravnest-jax finetune RECIPE runs N peers on this machine; "
        "--rendezvous URL joins a real swarm. The recipe is checked in full before anything loads "
        "(one line per problem, exit status 2).",
    )
    ft.add_argument("recipe", help="the recipe YAML file (its paths are relative to it)")
    ft.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one key (the value is YAML: optim.steps=10, lora.targets=[q,v]); repeatable",
    )
    ft.add_argument(
        "--fresh",
        action="store_true",
        help="start from step 0: the earlier checkpoints of checkpoint.dir are moved to DIR/previous-TIME/ "
        "(needed when every checkpoint there is unreadable)",
    )
    ft.add_argument("--check", action="store_true", help="check the recipe, print it and train.py's options; no run")
    ft.add_argument(
        "--no-file-check", action="store_true", help="with --check: do not require the recipe's files to exist"
    )
    ft.add_argument("--rendezvous", default=None, metavar="URL", help="join this swarm's rendezvous")
    ft.add_argument("--run-id", default=None, help="the run id at the rendezvous")
    ft.add_argument("--token-file", default=None, help="file holding the run token (else $RAVNEST_TOKEN)")
    ft.add_argument("--peer-id", default=None, help="this peer's name (default: generated)")
    ft.add_argument("--listen", default=None, metavar="HOST:PORT", help="where this peer listens for the others")
    ft.add_argument(
        "--rank",
        type=_non_negative_int,
        default=None,
        help="with --rendezvous: this peer's data shard, 0 .. WORLD_SIZE - 1 (peer R of N reads every N-th row)",
    )
    ft.add_argument(
        "--world-size", type=_positive_int, default=None, help="with --rendezvous: the number of data shards (peers)"
    )
    ft.set_defaults(func=_cmd_finetune)
