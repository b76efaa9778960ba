"""A flax nnx peer: an nnx model and ``nnx.Optimizer(model, rj.diloco(...), wrt=nnx.Param)``
trained across peers, with checkpoints. Byte-level next-token MLP on a standard-library module.

    ravnest-jax local --peers 2 -- python examples/nnx_peer.py --steps 120 --checkpoint-dir ckpt

Prints one JSON line per outer round and a final ``{"result": ...}`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import string

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ravnest_jax as rj


class ByteMLP(nnx.Module):
    """Predicts byte t+1 from bytes t-1 and t: embed (256 -> d), concat, MLP, logits (256)."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, d, rngs=rngs)
        self.hidden = nnx.Linear(2 * d, 4 * d, rngs=rngs)
        self.out = nnx.Linear(4 * d, 256, rngs=rngs)

    def __call__(self, ctx: jax.Array) -> jax.Array:  # ctx: int32 [batch, 2] -> float32 [batch, 256]
        h = self.embed(ctx).reshape(ctx.shape[0], -1)
        return self.out(nnx.gelu(self.hidden(h)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120, help="inner steps in all")
    ap.add_argument("--sync-every", type=int, default=20, help="H, inner steps per outer round")
    ap.add_argument("--checkpoint-dir", default=None, help="save every round under DIR/<peer id>; resume from it")
    ap.add_argument("--d", type=int, default=32, help="embedding width")
    args = ap.parse_args()
    data = np.frombuffer(inspect.getsource(string).encode(), np.uint8).astype(np.int32)
    text = jnp.asarray(data)
    rng = np.random.default_rng(int(os.environ.get("RAVNEST_RANK", "0")))

    model = ByteMLP(args.d, nnx.Rngs(0))  # every peer starts from the same params
    optimizer = nnx.Optimizer(model, rj.diloco(optax.adamw(3e-3), sync_every=args.sync_every), wrt=nnx.Param)

    def loss_fn(model: ByteMLP, idx: jax.Array) -> jax.Array:
        ctx = jnp.stack([text[idx], text[idx + 1]], axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(model(ctx), text[idx + 2]).mean()

    @nnx.jit
    def train_step(model: ByteMLP, optimizer: nnx.Optimizer, idx: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model, idx)
        optimizer.update(model, grads)
        return loss

    @jax.jit
    def eval_loss(params, idx):  # the global params (the anchor), not this peer's local ones
        return loss_fn(nnx.merge(nnx.graphdef(model), params), idx)

    eval_idx = jnp.arange(0, len(data) - 2, 7)

    def on_round(m: rj.RoundMetrics) -> None:
        print(json.dumps({"event": "round", **dataclasses.asdict(m)}), flush=True)

    with rj.Swarm() as swarm, rj.OuterSync(optimizer.tx, swarm, overlap_steps=1, on_round=on_round) as sync:
        # one directory per peer (the peer id is stable: ravnest-jax local names them peer0, ...)
        ckpt = (
            rj.Checkpointer(os.path.join(args.checkpoint_dir, swarm.peer_id), max_to_keep=2)
            if args.checkpoint_dir
            else None
        )
        got = rj.join_or_resume(swarm, sync, model, optimizer, checkpointer=ckpt)
        anchor = lambda: nnx.as_pure(optimizer.opt_state).global_params  # noqa: E731
        eval_start = float(eval_loss(anchor(), eval_idx))
        last_saved = got.step
        while sync.step is None or sync.step < args.steps:
            train_step(model, optimizer, jnp.asarray(rng.integers(0, len(data) - 2, 64)))
            sync(model, optimizer)  # updates model and optimizer in place at round boundaries
            if ckpt is not None and sync.pending == 0 and sync.step - last_saved >= args.sync_every:
                params, state = nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(optimizer.opt_state)
                ckpt.save(sync.step, params=params, opt_state=state, extra=rj.checkpoint_extra(sync, params))
                last_saved = sync.step
        sync.flush(model, optimizer)
        if ckpt is not None:
            if sync.step > last_saved:  # the end state too: a rerun with more --steps resumes here
                params, state = nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(optimizer.opt_state)
                ckpt.save(
                    sync.step, params=params, opt_state=state, extra=rj.checkpoint_extra(sync, params), force=True
                )
            ckpt.close()
        print(
            json.dumps(
                {
                    "result": {
                        "peer": swarm.peer_id,
                        "how": got.how,
                        "start_step": got.step,
                        "end_step": sync.step,
                        "eval_loss_start": eval_start,
                        "eval_loss_end": float(eval_loss(anchor(), eval_idx)),
                        "digest": sync.global_state_digest,
                        **sync.summary(),
                    }
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
