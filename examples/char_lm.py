#!/usr/bin/env python3
"""Byte-level transformer language model trained with DiLoCo on real text.

Simulation mode (the default): N DiLoCo replicas in one process (``jax.vmap`` over a replica
axis, each replica with its own data shard), for H in ``--sync-every-list``, against synchronous
data-parallel training with the same inner optimizer and the same tokens seen. Prints the eval
loss (nats per byte) of each and writes them to ``--summary-json``.

Text: the ``.py`` files of the running interpreter's standard library (every machine has them),
split by file into train and eval, or any text file given with ``--text`` (last 10% is eval).

    python examples/char_lm.py                       # 4 replicas, H in {1, 10, 50} vs data-parallel
    python examples/char_lm.py --steps 200 --sync-every-list 50 --summary-json out.json

The functions here (corpus, model, loss, batches) are reused by the benchmarks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator

import numpy as np

VOCAB = 256


# ----------------------------------------------------------------------------------------- data
def stdlib_files() -> list[Path]:
    """The ``.py`` files of this interpreter's standard library (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel and rel[0] in ("site-packages", "dist-packages"):
            continue
        files.append(path)
    return files


def load_corpus(text: str | None = None, *, eval_every: int = 10, max_bytes: int = 64 << 20) -> tuple[np.ndarray, np.ndarray]:
    """Loads real text as bytes.

    Args:
      text: path of a text file; ``None`` means the standard library's ``.py`` files, split by
        file (every ``eval_every``-th file, in sorted order, goes to eval).
      eval_every: see above.
      max_bytes: cap on the bytes read (the stdlib is ~30 MB).

    Returns:
      ``(train, eval)``: 1-D uint8 arrays of bytes (vocabulary 256).

    Raises:
      ValueError: the text is missing or too short to make batches.
    """
    if text is not None:
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"--text: no such file: {text}")
        data = np.frombuffer(path.read_bytes()[:max_bytes], dtype=np.uint8)
        if data.size < 4096:
            raise ValueError(f"--text: {text} has {data.size} bytes; need at least 4096")
        cut = int(data.size * 0.9)
        return data[:cut].copy(), data[cut:].copy()
    train, evals, total = [], [], 0
    for i, path in enumerate(stdlib_files()):
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        (evals if i % eval_every == 0 else train).append(raw)
        total += len(raw)
        if total >= max_bytes:
            break
    if not train or not evals:
        raise ValueError("found no standard-library .py files; pass --text FILE")
    sep = b"\n\n"
    return (
        np.frombuffer(sep.join(train), dtype=np.uint8).copy(),
        np.frombuffer(sep.join(evals), dtype=np.uint8).copy(),
    )


def sample_batch(data: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> np.ndarray:
    """Random windows of ``seq_len + 1`` bytes: int32 array ``(batch, seq_len + 1)``."""
    starts = rng.integers(0, data.size - seq_len - 1, size=batch)
    return data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def eval_batches(data: np.ndarray, *, batch: int, seq_len: int, num_batches: int, seed: int = 1234) -> np.ndarray:
    """Fixed eval windows: int32 array ``(num_batches, batch, seq_len + 1)``."""
    rng = np.random.default_rng(seed)
    return np.stack([sample_batch(data, rng, batch, seq_len) for _ in range(num_batches)])


# ---------------------------------------------------------------------------------------- model
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 96
    num_layers: int = 2
    num_heads: int = 4
    seq_len: int = 64
    mlp_ratio: int = 4


def build_model(cfg: ModelConfig, seed: int = 0):
    """A decoder-only transformer (flax nnx) over bytes.

    Returns:
      ``(graphdef, params)``: the nnx graph definition and the ``nnx.State`` of its parameters
      (float32). ``apply(graphdef, params, tokens)`` gives logits.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            d = cfg.d_model
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
            self.proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.fc = nnx.Linear(d, cfg.mlp_ratio * d, rngs=rngs)
            self.out = nnx.Linear(cfg.mlp_ratio * d, d, rngs=rngs)

        def __call__(self, x):
            b, t, d = x.shape
            h = cfg.num_heads
            q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
            q, k, v = (z.reshape(b, t, h, d // h) for z in (q, k, v))
            att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.reshape(b, t, d))
            return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))

    class CharTransformer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
            self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model)))
            self.blocks = nnx.List([Block(rngs) for _ in range(cfg.num_layers)])
            self.ln = nnx.LayerNorm(cfg.d_model, rngs=rngs)
            self.head = nnx.Linear(cfg.d_model, VOCAB, use_bias=False, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    model = CharTransformer(nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def make_loss(graphdef):
    """``loss(params, tokens) -> scalar``: mean next-byte cross-entropy (nats), tokens int32 ``(B, T+1)``."""
    import optax
    from flax import nnx

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def inner_optimizer(lr: float, steps: int):
    """AdamW with linear warmup (5% of steps) and cosine decay to 10% (the DiLoCo inner setup)."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup_steps=max(1, steps // 20), decay_steps=steps, end_value=lr * 0.1
    )
    return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1)


def make_evaluator(graphdef, eval_tokens: np.ndarray):
    """``evaluate(params) -> float``: mean eval loss over the fixed eval windows (nats/byte)."""
    import jax
    import jax.numpy as jnp

    loss = make_loss(graphdef)
    tokens = jnp.asarray(eval_tokens)

    @jax.jit
    def _eval(params):
        return jax.lax.map(lambda b: loss(params, b), tokens).mean()

    return lambda params: float(_eval(params))


# ----------------------------------------------------------------------------------- simulation
def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def replica_batches(train: np.ndarray, *, replicas: int, batch: int, seq_len: int, seed: int) -> Iterator[np.ndarray]:
    """Endless int32 batches ``(replicas, batch, seq_len + 1)``; replica r draws from its own RNG."""
    rngs = [np.random.default_rng([seed, r]) for r in range(replicas)]
    while True:
        yield np.stack([sample_batch(train, g, batch, seq_len) for g in rngs])


def train_data_parallel(graphdef, params, train, *, replicas, batch, seq_len, steps, lr, seed, progress=True):
    """Synchronous data-parallel baseline: one model, global batch ``replicas * batch`` per step
    (the same tokens as ``replicas`` DiLoCo replicas), mean gradient, the same inner optimizer."""
    import jax
    import optax

    loss = make_loss(graphdef)
    tx = inner_optimizer(lr, steps)

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
    graphdef, params, train, *, replicas, batch, seq_len, steps, lr, sync_every, seed, codec=None, progress=True
):
    """N DiLoCo replicas under ``jax.vmap(axis_name="replica")``, rounds every ``sync_every`` steps.

    Returns ``(global_params, last train loss averaged over replicas)``; the global params are the
    anchor after the last outer step.
    """
    import jax
    import optax

    import ravnest_jax as rj

    loss = make_loss(graphdef)
    tx = rj.diloco(inner_optimizer(lr, steps), sync_every=sync_every, axis_name="replica", codec=codec)

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


def machine_info() -> dict:
    import jax

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


def run_simulation(args: argparse.Namespace) -> dict:
    import jax

    cfg = ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len)
    t0 = time.perf_counter()
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
    evaluate = make_evaluator(graphdef, eval_batches(evald, batch=32, seq_len=cfg.seq_len, num_batches=args.eval_batches))
    common = dict(
        replicas=args.replicas, batch=args.batch_size, seq_len=cfg.seq_len, steps=args.steps, lr=args.lr,
        seed=args.seed, progress=not args.no_progress,
    )
    results: dict[str, dict] = {}
    init_loss = evaluate(params0)
    t = time.perf_counter()
    p, train_loss = train_data_parallel(graphdef, params0, train, **common)
    results["data_parallel"] = {
        "eval_loss": evaluate(p), "train_loss": train_loss, "seconds": time.perf_counter() - t,
        "outer_rounds": 0, "exchanges": args.steps,
    }
    print(f"  data-parallel        eval loss {results['data_parallel']['eval_loss']:.4f}")
    for h in args.sync_every_list:
        t = time.perf_counter()
        p, train_loss = train_diloco_simulation(graphdef, params0, train, sync_every=h, codec=args.codec, **common)
        results[f"diloco_h{h}"] = {
            "sync_every": h, "eval_loss": evaluate(p), "train_loss": train_loss,
            "seconds": time.perf_counter() - t, "outer_rounds": args.steps // h, "exchanges": args.steps // h,
        }
        print(f"  DiLoCo H={h:<4d}         eval loss {results[f'diloco_h{h}']['eval_loss']:.4f}")
    summary = {
        "mode": "simulation",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "config": {**vars(args), "model": dataclasses.asdict(cfg), "params": int(n_params), "tokens_per_run": tokens},
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
    return summary


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return x


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--text", default=None, help="text file to train on (default: the stdlib's .py files)")
    p.add_argument("--replicas", type=_positive_int, default=4, help="DiLoCo replicas N")
    p.add_argument("--sync-every-list", type=_positive_int, nargs="+", default=[1, 10, 50], help="H values to compare")
    p.add_argument("--steps", type=_positive_int, default=300, help="inner steps per run")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per replica per step")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="bytes per sequence")
    p.add_argument("--d-model", type=_positive_int, default=96)
    p.add_argument("--layers", type=_positive_int, default=2)
    p.add_argument("--heads", type=_positive_int, default=4)
    p.add_argument("--lr", type=_positive_float, default=3e-3, help="peak inner AdamW learning rate")
    p.add_argument("--codec", default=None, help="pseudo-gradient codec applied in simulation (e.g. int4)")
    p.add_argument("--eval-batches", type=_positive_int, default=8, help="eval batches of 32 sequences")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summary-json", default=None, help="write the figures to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    args = p.parse_args(argv)
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = run_simulation(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2, default=str))
        print(f"\nwrote {args.summary_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
