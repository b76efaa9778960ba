"""Pipeline activations between stage peers: one user of the transport.

A stage peer sends the activation of a micro-batch to the next stage and the activation-gradient
back to the previous one, each as one signed, streamed ``PUT`` (a wire-format message of one
leaf, ``"x"``, any codec) to::

    /v1/runs/{run}/pipe/{kind}/{epoch}/{micro}

(and ``POST /v1/runs/{run}/pipe/abort/{epoch}``: a stage peer that found the pipeline broken
tells the rest of its cluster at once). ``kind`` is ``act`` or ``grad``, ``epoch`` the
pipeline's incarnation (it grows when a stage is
taken over, so a message of an abandoned schedule is refused with 410) and ``micro`` the
micro-batch's index in the run (``step * micro_batches + m``). The receiver checks, before it
allocates anything, that the sender is the neighbour it expects for that kind (409 otherwise:
the sender retries until its deadline, the receiver may not know it yet) and that the header
names the expected shape and codec (400 otherwise); it decodes the body as it streams in and
keeps it in an inbox that the training thread reads with :meth:`ActivationLink.take`: the
float32 array, or, for a kind expected ``encoded=True``, the checked but undecoded wire parts
(:class:`EncodedActivation`: int8 codes and bf16 scales, bf16 bits, ...), which the stage's
jitted step decodes on its accelerator: a quarter of the host bytes with int8, and no float32
copy on the host at all.

Sends run on the swarm's event loop (:meth:`ActivationLink.send` returns at once); nothing here
imports jax.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, NamedTuple

import aiohttp
import numpy as np
from aiohttp import web

from ..wire._auth import body_digest, digest_matches
from ..wire._codec import ActivationDecoder
from ..wire._http import HTTPStatusError, read_json_body
from ..wire._types import SwarmError
from ._attempt import route_ints
from ._transport import Transport, why

log = logging.getLogger("ravnest_jax.swarm")

KINDS = ("act", "grad")
LEAF = "x"  # the one leaf of an activation message


class PipelineBroken(SwarmError):
    """The pipeline of this peer's cluster cannot go on: a neighbour did not deliver before the
    deadline, a send failed for good, or the link was closed. ``.neighbour`` names the stage
    peer at fault when known."""

    def __init__(self, message: str, neighbour: str | None = None):
        super().__init__(message)
        self.neighbour = neighbour


@dataclasses.dataclass
class LinkStats:
    """What crossed this peer's activation link (totals since it started).

    Attributes:
      bytes_sent / bytes_received: message bytes (wire format, headers included).
      messages_sent / messages_received: messages.
      send_seconds: summed wall time of the sends (upload, until the receiver answered).
      retries: sends repeated after a refusal or a connection error.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    send_seconds: float = 0.0
    retries: int = 0


class EncodedActivation(NamedTuple):
    """A received activation (or activation-gradient) as it crossed the wire: checked (the
    header, the checksum, finite values, scales in range) but not decoded.

    Attributes:
      codec: the codec (``"int8"``, ``"bf16"``, ...).
      shape: the decoded activation's shape.
      block_size: elements per scale block (block codecs), else 0.
      k: elements sent (topk), else 0.
      parts: the leaf's wire parts, little-endian numpy arrays (``_formats.part_dtypes``):
        int8 ``(uint16 bf16 scale bits (blocks,), uint8 codes (blocks * block_size,))``, bf16
        ``(uint16 bits (n,),)``, fp32 ``(float32 (n,),)``.
    """

    codec: str
    shape: tuple[int, ...]
    block_size: int
    k: int
    parts: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        """Host bytes the parts hold (what goes to the device)."""
        return sum(int(p.nbytes) for p in self.parts)


class _EncodedDecoder(ActivationDecoder):
    """:class:`ActivationDecoder` whose ``finish`` returns the :class:`EncodedActivation`."""

    def finish(self) -> EncodedActivation:  # type: ignore[override]
        (parts,) = self._dec.finish_parts()  # WireFormatError as the host decode raises it
        (leaf,) = self._dec.header.leaves
        return EncodedActivation(self.codec, self.shape, int(leaf.block_size), int(leaf.k), parts)


def encoded_activation(data: bytes | memoryview, *, name: str, shape: tuple[int, ...], codec: str) -> EncodedActivation:
    """A whole activation message, checked as :class:`ActivationLink` checks what it receives
    and returned undecoded (:class:`EncodedActivation`); raises like ``ActivationDecoder``."""
    dec = _EncodedDecoder(name=name, shape=shape, codec=codec, max_bytes=len(data))
    dec.feed(data)
    return dec.finish()


@dataclasses.dataclass(frozen=True)
class _Expect:
    sender: str
    shape: tuple[int, ...]
    codec: str
    encoded: bool = False


class ActivationLink:
    """The pipeline endpoint of one stage peer: receives activations and activation-gradients
    into an inbox, sends them to neighbours.

    Args:
      transport: the peer's transport (its route is added here: construct before it starts).
      loop: a function that returns the event loop the transport runs on (the swarm's, once it
        started).
      max_pending: messages the inbox holds at most (more are refused with 503: the sender
        retries); 1F1B keeps at most S in flight per direction.

    Thread-safety: :meth:`expect`, :meth:`take`, :meth:`send`, :meth:`set_epoch` and
    :meth:`close` may be called from any thread; the handler runs on the loop.
    """

    def __init__(self, transport: Transport, loop: Any, *, max_pending: int = 64):
        self.transport = transport
        self._loop = loop
        self.max_pending = int(max_pending)
        self.stats = LinkStats()
        self._cond = threading.Condition()
        self._inbox: dict[tuple[str, int, int], np.ndarray | EncodedActivation] = {}
        self._seen: dict[tuple[str, int, int], str] = {}  # body digests of this epoch's messages
        self._expect: dict[str, _Expect] = {}
        self._epoch = 0
        self._failure: PipelineBroken | None = None
        self._closed = False
        self._sends: set[concurrent.futures.Future[Any]] = set()
        transport.route("PUT", "/pipe/{kind}/{epoch}/{micro}", self._h_put)
        transport.route("POST", "/pipe/abort/{epoch}", self._h_abort)

    # ------------------------------------------------------------------ configuration
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Starts incarnation ``epoch`` of the pipeline: messages of older epochs are dropped
        (and refused from now on with 410), a recorded failure is cleared."""
        with self._cond:
            self._epoch = int(epoch)
            self._inbox = {k: v for k, v in self._inbox.items() if k[1] >= self._epoch}
            self._seen = {k: v for k, v in self._seen.items() if k[1] >= self._epoch}
            self._failure = None
            self._cond.notify_all()

    def expect(
        self, kind: str, sender: str | None, shape: tuple[int, ...], codec: str, *, encoded: bool = False
    ) -> None:
        """Accept ``kind`` messages from peer ``sender`` only (``None``: from nobody), each one
        leaf of ``shape`` (float32 once decoded) in ``codec``. ``encoded``: :meth:`take` returns
        them as :class:`EncodedActivation` (not decoded here), else as float32 arrays."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        with self._cond:
            if sender is None:
                self._expect.pop(kind, None)
            else:
                self._expect[kind] = _Expect(sender, tuple(int(s) for s in shape), codec, bool(encoded))

    # ------------------------------------------------------------------ receiving
    async def _h_put(self, request: web.Request) -> web.Response:
        t = self.transport
        sender, claimed = t.verify(request)
        kind = request.match_info["kind"]
        epoch, micro = route_ints(request, "epoch", "micro")
        with self._cond:
            exp = self._expect.get(kind)
            if self._closed:
                raise web.HTTPServiceUnavailable(text="link closed")
            if epoch < self._epoch:
                raise web.HTTPGone(text=f"epoch {epoch} is over (this stage is at {self._epoch})")
            if epoch > self._epoch or exp is None or exp.sender != sender:
                raise web.HTTPConflict(text=f"not expecting {kind} from {sender} in epoch {epoch}")
            seen = self._seen.get((kind, epoch, micro))
            if seen is not None:
                # a retry of a message whose answer was lost is answered again; another body is not
                if digest_matches(seen, claimed):
                    return t.reply(request, {"ok": True, "duplicate": True})
                raise web.HTTPConflict(text="another message for this micro-batch arrived first")
            if len(self._inbox) >= self.max_pending:
                raise web.HTTPServiceUnavailable(text="inbox full")
        n = int(np.prod(exp.shape, dtype=np.int64))
        limit = 4 * n + (1 << 20)
        if (request.content_length or 0) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length or 0)
        dec = (_EncodedDecoder if exp.encoded else ActivationDecoder)(
            name=LEAF, shape=exp.shape, codec=exp.codec, max_bytes=limit
        )
        arr, _ = await t.read_stream(request, dec, claimed, limit, lambda: False, what=kind)
        with self._cond:
            if epoch < self._epoch:  # a takeover happened while it streamed in
                raise web.HTTPGone(text=f"epoch {epoch} is over")
            self._inbox[(kind, epoch, micro)] = arr
            self._seen[(kind, epoch, micro)] = claimed
            if len(self._seen) > 64 * self.max_pending:  # keep the newest (a retry comes soon)
                for k in list(self._seen)[: len(self._seen) // 2]:
                    del self._seen[k]
            self.stats.bytes_received += dec.nbytes
            self.stats.messages_received += 1
            self._cond.notify_all()
        return t.reply(request, {"ok": True})

    async def _h_abort(self, request: web.Request) -> web.Response:
        sender, claimed = self.transport.verify(request)
        body = await read_json_body(request, claimed)
        (epoch,) = route_ints(request, "epoch")
        reason = str((body or {}).get("reason", ""))[:500]
        with self._cond:
            if epoch == self._epoch and self._failure is None:
                self._failure = PipelineBroken(f"{sender} stopped the pipeline (epoch {epoch}): {reason}")
                self._cond.notify_all()
        return self.transport.reply(request, {"ok": True})

    def abort(self, address: str, reason: str, timeout: float) -> concurrent.futures.Future[Any]:
        """Tells the stage peer at ``address`` that this epoch's pipeline is broken (its
        :meth:`take` raises at once instead of at its deadline). Best effort: failures are
        swallowed; returns a future of whether it was delivered."""
        epoch = self._epoch

        async def go() -> bool:
            try:
                await self.transport.rendezvous(
                    "POST", f"/pipe/abort/{epoch}", {"reason": reason}, timeout, address=address
                )
                return True
            except Exception as e:  # noqa: BLE001 - best effort: the peer may be the dead one
                log.info("%s: abort to %s failed: %s", self.transport.peer_id, address, why(e))
                return False

        return asyncio.run_coroutine_threadsafe(go(), self._loop())

    def take(self, kind: str, micro: int, timeout: float) -> np.ndarray | EncodedActivation:
        """Blocks until the ``kind`` message of micro-batch ``micro`` (this epoch) is in, and
        returns it (float32, the expected shape; an :class:`EncodedActivation` when expected
        ``encoded``).

        Raises:
          PipelineBroken: nothing came within ``timeout`` seconds (names the expected sender),
            a send of this peer failed for good, or the link closed.
        """
        key = (kind, self._epoch, int(micro))
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._failure is not None:
                    raise self._failure
                if self._closed:
                    raise PipelineBroken("the activation link is closed")
                arr = self._inbox.pop((kind, self._epoch, int(micro)), None)
                if arr is not None:
                    return arr
                left = deadline - time.monotonic()
                if left <= 0:
                    exp = self._expect.get(kind)
                    who = exp.sender if exp else None
                    raise PipelineBroken(
                        f"no {kind} of micro-batch {key[2]} (epoch {key[1]}) from {who} within {timeout:.1f} s",
                        neighbour=who,
                    )
                self._cond.wait(min(left, 0.5))

    def fail(self, error: PipelineBroken) -> None:
        """Records a failure: the next :meth:`take` raises it (a send that failed for good)."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()

    @property
    def failure(self) -> PipelineBroken | None:
        return self._failure

    # ------------------------------------------------------------------ sending
    def send(
        self, address: str, peer: str, kind: str, micro: int, data: bytes, timeout: float, epoch: int | None = None
    ) -> concurrent.futures.Future[int]:
        """Sends one message to the peer ``peer`` at ``address`` on the event loop and returns
        at once. Refusals that may pass (409: the receiver does not expect this sender yet; 503:
        its inbox is full) and connection errors are retried until ``timeout`` seconds; then,
        or on any other refusal, the failure is recorded (:meth:`take` raises it). A 410 (the
        receiver moved on to a newer epoch) ends the send quietly.

        ``epoch``: the epoch the message belongs to (default: the current one); a message of an
        older epoch than the link's is dropped at once (it was computed before a takeover).

        Returns:
          a future of the bytes sent (0 when dropped as stale).
        """
        epoch = self._epoch if epoch is None else int(epoch)
        fut = asyncio.run_coroutine_threadsafe(
            self._send(address, peer, kind, epoch, micro, data, timeout), self._loop()
        )
        with self._cond:
            self._sends.add(fut)
        fut.add_done_callback(self._sent)
        return fut

    def _sent(self, fut: concurrent.futures.Future[int]) -> None:
        with self._cond:
            self._sends.discard(fut)
        if fut.cancelled():
            return
        e = fut.exception()
        if isinstance(e, PipelineBroken):
            self.fail(e)

    async def _send(
        self, address: str, peer: str, kind: str, epoch: int, micro: int, data: bytes, timeout: float
    ) -> int:
        t0 = time.monotonic()
        deadline = t0 + timeout
        digest = body_digest(data)
        last = "no answer"
        pause = 0.02
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PipelineBroken(
                    f"{kind} of micro-batch {micro} to {peer} not delivered within {timeout:.1f} s: {last}",
                    neighbour=peer,
                )
            if self._closed or epoch < self._epoch:
                return 0
            try:
                n = await self.transport.put(
                    address,
                    f"/pipe/{kind}/{epoch}/{micro}",
                    data,
                    digest=digest,
                    round_=micro,
                    headers={},
                    timeout=left,
                    kind=kind,
                )
                with self._cond:
                    self.stats.bytes_sent += n
                    self.stats.messages_sent += 1
                    self.stats.send_seconds += time.monotonic() - t0
                return n
            except HTTPStatusError as e:
                if e.status == 410:
                    return 0
                if e.status not in (409, 503):
                    raise PipelineBroken(
                        f"{kind} of micro-batch {micro} refused by {peer}: {e}", neighbour=peer
                    ) from None
                last = str(e)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = why(e)
            with self._cond:
                self.stats.retries += 1
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.5)

    def drain(self, timeout: float) -> bool:
        """Waits until every send in flight ended (delivered, failed or dropped); returns
        whether they did within ``timeout`` seconds."""
        with self._cond:
            sends = list(self._sends)
        done, not_done = concurrent.futures.wait(sends, timeout=timeout)
        return not not_done

    def close(self) -> None:
        """Stops accepting messages and wakes a waiting :meth:`take` (it raises)."""
        with self._cond:
            self._closed = True
            self._inbox.clear()
            sends = list(self._sends)
            self._cond.notify_all()
        for f in sends:
            f.cancel()
