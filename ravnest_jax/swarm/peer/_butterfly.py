"""Butterfly all-reduce: a reduce-scatter to part owners, then an all-gather of the reduced parts.

Every member owns one part of the vector (``PartLayout.bounds``: cut on the codec's block
boundaries); it receives that part from every other member, reduces it over the contributors the
gather vote decides, encodes the mean once and pushes it to everybody. A member that misses the
part deadline is left out of the mean (the other members still finish the round); an owner that
never delivers fails the attempt, and the rendezvous retries it without that owner.

Bytes and memory. A member's parts are views of its encoded contribution (``_contrib.py``: the
message its device encoded, or its float32 arrays for fp32): nothing is decoded or encoded again
before it is sent. An owner adds every arriving chunk of a part straight into its slice of the
round's output buffer, in sorted-id order (``_fold.py``, bit-identical to reducing whole parts),
and result parts are decoded straight into the output buffer: no part-sized buffer per member.
When the gather decision needs another sum than the one made on the fly (a member left out after
its part arrived here, a member clipped, a part that failed half-way), the owner pulls the kept
members' parts again (``GET .../contrib/{part}``, served from their contributions).

The all-gather: every owner's mean, encoded once, pushed to every member (or pulled by a
client-only one) and decoded straight into the round's output buffer; then the commit vote.

Aggregators (``AllReduce.aggregator``): ``"mean"``, the weighted mean; ``"clipped_mean"``, the
weighted mean after scaling down every contribution whose L2 norm exceeds ``clip_multiple`` times
the round's median contribution norm (each owner reports the squared norm of every part it
received with its gather vote; the rendezvous sums them per contributor into whole-vector norms,
which the gather decision carries to every owner). Clipping needs the owners to see every
contribution of their part, which is why it exists only here and not in the ring. The clipped
mean reduces optimistically as if nobody were clipped (the tag covers the clip factors) and
again only when the decision clips someone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web

from ..wire._codec import PartLayout, RangeDecoder, WireFormatError, host_pack, mean_codec_options, part_chunks
from ..wire._types import result_digest
from ._allreduce import clip_scales, contributors_tag, part_limit
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
from ._fold import Fold
from ._rounds import Rounds
from ._transport import Body, Transport, body_digest, body_nbytes

log = logging.getLogger("ravnest_jax.swarm")

PARTS = "/rounds/{round}/{attempt}/parts/{part}"
CONTRIB = "/rounds/{round}/{attempt}/contrib/{part}"  # an owner pulls a member's part again
H_CONTRIB = "X-RJ-Contributors"  # tag of the contributor set a pushed result part was reduced over
H_TOTAL = "X-RJ-Total"  # a pulled result part's total weight (covered by the answer's signature)
RESULTS = "/rounds/{round}/{attempt}/results/{part}"
PULL = "/rounds/{round}/{attempt}/results/{part}/{tag}"  # a client-only member collects a result part


def send(
    transport: Transport,
    st: ButterflyAttempt,
    addr: str,
    kind: str,
    k: int,
    data: Body,
    digest: str,
    headers: dict,
    timeout: float,
) -> asyncio.Future[int]:
    """A signed PUT of ``data`` (a part or a result part) in the background; its bytes sent."""
    return asyncio.ensure_future(
        transport.put(
            addr,
            f"/rounds/{st.round}/{st.attempt}/{kind}/{k}",
            data,
            digest=digest,
            round_=st.round,
            headers=headers,
            timeout=timeout,
            kind=kind[:-1],  # "part" / "result"
        )
    )


class MeanResidual:
    """An owner's error feedback on the mean it sends (``mean_error_feedback``): what its encode
    of the mean of its part dropped, added to that part's mean in the next round it owns that
    part (bidirectional compression with error feedback, DoubleSqueeze arXiv 1905.05957; for
    coarse codecs such as ``sign``, whose encode drops a third of the mean's energy; measured
    to help with plain averaging as the outer step and to hurt with Nesterov momentum,
    ``docs/compression.md``).

    A residual counts once its round committed with the contributor set it was computed for
    (:meth:`offer` per push, :meth:`commit` after the commit vote); it is used only for the same
    part of the same layout (a part cut elsewhere after a membership change starts from zero).
    Every member decodes the same bytes, so the residual changes nothing of the round's
    agreement; it lives on the owner only (float32, the part's length).
    """

    def __init__(self) -> None:
        self.key: tuple[str, int, int] | None = None
        self.value: np.ndarray | None = None
        self.pending: dict[tuple[int, str], tuple[tuple[str, int, int], np.ndarray]] = {}

    def carried(self, key: tuple[str, int, int]) -> np.ndarray | None:
        """The committed residual of part ``key`` = ``(layout key, lo, hi)``, or ``None``."""
        return self.value if key == self.key else None

    def offer(self, round_: int, tag: str, key: tuple[str, int, int], value: np.ndarray) -> None:
        self.pending = {k: v for k, v in self.pending.items() if k[0] >= round_}
        self.pending[(round_, tag)] = (key, value)

    def commit(self, round_: int, tag: str) -> None:
        hit = self.pending.pop((round_, tag), None)
        self.pending = {k: v for k, v in self.pending.items() if k[0] > round_}
        if hit is not None:
            self.key, self.value = hit


class ButterflyAttempt(Attempt):
    """The butterfly's state of one attempt (as a part owner and as a receiver)."""

    def __init__(self, round_: int, attempt: int):
        super().__init__(round_, attempt)
        self.algorithm = "butterfly"
        self.complete = asyncio.Event()  # every member's part of this peer's part is in
        self.gather_closed = False  # the all-gather is over
        # the weight of every member whose part arrived whole (this peer's own too)
        self.received: dict[str, np.float32] = {}
        self.receiving: set[str] = set()
        self.layout: Any = None  # the contribution's PartLayout (cut positions, pieces)
        self.grid: list[tuple[int, int]] = []  # the grid chunks of this peer's part
        self.own_chunk: Any = None  # (a, b) -> this peer's values of its own part's chunk
        self.out: np.ndarray | None = None  # the round's output buffer (float32, the whole vector's length)
        self.fold: Fold | None = None  # the running sum of this peer's part
        self.sent_parts: dict[int, tuple[Any, str]] = {}  # owner index -> (message, digest) sent
        self.pullers: frozenset[str] = frozenset()  # client-only members: own no part, pull results
        self.my_results: dict[str, asyncio.Future[tuple[Any, str, str]]] = {}  # tag -> (data, digest, total)
        self.served = 0  # bytes pulled from this peer (result parts, parts pulled again)
        # result parts by (part, contributor tag) -> (None: decoded into ``out``, or a buffer
        # of its own; body digest); which tag each part's region of ``out`` holds
        self.results: dict[tuple[int, str], tuple[np.ndarray | None, str]] = {}
        self.results_receiving: set[tuple[int, str]] = set()
        self.out_claims: dict[int, str] = {}
        self.result_arrived = asyncio.Event()

    def close(self) -> None:
        self.gather_closed = True
        self.received.clear()
        self.sent_parts.clear()
        self.fold = self.out = self.own_chunk = None
        for fut in self.my_results.values():
            fut.cancel()
        self.my_results.clear()
        self.results.clear()
        super().close()
        self.result_arrived.set()


class _Abstained:
    """The decoder of an abstainer's part (weight 0): an empty body, any byte refused;
    ``done()`` once it arrived whole."""

    nbytes = 0

    def __init__(self, done: Callable[[], None]):
        self.done = done

    def feed(self, chunk: bytes | memoryview) -> None:
        if len(chunk):
            raise WireFormatError("an abstainer's part (weight 0) carries no values")

    def finish(self) -> None:
        self.done()


class Butterfly:
    """The butterfly algorithm of one peer (see the module docstring): the reduce-scatter, then
    the all-gather of the reduced parts and the commit vote.

    Args:
      transport: the peer's transport (its routes are added here).
      rounds: the round driver (votes, attempts, members that left).
      codec, codec_options: the wire codec of parts and results (the part deadline of each phase
        is the transport's ``timeouts.part``, seconds).
      aggregator: ``"mean"`` or ``"clipped_mean"`` (module docstring).
      clip_multiple: the clipped mean's bound, in multiples of the median norm (>= 1; checked
        by :class:`~ravnest_jax.swarm.AllReduce`).
      mean_error_feedback: each part owner carries what its encode of the mean dropped into the
        next round's mean (:class:`MeanResidual`).
      mean_codec: the codec of the mean (the result parts); ``None``: ``codec``.
    """

    name = "butterfly"

    def __init__(
        self,
        transport: Transport,
        rounds: Rounds,
        codec: str,
        codec_options: dict[str, Any],
        aggregator: str = "mean",
        clip_multiple: float | None = 2.0,
        mean_error_feedback: bool = False,
        mean_codec: str | None = None,
    ):
        self.aggregator, self.clip_multiple = aggregator, clip_multiple
        self.transport, self.rounds = transport, rounds
        self.codec, self.codec_options, self.timeouts = codec, codec_options, transport.timeouts
        self.peer_id = transport.peer_id
        self._other_manifest: set[str] = set()  # senders of another manifest, warned about once
        transport.route("PUT", PARTS, self._h_put_part)
        transport.route("GET", CONTRIB, self._h_get_contrib)
        transport.route("PUT", RESULTS, self._h_put_result)
        transport.route("GET", PULL, self._h_get_result)
        self.mean_codec = mean_codec or codec
        self.mean_options = mean_codec_options(codec, self.mean_codec, codec_options)
        self.mean_residual = MeanResidual() if mean_error_feedback and self.mean_codec != "fp32" else None

    def attempt(self, round_: int, attempt: int) -> ButterflyAttempt:
        return ButterflyAttempt(round_, attempt)

    def wire(self) -> str:
        """Codec (and the mean's, if another), algorithm and aggregator (with its knob): part of
        the round manifest."""
        codec = self.codec if self.mean_codec == self.codec else f"{self.codec}>{self.mean_codec}"
        if self.aggregator == "clipped_mean":
            return f"{codec}/butterfly/clipped_mean:{self.clip_multiple!r}"
        return f"{codec}/butterfly"

    def prepare(self, st: ButterflyAttempt, layout: PartLayout, relayed: frozenset[str] = frozenset()) -> None:
        """The parts of this attempt. Client-only members (``relayed``) own no part while some
        member is reachable: they send their parts to the owners and *pull* the result parts
        (outbound requests), so that nothing of a round goes through the relay."""
        st.layout = layout
        owners = [g for g in st.group if g not in relayed]
        if owners and len(owners) < len(st.group):
            split = iter(layout.bounds(len(owners)))
            st.bounds = [next(split) if g not in relayed else (0, 0) for g in st.group]
            st.pullers = frozenset(g for g in st.group if g in relayed)
        else:
            st.bounds = layout.bounds(len(st.group))
            st.pullers = frozenset()
        st.lo, st.hi = st.bounds[st.me]
        st.algorithm = self.name

    # ------------------------------------------------------------------ server side
    async def _h_put_part(self, request: web.Request) -> web.Response:
        """Reduce-scatter: a member's part of the part this peer owns, added into the sum as it
        streams in."""
        sender, claimed, w, manifest = signed_part(self.transport, request)
        st, k = await self.rounds.wait_entered(request, "part")
        if k != st.me or self.peer_id in st.pullers:
            raise web.HTTPBadRequest(text=f"this peer owns part {st.me}, not {k}")
        if sender not in st.group or sender == self.peer_id:
            raise web.HTTPForbidden(text="sender is not in this round's group")
        if manifest != st.manifest:
            refuse_other_manifest(self._other_manifest, self.peer_id, sender, self.wire())
        fold = st.fold

        def decoder() -> RangeDecoder | _Abstained:
            if not w > 0:  # an abstainer's: counts once its empty body arrived whole
                return _Abstained(lambda: fold.expect(sender, w))
            fold.expect(sender, w)
            return RangeDecoder(st.layout, st.lo, st.hi, lambda j, v: fold.add(sender, j, v))

        _, _, nbytes = await receive(
            self.transport,
            request,
            claimed,
            decoder,
            key=sender,
            done=st.received,
            busy=st.receiving,
            closed=lambda: st.closed,
            limit=part_limit(st.codec, st.hi - st.lo),
            what="part",
            late="the reduce-scatter of this attempt is over",
            undo=lambda: fold.failed(sender),  # what it added (if anything) is no longer a valid sum
        )
        if w > 0 and sender not in fold.order:  # its part failed earlier: this copy was not added
            raise web.HTTPConflict(text="this sender's part failed earlier in this attempt")
        st.received[sender] = w
        st.bytes_in += nbytes
        if len(st.received) == len(st.group):
            st.complete.set()
        return self.transport.reply(request, {"ok": True})

    async def _h_get_contrib(self, request: web.Request) -> web.StreamResponse:
        """An owner pulls this member's part of its part again (its sum needs redoing): the same
        message this member sent it, from this member's contribution."""
        sender, _ = self.transport.verify(request)
        st, k = await self.rounds.wait_entered(request, "part")
        if st.algorithm != self.name or not 0 <= k < len(st.group) or k == st.me:
            raise web.HTTPBadRequest(text=f"bad part {k}")
        if sender != st.group[k]:
            raise web.HTTPForbidden(text="only the owner of a part pulls it")
        sent = st.sent_parts.get(k)
        if sent is None or st.gather_closed:
            raise web.HTTPConflict(text="no part of this attempt for that owner here")
        chunks, digest = sent
        out = await self.transport.serve(request, chunks, digest, f"its part of round {st.round}")
        st.served += body_nbytes(chunks)
        return out

    # ------------------------------------------------------------------ client side
    def _enter(self, st: ButterflyAttempt, inp: AttemptInput) -> bool:
        """This peer's side of the attempt before anything is sent: the output buffer, the sum
        of its own part (with its own values in it).
        Returns whether this peer is a puller (owns nothing)."""
        puller = self.peer_id in st.pullers
        st.out = np.empty(st.layout.n, np.float32)
        st.grid = st.layout.chunk_grid(st.lo, st.hi)
        if inp.weight > 0:
            st.own_chunk = inp.contrib.chunk_reader(st.lo, st.hi)
        else:  # an abstainer adds nothing to its own part either
            st.own_chunk = lambda a, b: np.zeros(b - a, np.float32)
        if not puller:
            st.fold = Fold(
                st.out[st.lo : st.hi],
                st.grid,
                st.group,
                self.peer_id,
                st.own_chunk,
                inp.weight,
                norms=self.aggregator == "clipped_mean",
            )
        st.received[self.peer_id] = inp.weight
        if len(st.received) == len(st.group) or puller:
            st.complete.set()
        st.entered.set()
        return puller

    async def run(self, st: ButterflyAttempt, inp: AttemptInput) -> Reduced:
        r, a, group, n = st.round, st.attempt, st.group, len(st.group)
        membership, deadline, stats = inp.membership, inp.deadline, inp.stats
        puller = self._enter(st, inp)

        # phase 1: reduce-scatter (push part k to owner k) -------------------------------------
        part_s = self.timeouts.part if inp.part_left is None else min(inp.part_left, self.timeouts.part)
        t_part = min(time.monotonic() + part_s, deadline)
        weight_s = repr(float(inp.weight))
        abstain = not inp.weight > 0  # missed its round: empty parts of weight 0
        sends = {}
        for k, owner in enumerate(group):
            if k == st.me or owner not in membership or owner in st.pullers:
                continue
            chunks = [b""] if abstain else inp.contrib.part(*st.bounds[k])
            digest = body_digest(chunks)
            st.sent_parts[k] = (chunks, digest)
            headers = {H_WEIGHT: weight_s, H_MANIFEST: st.manifest}
            sends[owner] = send(
                self.transport, st, membership[owner], "parts", k, chunks, digest, headers, t_part - time.monotonic()
            )

        def missing() -> set[str]:
            if st.fold is not None:  # members that left and never sent: nothing waits for them
                for g in self.rounds.gone(r, a) - set(st.received) - st.receiving:
                    st.fold.failed(g)
            return set() if puller else set(group) - set(st.received)

        await self.rounds.wait_phase(st, missing, st.complete, t_part, inp.arrive, inp.epoch)
        st.closed = True
        if st.fold is not None:
            st.fold.keep_only(st.received)
        # Optimistic all-gather: an owner that holds every member's part reduces over the whole
        # group and pushes the result now, while the gather vote decides the contributors; the
        # pushed parts carry the contributor set's tag, so one reduced over another set than the
        # decided one is never used (the owner then reduces and pushes again). The clipped mean
        # too: optimistically as if nobody were over the bound, the usual case; a decision that
        # clips someone has another tag, and the owner reduces again.
        mine: dict[str, Any] = {}
        if len(st.received) == n and st.fold is not None and st.fold.complete and not puller:
            self.push(st, inp, group, mine, contributors_tag(group))
        # a puller holds every member's (empty) part of its own
        vote: dict[str, Any] = {"received": sorted(group) if puller else sorted(st.received)}
        if self.aggregator == "clipped_mean":
            norms = st.fold.sqnorms if st.fold is not None else {}
            vote["sqnorms"] = {c: 0.0 for c in group} if puller else {c: norms.get(c, 0.0) for c in sorted(st.received)}
        if inp.state is not None:
            vote["state"] = list(inp.state)
        log.debug(
            "%s: round %d attempt %d: gather vote, parts from %d of %d",
            self.peer_id,
            r,
            a,
            len(st.received),
            n,
            extra={"rj_event": "gather_vote", "rj_round": r, "rj_attempt": a},
        )
        gather = await self.rounds.vote(r, inp.epoch, a, "gather", vote, deadline)
        log.debug(
            "%s: round %d attempt %d: gather decision %s",
            self.peer_id,
            r,
            a,
            gather.get("decision"),
            extra={"rj_event": "gather_decided", "rj_round": r, "rj_attempt": a, "rj_decision": gather.get("decision")},
        )
        for t in sends.values():
            if not t.done():
                t.cancel()
        for owner, t in sends.items():
            try:
                stats["sent"] += await t
            except asyncio.CancelledError:
                pass
            except Exception as e:  # noqa: BLE001 - the votes decide what counts
                log.info("%s: part to %s failed: %r", self.peer_id, owner, e)
        reduced = False
        try:
            diverged = self.rounds.gathered(gather)
            contributors = tuple(gather["contributors"])
            missing = [c for c in contributors if c not in st.received]
            if missing and not puller:  # cannot happen with an honest rendezvous
                raise RoundFail(f"contributors {missing} not received here")
            clipped = self._clip_factors(contributors, gather.get("norms")) if self.aggregator == "clipped_mean" else {}
            tag = contributors_tag(contributors, clipped)
            if puller:
                mine.update(tag=tag, digest="", total=np.float32(0.0))
            elif mine.get("tag") != tag:  # the optimistic result is not the round's
                pushes = [t for t in mine.get("pushes", ()) if not t.done()]
                for t in pushes:
                    t.cancel()
                if pushes:  # they send views of the output buffer that the new sum overwrites
                    await asyncio.wait(pushes)
                mine.clear()
                if await self._reduce(st, inp, contributors, clipped, stats):
                    self.push(st, inp, contributors, mine, tag)
                else:
                    mine.update(tag=tag, failed=True)
            mine["clipped"] = clipped
            out = await self.all_gather(st, inp, mine, tag, contributors, diverged)
            reduced = True
            return out
        finally:
            st.gather_closed = True
            for t in mine.get("pushes", ()):
                if not t.done():
                    t.cancel()
            st.fold, st.sent_parts = None, {}
            if not reduced:
                st.out = None  # a retry starts from a new buffer; a failure keeps nothing

    async def _reduce(
        self,
        st: ButterflyAttempt,
        inp: AttemptInput,
        contributors: tuple[str, ...],
        scales: dict[str, float],
        stats: dict,
    ) -> bool:
        """Makes this owner's sum the one the gather decision asks for: over ``contributors``
        with the clipped mean's ``scales``. The sum made while the parts arrived is used when it
        is exactly that one; else the contributors' parts are pulled again (each from its
        member) and summed anew. Returns False when that failed (a member did not answer in
        time): this owner then delivers no result and the commit vote leaves it out."""
        fold = st.fold
        assert fold is not None
        if not scales and fold.complete and set(fold.order) | fold.abstained == set(contributors):
            return True
        log.info(
            "%s: round %d attempt %d: pulling %d parts again (sum over %s, clipped %s)",
            self.peer_id,
            st.round,
            st.attempt,
            len([c for c in contributors if c != self.peer_id]),
            list(contributors),
            sorted(scales),
        )
        fold = Fold(st.out[st.lo : st.hi], st.grid, contributors, self.peer_id, st.own_chunk, inp.weight, scales)
        st.fold = fold
        t_end = min(time.monotonic() + self.timeouts.part, inp.deadline)
        for c in contributors:
            if c != self.peer_id:
                fold.expect(c, st.received[c])
        others = [c for c in contributors if c != self.peer_id and st.received[c] > 0]  # abstainers sent nothing
        got = await asyncio.gather(
            *(self._pull_part(st, c, fold, t_end, inp.membership) for c in others), return_exceptions=True
        )
        failed = {c: e for c, e in zip(others, got) if isinstance(e, BaseException)}
        if failed:
            log.info("%s: pulling parts again failed: %s", self.peer_id, {c: repr(e) for c, e in failed.items()})
            return False
        stats["received"] += sum(int(x) for x in got)
        return fold.complete

    async def _pull_part(
        self, st: ButterflyAttempt, member: str, fold: Fold, t_end: float, membership: dict[str, str]
    ) -> int:
        """Pulls ``member``'s part of this owner's part again, into ``fold``; returns its bytes."""
        dec = RangeDecoder(st.layout, st.lo, st.hi, lambda j, v: fold.add(member, j, v))
        try:
            await self.transport.get_stream(
                membership[member],
                CONTRIB.format(round=st.round, attempt=st.attempt, part=st.me),
                t_end - time.monotonic(),
                part_limit(st.codec, st.hi - st.lo),
                None,
                dec.feed,
            )
            dec.finish()
        except BaseException:
            fold.failed(member)
            raise
        return dec.nbytes

    def _clip_factors(self, contributors: tuple[str, ...], norms: Any) -> dict[str, float]:
        """The clipped mean's factors ``s_c`` (< 1) of :func:`clip_scales` from the decided norms."""
        if not isinstance(norms, dict) or not all(c in norms for c in contributors):
            raise RoundFail("the gather decision carries no contribution norms (rendezvous too old?)")
        try:
            norm_f = {c: float(norms[c]) for c in contributors}
        except (TypeError, ValueError):
            raise RoundFail("bad contribution norms in the gather decision") from None
        return clip_scales(norm_f, contributors, self.clip_multiple)

    # ------------------------------------------------------------------ all-gather
    def result_layout(self, st: ButterflyAttempt) -> PartLayout:
        """The layout of the result parts: the contribution's, in the mean's codec (same leaves,
        same block size, so the same parts and grid chunks)."""
        if self.mean_codec == st.layout.codec:
            return st.layout
        return PartLayout(self.mean_codec, st.layout.sizes, st.layout.block_size)  # cheap: a cumsum

    async def _h_put_result(self, request: web.Request) -> web.Response:
        """All-gather: owner k pushes its reduced part k, tagged with the contributor set it
        was reduced over; decoded into the output buffer as it streams in (a second version of
        the same part, reduced over another set, into a buffer of its own) and kept until this
        peer knows the round's contributors."""
        tag = request.headers.get(H_CONTRIB, "")
        manifest = request.headers.get(H_MANIFEST, "")
        sender, claimed = self.transport.verify(request, extra=f"{tag}|{manifest}")
        st, k = await self.rounds.wait_entered(request, "part")
        if not 0 <= k < len(st.group) or k == st.me:
            raise web.HTTPBadRequest(text=f"bad result part {k}")
        if sender != st.group[k]:
            raise web.HTTPForbidden(text="only the owner of a part pushes its result")
        if manifest != st.manifest or st.algorithm != self.name or not 1 <= len(tag) <= 64:
            raise web.HTTPBadRequest(text="result does not match the round manifest")
        lo, hi = st.bounds[k]
        claim = k not in st.out_claims  # the first version of part k: into the output buffer
        own: list[np.ndarray] = []  # another one (reduced over another set): into a buffer of its own

        def decoder() -> RangeDecoder:
            if claim:
                st.out_claims[k] = tag
            else:
                own.append(np.empty(hi - lo, np.float32))
            assert st.out is not None
            return RangeDecoder(self.result_layout(st), lo, hi, out=own[0] if own else st.out[lo:hi])

        def undo() -> None:
            if claim and st.out_claims.get(k) == tag:
                del st.out_claims[k]  # the region is free again (its contents are garbage)

        _, sha, nbytes = await receive(
            self.transport,
            request,
            claimed,
            decoder,
            key=(k, tag),
            done=st.results,
            busy=st.results_receiving,
            closed=lambda: st.gather_closed or st.out is None,
            limit=part_limit(self.mean_codec, hi - lo),
            what="result part",
            late="the all-gather of this attempt is over",
            undo=undo,
        )
        st.results[(k, tag)] = (own[0] if own else None, sha)
        st.bytes_in += nbytes
        st.result_arrived.set()
        return self.transport.reply(request, {"ok": True})

    async def all_gather(
        self,
        st: ButterflyAttempt,
        inp: AttemptInput,
        mine: dict[str, Any],
        tag: str,
        contributors: tuple[str, ...],
        diverged: tuple[str, ...],
    ) -> Reduced:
        """Phase 2: the result parts pushed to us by their owners (or pulled from them, by a
        client-only member), then the commit vote."""
        r, a, group, n, stats = st.round, st.attempt, st.group, len(st.group), inp.stats
        out = st.out
        assert out is not None
        shas = {st.me: mine.get("digest", "")}
        t_gather = min(time.monotonic() + self.timeouts.part, inp.deadline)
        others = [k for k in range(n) if k != st.me and group[k] not in st.pullers]
        pulls = [
            asyncio.ensure_future(self._pull(st, k, tag, inp.membership[group[k]], t_gather, mine))
            for k in (others if self.peer_id in st.pullers else ())
            if group[k] in inp.membership
        ]
        try:
            missing = lambda: {group[k] for k in others if (k, tag) not in st.results}  # noqa: E731
            await self.rounds.wait_phase(st, missing, st.result_arrived, t_gather)
        finally:
            for t in pulls:
                t.cancel()
        have = [k for k in others if (k, tag) in st.results]
        st.gather_closed = True
        for k in have:
            lo, hi = st.bounds[k]
            part, shas[k] = st.results[(k, tag)]
            if part is not None:  # another version was decoded into the output buffer first
                out[lo:hi] = part
        st.results.clear()
        failed_owners = sorted(group[k] for k in others if k not in have)
        ok = not failed_owners and not mine.get("failed")
        if failed_owners:
            log.info("%s: all-gather: no result part from %s", self.peer_id, failed_owners)
        stats["received"] += st.bytes_in
        st.bytes_in = 0
        # the result is a pure function of the encoded result parts: hash their digests (a
        # client-only member's empty part counts as "")
        digest = result_digest([shas.get(k, "") for k in range(n)]) if ok else ""
        commit_vote: dict[str, Any] = {"ok": ok, "digest": digest, "failed_owners": failed_owners}
        commit = await self.rounds.vote(r, inp.epoch, a, "commit", commit_vote, inp.deadline)
        # the pushes of this peer's result: by a commit every member has them (a push whose
        # answer is still on its way is waited for briefly); counted before, one still in
        # flight was left out (a butterfly of 2 reported half its bytes)
        pushes = [t for t in mine.get("pushes", ()) if not t.done()]
        if pushes:
            await asyncio.wait(pushes, timeout=1.0)
        for t in mine.get("pushes", ()):
            if t.done() and not t.cancelled() and t.exception() is None:
                stats["sent"] += t.result()
        stats["sent"] += st.served
        st.served = 0
        decided(commit, "commit")
        if not ok:  # pragma: no cover - the rendezvous commits only if everyone is ok
            raise RoundFail("all-gather failed here")
        if self.mean_residual is not None:
            self.mean_residual.commit(r, tag)
        clipped = mine.get("clipped", {}) if self.aggregator == "clipped_mean" else {}
        return Reduced(out, contributors, float(mine["total"]), digest, diverged, commit.get("next"), clipped=clipped)

    async def _pull(
        self, st: ButterflyAttempt, k: int, tag: str, address: str, t_end: float, mine: dict[str, Any]
    ) -> None:
        """A client-only member collects result part ``k`` (reduced over ``tag``) from its owner:
        one signed GET that the owner answers once it has reduced (a long poll), decoded into
        the output buffer as it streams in."""
        lo, hi = st.bounds[k]
        rest = PULL.format(round=st.round, attempt=st.attempt, part=k, tag=tag)
        layout = self.result_layout(st)
        out = st.out
        assert out is not None
        dst = out[lo:hi]
        while time.monotonic() < t_end:
            dec = RangeDecoder(layout, lo, hi, out=dst)
            try:
                sha, total = await self.transport.get_stream(
                    address, rest, t_end - time.monotonic(), part_limit(self.mean_codec, hi - lo), H_TOTAL, dec.feed
                )
                dec.finish()
                st.results[(k, tag)] = (None, sha)
                st.bytes_in += dec.nbytes
                mine["total"] = np.float32(float(total))  # the same sum on every owner
                st.result_arrived.set()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - retried until the deadline; the commit vote decides
                log.info("%s: pulling result part %d from %s failed: %r", self.peer_id, k, st.group[k], e)
                await asyncio.sleep(0.2)

    async def _h_get_result(self, request: web.Request) -> web.StreamResponse:
        """Owner side of a pull: answers with this peer's encoded result part for the tag once
        it has it (waits up to the part deadline)."""
        sender, _ = self.transport.verify(request)
        tag = request.match_info["tag"]
        st, k = await self.rounds.wait_entered(request, "part")
        if k != st.me or st.algorithm != self.name:
            raise web.HTTPBadRequest(text=f"this peer owns part {st.me}, not {k}")
        if sender not in st.pullers:
            raise web.HTTPForbidden(text="only a client-only member of this round pulls result parts")
        fut = st.my_results.setdefault(tag, asyncio.get_running_loop().create_future())
        try:
            data, digest, total = await asyncio.wait_for(asyncio.shield(fut), self.timeouts.part)
        except (TimeoutError, asyncio.CancelledError):
            raise web.HTTPConflict(text="no result part reduced over that contributor set") from None
        out = await self.transport.serve(request, data, digest, "a result part", (H_TOTAL, total))
        st.served += body_nbytes(data)
        return out

    def push(
        self, st: ButterflyAttempt, inp: AttemptInput, contributors: tuple[str, ...], mine: dict[str, Any], tag: str
    ) -> None:
        """This owner's mean over ``contributors`` (its sum, of the clipped contributions for the
        clipped mean, divided by their total weight), encoded once with the mean's codec in the
        pieces of the part, decoded back into the output buffer as every member decodes it, and
        pushed to every other member of ``inp.membership`` tagged ``tag`` (tasks in
        ``mine["pushes"]``); ``mine`` also gets the tag, digest and total weight."""
        out = st.out
        assert out is not None
        acc = out[st.lo : st.hi]
        total = st.fold.total_weight(contributors)
        if total > 0:  # 0: every contributor abstained (the sum is zeros; the round fails anyway)
            np.divide(acc, total, out=acc)  # the sum of the clipped mean holds the clipped contributions
        target = None
        if self.mean_residual is not None:
            ef_key = (st.layout.key(), st.lo, st.hi)
            carried = self.mean_residual.carried(ef_key)
            if carried is not None:
                np.add(acc, carried, out=acc)
            target = acc.copy()
        pieces, base = [], 0
        for _, a, b in st.layout.pieces(st.lo, st.hi):
            pieces.append(acc[base : base + b - a])
            base += b - a
        mean = host_pack(pieces, self.mean_codec, **self.mean_options)
        data = part_chunks(mean, PartLayout.of(mean), 0, st.hi - st.lo)  # a part's message, as members' parts are
        digest = body_digest(data)
        if self.mean_codec != "fp32":  # lossy: the owner keeps what the others decode
            dec = RangeDecoder(self.result_layout(st), st.lo, st.hi, out=acc)
            for c in data:
                dec.feed(c)
            dec.finish()
        if target is not None and self.mean_residual is not None:
            np.subtract(target, acc, out=target)  # what the encode dropped
            self.mean_residual.offer(st.round, tag, ef_key, target)
        fut = st.my_results.setdefault(tag, asyncio.get_running_loop().create_future())
        if not fut.done():  # for the client-only members that pull it
            fut.set_result((data, digest, repr(float(total))))
        t_end, membership = min(time.monotonic() + self.timeouts.part, inp.deadline), inp.membership
        headers = {H_CONTRIB: tag, H_MANIFEST: st.manifest}
        mine.update(
            tag=tag,
            digest=digest,
            total=total,
            pushes=[
                send(
                    self.transport, st, membership[g], "results", st.me, data, digest, headers, t_end - time.monotonic()
                )
                for k, g in enumerate(st.group)
                if k != st.me and g in membership and g not in st.pullers
            ],
        )
