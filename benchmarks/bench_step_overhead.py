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


def round_device_memory(tx, params, state, codec: str) -> dict:
    """Device memory of one host-driven round with ``codec``, as :class:`ravnest_jax.sync.OuterSync`
    runs it: the jitted ``start`` (snapshot, pseudo-gradient, device encode with error feedback),
    the message fetched to the host, the float32 mean put back on the device (here: the
    pseudo-gradient itself, standing in for the swarm's mean), and the jitted ``merge`` (outer
    step, digest), on fresh copies of ``params``/``state``.

    Returns a dict of bytes: ``param_bytes`` (float32 params), ``residual_bytes`` (the error-feedback
    residual a lossy codec keeps on the device between rounds), ``extra_bytes`` (peak during the
    round minus in use before it, residual excluded) and ``extra_over_params``; ``extra_bytes`` is
    ``None`` on a backend without memory statistics (the CPU)."""
    import numpy as np

    from ravnest_jax.sync._pipeline import RoundFunctions, put_like

    dev = jax.devices()[0]
    leaves = jax.tree.leaves(params)
    param_bytes = int(sum(x.size * x.dtype.itemsize for x in leaves))
    fns = RoundFunctions(tx, codec, {}, keep_local_progress=True)
    start, merge = fns.start(0, None), fns.merge(0, None)
    p, s = jax.tree.map(lambda x: x.copy(), (params, state))
    residual = None if codec == "fp32" else [jax.numpy.zeros_like(x) for x in leaves]
    residual_bytes = 0 if residual is None else param_bytes
    jax.block_until_ready((p, s, residual))
    stats = dev.memory_stats()
    before = stats["bytes_in_use"] if stats else None
    snap, packed, residual = start(p, s, residual, jax.random.key(0))
    host = jax.device_get(packed)
    del packed
    mean_host = [np.asarray(x, np.float32) for x in jax.device_get(jax.tree.leaves(snap.pseudo_gradient))]
    mean = put_like(mean_host, leaves)
    p, s, digest = merge(p, s, mean, snap, 0.0)
    jax.block_until_ready((p, s, digest))
    out = {"codec": codec, "param_bytes": param_bytes, "residual_bytes": residual_bytes}
    out["message_bytes"] = int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(host.parts)))
    if not stats:
        return {**out, "extra_bytes": None, "note": f"no memory statistics on {dev.platform}"}
    peak = dev.memory_stats()["peak_bytes_in_use"]
    return {
        **out,
        "before_bytes": int(before),
        "peak_bytes": int(peak),
        "extra_bytes": int(peak - before),
        "extra_over_params": (peak - before) / param_bytes,
    }


def round_memory_in_child(codec: str) -> dict:
    """:func:`round_device_memory` in a fresh process with this run's arguments (the peak statistic
    of a device never goes down within a process, so each codec gets its own)."""
    import subprocess

    argv = [a for a in sys.argv[1:]]
    if "--round-codecs" in argv:  # drop "--round-codecs A B ..." (up to the next option)
        i = argv.index("--round-codecs")
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        del argv[i:j]
    cmd = [sys.executable, __file__, *argv, "--round-codecs", "--round-memory-of", codec]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"round memory of {codec}: the child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--block", type=int, default=10, help="steps per timed block")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--d-model", type=int, default=None, help="model width (default: the example's)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument(
        "--round-codecs", nargs="*", default=["fp32", "int4"], help="codecs whose round's device memory is measured"
    )
    ap.add_argument("--round-memory-of", default=None, help=argparse.SUPPRESS)  # child: one codec's round
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_overhead.json"))
    args = ap.parse_args()

    sizes = {"d_model": args.d_model, "num_layers": args.layers, "num_heads": args.heads, "seq_len": args.seq_len}
    cfg = char_lm.ModelConfig(**{k: v for k, v in sizes.items() if v is not None})
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

    if args.round_memory_of:  # a child process: the device's peak statistic is per process
        print(
            json.dumps(
                round_device_memory(dl_tx, runs["diloco_adamw"][1], runs["diloco_adamw"][2], args.round_memory_of)
            )
        )
        return
    round_memory = {c: round_memory_in_child(c) for c in args.round_codecs}

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
        "round_device_memory": round_memory,
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
    for c, m in round_memory.items():
        if m.get("extra_bytes") is not None:
            print(
                f"round {c:5s}   extra device memory {m['extra_bytes'] / 2**20:.1f} MiB = "
                f"{m['extra_over_params']:.2f}x the float32 params ({m['param_bytes'] / 2**20:.1f} MiB)"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
