"""The ``plan`` and ``report`` commands of ``ravnest-jax`` (registered by ``ravnest_jax.cli``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ravnest_jax.tools._argtypes import checked as _checked
from ravnest_jax.tools._argtypes import positive_float as _positive_float


def _non_negative(value: str) -> float:
    return _checked(value, float, lambda v: 0 <= v < math.inf, "a number >= 0")


def _hf_sizes(config: str) -> dict[str, Any]:
    """The sizes of a Hugging Face ``config.json`` (a file, its directory, or a preset name)."""
    path = Path(config)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--config {config}: the directory has no config.json")
        path = path / "config.json"
    if path.is_file():
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--config {config}: not a readable JSON file ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"--config {config}: not a config.json (a JSON object of the model's sizes)")
        return d
    try:
        from ravnest_jax.models._plan import PRESETS
    except ImportError:
        PRESETS = {}
    if config in PRESETS:
        return dict(PRESETS[config])
    raise ValueError(
        f"--config {config}: no such file or directory"
        + (f", and not a preset ({', '.join(PRESETS)})" if PRESETS else "")
    )


def params_of_config(config: str, lora_rank: int | None = None) -> int:
    """Parameters of a decoder-only transformer's ``config.json`` (Llama / Mistral / Qwen
    layout), or of its LoRA adapters on every projection with ``lora_rank``.

    Raises:
      ValueError: the file is missing or lacks a size (one line naming it).
    """
    if lora_rank is not None and (not isinstance(lora_rank, int) or lora_rank < 1):
        raise ValueError(f"--lora-rank must be an int >= 1, got {lora_rank!r}")
    c = _hf_sizes(config)
    try:
        d, ff, layers, vocab = (
            int(c[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
        )
        heads = int(c["num_attention_heads"])
    except KeyError as e:
        raise ValueError(f"--config {config}: no {e} in it") from None
    except (TypeError, ValueError):
        raise ValueError(f"--config {config}: a size is not a whole number") from None
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or d // heads)
    shapes = {
        "q": (d, heads * hd),
        "k": (d, kv * hd),
        "v": (d, kv * hd),
        "o": (heads * hd, d),
        "gate": (d, ff),
        "up": (d, ff),
        "down": (ff, d),
    }
    if lora_rank:
        return layers * sum(lora_rank * (i + o) for i, o in shapes.values())
    per_layer = sum(i * o for i, o in shapes.values()) + 2 * d
    emb = vocab * d * (1 if c.get("tie_word_embeddings") else 2)
    return layers * per_layer + emb + d


def cmd_plan(args: argparse.Namespace) -> int:
    from ._round_plan import PLAN_CODECS, check_codecs, codec_seconds_per_param, plan_rounds

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
        e = ValueError(_flag_names(str(e)))
        print(f"error: {e}", file=sys.stderr)
        return 2
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
            print(f"error: --json {args.json}: {e.strerror or e}", file=sys.stderr)
            return 2
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ._report import write_report

    try:
        paths = write_report(args.summary, out_dir=args.out_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: ravnest-jax report needs matplotlib (pip install matplotlib): {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


def add_parsers(sub: Any) -> None:
    from ._round_plan import PLAN_CODECS

    pl = sub.add_parser(
        "plan",
        help="predict rounds on a link; recommend H, codec, overlap and fragments",
        description="Predict, for a range of H, the bytes each peer sends per round, the round's time, the "
        "overlap tau that hides it and the compute utilisation, from the model size, the codec, the number of "
        "peers, the link and the step time; then recommend H, codec, tau and fragments. The model of a round "
        "is the one benchmarks/bench_utilization.py measured (docs/planning.md).",
    )
    what = pl.add_mutually_exclusive_group()
    what.add_argument("--params", type=_positive_float, help="parameters exchanged, e.g. 1e9")
    what.add_argument("--config", help="a Hugging Face config.json (or its directory, or a preset name)")
    pl.add_argument("--lora-rank", type=int, default=None, help="with --config: exchange rank-R LoRA adapters only")
    pl.add_argument(
        "--codec", default="int4", choices=list(PLAN_CODECS), help="codec of the contributions (default int4)"
    )
    pl.add_argument(
        "--mean-codec",
        choices=list(PLAN_CODECS),
        help="codec of the mean the part owners send back (default: --codec), as rj.Swarm(mean_codec=...)",
    )
    pl.add_argument(
        "--block-size",
        type=int,
        help="values per scale of a block codec (int8, int4, int2, sign; default 64), as rj.Swarm(codec_options={'block_size': ...})",
    )
    pl.add_argument("--peers", type=int, default=2, help="peers in a round (default 2)")
    pl.add_argument("--mbit", type=_positive_float, required=True, help="link rate up, Mbit/s")
    pl.add_argument("--mbit-down", type=_positive_float, default=None, help="link rate down, Mbit/s (default: --mbit)")
    pl.add_argument("--rtt-ms", type=_non_negative, default=50.0, help="round-trip time, ms (default 50)")
    pl.add_argument(
        "--step-s", type=_positive_float, required=True, help="one inner step, seconds (measured or guessed)"
    )
    pl.add_argument("--sync-every", type=int, nargs="+", default=[10, 25, 50, 100, 200, 500, 1000], help="H values")
    pl.add_argument("--target", type=float, default=0.95, help="utilisation to aim for (default 0.95)")
    pl.add_argument("--no-measure", action="store_true", help="codec speed of the calibration host, not this one")
    pl.add_argument("--json", default=None, metavar="PATH", help="also write the plan as JSON here")
    pl.set_defaults(func=cmd_plan)
    rp = sub.add_parser(
        "report",
        help="plot a run's summary JSON (loss, utilisation and stalls, bytes) as PNGs",
        description="Write PNGs of a run next to its summary JSON (the main job's --summary-json, or "
        "ravnest-jax local --summary-json): loss per round, utilisation and stall seconds per peer, bytes "
        "per round against data-parallel training.",
    )
    rp.add_argument("summary", help="the summary JSON")
    rp.add_argument("--out-dir", default=None, help="where to write the PNGs (default: next to the summary)")
    rp.set_defaults(func=cmd_report)


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
