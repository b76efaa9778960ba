"""What a peer tells the rendezvous about itself after each round (the status page's rows).

The driver writes a small ``"stats"`` object into the swarm's info (``Swarm.set_info``), which
the next heartbeat carries to the rendezvous; nothing of it runs in the jitted step.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from ._metrics import RoundMetrics

__all__ = ["PeerStats", "STATS_KEY"]

STATS_KEY = "stats"
MAX_SCALARS = 8
_ERROR_CHARS = 200


def _finite(x: Any) -> float | None:
    try:
        v = float(np.asarray(x))
    except (TypeError, ValueError):
        raise ValueError(f"a reported value must be a real scalar, got {x!r}") from None
    return v if math.isfinite(v) else None


class PeerStats:
    """The scalars a user reports (``OuterSync.report``) and the round totals, published as
    ``info["stats"]``: ``step``, ``round`` (the swarm's number of the last merged round, -1
    before one), ``rounds_ok``, ``rounds_failed``, ``resyncs``, ``utilisation`` (of the last
    round's window, 0..1), ``stall_s`` (seconds in total), ``bytes_sent`` / ``bytes_received``
    (totals), ``exchange_s`` (the last round's, seconds), ``link_mbit`` (the larger direction's
    bytes of the last round over its exchange seconds, Mbit/s: a lower bound of the link's
    rate, latency included), ``last_error`` (of the last failed round, 200 characters at most)
    and each reported scalar (its latest value; ``None`` when not finite), ``t`` (unix seconds).
    """

    def __init__(self) -> None:
        self.reported: dict[str, Any] = {}
        self.last_error: str | None = None

    def report(self, scalars: dict[str, Any]) -> None:
        for name, value in scalars.items():
            if name in self.reported and getattr(value, "shape", None) == ():  # the per-step case
                self.reported[name] = value
                continue
            if not isinstance(name, str) or not name.isidentifier() or len(name) > 32:
                raise ValueError(f"a reported name must be an identifier of at most 32 characters, got {name!r}")
            if name not in self.reported and len(self.reported) >= MAX_SCALARS:
                raise ValueError(f"at most {MAX_SCALARS} reported names; have {sorted(self.reported)}")
            if value is None:
                self.reported.pop(name, None)
                continue
            if not hasattr(value, "shape"):  # a device scalar is converted at the round, not now
                _finite(value)
            elif int(np.prod(value.shape)) != 1:
                raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
            self.reported[name] = value

    def publish(self, swarm: Any, m: RoundMetrics, sync: Any) -> None:
        """Writes the stats after round ``m`` into ``swarm``'s info (``set_info``; nothing
        without a swarm: the processes other than 0 of a peer). A device scalar reported since
        was computed steps ago: reading it here does not wait for the accelerator."""
        if swarm is None:
            return
        if not m.ok and m.error:
            self.last_error = m.error[:_ERROR_CHARS]
        summary = sync.summary()
        last = sync._totals.last_ok
        link = None
        if last is not None and last.exchange_seconds > 0:
            link = max(last.bytes_sent, last.bytes_received) * 8 / last.exchange_seconds / 1e6
        stats: dict[str, Any] = {
            "step": int(sync.step or 0),
            "round": last.swarm_round if last is not None else -1,
            "rounds_ok": summary["rounds"],
            "rounds_failed": summary["failed_rounds"],
            "resyncs": summary["resyncs"],
            "utilisation": round(float(m.compute_utilisation), 4),
            "stall_s": round(float(summary["stall_seconds"]), 3),
            "bytes_sent": summary["bytes_sent"],
            "bytes_received": summary["bytes_received"],
            "exchange_s": round(float(last.exchange_seconds), 3) if last is not None else None,
            "link_mbit": round(link, 2) if link is not None else None,
            "last_error": self.last_error,
            "t": round(time.time(), 3),
        }
        for name, value in self.reported.items():
            stats[name] = _finite(value)
        try:
            swarm.set_info({**swarm.info, STATS_KEY: stats})
        except ValueError:  # other info took the room: publish the totals without the scalars
            swarm.set_info({**swarm.info, STATS_KEY: {k: stats[k] for k in list(stats)[:13]}})
