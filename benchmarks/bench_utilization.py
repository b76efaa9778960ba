#!/usr/bin/env python3
"""Compute utilisation of a peer over emulated WAN links, per outer-sync mode.

    python benchmarks/bench_utilization.py            # the default sweep (8 modes x 16 links, ~35 min)
    python benchmarks/bench_utilization.py --quick    # 2 links, a smoke test

Setup (all real library code, nothing of it patched):

- 2 peers, each its own process (spawned per mode, as on separate machines: no GIL or XLA
  thread pool shared between them), each with a real ``rj.Swarm`` (aiohttp server + client)
  and, for the DiLoCo modes, a real ``rj.OuterSync``; a real rendezvous (a thread of the parent,
  which also sets the emulated link between segments).
- Every byte between the peers crosses a throttling TCP proxy (a separate process, see
  ``benchmarks/_common.py``): peer i listens on 127.0.0.1:P_i and *advertises*
  ``http://127.0.0.1:Q_i`` (``Swarm(advertise=...)``), Q_i being the proxy's port that forwards to
  P_i. Each direction of the peer-to-peer link is a FIFO line of rate B and one-way delay RTT/2,
  shared by all connections in that direction. The rendezvous is reached through the same kind
  of proxy (same B and RTT; ``--no-throttle-rendezvous`` turns that off): a round's begin and
  vote requests then pay the RTT as they would on a WAN.
- The accelerator is emulated: every inner step is the example's real jitted step (the real
  char-LM model, so the pseudo-gradient is the real payload) padded with sleep to
  ``--step-seconds`` (0.15 s; batch 2 so the real step fits in it on a loaded CPU), as the example's ``--min-step-seconds`` does. The model is the
  example's transformer with ``--d-model 128 --layers 4`` (0.86M params; 3.4 MB in fp32,
  0.43 MB in int4) so that payloads are not trivially small.
- Utilisation of a peer over a segment = time in inner steps (real step + padding) / wall time
  of the training loop over that segment (what ``sync()`` and the all-reduce cost is the rest);
  the mean of the two peers is reported. ``RoundMetrics.compute_utilisation`` of the library is
  recorded next to it as a cross-check.

Modes (all DiLoCo modes H=50, int4 with error feedback, outer Nesterov 0.7/0.9):
``data_parallel`` (fp32 gradient all-reduce through the same swarm/proxy every step, not
overlapped with the backward pass), ``blocking``, ``delayed_tau1``, ``eager_tau1``,
``fragments_int4`` (F=2 fragments, delayed, tau=1); and with ``overlap_steps="auto"`` (tau chosen
per round from the measured exchange and step times, capped at H/10 = 5): ``delayed_auto``,
``eager_auto``, ``fragments_int4_auto``. An auto mode first runs one unmeasured round on each
new link (until it merged), as a long run on one link would have: its tau follows what it
measured on the links before.
Each mode is one training run that walks through the links of the sweep, ``--rounds`` outer
rounds per link (data-parallel: ``--dp-steps`` steps per link), after one unmeasured warm-up
round on a fast link. Bandwidth needed for 90/95/99% is interpolated (log bandwidth, linear
utilisation) over the sweep; ``>max`` when not reached, ``<=min`` when already met at the
lowest bandwidth. Writes ``benchmarks/results/utilization.json`` and ``utilization.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(HERE))

from _common import LinkEmulator, free_port, machine_info, rendezvous_thread  # noqa: E402

TOKEN = "bench-utilization-token"
MODES = ("data_parallel", "blocking", "delayed_tau1", "eager_tau1", "fragments_int4")
AUTO_MODES = ("delayed_auto", "eager_auto", "fragments_int4_auto")  # OuterSync(overlap_steps="auto")
TARGETS = (0.90, 0.95, 0.99)


def mode_tau(mode: str) -> int | str:
    """Overlap tau of a mode name: ``delayed_tau5`` -> 5; ``delayed_auto`` -> ``"auto"``;
    blocking/data-parallel -> 0; else 1."""
    if mode in ("blocking", "data_parallel"):
        return 0
    if mode.endswith("_auto"):
        return "auto"
    if "_tau" in mode:
        return int(mode.rsplit("_tau", 1)[1])
    return 1


def check_mode(mode: str) -> str:
    if (
        mode in MODES
        or mode in AUTO_MODES
        or (
            mode.startswith(("delayed_tau", "eager_tau", "fragments_int4_tau"))
            and mode.rsplit("_tau", 1)[1].isdigit()
            and mode_tau(mode) >= 1
        )
    ):
        return mode
    raise argparse.ArgumentTypeError(
        f"unknown mode {mode!r}: one of {MODES + AUTO_MODES} or delayed_tauN / eager_tauN / fragments_int4_tauN"
    )


def needed_bandwidth(bws: list[float], utils: list[float], target: float) -> str | float:
    """Smallest bandwidth reaching ``target``, log-linear interpolation between sweep points."""
    pts = sorted(zip(bws, utils))
    if pts[0][1] >= target:
        return f"<={pts[0][0]:g}"
    for (b0, u0), (b1, u1) in zip(pts, pts[1:]):
        if u0 < target <= u1:
            f = (target - u0) / (u1 - u0)
            return float(math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0))))
    return f">{pts[-1][0]:g}"


def _peer_process(i: int, mode: str, args: argparse.Namespace, net: dict, barrier, results) -> None:
    """One peer of one mode, in its own (spawned) process, as on a real machine: its training
    loop, its ``OuterSync`` and its swarm's background thread share nothing with the other peer
    (no GIL, no XLA thread pool). Puts its per-link records (or an error) on ``results``."""
    import traceback

    try:
        out = _peer_run(i, mode, args, net, barrier)
        results.put((i, out, None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        with contextlib.suppress(Exception):
            barrier.abort()
        results.put((i, [], traceback.format_exc()))


def _peer_run(i: int, mode: str, args: argparse.Namespace, net: dict, barrier) -> list[dict]:
    import jax
    import optax

    import char_lm
    import ravnest_jax as rj
    from ravnest_jax.swarm import Swarm, Timeouts

    cfg = char_lm.ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len)
    train, _ = char_lm.load_corpus(None)
    graphdef, params0 = char_lm.build_model(cfg, seed=args.seed)  # the same params on every peer
    loss_fn = char_lm.make_loss(graphdef)
    links = net["links"]
    h, tau = args.sync_every, mode_tau(mode)
    seg_steps = args.dp_steps if mode == "data_parallel" else args.rounds * h
    warm_steps = 2 if mode == "data_parallel" else h + (1 if tau == "auto" else tau)
    # "auto" picks tau from the exchanges it measured; after a link change it first sees one
    # round at the new link (unmeasured, until merged), as a long run on one link would have
    settle_steps = h if tau == "auto" else 0
    total_steps = warm_steps + (seg_steps + 2 * settle_steps) * len(links)
    inner = char_lm.inner_optimizer(args.lr, total_steps)
    wait = args.barrier_timeout

    if mode == "data_parallel":

        @jax.jit
        def grad_fn(params, tokens):
            return jax.grad(loss_fn)(params, tokens)

        @jax.jit
        def apply_fn(params, state, grads):
            updates, state = inner.update(grads, state, params)
            return optax.apply_updates(params, updates), state
    else:
        tx = rj.diloco(inner, sync_every=h, fragments=args.fragments if mode.startswith("fragments_int4") else 1)

        @jax.jit
        def train_step(params, state, tokens):
            value, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

    timeouts = Timeouts(connect=10, part=120, grace=1, round=600, heartbeat=1, eviction=20)
    records: list[dict] = []
    swarm = Swarm(
        net["rendezvous"],
        run_id=net["run_id"],
        token=TOKEN,
        codec="fp32" if mode == "data_parallel" else "int4",
        listen=f"127.0.0.1:{net['listen'][i]}",
        advertise=f"http://127.0.0.1:{net['advertise'][i]}",
        timeouts=timeouts,
        peer_id=f"peer{i}",
    )
    with swarm:
        swarm.wait_for_peers(net["peers"], timeout=120)
        rng = np.random.default_rng([args.seed, i])
        params = params0
        sync = None
        if mode == "data_parallel":
            state = inner.init(params)
            tok = char_lm.sample_batch(train, rng, args.batch_size, args.seq_len)
            g = grad_fn(params, tok)
            apply_fn(params, state, g)
            leaves, treedef = jax.tree.flatten(g)
        else:
            state = tx.init(params)
            eager = mode.startswith("eager")
            sync = rj.OuterSync(tx, swarm, eager=eager, overlap_steps=tau, samples_per_step=args.batch_size)
            tok = char_lm.sample_batch(train, rng, args.batch_size, args.seq_len)
            train_step.lower(params, state, tok).compile()
            sync.warmup(params, state)

        def one_step(params, state):
            """Returns params, state, compute seconds, comm seconds."""
            t0 = time.perf_counter()
            tok = char_lm.sample_batch(train, rng, args.batch_size, args.seq_len)
            if mode == "data_parallel":
                g = grad_fn(params, tok)
                leaves = [np.asarray(x) for x in jax.tree.leaves(g)]
                t1 = time.perf_counter()
                mean, _ = swarm.all_reduce({"g": np.concatenate([x.ravel() for x in leaves])}, weight=1.0)
                t2 = time.perf_counter()
                flat, off, parts = mean["g"], 0, []
                for x in leaves:
                    parts.append(flat[off : off + x.size].reshape(x.shape))
                    off += x.size
                params, state = apply_fn(params, state, jax.tree.unflatten(treedef, parts))
                jax.block_until_ready(params)
                comm = t2 - t1
                pad = args.step_seconds - (time.perf_counter() - t0 - comm)
                if pad > 0:
                    time.sleep(pad)
                t3 = time.perf_counter()
                return params, state, t3 - t0 - comm, comm
            params, state, value = train_step(params, state, tok)
            value.block_until_ready()
            pad = args.step_seconds - (time.perf_counter() - t0)
            if pad > 0:
                time.sleep(pad)
            t1 = time.perf_counter()
            params, state = sync(params, state)
            return params, state, t1 - t0, time.perf_counter() - t1

        barrier.wait(wait)  # every peer compiled; the parent has set the fast warm-up link
        # unmeasured warm-up on a fast link: connections, first round
        for _ in range(warm_steps):
            params, state, _, _ = one_step(params, state)
        for bw, rtt in links:
            barrier.wait(wait)  # both peers done with the previous link ...
            barrier.wait(wait)  # ... and the parent has set this one
            for _ in range(settle_steps):
                params, state, _, _ = one_step(params, state)
            while settle_steps and sync.pending:  # until that round merged (tau < H steps)
                params, state, _, _ = one_step(params, state)
            m0 = len(sync.metrics) if sync else 0
            stall0 = sync.stall_seconds if sync else 0.0
            t_start = time.perf_counter()
            compute = comm = 0.0
            slow_syncs = []  # (step in segment, seconds) of sync calls over 2 ms
            for j in range(seg_steps):
                params, state, c, k = one_step(params, state)
                compute += c
                comm += k
                if k > 0.002:
                    slow_syncs.append((j, round(k, 4)))
            wall = time.perf_counter() - t_start
            rec = {
                "mode": mode,
                "peer": i,
                "bandwidth_mbit": bw,
                "rtt_ms": rtt,
                "steps": seg_steps,
                "wall_seconds": wall,
                "compute_seconds": compute,
                "sync_seconds": comm,
                "utilisation": compute / wall,
                "nominal_utilisation": seg_steps * args.step_seconds / wall,
                "slow_sync_calls": slow_syncs,
            }
            if sync is not None:
                ms = sync.metrics[m0:]
                rec.update(
                    rounds=len(ms),
                    ok_rounds=sum(m.ok for m in ms),
                    pending_at_end=sync.pending,
                    stall_seconds=sync.stall_seconds - stall0,
                    bytes_sent=int(sum(m.bytes_sent for m in ms)),
                    exchange_seconds=[round(m.exchange_seconds, 3) for m in ms],
                    library_compute_utilisation=[round(m.compute_utilisation, 4) for m in ms],
                    overlap_steps=[m.overlap_steps for m in ms],
                    errors=[m.error for m in ms if m.error],
                )
            records.append(rec)
        barrier.wait(wait)  # done measuring; the parent sets a fast link for the last round
        barrier.wait(wait)
        if sync is not None:
            sync.flush(params, state)
            sync.close()
    return records


def run_mode(mode: str, args, net: dict, links, emu, log) -> list[dict]:
    """One training run of ``mode`` on ``net["peers"]`` peer processes over every link of
    ``links``; the parent process sets the emulated link between the measured segments."""
    ctx = mp.get_context("spawn")
    n = net["peers"]
    barrier = ctx.Barrier(n + 1)
    results = ctx.Queue()
    net = {**net, "links": links, "run_id": f"util-{mode}"}
    emu.set_all(1000, 0)
    procs = [
        ctx.Process(target=_peer_process, args=(i, mode, args, net, barrier, results), name=f"peer{i}", daemon=True)
        for i in range(n)
    ]
    for p in procs:
        p.start()
    wait = args.barrier_timeout
    got: dict[int, list[dict]] = {}
    errors: list[str] = []
    try:
        barrier.wait(wait)
        for bw, rtt in links:
            barrier.wait(wait)
            emu.set_all(bw, rtt)
            barrier.wait(wait)
        barrier.wait(wait)
        emu.set_all(1000, 0)
        barrier.wait(wait)
    except threading.BrokenBarrierError:
        pass  # a peer failed: its traceback comes through the queue
    finally:
        deadline = time.monotonic() + wait
        while len(got) + len(errors) < n and time.monotonic() < deadline:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
            try:
                i, recs, err = results.get(timeout=1.0)
            except queue.Empty:
                continue
            if err:
                errors.append(f"peer{i}:\n{err}")
            else:
                got[i] = recs
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(10)
    if errors or len(got) < n:
        raise RuntimeError(f"mode {mode}: peers failed ({sorted(got)} of {n} reported)\n" + "\n".join(errors))
    runs = [r for i in sorted(got) for r in got[i]]
    for r in runs:
        if r["peer"] == 0:
            log(
                f"  {mode:<15} {r['bandwidth_mbit']:>6g} Mbit/s {r['rtt_ms']:>4g} ms  utilisation "
                f"{np.mean([q['utilisation'] for q in runs if (q['bandwidth_mbit'], q['rtt_ms']) == (r['bandwidth_mbit'], r['rtt_ms'])]):.3f}"
                f"  (wall {r['wall_seconds']:.1f}s, sync {r['sync_seconds']:.2f}s)"
            )
    return runs


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rtts = sorted({r["rtt_ms"] for r in result["summary"]})
    fig, axes = plt.subplots(2, len(rtts), figsize=(4.5 * len(rtts), 7), sharey="row", squeeze=False)
    for row, ylim in enumerate(((0, 1.02), (0.7, 1.0))):
        for ax, rtt in zip(axes[row], rtts):
            for mode in result["modes"]:
                pts = sorted(
                    (r["bandwidth_mbit"], r["utilisation"])
                    for r in result["summary"]
                    if r["mode"] == mode and r["rtt_ms"] == rtt
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=mode)
            for y in TARGETS:
                ax.axhline(y, color="grey", lw=0.6, ls="--")
            ax.set_xscale("log")
            ax.set_title(f"RTT {rtt:g} ms" + (" (zoom)" if row else ""))
            ax.set_xlim(7, 1400)
            ax.set_ylim(*ylim)
            ax.grid(alpha=0.3)
            if row:
                ax.set_xlabel("link bandwidth (Mbit/s, each direction)")
        axes[row][0].set_ylabel("compute utilisation")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"char-LM {result['config']['params'] / 1e6:.2f}M params, 2 peers, "
        f"{result['config']['step_seconds']} s/step emulated, H={result['config']['sync_every']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidths", type=float, nargs="+", default=[10, 30, 100, 300, 1000], help="Mbit/s")
    ap.add_argument("--rtts", type=float, nargs="+", default=[0, 50, 200], help="ms")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES + AUTO_MODES),
        type=check_mode,
        help=f"of {MODES}, or delayed_tauN / eager_tauN (overlap N steps, int4, F=1) / fragments_int4_tauN",
    )
    ap.add_argument("--step-seconds", type=float, default=0.15, help="emulated inner-step time")
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="outer rounds measured per link")
    ap.add_argument("--dp-steps", type=int, default=5, help="data-parallel steps measured per link")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2, help="small: the real step must fit in --step-seconds")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-throttle-rendezvous", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 links, 1 round")
    ap.add_argument("--out", default=str(HERE / "results" / "utilization.json"))
    ap.add_argument(
        "--barrier-timeout",
        type=float,
        default=900.0,
        help="seconds the parent and peers wait for each other at a link change",
    )
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON at --out")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return 0
    if args.quick:
        args.bandwidths, args.rtts, args.rounds, args.dp_steps = [100], [0, 100], 1, 3
    n = 2
    # lines: 0 = peer0 -> peer1, 1 = peer1 -> peer0, 2 = peers -> rendezvous, 3 = rendezvous -> peers
    kinds = ("dp", "diloco")
    ports = {(k, i): free_port() for k in kinds for i in range(n)}
    rv_port = free_port()
    routes = [(ports[(k, i)], 1 - i, i) for k in kinds for i in range(n)] + [(rv_port, 2, 3)]
    emu = LinkEmulator(routes, n_lines=4)
    proxy = {key: emu.ports[j] for j, key in enumerate((k, i) for k in kinds for i in range(n))}
    rv_proxy = emu.ports[-1]
    emu.set_all(1000, 0)
    if args.no_throttle_rendezvous:
        emu.set(2, 0, 0)
        emu.set(3, 0, 0)
        emu.frozen = {2, 3}

    import jax

    import char_lm

    def log(msg: str) -> None:
        print(msg, flush=True)

    cfg = char_lm.ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len)
    _, params0 = char_lm.build_model(cfg, seed=args.seed)
    n_params = int(sum(x.size for x in jax.tree.leaves(params0)))
    links = [(b, r) for r in args.rtts for b in args.bandwidths]
    if 100.0 in args.bandwidths and 100.0 not in args.rtts and not args.quick:
        links.append((100.0, 100.0))  # the goal point
    log(
        f"model {n_params / 1e6:.2f}M params; {len(links)} links x {len(args.modes)} modes; {n} peer processes per mode"
    )
    t0 = time.perf_counter()
    runs: list[dict] = []
    with rendezvous_thread(TOKEN, port=rv_port, heartbeat=1, eviction=20):
        try:
            for mode in args.modes:
                kind = "dp" if mode == "data_parallel" else "diloco"
                net = {
                    "peers": n,
                    "rendezvous": f"http://127.0.0.1:{rv_proxy}",
                    "listen": [ports[(kind, i)] for i in range(n)],
                    "advertise": [proxy[(kind, i)] for i in range(n)],
                }
                tm = time.perf_counter()
                runs += run_mode(mode, args, net, links, emu, log)
                log(f"{mode}: {time.perf_counter() - tm:.0f} s")
        finally:
            emu.close()

    summary = []
    for mode in args.modes:
        for bw, rtt in links:
            rs = [r for r in runs if r["mode"] == mode and r["bandwidth_mbit"] == bw and r["rtt_ms"] == rtt]
            summary.append(
                {
                    "mode": mode,
                    "bandwidth_mbit": bw,
                    "rtt_ms": rtt,
                    "utilisation": float(np.mean([r["utilisation"] for r in rs])),
                    "nominal_utilisation": float(np.mean([r["nominal_utilisation"] for r in rs])),
                }
            )
    table = []
    for mode in args.modes:
        for rtt in sorted({r for _, r in links}):
            pts = [(s["bandwidth_mbit"], s["utilisation"]) for s in summary if s["mode"] == mode and s["rtt_ms"] == rtt]
            if len(pts) < 2:
                continue
            bws, us = zip(*pts)
            table.append(
                {
                    "mode": mode,
                    "rtt_ms": rtt,
                    **{f"mbit_for_{int(t * 100)}pct": needed_bandwidth(list(bws), list(us), t) for t in TARGETS},
                }
            )
    goal = {}
    for mode in [m for m in args.modes if m not in ("data_parallel", "blocking")]:
        pt = [s for s in summary if s["mode"] == mode and s["bandwidth_mbit"] == 100 and s["rtt_ms"] == 100]
        if pt:
            goal[mode] = {"utilisation": pt[0]["utilisation"], "met": pt[0]["utilisation"] >= 0.95}
    result = {
        "benchmark": "utilization",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "config": {
            **vars(args),
            "params": n_params,
            "peers": n,
            "links": links,
            "rendezvous_throttled": not args.no_throttle_rendezvous,
            "payload_bytes_fp32": 4 * n_params,
        },
        "modes": list(args.modes),
        "seconds": time.perf_counter() - t0,
        "runs": runs,
        "summary": summary,
        "bandwidth_needed_table": table,
        "goal_95pct_at_100mbit_100ms": goal,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    plot(result, out.with_suffix(".png"))

    def fmt(x):
        return f"{x:.0f}" if isinstance(x, float) else x

    print("\nbandwidth (Mbit/s) needed for a utilisation of:")
    print(f"| {'mode':<15} | {'RTT ms':>6} | {'90%':>7} | {'95%':>7} | {'99%':>7} |")
    print(f"|{'-' * 17}|{'-' * 8}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
    for t in table:
        print(
            f"| {t['mode']:<15} | {t['rtt_ms']:6g} | {fmt(t['mbit_for_90pct']):>7} | {fmt(t['mbit_for_95pct']):>7} | "
            f"{fmt(t['mbit_for_99pct']):>7} |"
        )
    print(f"\ngoal >= 95% at 100 Mbit/s, 100 ms RTT: {json.dumps(goal)}")
    print(f"wrote {out} and {out.with_suffix('.png')} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
