"""One stage peer of the pipeline tests (a real process): trains its stage of the char-LM or
the tiny Llama for a few steps with real neighbours and writes its losses, last gradients and
params to an .npz file. Prints JSON events on stdout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--run-id", default="pipe-test")
    ap.add_argument("--model", default="char")
    ap.add_argument("--stages", type=int, required=True)
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--cluster", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--recv-timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import numpy as np
    from _models import batches, build, flat, optimizer

    import ravnest_jax as rj

    split, _, _, vocab = build(args.model)
    plan = rj.pipeline.plan_stages(split, args.stages)
    data = batches(vocab)
    peer = rj.pipeline.StagePeer(
        split,
        plan,
        args.stage,
        optimizer(args.lr),
        micro_batches=args.micro,
        mode=args.mode,
        codec=args.codec,
        rendezvous_url=args.url,
        run_id=args.run_id,
        token=args.token,
        listen="127.0.0.1:0",
        peer_id=f"c{args.cluster}s{args.stage}",
        cluster=args.cluster,
        recv_timeout=args.recv_timeout,
        keep_grads=True,
    )
    with peer:
        print(json.dumps({"event": "ready", "port": peer.swarm.port}), flush=True)
        losses = peer.run(args.steps, data)
        w = peer.worker
        out = {f"grad/{k}": v for k, v in flat(w.last_grads).items()}
        out.update({f"param/{k}": v for k, v in flat(w.params).items()})
        out["losses"] = np.asarray(losses, np.float64)
        np.savez(args.out, **out)
        print(json.dumps({"event": "done", "metrics": peer.metrics.as_dict()}), flush=True)


if __name__ == "__main__":
    main()
