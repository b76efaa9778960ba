"""Whole-swarm restart: the peers of a run agree on the newest checkpoint step they all have."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

from ..swarm import SwarmError

log = logging.getLogger("ravnest_jax.sync")

INFO_KEY = "checkpoint_steps"
MAX_STEPS_PUBLISHED = 64  # newest steps a peer publishes (keeps the rendezvous info small)


def _alive_since(peers: list, since: float, me: str) -> list:
    """Peers whose last heartbeat (or join) came after ``since`` (time.monotonic()), and this
    one. An entry left by a dead process (not yet evicted) never qualifies: it beats no more."""
    now = time.monotonic()
    return [p for p in peers if p.peer_id == me or now - p.seconds_since_heartbeat > since]


def _alive_polls(swarm: Any, timeout: float, poll_seconds: float) -> Iterator[list]:
    """Every ``poll_seconds`` until ``timeout`` seconds have passed: the run's peers alive since
    this began (see :func:`_alive_since`); ``[]`` while the rendezvous cannot be reached."""
    t0 = time.monotonic()
    while True:
        try:
            peers = _alive_since(swarm.peers(), t0, swarm.peer_id)
        except SwarmError as e:
            log.info("waiting for the rendezvous: %r", e)
            peers = []
        yield peers
        if time.monotonic() - t0 >= timeout:
            return
        time.sleep(poll_seconds)


def _check_num_peers(num_peers: Any) -> None:
    if not isinstance(num_peers, int) or num_peers < 1:
        raise ValueError(f"num_peers must be an int >= 1, got {num_peers!r}")


def running_peers(swarm: Any, *, wait_seconds: float = 3.0, poll_seconds: float = 0.2) -> list:
    """The other peers of the run that are training: they finished a round in their current
    process and are alive (they heartbeat after this call begins).

    A peer that (re)starts uses it to choose between joining a running swarm (download the
    state, ``Swarm.fetch_state``) and starting or restarting one (its own checkpoint, or
    :func:`common_checkpoint_step`). The rendezvous keeps the entry of a killed process until
    its eviction timeout; such an entry is not counted, because it beats no more. Returns at
    once when no other peer has finished a round; otherwise within ``wait_seconds`` (make it
    longer than the heartbeat interval).

    Args:
      swarm: a started ``rj.Swarm``.
      wait_seconds: how long to wait for a heartbeat of a peer that has finished rounds, seconds.
      poll_seconds: interval between asks to the rendezvous, seconds.

    Returns:
      A list of ``rj.PeerInfo``, empty when the swarm is not running.

    Raises:
      SwarmError: the rendezvous cannot be reached.
    """
    t0 = time.monotonic()
    while True:
        peers = [p for p in swarm.peers() if p.peer_id != swarm.peer_id and p.last_round >= 0]
        alive = _alive_since(peers, t0, swarm.peer_id)
        if alive or not peers or time.monotonic() - t0 >= wait_seconds:
            return alive
        time.sleep(poll_seconds)


def common_checkpoint_step(
    swarm: Any, steps: Iterable[int], *, num_peers: int, timeout: float = 300.0, poll_seconds: float = 0.2
) -> int | None:
    """The newest checkpoint step that every peer of a restarting swarm has.

    When a whole swarm stops (a crash, a reboot, Ctrl+C on every machine) the peers' checkpoint
    directories need not end at the same step: a peer killed early misses the later rounds.
    Restarted, they must all continue from one round, or their global params differ. Each peer
    calls this with the steps its ``rj.Checkpointer`` holds (``ckpt.all_steps()``); it publishes
    them through the rendezvous (``Swarm.set_info``), waits until ``num_peers`` live peers have
    published theirs, and returns the newest step in all of them. Every peer computes the same
    answer from the same lists, so each restores that step (``ckpt.restore(step=...)``) and
    loads it with ``OuterSync.load_state_dict(..., round_mapping=False)``: the swarm's round
    numbers are learned afresh from the first round. Only peers that heartbeat after the call
    begins count (so it takes at least one heartbeat interval): the rendezvous may still list a
    killed process, with the steps it had.

    Start exactly ``num_peers`` peers for the restart: a peer that registers later joins a
    running swarm and downloads the state instead (``Swarm.fetch_state``).

    Args:
      swarm: a started ``rj.Swarm``.
      steps: this peer's checkpoint steps (ints >= 0; only the newest 64 are published).
      num_peers: how many peers restart together (int >= 1), this one included.
      timeout: seconds to wait for the others to register and publish.
      poll_seconds: interval between asks to the rendezvous, seconds.

    Returns:
      The step, or ``None`` when no peer has a checkpoint (a fresh start) or when another peer
      of the run has already finished a round in this rendezvous' lifetime (the swarm is running:
      download its state instead).

    Raises:
      ValueError: ``num_peers`` < 1, or a step is not a non-negative int.
      TimeoutError: fewer than ``num_peers`` peers published their steps within ``timeout``.
      SwarmError: some peers have checkpoints and others have none, or there is no step common
        to all (the message lists every peer's steps); restore by hand, or delete checkpoints
        newer than a common step.
    """
    _check_num_peers(num_peers)
    mine = sorted({int(s) for s in steps})
    if any(s < 0 for s in mine):
        raise ValueError(f"steps must be non-negative ints, got {mine}")
    swarm.set_info({**swarm.info, INFO_KEY: mine[-MAX_STEPS_PUBLISHED:]})
    # only peers seen alive since this call began: the entry of a killed process holds the
    # steps of that process, which may be gone
    for peers in _alive_polls(swarm, timeout, poll_seconds):
        if any(p.last_round >= 0 for p in peers if p.peer_id != swarm.peer_id):
            return None
        published = {p.peer_id: p.info.get(INFO_KEY) for p in peers}
        if len(peers) >= num_peers and all(isinstance(v, list) for v in published.values()):
            break
    else:
        raise TimeoutError(
            f"fewer than {num_peers} peers published their checkpoint steps after {timeout} s: {published}"
        )
    lists = {pid: {int(s) for s in v} for pid, v in published.items()}
    if not any(lists.values()):
        return None
    if not all(lists.values()):
        raise SwarmError(
            "a whole-swarm restart needs a checkpoint on every peer; these have none: "
            f"{sorted(p for p, v in lists.items() if not v)} (steps per peer: "
            f"{ {p: sorted(v) for p, v in lists.items()} })"
        )
    common = set.intersection(*lists.values())
    if not common:
        raise SwarmError(
            f"the peers have no checkpoint step in common; steps per peer: { {p: sorted(v) for p, v in lists.items()} }"
        )
    step = max(common)
    log.info("whole-swarm restart: %d peers agree on checkpoint step %d", len(lists), step)
    return step


def wait_for_info(
    swarm: Any, key: str, value: Any, *, num_peers: int, timeout: float = 300.0, poll_seconds: float = 0.2
) -> None:
    """A barrier through the rendezvous: publishes ``info[key] = value`` and blocks until
    ``num_peers`` live peers (this one included) publish the same value.

    After a whole-swarm restart every peer restores the agreed checkpoint, which takes each a
    different time; passing this barrier before the first inner step keeps a slow restore from
    making that peer late for the first round (``Timeouts.part``).

    Args:
      swarm: a started ``rj.Swarm``.
      key: the info key (str).
      value: a JSON value every peer publishes alike (for example the agreed step).
      num_peers: how many peers to wait for (int >= 1).
      timeout: seconds.
      poll_seconds: interval between asks to the rendezvous, seconds.

    Raises:
      ValueError: ``num_peers`` < 1.
      TimeoutError: fewer than ``num_peers`` peers published ``value`` within ``timeout``.
    """
    _check_num_peers(num_peers)
    swarm.set_info({**swarm.info, key: value})
    for peers in _alive_polls(swarm, timeout, poll_seconds):
        if sum(1 for p in peers if p.info.get(key) == value) >= num_peers:
            return
    raise TimeoutError(f"fewer than {num_peers} peers published {key}={value!r} after {timeout} s")
