"""The README's user code, as it stands there, around a tiny byte-bigram model on real text
(a standard-library module). Nothing but what the README shows is called on the library, and
``sync.step``: the loop runs until the swarm's step reaches TOTAL_STEPS (as the examples do),
not for a fixed count of batches, because a resync moves a peer to the swarm's step; with a
fixed count, a peer that resynced forward ran on alone past the others' last round.

    python _readme_peer.py URL TOKEN PEER_ID TOTAL_STEPS [JOINED_FILE]

With JOINED_FILE, the peer ``c`` creates it once it has joined, and the others slow their data
loading (0.08 -> 0.3 s a step) from step 100 on until it exists: on a loaded machine, a joiner
still compiling must not find the first peers already done.
"""

import inspect
import json
import os
import string
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ravnest_jax as rj

URL, TOKEN, PEER, TOTAL = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
JOINED = sys.argv[5] if len(sys.argv) > 5 else None
text = jnp.asarray(np.frombuffer(inspect.getsource(string).encode(), np.uint8).astype(np.int32))
rng = np.random.default_rng(abs(hash(PEER)) % 1000)


def loss_fn(params, idx):
    return optax.softmax_cross_entropy_with_integer_labels(params["w"][text[idx]], text[idx + 1]).mean()


params = {"w": jnp.zeros((256, 256), jnp.float32)}

# ---- the README, from here on -------------------------------------------------------------
tx = rj.diloco(optax.adamw(3e-2), sync_every=10)
state = tx.init(params)


@jax.jit
def train_step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


with (
    rj.Swarm(URL, run_id="readme", token=TOKEN, codec="int4", peer_id=PEER, listen="127.0.0.1:0") as swarm,
    rj.OuterSync(tx, swarm, overlap_steps="auto") as sync,
):
    params, state, *_ = rj.join_or_resume(swarm, sync, params, state)
    start = int(state.count)
    if JOINED and PEER == "c":
        open(JOINED, "w").close()
    while (start if sync.step is None else sync.step) < TOTAL:
        batch = jnp.asarray(rng.integers(0, text.shape[0] - 1, 64))
        params, state, loss = train_step(params, state, batch)
        params, state = sync(params, state)
        sync.report(train_loss=loss)
        # the user's data loading (keeps the first peers from finishing before the joiner joins)
        waiting = JOINED and PEER != "c" and sync.step >= 100 and not os.path.exists(JOINED)
        time.sleep(0.3 if waiting else 0.08)
    params, state = sync.flush(params, state)
    print(json.dumps({"peer": PEER, "start_step": start, **sync.summary()}), flush=True)
