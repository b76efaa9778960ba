#!/usr/bin/env python3
"""Cost of rj.diloco on the hot path: a jitted inner step with ``rj.diloco(adamw)`` vs plain
``adamw`` on the same model (the char-LM example), interleaved in one process, plus the cost of
one outer step (``round_start`` + ``round_merge``, host-driven mode).

Method: both steps are compiled first; then ``--reps`` repetitions each time ``--block`` steps of
plain AdamW and ``--block`` steps of DiLoCo back to back (order alternating per repetition),
each block closed with ``block_until_ready``. The ratio (goal <= 1.02) is the median over
repetitions of the two adjacent blocks' ratio, which cancels slow changes of machine load; the
median per-step time of each is reported too. Writes ``benchmarks/results/step_overhead.json``.

    python benchmarks/bench_step_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import char_lm  # noqa: E402
import ravnest_jax as rj  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--block", type=int, default=10, help="steps per timed block")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_overhead.json"))
    args = ap.parse_args()

    cfg = char_lm.ModelConfig()
    graphdef, params0 = char_lm.build_model(cfg)
    loss = char_lm.make_loss(graphdef)
    train, _ = char_lm.load_corpus(max_bytes=4 << 20)
    rng = np.random.default_rng(0)
    tokens = jax.device_put(char_lm.sample_batch(train, rng, args.batch_size, cfg.seq_len))

    def make_step(tx):
        def step(params, state, tokens):
            grads = jax.grad(loss)(params, tokens)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return jax.jit(step, donate_argnums=(0, 1))

    plain_tx = optax.adamw(1e-3)
    dl_tx = rj.diloco(optax.adamw(1e-3), sync_every=args.sync_every)
    runs = {
        "adamw": [make_step(plain_tx), jax.tree.map(lambda x: x.copy(), params0), None],
        "diloco_adamw": [make_step(dl_tx), jax.tree.map(lambda x: x.copy(), params0), None],
    }
    runs["adamw"][2] = plain_tx.init(runs["adamw"][1])
    runs["diloco_adamw"][2] = dl_tx.init(runs["diloco_adamw"][1])

    def block(name, n):
        step, p, s = runs[name]
        t = time.perf_counter()
        for _ in range(n):
            p, s = step(p, s, tokens)
        jax.block_until_ready((p, s))
        runs[name][1:] = [p, s]
        return (time.perf_counter() - t) / n

    for name in runs:  # compile + warm up
        block(name, 3)
    times = {name: [] for name in runs}
    order = list(runs)
    for rep in range(args.reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            times[name].append(block(name, args.block))

    # outer step (host-driven): round_start + round_merge, jitted, on the live DiLoCo state
    start, merge = jax.jit(dl_tx.round_start), jax.jit(dl_tx.round_merge)
    _, p, s = runs["diloco_adamw"]
    snap = start(p, s)
    p2, s2 = merge(p, s, snap.pseudo_gradient, snap)
    jax.block_until_ready((p2, s2))
    outer = []
    for _ in range(args.reps):
        t = time.perf_counter()
        snap = start(p, s)
        out = merge(p, s, snap.pseudo_gradient, snap)
        jax.block_until_ready(out)
        outer.append(time.perf_counter() - t)

    med = {k: statistics.median(v) for k, v in times.items()}
    # paired estimate: the two blocks of one repetition ran back to back under the same load
    paired = [d / a for d, a in zip(times["diloco_adamw"], times["adamw"])]
    ratio = statistics.median(paired)
    outer_med = statistics.median(outer)
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    result = {
        "benchmark": "step_overhead",
        "command": " ".join(["python", *sys.argv]),
        "machine": char_lm.machine_info(),
        "model": {"config": vars(cfg), "params": int(n_params), "batch_size": args.batch_size},
        "method": f"{args.reps} interleaved repetitions of {args.block}-step blocks; median seconds/step",
        "seconds_per_step": med,
        "per_block_seconds_per_step": times,
        "ratio_diloco_over_adamw": ratio,
        "ratio_estimator": "median over repetitions of (DiLoCo block time / adjacent AdamW block time)",
        "ratio_of_medians": med["diloco_adamw"] / med["adamw"],
        "goal_ratio": 1.02,
        "goal_met": ratio <= 1.02,
        "outer_step_seconds": outer_med,
        "outer_step_over_inner_step": outer_med / med["adamw"],
        "outer_step_amortised_per_inner_step_at_H": {
            "H": args.sync_every,
            "fraction": outer_med / (args.sync_every * med["adamw"]),
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"adamw        {med['adamw'] * 1e3:8.3f} ms/step")
    print(f"diloco(adamw) {med['diloco_adamw'] * 1e3:7.3f} ms/step   ratio {ratio:.4f} (goal <= 1.02)")
    print(
        f"outer step   {outer_med * 1e3:8.3f} ms  = {outer_med / med['adamw']:.2f} inner steps; "
        f"{100 * result['outer_step_amortised_per_inner_step_at_H']['fraction']:.2f}% per step at H={args.sync_every}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
