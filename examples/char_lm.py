#!/usr/bin/env python3
"""Byte-level transformer language model trained with DiLoCo on real text.

Three ways to run it:

- ``--local-peers N``: a local swarm. Starts a rendezvous and N peer processes on 127.0.0.1
  that train together with overlapped, int4-compressed outer rounds (``rj.Swarm`` +
  ``rj.OuterSync``), shows progress, and ends with a summary: eval loss of the global params,
  rounds, bytes each peer sent next to what data-parallel training would have sent,
  compute utilisation, stalls. Ctrl+C stops all of it.
- ``--rendezvous URL --run-id ID --token-file F``: one peer, for separate machines.
- with either: ``--devices N [--layout replicated|fsdp]``: each peer trains over N local devices
  (the batch split over them, params replicated or split FSDP-style); without accelerators N CPU
  devices are made (docs/multi-device.md).
- neither (``--simulate``): the replica simulation: N DiLoCo replicas in one process
  (``jax.vmap`` over a replica axis, each replica with its own data shard), for H in
  ``--sync-every-list``, against synchronous data-parallel training with the same inner
  optimizer and the same tokens seen. Prints the eval loss (nats per byte) of each.

Text: the ``.py`` files of the running interpreter's standard library (every machine has them),
split by file into train and eval, or any text file given with ``--text`` (last 10% is eval).

    python examples/char_lm.py --local-peers 4            # a local swarm of 4 peer processes
    python examples/char_lm.py --local-peers 2 --devices 2 --layout fsdp   # 2 peers x 2 devices
    python examples/char_lm.py --simulate                 # 4 replicas, H in {1, 10, 50} vs data-parallel
    python examples/char_lm.py --rendezvous http://host:8765 --run-id exp1 --token-file token

The functions here (corpus, model, loss, batches) are reused by the benchmarks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

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


def load_corpus(
    text: str | None = None, *, eval_every: int = 10, max_bytes: int = 64 << 20
) -> tuple[np.ndarray, np.ndarray]:
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
        progress=not args.no_progress,
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
        p, train_loss = train_diloco_simulation(graphdef, params0, train, sync_every=h, codec=args.codec, **common)
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


# ------------------------------------------------------------------------------- swarm: a peer
def force_cpu_devices(n: int) -> None:
    """Lets the CPU backend show ``n`` devices (for ``--devices n`` without accelerators). Must
    run before any jax use; without effect on GPU/TPU backends, and once jax has started."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend is already up (for example in a test process)
        pass


def peer_mesh(n: int):
    """The peer's local device mesh: ``n`` devices on one ``"data"`` axis (automatic axes: XLA
    partitions the model code as it is), or ``None`` for one device.

    Raises:
      ValueError: fewer than ``n`` local devices.
    """
    import jax
    from jax.sharding import AxisType

    if n == 1:
        return None
    devices = jax.local_devices()
    if len(devices) < n:
        raise ValueError(f"--devices {n}: this process has {len(devices)} local {jax.default_backend()} devices")
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=devices[:n])


def place_on_mesh(mesh, layout: str, params, state):
    """Lays params and optimizer state out on the peer's mesh and returns ``(params, state,
    put_batch)``; ``put_batch(tokens)`` splits a batch over the devices (data parallel).

    ``layout="replicated"``: every device holds all params; ``"fsdp"``: every leaf is split along
    its first axis when that divides evenly (else replicated), and XLA gathers it where used.
    Without a mesh everything stays where it is.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if mesh is None:
        return params, state, lambda tokens: tokens
    n = mesh.size

    def spec(x):
        if layout == "fsdp" and x.ndim and x.shape[0] % n == 0:
            return NamedSharding(mesh, P("data"))
        return NamedSharding(mesh, P())

    params = jax.device_put(params, jax.tree.map(spec, params))
    # the optimizer state like the params (moments, anchor, outer momentum); scalars replicated
    state = jax.device_put(state, jax.tree.map(spec, state))
    data = NamedSharding(mesh, P("data"))
    return params, state, lambda tokens: jax.device_put(tokens, data)


def _emit(args: argparse.Namespace, **event) -> None:
    """One JSON line on stdout for the launcher (``--json-events``)."""
    if args.json_events:
        print(json.dumps({**event, "t": round(time.time(), 3)}), flush=True)


def _watch_parent(parent_pid: int) -> None:
    """Stops this peer when the launcher dies (no orphans after a crash or kill -9)."""
    import _thread
    import threading

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                _thread.interrupt_main()
                time.sleep(15)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def json_safe(value):
    """``value`` with every non-finite float replaced by ``None``: the summary is strict JSON
    (``json.dumps(..., allow_nan=False)``; ``NaN`` is refused by strict parsers)."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, (np.floating, np.integer)):
        return json_safe(value.item())
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def preflight_peer(args: argparse.Namespace) -> tuple[str, str]:
    """Everything a peer can get wrong that is cheap to check, before loading jax or compiling:
    the token, the text, the listen port, the rendezvous and whether it accepts the token.
    Returns ``(token, peer_id)``.

    Raises:
      ValueError, SwarmError: one line naming the problem.
    """
    from ravnest_jax import checkpoint, swarm

    token = swarm.read_token(args.token_file)
    check_text(args.text)
    swarm.check_listen(args.listen)
    swarm.check_rendezvous(args.rendezvous, run_id=args.run_id, token=token)
    if args.peer_id:
        peer_id = args.peer_id
    elif args.checkpoint_dir:  # the same peer after a restart on the same directory
        peer_id = checkpoint.persistent_peer_id(args.checkpoint_dir)
    else:
        import secrets

        peer_id = secrets.token_hex(8)
    return token, peer_id


def check_text(text: str | None) -> None:
    """Fails fast (one line) on a ``--text`` that :func:`load_corpus` would refuse."""
    if text is None:
        return
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"--text: no such file: {text}")
    if path.stat().st_size < 4096:
        raise ValueError(f"--text: {text} has {path.stat().st_size} bytes; need at least 4096")


def run_peer(args: argparse.Namespace) -> dict:
    """One swarm peer: trains ``--max-steps`` inner steps with overlapped outer rounds.

    Ctrl+C (or SIGTERM) stops it within seconds: it saves a checkpoint when no round is in
    flight (with ``--checkpoint-dir``), leaves the swarm and returns its summary so far
    (``"interrupted": true``)."""
    token, peer_id = preflight_peer(args)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    if args.devices > 1:
        force_cpu_devices(args.devices)
    _emit(args, event="compiling", peer=peer_id)

    import jax
    import optax

    import ravnest_jax as rj
    from ravnest_jax.swarm import Timeouts
    from ravnest_jax.sync import device_digest, digest_hex

    cfg = ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len)
    train, evald = load_corpus(args.text)
    graphdef, params = build_model(cfg, seed=args.seed)  # identical on every peer
    evaluate = make_evaluator(
        graphdef, eval_batches(evald, batch=32, seq_len=cfg.seq_len, num_batches=args.eval_batches)
    )
    loss_fn = make_loss(graphdef)
    tx = rj.diloco(
        inner_optimizer(args.lr, args.schedule_steps or args.max_steps),
        sync_every=args.sync_every,
        fragments=args.fragments,
    )
    mesh = peer_mesh(args.devices)
    state = tx.init(params)
    params, state, put_batch = place_on_mesh(mesh, args.layout, params, state)

    def step(params, state, tokens):
        value, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    # on a mesh the step keeps the layouts of params and state (XLA would otherwise choose)
    layouts = (
        None
        if mesh is None
        else (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, state), None)
    )
    train_step = jax.jit(step, donate_argnums=(0, 1), out_shardings=layouts)

    n_params = sum(x.size for x in jax.tree.leaves(params))
    timeouts = Timeouts(part=args.part_timeout, round=max(4 * args.part_timeout, 30.0), heartbeat=1.0, eviction=5.0)
    data_seed = args.data_seed if args.data_seed is not None else int(peer_id.encode().hex(), 16) % (1 << 31)
    rounds_log: list[dict] = []
    last_logged_loss: list = [None]

    def on_round(m) -> None:
        rec = dataclasses.asdict(m)
        rec["train_loss"] = last_logged_loss[0]  # this peer's last logged train loss
        rounds_log.append(rec)
        _emit(
            args,
            event="round",
            **{
                k: rec[k]
                for k in (
                    "round",
                    "swarm_round",
                    "step",
                    "ok",
                    "group_size",
                    "bytes_sent",
                    "exchange_seconds",
                    "stall_seconds",
                    "state_digest",
                    "error",
                )
            },
        )

    # the swarm joins the run only once this peer is compiled and ready: a registered peer is in
    # every round's group, and one still compiling would cost the others a timeout
    swarm = rj.Swarm(
        args.rendezvous,
        run_id=args.run_id,
        token=token,
        codec=args.codec,
        listen=args.listen,
        advertise=args.advertise,
        timeouts=timeouts,
        peer_id=peer_id,
    )
    mode = "blocking" if args.overlap_steps == 0 and args.mode != "eager" else args.mode
    sync = rj.OuterSync(
        tx,
        swarm,
        mode=mode,
        overlap_steps=args.overlap_steps,
        alpha=args.alpha,
        samples_per_step=args.batch_size,
        on_round=on_round,
    )
    tokens0 = put_batch(sample_batch(train, np.random.default_rng([data_seed, 0]), args.batch_size, cfg.seq_len))
    train_step.lower(params, state, tokens0).compile()
    sync.warmup(params, state)
    eval_start = evaluate(state.global_params)
    if args.join_when_exists:
        _emit(args, event="ready")
        while not Path(args.join_when_exists).exists():
            time.sleep(0.05)
    ckpt = None
    save_every = args.checkpoint_every or args.sync_every
    if args.checkpoint_dir:
        # saves happen between rounds (no exchange in flight), at most every `save_every` steps;
        # with overlapped rounds that is once the round merged (tau steps after its boundary)
        ckpt = rj.Checkpointer(
            args.checkpoint_dir,
            max_to_keep=3,
            save_interval_steps=1,
            metadata={"run_id": args.run_id, "peer": peer_id, "example": "char_lm"},
        )
    wall = 0.0
    interrupted = False
    start_step = int(state.count)
    with swarm, sync:
        listen = f"{args.listen.rpartition(':')[0]}:{swarm.port}"
        # join a running swarm (its state), resume this peer's checkpoint, or restart a whole
        # swarm from the checkpoint step every peer has; the driver serves our state to joiners
        got = rj.sync.join_or_resume(swarm, sync, params, state, checkpointer=ckpt, min_peers=args.min_peers)
        params, state = got.params, got.state
        joined, resumed_from = got.how == "joined", got.resumed_from
        if got.how in ("resumed", "restarted"):
            print(
                f"{'whole-swarm restart: ' if got.how == 'restarted' else ''}resumed from {args.checkpoint_dir} "
                f"at step {resumed_from}",
                file=sys.stderr,
            )
        start_step = int(state.count)
        if joined or resumed_from is not None:  # the loss where this process takes over
            eval_start = evaluate(state.global_params)
        _emit(
            args,
            event="start",
            peer=swarm.peer_id,
            step=start_step,
            eval_loss=eval_start,
            params=int(n_params),
            joined=joined,
        )
        bar = None
        if not args.json_events and not args.no_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=args.max_steps, initial=start_step, desc=f"peer {swarm.peer_id}", dynamic_ncols=True)
        t0 = t_step = time.perf_counter()
        last_loss = None
        t = last_saved = start_step

        def save(at: int) -> None:
            ckpt.save(at, params=params, opt_state=state, extra=rj.sync.checkpoint_extra(sync, params), force=True)
            swarm.set_info({**swarm.info, "checkpoint_steps": ckpt.saved_steps()})

        consistent = True  # params, state and sync agree (not in the middle of a step)
        try:
            while t < args.max_steps:
                if _LOOP["stop"]:
                    raise KeyboardInterrupt
                consistent = False
                tokens = put_batch(
                    sample_batch(train, np.random.default_rng([data_seed, t]), args.batch_size, cfg.seq_len)
                )
                params, state, value = train_step(params, state, tokens)
                params, state = sync(params, state)
                t_prev, t = t, sync.step  # steps done; a resync may move this peer to the swarm's step
                consistent = True
                if ckpt is not None and sync.pending == 0 and t - last_saved >= save_every:
                    save(t)
                    last_saved = t
                if args.min_step_seconds > 0:
                    value.block_until_ready()
                    time.sleep(max(0.0, args.min_step_seconds - (time.perf_counter() - t_step)))
                t_step = time.perf_counter()
                if t // args.log_every > t_prev // args.log_every:
                    # read the loss of the previous log point: long computed, so no stall here
                    shown = None if last_loss is None else float(last_loss)
                    last_loss = value
                    last_logged_loss[0] = shown
                    _emit(args, event="progress", step=t, loss=shown)
                    if bar is not None:
                        bar.update(t - bar.n)
                        if shown is not None:
                            bar.set_postfix(loss=f"{shown:.3f}", rounds=sum(r["ok"] for r in rounds_log))
            consistent = False
            params, state = sync.flush(params, state)
            consistent = True
        except KeyboardInterrupt:
            # stop within seconds: a round in flight is abandoned (the last checkpoint stands)
            interrupted = True
        if interrupted:
            print(f"\npeer {peer_id}: interrupted at step {t}", file=sys.stderr)
        wall = time.perf_counter() - t0
        if ckpt is not None:
            if consistent and sync.pending == 0 and t > last_saved:
                save(t)  # Ctrl+C between steps and rounds: nothing done since is lost
            ckpt.close()
        if bar is not None:
            bar.close()
        eval_end = evaluate(state.global_params) if consistent else None
        summary = sync.summary()
        # the digest of the last merge (no compilation at exit); computed only after a resync
        final_digest = sync.global_state_digest or (
            digest_hex(device_digest((state.global_params, state.outer_state))) if consistent else None
        )
    return json_safe(
        {
            "peer": peer_id,
            "run_id": args.run_id,
            "listen": listen,
            "address": swarm.address,
            "interrupted": interrupted,
            "devices": 1 if mesh is None else mesh.size,
            "layout": "single" if mesh is None else args.layout,
            "joined_running_swarm": joined,
            "resumed_from_step": resumed_from,
            "start_step": start_step,
            "end_step": t,
            "steps": t - start_step,
            "params": int(n_params),
            "eval_loss_start": eval_start,
            "eval_loss_end": eval_end,
            "rounds": summary["rounds"],
            "failed_rounds": summary["failed_rounds"],
            "resyncs": summary["resyncs"],
            "bytes_sent": summary["bytes_sent"],
            "bytes_received": summary["bytes_received"],
            "stall_seconds": summary["stall_seconds"],
            "mean_overlap_steps": summary["mean_overlap_steps"],
            "compute_utilisation": summary["compute_utilisation"],
            "wall_seconds": wall,
            "final_global_digest": final_digest,
            "round_digests": [r["state_digest"] for r in rounds_log if r["ok"]],
            "checkpoint_steps": ckpt.saved_steps() if ckpt is not None else [],
            "round_log": rounds_log,
        }
    )


# ---------------------------------------------------------------------------- swarm: a launcher
_FORWARD = (
    "text",
    "sync_every",
    "max_steps",
    "batch_size",
    "seq_len",
    "d_model",
    "layers",
    "heads",
    "lr",
    "codec",
    "overlap_steps",
    "mode",
    "alpha",
    "fragments",
    "eval_batches",
    "seed",
    "part_timeout",
    "log_every",
    "min_step_seconds",
    "checkpoint_every",
    "schedule_steps",
    "devices",
    "layout",
    "log_level",
)


def _forward_flags(args: argparse.Namespace) -> list[str]:
    out = []
    for name in _FORWARD:
        value = getattr(args, name)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


_INTERNAL = (
    "json_events",
    "join_when_exists",
    "parent_pid",
    "local_peers",
    "rendezvous",
    "simulate",
    "summary_json",
    "no_progress",
    "token_file",
    "peer_id",
    "data_seed",
    "listen",
    "advertise",
)


def run_config(args: argparse.Namespace, **actual) -> dict:
    """The settings of a run as the user would state them: no launcher internals, and the
    values that were actually used (``actual``: the run id, the peers' addresses...)."""
    return {**{k: v for k, v in vars(args).items() if k not in _INTERNAL}, **actual}


def print_peer_table(results: list[dict], dp_bytes: float | None) -> bool:
    """The summary table of the peers that finished; returns whether their global states are
    identical (final digest and every round's digest)."""
    digests = {r["final_global_digest"] for r in results}
    same_rounds = len({tuple(r["round_digests"]) for r in results}) == 1

    def num(x, fmt):
        return format(x, fmt) if x is not None else format("-", fmt.split(".")[0].rstrip("f") + "s")

    print()
    print(
        f"| {'peer':<16} | {'eval start':>10} | {'eval end':>8} | {'rounds':>6} | {'failed':>6} | {'sent MB':>8} | "
        f"{'DP would send MB':>16} | {'utilisation':>11} | {'stall s':>7} | {'mean tau':>8} |"
    )
    print(
        f"|{'-' * 18}|{'-' * 12}|{'-' * 10}|{'-' * 8}|{'-' * 8}|{'-' * 10}|{'-' * 18}|{'-' * 13}|{'-' * 9}|{'-' * 10}|"
    )
    for r in results:
        print(
            f"| {r['peer']:<16} | {num(r['eval_loss_start'], '10.4f')} | {num(r['eval_loss_end'], '8.4f')} | "
            f"{r['rounds']:6d} | {r['failed_rounds']:6d} | {r['bytes_sent'] / 1e6:8.2f} | "
            f"{num(None if dp_bytes is None else dp_bytes / 1e6, '16.1f')} | "
            f"{num(r['compute_utilisation'], '11.3f')} | {r['stall_seconds']:7.2f} | {num(r['mean_overlap_steps'], '8.1f')} |"
        )
    if len(results) > 1:
        print(
            f"\nglobal state (params and outer optimizer state) identical on all peers: "
            f"{'yes' if len(digests) == 1 else 'NO'} (digest {str(sorted(map(str, digests))[0])[:16]}...); "
            f"per-round digests identical: {'yes' if same_rounds else 'NO'}"
        )
    elif results:
        print(f"\nglobal state digest {str(results[0]['final_global_digest'])[:16]}...")
    return len(digests) == 1 and same_rounds


def data_parallel_bytes(n: int, params: int, steps: int) -> float:
    """Bytes one peer would send with data-parallel training: a ring all-reduce of float32
    gradients every step sends 2 (N - 1) / N * 4 * params bytes per peer per step."""
    return 2 * (n - 1) / n * 4 * params * steps


def run_local_swarm(args: argparse.Namespace) -> dict:
    """Starts a rendezvous and ``--local-peers`` peer processes on 127.0.0.1 and waits for them.

    Nothing touches the disk (the token travels in the environment, results and logs through
    pipes), so neither Ctrl+C nor a crash of this process leaves files behind; the children stop
    by themselves when this process dies. Ctrl+C stops the peers (each saves a checkpoint and
    reports what it did) and returns the summary so far with ``"interrupted": true``.
    """
    import collections
    import queue
    import secrets
    import signal
    import subprocess
    import threading

    from tqdm.auto import tqdm

    from ravnest_jax.launch import stop_processes

    check_text(args.text)  # before anything starts
    n = args.local_peers
    procs: list[subprocess.Popen] = []
    run_id = f"char-lm-{secrets.token_hex(3)}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAVNEST_TOKEN": secrets.token_hex(16)}
    events: queue.Queue = queue.Queue()
    tails: dict[str, collections.deque] = {}

    def pump(stream, name: str, parse: bool) -> None:
        tail = tails.setdefault(name, collections.deque(maxlen=60))
        for line in stream:
            tail.append(line)
            if parse:
                try:
                    events.put((name, json.loads(line)))
                except ValueError:
                    pass

    def start(cmd: list[str], name: str, extra_env: dict | None = None) -> subprocess.Popen:
        p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, **(extra_env or {})}
        )
        procs.append(p)
        threading.Thread(target=pump, args=(p.stdout, name, True), daemon=True).start()
        threading.Thread(target=pump, args=(p.stderr, name + ":stderr", False), daemon=True).start()
        return p

    steps = [0] * n
    results: dict[int, dict] = {}
    peers: list[subprocess.Popen] = []
    interrupted = False
    bar = None
    rounds = 0

    def handle(name: str, ev: dict) -> None:
        nonlocal rounds
        if not name.startswith("peer"):
            return
        i = int(name[4:])
        kind = ev.get("event")
        if kind == "compiling" and bar is not None:
            compiling.add(i)
            bar.set_description_str(f"{n} peers (compiling {len(compiling)}/{n})")
        elif kind == "start" and bar is not None:
            started.add(i)
            bar.set_description_str(f"{n} peers" if len(started) == n else f"{n} peers ({len(started)}/{n} training)")
            steps[i] = ev.get("step", 0)
            bar.update(max(sum(steps) - bar.n, 0))
        elif kind == "progress":
            steps[i] = ev["step"]
            if bar is not None:
                bar.update(max(sum(steps) - bar.n, 0))
            if ev.get("loss") is not None:
                losses[i] = ev["loss"]
                if bar is not None:
                    bar.set_postfix(loss=f"{np.mean(list(losses.values())):.3f}", rounds=rounds)
        elif kind == "round" and i == 0:
            rounds += bool(ev["ok"])
            if bar is not None and losses:
                bar.set_postfix(loss=f"{np.mean(list(losses.values())):.3f}", rounds=rounds)
            if args.no_progress:  # a line per round for logs (the bar shows it otherwise)
                loss = f", mean train loss {np.mean(list(losses.values())):.3f}" if losses else ""
                print(
                    f"round {ev['round']} at step {ev['step']}: {'ok' if ev['ok'] else 'failed: ' + str(ev.get('error'))}, "
                    f"{ev['group_size']} peers{loss}",
                    flush=True,
                )
        elif kind == "result":
            results[i] = ev["result"]

    compiling: set[int] = set()
    started: set[int] = set()
    losses: dict[int, float] = {}
    url = None
    try:
        rv = start(
            [
                sys.executable,
                "-m",
                "ravnest_jax.cli",
                "rendezvous",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--quiet",
                "--heartbeat",
                "1",
                "--eviction",
                "5",
                "--exit-with-parent",
            ],
            "rendezvous",
        )
        url = None
        deadline = time.monotonic() + 30
        while url is None:
            if rv.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "the rendezvous did not start:\n"
                    + "".join(tails.get("rendezvous", []))
                    + "".join(tails.get("rendezvous:stderr", []))
                )
            text = "".join(tails.get("rendezvous", []))
            if "listening on " in text:
                url = text.split("listening on ", 1)[1].split()[0]
            time.sleep(0.05)
        print(
            f"rendezvous {url}, run {run_id}; starting {n} peers "
            f"(codec {args.codec}, H={args.sync_every}, overlap {args.overlap_steps}, mode {args.mode})"
        )
        # N peers share this machine's cores: one compute thread each
        xla = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")}
        for i in range(n):
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--rendezvous",
                url,
                "--run-id",
                run_id,
                "--peer-id",
                f"peer{i}",
                "--data-seed",
                str(i),
                "--min-peers",
                str(n),
                "--listen",
                "127.0.0.1:0",
                "--json-events",
                "--parent-pid",
                str(os.getpid()),
                *_forward_flags(args),
            ]
            if args.checkpoint_dir:
                cmd += ["--checkpoint-dir", str(Path(args.checkpoint_dir).resolve() / f"peer{i}")]
            peers.append(start(cmd, f"peer{i}", xla))
        bar = tqdm(total=n * args.max_steps, desc=f"{n} peers (starting)", disable=args.no_progress, dynamic_ncols=True)
        if args.no_progress:
            print(f"compiling on {n} peers (a minute or so on a small CPU machine)...", flush=True)
        while any(p.poll() is None for p in peers) or not events.empty():
            try:
                handle(*events.get(timeout=0.5))
            except queue.Empty:
                continue
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping the peers and the rendezvous", file=sys.stderr)
    finally:
        stop_processes(procs[1:], signal.SIGINT, 20.0)  # the peers: as Ctrl+C, they save and report
        stop_processes(procs[:1])  # then the rendezvous
        time.sleep(0.2)  # the pump threads read the last lines of the peers that stopped
        while not events.empty():
            handle(*events.get())
        if bar is not None:
            bar.set_postfix(
                loss=f"{np.mean(list(losses.values())):.3f}" if losses else "-",
                rounds=results.get(0, {}).get("rounds", rounds),
            )
            bar.close()
    failed = {}
    for i, p in enumerate(peers):
        rc = p.wait()
        if interrupted and i in results:
            continue
        if rc != 0 or i not in results:
            how = (
                f"was killed by {signal.Signals(-rc).name}"
                if rc < 0
                else f"exited with status {rc}"
                if rc
                else "exited without a result"
            )
            err = [ln.rstrip() for ln in tails.get(f"peer{i}:stderr", []) if ln.strip()][-5:]
            failed[f"peer{i}"] = f"{how} after step {steps[i]}" + "".join(f"\n    {ln}" for ln in err)
    if not interrupted:
        for name, why in failed.items():
            print(f"{name} {why}", file=sys.stderr)
    done = [results[i] for i in range(len(peers)) if i in results and f"peer{i}" not in failed]
    if not done and not interrupted:
        raise RuntimeError("no peer finished")
    if failed and not interrupted:
        print(f"\n{len(failed)} of {n} peers did not finish (above); the {len(done)} that did:")
    dp_bytes = data_parallel_bytes(n, done[0]["params"], args.max_steps) if done else 0.0
    equal = print_peer_table(done, dp_bytes) if done else False
    return {
        "mode": "local_swarm",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "config": run_config(args, run_id=run_id, rendezvous=url),
        "interrupted": interrupted,
        "peers": done,
        "data_parallel_bytes_per_peer": dp_bytes,
        "global_digests_equal": bool(done) and len({r["final_global_digest"] for r in done}) == 1,
        "round_digests_equal": equal,
        "failed_peers": failed,
    }


def _int_at_least(value: str, low: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    return n


def _overlap(value: str) -> int | str:
    return value if value == "auto" else _int_at_least(value, 0, "an integer >= 0 or 'auto'")


def _positive_int(value: str) -> int:
    return _int_at_least(value, 1, "a positive integer")


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return x


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: not appended where the help text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    g = p.add_argument_group("mode")
    g.add_argument("--local-peers", type=_positive_int, default=None, help="run a local swarm of N peer processes")
    # under `ravnest-jax local -- python examples/char_lm.py` the launcher's RAVNEST_* variables
    # are the defaults: each process is one peer of the launcher's swarm
    env = os.environ.get
    g.add_argument(
        "--rendezvous",
        default=env("RAVNEST_RENDEZVOUS"),
        help="rendezvous URL: run one peer of a swarm ($RAVNEST_RENDEZVOUS)",
    )
    g.add_argument("--simulate", action="store_true", help="the replica simulation (the default without the two above)")
    p.add_argument("--text", default=None, help="text file to train on (default: the stdlib's .py files)")
    p.add_argument("--replicas", type=_positive_int, default=4, help="DiLoCo replicas N")
    p.add_argument("--sync-every-list", type=_positive_int, nargs="+", default=[1, 10, 50], help="H values to compare")
    p.add_argument("--steps", type=_positive_int, default=300, help="inner steps per run")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per replica per step")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="bytes per sequence")
    p.add_argument("--d-model", type=_positive_int, default=96, help="width of the transformer (a multiple of --heads)")
    p.add_argument("--layers", type=_positive_int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=_positive_int, default=4, help="attention heads per block")
    p.add_argument("--lr", type=_positive_float, default=3e-3, help="peak inner AdamW learning rate")
    p.add_argument("--eval-batches", type=_positive_int, default=8, help="eval batches of 32 sequences")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial params (the same on every peer)")
    p.add_argument("--summary-json", default=None, help="write the figures to this JSON file")
    s = p.add_argument_group("swarm (--local-peers / --rendezvous)")
    s.add_argument("--run-id", default=env("RAVNEST_RUN_ID", "char-lm"), help="run id of the swarm ($RAVNEST_RUN_ID)")
    s.add_argument("--token-file", default=None, help="file with the run token (else $RAVNEST_TOKEN)")
    s.add_argument("--max-steps", type=_positive_int, default=600, help="inner steps of each peer")
    s.add_argument("--sync-every", type=_positive_int, default=50, help="H, inner steps per outer round")
    p.add_argument(
        "--codec",
        default=env("RAVNEST_CODEC"),
        help="pseudo-gradient codec (default: $RAVNEST_CODEC, else int4 in a swarm, none in the simulation)",
    )
    s.add_argument(
        "--overlap-steps",
        type=_overlap,
        default="auto",
        help="tau: inner steps a round's exchange overlaps (0: blocking; 'auto': enough steps to "
        "cover the measured exchange time, per round)",
    )
    s.add_argument("--mode", choices=["delayed", "eager", "blocking"], default="delayed", help="outer-sync mode")
    s.add_argument("--alpha", type=float, default=0.0, help="mixing weight of local params at a late merge")
    s.add_argument("--fragments", type=_positive_int, default=1, help="streaming fragments F")
    s.add_argument(
        "--part-timeout", type=_positive_float, default=30.0, help="deadline of each phase of a round, seconds"
    )
    s.add_argument(
        "--listen",
        default=env("RAVNEST_LISTEN", "0.0.0.0:0"),
        help="host:port this peer's server binds ($RAVNEST_LISTEN)",
    )
    s.add_argument("--advertise", default=None, help="URL other peers reach this peer at (behind NAT)")
    s.add_argument(
        "--peer-id",
        default=env("RAVNEST_PEER_ID"),
        help="this peer's id (default: $RAVNEST_PEER_ID, else kept in --checkpoint-dir, so a restart is the same "
        "peer; else random)",
    )
    s.add_argument(
        "--data-seed",
        type=int,
        default=int(env("RAVNEST_RANK")) if env("RAVNEST_RANK", "").isdigit() else None,
        help="seed of this peer's data order (default: $RAVNEST_RANK, else from the peer id)",
    )
    s.add_argument(
        "--min-peers",
        type=int,
        default=int(env("RAVNEST_WORLD_SIZE")) if env("RAVNEST_WORLD_SIZE", "").isdigit() else 1,
        help="wait for this many peers before training (default: $RAVNEST_WORLD_SIZE, else 1)",
    )
    s.add_argument("--log-every", type=_positive_int, default=10, help="progress every this many steps")
    s.add_argument(
        "--min-step-seconds",
        type=float,
        default=0.0,
        help="emulate a slower accelerator: each inner step takes at least this long",
    )
    s.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save checkpoints here (orbax) and resume from the latest one (a swarm: one subfolder per peer)",
    )
    s.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=None,
        help="steps between checkpoints (default: --sync-every); a checkpoint is written at the first step "
        "with no round in flight, so with overlap tau the steps are k * N + tau, named by the "
        "inner steps they hold",
    )
    s.add_argument(
        "--schedule-steps",
        type=_positive_int,
        default=None,
        help="length of the learning-rate schedule (default: --max-steps; fix it to resume a run further)",
    )
    s.add_argument(
        "--devices",
        type=_positive_int,
        default=1,
        help="local devices of each peer: the batch is split over them (data parallel); on a "
        "machine without accelerators this many CPU devices are made",
    )
    s.add_argument(
        "--layout",
        choices=["replicated", "fsdp"],
        default="replicated",
        help="with --devices > 1: params replicated on every device, or split along their first axis",
    )
    s.add_argument("--json-events", action="store_true", help=argparse.SUPPRESS)
    s.add_argument("--join-when-exists", default=None, help=argparse.SUPPRESS)  # tests: join on cue
    s.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of the ravnest_jax loggers (INFO shows round retries and resyncs)",
    )
    args = p.parse_args(argv)
    from ravnest_jax.compress import CODECS

    if args.codec is not None and args.codec not in CODECS:
        p.error(f"--codec must be one of {', '.join(CODECS)}, got {args.codec!r}")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if args.local_peers and args.rendezvous:
        p.error("--local-peers and --rendezvous exclude each other")
    if not 0.0 <= args.alpha <= 1.0:
        p.error("--alpha must be in [0, 1]")
    gap = args.sync_every // args.fragments
    if (args.local_peers or args.rendezvous) and args.overlap_steps != "auto" and args.overlap_steps >= gap:
        p.error("--overlap-steps must be smaller than --sync-every / --fragments")
    if (args.local_peers or args.rendezvous) and args.overlap_steps == "auto" and gap < 2:
        p.error("--overlap-steps auto needs --sync-every / --fragments >= 2")
    if args.mode == "eager" and args.overlap_steps == 0:
        p.error("--mode eager needs --overlap-steps >= 1")
    if args.mode == "blocking" and args.overlap_steps == "auto":
        args.overlap_steps = 0
    if args.rendezvous and not (args.token_file or os.environ.get("RAVNEST_TOKEN")):
        p.error("--rendezvous needs --token-file (or $RAVNEST_TOKEN)")
    if args.devices > 1 and not (args.local_peers or args.rendezvous):
        p.error("--devices applies to swarm peers (--local-peers / --rendezvous)")
    if args.batch_size % args.devices:
        p.error(f"--batch-size ({args.batch_size}) must be a multiple of --devices ({args.devices})")
    if args.checkpoint_dir and args.rendezvous and os.environ.get("RAVNEST_PEER_ID") and not args.local_peers:
        # under `ravnest-jax local`: one subfolder per peer, as with --local-peers
        args.checkpoint_dir = str(Path(args.checkpoint_dir) / os.environ["RAVNEST_PEER_ID"])
    if not (args.local_peers or args.rendezvous):
        args.simulate = True
    elif args.codec is None:
        args.codec = "int4"
    return args


_STOPPED_BY: list[int] = []
# a stop asked for: the training loop checks it every step, because a KeyboardInterrupt raised
# at an arbitrary point can land in a callback whose exceptions Python ignores (jax's gc
# callback) and be lost (seen in the restart soak test under load)
_LOOP = {"stop": False}


def _stop(signum, frame):
    """SIGINT (Ctrl+C) and SIGTERM (``kill``, a scheduler, ``docker stop``) stop like Ctrl+C: a
    peer leaves the swarm at once instead of being evicted after a timeout, and a launcher
    stops its peers."""
    _STOPPED_BY.append(signum)
    _LOOP["stop"] = True
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("ravnest_jax").setLevel(args.log_level)
    in_main = threading.current_thread() is threading.main_thread()
    _LOOP["stop"] = False
    _STOPPED_BY.clear()
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)} if in_main else {}
    try:
        return _main(args)
    finally:  # called in-process (tests, notebooks): the caller's handlers again
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def _write_summary(args: argparse.Namespace, summary: dict) -> None:
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(json_safe(summary), indent=2, default=str, allow_nan=False))
        print(f"\nwrote {args.summary_json}", file=sys.stderr if args.json_events else sys.stdout)


def _main(args: argparse.Namespace) -> int:
    from ravnest_jax.swarm import SwarmError

    mode = "local_swarm" if args.local_peers else "peer" if args.rendezvous else "simulation"
    try:
        if args.local_peers:
            summary = run_local_swarm(args)
        elif args.rendezvous:
            result = run_peer(args)
            summary = {
                "mode": "peer",
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "machine": machine_info(),
                "config": run_config(args, run_id=args.run_id),
                "interrupted": result["interrupted"],
                "peer_result": result,
            }
            _emit(args, event="result", result=result)
            if not args.json_events:
                print_peer_table([result], None)
        else:
            summary = run_simulation(args)
    except (ValueError, SwarmError, RuntimeError) as e:  # bad input or a run that cannot go on: one line
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before training started (compiling, joining)
        print("\ninterrupted" + (" (SIGTERM)" if _STOPPED_BY and _STOPPED_BY[-1] == 15 else ""), file=sys.stderr)
        _write_summary(
            args,
            {
                "mode": mode,
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "interrupted": True,
                "config": run_config(args),
            },
        )
        return 128 + (_STOPPED_BY[-1] if _STOPPED_BY else 2)
    _write_summary(args, summary)
    if summary.get("interrupted"):
        return 128 + (_STOPPED_BY[-1] if _STOPPED_BY else 2)
    return 1 if summary.get("failed_peers") else 0


if __name__ == "__main__":
    sys.exit(main())
