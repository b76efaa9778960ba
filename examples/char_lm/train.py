#!/usr/bin/env python3
"""The char-LM peer as plain user code: what a user of ravnest_jax writes for their own model.

A byte-level transformer (flax nnx, ``model.py``) on real text (the standard library's ``.py``
files, or ``--text FILE``; ``data.py``), one ``rj.Swarm`` + ``rj.OuterSync`` with overlapped,
compressed outer rounds, ``rj.join_or_resume`` (join a running swarm, resume a checkpoint, or
restart a whole swarm), and an ``rj.Checkpointer`` saved between rounds. Started by the launcher,
which hands each peer its rendezvous, run id, token and peer id in the environment:

    ravnest-jax local --peers 3 -- python examples/char_lm/train.py --max-steps 60
    ravnest-jax local --peers 2 --codec int4 -- python examples/char_lm/train.py --checkpoint-dir ckpt

Ctrl+C stops every peer; run the same command again and each peer resumes from its checkpoint
(``--checkpoint-dir``: under the launcher, one subdirectory per peer). On separate machines,
set ``RAVNEST_RENDEZVOUS``, ``RAVNEST_RUN_ID`` and ``RAVNEST_TOKEN_FILE`` instead
(docs/launcher.md). Prints one JSON line per peer at the end: steps, eval loss of the global
params before and after, rounds, and the state digest (equal on every peer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the char_lm package is next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
import optax

import ravnest_jax as rj
from char_lm.data import eval_batches, load_corpus, sample_batch
from char_lm.model import ModelConfig, build_model, inner_optimizer, make_evaluator, make_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-steps", type=int, default=300, help="inner steps to train (default 300)")
    p.add_argument("--sync-every", type=int, default=20, help="H: inner steps per outer round (default 20)")
    p.add_argument("--overlap-steps", type=int, default=1, help="tau: steps a round overlaps (default 1)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak inner AdamW learning rate (default 3e-3)")
    p.add_argument("--text", default=None, help="text file to train on (default: the stdlib's .py files)")
    p.add_argument("--checkpoint-dir", default=None, help="save here between rounds; resume from it")
    p.add_argument("--fresh", action="store_true", help="start from step 0: earlier checkpoints moved aside")
    p.add_argument("--checkpoint-every", type=int, default=None, help="steps between saves (default: H)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial params (the same on every peer)")
    args = p.parse_args(argv)
    for name in ("max_steps", "sync_every", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.overlap_steps < args.sync_every:
        p.error("--overlap-steps must be in [0, --sync-every)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    train, held_out = load_corpus(args.text)  # checked before anything compiles
    cfg = ModelConfig(seq_len=args.seq_len)
    graphdef, params = build_model(cfg, seed=args.seed)  # identical on every peer
    loss_fn = make_loss(graphdef)
    evaluate = make_evaluator(graphdef, eval_batches(held_out, batch=32, seq_len=args.seq_len, num_batches=4))
    tx = rj.diloco(inner_optimizer(args.lr, args.max_steps), sync_every=args.sync_every)
    state = tx.init(params)

    @jax.jit
    def train_step(params, state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    ckpt = None
    if args.checkpoint_dir:
        # under the launcher, each peer keeps its own checkpoints
        peer_dir = Path(args.checkpoint_dir) / os.environ.get("RAVNEST_PEER_ID", ".")
        ckpt = rj.Checkpointer(peer_dir, max_to_keep=3, fresh=args.fresh)
    save_every = args.checkpoint_every or args.sync_every
    with (
        rj.Swarm() as swarm,
        rj.OuterSync(tx, swarm, overlap_steps=args.overlap_steps, samples_per_step=args.batch_size) as sync,
    ):
        joined = rj.join_or_resume(swarm, sync, params, state, checkpointer=ckpt)
        params, state = joined.params, joined.state
        eval_start = evaluate(state.global_params)
        rng = np.random.default_rng([args.seed, int(os.environ.get("RAVNEST_RANK", "0")), joined.step])
        last_saved = joined.step
        loss, interrupted = None, False
        try:
            while int(sync.step or joined.step) < args.max_steps:
                tokens = sample_batch(train, rng, args.batch_size, args.seq_len)
                params, state, loss = train_step(params, state, tokens)
                params, state = sync(params, state)  # counts; starts and merges rounds when due
                sync.report(train_loss=loss)  # for the rendezvous' status page
                if ckpt is not None and sync.step - last_saved >= save_every and not sync.pending:
                    ckpt.save(sync.step, params=params, opt_state=state, extra=rj.checkpoint_extra(sync, params))
                    last_saved = sync.step
        except KeyboardInterrupt:  # Ctrl+C: keep the last checkpoint, abandon a round in flight
            print(f"{swarm.peer_id}: interrupted at step {sync.step}", file=sys.stderr)
            interrupted = True
        if not interrupted:
            params, state = sync.flush(params, state)
        if ckpt is not None and sync.step is not None and sync.step > last_saved and not sync.pending:
            ckpt.save(sync.step, params=params, opt_state=state, extra=rj.checkpoint_extra(sync, params), force=True)
        summary = {
            "peer": swarm.peer_id,
            "how": joined.how,
            "interrupted": interrupted,
            "steps": int(sync.step or joined.step),
            "train_loss": None if loss is None else float(loss),
            "eval_loss_start": eval_start,
            "eval_loss_end": evaluate(state.global_params),
            **sync.summary(),
        }
    if ckpt is not None:
        ckpt.close()
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    rj.enable_compilation_cache()  # a restarted peer loads its compiled steps (RAVNEST_COMPILE_CACHE=0: off)
    main()
