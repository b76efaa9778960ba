"""``examples/finetune/train.py --stages S``: this peer is one stage of a pipeline
(``rj.pipeline.StagePeer``), its cluster's data shard, DiLoCo among the peers of its stage."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def train_stages(
    args: argparse.Namespace, split, train_tokens, eval_set, records=None, cluster_rows=None, lora=None
) -> dict:
    """``--stages S``: this process is one stage of a pipeline (placed among the launcher's
    peers); the adapters of its layers train on its cluster's data shard, the activations go
    ``--activation-codec``-compressed to its neighbours, and with several clusters each stage's
    adapters are averaged with DiLoCo among the peers that hold that stage. ``split`` is
    ``rj.pipeline.pretrained_split`` of the checkpoint: the plan needs no tensor, and the stage
    reads only its own from the files. The data: ``train_tokens`` (``--text``: packed windows,
    a shard per cluster) or ``records`` (``--data``: a ``PackedExamples`` of one document a row,
    loss-masked; cluster ``c`` of ``C`` reads its batches ``c, c + C, ...``), and ``eval_set``
    the held-out batches (int32 ``(n, batch, seq + 1)``, or a list of ``TokenBatch`` field dicts).
    ``cluster_rows``: the rows (windows) of the data one cluster reads per epoch (``data_epochs``
    of the summary). ``--export-adapters DIR``: the first cluster's peer of each stage writes its
    layers' adapters there as a part (``rj.models.save_peft_part``); the peer whose part completes
    the set assembles PEFT's ``adapter_model.safetensors`` (``lora``: the run's LoraConfig).
    Prints one JSON line."""
    import optax

    import ravnest_jax as rj
    from finetune.train import learning_rate, outer_optimizer
    from ravnest_jax.data import PackedTokens

    world = int(os.environ.get("RAVNEST_WORLD_SIZE", "1"))
    clusters = max(1, world // args.stages)
    plan = rj.pipeline.plan_stages(split, args.stages)
    inner = optax.adamw(learning_rate(args), weight_decay=0.0)
    tx = rj.diloco(inner, outer_optimizer(args), sync_every=args.sync_every) if clusters > 1 else inner
    peer = rj.pipeline.StagePeer(
        split,
        plan,
        tx,
        stage=None,
        micro_batches=args.micro_batches,
        in_flight=args.in_flight,
        mode=args.pipeline_mode,
        codec=args.activation_codec,
        expected_peers=world,
        clusters=clusters,
        standbys=0,
        # one subfolder per peer of the launcher (as without --stages); the stage's inside it
        checkpoint_dir=Path(args.checkpoint_dir) / os.environ.get("RAVNEST_PEER_ID", ".")
        if args.checkpoint_dir
        else None,
        checkpoint_every=args.checkpoint_every,
        fresh=args.fresh,
        outer={"overlap_steps": args.overlap_steps},
        outer_codec=os.environ.get("RAVNEST_CODEC", "int4"),
    )
    with peer:
        peer.place()
        if records is not None:
            cluster = peer.cluster

            def batch_at(step: int) -> dict:
                return records.batch_at(step * clusters + cluster)
        else:
            batch_at = PackedTokens(
                train_tokens,
                seq_len=args.seq_len,
                batch=args.batch_size,
                shard=peer.cluster,
                num_shards=clusters,
                seed=args.seed,
            ).batch_at
        interrupted = False
        try:
            losses = peer.run(args.max_steps, batch_at)
            eval_end = peer.evaluate(eval_set)
        except KeyboardInterrupt:
            print(f"{peer.peer_id}: interrupted at step {peer.step}", file=sys.stderr)
            interrupted, losses, eval_end = True, [], None
        exported = export_part(args, peer, lora) if not interrupted else {}
        m = peer.metrics
        summary = {
            "peer": peer.peer_id,
            "role": peer.role,
            "cluster": peer.cluster,
            "stage": peer.stage,
            "interrupted": interrupted,
            "steps": m.steps,
            "data_epochs": round(m.steps * args.batch_size / cluster_rows, 4) if cluster_rows else None,
            "resumed_from": peer.resumed_from,
            "adapter_params": int(sum(x.size for x in jax_leaves(peer.worker.params))) if peer.worker else 0,
            "train_loss": losses[-1] if losses else None,
            "eval_loss_end": eval_end,
            "utilisation": m.utilisation,
            "bubble_fraction": m.bubble_fraction,
            "activation_bytes_sent": m.bytes_sent,
            "activation_bytes_received": m.bytes_received,
            "outer_rounds": m.outer_rounds,
            "round_digests": {
                str(r.swarm_round): r.state_digest for r in (peer.sync.metrics if peer.sync else []) if r.ok
            },
            **exported,
        }
    print(json.dumps(summary), flush=True)
    return summary


def export_part(args: argparse.Namespace, peer, lora) -> dict:
    """``--export-adapters``: this stage's part of the PEFT export, written by the first cluster's
    peer of the stage (after the last outer round every cluster holds the same adapters). Returns
    the summary's fields: the part written and, from the peer that completed the set, the
    assembled directory."""
    from ravnest_jax.models import save_peft_part
    from ravnest_jax.models._peft_parts import part_name

    if not args.export_adapters or peer.worker is None or peer.role != "active" or peer.cluster != 0:
        return {}
    w = peer.worker
    done = save_peft_part(
        w.params,
        lora,
        args.export_adapters,
        stage=peer.stage,
        num_stages=args.stages,
        frozen=w.frozen,
        base_model_name_or_path=str(Path(args.checkpoint).resolve()),
    )
    out = {"exported_adapter_part": str(Path(args.export_adapters) / part_name(peer.stage, args.stages))}
    if done is not None:
        out["exported_adapters"] = str(done)
    return out


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)
