#!/usr/bin/env python3
"""How long an async ``rj.Checkpointer.save`` blocks the training loop, vs one inner step.

Model: the char-LM example (``build_model(ModelConfig())``, ``make_loss``, ``inner_optimizer``)
wrapped in ``rj.diloco``, batch 16 x 64 bytes, a jitted step that donates params and state.
Each save writes params, the whole ``DiLoCoState`` and an ``extra`` (typed PRNG key, data
position).

Method: after compiling and one warm-up save, ``--reps`` repetitions each run two blocks of
``--block`` steps back to back (order alternating): a plain block, and a block whose second
step is followed by ``ckpt.save(...)``. Each block ends with ``block_until_ready``; the save is
then waited for (outside the blocks). Reported (medians over repetitions):

- ``blocked_seconds_per_save``: wall time of the ``save()`` call itself, that is how long the
  training loop's Python thread is held. Goal: <= one inner step.
- ``seconds_per_inner_step``: from the plain blocks.
- ``extra_block_seconds_per_save``: block-with-save minus the adjacent plain block: the whole
  cost to the loop, including the background write competing for CPU and the GIL.
- ``orbax_blocking_phase_seconds``: for reference, what ``ocp.CheckpointManager.save`` alone
  blocks for when called on the training thread (its device-to-host copy and setup), which is
  why ``rj.Checkpointer`` runs it on a background thread.

Writes ``benchmarks/results/checkpoint.json``.

    python benchmarks/bench_checkpoint.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import char_lm  # noqa: E402
import ravnest_jax as rj  # noqa: E402


def tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9, help="repetitions (saves)")
    ap.add_argument("--block", type=int, default=20, help="inner steps per timed block")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint.json"))
    args = ap.parse_args()

    cfg = char_lm.ModelConfig()
    graphdef, params = char_lm.build_model(cfg)
    loss = char_lm.make_loss(graphdef)
    tx = rj.diloco(char_lm.inner_optimizer(3e-3, 10_000), sync_every=50)
    state = tx.init(params)
    train, _ = char_lm.load_corpus(max_bytes=4 << 20)
    rng = np.random.default_rng(0)
    tokens = jax.device_put(char_lm.sample_batch(train, rng, args.batch_size, cfg.seq_len))

    @jax.jit
    def _step(params, state, tokens):
        grads = jax.grad(loss)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step_fn = jax.jit(_step, donate_argnums=(0, 1))
    key = jax.random.key(0)
    state_bytes = tree_bytes(params) + tree_bytes(state)

    load_start = os.getloadavg()
    tmp = None
    directory = args.dir
    if directory is None:
        tmp = tempfile.mkdtemp(prefix="bench_ckpt_")
        directory = tmp
    step = 0

    def run(n, ckpt=None, save_after=None):
        nonlocal params, state, step
        blocked = None
        t = time.perf_counter()
        for i in range(n):
            params, state = step_fn(params, state, tokens)
            step += 1
            if ckpt is not None and i == save_after:
                t0 = time.perf_counter()
                ok = ckpt.save(
                    step, params=params, opt_state=state, extra={"data_key": key, "data_position": step}, force=True
                )
                blocked = time.perf_counter() - t0
                assert ok
        jax.block_until_ready((params, state))
        return time.perf_counter() - t, blocked

    try:
        ckpt = rj.Checkpointer(Path(directory) / "rj", max_to_keep=2, metadata={"benchmark": "checkpoint"})
        run(5)  # compile
        _, first_blocked = run(3, ckpt, save_after=1)  # compiles the on-device snapshot copy
        t0 = time.perf_counter()
        ckpt.wait()
        first_wait = time.perf_counter() - t0

        plain, with_save, blocked, waits = [], [], [], []
        for rep in range(args.reps):
            order = ("plain", "save") if rep % 2 == 0 else ("save", "plain")
            for kind in order:
                if kind == "plain":
                    plain.append(run(args.block)[0])
                else:
                    dt, b = run(args.block, ckpt, save_after=1)
                    with_save.append(dt)
                    blocked.append(b)
                    t0 = time.perf_counter()
                    ckpt.wait()
                    waits.append(time.perf_counter() - t0)
        ckpt.close()

        # Reference: orbax's CheckpointManager called on the training thread.
        orbax_blocking = []
        mngr = ocp.CheckpointManager(
            Path(directory) / "orbax",
            options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True),
            item_names=("params", "opt_state"),
        )
        for _ in range(max(3, args.reps // 2)):
            run(2)
            t0 = time.perf_counter()
            mngr.save(
                step,
                args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(state)),
            )
            orbax_blocking.append(time.perf_counter() - t0)
            mngr.wait_until_finished()
        mngr.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    sec_per_step = statistics.median(plain) / args.block
    blocked_med = statistics.median(blocked)
    diffs = [s - p for s, p in zip(with_save, plain)]
    summary = {
        "benchmark": "checkpoint",
        "command": " ".join(["python", *sys.argv]),
        "machine": char_lm.machine_info(),
        "load_average_1_5_15min": {
            "start": load_start,
            "end": os.getloadavg(),
            "note": "CPUs shared with other jobs while measuring",
        },
        "model": {
            "config": vars(cfg) if hasattr(cfg, "__dict__") else str(cfg),
            "params": int(sum(x.size for x in jax.tree.leaves(params))),
            "batch_size": args.batch_size,
            "seq_len": cfg.seq_len,
            "bytes_saved_params_plus_opt_state": state_bytes,
        },
        "method": (
            f"{args.reps} repetitions; each a plain block and a block with one save after its 2nd step, "
            f"{args.block} steps per block, order alternating; medians"
        ),
        "seconds_per_inner_step": sec_per_step,
        "blocked_seconds_per_save": blocked_med,
        "blocked_over_inner_step": blocked_med / sec_per_step,
        "goal": "blocked_seconds_per_save <= seconds_per_inner_step",
        "goal_met": blocked_med <= sec_per_step,
        "extra_block_seconds_per_save": statistics.median(diffs),
        "extra_block_over_inner_step": statistics.median(diffs) / sec_per_step,
        "background_write_remaining_after_block_seconds": statistics.median(waits),
        "first_save": {
            "blocked_seconds": first_blocked,
            "then_wait_seconds": first_wait,
            "note": "includes compiling the on-device snapshot copy",
        },
        "orbax_blocking_phase_seconds": statistics.median(orbax_blocking),
        "raw": {
            "blocked_seconds": blocked,
            "plain_block_seconds": plain,
            "save_block_seconds": with_save,
            "wait_after_block_seconds": waits,
            "orbax_blocking_phase_seconds": orbax_blocking,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2, default=str))
    print(f"inner step                      {sec_per_step * 1e3:8.2f} ms")
    print(
        f"save() blocks the loop for      {blocked_med * 1e3:8.2f} ms  (goal <= one inner step: "
        f"{'met' if summary['goal_met'] else 'NOT met'})"
    )
    print(f"block with a save is longer by  {summary['extra_block_seconds_per_save'] * 1e3:8.2f} ms")
    print(f"orbax save() on the loop thread {summary['orbax_blocking_phase_seconds'] * 1e3:8.2f} ms (reference)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
