"""One stage peer of the pipeline tests (a real process): trains its stage of the char-LM or the
tiny Llama with real neighbours; optionally DiLoCo across clusters, placement, a standby.
Prints JSON events on stdout ("placed", "step", "round", "done") and writes its losses, last
gradients and params to an .npz file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def emit(**event) -> None:
    print(json.dumps({**event, "t": time.time()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--run-id", default="pipe-test")
    ap.add_argument("--peer-id", default=None)
    ap.add_argument("--model", default="char")
    ap.add_argument("--stages", type=int, required=True)
    ap.add_argument("--stage", type=int, default=None, help="default: placed (--expected-peers)")
    ap.add_argument("--cluster", type=int, default=0)
    ap.add_argument("--expected-peers", type=int, default=None)
    ap.add_argument("--clusters", type=int, default=None)
    ap.add_argument("--standbys", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--diloco", type=int, default=0, help="H: DiLoCo across clusters every H steps (0: none)")
    ap.add_argument("--pad", type=float, default=0.0, help="emulated seconds per forward and per backward")
    ap.add_argument("--recv-timeout", type=float, default=60.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    args = ap.parse_args()

    import numpy as np
    from _models import batches, build, flat, optimizer

    import ravnest_jax as rj

    split, _, _, vocab = build(args.model)
    plan = rj.pipeline.plan_stages(split, args.stages)
    tx = optimizer(args.lr)
    if args.diloco:
        tx = rj.diloco(tx, sync_every=args.diloco)
    timeouts = rj.Timeouts(connect=2.0, part=5.0, grace=0.5, round=20.0, heartbeat=0.5, eviction=3.0)
    peer = rj.pipeline.StagePeer(
        split,
        plan,
        tx,
        stage=args.stage,
        cluster=args.cluster,
        micro_batches=args.micro,
        mode=args.mode,
        codec=args.codec,
        rendezvous_url=args.url,
        run_id=args.run_id,
        token=args.token,
        listen="127.0.0.1:0",
        peer_id=args.peer_id or f"c{args.cluster}s{args.stage}",
        timeouts=timeouts,
        recv_timeout=args.recv_timeout,
        start_timeout=60.0,
        compute_seconds=(args.pad, args.pad) if args.pad else None,
        expected_peers=args.expected_peers,
        clusters=args.clusters,
        standbys=args.standbys,
        outer={"overlap_steps": 0},
        keep_grads=True,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )
    with peer:
        emit(event="ready", port=peer.swarm.port)
        if args.stage is None:
            peer.place()
        emit(event="placed", role=peer.role, cluster=peer.cluster, stage=peer.stage)
        reported = [0]

        def on_step(step, loss):
            emit(event="step", step=step, loss=loss, cluster=peer.cluster, stage=peer.stage)
            if peer.sync is not None:
                for m in peer.sync.metrics[reported[0] :]:
                    emit(event="round", round=m.swarm_round, ok=m.ok, digest=m.state_digest, step=step)
                reported[0] = len(peer.sync.metrics)

        # each cluster trains on its own data (a DiLoCo replica); a standby learns its cluster late
        data = lambda t: batches(vocab, seed=peer.cluster)(t)  # noqa: E731
        if peer.role == "standby":
            emit(event="standby", stage=peer.stage)
        losses = peer.run(args.steps, data, on_step=on_step)
        if peer.role == "active" and peer.worker is not None:
            emit(event="active", cluster=peer.cluster, stage=peer.stage, joined=peer.joined)
        if peer.sync is not None:
            for m in peer.sync.metrics[reported[0] :]:
                emit(event="round", round=m.swarm_round, ok=m.ok, digest=m.state_digest, step=peer.step)
        w = peer.worker
        if args.out and w is not None and peer.role == "active":
            out = {f"param/{k}": v for k, v in flat(w.params).items()}
            if w.last_grads is not None:
                out.update({f"grad/{k}": v for k, v in flat(w.last_grads).items()})
            out["losses"] = np.asarray(losses, np.float64)
            np.savez(args.out, **out)
        emit(event="done", role=peer.role, cluster=peer.cluster, stage=peer.stage, metrics=peer.metrics.as_dict())


if __name__ == "__main__":
    main()
