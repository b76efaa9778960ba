"""The contract between the sync layer and the swarm: everything :class:`OuterSync`,
:func:`join_or_resume` and the whole-swarm restart use of a swarm, in one protocol.

``rj.Swarm`` implements all of it. A stand-in (a test double, another transport) needs
``codec`` and ``all_reduce_async`` for :class:`OuterSync`; the other members are optional there
(without ``serve_state`` the driver serves no state, without ``fetch_state`` it does not resync,
without ``ready`` a joiner's standby ends at its first round, without ``round_outcome`` every
failed round is followed by a resync attempt). :func:`join_or_resume` needs all of them.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Exchange(Protocol):
    """The minimum :class:`OuterSync` needs: a codec and an asynchronous weighted all-reduce."""

    codec: str

    def all_reduce_async(self, tree: Any, *, weight: float, **kw: Any) -> concurrent.futures.Future: ...


@runtime_checkable
class SwarmContract(Exchange, Protocol):
    """Everything the sync layer uses of a swarm (``rj.Swarm``; docs/architecture.md).

    Members (all called from the training thread unless noted):

    - ``codec``: the wire codec name; the device-side encode uses the same one.
    - ``all_reduce_async(tree, *, weight, round=None, state=None)``: a future of ``(mean_tree,
      record)``; raises ``RoundFailed`` (with ``.record``) through the future. ``round``: the
      swarm round this contribution belongs to; ``state``: ``(round, state digest)`` for the
      divergence check.
    - ``ready()``: this peer trains now (ends a joiner's standby); non-blocking.
    - ``serve_state(provider)``: ``provider()`` (called in a worker thread) returns the state
      bytes or a future of them, ``None`` for none; ``serve_state(None)`` stops serving.
    - ``fetch_state(timeout)``: the state bytes of a live peer, or ``None`` when nobody has one.
    - ``round_outcome(round)``: ``"ok"``, ``"failed"``, ``"running"`` or ``"unknown"``.
    - ``peers()``, ``wait_for_peers(n, timeout)``: the live peers (``PeerInfo``: id, address,
      last round, info).
    - ``info`` / ``set_info(dict)``: the small JSON object this peer publishes (checkpoint steps
      of a whole-swarm restart).
    - ``peer_id``: this peer's id; ``timeouts``: its deadlines (``Timeouts``).
    """

    peer_id: str
    timeouts: Any

    def ready(self) -> concurrent.futures.Future: ...

    def serve_state(self, provider: Callable[[], Any] | None) -> None: ...

    def fetch_state(self, timeout: float = 120.0) -> bytes | None: ...

    def round_outcome(self, round_: int) -> str: ...

    def peers(self) -> list: ...

    def wait_for_peers(self, n: int, timeout: float = 60.0) -> list: ...

    @property
    def info(self) -> dict[str, Any]: ...

    def set_info(self, info: dict[str, Any]) -> None: ...
