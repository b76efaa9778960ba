"""One attempt of one round: its per-peer state, what an all-reduce algorithm gets to run it,
its typed outcomes (:class:`Reduced` returned, :class:`Retry` or :class:`RoundFail` raised) and
the checks of the requests of its phases."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable, Container
from typing import Any, NoReturn, Protocol

import numpy as np
from aiohttp import web

log = logging.getLogger("ravnest_jax.swarm")

H_WEIGHT = "X-RJ-Weight"
H_MANIFEST = "X-RJ-Manifest"
F32_MAX = float(np.finfo(np.float32).max)


class Attempt:
    """This peer's state for one attempt of one round, what every algorithm shares; each
    algorithm keeps its own in a subclass (``ButterflyAttempt``, ``RingAttempt``), made by its
    :meth:`Algorithm.attempt`.

    Created by whichever comes first: the round driver entering the attempt, or a request of a
    faster member for it (then it waits on :attr:`entered`).
    """

    def __init__(self, round_: int, attempt: int):
        self.round, self.attempt = round_, attempt
        self.entered = asyncio.Event()
        self.group: tuple[str, ...] = ()
        self.me = -1
        self.lo = self.hi = 0  # this peer's part
        self.manifest = ""
        self.codec = ""
        self.algorithm = ""
        self.bounds: list[tuple[int, int]] = []
        self.closed = False  # the reduce-scatter is over: late parts are refused
        self.bytes_in = 0

    def close(self) -> None:
        """Refuse everything from now on and drop the buffers (wakes every waiter)."""
        self.closed = True
        self.entered.set()


class RoundFail(Exception):
    """The round failed on this peer (a decision of the rendezvous, a deadline, a miss).

    ``total_weight``: the round's total weight when it is known; ``all_abstained``: a missed
    round in which every member abstained (``RoundRecord.all_abstained``)."""

    def __init__(self, message: str, total_weight: float = 0.0, all_abstained: bool = False):
        super().__init__(message)
        self.total_weight, self.all_abstained = total_weight, all_abstained


class RoundUnknown(RoundFail):
    """The rendezvous does not know the round: it restarted (``epoch``: its new one) or the round
    is too old."""

    def __init__(self, message: str, epoch: str | None):
        super().__init__(message)
        self.epoch = epoch


@dataclasses.dataclass(frozen=True)
class Reduced:
    """An attempt that produced the round's mean.

    Attributes:
      out: the mean, float32 of the input vector's length, bit-identical on every contributor.
      contributors: the peer ids the mean is over.
      total: the sum of their weights.
      digest: the result digest (equal on every peer that got it).
      diverged: peers whose global state digest differed from the majority's.
      next: the next round's group when the rendezvous handed it out with the commit.
      clipped: clipped mean: contributor -> the factor (< 1) its contribution was scaled by.
    """

    out: np.ndarray
    contributors: tuple[str, ...]
    total: float
    digest: str
    diverged: tuple[str, ...]
    next: dict[str, Any] | None = None
    clipped: dict[str, float] = dataclasses.field(default_factory=dict)


class Retry(Exception):
    """The rendezvous decided to retry the round as ``attempt`` with ``group`` (raised by
    :func:`decided`, returned by ``Rounds._attempt``)."""

    def __init__(self, attempt: int, group: tuple[str, ...]):
        super().__init__(f"retry as attempt {attempt} with {group}")
        self.attempt, self.group = attempt, group


@dataclasses.dataclass
class AttemptInput:
    """What one attempt of this peer starts from.

    Attributes:
      membership: peer id -> base URL of every member that can be reached (this one included).
      epoch: the rendezvous epoch the votes carry.
      contrib: this peer's contribution (a ``Contribution``: encoded, with its part layout).
      weight: its weight (float32 > 0), or 0: this peer *abstains* (it missed its round and
        takes part only so that the others need not wait for it: a butterfly member sends its
        owners an empty part of weight 0, which counts as received and adds nothing).
      deadline: the round's deadline (``time.monotonic()``, seconds).
      stats: ``{"sent": bytes, "received": bytes}``, accumulated over the round's attempts.
      part_left: seconds left of the part deadline when the attempt starts (``None``: a whole one).
      arrive: the arrival request of a round handed out with the last commit (its answer
        tightens the part deadline), else ``None``.
      state: ``(round, state digest)`` sent with the gather vote (divergence check), or ``None``.
      relayed: the members the rendezvous reaches through its relay (client-only peers).
    """

    membership: dict[str, str]
    epoch: str
    contrib: Any
    weight: np.float32
    deadline: float
    stats: dict[str, int]
    part_left: float | None = None
    arrive: asyncio.Task[Any] | None = None
    state: tuple[int, str] | None = None
    relayed: frozenset[str] = frozenset()
    _vec: np.ndarray | None = None

    @property
    def vec(self) -> np.ndarray:
        """The contribution as one float32 vector, as every receiver decodes it (the ring)."""
        if self._vec is None:
            self._vec = self.contrib.vector()
        return self._vec


class Algorithm(Protocol):
    """One all-reduce algorithm over the transport (``_butterfly.py``, ``_ring.py``).

    ``name`` is what peers agree on (part of the round manifest with :meth:`wire`); the
    algorithm adds its routes to the transport at construction and runs one attempt of a round
    with :meth:`run`, returning :class:`Reduced`, or raising :class:`Retry` or
    :class:`RoundFail`."""

    name: str

    def wire(self) -> str: ...

    def attempt(self, round_: int, attempt: int) -> Attempt:
        """A new attempt's state, of this algorithm's own subclass."""
        ...

    def prepare(self, st: Attempt, layout: Any, relayed: frozenset[str] = ...) -> None: ...

    async def run(self, st: Attempt, inp: AttemptInput) -> Reduced: ...


def route_ints(request: web.Request, *names: str) -> tuple[int, ...]:
    """The integer path fields ``names`` of ``request``.

    Raises:
      web.HTTPBadRequest: one is not an integer.
    """
    try:
        return tuple(int(request.match_info[n]) for n in names)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{', '.join(names)} must be integers") from None


def signed_part(transport: Any, request: web.Request) -> tuple[str, str, np.float32, str]:
    """Checks the signature of a part (or ring message), which covers its weight and round
    manifest headers too; returns ``(sender, claimed body digest, weight, manifest digest)``.

    Raises:
      web.HTTPUnauthorized: a bad signature (see ``Transport.verify``).
      web.HTTPBadRequest: a weight that is not a finite float32 >= 0 (0: an abstainer's).
    """
    weight_s = request.headers.get(H_WEIGHT, "")
    manifest = request.headers.get(H_MANIFEST, "")
    sender, claimed = transport.verify(request, extra=f"{weight_s}|{manifest}")
    try:
        w = float(weight_s)
    except ValueError:
        raise web.HTTPBadRequest(text="bad weight") from None
    if not (math.isfinite(w) and 0 <= w <= F32_MAX):  # checked before the cast (no overflow warning)
        raise web.HTTPBadRequest(text="weight must be finite, >= 0 and within float32")
    return sender, claimed, np.float32(w), manifest


def refuse_other_manifest(warned: set[str], peer_id: str, sender: str, wire: str) -> NoReturn:
    """Refuse (400) a part whose round manifest is not this peer's, and say so once per sender
    (a WARNING): a member whose leaf names, shapes or wire settings (codec, mean codec,
    algorithm, aggregator) differ fails every round it is in, which the round's vote alone
    reports only as parts that never arrived.

    Raises:
      web.HTTPBadRequest: always.
    """
    if sender not in warned:
        warned.add(sender)
        log.warning(
            "%s: peer %s sends parts of another round manifest: its leaf names, shapes or wire settings "
            "(codec, mean codec, algorithm, aggregator) differ from this peer's (%s); every peer of a run "
            "must use the same, and rounds with both fail",
            peer_id,
            sender,
            wire,
        )
    raise web.HTTPBadRequest(text="part does not match the round manifest (leaf names, shapes or codec differ)")


def decided(decision: dict[str, Any], ok: str) -> None:
    """Checks that a vote's decision is ``ok``.

    Raises:
      Retry: the decision is ``"retry"``. RoundFail: any other (with the rendezvous' reason).
    """
    if decision["decision"] == "retry":
        raise Retry(int(decision["attempt"]), tuple(decision["group"]))
    if decision["decision"] != ok and decision.get("unknown"):
        epoch = decision.get("epoch")
        raise RoundUnknown(decision.get("reason", "round unknown"), epoch if isinstance(epoch, str) else None)
    if decision["decision"] != ok:
        raise RoundFail(decision.get("reason", "round failed"))


async def receive(
    transport: Any,
    request: web.Request,
    claimed: str,
    decoder: Callable[[], Any],
    *,
    key: Any,
    done: Container[Any],
    busy: set[Any],
    closed: Callable[[], bool],
    limit: int,
    what: str,
    late: str,
    undo: Callable[[], None] | None = None,
    raw: bytearray | None = None,
) -> tuple[Any, str, int]:
    """The body of one message of a phase (a part, a result part, a ring segment), ``key``, read
    into ``decoder()`` (``Transport.read_stream``) while ``key`` is in ``busy``; ``undo()`` when
    that fails.

    Returns:
      ``(what the decoder's finish returned, the body digest, the body's bytes)``.

    Raises:
      web.HTTPConflict: the phase is ``closed()`` (before or after the body; ``late`` names
      it), or ``key`` is in ``done`` or ``busy`` (a duplicate). web.HTTPRequestEntityTooLarge:
      a Content-Length over ``limit`` bytes (before anything is allocated). What
      ``Transport.read_stream`` raises.
    """
    if closed():
        raise web.HTTPConflict(text=f"too late: {late}")
    if key in done or key in busy:
        raise web.HTTPConflict(text=f"duplicate {what}")
    if (request.content_length or 0) > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length or 0)
    dec = decoder()
    busy.add(key)
    try:
        value, sha = await transport.read_stream(request, dec, claimed, limit, closed, raw, what)
        if closed():
            raise web.HTTPConflict(text=f"too late: {late}")
    except BaseException:
        if undo is not None:
            undo()
        raise
    finally:
        busy.discard(key)
    return value, sha, dec.nbytes
