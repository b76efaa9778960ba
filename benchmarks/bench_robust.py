#!/usr/bin/env python3
"""Bounded influence of one peer: the main job's 4 peers, one of them faulty, under each aggregator.

Runs ``examples/char_lm/main.py --local-peers 4`` (real peer processes, a real rendezvous on
127.0.0.1) once per case: a clean run, one peer sending its pseudo-gradient times 1000 every round
(``--adversary scale:1000``), and one sending Gaussian noise of its pseudo-gradient's norm
(``--adversary noise``), each with ``--aggregator`` mean and clipped_mean. Every
peer merges the same global state, so the honest peers' eval loss is the run's eval loss.

Writes ``benchmarks/results/robust_aggregation.json`` (the machine, the command, every case's
eval loss, the gap to the clean plain-mean run, the clipped contributions per round, round
seconds) and ``robust_aggregation.png``.

    python benchmarks/bench_robust.py                      # 600 steps, H=50: about 20 minutes on 2 cores
    python benchmarks/bench_robust.py --max-steps 200 --cases clean:mean,scale:1000:clipped_mean
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import machine_info  # noqa: E402

ATTACKS = ("clean", "scale:1000", "noise")
AGGREGATORS = ("mean", "clipped_mean")  # the trimmed mean was dropped: docs/swarm.md


def run_case(attack: str, aggregator: str, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{attack.replace(':', '')}_{aggregator}.json"
    cmd = [
        sys.executable,
        str(ROOT / "examples/char_lm/main.py"),
        "--local-peers",
        str(args.peers),
        "--max-steps",
        str(args.max_steps),
        "--sync-every",
        str(args.sync_every),
        "--aggregator",
        aggregator,
        "--seed",
        str(args.seed),
        "--no-progress",
        "--summary-json",
        str(out),
    ]
    if attack != "clean":
        cmd += ["--adversary", attack]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if proc.returncode != 0 or not out.exists():
        return {"attack": attack, "aggregator": aggregator, "error": proc.stderr[-2000:], "wall_seconds": wall}
    s = json.loads(out.read_text())
    peers = s["peers"]
    honest = [p for p in peers if p["peer"] != "peer0"] if attack != "clean" else peers
    log0 = honest[0]["round_log"]
    return {
        "attack": attack,
        "aggregator": aggregator,
        "eval_loss_end": float(np.mean([p["eval_loss_end"] for p in honest])),
        "eval_loss_start": honest[0]["eval_loss_start"],
        "rounds_ok": sum(1 for r in log0 if r["ok"]),
        "rounds": len(log0),
        "clipped_per_round": [r.get("clipped", {}) for r in log0],
        "mean_exchange_seconds": float(np.mean([r["exchange_seconds"] for r in log0 if r["ok"]] or [float("nan")])),
        "digests_equal": bool(s["global_digests_equal"] and s["round_digests_equal"]),
        "wall_seconds": wall,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    width, cap = 0.26, 8.0
    for j, agg in enumerate(AGGREGATORS):
        for i, att in enumerate(ATTACKS):
            r = next(
                (r for r in results if r["attack"] == att and r["aggregator"] == agg and "gap_vs_clean_mean" in r), None
            )
            if r is None:
                continue
            gap = 100 * r["gap_vs_clean_mean"]
            x = i + (j - 1) * width
            ax.bar(x, min(gap, cap), width, color=f"C{j}", label=agg if i == 0 else None)
            label = f"{gap:+.2f}%" if gap < cap else f"loss {r['eval_loss_end']:.3g}"
            ax.text(x, min(gap, cap) + (0.15 if gap >= 0 else -0.5), label, ha="center", fontsize=7)
    ax.axhline(2.0, color="k", ls="--", lw=0.8, label="+2% (the goal under attack)")
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_ylim(-2, cap + 1)
    ax.set_xticks(range(len(ATTACKS)), ["clean", "one peer sends x1000", "one peer sends noise (same norm)"])
    ax.set_ylabel("eval loss vs the clean plain-mean run (%)")
    ax.set_title("4 peers, char-LM, 600 steps, H=50: one faulty peer under each aggregator", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default=None, help="comma list of ATTACK:AGGREGATOR (default: all 9)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/robust_aggregation.json"))
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from --out")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.out).read_text())["results"], Path(args.out).with_suffix(".png"))
        return 0
    cases = [(a, g) for a in ATTACKS for g in AGGREGATORS]
    if args.cases:
        cases = [tuple(c.rsplit(":", 1)) for c in args.cases.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for attack, agg in cases:
            r = run_case(attack, agg, args, Path(tmp))
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("clipped_per_round",)})[:400], flush=True)
    clean = next((r["eval_loss_end"] for r in results if r["attack"] == "clean" and r["aggregator"] == "mean"), None)
    for r in results:
        if clean is not None and "eval_loss_end" in r:
            r["gap_vs_clean_mean"] = r["eval_loss_end"] / clean - 1.0
    doc = {
        "what": "eval loss of the honest peers of a 4-peer char-LM swarm with one faulty peer, per aggregator",
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": vars(args),
        "results": results,
    }
    out = Path(args.out)
    out.write_text(json.dumps(doc, indent=1, allow_nan=False, default=float))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
