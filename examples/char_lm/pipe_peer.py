"""One stage peer of the main job split into pipeline stages (``main.py --stages S``): the
transformer cut into S stages, this process one of them (placed from what the peers report), its
cluster's activations int8-compressed over the swarm, DiLoCo among the peers that hold the same
stage in other clusters, a standby that takes over a dead stage peer."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from char_lm.data import eval_batches, load_corpus, sample_batch
from char_lm.model import ModelConfig, build_model, inner_optimizer, make_evaluator, outer_optimizer, stage_split
from char_lm.peer import _LOOP, _emit, _watch_parent, preflight_peer
from char_lm.report import json_safe


def pipeline_mode(args: argparse.Namespace) -> str:
    """The StageWorker mode of ``--pipeline-mode`` (``async`` is the asynchronous mode the
    measurements chose, docs/pipeline.md)."""
    import ravnest_jax as rj

    return rj.pipeline.ASYNC_MODE if args.pipeline_mode == "async" else args.pipeline_mode


def round_log(metrics: list, losses: dict[int, float]) -> list[dict]:
    """Per outer round, as the whole-model peer's (``RoundMetrics`` as a dict and ``train_loss``,
    the last train loss at or before the round's step; ``None`` off the last stage): what
    ``ravnest-jax report`` plots per stage group. ``losses``: steps done -> train loss."""
    return [
        {
            **dataclasses.asdict(m),
            "train_loss": max(((s, v) for s, v in losses.items() if s <= m.step), default=(0, None))[1],
        }
        for m in metrics
    ]


def run_stage_peer(args: argparse.Namespace) -> dict:
    """One stage peer: placed among ``--min-peers`` peers (``--stages`` per cluster, ``--standbys``
    waiting), trains ``--max-steps`` steps of its cluster's pipeline, evaluates the cluster's
    model through the pipeline at the end (the last stage reports it), and returns its summary.
    """
    token, peer_id = preflight_peer(args)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    _emit(args, event="compiling", peer=peer_id)

    import ravnest_jax as rj
    from ravnest_jax.swarm import Timeouts

    cfg = ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len)
    train, evald = load_corpus(args.text)
    graphdef, params = build_model(cfg, seed=args.seed)  # identical on every peer
    split = stage_split(graphdef, params)
    plan = rj.pipeline.plan_stages(split, args.stages)
    expected = max(args.min_peers, args.stages)
    clusters = (expected - args.standbys) // args.stages
    inner = inner_optimizer(args.lr, args.schedule_steps or args.max_steps, args.inner)
    tx = (
        rj.diloco(inner, outer_optimizer(args.outer_lr, args.outer_momentum), sync_every=args.sync_every)
        if clusters > 1
        else inner
    )
    timeouts = Timeouts(part=args.part_timeout, round=max(4 * args.part_timeout, 30.0), heartbeat=1.0, eviction=5.0)
    peer = rj.pipeline.StagePeer(
        split,
        plan,
        tx,
        stage=None,
        micro_batches=args.micro_batches,
        in_flight=args.in_flight,
        mode=pipeline_mode(args),
        codec=args.activation_codec,
        rendezvous_url=args.rendezvous,
        run_id=args.run_id,
        token=token,
        listen=None if args.no_inbound else args.listen,
        advertise=args.advertise,
        peer_id=peer_id,
        timeouts=timeouts,
        recv_timeout=args.part_timeout,
        start_timeout=max(120.0, 4 * args.part_timeout),
        compute_seconds=(args.min_step_seconds / 3, 2 * args.min_step_seconds / 3)
        if args.min_step_seconds > 0
        else None,
        outer={"eager": args.mode == "eager", "overlap_steps": 0 if args.mode == "blocking" else args.overlap_steps},
        outer_codec=args.codec,
        expected_peers=expected,
        clusters=clusters,
        standbys=args.standbys,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every or args.sync_every,
    )
    evals = eval_batches(evald, batch=32, seq_len=cfg.seq_len, num_batches=args.eval_batches)
    result: dict = {"peer": peer_id, "run_id": args.run_id, "pipeline": True, "interrupted": False}
    with peer:
        peer.place()
        _emit(args, event="placed", peer=peer_id, role=peer.role, cluster=peer.cluster, stage=peer.stage)
        last_stage = peer.stage == args.stages - 1 and peer.role == "active"
        eval_start = make_evaluator(graphdef, evals)(params) if last_stage else None
        _emit(
            args, event="start", peer=peer_id, step=0, eval_loss=eval_start, params=int(sum(split.unit_nbytes()) // 4)
        )
        rounds_seen = [0]
        losses: dict[int, float] = {}  # steps done -> the train loss then (the last stage has it)

        def data(step: int) -> np.ndarray:
            return sample_batch(train, np.random.default_rng([peer.cluster, step]), args.batch_size, cfg.seq_len)

        def on_step(step: int, loss: float | None) -> None:
            if _LOOP["stop"]:
                raise KeyboardInterrupt
            if loss is not None:
                losses[step + 1] = float(loss)
            if (step + 1) % args.log_every == 0:
                _emit(args, event="progress", step=step + 1, loss=loss)
            if peer.sync is not None:
                for m in peer.sync.metrics[rounds_seen[0] :]:
                    _emit(
                        args,
                        event="round",
                        round=m.round,
                        swarm_round=m.swarm_round,
                        step=m.step,
                        ok=m.ok,
                        group_size=m.group_size,
                        bytes_sent=m.bytes_sent,
                        exchange_seconds=m.exchange_seconds,
                        stall_seconds=m.stall_seconds,
                        state_digest=m.state_digest,
                        error=m.error,
                    )
                rounds_seen[0] = len(peer.sync.metrics)

        t0 = time.perf_counter()
        eval_end = None
        try:
            peer.run(args.max_steps, data, on_step=on_step)
            if peer.role == "active":
                eval_end = peer.evaluate(evals)
        except KeyboardInterrupt:
            result["interrupted"] = True
            print(f"\nstage peer {peer_id}: interrupted at step {peer.step}", file=sys.stderr)
        wall = time.perf_counter() - t0
        m = peer.metrics
        sync_summary = peer.sync.summary() if peer.sync is not None else {}
        result.update(
            {
                "role": peer.role,
                "cluster": peer.cluster if peer.role == "active" else None,
                "stage": peer.stage,
                "units": list(plan.bounds[peer.stage]) if peer.stage is not None else None,
                "stage_param_bytes": int(sum(split.unit_nbytes()[slice(*plan.bounds[peer.stage])]))
                if peer.stage is not None
                else None,
                "joined": peer.joined,
                "end_step": peer.step,
                "steps": m.steps,
                "eval_loss_start": eval_start,
                "eval_loss_end": eval_end,
                "utilisation": m.utilisation,
                "bubble_fraction": m.bubble_fraction,
                "busy_seconds": m.busy_seconds,
                "wait_seconds": m.wait_seconds,
                "activation_bytes_sent": m.bytes_sent,
                "activation_bytes_received": m.bytes_received,
                "activation_codec": args.activation_codec,
                "recoveries": m.recoveries,
                "recovery_seconds": m.recovery_seconds,
                "resumed_from": peer.resumed_from,
                "restored_steps": m.restored_steps,
                "outer_rounds": m.outer_rounds,
                "outer_bytes_sent": sync_summary.get("bytes_sent"),
                "failed_rounds": sync_summary.get("failed_rounds"),
                "round_digests": [r.state_digest for r in (peer.sync.metrics if peer.sync else []) if r.ok],
                "round_log": round_log(peer.sync.metrics if peer.sync else [], losses),
                "wall_seconds": wall,
            }
        )
    return json_safe(result)


def print_stage_table(results: list[dict]) -> bool:
    """The summary table of a pipelined run; returns whether every stage group's round digests
    agree (DiLoCo across clusters)."""

    def num(x, fmt):
        return format(x, fmt) if x is not None else format("-", fmt.split(".")[0].rstrip("df") + "s")

    print()
    print(
        f"| {'peer':<10} | {'role':<7} | {'cluster':>7} | {'stage':>5} | {'util':>5} | {'bubble':>6} | "
        f"{'act MB out':>10} | {'act MB in':>9} | {'rounds':>6} | {'recov':>5} | {'eval end':>8} |"
    )
    print(
        f"|{'-' * 12}|{'-' * 9}|{'-' * 9}|{'-' * 7}|{'-' * 7}|{'-' * 8}|{'-' * 12}|{'-' * 11}|{'-' * 8}|{'-' * 7}|{'-' * 10}|"
    )
    for r in sorted(results, key=lambda r: (r.get("cluster") is None, r.get("cluster") or 0, r.get("stage") or 0)):
        print(
            f"| {r['peer']:<10} | {r['role']:<7} | {num(r['cluster'], '7d')} | {num(r['stage'], '5d')} | "
            f"{num(r['utilisation'], '5.2f')} | {num(r['bubble_fraction'], '6.2f')} | "
            f"{r['activation_bytes_sent'] / 1e6:10.2f} | {r['activation_bytes_received'] / 1e6:9.2f} | "
            f"{r['outer_rounds']:6d} | {r['recoveries']:5d} | {num(r['eval_loss_end'], '8.4f')} |"
        )
    groups: dict[int, set] = {}
    for r in results:
        if r.get("role") == "active" and r.get("round_digests"):
            groups.setdefault(r["stage"], set()).add(tuple(r["round_digests"]))
    equal = all(len(v) == 1 for v in groups.values())
    if groups:
        print(
            "\nDiLoCo across clusters: round digests identical within every stage group: "
            + ("yes" if equal else "NO")
            + f" ({', '.join(f'stage {s}: {len(next(iter(v)))} rounds' for s, v in sorted(groups.items()))})"
        )
    return equal
