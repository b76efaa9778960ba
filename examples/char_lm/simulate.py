"""The replica simulation (``main.py --simulate``): N DiLoCo replicas in one process
(``jax.vmap`` over a replica axis), for several H, against synchronous data-parallel training
with the same inner optimizer and the same tokens seen."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from char_lm.data import check_text, eval_batches, load_corpus, sample_batch
from char_lm.model import ModelConfig, build_model, inner_optimizer, make_evaluator, make_loss, outer_optimizer
from char_lm.report import machine_info, run_config


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def replica_batches(train: np.ndarray, *, replicas: int, batch: int, seq_len: int, seed: int) -> Iterator[np.ndarray]:
    """Endless int32 batches ``(replicas, batch, seq_len + 1)``; replica r draws from its own RNG."""
    rngs = [np.random.default_rng([seed, r]) for r in range(replicas)]
    while True:
        yield np.stack([sample_batch(train, g, batch, seq_len) for g in rngs])


def train_data_parallel(
    graphdef, params, train, *, replicas, batch, seq_len, steps, lr, seed, inner="adamw", progress=True
):
    """Synchronous data-parallel baseline: one model, global batch ``replicas * batch`` per step
    (the same tokens as ``replicas`` DiLoCo replicas), mean gradient, the same inner optimizer."""
    import jax
    import optax

    loss = make_loss(graphdef)
    tx = inner_optimizer(lr, steps, inner)

    @jax.jit
    def step(params, state, tokens):
        tokens = tokens.reshape(-1, tokens.shape[-1])
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = tx.init(params)
    data = replica_batches(train, replicas=replicas, batch=batch, seq_len=seq_len, seed=seed)
    bar = _progress(steps, "data-parallel", progress)
    value = None
    for _ in range(steps):
        params, state, value = step(params, state, next(data))
        bar.update(1)
    bar.close()
    return params, float(value)


def train_diloco_simulation(
    graphdef,
    params,
    train,
    *,
    replicas,
    batch,
    seq_len,
    steps,
    lr,
    sync_every,
    seed,
    codec=None,
    inner="adamw",
    outer=None,
    progress=True,
):
    """N DiLoCo replicas under ``jax.vmap(axis_name="replica")``, rounds every ``sync_every`` steps.

    Returns ``(global_params, last train loss averaged over replicas)``; the global params are the
    anchor after the last outer step.
    """
    import jax
    import optax

    import ravnest_jax as rj

    loss = make_loss(graphdef)
    tx = rj.diloco(inner_optimizer(lr, steps, inner), outer, sync_every=sync_every, axis_name="replica", codec=codec)

    def step(params, state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(value, "replica")

    vstep = jax.jit(jax.vmap(step, axis_name="replica"), donate_argnums=(0, 1))
    p = rj.replicate(params, replicas)
    s = rj.replicate(tx.init(params), replicas)
    data = replica_batches(train, replicas=replicas, batch=batch, seq_len=seq_len, seed=seed)
    bar = _progress(steps, f"DiLoCo H={sync_every}", progress)
    value = None
    for _ in range(steps):
        p, s, value = vstep(p, s, next(data))
        bar.update(1)
    bar.close()
    return rj.unreplicate(s.global_params), float(value[0])


def run_simulation(args: argparse.Namespace) -> dict:
    import jax

    cfg = ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len)
    t0 = time.perf_counter()
    check_text(args.text)
    train, evald = load_corpus(args.text)
    print(
        f"text: {'stdlib .py files' if args.text is None else args.text}: "
        f"{train.size / 1e6:.1f} MB train, {evald.size / 1e6:.1f} MB eval"
    )
    graphdef, params0 = build_model(cfg, seed=args.seed)
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    tokens = args.steps * args.replicas * args.batch_size * cfg.seq_len
    print(
        f"model: {n_params / 1e6:.2f}M params; {args.replicas} replicas x batch {args.batch_size} x "
        f"{cfg.seq_len} bytes x {args.steps} steps = {tokens / 1e6:.1f}M tokens per run"
    )
    evaluate = make_evaluator(
        graphdef, eval_batches(evald, batch=32, seq_len=cfg.seq_len, num_batches=args.eval_batches)
    )
    common = dict(
        replicas=args.replicas,
        batch=args.batch_size,
        seq_len=cfg.seq_len,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        inner=args.inner,
        progress=not args.no_progress,
    )
    outer = outer_optimizer(args.outer_lr, args.outer_momentum)
    codec = args.codec
    if codec is not None and codec != "fp32":
        from ravnest_jax import Codec

        # the value a swarm peer gives rj.Swarm (peer.py), simulated on one machine
        codec = Codec(
            codec,
            block_size=args.block_size,
            fraction=args.topk_fraction,
            mean=args.mean_codec,
            mean_ef=args.mean_ef == "on",
            error_feedback_decay=args.ef_decay,
        )
    results: dict[str, dict] = {}
    init_loss = evaluate(params0)
    t = time.perf_counter()
    p, train_loss = train_data_parallel(graphdef, params0, train, **common)
    results["data_parallel"] = {
        "eval_loss": evaluate(p),
        "train_loss": train_loss,
        "seconds": time.perf_counter() - t,
        "outer_rounds": 0,
        "exchanges": args.steps,
    }
    print(f"  data-parallel        eval loss {results['data_parallel']['eval_loss']:.4f}")
    for h in args.sync_every_list:
        t = time.perf_counter()
        p, train_loss = train_diloco_simulation(
            graphdef, params0, train, sync_every=h, codec=codec, outer=outer, **common
        )
        results[f"diloco_h{h}"] = {
            "sync_every": h,
            "eval_loss": evaluate(p),
            "train_loss": train_loss,
            "seconds": time.perf_counter() - t,
            "outer_rounds": args.steps // h,
            "exchanges": args.steps // h,
        }
        print(f"  DiLoCo H={h:<4d}         eval loss {results[f'diloco_h{h}']['eval_loss']:.4f}")
    summary = {
        "mode": "simulation",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "config": {
            **run_config(args),
            "model": dataclasses.asdict(cfg),
            "params": int(n_params),
            "tokens_per_run": tokens,
        },
        "eval_loss_at_init": init_loss,
        "results": results,
        "seconds": time.perf_counter() - t0,
    }
    print()
    print(f"eval loss (nats/byte) at equal tokens ({tokens / 1e6:.1f}M), initial {init_loss:.4f}:")
    print(f"| {'run':<16} | {'eval loss':>9} | {'vs DP':>7} | {'outer rounds':>12} | {'seconds':>7} |")
    print(f"|{'-' * 18}|{'-' * 11}|{'-' * 9}|{'-' * 14}|{'-' * 9}|")
    dp = results["data_parallel"]["eval_loss"]
    for name, r in results.items():
        rel = (r["eval_loss"] / dp - 1) * 100
        print(f"| {name:<16} | {r['eval_loss']:9.4f} | {rel:+6.2f}% | {r['outer_rounds']:12d} | {r['seconds']:7.1f} |")
    small = [h for h in args.sync_every_list if h < 10]
    if small:
        print(SMALL_H_NOTE.format(h=", ".join(f"H={h}" for h in small)))
    return summary


SMALL_H_NOTE = """
Note on {h}: DiLoCo with a small H is not data-parallel training. After every H inner steps the
outer Nesterov step (lr 0.7, momentum 0.9, the DiLoCo defaults) applies the averaged change of
the replicas; for a change that keeps its direction, momentum builds the step up to
lr / (1 - momentum) = 7 times that change. With H = 1 the change is one AdamW step, so the
model moves up to 7x the inner learning rate per step and overshoots; with H in the tens to
hundreds (arXiv 2311.08105) the change is a whole local trajectory and the outer settings fit.
Read H = 1 as a bound, not a recommended setting (for H = 1 use outer SGD with lr 1 and no
momentum: it is then exactly synchronous averaging of the AdamW updates)."""
