"""The run manifest: the settings every peer of a run must share, checked at the door.

A peer declares its manifest (:meth:`Swarm.declare_manifest`; ``rj.join_or_resume`` and
``rj.OuterSync``'s first call do it) before it trains: the params' fingerprint (tree structure,
shapes, dtypes), the codec value and its options, the mean codec, the aggregator, the algorithm,
H, the fragments and their schedule, the overlap mode and the protocol version. The first peer of
a run fixes it at the rendezvous; a peer whose manifest differs is refused with one line naming
every differing setting with both values (``sync_every: this peer 20, the run 10``), before it
compiles, and the run is untouched: the refused peer is dropped from the membership at once and
its heartbeats do not register it again. When no live peer holds the run's manifest any more
(every earlier peer left or was evicted), the next one fixes a new one.

Without this check such a peer used to fail every round it was in (parts of another shape
refused, ~two part deadlines each), or, with another H, silently average one peer's step 10 with
another's step 20.
"""

from __future__ import annotations

import json
from typing import Any

from ._http import ask_once

#: the swarm protocol's version: peers of another version are refused at the door
PROTOCOL_VERSION = 1
#: a manifest is a JSON object of at most this many bytes
MAX_MANIFEST_BYTES = 16384


def swarm_settings(swarm: Any) -> dict[str, Any]:
    """The part of the manifest a swarm knows by itself: the protocol version, the codec value
    (name and options), the mean codec and its error feedback, the algorithm (the ring with its
    segment size) and the aggregator (with its knob)."""
    algorithm, aggregator = swarm.algorithm.manifest()
    return {
        "protocol": PROTOCOL_VERSION,
        **swarm.codec.manifest(),
        "algorithm": algorithm,
        "aggregator": aggregator,
    }


def check_manifest(manifest: Any) -> dict[str, Any]:
    """``manifest`` checked: a JSON object (str keys) of at most :data:`MAX_MANIFEST_BYTES`.

    Raises:
      ValueError: it is not one (one line).
    """
    if not isinstance(manifest, dict) or not all(isinstance(k, str) for k in manifest):
        raise ValueError(f"a manifest is a dict with str keys, got {type(manifest).__name__}")
    try:
        size = len(json.dumps(manifest, separators=(",", ":"), sort_keys=True))
    except (TypeError, ValueError) as e:
        raise ValueError(f"a manifest must serialise to JSON: {e}") from None
    if size > MAX_MANIFEST_BYTES:
        raise ValueError(f"a manifest is at most {MAX_MANIFEST_BYTES} bytes of JSON, got {size}")
    return manifest


def _show(value: Any) -> str:
    if isinstance(value, dict) and {"leaves", "elements", "sha256"} <= value.keys():
        return f"{value['leaves']} leaves, {value['elements']:,} elements (fingerprint {value['sha256']})"
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def differences(mine: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """Every setting where ``mine`` differs from ``run``, one ``"key: this peer A, the run B"``
    each, in key order (a setting one side lacks shows as ``none``)."""
    out = []
    for key in sorted(mine.keys() | run.keys()):
        a, b = mine.get(key), run.get(key)
        if a != b:
            out.append(f"{key}: this peer {_show(a)}, the run {_show(b)}")
    return out


_REFUSED = (
    "this peer's settings differ from the run's, so the rendezvous refused it (every peer of a run "
    "must use the same; change this peer's, or use another --run-id): "
)


def refusal_line(diffs: list[str]) -> str:
    """The one line a refused peer reports."""
    return _REFUSED + "; ".join(diffs)


def refusal_differences(line: str) -> list[str] | None:
    """The differences of a :func:`refusal_line` (None: ``line`` is not one)."""
    return line[len(_REFUSED) :].split("; ") if line.startswith(_REFUSED) else None


class Manifests:
    """The rendezvous' record of each run's manifest and of the peers that declared it.

    A peer's manifest is admitted when the run has none yet, when it equals the run's, or when
    no live peer other than itself holds the run's (``live``: the ids of the run's live peers);
    then it becomes (or stays) the run's.
    """

    def __init__(self) -> None:
        self._runs: dict[str, tuple[dict[str, Any], set[str]]] = {}
        self._init: dict[str, tuple[str, str]] = {}  # run -> (initial-state digest, its peer)

    def manifest(self, run_id: str) -> dict[str, Any] | None:
        """The run's manifest (None before any peer declared one)."""
        held = self._runs.get(run_id)
        return None if held is None else held[0]

    def refusal(self, run_id: str, peer_id: str, manifest: dict[str, Any], live: set[str]) -> list[str]:
        """The differences that refuse ``peer_id``'s ``manifest`` (see :func:`differences`);
        ``[]`` when it would be admitted. Changes nothing."""
        held = self._runs.get(run_id)
        if held is not None and held[0] != manifest and (held[1] & live) - {peer_id}:
            return differences(manifest, held[0])
        return []

    def admit(
        self, run_id: str, peer_id: str, manifest: dict[str, Any], live: set[str], init: str | None = None
    ) -> list[str]:
        """Admits ``peer_id``'s ``manifest`` (returns ``[]``; it is now the run's) or refuses it
        (returns the differences, see :func:`differences`). ``init``: the digest of the peer's
        initial state; the peer that fixes the run's manifest fixes the run's reference
        initial state (:meth:`initial`), kept while that peer lives."""
        diffs = self.refusal(run_id, peer_id, manifest, live)
        if diffs:
            return diffs
        held = self._runs.get(run_id)
        if held is None or held[0] != manifest:
            self._runs[run_id] = (manifest, {peer_id})
            self._init.pop(run_id, None)
        else:
            held[1].add(peer_id)
        ref = self._init.get(run_id)
        if isinstance(init, str) and (ref is None or ref[1] not in live):
            self._init[run_id] = (init, peer_id)
        return []

    def initial(self, run_id: str) -> dict[str, Any]:
        """The run's reference initial state: ``{"init": digest, "init_from": peer id}`` (both
        None before a peer declared one). A fresh peer whose initial state differs (another
        seed) takes that peer's state before its first round."""
        digest, peer = self._init.get(run_id, (None, None))
        return {"init": digest, "init_from": peer}


def manifest_request(swarm: Any, manifest: dict[str, Any], init: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(full manifest, request body)`` of :meth:`Swarm.declare_manifest`: ``manifest`` with
    the swarm's own settings (:func:`swarm_settings`).

    Raises:
      ValueError: not a JSON object of at most :data:`MAX_MANIFEST_BYTES`, or ``init`` not a str.
    """
    full = check_manifest({**swarm_settings(swarm), **check_manifest(manifest)})
    if init is not None and not isinstance(init, str):
        raise ValueError(f"init must be a digest string, got {type(init).__name__}")
    return full, {"peer_id": swarm.peer_id, "manifest": full, **({"init": init} if init else {})}


def manifest_answer(reply: Any) -> dict[str, Any]:
    """The run's reference initial state from a ``/manifest`` answer.

    Raises:
      ManifestMismatch: the answer refuses this peer.
    """
    from ._types import ManifestMismatch

    reply = reply if isinstance(reply, dict) else {}
    if reply.get("refused"):
        raise ManifestMismatch(refusal_line(reply["refused"]), reply["refused"])
    return {"init": reply.get("init"), "init_from": reply.get("init_from")}


class ManifestDeclaration:
    """The part of :class:`Swarm` that declares its run manifest and says hello (the
    membership's request body, which carries the manifest once declared)."""

    def declare_manifest(
        self, manifest: dict[str, Any], *, init: str | None = None, timeout: float | None = None
    ) -> dict[str, Any] | None:
        """Declares this peer's run manifest: ``manifest`` (the trainer's settings: the params'
        fingerprint, H, fragments, overlap; ``rj.OuterSync.declare_manifest`` makes it) with this
        swarm's own (protocol version, codec and options, mean codec, algorithm, aggregator).
        The first peer of a run fixes the run's; one that differs is refused and dropped at once
        (docs/swarm.md, "The run manifest"). Before :meth:`start` a check only (refused before
        compiling); the join then carries it (``start`` raises ManifestMismatch if the run fixed
        another meanwhile). ``init``: a digest of this peer's initial state. One rendezvous
        request (``timeout``, s).

        Returns: the run's reference initial state ``{"init", "init_from"}`` after start, None before.

        Raises:
          ManifestMismatch: refused; one line naming every differing setting with both values.
          ValueError: ``manifest`` is not a JSON object of at most 16 KiB.
          SwarmError: the rendezvous cannot be reached.
        """
        self._manifest, ask = manifest_request(self, manifest, init)
        if self._loop is not None:
            return manifest_answer(self._ask("POST", "/manifest", ask, timeout))
        t, tr = self.timeouts.connect * 2 if timeout is None else timeout, self.transport
        ask["check"] = True
        manifest_answer(
            ask_once(
                self.rendezvous_url, self.run_id, tr.token, self.peer_id, "POST", "/manifest", ask, t, tr.client_ssl
            )
        )

    def announce(self, timeout: float | None = None) -> None:
        """A heartbeat now, so that the rendezvous has this peer's :attr:`info` at once; blocks
        until it answered (``timeout``, seconds). Raises SwarmError when it did not."""
        self._ask("POST", "/heartbeat", self._hello(), timeout)

    # ------------------------------------------------------------------ lifecycle (caller thread)

    def _hello(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "address": self.transport.address,
            "last_round": self._rounds.last_round,
            "info": self._info,
            **({"manifest": self._manifest} if self._manifest is not None else {}),
        }
