#!/usr/bin/env python3
"""Bytes on the wire against data-parallel, and the eval loss, of compressed DiLoCo rounds in a
real swarm: 4 peer processes on 127.0.0.1 (the example's ``--local-peers``), blocking rounds,
one run per configuration, side by side in one invocation.

    python benchmarks/bench_wire_ratio.py                      # 2000 steps, ~20 min on 2 cores
    python benchmarks/bench_wire_ratio.py --steps 600 --configs fp32 int2:256

A configuration is ``CODEC[/MEAN][:BLOCK][:mef][:plain][:muon]``: the swarm's codec (and the
codec of the mean, ``rj.Codec(mean=)``, if another), its block size, ``olrX`` the outer
learning rate X (after ``plain``),
``mef`` the part owners' error feedback on the mean (``rj.Codec(mean_ef=True)``),
``plain`` the outer SGD without momentum at learning rate 1 (plain averaging) instead of the
default Nesterov 0.7 / 0.9, ``muon`` Muon as the inner optimizer (the example's ``--inner muon
--lr 0.02``) instead of AdamW 3e-3. Every peer keeps its own error feedback (``rj.OuterSync``).

Per run: the bytes each peer sent over the whole run as the swarm counts them (every part and
result message, headers included), the bytes a data-parallel ring all-reduce of float32
gradients would have sent per peer (``2 (N - 1) / N * 4 * params`` per step), their ratio (against
the peer that sent most), the final eval loss (nats/byte, identical on every peer), and whether
the digests agreed every round. Writes ``benchmarks/results/wire_ratio.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import machine_info  # noqa: E402

DEFAULT_CONFIGS = ["fp32", "int4", "int2:256", "sign:mef:plain"]


def config_flags(config: str) -> list[str]:
    """``CODEC[/MEAN][:BLOCK][:mef][:plain][:muon]`` -> the example's flags."""
    codec, *rest = config.split(":")
    codec, _, mean = codec.partition("/")
    flags = ["--codec", codec] + (["--mean-codec", mean] if mean else [])
    for r in rest:
        if r == "mef":
            flags += ["--mean-ef", "on"]
        elif r == "plain":
            flags += ["--outer-lr", "1", "--outer-momentum", "0"]
        elif r == "muon":
            flags += ["--inner", "muon", "--lr", "0.02"]
        elif r.startswith("olr"):
            flags += ["--outer-lr", r[3:]]
        elif r.isdigit():
            flags += ["--block-size", r]
        else:
            raise SystemExit(f"bad config {config!r}: {r!r} is not a block size, 'mef', 'plain' or 'muon'")
    return flags


def run(config: str, steps: int, peers: int, seed: int, tmp: Path) -> dict:
    summary = tmp / f"{config.replace(':', '_')}.json"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "char_lm" / "main.py"),
        "--local-peers",
        str(peers),
        "--max-steps",
        str(steps),
        "--overlap-steps",
        "0",
        "--eval-batches",
        "16",
        "--seed",
        str(seed),
        "--no-progress",
        "--summary-json",
        str(summary),
        *config_flags(config),
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(
            f"{config}: the swarm failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    doc = json.loads(summary.read_text())
    sent = [p["bytes_sent"] for p in doc["peers"]]
    dp = float(doc["data_parallel_bytes_per_peer"])
    evals = sorted({round(p["eval_loss_end"], 6) for p in doc["peers"]})
    return {
        "config": config,
        "flags": config_flags(config),
        "seconds": time.monotonic() - t0,
        "params": doc["peers"][0]["params"],
        "rounds": [p["rounds"] for p in doc["peers"]],
        "failed_rounds": [p["failed_rounds"] for p in doc["peers"]],
        "bytes_sent_per_peer": sent,
        "data_parallel_bytes_per_peer": dp,
        "ratio_vs_data_parallel": dp / max(sent),
        "bits_per_param_per_round": 8
        * max(sent)
        / (doc["peers"][0]["params"] * max(1, max(p["rounds"] for p in doc["peers"]))),
        "eval_loss": evals[0] if len(evals) == 1 else evals,
        "digests_equal_every_round": bool(doc["global_digests_equal"] and doc["round_digests_equal"]),
    }


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    names = [r["config"] for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    bars = a1.bar(names, [r["ratio_vs_data_parallel"] for r in runs], color="tab:blue")
    a1.bar_label(bars, labels=[f"{r['ratio_vs_data_parallel']:.0f}x" for r in runs], fontsize=8)
    a1.axhline(1000, color="k", ls="--", lw=1, label="1000x")
    a1.set_yscale("log")
    a1.set_ylabel("data-parallel bytes / swarm bytes (per peer)")
    a1.legend(fontsize=8)
    base = next((r["eval_loss"] for r in runs if r["config"].split(":")[0] == "fp32"), None)
    bars = a2.bar(names, [r["eval_loss"] for r in runs], color="tab:orange")
    a2.bar_label(bars, labels=[f"{r['eval_loss']:.4f}" for r in runs], fontsize=8)
    if base is not None:
        a2.axhline(base * 1.01, color="k", ls="--", lw=1, label="fp32 + 1%")
        a2.legend(fontsize=8)
    lo = min(r["eval_loss"] for r in runs)
    a2.set_ylim(lo * 0.97, max(r["eval_loss"] for r in runs) * 1.01)
    a2.set_ylabel("final eval loss (nats/byte)")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle(f"4 peer processes, H = 50, {doc['config']['steps']} steps, blocking rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "wire_ratio.json"))
    args = ap.parse_args()
    for c in args.configs:
        config_flags(c)  # bad configs fail before anything runs
    out = Path(args.out)
    doc = {
        "benchmark": "wire_ratio",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "config": {"steps": args.steps, "peers": args.peers, "seed": args.seed, "sync_every": 50},
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="ravnest-wire-") as tmp:
        for c in args.configs:
            r = run(c, args.steps, args.peers, args.seed, Path(tmp))
            doc["runs"].append(r)
            print(
                f"{c:<18} ratio {r['ratio_vs_data_parallel']:8.1f}x  eval {r['eval_loss']}  "
                f"sent {max(r['bytes_sent_per_peer']) / 1e6:.2f} MB  ({r['seconds']:.0f} s)",
                flush=True,
            )
            out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
