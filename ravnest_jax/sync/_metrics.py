"""What rounds cost and produced: :class:`RoundMetrics` per round, and the totals a peer reports
(:func:`summarize`; under ``ravnest-jax local`` also to the launcher's pipe)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class RoundMetrics:
    """What one outer round cost and produced on this peer.

    Attributes:
      round: exchange number on this peer's schedule (0, 1, ...; one per fragment round).
      fragment: the fragment synchronised (0 without fragments).
      step: inner step at the round boundary.
      merged_at_step: inner step at which the result was merged (``step + overlap``).
      ok: the round produced a result that was merged.
      swarm_round: the swarm's round number (``-1`` if unknown).
      group_size: peers that contributed to the mean.
      bytes_sent: body bytes this peer sent in the exchange.
      bytes_received: body bytes it received.
      payload_bytes: encoded size of this peer's pseudo-gradient (bytes).
      codec_ratio: ``payload_bytes`` / float32 size of the pseudo-gradient.
      exchange_seconds: wall time from when this peer's contribution reached the host (the device
        had run the boundary step) until the result was in (seconds).
      overlap_steps: tau of this round: inner steps from its boundary to its merge (chosen per
        round with ``overlap_steps="auto"``).
      stall_seconds: time the device sat idle waiting for this round (seconds): the training
        loop's wait after the steps it had dispatched were run (the accelerator runs those meanwhile).
      compute_utilisation: ``1 - stall / wall`` over the inner steps since the previous round.
      result_digest: digest of the averaged pseudo-gradient (equal on every contributor).
      state_digest: digest of the global params and outer state after the merge (equal on every
        live peer when they agree).
      error: why the round failed, else ``None``.
      needed_overlap_steps: with ``overlap_steps="auto"``: the tau this exchange would have
        needed to hide completely (``ceil(1.25 * t_x / t_s)``, uncapped; above ``overlap_steps``
        when the staleness budget's cap binds), else 0.
      clipped: with the clipped mean (``rj.AllReduce``'s default aggregator): contributor -> the
        factor (< 1) its pseudo-gradient was scaled by (its norm exceeded the round's bound).
    """

    round: int
    fragment: int
    step: int
    merged_at_step: int
    ok: bool
    swarm_round: int
    group_size: int
    bytes_sent: int
    bytes_received: int
    payload_bytes: int
    codec_ratio: float
    exchange_seconds: float
    stall_seconds: float
    compute_utilisation: float
    result_digest: str
    state_digest: str
    error: str | None = None
    overlap_steps: int = 0
    needed_overlap_steps: int = 0
    clipped: dict[str, float] = dataclasses.field(default_factory=dict)


def round_metrics(
    seq: int,
    fragment: int,
    step: int,
    merged_at_step: int,
    exchange_seconds: float,
    stall_seconds: float,
    utilisation: float,
    *,
    record: Any = None,
    payload_bytes: int = 0,
    float_bytes: int = 0,
    state_digest: str = "",
    error: str | None = None,
    needed_overlap_steps: int = 0,
) -> RoundMetrics:
    """The :class:`RoundMetrics` of a merged round (``error`` None, with the swarm's ``record``)
    or of a failed one (``error`` set: no bytes, no digests, ``codec_ratio`` NaN)."""
    ok = error is None
    rec = record if ok else None  # None also on the processes other than 0 of a peer
    return RoundMetrics(
        round=seq,
        fragment=fragment,
        step=step,
        merged_at_step=merged_at_step,
        ok=ok,
        swarm_round=int(rec.round) if rec is not None else -1,
        group_size=len(rec.contributors) if rec is not None else 0,
        bytes_sent=int(rec.bytes_sent) if rec is not None else 0,
        bytes_received=int(rec.bytes_received) if rec is not None else 0,
        payload_bytes=payload_bytes if ok else 0,
        codec_ratio=payload_bytes / max(float_bytes, 1) if ok else math.nan,
        exchange_seconds=exchange_seconds,
        stall_seconds=stall_seconds,
        compute_utilisation=utilisation,
        result_digest=str(rec.digest) if rec is not None else "",
        state_digest=state_digest if ok else "",
        error=error,
        overlap_steps=merged_at_step - step,
        needed_overlap_steps=needed_overlap_steps,
        clipped=dict(rec.clipped) if rec is not None else {},
    )


METRICS_KEPT = 10_000  # rounds whose RoundMetrics a driver keeps (about 0.85 KB each)


@dataclasses.dataclass
class Totals:
    """Running totals over every round of a driver, what :func:`summarize` reports: kept apart
    from the per-round list, which keeps the last :data:`METRICS_KEPT` rounds only (a peer's
    memory must not grow with the rounds it has run).

    Attributes:
      ok_rounds: merged rounds.
      bytes_sent, bytes_received: body bytes over all rounds.
      overlap_steps: tau summed over the merged rounds (steps).
      utilisation: compute utilisation summed over the merged rounds.
      clipped_rounds: merged rounds in which some contribution was clipped.
      max_needed_overlap_steps: the largest ``needed_overlap_steps`` of a merged round.
      last_ok: the last merged round's metrics, or None.
    """

    ok_rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    overlap_steps: int = 0
    utilisation: float = 0.0
    clipped_rounds: int = 0
    max_needed_overlap_steps: int = 0
    last_ok: RoundMetrics | None = None

    def add(self, m: RoundMetrics, metrics: list[RoundMetrics]) -> None:
        """Counts round ``m`` and appends it to ``metrics``, dropping its oldest entries beyond
        :data:`METRICS_KEPT`."""
        self.bytes_sent += m.bytes_sent
        self.bytes_received += m.bytes_received
        if m.ok:
            self.ok_rounds += 1
            self.overlap_steps += m.overlap_steps
            self.utilisation += m.compute_utilisation
            self.clipped_rounds += bool(m.clipped)
            self.max_needed_overlap_steps = max(self.max_needed_overlap_steps, m.needed_overlap_steps)
            self.last_ok = m
        metrics.append(m)
        if len(metrics) > METRICS_KEPT:
            del metrics[: len(metrics) - METRICS_KEPT]


def summarize(totals: Totals, failed_rounds: int, resyncs: int, stall_seconds: float) -> dict:
    """Totals over every round: rounds, failures, resyncs, bytes, stall seconds, mean utilisation,
    mean overlap tau (steps). Means over no round are ``None`` (the dict is strict JSON)."""
    n = totals.ok_rounds
    return {
        "rounds": n,
        "mean_overlap_steps": totals.overlap_steps / n if n else None,
        "failed_rounds": failed_rounds,
        "resyncs": resyncs,
        "bytes_sent": int(totals.bytes_sent),
        "bytes_received": int(totals.bytes_received),
        "stall_seconds": stall_seconds,
        "compute_utilisation": totals.utilisation / n if n else None,
        "last_state_digest": totals.last_ok.state_digest if totals.last_ok is not None else "",
        "clipped_rounds": totals.clipped_rounds,
        "max_needed_overlap_steps": totals.max_needed_overlap_steps,
    }


def report_summary(summary: dict) -> None:
    """Under ``ravnest-jax local``: one JSON line of :meth:`OuterSync.summary` to the launcher's
    pipe (``$RAVNEST_SUMMARY_FD``). Elsewhere nothing."""
    fd = os.environ.get("RAVNEST_SUMMARY_FD")
    if not fd:
        return
    with contextlib.suppress(OSError, ValueError, TypeError):  # not our launcher's pipe
        os.write(int(fd), (json.dumps(summary) + "\n").encode())
