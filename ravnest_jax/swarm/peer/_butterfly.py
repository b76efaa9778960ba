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
from typing import Any

import numpy as np
from aiohttp import web

from ..wire._codec import PartLayout, RangeDecoder
from ._allreduce import clip_scales, contributors_tag, part_limit
from ._attempt import (
    H_MANIFEST,
    H_WEIGHT,
    Attempt,
    AttemptInput,
    Reduced,
    RoundFail,
    receive,
    refuse_other_manifest,
    signed_part,
)
from ._fold import Fold
from ._gather import AllGather, send
from ._rounds import Rounds
from ._transport import Transport, body_digest, body_nbytes

log = logging.getLogger("ravnest_jax.swarm")

PARTS = "/rounds/{round}/{attempt}/parts/{part}"
CONTRIB = "/rounds/{round}/{attempt}/contrib/{part}"  # an owner pulls a member's part again


class Butterfly(AllGather):
    """The butterfly algorithm of one peer (see the module docstring; its all-gather is
    :class:`~ravnest_jax.swarm.peer._gather.AllGather`).

    Args:
      transport: the peer's transport (its routes are added here).
      rounds: the round driver (votes, attempts, members that left).
      codec, codec_options: the wire codec of parts and results (the part deadline of each phase
        is the transport's ``timeouts.part``, seconds).
      aggregator: ``"mean"`` or ``"clipped_mean"`` (module docstring).
      clip_multiple: the clipped mean's bound, in multiples of the median norm (>= 1; checked
        by :class:`~ravnest_jax.swarm.AllReduce`).
      mean_error_feedback: each part owner carries what its encode of the mean dropped into the
        next round's mean (``_gather.MeanResidual``).
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
        self._init_gather(mean_error_feedback, mean_codec)

    def wire(self) -> str:
        """Codec (and the mean's, if another), algorithm and aggregator (with its knob): part of
        the round manifest."""
        codec = self.codec if self.mean_codec == self.codec else f"{self.codec}>{self.mean_codec}"
        if self.aggregator == "clipped_mean":
            return f"{codec}/butterfly/clipped_mean:{self.clip_multiple!r}"
        return f"{codec}/butterfly"

    def prepare(self, st: Attempt, layout: PartLayout, relayed: frozenset[str] = frozenset()) -> None:
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

        def decoder() -> RangeDecoder:
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
    def _enter(self, st: Attempt, inp: AttemptInput) -> bool:
        """This peer's side of the attempt before anything is sent: the output buffer, the sum
        of its own part (with its own values in it).
        Returns whether this peer is a puller (owns nothing)."""
        puller = self.peer_id in st.pullers
        st.out = np.empty(st.layout.n, np.float32)
        st.grid = st.layout.chunk_grid(st.lo, st.hi)
        st.own_chunk = inp.contrib.chunk_reader(st.lo, st.hi)
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

    async def run(self, st: Attempt, inp: AttemptInput) -> Reduced:
        r, a, group, n = st.round, st.attempt, st.group, len(st.group)
        membership, deadline, stats = inp.membership, inp.deadline, inp.stats
        puller = self._enter(st, inp)

        # phase 1: reduce-scatter (push part k to owner k) -------------------------------------
        part_s = self.timeouts.part if inp.part_left is None else min(inp.part_left, self.timeouts.part)
        t_part = min(time.monotonic() + part_s, deadline)
        weight_s = repr(float(inp.weight))
        sends = {}
        for k, owner in enumerate(group):
            if k == st.me or owner not in membership or owner in st.pullers:
                continue
            chunks = inp.contrib.part(*st.bounds[k])
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

        await self.rounds.wait_phase(st, missing, st.complete, t_part, inp.arrive)
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
        self, st: Attempt, inp: AttemptInput, contributors: tuple[str, ...], scales: dict[str, float], stats: dict
    ) -> bool:
        """Makes this owner's sum the one the gather decision asks for: over ``contributors``
        with the clipped mean's ``scales``. The sum made while the parts arrived is used when it
        is exactly that one; else the contributors' parts are pulled again (each from its
        member) and summed anew. Returns False when that failed (a member did not answer in
        time): this owner then delivers no result and the commit vote leaves it out."""
        fold = st.fold
        assert fold is not None
        if not scales and fold.complete and set(fold.order) == set(contributors):
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
        others = [c for c in contributors if c != self.peer_id]
        for c in others:
            fold.expect(c, st.received[c])
        got = await asyncio.gather(
            *(self._pull_part(st, c, fold, t_end, inp.membership) for c in others), return_exceptions=True
        )
        failed = {c: e for c, e in zip(others, got) if isinstance(e, BaseException)}
        if failed:
            log.info("%s: pulling parts again failed: %s", self.peer_id, {c: repr(e) for c, e in failed.items()})
            return False
        stats["received"] += sum(int(x) for x in got)
        return fold.complete

    async def _pull_part(self, st: Attempt, member: str, fold: Fold, t_end: float, membership: dict[str, str]) -> int:
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
