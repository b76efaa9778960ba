#!/usr/bin/env python3
"""Byte-level transformer language model trained with DiLoCo on real text.

Three ways to run it:

- ``--local-peers N``: a local swarm. Starts a rendezvous and N peer processes on 127.0.0.1
  that train together with overlapped, int4-compressed outer rounds (``rj.Swarm`` +
  ``rj.OuterSync``), shows progress, and ends with a summary: eval loss of the global params,
  rounds, bytes each peer sent next to what data-parallel training would have sent,
  compute utilisation, stalls. Ctrl+C stops all of it.
- ``--rendezvous URL --run-id ID --token-file F``: one peer, for separate machines.
- with either: ``--devices N [--layout replicated|fsdp]``: each peer trains over N local devices
  (the batch split over them, params replicated or split FSDP-style); without accelerators N CPU
  devices are made (docs/multi-device.md).
- neither (``--simulate``): the replica simulation: N DiLoCo replicas in one process
  (``jax.vmap`` over a replica axis, each replica with its own data shard), for H in
  ``--sync-every-list``, against synchronous data-parallel training with the same inner
  optimizer and the same tokens seen. Prints the eval loss (nats per byte) of each.

Text: the ``.py`` files of the running interpreter's standard library (every machine has them),
split by file into train and eval, or any text file given with ``--text`` (last 10% is eval).

    python examples/char_lm/main.py --local-peers 4       # a local swarm of 4 peer processes
    python examples/char_lm/main.py --local-peers 2 --devices 2 --layout fsdp   # 2 peers x 2 devices
    python examples/char_lm/main.py --simulate            # 4 replicas, H in {1, 10, 50} vs data-parallel
    python examples/char_lm/main.py --rendezvous http://host:8765 --run-id exp1 --token-file token

The package: ``data.py`` (text, batches) and ``model.py`` (the transformer, loss, optimizer),
which the benchmarks import; ``simulate.py`` (the replica simulation); ``peer.py`` and
``local.py`` (one peer and the local swarm of this job); ``train.py`` is the same peer as plain
user code, about a hundred lines, for ``ravnest-jax local -- python examples/char_lm/train.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the char_lm package is next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from char_lm.local import print_peer_table, run_local_swarm  # noqa: E402
from char_lm.peer import _LOOP, _STOPPED_BY, _emit, _stop, run_peer, warnings_as_log_lines  # noqa: E402
from char_lm.report import json_safe, machine_info, run_config  # noqa: E402
from char_lm.simulate import run_simulation  # noqa: E402


def _int_at_least(value: str, low: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    return n


def _overlap(value: str) -> int | str:
    return value if value == "auto" else _int_at_least(value, 0, "an integer >= 0 or 'auto'")


def _positive_int(value: str) -> int:
    return _int_at_least(value, 1, "a positive integer")


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return x


def _unit_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value!r}") from None
    if not 0.0 <= x < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value!r}")
    return x


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: not appended where the help text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    g = p.add_argument_group("mode")
    g.add_argument("--local-peers", type=_positive_int, default=None, help="run a local swarm of N peer processes")
    # under `ravnest-jax local -- python examples/char_lm/main.py` the launcher's RAVNEST_* variables
    # are the defaults: each process is one peer of the launcher's swarm
    env = os.environ.get
    g.add_argument(
        "--rendezvous",
        default=env("RAVNEST_RENDEZVOUS"),
        help="rendezvous URL: run one peer of a swarm ($RAVNEST_RENDEZVOUS)",
    )
    g.add_argument("--simulate", action="store_true", help="the replica simulation (the default without the two above)")
    p.add_argument("--text", default=None, help="text file to train on (default: the stdlib's .py files)")
    p.add_argument("--replicas", type=_positive_int, default=4, help="DiLoCo replicas N")
    p.add_argument("--sync-every-list", type=_positive_int, nargs="+", default=[1, 10, 50], help="H values to compare")
    p.add_argument("--steps", type=_positive_int, default=300, help="inner steps per run")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per replica per step")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="bytes per sequence")
    p.add_argument("--d-model", type=_positive_int, default=96, help="width of the transformer (a multiple of --heads)")
    p.add_argument("--layers", type=_positive_int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=_positive_int, default=4, help="attention heads per block")
    p.add_argument("--lr", type=_positive_float, default=3e-3, help="peak inner learning rate")
    p.add_argument(
        "--inner",
        choices=["adamw", "muon"],
        default="adamw",
        help="inner optimizer: AdamW, or Muon on the blocks' matrices (AdamW 3e-3 on the rest; try --lr 0.02)",
    )
    p.add_argument(
        "--outer-lr", type=_positive_float, default=None, help="outer learning rate (default: rj.default_outer's)"
    )
    p.add_argument(
        "--outer-momentum",
        type=_unit_float,
        default=None,
        help="outer Nesterov momentum in [0, 1); 0 is plain SGD (default: rj.default_outer's)",
    )
    p.add_argument("--eval-batches", type=_positive_int, default=8, help="eval batches of 32 sequences")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial params (the same on every peer)")
    p.add_argument(
        "--summary-json",
        default=None,
        help="write the figures to this JSON file (with --local-peers, default runs/RUN_ID/summary.json, "
        "and its plots next to it)",
    )
    s = p.add_argument_group("swarm (--local-peers / --rendezvous)")
    s.add_argument("--run-id", default=env("RAVNEST_RUN_ID", "char-lm"), help="run id of the swarm ($RAVNEST_RUN_ID)")
    s.add_argument("--token-file", default=None, help="file with the run token (else $RAVNEST_TOKEN)")
    s.add_argument("--max-steps", type=_positive_int, default=600, help="inner steps of each peer")
    s.add_argument("--sync-every", type=_positive_int, default=50, help="H, inner steps per outer round")
    p.add_argument(
        "--codec",
        default=env("RAVNEST_CODEC"),
        help="pseudo-gradient codec (default: $RAVNEST_CODEC, else int4 in a swarm, none in the simulation)",
    )
    s.add_argument(
        "--topk-fraction",
        type=_positive_float,
        default=None,
        help="with --codec topk: the fraction of each part's values sent (default 0.01)",
    )
    s.add_argument(
        "--block-size",
        type=_positive_int,
        default=None,
        help="with a block codec (int8, int4, fp4, int2, sign): elements per block (default: the codec's)",
    )
    s.add_argument(
        "--mean-codec",
        default=None,
        help="the codec of the mean the part owners send back, if not --codec: a block codec of the same "
        "block size (--codec sign --mean-codec int2: 1 bit up, 2 down; rj.Codec(mean=))",
    )
    s.add_argument(
        "--mean-ef",
        choices=["on", "off"],
        default="off",
        help="the part owners' error feedback on the mean they send (rj.Codec(mean_ef=))",
    )
    s.add_argument(
        "--ef-decay",
        type=float,
        default=1.0,
        help="error-feedback decay beta in [0, 1] (0.95 with topk and --outer-momentum 0: SparseLoCo)",
    )
    s.add_argument(
        "--overlap-steps",
        type=_overlap,
        default="auto",
        help="tau: inner steps a round's exchange overlaps (0: blocking; 'auto': enough steps to "
        "cover the measured exchange time, per round)",
    )
    s.add_argument(
        "--staleness-budget",
        type=_positive_float,
        default=0.01,
        help="with --overlap-steps auto: the eval-loss cost (fraction) tau may spend on staleness; caps tau at "
        "about 0.116 * H per 1%% (docs/overlap.md)",
    )
    s.add_argument("--mode", choices=["delayed", "eager", "blocking"], default="delayed", help="outer-sync mode")
    s.add_argument(
        "--aggregator",
        choices=["mean", "clipped_mean"],
        default=None,
        help="how a round combines the peers' pseudo-gradients (default clipped_mean: it bounds what one "
        "faulty peer can do, and equals the plain mean when no peer is far off; docs/swarm.md)",
    )
    s.add_argument(
        "--clip-multiple",
        type=float,
        default=2.0,
        help="clipped_mean: bound a contribution's norm at this many times the round's median norm",
    )
    s.add_argument(
        "--adversary",
        default=None,
        help="testing an aggregator: this peer sends its pseudo-gradient times F ('scale:F') or Gaussian noise "
        "of the same norm ('noise'); with --local-peers, the first --adversary-peers peers do",
    )
    s.add_argument(
        "--adversary-peers", type=_positive_int, default=1, help="with --local-peers and --adversary: how many"
    )
    s.add_argument("--alpha", type=float, default=0.0, help="mixing weight of local params at a late merge")
    s.add_argument("--fragments", type=_positive_int, default=1, help="streaming fragments F")
    s.add_argument(
        "--part-timeout", type=_positive_float, default=30.0, help="deadline of each phase of a round, seconds"
    )
    s.add_argument(
        "--listen",
        default=env("RAVNEST_LISTEN", "0.0.0.0:0"),
        help="host:port this peer's server binds ($RAVNEST_LISTEN)",
    )
    s.add_argument("--advertise", default=None, help="URL other peers reach this peer at (behind NAT)")
    s.add_argument(
        "--no-inbound",
        action="store_true",
        help="client-only: open no port; other peers reach this one through the rendezvous' relay (NAT, firewalls)",
    )
    s.add_argument(
        "--peer-id",
        default=env("RAVNEST_PEER_ID"),
        help="this peer's id (default: $RAVNEST_PEER_ID, else kept in --checkpoint-dir, so a restart is the same "
        "peer; else random)",
    )
    s.add_argument(
        "--data-seed",
        type=int,
        default=int(env("RAVNEST_RANK")) if env("RAVNEST_RANK", "").isdigit() else None,
        help="seed of this peer's data order (default: $RAVNEST_RANK, else from the peer id)",
    )
    s.add_argument(
        "--min-peers",
        type=int,
        default=int(env("RAVNEST_WORLD_SIZE")) if env("RAVNEST_WORLD_SIZE", "").isdigit() else 1,
        help="wait for this many peers before training (default: $RAVNEST_WORLD_SIZE, else 1)",
    )
    s.add_argument("--log-every", type=_positive_int, default=10, help="progress every this many steps")
    s.add_argument(
        "--min-step-seconds",
        type=float,
        default=0.0,
        help="emulate a slower accelerator: each inner step takes at least this long",
    )
    s.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save checkpoints here (orbax) and resume from the latest one (a swarm: one subfolder per peer)",
    )
    s.add_argument(
        "--fresh",
        action="store_true",
        help="start from step 0 although --checkpoint-dir has checkpoints (they are moved to DIR/previous-TIME/); "
        "needed after a run found none of them readable",
    )
    s.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=None,
        help="steps between checkpoints (default: --sync-every); a checkpoint is written at the first step "
        "with no round in flight, so with overlap tau the steps are k * N + tau, named by the "
        "inner steps they hold",
    )
    s.add_argument(
        "--schedule-steps",
        type=_positive_int,
        default=None,
        help="length of the learning-rate schedule (default: --max-steps; fix it to resume a run further)",
    )
    s.add_argument(
        "--devices",
        type=_positive_int,
        default=1,
        help="local devices of each peer: the batch is split over them (data parallel); on a "
        "machine without accelerators this many CPU devices are made",
    )
    s.add_argument(
        "--layout",
        choices=["replicated", "fsdp"],
        default="replicated",
        help="with --devices > 1: params replicated on every device, or split along their first axis",
    )
    pp = p.add_argument_group("pipeline stages (--stages S > 1 with --local-peers / --rendezvous)")
    pp.add_argument(
        "--stages",
        type=_positive_int,
        default=1,
        help="cut the model into S pipeline stages, one peer each; --local-peers N makes N / S clusters that "
        "average each stage with DiLoCo (docs/pipeline.md)",
    )
    pp.add_argument(
        "--micro-batches", type=_positive_int, default=4, help="micro-batches per step (divides --batch-size)"
    )
    pp.add_argument(
        "--in-flight",
        type=_positive_int,
        default=None,
        help="micro-batches the first stage holds (default: the stage count, 1F1B's; up to --micro-batches + 1 "
        "hides slow links, docs/pipeline.md)",
    )
    pp.add_argument(
        "--pipeline-mode",
        choices=["sync", "async", "stash", "predict", "2bw"],
        default="sync",
        help="sync: flush every step (exactly the unsplit model); async: no flush (the measured choice, "
        "docs/pipeline.md), or name stash / 2bw",
    )
    pp.add_argument(
        "--activation-codec",
        choices=["fp32", "bf16", "int8", "int4", "fp4"],
        default="int8",
        help="codec of the activations and activation-gradients between stages",
    )
    pp.add_argument(
        "--standbys", type=int, default=0, help="extra peers that wait to take over a stage whose peer dies"
    )
    s.add_argument("--json-events", action="store_true", help=argparse.SUPPRESS)
    s.add_argument("--join-when-exists", default=None, help=argparse.SUPPRESS)  # tests: join on cue
    s.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of the ravnest_jax loggers (INFO shows round retries and resyncs)",
    )
    args = p.parse_args(argv)
    from ravnest_jax.compress import CODECS

    if args.codec is not None and args.codec not in CODECS:
        p.error(f"--codec must be one of {', '.join(CODECS)}, got {args.codec!r}")
    if args.topk_fraction is not None and (args.codec != "topk" or not args.topk_fraction <= 1.0):
        p.error(f"--topk-fraction needs --codec topk and a value in (0, 1], got {args.topk_fraction}")
    from ravnest_jax.compress import Codec

    if args.block_size is not None:
        # the codec the run will use: a swarm's default (int4) is set at the end
        codec = args.codec if args.codec is not None or not (args.local_peers or args.rendezvous) else "int4"
        if codec is None:
            p.error("--block-size needs a block codec: --codec int8, int4, fp4, int2 or sign")
        try:
            Codec(codec, block_size=args.block_size)
        except ValueError as e:
            p.error(f"--block-size: {e}")
    if args.mean_codec is not None:
        if args.codec is None:
            p.error("--mean-codec needs --codec (a block codec: the contributions' codec)")
        try:
            Codec(args.codec, block_size=args.block_size, mean=args.mean_codec)
        except ValueError as e:
            p.error(f"--mean-codec: {e}")
    if not args.staleness_budget < 1.0:
        p.error(f"--staleness-budget must be a fraction below 1, got {args.staleness_budget}")
    if not args.clip_multiple >= 1.0:
        p.error(f"--clip-multiple must be >= 1, got {args.clip_multiple}")
    if args.adversary is not None:
        kind, _, factor = args.adversary.partition(":")
        try:
            ok = (kind == "noise" and not factor) or (kind == "scale" and math.isfinite(float(factor)))
        except ValueError:
            ok = False
        if not ok:
            p.error(f"--adversary must be 'scale:F' (F a number) or 'noise', got {args.adversary!r}")
        if not (args.local_peers or args.rendezvous):
            p.error("--adversary applies to swarm peers (--local-peers / --rendezvous)")
    if args.local_peers and args.adversary is not None and args.adversary_peers >= args.local_peers:
        p.error(f"--adversary-peers ({args.adversary_peers}) must be fewer than --local-peers ({args.local_peers})")
    if not 0.0 <= args.ef_decay <= 1.0:
        p.error(f"--ef-decay must be in [0, 1], got {args.ef_decay}")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if args.no_inbound and args.advertise:
        p.error("--no-inbound and --advertise exclude each other (a client-only peer is reached through the relay)")
    if args.local_peers and args.rendezvous:
        p.error("--local-peers and --rendezvous exclude each other")
    if not 0.0 <= args.alpha <= 1.0:
        p.error("--alpha must be in [0, 1]")
    gap = args.sync_every // args.fragments
    if (args.local_peers or args.rendezvous) and args.overlap_steps != "auto" and args.overlap_steps >= gap:
        p.error("--overlap-steps must be smaller than --sync-every / --fragments")
    if (args.local_peers or args.rendezvous) and args.overlap_steps == "auto" and gap < 2:
        p.error("--overlap-steps auto needs --sync-every / --fragments >= 2")
    if args.mode == "eager" and args.overlap_steps == 0:
        p.error("--mode eager needs --overlap-steps >= 1")
    if args.mode == "blocking" and args.overlap_steps == "auto":
        args.overlap_steps = 0
    if args.rendezvous and not args.rendezvous.startswith(("http://", "https://")):
        p.error(f"--rendezvous must be an http:// or https:// URL, got {args.rendezvous!r}")
    if args.rendezvous and not (
        args.token_file or os.environ.get("RAVNEST_TOKEN") or os.environ.get("RAVNEST_TOKEN_FILE")
    ):
        p.error("--rendezvous needs --token-file (or $RAVNEST_TOKEN, $RAVNEST_TOKEN_FILE)")
    if args.devices > 1 and not (args.local_peers or args.rendezvous):
        p.error("--devices applies to swarm peers (--local-peers / --rendezvous)")
    if args.batch_size % args.devices:
        p.error(f"--batch-size ({args.batch_size}) must be a multiple of --devices ({args.devices})")
    if (
        args.checkpoint_dir
        and Path(args.checkpoint_dir).expanduser().exists()
        and not Path(args.checkpoint_dir).expanduser().is_dir()
    ):
        p.error(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a directory")
    if args.checkpoint_dir and args.rendezvous and os.environ.get("RAVNEST_PEER_ID") and not args.local_peers:
        # under `ravnest-jax local`: one subfolder per peer, as with --local-peers
        args.checkpoint_dir = str(Path(args.checkpoint_dir) / os.environ["RAVNEST_PEER_ID"])
    if args.stages > 1:
        if not (args.local_peers or args.rendezvous):
            p.error("--stages applies to swarm peers (--local-peers / --rendezvous)")
        if args.local_peers and args.local_peers % args.stages:
            p.error(f"--local-peers ({args.local_peers}) must be a multiple of --stages ({args.stages})")
        if args.stages > args.layers + 2:
            p.error(
                f"--stages ({args.stages}) can be at most --layers + 2 ({args.layers + 2}): embedding, blocks, head"
            )
        if args.batch_size % args.micro_batches:
            p.error(f"--batch-size ({args.batch_size}) must be a multiple of --micro-batches ({args.micro_batches})")
        if args.in_flight is not None and not args.stages <= args.in_flight <= max(args.stages, args.micro_batches + 1):
            p.error(
                f"--in-flight ({args.in_flight}) must be in [--stages, --micro-batches + 1] = "
                f"[{args.stages}, {max(args.stages, args.micro_batches + 1)}]"
            )
        if 32 % (args.batch_size // args.micro_batches):
            p.error("--batch-size / --micro-batches must divide 32 (the eval batches pass through the pipeline)")
        if args.standbys < 0:
            p.error("--standbys must be >= 0")
        for flag, bad in (
            ("--devices", args.devices > 1),
            ("--adversary", args.adversary),
            ("--fragments", args.fragments > 1),
            # the stage groups' rounds take --codec only: these would be ignored silently
            ("--mean-codec", args.mean_codec not in (None, args.codec)),
            ("--mean-ef on", args.mean_ef == "on"),
            ("--block-size", args.block_size is not None),
            ("--topk-fraction", args.topk_fraction is not None),
            ("--ef-decay", args.ef_decay != 1.0),
            ("--aggregator", args.aggregator not in (None, "clipped_mean")),
            ("--clip-multiple", args.clip_multiple != 2.0),
        ):
            if bad:
                p.error(f"{flag} is not supported with --stages yet (docs/pipeline.md, limits)")
    elif args.standbys:
        p.error("--standbys needs --stages > 1")
    if not (args.local_peers or args.rendezvous):
        args.simulate = True
    elif args.codec is None:
        args.codec = "int4"
    return args


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("ravnest_jax").setLevel(args.log_level)
    warnings_as_log_lines()  # one line each, which the local mode's console shows
    in_main = threading.current_thread() is threading.main_thread()
    _LOOP["stop"] = _LOOP["defer"] = False
    _LOOP["hard_exit"] = False
    _STOPPED_BY.clear()
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)} if in_main else {}
    try:
        return _main(args)
    finally:  # called in-process (tests, notebooks): the caller's handlers again
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def _write_summary(args: argparse.Namespace, summary: dict) -> None:
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(json_safe(summary), indent=2, default=str, allow_nan=False))
        print(f"\nwrote {args.summary_json}", file=sys.stderr if args.json_events else sys.stdout)


def _plot(summary_json: str) -> None:
    """The run's plots next to its summary (``ravnest-jax report``), or why there are none."""
    try:
        from ravnest_jax.tools._report import write_report

        paths = write_report(summary_json)
    except ImportError:
        print("plots: none (pip install matplotlib, then: ravnest-jax report " + summary_json + ")")
        return
    except ValueError as e:
        print(f"plots: none ({e})")
        return
    print("plots: " + ", ".join(str(p) for p in paths))


def _main(args: argparse.Namespace) -> int:
    from ravnest_jax.swarm import SwarmError

    mode = "local_swarm" if args.local_peers else "peer" if args.rendezvous else "simulation"
    try:
        if args.local_peers:
            summary = run_local_swarm(args)
        elif args.rendezvous:  # one peer of a swarm: a whole model, or one pipeline stage
            if args.stages > 1:
                from char_lm.pipe_peer import print_stage_table, run_stage_peer

                mode, result = "stage_peer", run_stage_peer(args)
            else:
                mode, result = "peer", run_peer(args)
            summary = {
                "mode": mode,
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "machine": machine_info(),
                "config": run_config(args, run_id=args.run_id),
                "interrupted": result["interrupted"],
                "peer_result": result,
            }
            _emit(args, event="result", result=result)
            if not args.json_events and args.stages > 1:
                print_stage_table([result])
            elif not args.json_events:
                print_peer_table([result], None)
        else:
            summary = run_simulation(args)
    except (ValueError, SwarmError, RuntimeError, TimeoutError) as e:  # bad input or a run that cannot go on: one line
        # TimeoutError: e.g. fewer than --min-peers peers registered in time (rj.join_or_resume)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before training started (compiling, joining)
        _LOOP["hard_exit"] = True  # see the end of this file
        print("\ninterrupted" + (" (SIGTERM)" if _STOPPED_BY and _STOPPED_BY[-1] == 15 else ""), file=sys.stderr)
        _write_summary(
            args,
            {
                "mode": mode,
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "interrupted": True,
                "config": run_config(args),
            },
        )
        return 128 + (_STOPPED_BY[-1] if _STOPPED_BY else 2)
    _write_summary(args, summary)  # local mode: signals only recorded here (run_local_swarm's handlers)
    if mode == "local_swarm" and summary.get("peers") and not summary.get("pipeline"):
        if summary.get("interrupted") or _STOPPED_BY:  # exit at once; the plots can be made later
            print(f"plots: none (interrupted; ravnest-jax report {args.summary_json})")
        else:
            _plot(args.summary_json)
    if summary.get("interrupted") or (mode == "local_swarm" and _STOPPED_BY):
        return 128 + (_STOPPED_BY[-1] if _STOPPED_BY else 2)
    return 1 if summary.get("failed_peers") else 0


if __name__ == "__main__":
    import ravnest_jax as rj

    rj.enable_compilation_cache()  # a restarted peer loads its compiled steps (RAVNEST_COMPILE_CACHE=0: off)
    code = main()
    if _LOOP.get("hard_exit") or _STOPPED_BY:
        # interrupted before training started, possibly inside an XLA compile: the interpreter's
        # teardown can then crash (SIGSEGV, exit 139) while XLA's compile threads still run.
        # Nothing of this process is left to clean (a swarm it joined was left by its with-block,
        # the summary is written), so end it without the teardown, with Ctrl+C's status; after
        # Ctrl+C anywhere the same: the report is out, and the teardown costs seconds
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)
