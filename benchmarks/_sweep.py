"""The convergence sweep of ``bench_convergence.py --sweep``: DiLoCo against data-parallel on the
char-LM replica simulation, one *cell* (one configuration) at a time, all seeds of a cell in one
jitted program (``jax.vmap`` over seeds, and over replicas with ``axis_name="replica"``).

A cell is data-parallel (``algo="dp"``: one model, global batch ``replicas * batch``, mean
gradient) or DiLoCo (``algo="diloco"``: ``replicas`` replicas of batch ``batch``,
``rj.diloco(sync_every=H, axis_name="replica")``). Same model init, same data streams (replica r of
seed s draws from ``default_rng([s, r])``; data-parallel's global batch is the concatenation of
the same draws), same tokens. The eval loss (nats/byte) of the global params is taken every
``eval_every`` steps and at the end, on fixed eval windows of held-out stdlib files.

Knobs of a cell (all in :class:`Cell`): run length, H, outer learning rate, momentum and
Nesterov, inner optimizer (``adamw`` as in the example, or ``muon``: ``optax.contrib.muon``,
arXiv 2502.16982), inner learning rate and warm-up fraction, and a pseudo-gradient codec applied
as the swarm applies it (``ravnest_jax.compress.simulated``, error feedback with decay
``ef_decay``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Cell:
    algo: str  # "dp" or "diloco"
    steps: int
    sync_every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    inner: str = "adamw"
    inner_lr: float = 3e-3
    warmup: float = 0.05
    codec: str = "fp32"  # "fp32", "int4", "topk:0.01", ...
    ef_decay: float = 1.0
    replicas: int = 4
    batch: int = 8
    dp_warm_steps: int = 0  # DiLoCo: the first steps as data-parallel (then replicas of that model)

    def key(self) -> str:
        if self.algo == "dp":
            parts = ["dp", f"T{self.steps}", self.inner, f"lr{self.inner_lr:g}", f"wu{self.warmup:g}"]
        else:
            parts = [
                "diloco",
                f"T{self.steps}",
                f"H{self.sync_every}",
                f"olr{self.outer_lr:g}",
                f"m{self.outer_momentum:g}{'n' if self.nesterov else ''}",
                self.inner,
                f"lr{self.inner_lr:g}",
                f"wu{self.warmup:g}",
                self.codec,
            ]
            if self.ef_decay != 1.0:
                parts.append(f"ef{self.ef_decay:g}")
            if self.dp_warm_steps:
                parts.append(f"dpwarm{self.dp_warm_steps}")
        if self.replicas != 4 or self.batch != 8:
            parts.append(f"R{self.replicas}B{self.batch}")
        return "-".join(parts)


def inner_optimizer(cell: Cell):
    """The example's inner optimizer (``char_lm.inner_optimizer``) with the cell's settings."""
    import char_lm

    return char_lm.inner_optimizer(cell.inner_lr, cell.steps, cell.inner, cell.warmup)


def parse_codec(spec: str) -> tuple[str, dict, bool, bool]:
    """``"name[:opt]..."`` -> ``(name, codec options, exact, mean_ef)``. Options: a number (topk:
    the fraction; a block codec: the block size), ``exact`` (the mean of the contributions is kept
    as it is: the all-gather sends it losslessly), ``mef`` (the owners' error feedback on the
    mean, ``rj.Codec(mean_ef=True)``)."""
    name, *rest = spec.split(":")
    exact, mean_ef = "exact" in rest, "mef" in rest
    nums = [r for r in rest if r not in ("exact", "mef")]
    options: dict = {}
    if nums:
        options = {"fraction": float(nums[0])} if name == "topk" else {"block_size": int(nums[0])}
    return name, options, exact, mean_ef


def _codec(cell: Cell):
    """The cell's codec as the swarm applies it (see :func:`parse_codec`); the mean is encoded
    again unless ``exact``."""
    if cell.codec == "fp32":
        return None
    from ravnest_jax.compress import Codec, simulated

    if "/" in cell.codec:  # "UP[:BLOCK]/DOWN[:BLOCK][:mef]": the mean in its own codec (rj.Codec(mean=))
        up_spec, down_spec = cell.codec.split("/")
        name, options, _, _ = parse_codec(up_spec)
        mean_name, mean_options, exact, mean_ef = parse_codec(down_spec)
        if exact or mean_options.get("block_size", options.get("block_size")) != options.get("block_size"):
            raise ValueError(f"codec {cell.codec!r}: one block size on both sides, and no 'exact'")
        return simulated(Codec(name, mean=mean_name, mean_ef=mean_ef, error_feedback_decay=cell.ef_decay, **options))

    name, options, exact, mean_ef = parse_codec(cell.codec)
    codec = simulated(Codec(name, mean_ef=mean_ef, error_feedback_decay=cell.ef_decay, **options))
    if exact:
        codec.requantize = lambda mean, key: mean
        codec.mean_error_feedback = False
    return codec


def run_cell(cell: Cell, seeds: list[int], *, eval_every: int = 100, eval_batches: int = 16) -> dict:
    """Trains one cell for every seed (in one program); returns eval losses and the curve."""
    import jax
    import jax.numpy as jnp
    import optax

    import char_lm
    import ravnest_jax as rj

    t0 = time.perf_counter()
    cfg = char_lm.ModelConfig()
    train, evald = char_lm.load_corpus(None)
    graphdef = None
    inits = []
    for s in seeds:
        graphdef, p = char_lm.build_model(cfg, seed=s)
        inits.append(p)
    params0 = jax.tree.map(lambda *xs: jnp.stack(xs), *inits)  # (S, ...)
    loss = char_lm.make_loss(graphdef)
    eval_tokens = jnp.asarray(char_lm.eval_batches(evald, batch=32, seq_len=cfg.seq_len, num_batches=eval_batches))

    @jax.jit
    def evaluate(params):  # (S, ...) -> (S,)
        return jax.vmap(lambda p: jax.lax.map(lambda b: loss(p, b), eval_tokens).mean())(params)

    r, b = cell.replicas, cell.batch
    rngs = [[np.random.default_rng([s, i]) for i in range(r)] for s in seeds]

    def batch_np() -> np.ndarray:  # (S, R, B, T+1)
        return np.stack([np.stack([char_lm.sample_batch(train, g, b, cfg.seq_len) for g in row]) for row in rngs])

    inner = inner_optimizer(cell)
    if cell.algo == "dp":
        tx = inner

        def step1(params, state, tokens):
            tokens = tokens.reshape(-1, tokens.shape[-1])
            value, grads = jax.value_and_grad(loss)(params, tokens)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        step = jax.jit(jax.vmap(step1), donate_argnums=(0, 1))
        params = params0
        state = jax.vmap(tx.init)(params)
        global_of = lambda p, s: p  # noqa: E731
    elif cell.algo == "diloco":
        outer = optax.sgd(cell.outer_lr, momentum=cell.outer_momentum or None, nesterov=cell.nesterov)
        tx = rj.diloco(inner, outer, sync_every=cell.sync_every, axis_name="replica", codec=_codec(cell))

        def step1(params, state, tokens):
            value, grads = jax.value_and_grad(loss)(params, tokens)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, jax.lax.pmean(value, "replica")

        step = jax.jit(jax.vmap(jax.vmap(step1, axis_name="replica")), donate_argnums=(0, 1))
        params = jax.vmap(lambda p: rj.replicate(p, r))(params0)
        state = jax.vmap(lambda p: rj.replicate(tx.init(p), r))(params0)
        warm = cell.dp_warm_steps
        if warm:  # data-parallel warm start: one model on the global batch, then DiLoCo from it
            if warm % cell.sync_every:
                raise ValueError(f"dp_warm_steps {warm} must be a multiple of H {cell.sync_every}")

            def dp1(p, s_in, tokens):
                value, grads = jax.value_and_grad(loss)(p, tokens.reshape(-1, tokens.shape[-1]))
                updates, s_in = inner.update(grads, s_in, p)
                return optax.apply_updates(p, updates), s_in, value

            dstep = jax.jit(jax.vmap(dp1), donate_argnums=(0, 1))
            p, s_in = jax.tree.map(jnp.copy, params0), jax.vmap(inner.init)(params0)
            for _ in range(warm):
                p, s_in, _ = dstep(p, s_in, batch_np())

            def diloco_from(p, s_in):
                st = tx.init(p)._replace(inner_state=s_in, count=jnp.asarray(warm, jnp.int32))
                return rj.replicate(p, r), rj.replicate(st, r)

            params, state = jax.vmap(diloco_from)(p, s_in)
        global_of = lambda p, s: jax.tree.map(lambda x: x[:, 0], s.global_params)  # noqa: E731
    else:
        raise ValueError(f"unknown algo {cell.algo!r}")

    def flushed_of(p, s):  # the global params had the last round sent its residuals losslessly
        cs = getattr(s, "codec_state", None)
        if cell.algo != "diloco" or not hasattr(cs, "residual"):
            return None
        res = jax.tree.map(lambda x: x.mean(axis=1), cs.residual) if cs.residual is not None else None
        if cs.mean_residual is not None:
            mres = jax.tree.map(lambda x: x[:, 0], cs.mean_residual)
            res = mres if res is None else jax.tree.map(jnp.add, res, mres)
        if res is None:
            return None
        return jax.tree.map(lambda g, r: g - cell.outer_lr * r, global_of(p, s), res)

    curve = [{"step": 0, "eval_loss": [float(x) for x in evaluate(params0)]}]
    losses = None
    first = cell.dp_warm_steps + 1 if cell.algo == "diloco" else 1
    for t in range(first, cell.steps + 1):
        params, state, losses = step(params, state, batch_np())
        if t % eval_every == 0 or t == cell.steps:
            g = global_of(params, state)
            ev = [float(x) for x in evaluate(g)]
            if not all(np.isfinite(ev)):
                raise FloatingPointError(f"{cell.key()}: eval loss not finite at step {t}: {ev}")
            point = {"step": t, "eval_loss": ev}
            flushed = flushed_of(params, state)
            if flushed is not None:
                point["eval_loss_flushed"] = [float(x) for x in evaluate(flushed)]
            curve.append(point)
    tr = np.asarray(losses)
    return {
        "key": cell.key(),
        "cell": dataclasses.asdict(cell),
        "seeds": list(seeds),
        "eval_loss": curve[-1]["eval_loss"],
        "eval_loss_mean": float(np.mean(curve[-1]["eval_loss"])),
        "train_loss_last": [float(x) for x in tr.reshape(len(seeds), -1)[:, 0]],
        "curve": curve,
        "seconds": time.perf_counter() - t0,
        "tokens": cell.steps * r * b * cfg.seq_len,
    }


def _die_with_parent(parent_pid: int) -> None:  # pragma: no cover - pool process
    """Pool initializer: the worker dies with the sweep (Linux ``PR_SET_PDEATHSIG``), so Ctrl+C
    or a kill of the sweep leaves no worker training on."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker(payload: tuple[dict, list[int], int]) -> dict:  # pragma: no cover - pool process
    cell, seeds, eval_every = payload
    return run_cell(Cell(**cell), seeds, eval_every=eval_every)


def bits_per_round(codec: str, n: int) -> float:
    """Bits on the wire per parameter of one butterfly round (reduce-scatter + all-gather), for
    the byte ratio against data-parallel; exact from the wire format."""
    from ravnest_jax.compress import _formats as F

    if "/" in codec:  # the contributions in one codec, the mean in another
        return sum(bits_per_round(side, n) / 2 for side in codec.split("/"))
    name, options, _, _ = parse_codec(codec)
    cfg = F.resolve(name, **options)
    k = F.topk_count(n, cfg.fraction) if name == "topk" else 0
    return 2 * 8 * F.payload_nbytes(name, n, cfg.block_size, k) / n


def summarize(cells: list[dict]) -> dict[str, Any]:
    """Gap of every DiLoCo cell to data-parallel at the same length and seeds, twice: against
    data-parallel with the same inner optimizer and learning rate (``gap_vs_dp_*``: the same
    optimizer on both sides) and against the best data-parallel learning rate measured at that
    length (``gap_vs_best_dp_*``: each side at its best)."""
    by_len: dict[int, list[dict]] = {}
    for c in cells:
        c["cell"] = {**dataclasses.asdict(Cell(c["cell"]["algo"], c["cell"]["steps"])), **c["cell"]}
        if c["cell"]["algo"] == "dp":
            by_len.setdefault(c["cell"]["steps"], []).append(c)
    best = {t: min(v, key=lambda c: c["eval_loss_mean"]) for t, v in by_len.items()}
    rows = []
    for c in cells:
        if c["cell"]["algo"] != "diloco":
            continue
        cc = {**dataclasses.asdict(Cell(c["cell"]["algo"], c["cell"]["steps"])), **c["cell"]}
        row = {"key": c["key"], **cc, "eval_loss_mean": c["eval_loss_mean"], "eval_loss": c["eval_loss"]}
        same = [
            d
            for d in by_len.get(cc["steps"], [])
            if d["cell"]["inner"] == cc["inner"]
            and d["cell"]["inner_lr"] == cc["inner_lr"]
            and d["seeds"] == c["seeds"]
        ]
        for name, dp in (("dp", same[0] if same else None), ("best_dp", best.get(cc["steps"]))):
            if dp is None or dp["seeds"] != c["seeds"]:
                continue
            gaps = [100 * (a / d - 1) for a, d in zip(c["eval_loss"], dp["eval_loss"])]
            row[f"{name}_key"] = dp["key"]
            row[f"gap_vs_{name}_pct"] = gaps
            row[f"gap_vs_{name}_pct_mean"] = float(np.mean(gaps))
            row[f"gap_vs_{name}_pct_std"] = float(np.std(gaps))
        rows.append(row)
    return {"best_dp": {t: dp["key"] for t, dp in best.items()}, "rows": rows}


# ------------------------------------------------------------------------------ the sweep plan
def plan(name: str, steps: int) -> list[Cell]:
    """The cells of a named group (``--sweep-group``); ``steps`` is the long run length."""
    d = Cell("diloco", steps)
    dp = Cell("dp", steps)
    if name == "length":  # the gap against the number of outer steps (H = 50)
        out = []
        for t in sorted({steps // 4, steps // 2, steps}):
            out += [dataclasses.replace(dp, steps=t), dataclasses.replace(d, steps=t)]
        return out
    if name == "outer":  # outer learning rate and momentum at the long length
        return (
            [dp, d]
            + [
                dataclasses.replace(d, outer_lr=lr, outer_momentum=m)
                for lr, m in ((0.5, 0.9), (1.0, 0.9), (0.7, 0.8), (1.0, 0.8))
            ]
            + [dataclasses.replace(d, outer_lr=1.0, outer_momentum=0.0, nesterov=False)]
        )  # plain averaging
    if name == "inner":  # the inner learning rate (data-parallel tuned the same way) and warm-up
        return [
            dataclasses.replace(dp, inner_lr=1.5e-3),
            dataclasses.replace(dp, inner_lr=6e-3),
            dataclasses.replace(d, inner_lr=1.5e-3),
            dataclasses.replace(d, inner_lr=6e-3),
        ]
    if name == "sync_every":
        return [dp] + [dataclasses.replace(d, sync_every=h) for h in (25, 100)]
    if name == "codec":  # compressed rounds (the swarm's codecs, error feedback on)
        return [
            dp,
            d,
            dataclasses.replace(d, codec="int4"),
            dataclasses.replace(d, codec="topk:0.01"),
            # SparseLoCo (arXiv 2508.15706): decayed error feedback in place of outer momentum
            dataclasses.replace(d, codec="topk:0.01", ef_decay=0.95, outer_lr=1.0, outer_momentum=0.0, nesterov=False),
            dataclasses.replace(d, codec="topk:0.03", ef_decay=0.95, outer_lr=1.0, outer_momentum=0.0, nesterov=False),
        ]
    if name == "muon":  # Muon as the inner optimizer (data-parallel with Muon too)
        return [
            dataclasses.replace(dp, inner="muon", inner_lr=0.02),
            dataclasses.replace(d, inner="muon", inner_lr=0.02),
        ]
    raise ValueError(f"unknown sweep group {name!r}")


GROUPS = ("length", "outer", "inner", "sync_every", "codec", "muon")


def sweep_main(args, out, machine_info) -> int:
    """``bench_convergence.py --sweep``: runs the cells of ``args.sweep_group`` not yet in ``out``
    (a rerun resumes), ``args.jobs`` cells at a time in worker processes, and rewrites ``out`` and
    its PNG after each cell."""
    import concurrent.futures
    import json
    import multiprocessing as mp
    import sys

    cells: list[Cell] = []
    for g in args.sweep_group:
        for c in plan(g, args.steps):
            if c not in cells:
                cells.append(c)
    for spec in args.sweep_cell or []:  # ad-hoc cells: "algo=diloco,outer_momentum=0.8,..."
        kw: dict[str, Any] = {"algo": "diloco", "steps": args.steps}
        types = {f.name: f.type for f in dataclasses.fields(Cell)}
        for item in spec.split(","):
            k, _, v = item.partition("=")
            if k not in types:
                raise SystemExit(f"--sweep-cell: unknown field {k!r}; known: {', '.join(types)}")
            t = types[k]
            kw[k] = (
                v
                if t == "str"
                else (v.lower() in ("1", "true") if t == "bool" else (int(v) if t == "int" else float(v)))
            )
        c = Cell(**kw)
        if c not in cells:
            cells.append(c)
    doc = json.loads(out.read_text()) if out.exists() else {}
    done = {(c["key"], tuple(c["seeds"])): c for c in doc.get("cells", [])}
    todo = [c for c in cells if (c.key(), tuple(args.seeds)) not in done]
    doc.update(
        benchmark="convergence_sweep",
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        machine=machine_info(),
        config={"model": dataclasses.asdict(__import__("char_lm").ModelConfig()), "seeds": list(args.seeds)},
    )
    doc.setdefault("cells", [])
    print(f"sweep: {len(cells)} cells, {len(todo)} to run, {args.jobs} at a time, seeds {args.seeds}", flush=True)

    def save() -> None:
        doc["summary"] = summarize(doc["cells"])
        out.write_text(json.dumps(doc, indent=1))
        plot_sweep(doc, out.with_suffix(".png"))

    env_threads = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
    if args.jobs > 1:
        os.environ.update(env_threads)
    ctx = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=args.jobs, mp_context=ctx, initializer=_die_with_parent, initargs=(os.getpid(),)
    ) as pool:
        futs = {pool.submit(_worker, (dataclasses.asdict(c), list(args.seeds), args.eval_every)): c for c in todo}
        for f in concurrent.futures.as_completed(futs):
            res = f.result()
            doc["cells"] = [
                c for c in doc["cells"] if (c["key"], tuple(c["seeds"])) != (res["key"], tuple(res["seeds"]))
            ]
            doc["cells"].append(res)
            ev = " ".join(f"{x:.4f}" for x in res["eval_loss"])
            print(f"{res['key']:<70} eval {ev}  ({res['seconds']:.0f} s)", flush=True)
            save()
    save()
    print_sweep(doc)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def print_sweep(doc: dict) -> None:
    rows = doc["summary"]["rows"]
    print(f"\n| {'cell':<66} | {'eval loss':>9} | {'vs DP, same lr':>14} | {'vs best DP':>14} |")
    print(f"|{'-' * 68}|{'-' * 11}|{'-' * 16}|{'-' * 16}|")

    def gap(r: dict, name: str) -> str:
        g = r.get(f"gap_vs_{name}_pct_mean")
        return "" if g is None else f"{g:+.2f}% ±{r[f'gap_vs_{name}_pct_std']:.2f}"

    for r in sorted(rows, key=lambda r: (r["steps"], r["key"])):
        print(f"| {r['key']:<66} | {r['eval_loss_mean']:9.4f} | {gap(r, 'dp'):>14} | {gap(r, 'best_dp'):>14} |")
    print(f"best data-parallel learning rate per length: {doc['summary']['best_dp']}")


def report_main(paths: list, out, machine_info) -> int:
    """``--sweep-report A.json B.json ...``: merges the cells of sweep files (later files win
    for the same cell and seeds) into ``out`` with the summary, the table and the PNG."""
    import json

    cells: dict[tuple, dict] = {}
    commands = []
    for p in paths:
        d = json.loads(open(p).read())
        commands.append(d.get("command"))
        for c in d.get("cells", []):
            cells[(c["key"], tuple(c["seeds"]))] = c
    doc = {
        "benchmark": "convergence_sweep",
        "commands": commands,
        "merged_from": [str(p) for p in paths],
        "machine": machine_info(),
        "cells": list(cells.values()),
    }
    doc["summary"] = summarize(doc["cells"])
    out.write_text(json.dumps(doc, indent=1))
    plot_sweep(doc, out.with_suffix(".png"))
    print_sweep(doc)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot_sweep(doc: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["summary"]["rows"] if "gap_vs_dp_pct_mean" in r]
    fig, (a1, a3, a2) = plt.subplots(1, 3, figsize=(19, 5.2))
    base = Cell("diloco", 1)
    varied = ("steps", "sync_every", "outer_lr", "outer_momentum", "dp_warm_steps")
    same = {k: v for k, v in dataclasses.asdict(base).items() if k not in varied}
    by_cfg: dict[tuple, list] = {}
    for r in rows:
        if all(r[k] == v for k, v in same.items()):
            warm = round(r["dp_warm_steps"] / r["steps"], 3)
            by_cfg.setdefault((r["sync_every"], r["outer_lr"], r["outer_momentum"], warm), []).append(r)
    for (h, lr, m, warm), rs in sorted(by_cfg.items()):
        rs = sorted(rs, key=lambda r: r["steps"])
        if len(rs) < 2:
            continue
        x = [r["steps"] / r["sync_every"] for r in rs]
        label = f"H={h}, outer lr {lr:g}, momentum {m:g}" + (f", data-parallel first {warm:.0%}" if warm else "")
        a1.errorbar(
            x,
            [r["gap_vs_dp_pct_mean"] for r in rs],
            yerr=[r["gap_vs_dp_pct_std"] for r in rs],
            marker="o",
            capsize=3,
            label=label,
        )
    a1.axhline(2.0, color="r", ls="--", lw=1, label="goal: +2%")
    a1.axhline(0.0, color="k", lw=0.8)
    a1.set_xscale("log")
    a1.set_xlabel("run length / H (warm-started runs: their DiLoCo rounds are 80% of it)")
    a1.set_ylabel("eval loss vs data-parallel, same inner lr (%)")
    a1.set_title("the gap against the number of outer steps")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=7)
    long = max((r["steps"] for r in rows), default=0)
    lr_rows = sorted([r for r in rows if r["steps"] == long], key=lambda r: r["gap_vs_dp_pct_mean"])
    cap = 16.0
    vals = [r["gap_vs_dp_pct_mean"] for r in lr_rows]
    a2.barh(
        range(len(lr_rows)),
        [min(v, cap) for v in vals],
        xerr=[r["gap_vs_dp_pct_std"] if v < cap else 0 for r, v in zip(lr_rows, vals)],
        color=["tab:red" if v >= cap else "tab:blue" for v in vals],
        alpha=0.7,
    )
    for i, v in enumerate(vals):
        if v >= cap:
            a2.text(cap - 0.2, i, f"{v:+.0f}%", va="center", ha="right", fontsize=7, color="w")
    a2.set_yticks(range(len(lr_rows)), [r["key"].replace(f"diloco-T{long}-", "") for r in lr_rows], fontsize=6)
    a2.set_xlim(min(-1.0, min(vals, default=0) - 0.5), cap)
    a2.axvline(2.0, color="r", ls="--", lw=1)
    a2.axvline(0.0, color="k", lw=0.8)
    a2.set_xlabel(f"eval loss vs data-parallel with the same inner lr (%), {long} steps")
    a2.set_title(f"every cell at {long} steps (mean of seeds)")
    a2.grid(alpha=0.3, axis="x")
    # where the gap arises: the gap along the run, at every eval point
    cells = {c["key"]: c for c in doc["cells"]}
    default = Cell("diloco", long).key()
    shown = lr_rows[:5] + [r for r in lr_rows[5:] if r["key"] == default]
    for r in shown:
        if r.get("dp_key") not in cells:
            continue
        mine, dp = cells[r["key"]]["curve"], {p["step"]: p["eval_loss"] for p in cells[r["dp_key"]]["curve"]}
        pts = [
            (p["step"], np.mean([100 * (a / b - 1) for a, b in zip(p["eval_loss"], dp[p["step"]])]))
            for p in mine
            if p["step"] in dp and p["step"] > 0
        ]
        if pts:
            name = r["key"].replace(f"diloco-T{long}-", "")
            a3.plot(
                *zip(*pts),
                lw=2 if r["key"] == default else 1,
                label=name + (" (default)" if r["key"] == default else ""),
            )
    a3.axhline(0.0, color="k", lw=0.8)
    a3.set_xlabel("inner step")
    a3.set_ylabel("eval loss vs data-parallel at the same step (%)")
    a3.set_title(f"the gap along the {long}-step runs (both at their own schedule)")
    a3.grid(alpha=0.3)
    a3.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
