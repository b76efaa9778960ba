"""A standby stage peer's watch over the run: when a cluster's pipeline broke for a stage that
no live peer holds, the standby whose turn it is takes that stage over (``StagePeer``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from ravnest_jax.swarm import Timeouts

log = logging.getLogger("ravnest_jax.pipeline")


def wait_for_a_free_slot(peer: Any, deadline: float | None = None) -> bool:
    """A standby's watch: waits until a stage of some cluster has no live peer while the
    rest of that cluster went on to a newer epoch than the one at which every stage was last
    seen held (its pipeline broke and it waits for the stage: a cluster whose stages finish
    and leave one by one stays in its epoch), and takes the stage over if it is this peer's
    turn (lowest id among the standbys for that stage, else among all standbys). Returns
    False when no cluster trains any more (nothing to take over)."""
    hb = (peer._timeouts or Timeouts()).heartbeat
    clusters_expected = peer.placement.clusters if peer.placement is not None else 1
    seen_full = False  # every slot held at once: the placement is in force
    full_epoch: dict[int, int] = {}  # cluster -> the newest epoch at which all its stages were held
    while deadline is None or time.monotonic() < deadline:
        members = peer._members()
        active = [(p, i) for p, i in members if i.get("role") == "active" and not i.get("done")]
        by_cluster: dict[int, list[dict]] = {}
        for _, i in (x for x in members if x[1].get("role") == "active"):
            by_cluster.setdefault(int(i.get("cluster")), []).append(i)
        for c, infos in by_cluster.items():
            if {int(i.get("stage")) for i in infos} >= set(range(peer.num_stages)):
                full_epoch[c] = max([full_epoch.get(c, 0)] + [int(i.get("epoch", 0)) for i in infos])
        if not seen_full:
            seen_full = len(full_epoch) >= clusters_expected
            time.sleep(hb / 2)
            continue
        if not active:
            return False
        standbys = sorted(
            (p.peer_id, i.get("stage")) for p, i in members if i.get("role") == "standby" and not i.get("done")
        )
        for c in sorted({int(i.get("cluster")) for _, i in active}):
            infos = [i for _, i in active if int(i.get("cluster")) == c]
            if min(int(i.get("epoch", 0)) for i in infos) <= full_epoch.get(c, 0):
                continue  # the cluster did not break: a stage that is missing finished and left
            held = {int(i.get("stage")) for i in infos}
            for s in range(peer.num_stages):
                if s in held:
                    continue
                mine = [pid for pid, st in standbys if st == s] or [pid for pid, _ in standbys]
                if mine and mine[0] == peer.peer_id:
                    peer.role, peer.cluster, peer.stage = "active", c, s
                    peer._epoch = max(int(i.get("epoch", 0)) for i in infos)
                    peer._resume = peer.step = max(int(i.get("resume", 0)) for i in infos)
                    log.warning("%s: takes over stage %d of cluster %d (epoch %d)", peer.peer_id, s, c, peer._epoch)
                    return True
        time.sleep(hb / 2)
    return False
