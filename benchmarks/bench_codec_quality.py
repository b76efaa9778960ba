"""Eval loss of the char-LM example under each pseudo-gradient codec, with and without error
feedback, against fp32 (no compression), in the in-process DiLoCo simulation.

Setup (defaults): 4 replicas, H = 50 (``--sync-every``), the same model, data, seed and tokens
for every run (``examples/char_lm/main.py``: byte-level transformer on the standard library's .py
files); only the codec differs. The codec is applied as the swarm does: each replica's
pseudo-gradient is encoded and decoded (with its error-feedback residual), the decoded values are
averaged, and the mean is encoded and decoded again (``ravnest_jax.compress.simulated``).

Writes ``benchmarks/results/codec_quality.json`` and ``codec_quality.png`` (eval loss per codec,
with/without error feedback, relative to fp32).

Usage:
  python benchmarks/bench_codec_quality.py                      # 11 runs, ~10-15 min on 2 CPU cores
  python benchmarks/bench_codec_quality.py --steps 100 --codecs int4,fp4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

DEFAULT_CODECS = "bf16,int8,int4,fp4,topk"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="inner steps per run (rounds = steps / H)")
    p.add_argument("--sync-every", type=int, default=50, help="H")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--codecs", default=DEFAULT_CODECS, help="lossy codecs to compare with fp32")
    p.add_argument("--topk-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--progress", action="store_true")
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON in --out-dir")
    return p.parse_args(argv)


def plot(results: list[dict], fp32_loss: float, path: str, title: str, cap: float = 3.0) -> None:
    """Bars of eval loss vs fp32 (%) per codec, without/with error feedback.

    The y axis is cut at ``cap`` percent so that small differences stay visible; a bar above it is
    drawn to the cut and labelled with its true value.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = [r["codec"] for r in results if r["error_feedback"]]
    by = {(r["codec"], r["error_feedback"]): r for r in results}
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    width = 0.38
    xs = range(len(codecs))
    lo = min([-0.5] + [(r["eval_loss"] / fp32_loss - 1) * 100 - 0.3 for r in results])
    for off, ef, color, label in (
        (-width / 2, False, "#a0a0a0", "no error feedback"),
        (width / 2, True, "#3060c0", "error feedback"),
    ):
        vals = [(by[(c, ef)]["eval_loss"] / fp32_loss - 1) * 100 if (c, ef) in by else float("nan") for c in codecs]
        bars = ax.bar([x + off for x in xs], [min(v, cap) for v in vals], width, color=color, label=label)
        for b, v in zip(bars, vals):
            y = min(v, cap)
            text = f"{v:+.2f}%" + (" (cut)" if v > cap else "")
            ax.annotate(
                text,
                (b.get_x() + b.get_width() / 2, y),
                ha="center",
                va="bottom" if v >= 0 else "top",
                fontsize=7,
                rotation=90 if v > cap else 0,
                xytext=(0, 2 if v >= 0 else -2),
                textcoords="offset points",
            )
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(1, color="#d04040", lw=0.8, ls="--", label="+1% (goal for int4/fp4 + EF)")
    ax.set_ylim(lo, cap + 1.2)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{c}\n{by[(c, True)]['ratio']:.3f}x bytes" for c in codecs])
    ax.set_ylabel(f"eval loss vs fp32 (%), axis cut at +{cap:g}%")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        with open(os.path.join(args.out_dir, "codec_quality.json")) as f:
            summary = json.load(f)
        plot(
            [r for r in summary["results"] if r["codec"] != "fp32"],
            summary["fp32_eval_loss"],
            os.path.join(args.out_dir, "codec_quality.png"),
            summary["title"],
        )
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import char_lm  # examples/char_lm/main.py
    import ravnest_jax.compress as C

    cfg = char_lm.ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len)
    train, evald = char_lm.load_corpus(None)
    graphdef, params0 = char_lm.build_model(cfg, seed=args.seed)
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    evaluate = char_lm.make_evaluator(
        graphdef, char_lm.eval_batches(evald, batch=32, seq_len=cfg.seq_len, num_batches=args.eval_batches)
    )
    common = dict(
        replicas=args.replicas,
        batch=args.batch_size,
        seq_len=cfg.seq_len,
        steps=args.steps,
        lr=args.lr,
        sync_every=args.sync_every,
        seed=args.seed,
        progress=args.progress,
    )
    tokens = args.steps * args.replicas * args.batch_size * cfg.seq_len
    print(
        f"model {n_params / 1e6:.2f}M params, {args.replicas} replicas, H={args.sync_every}, "
        f"{args.steps} steps, {tokens / 1e6:.1f}M tokens per run",
        flush=True,
    )
    leaf_sizes = [int(x.size) for x in jax.tree.leaves(params0)]

    def ratio(codec: str) -> float:
        opts = {"fraction": args.topk_fraction} if codec == "topk" else {}
        return sum(C.payload_ratio(codec, n, **opts) * 4 * n for n in leaf_sizes) / (4 * sum(leaf_sizes))

    runs = [("fp32", False)]
    for codec in filter(None, args.codecs.split(",")):
        runs += [(codec, True), (codec, False)]
    results = []
    fp32_loss = None
    t_all = time.perf_counter()
    for codec, ef in runs:
        opts = {"fraction": args.topk_fraction} if codec == "topk" else {}
        sim = C.simulated(C.Codec(codec, error_feedback=ef, **opts))
        t = time.perf_counter()
        p, train_loss = char_lm.train_diloco_simulation(graphdef, params0, train, codec=sim, **common)
        loss = evaluate(p)
        if codec == "fp32":
            fp32_loss = loss
        r = {
            "codec": codec,
            "error_feedback": ef,
            "options": opts,
            "ratio": ratio(codec),
            "eval_loss": loss,
            "train_loss": train_loss,
            "vs_fp32_pct": (loss / fp32_loss - 1) * 100,
            "seconds": time.perf_counter() - t,
        }
        results.append(r)
        print(
            f"  {codec:5s} EF={str(ef):5s} ratio {r['ratio']:.4f}  eval loss {loss:.4f}  "
            f"({r['vs_fp32_pct']:+.2f}% vs fp32)  {r['seconds']:.0f}s",
            flush=True,
        )
    os.makedirs(args.out_dir, exist_ok=True)
    summary = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": char_lm.machine_info(),
        "config": {
            **vars(args),
            "model": vars(cfg) if hasattr(cfg, "__dict__") else str(cfg),
            "params": int(n_params),
            "tokens_per_run": tokens,
            "rounds": args.steps // args.sync_every,
        },
        "eval_loss_at_init": evaluate(params0),
        "fp32_eval_loss": fp32_loss,
        "goal": "int4 or fp4 with error feedback within 1% of fp32",
        "goal_met": any(
            r["codec"] in ("int4", "fp4") and r["error_feedback"] and r["vs_fp32_pct"] <= 1.0 for r in results
        ),
        "results": results,
        "seconds": time.perf_counter() - t_all,
    }
    title = (
        f"char-LM, {args.replicas} replicas, H={args.sync_every}, {args.steps} steps "
        f"({tokens / 1e6:.1f}M tokens); fp32 eval loss {fp32_loss:.4f} nats/byte"
    )
    summary["title"] = title
    json_path = os.path.join(args.out_dir, "codec_quality.json")
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    plot(
        [r for r in results if r["codec"] != "fp32"], fp32_loss, os.path.join(args.out_dir, "codec_quality.png"), title
    )
    print()
    print("| codec | error feedback | bytes vs fp32 | eval loss | vs fp32 |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['codec']} | {'yes' if r['error_feedback'] else 'no'} | {r['ratio']:.4f} | "
            f"{r['eval_loss']:.4f} | {r['vs_fp32_pct']:+.2f}% |"
        )
    print(f"wrote {json_path} and codec_quality.png; goal met: {summary['goal_met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
