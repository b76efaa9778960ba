"""Rounds at real model sizes: a scale sweep of the butterfly all-reduce.

    python benchmarks/bench_scale.py                       # the full sweep (about an hour here)
    python benchmarks/bench_scale.py --params 1e6,1e7 --links loopback   # a quick look

For every pseudo-gradient size (``--params``: 1M, 10M, 100M, 1B parameters), codec (fp32, int8,
int4) and link (loopback; 1 Gbit/s with 20 ms RTT; 100 Mbit/s with 100 ms RTT, every byte of the
peers and the rendezvous through the throttling proxy of ``benchmarks/_common.py``), 2 peer
processes on 127.0.0.1 average a float32 vector of that size with ``Swarm.all_reduce`` (its own
float32 array used in place, ``copy=False``) and report, per configuration: the round time (the
slower peer's, median after a warm-up round), each peer's CPU seconds (all its threads) in the
round, its extra resident memory (peak during the round minus before it, the result still held,
the larger of the two peers) and the bytes it sent.

Then the *utilisation* of a peer whose inner step time grows with the model, computed from the
measured round time with the model ``ravnest-jax plan`` uses and ``OuterSync(overlap_steps=
"auto")`` follows: tau = min(ceil(1.25 round / step), the staleness cap), stall =
max(0, round - tau step), utilisation = H step / (H step + stall + the host overhead of a round
measured by bench_utilization). The step time rule: an RTX 4090 training the model in bf16 at a
stated model-FLOPs utilisation, ``step_s = 6 * params * tokens / (MFU * 165e12)`` with
``tokens = --tokens-per-step`` (16 x 2048) and ``MFU = --mfu`` (0.35): 165 TFLOP/s is the 4090's
dense bf16 tensor throughput with fp32 accumulation; 35 % is what well-tuned single-card
training reaches. H in {100, 500}.

A configuration whose bytes would take longer than ``--max-round-s`` over its link (fp32 of 1B
parameters over 100 Mbit/s: about 11 minutes a round) is not run; the JSON says which and why,
and its row carries the transfer time the link alone would need.

Writes ``benchmarks/results/scale.json`` (machine and command included) and ``scale.png``
(log-log: round time and extra RSS against parameters, per codec and link).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import machine_info  # noqa: E402
from bench_allreduce import MB, swarm_run  # noqa: E402

LINKS = {"loopback": None, "1gbit": (1000.0, 20.0), "100mbit": (100.0, 100.0)}
PEAK_4090 = 165e12  # dense bf16 tensor FLOP/s with fp32 accumulation


def step_seconds(params: float, tokens: int, mfu: float) -> float:
    """An RTX 4090's inner step for a model of ``params`` parameters (the rule of the docstring)."""
    return 6 * params * tokens / (mfu * PEAK_4090)


def utilisation(round_s: float, step_s: float, sync_every: int) -> dict[str, float]:
    """``overlap_steps="auto"``'s tau and the utilisation it gives (module docstring)."""
    from ravnest_jax.tools._round_plan import CALIBRATION, default_cap

    cap = max(1, min(default_cap(sync_every), sync_every - 1))
    tau = min(max(1, math.ceil(1.25 * round_s / step_s)), cap)
    stall = max(0.0, round_s - tau * step_s)
    window = sync_every * step_s
    u = window / (window + stall + CALIBRATION.overhead["delayed"])
    blocking = window / (window + round_s + CALIBRATION.overhead["blocking"])
    return {"tau": tau, "stall_s": stall, "utilisation": u, "utilisation_blocking": blocking}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="1e6,1e7,1e8,1e9", help="comma-separated parameter counts")
    ap.add_argument("--codecs", default="fp32,int8,int4")
    ap.add_argument("--links", default=",".join(LINKS))
    ap.add_argument("--rounds", type=int, default=0, help="rounds per configuration (0: 4 below 1e8, else 2)")
    ap.add_argument(
        "--max-round-s", type=float, default=240.0, help="skip configurations whose link alone needs longer"
    )
    ap.add_argument("--tokens-per-step", type=int, default=16 * 2048)
    ap.add_argument("--mfu", type=float, default=0.35)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, skipped = [], []
    from ravnest_jax.tools._round_plan import message_bytes

    with tempfile.TemporaryDirectory() as tmp:
        for link_name in args.links.split(","):
            link = LINKS[link_name]
            for codec in args.codecs.split(","):
                for p in [int(float(x)) for x in args.params.split(",")]:
                    payload = 4 * p
                    # each of 2 peers moves half its message out as a part and half as a result
                    wire_s = 0.0 if link is None else message_bytes(p, codec) * 8 / (link[0] * 1e6)
                    if wire_s > args.max_round_s:
                        skipped.append(
                            {
                                "params": p,
                                "codec": codec,
                                "link": link_name,
                                "link_alone_s": wire_s,
                                "why": f"the link alone needs {wire_s:.0f} s a round (> --max-round-s)",
                            }
                        )
                        print(f"skip {link_name} {codec} {p:.0e}: {skipped[-1]['why']}", flush=True)
                        continue
                    rounds = args.rounds or (4 if p < 10**8 else 2)
                    t0 = time.monotonic()
                    res = swarm_run(2, payload, rounds, codec, Path(tmp), "butterfly", link=link, scale=1e-3)
                    per_round = [max(r[i]["seconds"] for r in res) for i in range(1, rounds)]
                    row = {
                        "params": p,
                        "codec": codec,
                        "link": link_name,
                        "mbit": None if link is None else link[0],
                        "rtt_ms": None if link is None else link[1],
                        "payload_float32_bytes": payload,
                        "round_s": statistics.median(per_round),
                        "round_s_all": per_round,
                        "cpu_s_per_peer": [statistics.median(r[i]["cpu_s"] for i in range(1, rounds)) for r in res],
                        "extra_rss_bytes": max(
                            statistics.median(r[i]["rss_peak"] - r[i]["rss_before"] for i in range(1, rounds))
                            for r in res
                        ),
                        "bytes_sent_per_peer": [r[-1]["sent"] for r in res],
                        "digests_equal": all(len({r[i]["digest"] for r in res}) == 1 for i in range(rounds)),
                        "all_ok": all(e["ok"] for r in res for e in r),
                        "wall_s": time.monotonic() - t0,
                    }
                    row["extra_rss_x_float32_payload"] = row["extra_rss_bytes"] / payload
                    step = step_seconds(p, args.tokens_per_step, args.mfu)
                    row["step_s_4090"] = step
                    row["utilisation"] = {str(h): utilisation(row["round_s"], step, h) for h in (100, 500)}
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "round_s_all"}), flush=True)
    result = {
        "benchmark": "bench_scale",
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "step_rule": f"step_s = 6 * params * {args.tokens_per_step} / ({args.mfu} * {PEAK_4090:.3g}) (RTX 4090, bf16)",
        "utilisation_rule": "tau = min(ceil(1.25 round / step), staleness cap); "
        "utilisation = H step / (H step + max(0, round - tau step) + delayed-mode host overhead)",
        "rows": rows,
        "skipped": skipped,
    }
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "scale.png")
    print(f"wrote {out / 'scale.json'} and {out / 'scale.png'}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"fp32": "o-", "int8": "s--", "int4": "^:"}
    colors = {"loopback": "C0", "1gbit": "C1", "100mbit": "C2"}
    for codec, link in sorted({(r["codec"], r["link"]) for r in result["rows"]}):
        rs = sorted((r for r in result["rows"] if r["codec"] == codec and r["link"] == link), key=lambda r: r["params"])
        x = [r["params"] for r in rs]
        axes[0].loglog(
            x, [r["round_s"] for r in rs], styles.get(codec, "o-"), color=colors.get(link), label=f"{codec}, {link}"
        )
        if link == "loopback":
            axes[1].loglog(x, [max(r["extra_rss_bytes"], 1) / MB for r in rs], styles.get(codec, "o-"), label=codec)
    axes[0].set(xlabel="parameters", ylabel="round time (s)", title="round time, 2 peers")
    axes[1].set(xlabel="parameters", ylabel="extra RSS during a round (MB)", title="host memory of a round (loopback)")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"bench_scale ({result['machine'].get('cpu_count')} CPUs, all peers on one machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
