"""`StagePeer`: one pipeline stage as a peer process: its compute (a :class:`StageWorker`), its
place (given, or from :func:`place` over the peers' reports), its neighbours found through the
rendezvous, activations over the swarm's transport, DiLoCo with the peers that hold the same
stage in other clusters, and recovery when a stage peer of its cluster dies.

The training thread runs the stage's schedule and blocks only to receive (an activation from the
previous stage, an activation-gradient from the next), with a deadline. Sends never block it: a
sender thread waits for the device, builds the wire message and hands it to the event loop.

What a stage peer publishes through the rendezvous (``info["pipe"]``): its role (``"active"``,
``"standby"``, ``"unplaced"``), cluster, stage, the pipeline epoch it is at, whether it is ready,
the step it will run next (``resume``), the checkpoint steps it can go back to (``ckpt``),
whether it is done, and its report for placement (``memory`` bytes, ``mbit``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from ravnest_jax.compress import Codec
from ravnest_jax.swarm import PipelineBroken, Swarm, SwarmError, Timeouts

from ._drive import Batches, read_batch, run_stage
from ._placement import Placement, device_memory, place
from ._schedule import check_depth, stage_ops
from ._stage_io import StageMetrics, _Sender, pad_to
from ._stage_memory import stage_need_bytes
from ._stage_state import cluster_step, join_group, open_checkpoints, rollback, save
from ._stage_state import evaluate as evaluate_cluster
from ._standby import wait_for_a_free_slot
from ._worker import StageWorker

log = logging.getLogger("ravnest_jax.pipeline")

__all__ = ["PipelineBroken", "StageMetrics", "StagePeer"]

INFO_KEY = "pipe"


class StagePeer:
    """One stage of a pipeline, as a peer of a swarm run: trains its slice of the model with its
    neighbours in the same cluster, averages it with DiLoCo among the peers that hold the same
    stage in other clusters, and recovers when a stage peer of its cluster dies.

    Args:
      split: the model's :class:`LayerSplit` (every stage peer builds the same one).
      plan: the :class:`StagePlan` (the same on every stage peer).
      tx: the optimizer of the stage's parameters: an optax transformation, or an
        ``rj.diloco(...)`` one for DiLoCo across clusters (then the peer joins the stage's group,
        run ``"{run_id}.stage{s}"``, with an :class:`rj.OuterSync` (``outer``: its options) and
        downloads the stage's state from a running member when there is one).
      stage, cluster: this peer's place; ``stage=None``: placed by :func:`place` once
        ``expected_peers`` peers joined (it may become a standby).
      micro_batches: M micro-batches per step (the batch's rows must divide by M).
      mode: ``"sync"`` (flush every step: exactly the unsplit model's training) or ``"async"``
        (no flush; ``rj.pipeline.ASYNC_MODE``, weight stashing with weight prediction), or an
        asynchronous mode by name: ``"stash"``, ``"predict"``, ``"2bw"`` (``docs/pipeline.md``).
      codec, codec_options: the activation codec (``"fp32"``, ``"bf16"``, ``"int8"``, ``"int4"``,
        ``"fp4"``) for activations and activation-gradients.
      recompute: recompute the forward in the backward (less memory per micro-batch in flight).
      in_flight: the most micro-batches stage 0 holds (default S; at most M + 1); over slow links
        a larger depth hides the transfers (``rj.pipeline.stage_ops``, docs/pipeline.md).
      rendezvous_url, run_id, token, listen, advertise, peer_id, timeouts: of the peer's
        pipeline :class:`rj.Swarm` (read from ``RAVNEST_*`` when left out, as there).
      recv_timeout: seconds a stage waits for an activation or activation-gradient before its
        cluster's pipeline is broken (:class:`PipelineBroken`); a send is retried as long.
      start_timeout: seconds to wait for the cluster's stages (at start and after a break).
      recover: after a break, go on in a new epoch with whoever holds each stage then (a
        standby that took over), replaying the step that was cut; ``False``: raise.
      compute_seconds: emulate a slower accelerator: each forward takes at least ``[0]`` and each
        backward ``[1]`` seconds (the last stage's fused forward-backward their sum).
      outer: options of the :class:`rj.OuterSync` (``mode``, ``overlap_steps``, ...).
      outer_codec: the stage groups' round codec, an ``rj.Codec`` or a name (default ``"int8"``).
      group_size: peers each stage group waits for before its first step (default: 1, or the
        placement's cluster count).
      group_listen, group_advertise: the stage group swarm's listen address and advertised URL
        (default: the pipeline swarm's host, port 0; the guessed address).
      expected_peers, clusters, standbys: placement (``stage=None``): wait for this many peers,
        form this many clusters and standbys (see :func:`place`).
      memory, mbit: this peer's report for placement (default: the device's memory, bandwidth
        unknown).
      need_bytes: device bytes each stage needs (default: its base at the measured width,
        trainable leaves, optimizer and outer state: ``stage_need_bytes``; pass
        ``[s.total for s in plan_stage_memory(...).stages]`` to count activations too).
      advertise_to: ``{"prev": url, "next": url}``: the base URL the previous (next) stage uses
        to reach this peer when it differs from ``advertise`` (e.g. a different network per
        neighbour; the benchmark's emulated links).
      checkpoint_dir: save this stage's params and optimizer state with orbax under
        ``<checkpoint_dir>/stage<s>/`` (an :class:`rj.Checkpointer`; the peer id is kept in
        ``<checkpoint_dir>/peer_id`` when ``peer_id`` is not given) and resume from there: a
        stage peer started again on the same directory goes on from its newest checkpoint, and
        with one cluster the whole cluster goes on from the newest step every stage can resume
        (the others roll back to it from their own checkpoints), so a stage peer that dies loses
        at most ``checkpoint_every`` steps (docs/pipeline.md, faults).
      checkpoint_every: steps between checkpoints (int >= 1; the last step is saved too).
      max_to_keep: checkpoints kept per stage (int >= 2: a rollback needs an older one).
      fresh: start from step 0, the stage folder's earlier checkpoints moved aside (``Checkpointer(fresh=True)``).

    Use as a context manager; then :meth:`run`.

    Raises:
      ValueError: a bad stage, mode, codec, plan, timeout or checkpoint option (a
        ``checkpoint_dir`` that is a file; a checkpoint of other units than this stage's, when
        the stage is known, before anything compiles).
    """

    def __init__(
        self,
        split: Any,
        plan: Any,
        tx: Any,
        *,
        stage: int | None = None,
        cluster: int = 0,
        micro_batches: int,
        mode: str = "sync",
        codec: str = "fp32",
        codec_options: dict | None = None,
        recompute: bool = False,
        in_flight: int | None = None,
        rendezvous_url: str | None = None,
        run_id: str | None = None,
        token: str | bytes | None = None,
        listen: str | None = "auto",
        advertise: str | None = None,
        peer_id: str | None = None,
        timeouts: Timeouts | None = None,
        recv_timeout: float = 60.0,
        start_timeout: float = 120.0,
        recover: bool = True,
        compute_seconds: tuple[float, float] | None = None,
        outer: dict | None = None,
        outer_codec: Codec | str = "int8",
        group_size: int | None = None,
        group_listen: str | None = None,
        group_advertise: str | None = None,
        expected_peers: int | None = None,
        clusters: int | None = None,
        standbys: int | None = None,
        memory: int | None = None,
        mbit: float | None = None,
        need_bytes: list[int] | None = None,
        advertise_to: dict[str, str] | None = None,
        keep_grads: bool = False,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 100,
        max_to_keep: int = 3,
        fresh: bool = False,
    ):
        S = plan.num_stages
        if checkpoint_dir is not None:
            root = Path(checkpoint_dir).expanduser()
            if root.exists() and not root.is_dir():
                raise ValueError(f"checkpoint_dir {str(root)!r} is a file")
            if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
                raise ValueError(f"checkpoint_every must be an int >= 1 (steps), got {checkpoint_every!r}")
            if not isinstance(max_to_keep, int) or max_to_keep < 2:
                raise ValueError(f"max_to_keep must be an int >= 2, got {max_to_keep!r}")
            if peer_id is None and not os.environ.get("RAVNEST_PEER_ID"):
                from ravnest_jax.checkpoint import persistent_peer_id

                peer_id = persistent_peer_id(root)
        if stage is not None and (not isinstance(stage, int) or not 0 <= stage < S):
            raise ValueError(f"stage must be an int in [0, {S}) or None (placed), got {stage!r}")
        if stage is None and not expected_peers:
            raise ValueError("stage=None (placement) needs expected_peers")
        if not recv_timeout > 0 or not start_timeout > 0:
            raise ValueError(f"recv_timeout and start_timeout must be > 0 seconds, got {recv_timeout}, {start_timeout}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.split, self.plan, self.num_stages = split, plan, S
        self.stage, self.cluster = stage, int(cluster)
        self.role = "active" if stage is not None else "unplaced"
        from ._worker import ASYNC_MODE

        self.tx, self.micro_batches, self.mode = tx, int(micro_batches), ASYNC_MODE if mode == "async" else mode
        self.in_flight = check_depth(in_flight, S, self.micro_batches)
        self.codec, self.codec_options, self.recompute = codec, dict(codec_options or {}), recompute
        self.recv_timeout, self.start_timeout, self.recover = float(recv_timeout), float(start_timeout), bool(recover)
        self.compute_seconds = compute_seconds
        self.outer, self.outer_codec, self.group_size = dict(outer or {}), outer_codec, group_size
        self.expected_peers, self.clusters, self.standbys = expected_peers, clusters, standbys
        self.memory = memory if memory is not None else device_memory()
        self.mbit = mbit
        self.need_bytes = need_bytes
        self.advertise_to = dict(advertise_to or {})
        self.keep_grads = keep_grads
        self.placement: Placement | None = None
        self.step = 0  # the next step this stage runs
        self._epoch = 0
        self._ready = False
        self._done = False
        self._resume = 0
        self._ckpt_steps: list[int] = []  # published: the steps a cluster may roll back to
        self._timeouts = timeouts
        self._swarm_args = dict(rendezvous_url=rendezvous_url, token=token, timeouts=timeouts)
        self._group_listen, self._group_advertise = group_listen, group_advertise
        self.swarm = Swarm(
            rendezvous_url,
            run_id=run_id,
            token=token,
            listen=listen,
            advertise=advertise,
            peer_id=peer_id,
            timeouts=timeouts,
        )
        self.swarm.set_info({INFO_KEY: self._info()})
        self.link = self.swarm.activation_link()
        self.worker: StageWorker | None = None
        self.metrics = StageMetrics()
        self.neighbours: dict[str, tuple[str, str] | None] = {"prev": None, "next": None}
        self.group: Swarm | None = None
        self.sync: Any = None
        self.joined: str | None = None  # how the stage's state began: "fresh" or "joined" (downloaded)
        self._sender: _Sender | None = None
        self._shape: tuple[int, int, bool] | None = None  # batch rows, seq, loss-masked batches
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir).expanduser()
        self.fresh, self._fresh_opened = fresh, set()  # the stage folders a fresh start has set aside
        self.checkpoint_every, self.max_to_keep = checkpoint_every, max_to_keep
        self._ckpt: Any = None  # the rj.Checkpointer of this peer's stage
        self._ckpt_units: tuple[int, int] | None = None
        self._save_due = False
        self.resumed_from: int | None = None  # the checkpoint step this stage started from

    @property
    def peer_id(self) -> str:
        return self.swarm.peer_id

    def _info(self) -> dict:
        return {
            "role": self.role,
            "cluster": self.cluster if self.role == "active" else None,
            "stage": self.stage,
            "epoch": self._epoch,
            "ready": self._ready,
            "resume": self._resume,
            "ckpt": self._ckpt_steps,
            "done": self._done,
            "memory": self.memory,
            "mbit": self.mbit,
            "via": self.advertise_to,
        }

    def _publish(self) -> None:
        self.swarm.set_info({INFO_KEY: self._info()})
        self.swarm.announce()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> StagePeer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Joins the run (the pipeline swarm starts; not yet ready: nobody sends to it yet)."""
        self.swarm.start()
        self._sender = _Sender(self.link, self.recv_timeout, f"pipe-send-{self.peer_id}")

    def close(self) -> None:
        """Says it is done, leaves the run and its stage group; stops the sender thread.
        Idempotent."""
        if self._sender is not None:
            try:
                self._done, self._ready = True, False
                self._publish()
            except (SwarmError, RuntimeError) as e:
                log.info("%s: could not say done: %s", self.peer_id, e)
            self._sender.close()
            self._sender = None
        if self.sync is not None:
            self.sync.close()
        if self._ckpt is not None:
            try:
                self._ckpt.close()  # waits for the write in flight
            finally:
                self._ckpt = None
        if self.group is not None:
            self.group.close()
        self.swarm.close()

    # ------------------------------------------------------------------ membership
    def _members(self) -> list[tuple[Any, dict]]:
        """Live peers of the run (stale heartbeats excluded) with their pipeline info."""
        hb = (self._timeouts or Timeouts()).heartbeat
        out = []
        for p in self.swarm.peers():
            info = p.info.get(INFO_KEY)
            if isinstance(info, dict) and p.seconds_since_heartbeat <= 3 * hb + 0.5:
                out.append((p, info))
        return out

    def place(self) -> Placement | None:
        """Placement (``stage=None``): waits until ``expected_peers`` peers joined, then computes
        :func:`place` from their reports (the same on every peer) and takes this peer's part.

        Raises:
          SwarmError: fewer peers joined within ``start_timeout``. ValueError: see :func:`place`.
        """
        if self.role != "unplaced":
            return self.placement
        deadline = time.monotonic() + self.start_timeout
        while True:
            # every peer with a report counts: those that placed themselves already keep it
            members = [(p, i) for p, i in self._members() if i.get("role") in ("unplaced", "active", "standby")]
            if len(members) >= self.expected_peers:
                break
            if time.monotonic() > deadline:
                raise SwarmError(
                    f"{len(members)} of {self.expected_peers} peers joined within {self.start_timeout:.0f} s"
                )
            time.sleep(0.1)
        reports = [{"peer": p.peer_id, "memory": i.get("memory"), "mbit": i.get("mbit")} for p, i in members]
        reports = sorted(reports, key=lambda r: r["peer"])[: self.expected_peers]
        need = self.need_bytes or stage_need_bytes(self.split, self.plan.bounds, tx=self.tx)
        self.placement = place(reports, need, clusters=self.clusters, standbys=self.standbys)
        role, cluster, stage = self.placement.of(self.peer_id)
        if role == "none":
            raise SwarmError(f"{self.peer_id}: the placement has no place for this peer")
        self.role, self.stage = role, stage
        if cluster is not None:
            self.cluster = cluster
        if self.group_size is None:
            self.group_size = self.placement.clusters
        self._publish()
        log.info("%s: placed as %s (cluster %s, stage %s)", self.peer_id, role, cluster, stage)
        return self.placement

    def _wait_for_a_free_slot(self, deadline: float | None = None) -> bool:
        return wait_for_a_free_slot(self, deadline)

    # ------------------------------------------------------------------ set-up
    def prepare(self, batch_rows: int, seq_len: int, *, masked: bool = False) -> StageWorker:
        """Builds and compiles this stage's compute for batches of ``batch_rows`` sequences of
        ``seq_len`` tokens, ``masked`` or not (:meth:`run` calls it when not done)."""
        if batch_rows % self.micro_batches:
            raise ValueError(f"batch of {batch_rows} rows does not split into {self.micro_batches} micro-batches")
        assert self.stage is not None, "place() first"
        rows = batch_rows // self.micro_batches
        if (
            self.worker is not None
            and self.worker.stage.lo == self.plan.bounds[self.stage][0]
            and self._shape == (batch_rows, seq_len, masked)
        ):
            return self.worker
        lo, hi = self.plan.bounds[self.stage]
        self.worker = StageWorker(
            self.split.stage(lo, hi),
            self.tx,
            num_stages=self.num_stages,
            micro_batches=self.micro_batches,
            hidden=self.split.hidden(rows, seq_len),
            codec=self.codec,
            codec_options=self.codec_options,
            mode=self.mode,
            recompute=self.recompute,
            keep_grads=self.keep_grads,
        )
        open_checkpoints(self)
        self.worker.compile(rows, seq_len, masked=masked)
        self.metrics.residual_bytes = self.worker.residual_bytes
        self._shape = (batch_rows, seq_len, masked)
        return self.worker

    def connect(self) -> None:
        """Says this stage is ready (in its epoch) and waits (up to ``start_timeout``) until
        every stage of the cluster is ready in the same epoch; adopts a newer epoch when a
        cluster member is at one. Then only its neighbours may send to it, and all stages go on
        from the largest step any of them will run next.

        Raises:
          SwarmError: the cluster did not become ready in time.
        """
        assert self.worker is not None, "prepare() first"
        self._ckpt_steps = []
        if self._ckpt is not None and self.sync is None:
            # without a stage group the cluster may roll back to a step every stage has saved;
            # a group's members resume from the group (join_or_resume), not by rolling back
            self._ckpt.wait()
            self._ckpt_steps = self._ckpt.all_steps()
        self._ready, self._resume = True, self.step
        self._publish()
        deadline = time.monotonic() + self.start_timeout
        while True:
            members = [
                (p, i)
                for p, i in self._members()
                if i.get("role") == "active" and i.get("cluster") == self.cluster and not i.get("done")
            ]
            top = max([int(i.get("epoch", 0)) for _, i in members] + [self._epoch])
            if top > self._epoch:
                log.info("%s: cluster %d is at epoch %d: joining it", self.peer_id, self.cluster, top)
                self._epoch = top
                self._publish()
                continue
            ready = {}
            for p, i in members:
                if i.get("ready") and int(i.get("epoch", -1)) == self._epoch:
                    ready.setdefault(int(i.get("stage")), (p, i))
            if len(ready) == self.num_stages and ready[self.stage][0].peer_id == self.peer_id:
                break
            if time.monotonic() > deadline:
                missing = [s for s in range(self.num_stages) if s not in ready]
                raise SwarmError(
                    f"cluster {self.cluster}: stages {missing} not ready in epoch {self._epoch} within "
                    f"{self.start_timeout:.0f} s"
                )
            time.sleep(0.05)
        resume = cluster_step([i for _, i in ready.values()])
        if resume < self.step:
            rollback(self, resume)
        elif resume > self.step:
            log.warning(
                "%s: the cluster goes on at step %d; this stage skips from step %d", self.peer_id, resume, self.step
            )
            self.worker.reset_step()
        self.step = resume
        prev = ready.get(self.stage - 1)
        nxt = ready.get(self.stage + 1)
        # the previous stage reaches us "from next" of its view: its via["next"], and vice versa
        self.neighbours = {
            "prev": (prev[0].peer_id, (prev[1].get("via") or {}).get("next") or prev[0].address) if prev else None,
            "next": (nxt[0].peer_id, (nxt[1].get("via") or {}).get("prev") or nxt[0].address) if nxt else None,
        }
        self._cluster_addresses = [p.address for p, _ in ready.values() if p.peer_id != self.peer_id]
        shape = self.worker.hidden.shape
        self.link.set_epoch(self._epoch)
        # received undecoded: the stage's jitted step decodes them on its device
        self.link.expect("act", self.neighbours["prev"][0] if prev else None, shape, self.codec, encoded=True)
        self.link.expect("grad", self.neighbours["next"][0] if nxt else None, shape, self.codec, encoded=True)

    # ------------------------------------------------------------------ training
    def run(
        self,
        steps: int,
        batches: Callable[[int], Any] | None,
        *,
        batch_shape: tuple[int, int] | None = None,
        on_step: Callable[[int, Any], None] | None = None,
    ) -> list[float]:
        """Trains until step ``steps`` (steps are counted from 0 through the run; a peer that
        took over a stage starts where its cluster is).

        Args:
          steps: the step to stop before.
          batches: ``batches(step)`` -> int32 tokens ``(B, T + 1)``, or a loss-masked batch of one
            document a row (``TokenBatch`` fields: ``_drive.read_batch``), the same on every stage
            of a cluster (the first stage reads the inputs, the last the targets; clusters should
            read different data).
          batch_shape: ``(B, T)`` when ``batches`` is None (a middle stage without data).
          on_step: ``on_step(step, loss)`` after each update (``loss``: the step's mean
            micro-batch loss, a float, on the last stage; else ``None``).

        Returns:
          the losses of the steps this peer ran (on the last stage; else an empty list). A
          standby that took nothing over returns an empty list.

        Raises:
          PipelineBroken: the pipeline broke and ``recover`` is False.
          SwarmError: the cluster did not come together within ``start_timeout``.
          ValueError: a bad batch.
        """
        assert self._sender is not None, "start() first"
        masked = False  # loss-masked batches (a stage without data is not the last: no targets)
        if batches is not None:
            tok, _, mask = read_batch(batches(self.step), f"batches({self.step})")
            masked, batch_shape = mask is not None, batch_shape or tok.shape
        elif batch_shape is None:
            raise ValueError("a stage without data needs batch_shape=(B, T)")
        if self.role == "unplaced":
            self.place()
        if self.role == "standby":
            self.prepare(*batch_shape, masked=masked)  # compiled ahead: a takeover costs the download only
            self._ready = False
            self._publish()
            if not self._wait_for_a_free_slot():
                return []
        self.prepare(*batch_shape, masked=masked)
        join_group(self)
        losses: list[float] = []
        data = Batches(batches, self.micro_batches) if batches is not None else None
        broke_at: float | None = None
        while self.step < steps:
            try:
                self.connect()
                if broke_at is not None:
                    self.metrics.recovery_seconds += time.perf_counter() - broke_at
                    broke_at = None
                self._train(steps, data, losses, on_step)
            except PipelineBroken as e:
                if not self.recover:
                    raise
                broke_at = time.perf_counter()
                self.metrics.break_times.append(time.time())
                log.warning("%s: pipeline of cluster %d broke at step %d: %s", self.peer_id, self.cluster, self.step, e)
                self._abort_cluster(str(e))
                self.metrics.recoveries += 1
                self.metrics.replayed_steps += 1
                self.worker.reset_step()
                self._epoch += 1
                self._ready = False
        if self.sync is not None:
            w = self.worker
            params, state = self.sync.flush(w.params, w.opt_state)
            if params is not w.params:
                w.set_state(params, state)
            self.metrics.outer_rounds = sum(1 for m in self.sync.metrics if m.ok)
            if self._save_due:
                save(self, force=True)
        return losses

    def _abort_cluster(self, reason: str) -> None:
        for address in getattr(self, "_cluster_addresses", []):
            self.link.abort(address, reason, timeout=min(2.0, self.recv_timeout))

    def _train(self, steps: int, data: Batches | None, losses: list[float], on_step: Callable | None) -> None:
        w = self.worker
        assert w is not None and self._sender is not None
        m = self.metrics

        def updated(step: int, loss: Any) -> None:
            m.steps += 1
            self.step = step + 1
            if self.sync is not None:
                params, state = self.sync(w.params, w.opt_state)
                if params is not w.params:
                    w.set_state(params, state)
            if self._ckpt is not None:
                save(self, force=self.step == steps)
            val = None if loss is None else float(loss)
            if val is not None:
                losses.append(val)
            if on_step is not None:
                on_step(step, val)

        sched = "sync" if self.mode == "sync" else "async"
        S, M = self.num_stages, self.micro_batches
        ops = stage_ops(self.stage, S, M, steps - self.step, sched, self.step, self.in_flight)
        gen = run_stage(w, ops, data, updated)
        pad_f, pad_b = self.compute_seconds or (0.0, 0.0)
        pads = {"F": pad_f + pad_b if w.last else pad_f, "B": pad_b, "U": 0.0}
        t_start = t_op = time.perf_counter()
        value = None
        try:
            while True:
                try:
                    req = gen.send(value)
                except StopIteration:
                    break
                value = None
                if req[0] == "recv":
                    m.busy_seconds += time.perf_counter() - t_op
                    t0 = time.perf_counter()
                    value = self.link.take(req[1], req[2], self.recv_timeout)
                    t_op = time.perf_counter()
                    m.wait_seconds += t_op - t0
                    continue
                op = req[-1]
                jax.block_until_ready(req[3] if req[0] == "send" else req[1])
                pad_to(t_op, pads[op])
                if req[0] == "send":
                    _, kind, g, packed, _ = req
                    dest = self.neighbours["next" if kind == "act" else "prev"]
                    assert dest is not None
                    self._sender.put(packed, kind, g, dest)
                if op == "F":
                    m.micro_batches += 1
                m.busy_seconds += time.perf_counter() - t_op
                t_op = time.perf_counter()
                del req
            if not self._sender.flush(self.recv_timeout):
                raise PipelineBroken("sends still in flight after the last step")
            if self.link.failure is not None:
                raise self.link.failure
        finally:
            gen.close()
            m.wall_seconds += time.perf_counter() - t_start
            st = self.link.stats
            m.bytes_sent, m.bytes_received = st.bytes_sent, st.bytes_received
            m.messages_sent, m.messages_received, m.send_retries = st.messages_sent, st.messages_received, st.retries

    def evaluate(self, tokens: Any) -> float | None:
        """The mean loss of the cluster's model on ``tokens`` (int32 ``(K, B, T + 1)``, or
        loss-masked batches, one or a list: their token mean), the same on every stage of the
        cluster: a forward-only pass through the pipeline, batch by batch of the training
        micro-batch's shape. Returns the loss on the last stage, else ``None``.

        Raises:
          PipelineBroken: a neighbour did not deliver in time.
          ValueError: the rows or sequence length do not fit the training shape.
        """
        return evaluate_cluster(self, tokens)
