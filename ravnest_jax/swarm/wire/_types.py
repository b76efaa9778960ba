"""Public value types of the swarm: timeouts, result records, errors, and tree flattening."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class TLS:
    """HTTPS between the peers of a run: ``rj.Swarm(..., tls=rj.TLS(server=ctx, client=ca_ctx))``.

    Attributes:
      server: the ``ssl.SSLContext`` this peer serves HTTPS with (its certificate and key);
        then it advertises an ``https://`` URL. ``None``: plain HTTP.
      client: aiohttp's ``ssl=`` for this peer's outgoing requests: an ``ssl.SSLContext`` that
        trusts the other peers' certificates (a private CA), ``False`` to skip verification
        (testing only), or ``None`` for aiohttp's defaults (the system's CAs).
    """

    server: Any = None
    client: Any = None


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Deadlines of the swarm, all in seconds.

    Attributes:
      connect: to open a TCP connection to a peer or the rendezvous.
      part: one data phase of a round: the reduce-scatter (sending and receiving parts) and,
        separately, the all-gather. A peer that has not delivered by then is left out. It must
        also cover how much later than the first peer the slowest healthy peer reaches a round.
      grace: extra time the rendezvous waits for votes after a phase deadline (clock jitter).
      round: the whole round, every attempt included; past it the round fails for this peer.
      heartbeat: interval between heartbeats to the rendezvous.
      eviction: a peer whose last heartbeat is older than this is dropped from the membership.
      max_attempts: how often a round is retried among the survivors before it fails.
    """

    connect: float = 5.0
    part: float = 30.0
    grace: float = 1.0
    round: float = 180.0
    heartbeat: float = 2.0
    eviction: float = 10.0
    max_attempts: int = 3

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not v > 0:
                raise ValueError(f"Timeouts.{f.name} must be > 0, got {v!r}")
        if self.eviction <= self.heartbeat:
            raise ValueError("Timeouts.eviction must be longer than Timeouts.heartbeat")


@dataclasses.dataclass(frozen=True)
class PeerInfo:
    """One live peer of a run, as the rendezvous sees it.

    Attributes:
      peer_id: the peer's id (the order of peers in a round is the sorted order of ids).
      address: the advertised base URL, e.g. ``"http://10.0.0.5:7000"``.
      last_round: the last round the peer finished (``-1`` before its first).
      seconds_since_heartbeat: age of its last heartbeat, seconds.
      info: the small JSON object the peer publishes (``Swarm.set_info``),
        for example the steps of its checkpoints; ``{}`` if none.
      relayed: the peer is client-only: it is reached through the rendezvous' relay.
    """

    peer_id: str
    address: str
    last_round: int
    seconds_since_heartbeat: float
    info: dict = dataclasses.field(default_factory=dict)
    relayed: bool = False

    @classmethod
    def of(cls, p: dict[str, Any]) -> PeerInfo:
        """From one entry of the rendezvous' membership answer."""
        return cls(
            p["peer_id"],
            p["address"],
            p["last_round"],
            p["seconds_since_heartbeat"],
            dict(p.get("info") or {}),
            bool(p.get("relayed")),
        )


@dataclasses.dataclass(frozen=True)
class RoundRecord:
    """What happened in one all-reduce, on this peer.

    Attributes:
      round: the round number (``-1`` if none was assigned).
      ok: whether a result was produced.
      attempts: how many attempts the round took (a retry follows a peer lost mid-round).
      group: sorted peer ids of the last attempt's group.
      contributors: sorted peer ids whose contributions are in the result (identical on every
        peer that got a result).
      total_weight: sum of the contributors' weights (float32 arithmetic).
      bytes_sent: body bytes this peer sent in the round.
      bytes_received: body bytes this peer received in the round.
      seconds: wall time of the round on this peer.
      digest: blake2b-128 hex digest over the body digest (BLAKE3) of every encoded result part, in part
        order: equal digests mean bit-identical results (empty when not ok).
      codec: the codec used on the wire.
      algorithm: ``"butterfly"`` or ``"ring"``.
      error: why the round failed, or ``None``.
      diverged: peers whose reported global state (``all_reduce_async(..., state=...)``)
        differed from the swarm's in this round: their contributions were left out
        (butterfly) and their own round failed, so that they download the state again.
      clipped: the clipped mean (``AllReduce.aggregator``): contributor -> the factor (< 1) its contribution
        was scaled by (its norm was over the bound); empty when nobody was clipped.
      all_abstained: a failed round that this peer missed (it asked for an earlier one) and in
        which every member abstained (each missed its own: no peer is ahead of the others, so
        there is nobody to download a newer state from).
    """

    round: int
    ok: bool
    attempts: int
    group: tuple[str, ...]
    contributors: tuple[str, ...]
    total_weight: float
    bytes_sent: int
    bytes_received: int
    seconds: float
    digest: str
    codec: str
    algorithm: str = "butterfly"
    error: str | None = None
    diverged: tuple[str, ...] = ()
    clipped: dict[str, float] = dataclasses.field(default_factory=dict)
    all_abstained: bool = False


class RoundFailed(RuntimeError):
    """A round could not be completed on this peer; ``.record`` holds the details (ok=False)."""

    def __init__(self, record: RoundRecord):
        # round -1: it failed before this peer learnt its swarm round (the error names it)
        super().__init__(f"round {record.round} failed: {record.error}" if record.round >= 0 else record.error)
        self.record = record


class SwarmError(RuntimeError):
    """The swarm could not start or talk to the rendezvous."""


class ManifestMismatch(SwarmError):
    """The rendezvous refused this peer: its run manifest (the settings every peer of a run
    shares, :meth:`Swarm.declare_manifest`) differs from the run's. The message is one line
    naming every differing setting with both values; ``differences`` lists them."""

    def __init__(self, message: str, differences: list[str]):
        super().__init__(message)
        self.differences = list(differences)


def result_digest(part_sha256s: list[str]) -> str:
    """Digest of a round's result: blake2b-128 over the body digest of each encoded result part.

    Every peer decodes the same encoded parts with the same code, so equal digests mean
    bit-identical float32 results (and hashing 32-byte hashes is free, unlike the payload).
    """
    return hashlib.blake2b("".join(part_sha256s).encode(), digest_size=16).hexdigest()


# --- pytrees without jax: nested dict / list / tuple / namedtuple of arrays ------------------


def flatten(tree: Any) -> tuple[list[str], list[np.ndarray], Callable[[list[np.ndarray]], Any]]:
    """Flatten a nested dict/list/tuple of float32 arrays.

    Returns ``(names, leaves, unflatten)``; dict keys are visited in sorted order.

    Raises:
      TypeError: a leaf is not a float32 array (or a float32 scalar).
    """
    names: list[str] = []
    leaves: list[np.ndarray] = []

    def rec(node: Any, path: str) -> Callable[[list[np.ndarray]], Any]:
        if isinstance(node, dict):
            keys = sorted(node, key=str)
            subs = [rec(node[k], f"{path}/{k}") for k in keys]  # noqa: F821 - del rec below
            cls = type(node)
            return lambda it: cls((k, s(it)) for k, s in zip(keys, subs))
        if isinstance(node, (list, tuple)):
            cls = type(node)
            if hasattr(node, "_fields"):
                subs = [rec(v, f"{path}/{f}") for f, v in zip(node._fields, node)]  # noqa: F821
                return lambda it: cls(*[s(it) for s in subs])
            subs = [rec(v, f"{path}/{i}") for i, v in enumerate(node)]  # noqa: F821
            return lambda it: cls(s(it) for s in subs)
        arr = np.asarray(node)
        if arr.dtype != np.float32:
            raise TypeError(f"leaf {path or '/'} has dtype {arr.dtype}; the swarm takes float32")
        idx = len(leaves)
        names.append(path or "/")
        leaves.append(arr)
        shape = arr.shape
        return lambda it: it[idx].reshape(shape)

    build = rec(tree, "")
    del rec  # break the cycle rec -> its closure cell -> rec, which held ``leaves`` until a GC pass
    return names, leaves, build


def check_info(info: Any) -> None:
    """Raises ValueError unless ``info`` is a dict that serialises to at most 4096 bytes of JSON."""
    try:
        size = len(json.dumps(info, separators=(",", ":"))) if isinstance(info, dict) else -1
    except (TypeError, ValueError) as e:
        raise ValueError(f"info must be JSON-serialisable: {e}") from None
    if not 0 <= size <= 4096:
        raise ValueError("info must be a dict of at most 4096 bytes as JSON")
