"""Pipelined ring all-reduce: 2(n - 1) neighbour steps, every part cut into segments.

Each segment of each step is its own encoded message and PUT to the right neighbour; segment j of
step s + 1 leaves as soon as segment j of step s has arrived (and, in the reduce-scatter, been
added), while later segments of step s are still on the wire. Per element the float32 arithmetic
is the unsegmented ring's. A ring cannot leave a member out: any failure fails the attempt and the
rendezvous retries it without the members that did not vote.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from ..wire import _auth
from ..wire._codec import PartDecoder, decode_part, encode_part
from ..wire._http import HTTPStatusError
from ..wire._types import result_digest
from ._allreduce import part_bounds, part_limit, ring_segments
from ._attempt import (
    H_MANIFEST,
    H_WEIGHT,
    Attempt,
    AttemptInput,
    Reduced,
    RoundFail,
    decided,
    receive,
    refuse_other_manifest,
    signed_part,
)
from ._rounds import Rounds
from ._transport import Transport

log = logging.getLogger("ravnest_jax.swarm")

RING_INFLIGHT = 4  # ring PUTs in flight per peer at most (the others wait, not yet encoded)
RING = "/rounds/{round}/{attempt}/ring/{phase}/{step}/{seg}"
_FAILURES = (TimeoutError, aiohttp.ClientError, HTTPStatusError, PermissionError, OSError)


class RingAttempt(Attempt):
    """The ring's state of one attempt: ``segments[c][j] = (lo, hi)`` of segment j of part c,
    and the messages that arrived, by ``(phase, step, segment)``."""

    def __init__(self, round_: int, attempt: int):
        super().__init__(round_, attempt)
        self.algorithm = "ring"
        self.segments: list[list[tuple[int, int]]] = [[(0, 0)]]
        self.inbox: dict[tuple[str, int, int], tuple[Any, ...]] = {}
        self.seen: set[tuple[str, int, int]] = set()  # every message stored (409 again)
        self.receiving: set[tuple[str, int, int]] = set()
        self._events: dict[tuple[str, int, int], asyncio.Event] = {}

    def event(self, phase: str, step: int, seg: int) -> asyncio.Event:
        return self._events.setdefault((phase, step, seg), asyncio.Event())

    def close(self) -> None:
        self.inbox.clear()  # the messages nobody took (their buffers)
        super().close()


class Ring:
    """The pipelined ring of one peer (see the module docstring).

    Args:
      transport, rounds, codec, codec_options: as for :class:`Butterfly`.
      segment_bytes: float32 bytes per segment (part of the round manifest: equal on all peers).
    """

    name = "ring"

    def __init__(
        self,
        transport: Transport,
        rounds: Rounds,
        codec: str,
        codec_options: dict[str, Any],
        segment_bytes: int,
    ):
        self.transport, self.rounds = transport, rounds
        self.codec, self.codec_options, self.timeouts = codec, codec_options, transport.timeouts
        self.segment_bytes = segment_bytes
        self.peer_id = transport.peer_id
        self._other_manifest: set[str] = set()  # senders of another manifest, warned about once
        self._slots = asyncio.Semaphore(RING_INFLIGHT)
        transport.route("PUT", RING, self._h_put_ring)

    def attempt(self, round_: int, attempt: int) -> RingAttempt:
        return RingAttempt(round_, attempt)

    def wire(self) -> str:
        return f"{self.codec}/ring/{self.segment_bytes}"

    def prepare(self, st: RingAttempt, layout: Any, relayed: frozenset[str] = frozenset()) -> None:
        st.bounds = part_bounds(layout.n, len(st.group))
        st.lo, st.hi = st.bounds[st.me]
        st.algorithm = self.name
        st.segments = ring_segments(st.bounds, self.segment_bytes)

    # ------------------------------------------------------------------ server side
    async def _h_put_ring(self, request: web.Request) -> web.Response:
        """One segment of one ring step from the left neighbour, streamed into its decoder."""
        sender, claimed, w, manifest = signed_part(self.transport, request)
        phase = request.match_info["phase"]
        if phase not in ("rs", "ag"):
            raise web.HTTPBadRequest(text="bad phase")
        st, step, j = await self.rounds.wait_entered(request, "step", "seg")
        n = len(st.group)
        if st.algorithm != self.name:
            raise web.HTTPBadRequest(text="part does not match the round manifest")
        if manifest != st.manifest:
            refuse_other_manifest(self._other_manifest, self.peer_id, sender, self.wire())
        if sender != st.group[(st.me - 1) % n]:
            raise web.HTTPForbidden(text="only the left neighbour sends ring messages")
        if not 0 <= step < n - 1 or not 0 <= j < len(st.segments[0]):
            raise web.HTTPBadRequest(text="bad ring step or segment")
        key = (phase, step, j)
        c = (st.me - 1 - step) % n if phase == "rs" else (st.me - step) % n
        lo, hi = st.segments[c][j]
        limit = part_limit(st.codec, hi - lo)
        # all-gather messages are forwarded unchanged to the right, except at the last step
        raw = bytearray() if phase == "ag" and step < n - 2 else None
        vec, sha, nbytes = await receive(
            self.transport,
            request,
            claimed,
            lambda: PartDecoder(name=f"ring{phase}{c}.{j}", length=hi - lo, codec=st.codec, max_bytes=limit),
            key=key,
            done=st.seen,
            busy=st.receiving,
            closed=lambda: st.closed,
            limit=limit,
            what="ring message",
            late="the ring of this attempt is over",
            raw=raw,
        )
        st.seen.add(key)
        st.inbox[key] = (w, vec, raw if raw is not None else b"", sha)
        st.bytes_in += nbytes
        st.event(phase, step, j).set()
        return self.transport.reply(request, {"ok": True})

    # ------------------------------------------------------------------ client side
    async def _send(
        self,
        st: RingAttempt,
        addr: str,
        phase: str,
        step: int,
        j: int,
        data: Any,
        weight: np.float32,
        timeout: float,
        digest: str | None = None,
    ) -> int:
        """One signed PUT of segment ``j`` of ring step ``step``; ``data`` is the encoded bytes
        or a function that encodes them (called once a send slot is free, so that at most
        ``RING_INFLIGHT`` encoded messages wait per peer); ``digest``: its body digest when
        known (a forwarded message: no second hash pass)."""
        weight_s = repr(float(weight))
        t_end = time.monotonic() + timeout
        async with self._slots:
            if callable(data):
                data = data()
            return await self.transport.put(
                addr,
                f"/rounds/{st.round}/{st.attempt}/ring/{phase}/{step}/{j}",
                data,
                digest=digest or _auth.body_digest(data),
                round_=st.round,
                headers={H_WEIGHT: weight_s, H_MANIFEST: st.manifest},
                timeout=t_end - time.monotonic(),
                kind="ring",
            )

    async def _phase(self, st: RingAttempt, t_end: float, segment: Callable[..., Any], stats: dict[str, int]) -> None:
        """Run ``segment(j, send)`` for every segment j concurrently (the pipeline: segment j
        moves on to its next step as soon as its own message of this step has arrived) until
        all are done and every PUT they started (``send(coro)``) was answered. Raises the first
        failure of any of them, or ``TimeoutError`` at ``t_end`` or as soon as a heartbeat
        answer says a member left the run (a ring cannot go round without it: the retry
        without it starts then, not at the part deadline); cancels the rest."""
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[BaseException] = loop.create_future()
        sends: list[asyncio.Future[int]] = []

        def watch(t: asyncio.Future[Any]) -> None:
            if not t.cancelled() and not failed.done():
                e = t.exception()
                if e is not None:
                    failed.set_result(e)

        def send(coro: Any) -> None:
            t = asyncio.ensure_future(coro)
            t.add_done_callback(watch)
            sends.append(t)

        tasks = [asyncio.ensure_future(segment(j, send)) for j in range(len(st.segments[0]))]
        for t in tasks:
            t.add_done_callback(watch)
        gone: asyncio.Future[Any] | None = None
        try:
            while True:
                pending = [t for t in (*tasks, *sends) if not t.done()]
                if failed.done():
                    raise failed.result()
                if not pending:
                    return
                left = t_end - time.monotonic()
                if left <= 0:
                    raise TimeoutError("ring phase deadline")
                if lost := self.rounds.gone(st.round, st.attempt) & set(st.group):
                    raise TimeoutError(f"ring: {', '.join(sorted(lost))} left the run")
                if gone is None or gone.done():
                    gone = asyncio.ensure_future(self.rounds.left_event().wait())
                await asyncio.wait([failed, gone, *pending], timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if gone is not None:
                gone.cancel()
            # a segment task that ends while we cancel may still start a send: repeat until
            # every task is done (segment tasks start no sends once done, so this ends)
            while rest := [t for t in (*tasks, *sends) if not t.done()]:
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)
            stats["sent"] += sum(t.result() for t in sends if not t.cancelled() and t.exception() is None)

    async def run(self, st: RingAttempt, inp: AttemptInput) -> Reduced:
        r, a, group, n, i = st.round, st.attempt, st.group, len(st.group), st.me
        weight, stats, deadline = inp.weight, inp.stats, inp.deadline
        # an abstainer (weight 0) passes zeros on: a ring cannot leave a member out
        vec = inp.vec if weight > 0 else np.zeros(inp.contrib.n, np.float32)
        st.entered.set()
        right = inp.membership.get(group[(i + 1) % n], "")
        segs = st.segments
        out = np.empty(vec.size, dtype=np.float32)
        shas: dict[tuple[int, int], str] = {}
        own: dict[int, tuple[bytes, str]] = {}
        totals: dict[int, np.float32] = {}
        codec, opts = self.codec, self.codec_options

        def wait(phase: str, s: int, j: int, t_end: float) -> Any:
            return asyncio.wait_for(st.event(phase, s, j).wait(), max(t_end - time.monotonic(), 0))

        t_rs = min(time.monotonic() + self.timeouts.part, deadline)

        async def reduce_scatter(j: int, send: Callable[[Any], None]) -> None:
            # partial weighted sums of segment j of one part, passed to the right, n - 1 steps
            c = i
            lo, hi = segs[c][j]
            num = vec[lo:hi] * weight
            acc_w = weight
            for s in range(n - 1):
                encode = lambda c=c, num=num: encode_part(f"ringrs{c}.{j}", num, codec, **opts)  # noqa: E731
                send(self._send(st, right, "rs", s, j, encode, acc_w, t_rs - time.monotonic()))
                await wait("rs", s, j, t_rs)
                in_w, in_num, _, _ = st.inbox.pop(("rs", s, j))
                c = (i - s - 1) % n
                lo, hi = segs[c][j]
                num = np.multiply(vec[lo:hi], weight)
                np.add(in_num, num, out=num)  # in_num + w * x, as the unsegmented ring
                acc_w = np.float32(in_w + weight)
            mean = np.divide(num, acc_w, out=num) if acc_w > 0 else num  # 0: everybody abstained
            data = encode_part(f"ringag{c}.{j}", mean, codec, **opts)
            lo, hi = segs[c][j]
            out[lo:hi] = (
                mean if codec == "fp32" else decode_part(data, name=f"ringag{c}.{j}", length=hi - lo, codec=codec)
            )
            shas[(c, j)] = _auth.body_digest(data)
            own[j], totals[j] = (data, shas[(c, j)]), acc_w

        complete = True
        try:
            await self._phase(st, t_rs, reduce_scatter, stats)
        except _FAILURES as e:
            log.info("%s: ring reduce-scatter failed: %r", self.peer_id, e)
            complete = False
        vote: dict[str, Any] = {"received": list(group) if complete else [], "ring": True}
        if inp.state is not None:
            vote["state"] = list(inp.state)
        diverged = self.rounds.gathered(await self.rounds.vote(r, inp.epoch, a, "gather", vote, deadline))
        if not complete:  # cannot happen with an honest rendezvous
            raise RoundFail("ring: gather decided ok without this peer's parts")
        total = float(totals[0])

        # all-gather: forward the encoded final segments unchanged as they arrive, n - 1 steps
        t_ag = min(time.monotonic() + self.timeouts.part, deadline)

        async def all_gather(j: int, send: Callable[[Any], None]) -> None:
            cur, sha = own.pop(j)
            for s in range(n - 1):
                send(self._send(st, right, "ag", s, j, cur, np.float32(1.0), t_ag - time.monotonic(), sha))
                await wait("ag", s, j, t_ag)
                _, part, cur, sha = st.inbox.pop(("ag", s, j))
                k = (i - s) % n
                lo, hi = segs[k][j]
                out[lo:hi] = part
                shas[(k, j)] = sha

        ok = True
        try:
            await self._phase(st, t_ag, all_gather, stats)
        except _FAILURES as e:
            log.info("%s: ring all-gather failed: %r", self.peer_id, e)
            ok = False
        stats["received"] += st.bytes_in
        st.bytes_in = 0
        digest = result_digest([shas[(k, j)] for k in range(n) for j in range(len(segs[0]))]) if ok else ""
        commit = await self.rounds.vote(
            r, inp.epoch, a, "commit", {"ok": ok, "digest": digest, "failed_owners": []}, deadline
        )
        st.inbox.clear()
        decided(commit, "commit")
        return Reduced(out, tuple(group), total, digest, diverged)
