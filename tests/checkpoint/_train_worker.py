"""Training process for the checkpoint tests (run with ``sys.executable``, killed with SIGKILL).

Modes:
  train: the char-LM example at tiny size with ``rj.diloco(inner_optimizer(...), sync_every=3)``
    and host-driven rounds (one peer: the pseudo-gradient itself is the "mean"). The data come
    from a typed PRNG key carried in ``extra`` (split every step), so the key must round-trip
    exactly. Resumes from ``--dir`` if it has a checkpoint; trains to ``--steps``; with
    ``--save-at K`` saves at step K (and waits); with ``--kill-after-save`` then SIGKILLs
    itself. At the end writes every leaf of params, opt_state and extra to ``--out`` (.npz).
    With ``--ref-out``, first runs ``--ref-steps`` uninterrupted steps from the same init (no
    checkpointing) and writes them there.
  bigsave: saves step 1 of a large state (``--mib``) and waits, prints ``saving``, starts an
    async save of step 2 and sleeps (the test kills it mid-save).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import ravnest_jax as rj  # noqa: E402

SYNC_EVERY = 3
BATCH, SEQ = 4, 8


def build():
    import char_lm

    cfg = char_lm.ModelConfig(d_model=16, num_layers=1, num_heads=2, seq_len=SEQ, mlp_ratio=2)
    holder = {}

    def init():  # one compiled init instead of one compile per eager initializer op
        graphdef, params = char_lm.build_model(cfg, seed=0)
        holder["graphdef"] = graphdef
        return params

    params = jax.jit(init)()
    loss = char_lm.make_loss(holder["graphdef"])
    tx = rj.diloco(char_lm.inner_optimizer(3e-3, 40), sync_every=SYNC_EVERY)
    state = jax.jit(tx.init)(params)
    extra = {"data_key": jax.random.key(42), "data_position": 0, "round": np.int64(0)}
    return loss, tx, params, state, extra


def flat_dump(path: str, params, state, extra) -> None:
    out = {}
    for name, tree in (("params", params), ("opt_state", state), ("extra", extra)):
        for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            out[name + jax.tree_util.keystr(kp)] = np.asarray(leaf)
    np.savez(path, **out)


def train(args: argparse.Namespace) -> None:
    loss, tx, params, state, extra = build()

    @jax.jit
    def train_step(params, state, key):
        key, sub = jax.random.split(key)
        tokens = jax.random.randint(sub, (BATCH, SEQ + 1), 0, 256, dtype=jnp.int32)
        grads = jax.grad(loss)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, key

    round_start, round_merge = jax.jit(tx.round_start), jax.jit(tx.round_merge)

    def run(params, state, extra, step, stop, ckpt=None):
        key = extra["data_key"]
        while step < stop:
            params, state, key = train_step(params, state, key)
            step += 1
            if step % SYNC_EVERY == 0:
                snap = round_start(params, state)
                params, state = round_merge(params, state, snap.pseudo_gradient, snap)  # one peer
            extra = {"data_key": key, "data_position": step, "round": np.int64(int(state.rounds))}
            if ckpt is not None and step == args.save_at:
                ckpt.save(step, params=params, opt_state=state, extra=extra, force=True)
                ckpt.wait()
                print(f"saved {step}", flush=True)
                if args.kill_after_save:
                    os.kill(os.getpid(), signal.SIGKILL)
        return params, state, extra

    if args.ref_out:  # an uninterrupted run from the same init first (shares the compiled steps)
        flat_dump(args.ref_out, *run(params, state, extra, 0, args.ref_steps))
        print("reference done", flush=True)
    ckpt = rj.Checkpointer(args.dir, max_to_keep=2, metadata={"run_id": "test"}) if args.dir else None
    step = 0
    if ckpt is not None:
        r = ckpt.restore(params=params, opt_state=state, extra=extra)
        if r is not None:
            params, state, extra, step = r.params, r.opt_state, r.extra, r.step
            assert extra["data_position"] == step
            print(f"resumed {step}", flush=True)
    params, state, extra = run(params, state, extra, step, args.steps, ckpt)
    if ckpt is not None:
        ckpt.close()
    flat_dump(args.out, params, state, extra)
    print("done", flush=True)


def big_tree(step: int, mib: int) -> dict:
    n = mib * (1 << 20) // 4 // 4
    return {f"w{i}": jnp.full((n,), float(step * 10 + i), jnp.float32) for i in range(4)}


def bigsave(args: argparse.Namespace) -> None:
    ckpt = rj.Checkpointer(args.dir, max_to_keep=3)
    ckpt.save(1, params=big_tree(1, args.mib), opt_state={"count": jnp.int32(1)}, force=True)
    ckpt.wait()
    params2 = jax.block_until_ready(big_tree(2, args.mib))
    print("saving", flush=True)
    ckpt.save(2, params=params2, opt_state={"count": jnp.int32(2)}, force=True)
    print("returned", flush=True)
    ckpt.wait()
    print("committed", flush=True)
    time.sleep(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "bigsave"])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--kill-after-save", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ref-out", default=None, help="first write an uninterrupted run here")
    ap.add_argument("--ref-steps", type=int, default=8)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    (train if args.mode == "train" else bigsave)(args)


if __name__ == "__main__":
    main()
