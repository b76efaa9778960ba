"""Placement: which peer holds which stage of which cluster, and which peers stand by, from what
the peers report (device memory, link bandwidth). Pure Python; every peer computes it from the
same reports (the rendezvous' membership once every expected peer joined), so all agree without
a coordinator.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["Placement", "device_memory", "place"]

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Placement:
    """The outcome of :func:`place`.

    Attributes:
      slots: ``{peer id: (cluster, stage)}`` of the peers that train.
      standbys: ``{peer id: stage}``: peers that wait to take over a stage of any cluster.
      clusters: the number of clusters (replicas of the model).
    """

    slots: dict[str, tuple[int, int]]
    standbys: dict[str, int]
    clusters: int

    def of(self, peer: str) -> tuple[str, int | None, int | None]:
        """``("active", cluster, stage)``, ``("standby", None, stage)`` or ``("none", None,
        None)`` for ``peer``."""
        if peer in self.slots:
            c, s = self.slots[peer]
            return "active", c, s
        if peer in self.standbys:
            return "standby", None, self.standbys[peer]
        return "none", None, None


def place(
    reports: Sequence[dict[str, Any]],
    need_bytes: Sequence[int],
    *,
    clusters: int | None = None,
    standbys: int | None = None,
) -> Placement:
    """Assigns stages to peers.

    Args:
      reports: one dict per peer: ``{"peer": id, "memory": bytes the stage may use: its
        allocator's pool (:func:`device_memory`; None: unknown, taken as enough), "mbit": link
        bandwidth in Mbit/s (None: unknown)}``.
      need_bytes: device bytes each stage needs: base at its measured width, adapters,
        optimizer and outer state, activations in flight and a block's working set
        (``plan_stage_memory``; a ``StagePeer`` without them counts the static part,
        ``stage_need_bytes``).
      clusters: clusters to form (default: as many as the peers allow, keeping ``standbys``).
      standbys: peers to keep as standbys (default: every peer no cluster needs).

    Rule: clusters are filled one at a time. Within a cluster the middle stages (they send
    and receive in both directions) are placed first, on the peers with the most bandwidth
    among those with the memory; then the end stages, largest need first. Among equals a stage
    goes to the peer with the least memory that holds it (best fit: the larger devices stay
    free for the larger stages and for standby duty); ties by peer id. The peers left over
    stand by, each for the stage with the fewest standbys that it can hold (the largest such
    stage first).

    Raises:
      ValueError: fewer peers than one cluster needs, a stage no peer can hold, more clusters or
        standbys than there are peers.
    """
    S = len(need_bytes)
    peers = sorted(reports, key=lambda r: str(r["peer"]))
    if len({r["peer"] for r in peers}) != len(peers):
        raise ValueError("two reports name the same peer")

    def mem(r: dict) -> float:
        m = r.get("memory")
        return float("inf") if m is None else float(m)

    def bw(r: dict) -> float:
        b = r.get("mbit")
        return 0.0 if b is None else float(b)

    for s, need in enumerate(need_bytes):
        if not any(mem(r) >= need for r in peers):
            most = max((mem(r) for r in peers), default=0.0)
            raise ValueError(
                f"no peer has memory for stage {s}: it needs {need / GIB:.2f} GiB, the largest pool a peer "
                f"reports is {most / GIB:.2f} GiB (JAX's allocator takes 0.75 of a card unless "
                "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 raises it)"
            )
    max_clusters = len(peers) // S
    if clusters is None:
        clusters = (len(peers) - (standbys or 0)) // S
    if clusters < 1 or clusters > max_clusters:
        raise ValueError(f"{len(peers)} peers cannot form {clusters} clusters of {S} stages")
    if standbys is not None and clusters * S + standbys > len(peers):
        raise ValueError(f"{len(peers)} peers cannot form {clusters} clusters of {S} stages and {standbys} standbys")
    free = list(peers)
    slots: dict[str, tuple[int, int]] = {}
    order = sorted(range(S), key=lambda s: (not 0 < s < S - 1, -need_bytes[s], s))
    for c in range(clusters):
        for s in order:
            middle = 0 < s < S - 1
            fits = [r for r in free if mem(r) >= need_bytes[s]]
            if not fits:
                raise ValueError(
                    f"no free peer has memory for stage {s} of cluster {c}: it needs {need_bytes[s] / GIB:.2f} GiB "
                    "(a peer's pool: XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 raises it)"
                )
            if middle:
                fits.sort(key=lambda r: (-bw(r), mem(r), str(r["peer"])))
            else:
                fits.sort(key=lambda r: (mem(r), -bw(r), str(r["peer"])))
            pick = fits[0]
            free.remove(pick)
            slots[str(pick["peer"])] = (c, s)
    spare: dict[str, int] = {}
    count = [0] * S
    for r in free[: standbys if standbys is not None else len(free)]:
        ok = [s for s in range(S) if mem(r) >= need_bytes[s]]
        if not ok:
            continue
        s = min(ok, key=lambda s: (count[s], -need_bytes[s], s))
        spare[str(r["peer"])] = s
        count[s] += 1
    return Placement(slots, spare, clusters)


def device_memory() -> int | None:
    """Bytes this process's first accelerator may allocate: ``bytes_limit`` of its memory stats
    (on a GPU the allocator's pool: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card, 0.75 by
    default), or the host's memory when the backend reports none (CPU); ``None`` when
    unknown."""
    try:
        import jax

        stats = jax.local_devices()[0].memory_stats() or {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
    except Exception:  # noqa: BLE001 - a backend without memory stats
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
