#!/usr/bin/env python3
"""Eval loss at equal tokens for each outer-sync mode against data-parallel, on the char LM.

    python benchmarks/bench_convergence.py               # 2 seeds, ~15-25 min on 2 loaded cores
    python benchmarks/bench_convergence.py --seeds 0     # one seed
    python benchmarks/bench_convergence.py --sweep --seeds 0 1 2 --steps 2000 \
        --sweep-group length outer inner codec muon --jobs 2   # the simulation sweep (_sweep.py)

Each seed, at the same tokens (4 peers/replicas x ``--steps`` x batch 8 x 64 bytes), same model
init and the same data streams (replica r draws from ``default_rng([seed, r])`` as in the
example's simulation):

- ``data_parallel``: the example's ``train_data_parallel`` (one model, global batch 4 x 8).
- ``blocking_sim``: the replica simulation, ``rj.diloco(axis_name="replica", codec="int4")``
  under ``jax.vmap`` (a cross-check of the swarm's blocking run).
- ``blocking``, ``delayed_tau1``, ``eager_tau1``, ``fragments_int4`` (F=2, delayed, tau=1):
  4 peers (threads of this process), each a real ``rj.Swarm`` on 127.0.0.1 with codec int4 and a
  real ``rj.OuterSync`` (error feedback on), a real rendezvous.
- ``naive_delay``: the naive one-round delay of the eager-updates paper (arXiv 2502.12996):
  round r's averaged pseudo-gradient is applied to the anchor at round r+1's boundary and the
  local params restart from that anchor, without rebasing on the round they were computed for.
  Driven here with the library's jitted pieces (``tx.round_start``, ``tx.outer_step``, the
  device int4 encoder with error feedback, as ``OuterSync`` does) over the same real swarm.

All DiLoCo runs: H = ``--sync-every`` (50), outer Nesterov lr 0.7 momentum 0.9, inner AdamW
(warmup + cosine) as in the example. Reported: eval loss (nats/byte) of the final global params
(after the last round is merged), the relative difference to blocking DiLoCo and to
data-parallel, per seed and the mean over seeds. Writes ``benchmarks/results/convergence.json``
(rewritten after every run) and ``convergence.png``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(HERE))

from _common import machine_info, rendezvous_thread  # noqa: E402

TOKEN = "bench-convergence-token"
SWARM_MODES = ("blocking", "delayed_tau1", "eager_tau1", "fragments_int4", "naive_delay")
MODES = ("data_parallel", "blocking_sim", *SWARM_MODES)


def check_mode(mode: str) -> str:
    if mode in MODES or (
        mode.startswith(("delayed_tau", "eager_tau"))
        and mode.rsplit("_tau", 1)[1].isdigit()
        and int(mode.rsplit("_tau", 1)[1]) >= 1
    ):
        return mode
    raise argparse.ArgumentTypeError(f"unknown mode {mode!r}")


def run_swarm_mode(mode: str, args, url: str, graphdef, params0, train, seed: int, log) -> dict:
    """``mode`` on ``args.peers`` real swarm peers; returns eval-ready global params + stats."""
    import jax
    import jax.numpy as jnp
    import optax

    import char_lm
    import ravnest_jax as rj
    from ravnest_jax import compress
    from ravnest_jax.swarm import Swarm, Timeouts

    n, h = args.peers, args.sync_every
    loss_fn = char_lm.make_loss(graphdef)
    tx = rj.diloco(
        char_lm.inner_optimizer(args.lr, args.steps),
        sync_every=h,
        fragments=args.fragments if mode == "fragments_int4" else 1,
    )

    @jax.jit
    def train_step(params, state, tokens):
        value, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    # naive one-round delay: the library's pieces, as OuterSync's start function uses them
    @jax.jit
    def naive_start(params, state, residual, key):
        snap = tx.round_start(params, state)
        flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(snap.pseudo_gradient)])
        packed, new_res = compress.device_encode({"pg": flat}, "int4", key=key, residual={"pg": residual})
        return packed, new_res["pg"]

    @jax.jit
    def naive_apply(state, mean_flat):
        leaves, treedef = jax.tree.flatten(state.global_params)
        out, off = [], 0
        for x in leaves:
            out.append(mean_flat[off : off + x.size].reshape(x.shape))
            off += x.size
        state = tx.outer_step(state, jax.tree.unflatten(treedef, out))
        return jax.tree.map(lambda g: g + 0.0, state.global_params), state

    timeouts = Timeouts(connect=10, part=120, grace=1, round=600, heartbeat=1, eviction=30)
    run_id = f"conv-{mode}-{seed}-{time.monotonic_ns()}"
    swarms = [
        Swarm(url, run_id=run_id, token=TOKEN, codec="int4", listen="127.0.0.1:0", timeouts=timeouts, peer_id=f"p{i}")
        for i in range(n)
    ]

    def peer(i: int) -> dict:
        swarm = swarms[i]
        rng = np.random.default_rng([seed, i])
        params = params0
        state = tx.init(params)
        losses = []
        if mode == "naive_delay":
            residual = jnp.zeros((sum(x.size for x in jax.tree.leaves(params)),), jnp.float32)
            prev = None
            rounds = 0
            for t in range(1, args.steps + 1):
                tok = char_lm.sample_batch(train, rng, args.batch_size, args.seq_len)
                params, state, value = train_step(params, state, tok)
                if t % 10 == 0:
                    losses.append(float(value))
                if t % h == 0:
                    packed, residual = naive_start(
                        params, state, residual, jax.random.fold_in(jax.random.key(0), rounds)
                    )
                    vec = compress.decode(compress.packed_to_bytes(jax.device_get(packed)))["pg"]
                    fut = swarm.all_reduce_async({"pg": vec}, weight=float(h * args.batch_size))
                    rounds += 1
                    if prev is not None:
                        mean, _ = prev.result(timeout=600)
                        params, state = naive_apply(state, jnp.asarray(mean["pg"]))
                    else:
                        params = jax.tree.map(lambda g: g + 0.0, state.global_params)  # round 0: restart from A_0
                    prev = fut
            if prev is not None:
                mean, _ = prev.result(timeout=600)
                params, state = naive_apply(state, jnp.asarray(mean["pg"]))
            return {"global": jax.device_get(state.global_params), "losses": losses, "rounds": rounds, "failed": 0}
        with syncs[i] as sync:
            for t in range(1, args.steps + 1):
                tok = char_lm.sample_batch(train, rng, args.batch_size, args.seq_len)
                params, state, value = train_step(params, state, tok)
                params, state = sync(params, state)
                if t % 10 == 0:
                    losses.append(float(value))
            params, state = sync.flush(params, state)
            s = sync.summary()
            return {
                "global": jax.device_get(state.global_params),
                "losses": losses,
                "rounds": s["rounds"],
                "failed": s["failed_rounds"],
                "digest": s["last_state_digest"],
            }

    # compile once in this thread: the train step, and the round functions of one OuterSync whose
    # jit cache the other peers' OuterSyncs share (same tx, codec and mode, so the same closures;
    # a harness shortcut that only saves compile time)
    tok = char_lm.sample_batch(train, np.random.default_rng(99), args.batch_size, args.seq_len)
    train_step.lower(params0, tx.init(params0), tok).compile()
    syncs = []
    if mode != "naive_delay":
        sync_mode = "blocking" if mode == "blocking" else ("eager" if mode.startswith("eager") else "delayed")
        tau = 0 if mode == "blocking" else (int(mode.rsplit("_tau", 1)[1]) if "_tau" in mode else 1)
        syncs = [
            rj.OuterSync(tx, s, eager=sync_mode == "eager", overlap_steps=tau, samples_per_step=args.batch_size)
            for s in swarms
        ]
        for s in syncs[1:]:
            s._fns.cache = syncs[0]._fns.cache
        syncs[0].warmup(params0, tx.init(params0))
    try:
        for s in swarms:
            s.start()
        swarms[0].wait_for_peers(n, timeout=60)
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            res = [f.result() for f in [pool.submit(peer, i) for i in range(n)]]
    finally:
        for s in swarms:
            s.close()
    digests = {r.get("digest") for r in res}
    return {
        "global": res[0]["global"],
        "rounds": res[0]["rounds"],
        "failed_rounds": sum(r["failed"] for r in res),
        "digests_equal": len(digests) == 1,
        "train_loss_curve": [float(np.mean(x)) for x in zip(*[r["losses"] for r in res])],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    modes = [m for m in result["modes"] if any(r["mode"] == m for r in result["runs"])]
    seeds = sorted({r["seed"] for r in result["runs"]})
    for k, seed in enumerate(seeds):
        xs, ys = [], []
        for j, m in enumerate(modes):
            rs = [r for r in result["runs"] if r["mode"] == m and r["seed"] == seed]
            if rs:
                xs.append(j + 0.15 * (k - (len(seeds) - 1) / 2))
                ys.append(rs[0]["eval_loss"])
        a1.scatter(xs, ys, label=f"seed {seed}", zorder=3)
    for j, m in enumerate(modes):
        v = [r["eval_loss"] for r in result["runs"] if r["mode"] == m]
        a1.hlines(np.mean(v), j - 0.3, j + 0.3, color="k")
    a1.set_xticks(range(len(modes)), modes, rotation=30, ha="right", fontsize=8)
    a1.set_ylabel("eval loss (nats/byte), final global params")
    a1.set_title(f"equal tokens ({result['config']['tokens_per_run'] / 1e6:.1f}M); bar = mean over seeds")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    seed0 = seeds[0]
    for m in modes:
        rs = [r for r in result["runs"] if r["mode"] == m and r["seed"] == seed0 and r.get("train_loss_curve")]
        if rs:
            c = rs[0]["train_loss_curve"]
            a2.plot(np.arange(1, len(c) + 1) * 10, c, label=m, lw=1)
    a2.set_xlabel("inner step")
    a2.set_ylabel("train loss (mean over peers, local params)")
    a2.set_title(f"seed {seed0}: train loss")
    a2.set_ylim(top=3.5)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        type=check_mode,
        help=f"of {MODES}, or delayed_tauN / eager_tauN (int4, overlap N steps)",
    )
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument(
        "--out", default=None, help="default results/convergence.json (convergence_sweep.json with --sweep)"
    )
    ap.add_argument("--sweep", action="store_true", help="the simulation sweep of benchmarks/_sweep.py instead")
    ap.add_argument("--sweep-group", nargs="+", default=["length"], help="of length outer inner sync_every codec muon")
    ap.add_argument(
        "--sweep-cell", action="append", help="--sweep: an extra cell, e.g. outer_momentum=0.8,sync_every=25"
    )
    ap.add_argument("--jobs", type=int, default=1, help="--sweep: cells run at a time (worker processes)")
    ap.add_argument("--eval-every", type=int, default=100, help="--sweep: steps between evals of the curve")
    ap.add_argument("--sweep-report", nargs="+", default=None, help="merge sweep JSON files into --out (no training)")
    ap.add_argument(
        "--codec-report",
        nargs="+",
        default=None,
        help="compressed against fp32 DiLoCo from sweep JSON files, with the bytes, into --out (no training)",
    )
    args = ap.parse_args()
    if args.codec_report:
        import _codec_report

        out = Path(args.out or HERE / "results" / "convergence_codecs_gpu.json")
        return _codec_report.codec_report(args.codec_report, out, machine_info)
    if args.sweep_report:
        import _sweep

        out = Path(args.out or HERE / "results" / "convergence_sweep.json")
        return _sweep.report_main(args.sweep_report, out, machine_info)
    if args.sweep:
        import _sweep

        args.sweep_group = [] if args.sweep_cell and args.sweep_group == ["length"] else args.sweep_group
        bad = [g for g in args.sweep_group if g not in _sweep.GROUPS]
        if bad:
            ap.error(f"--sweep-group: unknown {bad}; known: {' '.join(_sweep.GROUPS)}")
        out = Path(args.out or HERE / "results" / "convergence_sweep.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        return _sweep.sweep_main(args, out, machine_info)
    args.out = args.out or str(HERE / "results" / "convergence.json")

    import char_lm

    def log(msg: str) -> None:
        print(msg, flush=True)

    cfg = char_lm.ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len)
    train, evald = char_lm.load_corpus(None)
    evaluate = char_lm.make_evaluator(
        char_lm.build_model(cfg, 0)[0],
        char_lm.eval_batches(evald, batch=32, seq_len=cfg.seq_len, num_batches=args.eval_batches),
    )
    tokens = args.steps * args.peers * args.batch_size * args.seq_len
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = {
        "benchmark": "convergence",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "config": {**vars(args), "model": dataclasses.asdict(cfg), "tokens_per_run": tokens},
        "modes": list(args.modes),
        "runs": [],
    }

    def save() -> None:
        result["seconds"] = time.perf_counter() - t0
        result["table"] = table(result)
        out.write_text(json.dumps(result, indent=2, default=str))

    common = dict(
        replicas=args.peers, batch=args.batch_size, seq_len=args.seq_len, steps=args.steps, lr=args.lr, progress=False
    )
    with rendezvous_thread(TOKEN, heartbeat=1, eviction=30) as port:
        url = f"http://127.0.0.1:{port}"
        for seed in args.seeds:
            graphdef, params0 = char_lm.build_model(cfg, seed=seed)
            for mode in args.modes:
                tm = time.perf_counter()
                rec: dict = {"mode": mode, "seed": seed}
                if mode == "data_parallel":
                    p, _ = char_lm.train_data_parallel(graphdef, params0, train, seed=seed, **common)
                elif mode == "blocking_sim":
                    p, _ = char_lm.train_diloco_simulation(
                        graphdef, params0, train, seed=seed, sync_every=args.sync_every, codec="int4", **common
                    )
                else:
                    r = run_swarm_mode(mode, args, url, graphdef, params0, train, seed, log)
                    p = r.pop("global")
                    rec.update(r)
                rec["eval_loss"] = evaluate(p)
                rec["seconds"] = time.perf_counter() - tm
                result["runs"].append(rec)
                log(f"seed {seed} {mode:<15} eval loss {rec['eval_loss']:.4f}  ({rec['seconds']:.0f} s)")
                save()
    result["machine"]["loadavg_at_end"] = list(__import__("os").getloadavg())
    save()
    plot(result, out.with_suffix(".png"))
    print_table(result)
    print(f"wrote {out} and {out.with_suffix('.png')} ({result['seconds']:.0f} s)")
    return 0


def table(result: dict) -> list[dict]:
    rows = []
    seeds = sorted({r["seed"] for r in result["runs"]})
    for m in result["modes"]:
        per = {r["seed"]: r["eval_loss"] for r in result["runs"] if r["mode"] == m}
        if not per:
            continue
        row = {"mode": m, "eval_loss_per_seed": per, "eval_loss_mean": float(np.mean(list(per.values())))}
        for ref in ("blocking", "data_parallel"):
            rp = {r["seed"]: r["eval_loss"] for r in result["runs"] if r["mode"] == ref}
            common = [s for s in seeds if s in per and s in rp]
            if common:
                rel = [100 * (per[s] / rp[s] - 1) for s in common]
                row[f"rel_vs_{ref}_pct_per_seed"] = rel
                row[f"rel_vs_{ref}_pct_mean"] = float(np.mean(rel))
        rows.append(row)
    goal = {}
    for m in [m for m in result["modes"] if m.startswith(("eager_tau", "delayed_tau"))]:
        row = next((r for r in rows if r["mode"] == m), None)
        if row and "rel_vs_blocking_pct_mean" in row:
            goal[m] = {
                "rel_vs_blocking_pct_mean": row["rel_vs_blocking_pct_mean"],
                "met_within_1pct": abs(row["rel_vs_blocking_pct_mean"]) <= 1.0,
            }
    result["goal_within_1pct_of_blocking"] = goal
    naive = next((r for r in rows if r["mode"] == "naive_delay"), None)
    if naive and "rel_vs_blocking_pct_mean" in naive:
        others = [r.get("rel_vs_blocking_pct_mean") for r in rows if r["mode"] in ("eager_tau1", "delayed_tau1")]
        result["naive_delay_worse"] = {
            "naive_rel_vs_blocking_pct_mean": naive["rel_vs_blocking_pct_mean"],
            "worse_than_blocking": naive["rel_vs_blocking_pct_mean"] > 0,
            "worse_than_eager_and_delayed": all(
                o is not None and naive["rel_vs_blocking_pct_mean"] > o for o in others
            ),
        }
    return rows


def print_table(result: dict) -> None:
    print(f"\neval loss (nats/byte) at equal tokens ({result['config']['tokens_per_run'] / 1e6:.1f}M):")
    print(f"| {'mode':<15} | {'per seed':<17} | {'mean':>7} | {'vs blocking':>11} | {'vs DP':>7} |")
    print(f"|{'-' * 17}|{'-' * 19}|{'-' * 9}|{'-' * 13}|{'-' * 9}|")
    for r in result["table"]:
        per = " ".join(f"{v:.4f}" for v in r["eval_loss_per_seed"].values())
        vb = r.get("rel_vs_blocking_pct_mean")
        vd = r.get("rel_vs_data_parallel_pct_mean")
        print(
            f"| {r['mode']:<15} | {per:<17} | {r['eval_loss_mean']:7.4f} | "
            f"{'' if vb is None else f'{vb:+.2f}%':>11} | {'' if vd is None else f'{vd:+.2f}%':>7} |"
        )
    print(
        f"goal (overlapped modes within 1% of blocking; the issue's goal is for tau=1): {json.dumps(result.get('goal_within_1pct_of_blocking'))}"
    )
    print(f"naive one-round delay: {json.dumps(result.get('naive_delay_worse'))}")


if __name__ == "__main__":
    sys.exit(main())
