"""One process of a peer that spans 2 processes (jax.distributed, CPU collectives over gloo on
127.0.0.1), 2 CPU devices each: FSDP params and a data-parallel batch over the 4 devices of both
processes. Process 0 joins the swarm; process 1 passes ``swarm=None``. Prints one JSON line.

    python _mp_worker.py PROCESS_ID COORDINATOR_PORT RENDEZVOUS_URL
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main() -> None:
    pid, port, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60
    )
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]
    import numpy as np
    import optax
    from _model import batch, init_params, make_step, mesh, param_shardings
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from sync._local import PATIENT, TOKEN

    import ravnest_jax as rj
    from ravnest_jax.sync import device_digest, digest_hex

    steps, h = int(os.environ.get("MP_STEPS", "10")), int(os.environ.get("MP_H", "4"))
    m = mesh(devices=4)  # all 4 devices: 2 here, 2 in the other process
    sh = param_shardings(m, "fsdp", init_params())
    data_sh = NamedSharding(m, P("data", None))

    def put(host, sharding):  # every process holds the same host value and fills its own devices
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    params = jax.tree.map(lambda x, s: put(np.asarray(x), s), init_params(), sh)
    tx = rj.diloco(optax.adam(2e-2), sync_every=h)
    # the scalars tx.init leaves on one device go on the mesh, as the jitted step returns them
    state = jax.tree.map(
        lambda x: x if getattr(x.sharding, "mesh", None) == m else put(np.asarray(x), NamedSharding(m, P())),
        tx.init(params),
    )
    step = make_step(tx, params, state, m, gather=True)
    x0, y0 = batch(0, 0)
    jax.block_until_ready(step(params, state, put(x0, data_sh), put(y0, data_sh)))  # compile now
    swarm = None
    if pid == 0:
        swarm = rj.Swarm(
            url,
            run_id="md-mp",
            token=TOKEN,
            codec="int4",
            listen="127.0.0.1:0",
            timeouts=PATIENT,
            peer_id="multiprocess",
        )
    try:
        with rj.OuterSync(tx, swarm, overlap_steps=1, codec="int4") as sync:
            sync.warmup(params, state)  # every process compiles the round functions before round 0
            if swarm is not None:
                swarm.start()
                swarm.wait_for_peers(2, timeout=60)
            for t in range(steps):
                x, y = batch(0, t)
                params, state, _ = step(params, state, put(x, data_sh), put(y, data_sh))
                params, state = sync(params, state)
            params, state = sync.flush(params, state)
            kept = all(
                jax.tree.map(lambda a: a.sharding, tree) == sh
                for tree in (params, state.global_params, state.outer_state[0].trace)
            )
            out = {
                "process": pid,
                "digests": [r.state_digest for r in sync.metrics if r.ok],
                "group_sizes": [r.group_size for r in sync.metrics if r.ok],
                "failed": sync.failed_rounds,
                "layout_kept": kept,
                "global_digest": digest_hex(device_digest(state.global_params)),
                "addressable_devices": len(jax.local_devices()),
                "compiles": [step._cache_size()] + [fn._cache_size() for fn in sync._fns.cache.values()],
            }
    finally:
        if swarm is not None:
            swarm.close()
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
