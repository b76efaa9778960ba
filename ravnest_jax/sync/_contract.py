"""The contract between the sync layer and the swarm: everything :class:`OuterSync`,
:func:`join_or_resume` and the whole-swarm restart use of a swarm, in one protocol, all of it
required (no member is optional, nothing is looked up with a default).

``rj.Swarm`` implements it over the network; :class:`ravnest_jax.testing.LocalSwarm` in memory
(N peers in threads of one process, for tests). :func:`check_contract` is the one check, made
when :class:`OuterSync` is built.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SwarmContract(Protocol):
    """Everything the sync layer uses of a swarm (``rj.Swarm``; docs/architecture.md).

    Members (all called from the training thread unless noted):

    - ``codec``: the run's :class:`~ravnest_jax.Codec`; the device-side encode uses it.
    - ``peer_id``, ``run_id``: this peer's and its run's ids; ``timeouts``: its deadlines
      (``Timeouts``); ``started``: whether it runs (``False``: a manifest declared now is a
      check only).
    - ``all_reduce_packed_async(packed, *, weight, round=None, state=None)`` (sync worker
      thread): the contribution encoded on the device (a host ``compress.Packed`` of
      ``codec``) in, a future of ``(mean, record)`` out: ``mean`` float32 ``(n,)``, the
      leaves raveled in order, ``record`` a ``RoundRecord``; raises ``RoundFailed`` (with
      ``.record``) through the future. ``round``: the swarm round this contribution belongs
      to; ``state``: ``(round, state digest)`` for the divergence check.
    - ``ready()``: this peer trains now (ends a joiner's standby); non-blocking, a future.
    - ``serve_state(provider)``: ``provider()`` (called in a worker thread) returns the state
      bytes or a future of them, ``None`` for none; ``serve_state(None)`` stops serving.
    - ``fetch_state(timeout)``: the state bytes of a live peer, or ``None`` when nobody has one.
    - ``round_outcome(round)``: ``"ok"``, ``"failed"``, ``"running"`` or ``"unknown"``.
    - ``status()``: the run's status (``"rounds"``: number, outcome, group of the recent ones).
    - ``peers()``, ``wait_for_peers(n, timeout)``: the live peers (``PeerInfo``: id, address,
      last round, info).
    - ``info`` / ``set_info(dict)``: the small JSON object this peer publishes (checkpoint steps
      of a whole-swarm restart, the driver's round stats).
    - ``declare_manifest(manifest, *, init=None)``: the run manifest; ``ManifestMismatch``
      when the run has another; returns the run's reference initial state once started.
    """

    codec: Any
    peer_id: str
    run_id: str
    timeouts: Any
    started: bool

    def all_reduce_packed_async(
        self, packed: Any, *, weight: float, round: int | None = None, state: tuple[int, str] | None = None
    ) -> concurrent.futures.Future: ...

    def ready(self) -> concurrent.futures.Future: ...

    def serve_state(self, provider: Callable[[], Any] | None) -> None: ...

    def fetch_state(self, timeout: float = 120.0) -> bytes | None: ...

    def round_outcome(self, round_: int) -> str: ...

    def status(self) -> dict[str, Any]: ...

    def peers(self) -> list: ...

    def wait_for_peers(self, n: int, timeout: float = 60.0) -> list: ...

    @property
    def info(self) -> dict[str, Any]: ...

    def set_info(self, info: dict[str, Any]) -> None: ...

    def declare_manifest(self, manifest: dict[str, Any], *, init: str | None = None) -> dict[str, Any] | None: ...


#: the members :func:`check_contract` requires, in the order the docstring lists them (the
#: attributes, then the methods, as the protocol declares them)
MEMBERS = (*SwarmContract.__annotations__, *(k for k in vars(SwarmContract) if not k.startswith("_")))


def check_contract(swarm: Any) -> None:
    """Raises ``TypeError`` (one line naming every missing member) unless ``swarm`` has the
    whole :class:`SwarmContract`."""
    missing = [m for m in MEMBERS if not hasattr(swarm, m)]
    if missing:
        raise TypeError(
            f"swarm {type(swarm).__name__} lacks {', '.join(missing)}: OuterSync needs an rj.Swarm "
            "(or ravnest_jax.testing.LocalSwarm; the contract: ravnest_jax.sync.SwarmContract)"
        )
