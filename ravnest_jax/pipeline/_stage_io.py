"""What a stage peer measures (:class:`StageMetrics`) and how it sends without blocking its
training thread (a sender thread that builds each wire message and hands it to the event loop)."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any

from ravnest_jax.swarm import ActivationLink, PipelineBroken

from ._drive import encode_message

log = logging.getLogger("ravnest_jax.pipeline")


@dataclasses.dataclass
class StageMetrics:
    """Totals of one stage peer (seconds, bytes).

    Attributes:
      steps: updates applied.
      micro_batches: forwards run.
      busy_seconds: time the stage computed (its ops until their outputs were ready, padding of
        an emulated compute time included).
      wait_seconds: time it waited for an activation or activation-gradient.
      wall_seconds: time from its first op to its last (recoveries excluded).
      bytes_sent / bytes_received: activation messages (wire format).
      messages_sent / messages_received, send_retries: as counted by the link.
      residual_bytes: device bytes a micro-batch in flight keeps besides its input.
      recoveries: times the pipeline broke and this peer went on in a new epoch.
      replayed_steps: steps started again after a break (their micro-batches replayed).
      recovery_seconds: time from a break until the cluster ran again.
      outer_rounds: DiLoCo rounds merged (with the peers of this stage in other clusters).
      break_times: UNIX times at which this peer found its cluster's pipeline broken.
      restored_steps: the checkpoint steps this stage's state was restored from (at its start,
        or rolling back to the step its cluster resumes at).
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
    recoveries: int = 0
    replayed_steps: int = 0
    recovery_seconds: float = 0.0
    outer_rounds: int = 0
    break_times: list[float] = dataclasses.field(default_factory=list)
    restored_steps: list[int] = dataclasses.field(default_factory=list)

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


def pad_to(t0: float, seconds: float) -> None:
    """Sleeps until ``seconds`` after ``t0`` (``time.perf_counter()``): an emulated accelerator's
    op time (``StagePeer(compute_seconds=...)``)."""
    left = seconds - (time.perf_counter() - t0)
    if seconds > 0 and left > 0:
        time.sleep(left)


class _Sender:
    """The sender thread: waits for each encoded output on the device, serialises it and hands
    it to the link (whose upload runs on the event loop). FIFO; never blocks the caller."""

    def __init__(self, link: ActivationLink, timeout: float, name: str):
        self.link, self.timeout = link, timeout
        self._q: queue.Queue[Any] = queue.Queue()
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def put(self, packed: Any, kind: str, g: int, dest: tuple[str, str]) -> None:
        # the epoch now: an output queued before a break must not go out as the new epoch's
        self._q.put((packed, kind, g, dest, self.link.epoch))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                packed, kind, g, (peer, address), epoch = item
                del item
                if epoch < self.link.epoch:
                    continue  # computed before a break: the replay sends its own
                try:
                    data = encode_message(packed)
                except Exception as e:  # noqa: BLE001 - NonFiniteError, a device error: the pipeline stops
                    self.link.fail(PipelineBroken(f"cannot send {kind} of micro-batch {g}: {e}"))
                    continue
                del packed
                self.link.send(address, peer, kind, g, data, self.timeout, epoch=epoch)
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
