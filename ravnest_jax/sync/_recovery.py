"""What a round that failed on this peer costs: nothing, a resync, or a new round mapping."""

from __future__ import annotations

import logging
from typing import Any

from ravnest_jax.optim import DiLoCoState
from ravnest_jax.swarm import RoundFailed

from ._pipeline import Pending

log = logging.getLogger("ravnest_jax.sync")


def needs_resync(swarm: Any, exc: BaseException | None) -> bool:
    """After a failed round: False only when the rendezvous says the round failed for everyone
    (then nobody applied it and the local state is still the swarm's)."""
    if not isinstance(exc, RoundFailed) or exc.record.round < 0:
        return True  # this peer diverged (compress.NonFiniteError), or another error of its own
    try:
        return swarm.round_outcome(exc.record.round) != "failed"
    except Exception:  # noqa: BLE001 - rendezvous unreachable: try to resync
        return True


def after_failure(sync: Any, p: Pending, exc: BaseException | None, params: Any, state: DiLoCoState) -> tuple:
    """A round failed on this peer (``sync``: its ``OuterSync``). If the other peers applied it
    (or this peer diverged), download the current state from a live peer, serving this peer's
    own state meanwhile so that peers waiting on each other never deadlock. Without a live peer,
    carry on alone: a delayed round is simply skipped (the next pseudo-gradient covers its
    steps); an eager round, whose speculative anchor the params already stand on, is applied
    with the local pseudo-gradient (a swarm of one). Returns ``(params, state)``."""
    data = None
    if isinstance(exc, RoundFailed) and exc.record.all_abstained:
        # Every member of the round missed its own expected round (each abstained): no peer
        # is ahead to download from, and downloading from each other only swaps the states
        # (two peers restarted from stale checkpoints did so forever). Learn the round
        # mapping anew instead; if the states differ, the state digests of the next round
        # name the minority, which then resyncs from the majority.
        log.warning(
            "round %d: every member of the round the swarm ran missed its own (this peer resumed from a "
            "state older than the swarm's last round, and no live peer holds a newer one): continuing from "
            "the local state; the round mapping is learned anew",
            p.seq,
        )
        sync._schedule.swarm_base = None
        sync._last_state = None
    elif sync._serving and needs_resync(sync.swarm, exc):
        try:
            serve = lambda: sync._serve_state(params, state)  # noqa: E731
            data = sync._server.fetch_past(sync.swarm.fetch_state, serve, p.seq)
        except Exception as e:  # noqa: BLE001 - no live peer: keep training alone
            log.warning("resync failed: %s; continuing with the local state", e)
        else:
            if data is None and sync._schedule.swarm_base is not None:
                # no other live peer: nobody to be inconsistent with. The rendezvous may
                # number rounds past this peer's saved mapping (a peer resumed alone from a
                # checkpoint); learn the mapping afresh instead of missing every round
                log.info("no live peer to resync from: the round mapping is learned anew")
                sync._schedule.swarm_base = None
    if data:
        params, state = sync.load_state_bytes(data, params, state)
        sync.resyncs += 1
        log.info("resynced from a live peer at step %d", sync.step)
        return params, state
    if p.spec_params is not None:  # eager, alone: the own pseudo-gradient is the mean
        params, state, _ = sync._rounds.merge(p, params, state, None)
    return params, state


def taken_again(sync: Any, params: Any, state: DiLoCoState) -> bytes | None:
    """After a state download (a joiner, or a resync), on the first step, once this peer told
    the swarm it is ready (``sync._ready``): when a round this peer's schedule expects was
    created without it meanwhile (it was on standby while it compiled its first step or
    downloaded), the state past that round, downloaded now: before this peer's first round,
    instead of a missed round and a resync. ``None``: nothing ran without it (or nothing to
    ask: no round mapping yet, no rendezvous status, a peer over several processes)."""
    base = sync._schedule.swarm_base
    if base is None or not sync._serving:
        return None
    expected, me = base[0] + (sync._schedule.rounds_started - base[1]), sync.swarm.peer_id
    try:
        if sync._ready is not None:
            sync._ready.result(timeout=10.0)  # the rendezvous has this peer out of standby
        without = [
            int(r["round"])
            for r in sync.swarm.status().get("rounds", [])
            if int(r["round"]) >= expected and r.get("outcome") != "failed" and me not in r.get("group", ())
        ]
    except Exception as e:  # noqa: BLE001 - only spares a missed round; the round itself tells
        log.info("could not ask the rendezvous for its rounds: %r", e)
        return None
    if not without:
        return None
    log.info("round %d runs without this peer (it was not ready yet): downloading the state again", max(without))
    seq = base[1] + (max(without) - base[0])  # the exchange of that round in this peer's mapping
    try:
        return sync._server.fetch_past(sync.swarm.fetch_state, lambda: sync._serve_state(params, state), seq)
    except Exception as e:  # noqa: BLE001 - the round's miss then resyncs it
        log.info("could not download the state again: %s", e)
        return None
