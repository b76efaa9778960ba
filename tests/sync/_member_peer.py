"""A peer of the README's shape (rj.Swarm, rj.OuterSync, rj.join_or_resume) on a byte-bigram
model, with short deadlines, for the membership tests (tests/sync/test_membership_costs.py).

    python _member_peer.py URL TOKEN PEER_ID STEPS [--seed S] [--checkpoint-dir D] [--stop-file F]

One JSON line per round (``{"event": "round", ...}``, with the step's stall) and a last one with
the summary. It trains until its step reaches STEPS, or until STOP_FILE exists.
"""

import argparse
import inspect
import json
import os
import string
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ravnest_jax as rj

ap = argparse.ArgumentParser()
ap.add_argument("url")
ap.add_argument("token")
ap.add_argument("peer")
ap.add_argument("steps", type=int)
ap.add_argument("--seed", type=int, default=0)  # 0: zeros (every peer the same), else random
ap.add_argument("--checkpoint-dir")
ap.add_argument("--stop-file")
ap.add_argument("--step-seconds", type=float, default=0.05)
ap.add_argument("--part", type=float, default=15.0)
ap.add_argument("--eviction", type=float, default=3.0)
args = ap.parse_args()
text = jnp.asarray(np.frombuffer(inspect.getsource(string).encode(), np.uint8).astype(np.int32))
rng = np.random.default_rng(sum(map(ord, args.peer)))


def loss_fn(params, idx):
    return optax.softmax_cross_entropy_with_integer_labels(params["w"][text[idx]], text[idx + 1]).mean()


w = jnp.zeros((256, 256)) if args.seed == 0 else 0.1 * jax.random.normal(jax.random.key(args.seed), (256, 256))
params = {"w": w.astype(jnp.float32)}
tx = rj.diloco(optax.adamw(3e-2), sync_every=10)
state = tx.init(params)


@jax.jit
def train_step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def on_round(m):
    print(
        json.dumps(
            {
                "event": "round",
                "t": time.time(),
                "ok": m.ok,
                "swarm_round": m.swarm_round,
                "stall": m.stall_seconds,
                "step": m.step,
                "digest": m.state_digest,
                "error": m.error,
                "group": m.group_size,
            }
        ),
        flush=True,
    )


timeouts = rj.Timeouts(connect=3.0, part=args.part, grace=0.5, round=60.0, heartbeat=0.5, eviction=args.eviction)
ckpt = rj.Checkpointer(args.checkpoint_dir, max_to_keep=2) if args.checkpoint_dir else None
with (
    rj.Swarm(
        args.url, run_id="members", token=args.token, peer_id=args.peer, listen="127.0.0.1:0", timeouts=timeouts
    ) as swarm,
    rj.OuterSync(tx, swarm, overlap_steps=1, on_round=on_round) as sync,
):
    joined = rj.join_or_resume(swarm, sync, params, state, checkpointer=ckpt)
    params, state = joined.params, joined.state
    print(json.dumps({"event": "started", "how": joined.how, "step": joined.step}), flush=True)
    while (joined.step if sync.step is None else sync.step) < args.steps:
        if args.stop_file and os.path.exists(args.stop_file):
            break
        batch = jnp.asarray(rng.integers(0, text.shape[0] - 1, 64))
        params, state, loss = train_step(params, state, batch)
        params, state = sync(params, state)
        if ckpt is not None and sync.step % 10 == 5 and sync.pending == 0:
            ckpt.save(sync.step, params=params, opt_state=state, extra=rj.sync.checkpoint_extra(sync, params))
        time.sleep(args.step_seconds)
    params, state = sync.flush(params, state)
    if ckpt is not None:
        ckpt.close()
    print(json.dumps({"event": "summary", "step": sync.step, **sync.summary()}), flush=True)
