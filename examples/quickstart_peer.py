"""The docs' short peer script (about 40 lines of code): a byte bigram model on real text (a
standard-library module), plain pytrees, the README's loop.

    ravnest-jax local --peers 3 --codec int8 -- python examples/quickstart_peer.py --steps 200
"""

import argparse
import inspect
import json
import os
import string

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ravnest_jax as rj


def count(value: str) -> int:  # a flag's check: argparse prints one line and exits 2
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}")
    return int(value)


ap = argparse.ArgumentParser(description="One peer of the docs' quickstart (run it under ravnest-jax local).")
ap.add_argument("--steps", type=count, default=200, help="inner steps of the whole run")
ap.add_argument("--sync-every", type=count, default=20, help="H: inner steps per outer round")
args = ap.parse_args()
text = np.frombuffer(inspect.getsource(string).encode() * 20, np.uint8).astype(np.int32)
rng = np.random.default_rng(int(os.environ.get("RAVNEST_RANK", "0")))  # each peer its own batches


def loss_fn(params, idx):  # predict byte t+1 from byte t
    logits = params["w"][text_dev[idx]]
    return optax.softmax_cross_entropy_with_integer_labels(logits, text_dev[idx + 1]).mean()


text_dev = jnp.asarray(text)
params = {"w": jnp.zeros((256, 256), jnp.float32)}
tx = rj.diloco(optax.adamw(3e-2), sync_every=args.sync_every)
state = tx.init(params)


@jax.jit
def train_step(params, state, idx):
    loss, grads = jax.value_and_grad(loss_fn)(params, idx)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


with rj.Swarm() as swarm, rj.OuterSync(tx, swarm, overlap_steps=1) as sync:
    params, state, *_ = rj.join_or_resume(swarm, sync, params, state)
    loss = None  # stays None when the run is already past --steps (a resumed or late peer)
    for _ in range(int(state.count), args.steps):
        params, state, loss = train_step(params, state, jnp.asarray(rng.integers(0, len(text) - 1, 256)))
        params, state = sync(params, state)
    params, state = sync.flush(params, state)
    print(
        json.dumps(
            {
                "peer": swarm.peer_id,
                "loss": None if loss is None else float(loss),
                "eval_loss": float(loss_fn(state.global_params, jnp.arange(20_000))),
            }
        )
    )
