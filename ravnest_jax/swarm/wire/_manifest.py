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

Here: the peer's side (:class:`ManifestDeclaration`) and what both sides share (the check, the
refusal line). The rendezvous' record of each run's manifest and the differences it names are
its run's (``rendezvous/_rounds.py``, ``_Run.admit``).
"""

from __future__ import annotations

import json
from typing import Any

from ._http import ask_once
from ._types import ManifestMismatch

#: the swarm protocol's version: peers of another version are refused at the door
PROTOCOL_VERSION = 1
#: a manifest is a JSON object of at most this many bytes
MAX_MANIFEST_BYTES = 16384


def swarm_settings(swarm: Any) -> dict[str, Any]:
    """The part of the manifest a swarm knows by itself: the protocol version, the codec value
    (name and options), the mean codec and its error feedback, the algorithm (the ring with its
    segment size) and the aggregator (with its knob)."""
    algorithm, aggregator = swarm.algorithm.manifest()
    return {"protocol": PROTOCOL_VERSION, **swarm.codec.manifest(), "algorithm": algorithm, "aggregator": aggregator}


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
          ValueError: ``manifest`` is not a JSON object of at most 16 KiB, or ``init`` not a str.
          SwarmError: the rendezvous cannot be reached.
        """
        full = check_manifest({**swarm_settings(self), **check_manifest(manifest)})
        if init is not None and not isinstance(init, str):
            raise ValueError(f"init must be a digest string, got {type(init).__name__}")
        self._manifest, ask = full, {"peer_id": self.peer_id, "manifest": full, **({"init": init} if init else {})}
        started = self._loop is not None
        if started:
            reply = self._ask("POST", "/manifest", ask, timeout)
        else:  # a check only
            t, tr = self.timeouts.connect * 2 if timeout is None else timeout, self.transport
            ask["check"] = True
            reply = ask_once(
                self.rendezvous_url, self.run_id, tr.token, self.peer_id, "POST", "/manifest", ask, t, tr.client_ssl
            )
        reply = reply if isinstance(reply, dict) else {}
        if reply.get("refused"):
            raise ManifestMismatch(refusal_line(reply["refused"]), reply["refused"])
        return {"init": reply.get("init"), "init_from": reply.get("init_from")} if started else None

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
