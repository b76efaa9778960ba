"""Where a stage peer's state comes from besides its own training: its checkpoints (saved
every ``checkpoint_every`` steps, restored at its start, rolled back to when its cluster resumes
at an older step) and its DiLoCo group (the peers that hold the same stage in other clusters),
and the cluster's evaluation pass. Functions of a :class:`StagePeer` (``peer``)."""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from ravnest_jax.swarm import PipelineBroken, Swarm

log = logging.getLogger("ravnest_jax.pipeline")


def open_checkpoints(peer: Any) -> None:
    """Opens ``<checkpoint_dir>/stage<s>`` (checking that its checkpoints are of this
    stage's units) and, without a stage group, restores the newest one; with a group,
    :func:`rj.join_or_resume` restores it in :func:`join_group`."""
    if peer.checkpoint_dir is None:
        return
    from ravnest_jax.checkpoint import Checkpointer
    from ravnest_jax.optim import DiLoCo

    assert peer.stage is not None and peer.worker is not None
    lo, hi = peer.plan.bounds[peer.stage]
    if peer._ckpt is not None:
        if peer._ckpt_units == (lo, hi):
            return
        peer._ckpt.close()
        peer._ckpt = None
    meta = {"stage": peer.stage, "units": [lo, hi], "num_stages": peer.num_stages, "run_id": peer.swarm.run_id}
    folder = peer.checkpoint_dir / f"stage{peer.stage}"
    fresh = peer.fresh and folder not in peer._fresh_opened  # once: later checkpoints are this run's
    ckpt = Checkpointer(folder, max_to_keep=peer.max_to_keep, metadata=meta, fresh=fresh)
    peer._fresh_opened.add(folder)
    try:
        saved = ckpt.metadata()
        got = None if saved is None else saved.get("metadata", {})
        others = sorted(
            d.name
            for d in peer.checkpoint_dir.glob("stage*")
            if d.is_dir() and d.name != f"stage{peer.stage}" and any(x.name.isdigit() for x in d.iterdir())
        )
        if saved is None and others:
            log.warning(
                "%s: %s holds checkpoints of %s but none of stage %d, this peer's stage now (another placement "
                "or plan): stage %d starts without them",
                peer.peer_id,
                peer.checkpoint_dir,
                ", ".join(others),
                peer.stage,
                peer.stage,
            )
        if got is not None and (got.get("units") != [lo, hi] or got.get("num_stages") != peer.num_stages):
            raise ValueError(
                f"{ckpt.directory} holds a checkpoint of units {got.get('units')} of {got.get('num_stages')} "
                f"stages; this peer's stage {peer.stage} holds units {[lo, hi]} of {peer.num_stages} "
                "(another plan: use another checkpoint directory)"
            )
        if not isinstance(peer.tx, DiLoCo):
            w = peer.worker
            r = ckpt.restore(params=w.params, opt_state=w.opt_state)
            if r is not None:
                w.set_state(r.params, r.opt_state)
                peer.step = peer.resumed_from = r.step
                peer.metrics.restored_steps.append(r.step)
                log.warning("%s: stage %d resumes from its checkpoint at step %d", peer.peer_id, peer.stage, r.step)
    except BaseException:
        ckpt.close()
        raise
    peer._ckpt, peer._ckpt_units = ckpt, (lo, hi)


def save(peer: Any, force: bool = False) -> None:
    """A checkpoint at :attr:`step` (in the background); with DiLoCo only between rounds
    (then at the first step after the round lands)."""
    w = peer.worker
    if peer._ckpt is None or w is None:
        return
    if not force and peer.step % peer.checkpoint_every and not peer._save_due:
        return
    extra = None
    if peer.sync is not None:
        if peer.sync.pending:
            peer._save_due = True
            return
        from ravnest_jax.sync import checkpoint_extra

        extra = checkpoint_extra(peer.sync, w.params)
    peer._ckpt.save(peer.step, params=w.params, opt_state=w.opt_state, extra=extra, force=True)
    peer._save_due = False


def rollback(peer: Any, step: int) -> None:
    """Goes back to this stage's checkpoint at ``step`` (the step its cluster resumes)."""
    w = peer.worker
    assert peer._ckpt is not None and w is not None
    r = peer._ckpt.restore(step, params=w.params, opt_state=w.opt_state)
    w.set_state(r.params, r.opt_state)
    w.reset_step()
    log.warning(
        "%s: the cluster resumes at step %d, the newest step every stage has: stage %d rolls back from step %d "
        "to its checkpoint",
        peer.peer_id,
        step,
        peer.stage,
        peer.step,
    )
    peer.step = step
    peer.metrics.restored_steps.append(step)


def join_group(peer: Any) -> None:
    """DiLoCo across clusters: joins the stage's group (its own swarm run) with an OuterSync;
    downloads the stage's state when a member already trains."""
    from ravnest_jax.optim import DiLoCo
    from ravnest_jax.sync import OuterSync, join_or_resume

    if peer.group is not None or not isinstance(peer.tx, DiLoCo):
        return
    w = peer.worker
    assert w is not None
    host = (peer.swarm.transport._listen or ("0.0.0.0", 0))[0]
    peer.group = Swarm(
        peer._swarm_args["rendezvous_url"],
        run_id=f"{peer.swarm.run_id}.stage{peer.stage}",
        token=peer._swarm_args["token"],
        codec=peer.outer_codec,
        listen=peer._group_listen or f"{host}:0",
        advertise=peer._group_advertise,
        timeouts=peer._timeouts,
        peer_id=peer.peer_id,
    )
    peer.group.start()
    opts = {"samples_per_step": float(peer._shape[0]) if peer._shape else 1.0, **peer.outer}
    peer.sync = OuterSync(peer.tx, peer.group, **opts)
    peer.sync.warmup(w.params, w.opt_state)
    took_over = peer.placement is not None and peer.peer_id in peer.placement.standbys
    got = join_or_resume(
        peer.group,
        peer.sync,
        w.params,
        w.opt_state,
        checkpointer=peer._ckpt,
        min_peers=1 if took_over else max(1, int(peer.group_size or 1)),
        timeout=peer.start_timeout,
    )
    peer.joined = got.how
    if got.how == "joined":
        w.set_state(got.params, got.state)
        log.warning("%s: downloaded stage %d's state from its group (step %d)", peer.peer_id, peer.stage, got.step)
    elif got.how in ("resumed", "restarted"):
        w.set_state(got.params, got.state)
        peer.step = peer.resumed_from = int(got.resumed_from)
        peer.metrics.restored_steps.append(peer.step)
        log.warning("%s: stage %d resumes from its checkpoint at step %d", peer.peer_id, peer.stage, peer.step)


def evaluate(peer: Any, tokens: Any) -> float | None:
    """:meth:`StagePeer.evaluate` (its docstring says what and what it raises)."""
    from collections.abc import Mapping

    from ._drive import read_batch

    w = peer.worker
    assert w is not None and peer._sender is not None and peer._shape is not None
    rows, seq = peer._shape[0] // peer.micro_batches, peer._shape[1]
    if isinstance(tokens, Mapping) or (isinstance(tokens, list | tuple) and tokens and isinstance(tokens[0], Mapping)):
        batches = [tokens] if isinstance(tokens, Mapping) else list(tokens)
        flat = [{k: np.asarray(v).reshape(-1, np.shape(v)[-1]) for k, v in b.items()} for b in batches]
        inputs, targets, mask = read_batch({k: np.concatenate([b[k] for b in flat]) for k in flat[0]}, "eval batch")
    else:
        tok = np.asarray(tokens, np.int32)
        tok = tok.reshape(-1, tok.shape[-1])
        if tok.shape[1] != seq + 1:
            raise ValueError(f"eval tokens of shape {tok.shape} do not cut into ({rows}, {seq + 1}) micro-batches")
        inputs, targets, mask = tok[:, :-1], tok[:, 1:], None
    if inputs.shape[1] != seq or inputs.shape[0] % rows:
        raise ValueError(f"eval batch of shape {inputs.shape} does not cut into ({rows}, {seq}) micro-batches")
    chunks = inputs.shape[0] // rows
    weights = None  # masked: each chunk's loss its share of the token mean over the whole eval set
    if mask is not None:
        weights = (mask * (chunks / max(float(mask.sum()), 1.0))).astype(np.float32)
    losses = []
    for k in range(chunks):
        g = -1 - k  # eval micro-batches: negative numbers, never a training one's
        at = slice(k * rows, (k + 1) * rows)
        x = inputs[at] if w.first else peer.link.take("act", g, peer.recv_timeout)
        t = None
        if w.last:
            t = targets[at] if weights is None else (targets[at], weights[at])
        packed, loss = w.evaluate(x, t)
        if w.last:
            losses.append(loss)
        else:
            jax.block_until_ready(packed)
            assert peer.neighbours["next"] is not None
            peer._sender.put(packed, "act", g, peer.neighbours["next"])
    if not peer._sender.flush(peer.recv_timeout):
        raise PipelineBroken("eval sends still in flight")
    return float(np.mean([float(x) for x in losses])) if losses else None


def cluster_step(infos: list[dict]) -> int:
    """The step a cluster goes on from, from its stages' published infos: the newest step that
    every stage either will run next (``resume``) or can go back to (``ckpt``, its checkpoint
    steps), so that no stage skips updates; when there is none, the largest ``resume`` (the
    stages behind skip to it, losing their part of the steps between)."""
    resumes = [int(i.get("resume", 0)) for i in infos]
    steps = [{int(x) for x in (i.get("ckpt") or [])} for i in infos]
    valid = [x for x in set(resumes).union(*steps) if all(x == r or x in c for r, c in zip(resumes, steps))]
    return max(valid) if valid else max(resumes)
