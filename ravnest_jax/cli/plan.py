"""Predict, for a range of H, the bytes each peer sends per round, the round's time, the overlap
tau that hides it and the compute utilisation, from the model size, the codec, the number of
peers, the link and the step time; then recommend H, codec, tau and fragments. The model of a
round is the one benchmarks/bench_utilization.py measured (docs/planning.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._args import add_json, fail, non_negative_float, positive_float

NAME = "plan"
HELP = "predict rounds on a link; recommend H, codec, overlap and fragments"

#: :func:`ravnest_jax.tools.plan_rounds`'s parameters named as the command's flags in its errors
_FLAGS = {
    "params": "--params",
    "peers": "--peers",
    "mbit_up": "--mbit",
    "mbit_down": "--mbit-down",
    "rtt_ms": "--rtt-ms",
    "step_s": "--step-s",
    "target": "--target",
    "sync_every": "--sync-every",
    "codec": "--codec",
    "mean_codec": "--mean-codec",
    "block_size": "--block-size",
}


def _flag_names(msg: str) -> str:
    """A :func:`plan_rounds` error with its parameter named as the command's flag."""
    msg = msg.replace("option 'block_size'", "--block-size").replace(" with codec ", " with --codec ")
    head, sep, rest = msg.partition(" ")
    return f"{_FLAGS[head]}{sep}{rest}" if head in _FLAGS else msg


def run(args: argparse.Namespace) -> int:
    """Prints the plan and the recommendation; exit status 2 with one error line on a bad input."""
    from ravnest_jax.tools import PLAN_CODECS, check_codecs, codec_seconds_per_param, params_of_config, plan_rounds

    try:
        if args.lora_rank is not None and not args.config:
            raise ValueError("--lora-rank needs --config (the model's projections)")
        if args.config:
            params = params_of_config(args.config, args.lora_rank)
        elif args.params is not None:
            if not float(args.params).is_integer() or args.params > 1e15:
                raise ValueError(f"--params must be a whole number of parameters up to 1e15, got {args.params:g}")
            params = int(args.params)
        else:
            raise ValueError("give --params N or --config config.json")
        check_codecs(args.codec, args.mean_codec, args.block_size)  # before measuring the codecs
        if args.json and not Path(args.json).resolve().parent.is_dir():
            raise ValueError(f"--json {args.json}: no such directory {Path(args.json).resolve().parent}")
        codec_s = None if args.no_measure else {c: codec_seconds_per_param(c) for c in PLAN_CODECS}
        plan = plan_rounds(
            params,
            codec=args.codec,
            mean_codec=args.mean_codec,
            block_size=args.block_size,
            peers=args.peers,
            mbit_up=args.mbit,
            mbit_down=args.mbit_down,
            rtt_ms=args.rtt_ms,
            step_s=args.step_s,
            sync_every=tuple(args.sync_every),
            target=args.target,
            codec_s=codec_s,
        )
    except ValueError as e:
        return fail(_flag_names(str(e)))
    i = plan.inputs
    down = "" if args.mbit_down is None else f" / {args.mbit_down:g} down"
    count = f"{params / 1e6:,.1f}M" if params >= 100_000 else f"{params:,}"
    pair = args.codec if args.mean_codec in (None, args.codec) else f"{args.codec} up, {args.mean_codec} down"
    if args.block_size is not None:
        pair += f", block {args.block_size}"
    print(
        f"{count} parameters exchanged, codec {pair}, {args.peers} peers, "
        f"{args.mbit:g} Mbit/s up{down}, RTT {args.rtt_ms:g} ms, {args.step_s:g} s a step "
        f"(codec {'measured here' if codec_s else 'speed of the calibration host'})"
    )
    print(plan.table())
    coarse = (
        "2-bit and 1-bit codes stay close to fp32 DiLoCo only with error feedback (the default) and enough "
        "rounds; measured in docs/algorithm.md (sign up, int2 down, block 512: +0.45% at 80 rounds)"
        if {args.codec, args.mean_codec} & {"int2", "sign"}
        else ""
    )
    if coarse:
        print(f"note: {coarse}")
    dp = plan.data_parallel
    print(
        f"data-parallel (fp32 all-reduce every step, {dp['bytes_per_step'] / 1e6:,.1f} MB a step): "
        f"{dp['step_allreduce_s']:.2f} s a step, {100 * dp['utilisation']:.1f}% utilisation"
    )
    r = plan.recommendation
    print(
        f"recommended: H={r['sync_every']}, codec {r['codec']}, overlap_steps={r['overlap_steps']}, "
        f"fragments={r['fragments']}: {100 * r['utilisation']:.1f}% predicted ({r['why']})"
    )
    print(
        f"  rj.diloco(inner, sync_every={r['sync_every']}"
        + (f", fragments={r['fragments']}" if r["fragments"] > 1 else "")
        + f'); rj.Swarm(..., codec="{r["codec"]}"); rj.OuterSync(tx, swarm, overlap_steps={r["overlap_steps"]})'
    )
    if args.json:
        out = {"inputs": i, "rows": [vars(x) for x in plan.rows], "data_parallel": dp, "recommendation": r}
        if coarse:
            out["note"] = coarse
        try:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        except OSError as e:
            return fail(f"--json {args.json}: {e.strerror or e}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax plan``."""
    from ravnest_jax.tools import PLAN_CODECS

    what = p.add_mutually_exclusive_group()
    what.add_argument("--params", type=positive_float, help="parameters exchanged, e.g. 1e9")
    what.add_argument("--config", help="a Hugging Face config.json (or its directory, or a preset name)")
    p.add_argument("--lora-rank", type=int, default=None, help="with --config: exchange rank-R LoRA adapters only")
    p.add_argument(
        "--codec", default="int4", choices=list(PLAN_CODECS), help="codec of the contributions (default int4)"
    )
    p.add_argument(
        "--mean-codec",
        choices=list(PLAN_CODECS),
        help="codec of the mean the part owners send back (default: --codec), as rj.Codec(mean=...)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        help="values per scale of a block codec (int8, int4, int2, sign; default 64), as rj.Codec(block_size=...)",
    )
    p.add_argument("--peers", type=int, default=2, help="peers in a round (default 2)")
    p.add_argument("--mbit", type=positive_float, required=True, help="link rate up, Mbit/s")
    p.add_argument("--mbit-down", type=positive_float, default=None, help="link rate down, Mbit/s (default: --mbit)")
    p.add_argument("--rtt-ms", type=non_negative_float, default=50.0, help="round-trip time, ms (default 50)")
    p.add_argument("--step-s", type=positive_float, required=True, help="one inner step, seconds (measured or guessed)")
    p.add_argument("--sync-every", type=int, nargs="+", default=[10, 25, 50, 100, 200, 500, 1000], help="H values")
    p.add_argument("--target", type=float, default=0.95, help="utilisation to aim for (default 0.95)")
    p.add_argument("--no-measure", action="store_true", help="codec speed of the calibration host, not this one")
    add_json(p, "the plan")
