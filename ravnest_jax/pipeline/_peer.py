"""`StagePeer`: one pipeline stage as a peer process: its compute (a :class:`StageWorker`), its
neighbours found through the rendezvous, activations over the swarm's transport.

The training thread runs the stage's schedule and blocks only to receive (an activation from
the previous stage, an activation-gradient from the next), with a deadline. Sends never block
it: each encoded output goes to a sender thread, which waits for the device, builds the wire
message and hands it to the swarm's event loop, which uploads it while the next op computes.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ravnest_jax.swarm import Swarm, SwarmError, Timeouts
from ravnest_jax.swarm._activations import ActivationLink, PipelineBroken

from ._drive import Batches, encode_message, run_stage
from ._schedule import stage_ops
from ._worker import StageWorker

log = logging.getLogger("ravnest_jax.pipeline")

__all__ = ["PipelineBroken", "StageMetrics", "StagePeer"]

INFO_KEY = "pipe"


@dataclasses.dataclass
class StageMetrics:
    """Totals of one stage peer (seconds, bytes).

    Attributes:
      steps: updates applied.
      micro_batches: forwards run.
      busy_seconds: time the stage computed (its ops until their outputs were ready, padding of
        an emulated compute time included).
      wait_seconds: time it waited for an activation or activation-gradient.
      wall_seconds: time from its first op to its last.
      bytes_sent / bytes_received: activation messages (wire format, all codecs' bytes).
      messages_sent / messages_received, send_retries: as counted by the link.
      residual_bytes: device bytes a micro-batch in flight keeps besides its input.
    """

    steps: int = 0
    micro_batches: int = 0
    busy_seconds: float = 0.0
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    send_retries: int = 0
    residual_bytes: int = 0

    @property
    def utilisation(self) -> float | None:
        """busy / wall: the fraction of the time this stage computed."""
        return self.busy_seconds / self.wall_seconds if self.wall_seconds > 0 else None

    @property
    def bubble_fraction(self) -> float | None:
        """1 - utilisation: the fraction of the time the stage idled (pipeline bubbles and
        transfers it could not hide)."""
        u = self.utilisation
        return None if u is None else 1.0 - u

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["utilisation"] = self.utilisation
        d["bubble_fraction"] = self.bubble_fraction
        return d


class _Sender:
    """The sender thread: waits for each encoded output on the device, serialises it and hands
    it to the link (whose upload runs on the event loop). FIFO; never blocks the caller."""

    def __init__(self, link: ActivationLink, timeout: float, name: str):
        self.link, self.timeout = link, timeout
        self._q: queue.Queue[Any] = queue.Queue()
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def put(self, packed: Any, kind: str, g: int, dest: tuple[str, str]) -> None:
        self._q.put((packed, kind, g, dest))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                packed, kind, g, (peer, address) = item
                del item
                try:
                    data = encode_message(packed)
                except Exception as e:  # noqa: BLE001 - NonFiniteError, a device error: the pipeline stops
                    self.link.fail(PipelineBroken(f"cannot send {kind} of micro-batch {g}: {e}"))
                    continue
                del packed
                self.link.send(address, peer, kind, g, data, self.timeout)
            finally:
                self._q.task_done()

    def flush(self, timeout: float) -> bool:
        """Waits (up to ``timeout`` seconds) until every queued output went to the link and
        every send ended; returns whether they did."""
        deadline = time.monotonic() + timeout
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)
        return self.link.drain(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self._q.put(None)
        self._t.join(timeout=10)


class StagePeer:
    """One stage of a pipeline, as a peer of a swarm run: trains its slice of the model with its
    neighbours in the same cluster.

    Args:
      split: the model's :class:`LayerSplit` (every stage peer builds the same one).
      plan: the :class:`StagePlan` (the same on every stage peer).
      stage: the stage this peer holds, in ``[0, plan.num_stages)``.
      tx: the optax optimizer of the stage's parameters.
      micro_batches: M micro-batches per step (the batch's rows must divide by M).
      mode: ``"sync"`` (flush every step: exactly the unsplit model's training), ``"stash"`` or
        ``"2bw"`` (asynchronous: no flush; see :mod:`ravnest_jax.pipeline._worker`).
      codec, codec_options: the activation codec (``"fp32"``, ``"bf16"``, ``"int8"``, ``"int4"``,
        ``"fp4"``) for activations and activation-gradients.
      recompute: recompute the forward in the backward (less memory per micro-batch in flight).
      rendezvous_url, run_id, token, listen, advertise, peer_id, timeouts: of the peer's
        :class:`rj.Swarm` (read from ``RAVNEST_*`` when left out, as there).
      cluster: which replica of the model this peer's pipeline is (stages of one cluster send
        activations to each other).
      recv_timeout: seconds a stage waits for an activation or activation-gradient before the
        pipeline is broken (:class:`PipelineBroken`); a send is retried as long.
      start_timeout: seconds to wait for the neighbours to appear at the rendezvous.
      compute_seconds: emulate a slower accelerator: each forward takes at least ``[0]`` and each
        backward ``[1]`` seconds (the last stage's fused forward-backward their sum).

    Use as a context manager; then :meth:`run`.

    Raises:
      ValueError: a bad stage, mode, codec or plan.
    """

    def __init__(
        self,
        split: Any,
        plan: Any,
        stage: int,
        tx: Any,
        *,
        micro_batches: int,
        mode: str = "sync",
        codec: str = "fp32",
        codec_options: dict | None = None,
        recompute: bool = False,
        rendezvous_url: str | None = None,
        run_id: str | None = None,
        token: str | bytes | None = None,
        listen: str | None = "auto",
        advertise: str | None = None,
        peer_id: str | None = None,
        timeouts: Timeouts | None = None,
        cluster: int = 0,
        recv_timeout: float = 60.0,
        start_timeout: float = 120.0,
        compute_seconds: tuple[float, float] | None = None,
        keep_grads: bool = False,
    ):
        S = plan.num_stages
        if not isinstance(stage, int) or not 0 <= stage < S:
            raise ValueError(f"stage must be an int in [0, {S}), got {stage!r}")
        if not recv_timeout > 0:
            raise ValueError(f"recv_timeout must be > 0 seconds, got {recv_timeout!r}")
        self.split, self.plan, self.stage, self.num_stages = split, plan, stage, S
        self.tx, self.micro_batches, self.mode = tx, int(micro_batches), mode
        self.codec, self.codec_options, self.recompute = codec, dict(codec_options or {}), recompute
        self.cluster = int(cluster)
        self.recv_timeout, self.start_timeout = float(recv_timeout), float(start_timeout)
        self.compute_seconds = compute_seconds
        self.keep_grads = keep_grads
        self._epoch = 0
        self.swarm = Swarm(
            rendezvous_url,
            run_id=run_id,
            token=token,
            listen=listen,
            advertise=advertise,
            peer_id=peer_id,
            timeouts=timeouts,
            info={INFO_KEY: self._info(ready=False)},
        )
        self.link = self.swarm.activation_link()
        self.worker: StageWorker | None = None
        self.metrics = StageMetrics()
        self.neighbours: dict[str, tuple[str, str] | None] = {"prev": None, "next": None}
        self._sender: _Sender | None = None

    @property
    def peer_id(self) -> str:
        return self.swarm.peer_id

    def _info(self, ready: bool) -> dict:
        return {"cluster": self.cluster, "stage": self.stage, "epoch": self._epoch, "ready": ready}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> StagePeer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Joins the run (the swarm starts; not yet ready: neighbours do not send to it yet)."""
        self.swarm.start()
        self._sender = _Sender(self.link, self.recv_timeout, f"pipe-send-{self.peer_id}")

    def close(self) -> None:
        """Leaves the run; stops the sender thread. Idempotent."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        self.swarm.close()

    # ------------------------------------------------------------------ set-up
    def prepare(self, batch_rows: int, seq_len: int) -> StageWorker:
        """Builds and compiles this stage's compute for batches of ``batch_rows`` sequences of
        ``seq_len`` tokens (before :meth:`run`; :meth:`run` calls it when not done)."""
        if self.micro_batches < 1 or batch_rows % self.micro_batches:
            raise ValueError(f"batch of {batch_rows} rows does not split into {self.micro_batches} micro-batches")
        rows = batch_rows // self.micro_batches
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
        self.worker.compile(rows, seq_len)
        self.metrics.residual_bytes = self.worker.residual_bytes
        return self.worker

    def connect(self) -> None:
        """Says this stage is ready and waits (up to ``start_timeout``) until its neighbours in
        the cluster are too; then only they may send to it.

        Raises:
          SwarmError: a neighbour did not appear in time.
        """
        assert self.worker is not None, "prepare() first"
        self.swarm.set_info({INFO_KEY: self._info(ready=True)})
        self.swarm.announce()
        want = {
            "prev": self.stage - 1 if self.stage > 0 else None,
            "next": self.stage + 1 if self.stage < self.num_stages - 1 else None,
        }
        deadline = time.monotonic() + self.start_timeout
        while True:
            found = self._find(want)
            if all(found[k] is not None for k, s in want.items() if s is not None):
                break
            if time.monotonic() > deadline:
                missing = [f"stage {s}" for k, s in want.items() if s is not None and found[k] is None]
                raise SwarmError(
                    f"cluster {self.cluster}: {', '.join(missing)} not ready within {self.start_timeout:.0f} s"
                )
            time.sleep(0.1)
        self.neighbours = found
        shape = self.worker.hidden.shape
        prev, nxt = found["prev"], found["next"]
        self.link.set_epoch(self._epoch)
        self.link.expect("act", prev[0] if prev else None, shape, self.codec)
        self.link.expect("grad", nxt[0] if nxt else None, shape, self.codec)

    def _find(self, want: dict[str, int | None]) -> dict[str, tuple[str, str] | None]:
        out: dict[str, tuple[str, str] | None] = {k: None for k in want}
        for p in self.swarm.peers():
            info = p.info.get(INFO_KEY) or {}
            if p.peer_id == self.peer_id or not info.get("ready") or info.get("cluster") != self.cluster:
                continue
            if info.get("epoch") != self._epoch:
                continue
            for k, s in want.items():
                if s is not None and info.get("stage") == s:
                    out[k] = (p.peer_id, p.address)
        return out

    # ------------------------------------------------------------------ training
    def run(
        self,
        steps: int,
        batches: Callable[[int], Any] | None,
        *,
        start: int = 0,
        on_step: Callable[[int, Any], None] | None = None,
    ) -> list[float]:
        """Runs ``steps`` steps of this stage's schedule from step ``start``.

        Args:
          batches: ``batches(step)`` -> int32 tokens ``(B, T + 1)``, the same on every stage of
            the cluster (the first stage reads the inputs, the last the targets); ``None`` on a
            stage that is neither.
          on_step: ``on_step(step, loss)`` after each update (``loss``: the step's mean
            micro-batch loss, a float, on the last stage; else ``None``).

        Returns:
          the losses of the steps (on the last stage; else an empty list).

        Raises:
          PipelineBroken: a neighbour did not deliver in time or a send failed for good.
          ValueError: a bad batch.
        """
        if self.worker is None:
            if batches is None:
                raise ValueError("a stage without data must be prepared first: call prepare(batch_rows, seq_len)")
            tok = np.asarray(batches(start))
            self.prepare(tok.shape[0], tok.shape[1] - 1)
        if self.neighbours["prev"] is None and self.neighbours["next"] is None and self.num_stages > 1:
            self.connect()
        w = self.worker
        assert w is not None and self._sender is not None
        data = Batches(batches, self.micro_batches) if batches is not None else None
        losses: list[float] = []
        m = self.metrics

        def updated(step: int, loss: Any) -> None:
            m.steps += 1
            val = None if loss is None else float(loss)
            if val is not None:
                losses.append(val)
            if on_step is not None:
                on_step(step, val)

        sched = "sync" if self.mode == "sync" else "async"
        gen = run_stage(
            w, stage_ops(self.stage, self.num_stages, self.micro_batches, steps, sched, start), data, updated
        )
        pad_f, pad_b = self.compute_seconds or (0.0, 0.0)
        pads = {"F": pad_f + pad_b if w.last else pad_f, "B": pad_b, "U": 0.0}
        t_start = time.perf_counter()
        t_op = t_start
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
                self._pad(t_op, pads[op])
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
            m.wall_seconds += time.perf_counter() - t_start
            st = self.link.stats
            m.bytes_sent, m.bytes_received = st.bytes_sent, st.bytes_received
            m.messages_sent, m.messages_received, m.send_retries = st.messages_sent, st.messages_received, st.retries
        return losses

    def _pad(self, t0: float, seconds: float) -> None:
        if seconds > 0:
            left = seconds - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)
