#!/usr/bin/env python3
"""Pipeline stages over emulated WAN links: per-stage utilisation and tokens/s.

    python benchmarks/bench_pipeline.py                          # the grid (~15 min on a quiet machine)
    python benchmarks/bench_pipeline.py --quick                  # one link, few steps: a smoke test
    python benchmarks/bench_pipeline.py --analog llama70b-4090   # a third of Llama-70B per RTX 4090

Setup (real library code, nothing of it patched):

- S stage peers, each its own process (spawned; one ``rj.pipeline.StagePeer`` each, with a real
  ``rj.Swarm`` and activation link), a real rendezvous (a thread of this process).
- Every byte crosses a throttling TCP proxy (``benchmarks/_common.py``, the one
  bench_utilization.py uses): stage ``i`` listens on ``P_i`` and tells its previous and next
  stage to reach it at two proxy ports (``StagePeer(advertise_to=...)``), so each direction of
  each link between neighbours is its own FIFO line of rate B and one-way delay RTT / 2
  (full duplex). The rendezvous is reached through a line of the same kind.
- The accelerator is emulated: each forward takes ``t_f`` and each backward ``t_b`` seconds
  (``StagePeer(compute_seconds=...)``: the real jitted op padded with sleep), and the model is a
  synthetic one whose activations have the real size (an embedding into ``d`` dimensions, a
  per-channel scale per block, a head to 256 classes): the bytes, the encode and decode on the
  host and the network are real, the FLOPs are not. The stated model and machine give
  ``t_f``/``t_b`` (the rule is in :func:`times_from_flops`).
- Configurations (int8 activations unless named): ``1f1b-sync`` (M micro-batches, flush every
  step), ``1f1b-async`` (no flush, ``rj.pipeline.ASYNC_MODE``), ``naive`` (one micro-batch a
  step, each stage waits for the others: plain model parallelism), ``1f1b-async-fp32``, and
  ``-deep`` variants (``1f1b-async-deep``): the schedule's depth ``StagePeer(in_flight=M + 1)``
  instead of 1F1B's S micro-batches in flight, so that stage 0 keeps computing while a
  micro-batch's round trip (its compute on all stages and ``2 (S - 1)`` transfers) is longer
  than S micro-batches of its compute: the case of slow links.
- ``one peer``: the same model on one machine with all stages' compute (the upper bound of a
  pipeline, which adds peers but never FLOPs): ``S * (t_f + t_b)`` per micro-batch, no
  transfers; computed, not measured (on one machine the emulated compute is the only cost).
- Each configuration runs ``--warmup`` steps, then ``--steps`` measured steps per link setting
  (the processes stay; the parent changes the links between segments). Tokens/s: the measured
  steps' tokens over the last stage's wall time; utilisation: each stage's busy / wall
  (``StageMetrics``). In the async mode each segment fills and drains the pipeline once.

Writes ``benchmarks/results/pipeline.json`` and ``pipeline.png`` (``pipeline_analog.*`` for the
analog). Timings on a shared machine are not results: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import LinkEmulator, free_port, machine_info, rendezvous_thread  # noqa: E402

TOKEN = "bench-pipeline-token"
RUN = "bench-pipeline"

# ------------------------------------------------------------------ the emulated machines
RTX_4090_BF16_TFLOPS = 165.2  # dense bf16 tensor-core peak with fp32 accumulate (NVIDIA's Ada whitepaper)


def times_from_flops(
    params: float, layers: int, hidden: int, tokens: int, seq: int, tflops: float, efficiency: float, lora: bool
) -> tuple[float, float]:
    """Emulated seconds of one stage's forward and backward of one micro-batch.

    Rule: a forward costs ``2 N`` FLOPs per token for the ``N`` parameters of the stage's matmuls
    plus attention's ``4 s d`` per layer and token (QK^T and AV at sequence length ``s``, width
    ``d``); a backward costs twice the forward with full training (gradients of the activations
    and of the weights) and once the forward with LoRA on a frozen base (no weight gradients of
    the base; the adapters' are negligible). Seconds = FLOPs / (peak TFLOPS x efficiency).
    """
    fwd = tokens * (2.0 * params + 4.0 * seq * hidden * layers)
    bwd = fwd * (1.0 if lora else 2.0)
    rate = tflops * 1e12 * efficiency
    return fwd / rate, bwd / rate


def grid_setup(args: argparse.Namespace) -> dict:
    """The grid's model: a 1.5B-parameter decoder (d 2048, 32 layers) in 3 stages of ~0.5B,
    micro-batches of 2 x 1024 tokens, full training, on a 40 TFLOPS-effective GPU."""
    t_f, t_b = times_from_flops(0.5e9, 11, 2048, 2048, 1024, 100.0, 0.40, lora=False)
    return {
        "name": "grid",
        "model": "1.5B decoder (d 2048, 32 layers) in 3 stages of ~0.5B; full training",
        "machine": "a GPU at 100 TFLOPS bf16 peak, 40% efficiency",
        "stages": 3,
        "hidden": 2048,
        "seq": 1024,
        "rows": 2,
        "micro_batches": 8,
        "t_f": t_f,
        "t_b": t_b,
        "links": [(100.0, 20.0), (100.0, 100.0), (1000.0, 20.0), (1000.0, 100.0)],
        "configs": ["1f1b-async", "1f1b-async-deep", "1f1b-sync", "naive", "1f1b-async-fp32"],
    }


def analog_setup(args: argparse.Namespace) -> dict:
    """A third of Llama-70B (80 layers, d 8192, 70.6B params) per RTX 4090, LoRA on a 4-bit
    frozen base (35 GB: no 24 GB card holds it whole), micro-batches of 2048 tokens."""
    t_f, t_b = times_from_flops(70.6e9 / 3, 80 // 3, 8192, 2048, 2048, RTX_4090_BF16_TFLOPS, args.efficiency, lora=True)
    return {
        "name": "llama70b-4090",
        "model": "Llama-70B in 3 stages of ~23.5B (about 27 layers), LoRA on a frozen 4-bit base",
        "machine": f"RTX 4090: {RTX_4090_BF16_TFLOPS} TFLOPS bf16 peak at {args.efficiency:.0%} efficiency",
        "stages": 3,
        "hidden": 8192,
        "seq": 2048,
        "rows": 1,
        "micro_batches": args.micro_batches or 8,
        "t_f": t_f,
        "t_b": t_b,
        "links": [(100.0, 50.0)],
        "configs": ["1f1b-async", "1f1b-async-deep", "1f1b-sync"],
    }


# ------------------------------------------------------------------ the synthetic model (child side)
def synthetic_split(hidden: int, blocks: int, seq: int):
    """A model with real-size activations and almost no compute: embedding (256 -> hidden), per
    block a per-channel scale, a head (hidden -> 256). Follows rj.pipeline.LayerSplit's contract."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import ravnest_jax as rj

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.scale = nnx.Param(jnp.ones((hidden,), jnp.float32))

        def __call__(self, x):
            return x * self.scale[...]

    class Model(nnx.Module):
        stage_ends = (True, True)

        def __init__(self, rngs):
            self.embed = nnx.Embed(256, hidden, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])
            self.head = nnx.Linear(hidden, 256, use_bias=False, rngs=rngs)

        def __call__(self, x):
            first, last = self.stage_ends
            if first:
                x = self.embed(x)
            for b in self.blocks:
                if b is not None:
                    x = b(x)
            return self.head(x) if last else x

    del jax
    return rj.pipeline.LayerSplit(Model(nnx.Rngs(0)), blocks="blocks", prologue=("embed",), epilogue=("head",))


def stage_main(cfg: dict, s: int, ports: dict, barrier, results) -> None:  # pragma: no cover - child
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    import numpy as np
    import optax

    import ravnest_jax as rj

    S = cfg["stages"]
    split = synthetic_split(cfg["hidden"], S, cfg["seq"])  # units: embed, S blocks, head
    bounds = [(0, 2)] + [(i + 1, i + 2) for i in range(1, S - 1)] + [(S, S + 2)]
    plan = rj.pipeline.StagePlan(tuple(bounds), tuple(1.0 for _ in bounds), "bytes", split.unit_names)
    cfg_mode = cfg["config"]
    M = 1 if cfg_mode == "naive" else cfg["micro_batches"]
    mode = "sync" if cfg_mode == "naive" or cfg_mode.startswith("1f1b-sync") else "async"
    codec = "fp32" if cfg_mode.endswith("fp32") else "int8"
    in_flight = (cfg.get("deep_in_flight") or M + 1) if "-deep" in cfg_mode else None
    advertise_to = {}
    if s > 0:
        advertise_to["prev"] = f"http://127.0.0.1:{ports['in'][(s - 1, s)]}"
    if s < S - 1:
        advertise_to["next"] = f"http://127.0.0.1:{ports['in'][(s + 1, s)]}"
    peer = rj.pipeline.StagePeer(
        split,
        plan,
        optax.sgd(1e-3),
        stage=s,
        micro_batches=M,
        mode=mode,
        in_flight=in_flight,
        codec=codec,
        rendezvous_url=f"http://127.0.0.1:{ports['rendezvous']}",
        run_id=f"{RUN}-{cfg_mode}",
        token=TOKEN,
        listen=f"127.0.0.1:{ports['listen'][s]}",
        peer_id=f"stage{s}",
        timeouts=rj.Timeouts(connect=10.0, part=120.0, round=600.0, heartbeat=2.0, eviction=30.0),
        recv_timeout=600.0,
        start_timeout=600.0,
        recover=False,
        compute_seconds=(cfg["t_f"], cfg["t_b"]),
        advertise_to=advertise_to,
    )
    rows = cfg["rows"] * M
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (rows, cfg["seq"] + 1)).astype(np.int32)
    with peer:
        peer.prepare(rows, cfg["seq"])
        step = 0
        peer.run(cfg["warmup"], lambda t: tokens)
        step = cfg["warmup"]
        for k in range(len(cfg["links"])):
            barrier.wait()  # the parent set link k
            before = peer.metrics.as_dict()
            t0 = time.perf_counter()
            peer.run(step + cfg["steps"], lambda t: tokens)
            wall = time.perf_counter() - t0
            step += cfg["steps"]
            after = peer.metrics.as_dict()
            d = {
                key: after[key] - before[key] for key in ("busy_seconds", "wait_seconds", "wall_seconds", "bytes_sent")
            }
            results.put(
                {
                    "config": cfg_mode,
                    "link": k,
                    "stage": s,
                    "wall": wall,
                    "busy": d["busy_seconds"],
                    "wait": d["wait_seconds"],
                    "stage_wall": d["wall_seconds"],
                    "bytes_sent": d["bytes_sent"],
                    "utilisation": d["busy_seconds"] / max(d["wall_seconds"], 1e-9),
                    "tokens": cfg["steps"] * rows * cfg["seq"],
                }
            )
            barrier.wait()  # every stage finished the segment


# ------------------------------------------------------------------ the parent
def run_config(setup: dict, config: str, args: argparse.Namespace) -> list[dict]:
    S = setup["stages"]
    listen = [free_port() for _ in range(S)]
    rv_port = free_port()
    # routes: into stage j from its neighbour i (data i -> j on line (i, j), answers on (j, i)),
    # and into the rendezvous (a line pair of its own)
    pairs = [(i, i + 1) for i in range(S - 1)] + [(i + 1, i) for i in range(S - 1)]
    line = {p: k for k, p in enumerate(pairs)}
    rv_lines = (len(pairs), len(pairs) + 1)
    routes = [(listen[j], line[(i, j)], line[(j, i)]) for i, j in pairs] + [(rv_port, *rv_lines)]
    emu = LinkEmulator(routes, len(pairs) + 2)
    ports = {"listen": listen, "in": {p: emu.ports[k] for k, p in enumerate(pairs)}, "rendezvous": emu.ports[-1]}
    cfg = {**setup, "config": config, "warmup": args.warmup, "steps": args.steps}
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(S + 1)
    results = ctx.Queue()
    out: list[dict] = []
    mbit, rtt = setup["links"][0]
    emu.set_all(mbit, rtt)
    with rendezvous_thread(TOKEN, port=rv_port, heartbeat=2.0, eviction=30.0):
        procs = [ctx.Process(target=stage_main, args=(cfg, s, ports, barrier, results), daemon=True) for s in range(S)]
        for p in procs:
            p.start()
        try:
            for mbit, rtt in setup["links"]:
                emu.set_all(mbit, rtt)
                barrier.wait(timeout=1800)
                rows = []
                for _ in range(S):
                    rows.append(results.get(timeout=3600))
                barrier.wait(timeout=600)
                rows.sort(key=lambda r: r["stage"])
                last = rows[-1]
                cell = {
                    "config": config,
                    "measured_steps": args.steps,
                    "in_flight": (setup.get("deep_in_flight") or setup["micro_batches"] + 1)
                    if "-deep" in config
                    else setup["stages"],
                    "mbit": mbit,
                    "rtt_ms": rtt,
                    "tokens_per_s": last["tokens"] / last["wall"],
                    "utilisation": [r["utilisation"] for r in rows],
                    "mean_utilisation": sum(r["utilisation"] for r in rows) / S,
                    "activation_bytes_per_stage": [r["bytes_sent"] for r in rows],
                    "stages": rows,
                }
                print(
                    f"{config:<17} {mbit:>6.0f} Mbit/s RTT {rtt:>4.0f} ms: {cell['tokens_per_s']:9.1f} tok/s, "
                    f"utilisation {' '.join(f'{u:.2f}' for u in cell['utilisation'])}",
                    flush=True,
                )
                out.append(cell)
            for p in procs:
                p.join(120)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(10)
            emu.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--analog", choices=["llama70b-4090"], default=None)
    ap.add_argument("--efficiency", type=float, default=0.40, help="the analog's fraction of the GPU's peak")
    ap.add_argument("--micro-batches", type=int, default=None)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per link setting")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", default=None, help="comma-separated subset of the configurations")
    ap.add_argument("--deep-in-flight", type=int, default=None, help="the -deep configurations' depth (default M + 1)")
    ap.add_argument("--quick", action="store_true", help="one link, 2 steps, small activations")
    ap.add_argument(
        "--links", default=None, help="comma-separated MBIT:RTT_MS subset, e.g. 1000:20 (default: the grid's)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup = analog_setup(args) if args.analog else grid_setup(args)
    if args.quick:  # a smoke test: small activations, compute scaled down with the tokens
        scale = min(setup["seq"], 256) / setup["seq"]
        setup.update(links=setup["links"][:1], hidden=min(setup["hidden"], 512), seq=min(setup["seq"], 256))
        setup.update(t_f=setup["t_f"] * scale, t_b=setup["t_b"] * scale)
        args.steps, args.warmup = 2, 1
    if args.configs:
        setup["configs"] = args.configs.split(",")
    if args.links:
        setup["links"] = [tuple(float(v) for v in x.split(":")) for x in args.links.split(",")]
    if args.deep_in_flight:
        setup["deep_in_flight"] = args.deep_in_flight
    S = setup["stages"]
    micro_tokens = setup["rows"] * setup["seq"]
    one_peer = micro_tokens / (S * (setup["t_f"] + setup["t_b"]))
    print(
        f"{setup['model']}; {setup['machine']}: t_f {setup['t_f'] * 1e3:.0f} ms, t_b {setup['t_b'] * 1e3:.0f} ms per "
        f"micro-batch of {micro_tokens} tokens per stage; one peer with all stages: {one_peer:.1f} tok/s",
        flush=True,
    )
    name = "pipeline_analog" if args.analog else "pipeline"
    out = Path(args.out) if args.out else HERE / "results" / f"{name}.json"
    cells = _kept_cells(out, setup) if args.configs else []  # a rerun of some configurations
    for config in setup["configs"]:
        cells += run_config(setup, config, args)
    for c in cells:
        c["vs_one_peer"] = c["tokens_per_s"] / one_peer
        naive = next(
            (n for n in cells if n["config"] == "naive" and (n["mbit"], n["rtt_ms"]) == (c["mbit"], c["rtt_ms"])), None
        )
        c["vs_naive"] = c["tokens_per_s"] / naive["tokens_per_s"] if naive else None
    summary = {
        "title": f"pipeline stages over emulated links ({setup['name']})",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "setup": {
            **{k: v for k, v in setup.items() if k != "links"},
            "configs": list(dict.fromkeys(c["config"] for c in cells)),
        },
        "links": setup["links"],
        "one_peer_tokens_per_s": one_peer,
        "cells": cells,
        "goals": {
            "utilisation >= 0.8 at 1 Gbit/s with int8 (1f1b-async, depth S; -deep: M + 1)": [
                (c["config"], c["rtt_ms"], round(min(c["utilisation"]), 3))
                for c in cells
                if c["config"] in ("1f1b-async", "1f1b-async-deep") and c["mbit"] >= 1000
            ],
            ">= 3x naive at 100 Mbit/s (1f1b-async, depth S; -deep: M + 1)": [
                (c["config"], c["rtt_ms"], None if c["vs_naive"] is None else round(c["vs_naive"], 2))
                for c in cells
                if c["config"] in ("1f1b-async", "1f1b-async-deep") and c["mbit"] <= 100
            ],
            "analog: >= 50% of one machine's tokens/s": [
                (c["config"], round(c["vs_one_peer"], 3)) for c in cells if args.analog
            ],
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    _plot(summary, out.with_suffix(".png"))
    return 0


def _kept_cells(out: Path, setup: dict) -> list[dict]:
    """The cells of an earlier run written to ``out`` with the same setup, except the
    configurations this run measures again (``--configs``): a rerun replaces those only."""
    try:
        old = json.loads(out.read_text())
    except (OSError, ValueError):
        return []
    same = all(old.get("setup", {}).get(k) == setup[k] for k in ("stages", "hidden", "seq", "rows", "t_f", "t_b"))
    if not same or [list(x) for x in old.get("links", [])] != [list(x) for x in setup["links"]]:
        print(f"{out}: an earlier run with another setup; not kept")
        return []
    kept = [c for c in old.get("cells", []) if c["config"] not in setup["configs"]]
    print(f"kept {len(kept)} cells of {out} ({sorted({c['config'] for c in kept})})")
    return kept


def _plot(summary: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot (pip install matplotlib)")
        return
    cells = summary["cells"]
    links = [tuple(x) for x in summary["links"]]
    configs = list(dict.fromkeys(c["config"] for c in cells))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(configs), 1)
    for k, cfg in enumerate(configs):
        tps = [
            next((c["tokens_per_s"] for c in cells if c["config"] == cfg and (c["mbit"], c["rtt_ms"]) == ln), 0)
            for ln in links
        ]
        util = [
            next((c["mean_utilisation"] for c in cells if c["config"] == cfg and (c["mbit"], c["rtt_ms"]) == ln), 0)
            for ln in links
        ]
        xs = [i + k * width for i in range(len(links))]
        axes[0].bar(xs, tps, width, label=cfg)
        axes[1].bar(xs, util, width, label=cfg)
    axes[0].axhline(summary["one_peer_tokens_per_s"], color="k", ls="--", lw=1, label="one peer, all stages")
    for ax, title in zip(axes, ("tokens/s", "mean stage utilisation")):
        ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(links))])
        ax.set_xticklabels([f"{m:.0f} Mbit/s\nRTT {r:.0f} ms" for m, r in links])
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    axes[1].set_ylim(0, 1)
    fig.suptitle(summary["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
