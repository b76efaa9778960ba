"""Butterfly all-reduce: a reduce-scatter to part owners, then an all-gather of the reduced parts.

Every member owns one part of the vector (``part_bounds``); it receives that part from every
other member, reduces it over the contributors the gather vote decides, encodes the mean once and
pushes it to everybody. A member that misses the part deadline is left out of the mean (the other
members still finish the round); an owner that never delivers fails the attempt, and the
rendezvous retries it without that owner.

Aggregators (``aggregator=``): ``"mean"``, the weighted mean; ``"clipped_mean"``, the weighted
mean after scaling down every contribution whose L2 norm exceeds ``clip_multiple`` times the
round's median contribution norm (each owner reports the squared norm of every part it received
with its gather vote; the rendezvous sums them per contributor into whole-vector norms, which
the gather decision carries to every owner); ``"trimmed_mean"``, the coordinate-wise trimmed
mean (unweighted). Both need the owners to see every contribution of their part, which is why
they exist only here and not in the ring. The clipped mean reduces optimistically as if nobody
were clipped (the tag covers the clip factors) and again only when the decision clips someone;
the trimmed mean reduces after the gather decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
from aiohttp import web

from . import _auth
from ._allreduce import (
    CHUNK,
    check_aggregator,
    clip_scales,
    contributors_tag,
    max_message_bytes,
    mean_of_scaled,
    part_bounds,
    squared_norm,
    trimmed_mean,
)
from ._attempt import Attempt, AttemptInput, Reduced, Retry, RoundFail, Voter, decided, route_ints
from ._codec import PartDecoder, decode_part, encode_part
from ._http import stream_body
from ._transport import Transport
from ._types import Timeouts, result_digest

log = logging.getLogger("ravnest_jax.swarm")

H_WEIGHT = "X-RJ-Weight"
H_MANIFEST = "X-RJ-Manifest"
H_CONTRIB = "X-RJ-Contributors"  # tag of the contributor set a pushed result part was reduced over
H_TOTAL = "X-RJ-Total"  # a pulled result part's total weight (covered by the answer's signature)
PARTS = "/rounds/{round}/{attempt}/parts/{part}"
RESULTS = "/rounds/{round}/{attempt}/results/{part}"
PULL = "/rounds/{round}/{attempt}/results/{part}/{tag}"  # a client-only member collects a result part


class Butterfly:
    """The butterfly algorithm of one peer (see the module docstring).

    Args:
      transport: the peer's transport (its routes are added here).
      rounds: the round driver (votes, attempts, members that left).
      codec, codec_options: the wire codec of parts and results.
      timeouts: the part deadline (seconds) of each phase.
      aggregator: ``"mean"``, ``"clipped_mean"`` or ``"trimmed_mean"`` (module docstring).
      clip_multiple: the clipped mean's bound, in multiples of the median norm (>= 1).
      trim: the trimmed mean drops this many values at each end of every coordinate (>= 1).
    """

    name = "butterfly"

    def __init__(
        self,
        transport: Transport,
        rounds: Voter,
        codec: str,
        codec_options: dict[str, Any],
        timeouts: Timeouts,
        aggregator: str = "mean",
        clip_multiple: float = 2.0,
        trim: int = 1,
    ):
        check_aggregator(aggregator, clip_multiple, trim)
        self.aggregator, self.clip_multiple, self.trim = aggregator, float(clip_multiple), int(trim)
        self.transport, self.rounds = transport, rounds
        self.codec, self.codec_options, self.timeouts = codec, codec_options, timeouts
        self.peer_id = transport.peer_id
        self._scratch = np.empty(0, np.float32)  # own weighted part + the mean, reused
        transport.route("PUT", PARTS, self._h_put_part)
        transport.route("PUT", RESULTS, self._h_put_result)
        transport.route("GET", PULL, self._h_get_result)

    def wire(self) -> str:
        """Codec, algorithm and aggregator (with its knob): part of the round manifest."""
        if self.aggregator == "clipped_mean":
            return f"{self.codec}/butterfly/clipped_mean:{self.clip_multiple!r}"
        if self.aggregator == "trimmed_mean":
            return f"{self.codec}/butterfly/trimmed_mean:{self.trim}"
        return f"{self.codec}/butterfly"

    def prepare(self, st: Attempt, n_elements: int, relayed: frozenset[str] = frozenset()) -> None:
        """The parts of this attempt. Client-only members (``relayed``) own no part while some
        member is reachable: they send their parts to the owners and *pull* the result parts
        (outbound requests), so that nothing of a round goes through the relay."""
        st.n_elements = n_elements
        owners = [g for g in st.group if g not in relayed]
        if owners and len(owners) < len(st.group):
            split = iter(part_bounds(n_elements, len(owners)))
            st.bounds = [next(split) if g not in relayed else (0, 0) for g in st.group]
            st.pullers = frozenset(g for g in st.group if g in relayed)
        else:
            st.bounds = part_bounds(n_elements, len(st.group))
            st.pullers = frozenset()
        st.lo, st.hi = st.bounds[st.me]
        st.algorithm = self.name

    # ------------------------------------------------------------------ server side
    async def _h_put_part(self, request: web.Request) -> web.Response:
        weight_s = request.headers.get(H_WEIGHT, "")
        manifest = request.headers.get(H_MANIFEST, "")
        sender, claimed = self.transport.verify(request, extra=f"{weight_s}|{manifest}")
        r, a, k = route_ints(request, "round", "attempt", "part")
        try:
            w = np.float32(float(weight_s))
        except ValueError:
            raise web.HTTPBadRequest(text="bad weight") from None
        if not (np.isfinite(w) and w > 0):
            raise web.HTTPBadRequest(text="weight must be finite and > 0")
        st = await self.rounds.wait_entered(r, a)
        if k != st.me:
            raise web.HTTPBadRequest(text=f"this peer owns part {st.me}, not {k}")
        if sender not in st.group or sender == self.peer_id:
            raise web.HTTPForbidden(text="sender is not in this round's group")
        if manifest != st.manifest:
            raise web.HTTPBadRequest(text="part does not match the round manifest (leaf names, shapes or codec differ)")
        if st.closed:
            raise web.HTTPConflict(text="too late: the reduce-scatter of this attempt is over")
        if sender in st.received or sender in st.receiving:
            raise web.HTTPConflict(text="duplicate part")
        length = st.hi - st.lo
        limit = max_message_bytes(length)
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        st.receiving.add(sender)
        try:
            dec = PartDecoder(name=f"part{k}", length=length, codec=st.codec, max_bytes=limit)
            vec, _ = await self.transport.read_body(request, dec, claimed, limit, lambda: st.closed)
            if st.closed:
                raise web.HTTPConflict(text="too late: the reduce-scatter of this attempt is over")
            if self.aggregator == "clipped_mean":
                st.sqnorms[sender] = squared_norm(vec)  # of the unweighted part
            if self.aggregator != "trimmed_mean":
                np.multiply(vec, w, out=vec)  # weighted in place, once (the decoder's own array)
            st.received[sender] = (w, vec)
            st.bytes_in += dec.nbytes
            if len(st.received) == len(st.group):
                st.complete.set()
        finally:
            st.receiving.discard(sender)
        return self.transport.reply(request, {"ok": True})

    async def _h_put_result(self, request: web.Request) -> web.Response:
        """All-gather: owner k pushes its reduced part k, tagged with the contributor set it
        was reduced over; kept until this peer knows the round's contributors."""
        tag = request.headers.get(H_CONTRIB, "")
        manifest = request.headers.get(H_MANIFEST, "")
        sender, claimed = self.transport.verify(request, extra=f"{tag}|{manifest}")
        r, a, k = route_ints(request, "round", "attempt", "part")
        st = await self.rounds.wait_entered(r, a)
        if not 0 <= k < len(st.group) or k == st.me:
            raise web.HTTPBadRequest(text=f"bad result part {k}")
        if sender != st.group[k]:
            raise web.HTTPForbidden(text="only the owner of a part pushes its result")
        if manifest != st.manifest or st.algorithm != self.name or not 1 <= len(tag) <= 64:
            raise web.HTTPBadRequest(text="result does not match the round manifest")
        if st.gather_closed:
            raise web.HTTPConflict(text="too late: the all-gather of this attempt is over")
        if (k, tag) in st.results:
            raise web.HTTPConflict(text="duplicate result part")
        lo, hi = st.bounds[k]
        limit = max_message_bytes(hi - lo)
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        dec = PartDecoder(name=f"result{k}", length=hi - lo, codec=st.codec, max_bytes=limit)
        vec, _ = await self.transport.read_body(request, dec, claimed, limit, lambda: st.gather_closed)
        if st.gather_closed:
            raise web.HTTPConflict(text="too late: the all-gather of this attempt is over")
        st.results[(k, tag)] = (vec, claimed)
        st.bytes_in += dec.nbytes
        st.result_arrived.set()
        return self.transport.reply(request, {"ok": True})

    # ------------------------------------------------------------------ client side
    def _send(self, st: Attempt, addr: str, kind: str, k: int, data: bytes, digest: str, headers: dict, timeout: float):
        extra = "|".join(headers.values())
        return asyncio.ensure_future(
            self.transport.put(
                addr,
                f"/rounds/{st.round}/{st.attempt}/{kind}/{k}",
                data,
                digest=digest,
                round_=st.round,
                extra=extra,
                headers=headers,
                timeout=timeout,
                kind=kind[:-1],  # "part" / "result"
            )
        )

    async def run(self, st: Attempt, inp: AttemptInput) -> Reduced | Retry:
        r, a, group, n = st.round, st.attempt, st.group, len(st.group)
        membership, deadline, stats = inp.membership, inp.deadline, inp.stats
        plen = st.hi - st.lo
        if self._scratch.size < 2 * plen:  # reused from round to round: its pages stay mapped
            self._scratch = np.empty(2 * plen, np.float32)
        if self.aggregator == "clipped_mean":
            st.sqnorms[self.peer_id] = squared_norm(inp.vec[st.lo : st.hi])
        if self.aggregator != "trimmed_mean":
            own = np.multiply(inp.vec[st.lo : st.hi], inp.weight, out=self._scratch[:plen])
        else:  # the trimmed mean works on the unweighted parts
            own = self._scratch[:plen]
            np.copyto(own, inp.vec[st.lo : st.hi])
        st.received[self.peer_id] = (inp.weight, own)
        puller = self.peer_id in st.pullers  # owns nothing: receives no part
        if len(st.received) == n or puller:
            st.complete.set()
        st.entered.set()

        # phase 1: reduce-scatter (push part k to owner k) -------------------------------------
        part_s = self.timeouts.part if inp.part_left is None else min(inp.part_left, self.timeouts.part)
        t_part = min(time.monotonic() + part_s, deadline)
        weight_s = repr(float(inp.weight))
        sends = {}
        for k, owner in enumerate(group):
            if k == st.me or owner not in membership or owner in st.pullers:
                continue
            lo, hi = st.bounds[k]
            data = encode_part(f"part{k}", inp.vec[lo:hi], self.codec, **self.codec_options)
            headers = {H_WEIGHT: weight_s, H_MANIFEST: st.manifest}
            sends[owner] = self._send(
                st, membership[owner], "parts", k, data, _auth.body_digest(data), headers, t_part - time.monotonic()
            )
            del data
        arrive = inp.arrive
        complete = asyncio.ensure_future(st.complete.wait())
        gone = self.rounds.gone_wait()
        try:
            while not complete.done():
                left = t_part - time.monotonic()
                if left <= 0 or set(group) - set(st.received) <= self.rounds.gone(r, a):
                    break  # the deadline, or every part still missing is from a member that left
                if gone.done():
                    gone = self.rounds.gone_wait()
                waits = {complete, gone} | ({arrive} if arrive is not None and not arrive.done() else set())
                done, _ = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if arrive is not None and arrive in done:
                    t_part = min(t_part, self.rounds.arrived(arrive, r, t_part))
        finally:
            complete.cancel()
            gone.cancel()
        st.closed = True
        # Optimistic all-gather: an owner that holds every member's part reduces over the whole
        # group and pushes the result now, while the gather vote decides the contributors; the
        # pushed parts carry the contributor set's tag, so one reduced over another set than the
        # decided one is never used (the owner then reduces and pushes again).
        mine: dict[str, Any] = {}
        # (the clipped mean too: optimistically as if nobody were over the bound, the usual case;
        # a decision that clips someone has another tag, and the owner reduces again)
        if len(st.received) == n and self.aggregator != "trimmed_mean" and not puller:
            self._reduce_and_push(st, group, membership, deadline, mine, contributors_tag(group))
        # a puller holds every member's (empty) part of its own
        vote: dict[str, Any] = {"received": sorted(group) if puller else sorted(st.received)}
        if self.aggregator == "clipped_mean":
            vote["sqnorms"] = {c: 0.0 for c in group} if puller else {c: st.sqnorms[c] for c in sorted(st.received)}
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
        try:
            retry = decided(gather, "ok")
            if retry is not None:
                return retry
            contributors = tuple(gather["contributors"])
            diverged = tuple(str(d) for d in gather.get("diverged") or ())
            self.rounds.note_diverged(diverged)
            missing = [c for c in contributors if c not in st.received]
            if missing and not puller:  # cannot happen with an honest rendezvous
                raise RoundFail(f"contributors {missing} not received here")
            clipped = (
                self._apply_clip(st, contributors, gather.get("norms"), puller)
                if self.aggregator == "clipped_mean"
                else {}
            )
            tag = contributors_tag(contributors, clipped)
            if puller:
                mine.update(tag=tag, digest="", total=np.float32(0.0), out=np.empty(st.n_elements, np.float32))
            elif mine.get("tag") != tag:  # the optimistic result is not the round's
                for t in mine.get("pushes", ()):
                    t.cancel()
                mine.clear()
                self._reduce_and_push(st, contributors, membership, deadline, mine, tag)
            mine["clipped"] = clipped
            st.received.clear()
            st.sqnorms.clear()
            return await self._all_gather(st, inp, mine, tag, contributors, diverged)
        finally:
            st.gather_closed = True
            for t in mine.get("pushes", ()):
                if not t.done():
                    t.cancel()

    async def _all_gather(
        self,
        st: Attempt,
        inp: AttemptInput,
        mine: dict[str, Any],
        tag: str,
        contributors: tuple[str, ...],
        diverged: tuple[str, ...],
    ) -> Reduced | Retry:
        """Phase 2: the result parts pushed to us by their owners (or pulled from them, by a
        client-only member), then the commit vote."""
        r, a, group, n, stats = st.round, st.attempt, st.group, len(st.group), inp.stats
        out = mine.pop("out")
        shas = {st.me: mine["digest"]}
        t_gather = min(time.monotonic() + self.timeouts.part, inp.deadline)
        others = [k for k in range(n) if k != st.me and group[k] not in st.pullers]
        pulls = [
            asyncio.ensure_future(self._pull(st, k, tag, inp.membership[group[k]], t_gather, mine))
            for k in (others if self.peer_id in st.pullers else ())
            if group[k] in inp.membership
        ]
        try:
            have = await self._wait_results(st, others, tag, t_gather)
        finally:
            for t in pulls:
                t.cancel()
        st.gather_closed = True
        for k in have:
            lo, hi = st.bounds[k]
            part, shas[k] = st.results[(k, tag)]
            out[lo:hi] = part
        st.results.clear()
        failed_owners = sorted(group[k] for k in others if k not in have)
        ok = not failed_owners
        if not ok:
            log.info("%s: all-gather: no result part from %s", self.peer_id, failed_owners)
        stats["received"] += st.bytes_in
        st.bytes_in = 0
        # the result is a pure function of the encoded result parts: hash their digests (a
        # client-only member's empty part counts as "")
        digest = result_digest([shas.get(k, "") for k in range(n)]) if ok else ""
        commit_vote: dict[str, Any] = {"ok": ok, "digest": digest, "failed_owners": failed_owners}
        if self.aggregator == "trimmed_mean":
            commit_vote["trimmed"] = mine.get("trimmed", {})
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
        retry = decided(commit, "commit")
        if retry is not None:
            return retry
        if not ok:  # pragma: no cover - the rendezvous commits only if everyone is ok
            raise RoundFail("all-gather failed here")
        robust: dict[str, dict[str, float]] = {}
        if self.aggregator == "clipped_mean":
            robust["clipped"] = mine.get("clipped", {})
        elif self.aggregator == "trimmed_mean":  # fraction of all coordinates dropped, per contributor
            tally = commit.get("trimmed") or {}
            robust["trimmed"] = {
                str(c): float(k) / max(1, st.n_elements) for c, k in sorted(tally.items()) if c in contributors
            }
        return Reduced(out, contributors, float(mine["total"]), digest, diverged, commit.get("next"), **robust)

    async def _wait_results(self, st: Attempt, others: list[int], tag: str, t_gather: float) -> list[int]:
        """Waits until every result part of ``others`` with ``tag`` is in, the deadline, or the
        owners still missing left the run; returns the parts that are in."""
        r, a, group = st.round, st.attempt, st.group
        while True:
            have = [k for k in others if (k, tag) in st.results]
            left = t_gather - time.monotonic()
            if (
                len(have) == len(others)
                or left <= 0
                or {group[k] for k in others if k not in have} <= self.rounds.gone(r, a)
            ):
                return have  # complete, the deadline, or the owners still missing left the run
            st.result_arrived.clear()
            arrived = asyncio.ensure_future(st.result_arrived.wait())
            gone = self.rounds.gone_wait()
            try:
                await asyncio.wait({arrived, gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrived.cancel()
                gone.cancel()

    async def _pull(self, st: Attempt, k: int, tag: str, address: str, t_end: float, mine: dict[str, Any]) -> None:
        """A client-only member collects result part ``k`` (reduced over ``tag``) from its owner:
        one signed GET that the owner answers once it has reduced (a long poll)."""
        lo, hi = st.bounds[k]
        rest = PULL.format(round=st.round, attempt=st.attempt, part=k, tag=tag)
        while time.monotonic() < t_end:
            try:
                data, total = await self.transport.get_signed(
                    address, rest, t_end - time.monotonic(), max_message_bytes(hi - lo), H_TOTAL
                )
                vec = decode_part(data, name=f"result{k}", length=hi - lo, codec=st.codec)
                st.results[(k, tag)] = (vec, _auth.body_digest(data))
                st.bytes_in += len(data)
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
        r, a, k = route_ints(request, "round", "attempt", "part")
        tag = request.match_info["tag"]
        st = await self.rounds.wait_entered(r, a)
        if k != st.me or st.algorithm != self.name:
            raise web.HTTPBadRequest(text=f"this peer owns part {st.me}, not {k}")
        if sender not in st.pullers:
            raise web.HTTPForbidden(text="only a client-only member of this round pulls result parts")
        fut = st.my_results.setdefault(tag, asyncio.get_running_loop().create_future())
        try:
            data, digest, total = await asyncio.wait_for(asyncio.shield(fut), self.timeouts.part)
        except (TimeoutError, asyncio.CancelledError):
            raise web.HTTPConflict(text="no result part reduced over that contributor set") from None
        headers = _auth.sign(
            self.transport.token,
            method="RESPONSE",
            path=request.path,
            run_id=self.transport.run_id,
            peer=self.peer_id,
            body_digest=digest,
            extra=total,
        )
        headers[H_TOTAL] = total
        out = await stream_body(request, headers, data, CHUNK)
        st.served += len(data)
        return out

    def _apply_clip(self, st: Attempt, contributors: tuple[str, ...], norms: Any, puller: bool) -> dict[str, float]:
        """Scales the (weighted) parts of the clipped contributors in place by their factor
        ``s_c`` of :func:`clip_scales` from the decided norms (a puller holds no part).
        Returns the factors < 1."""
        if not isinstance(norms, dict) or not all(c in norms for c in contributors):
            raise RoundFail("the gather decision carries no contribution norms (rendezvous too old?)")
        try:
            norm_f = {c: float(norms[c]) for c in contributors}
        except (TypeError, ValueError):
            raise RoundFail("bad contribution norms in the gather decision") from None
        scales = clip_scales(norm_f, contributors, self.clip_multiple)
        for c in () if puller else scales:
            vec = st.received[c][1]
            np.multiply(vec, np.float32(scales[c]), out=vec)
        return scales

    def _reduce_and_push(
        self,
        st: Attempt,
        contributors: tuple[str, ...],
        membership: dict[str, str],
        deadline: float,
        mine: dict[str, Any],
        tag: str,
    ) -> None:
        """Reduce own part over ``contributors``, encode it once, and push it to every other
        member tagged ``tag`` (tasks in ``mine["pushes"]``); ``mine`` also gets the tag,
        digest, total weight and the round's output buffer with this part filled in."""
        plen = st.hi - st.lo
        if self.aggregator == "trimmed_mean":
            mean, mine["trimmed"] = trimmed_mean(st.received, contributors, self.trim)
            total = np.float32(0.0)
            for c in sorted(contributors):
                total = np.float32(total + np.float32(st.received[c][0]))
        else:  # mean, or the clipped mean (parts weighted and clipped by _apply_clip)
            mean, total = mean_of_scaled(st.received, contributors, out=self._scratch[plen : 2 * plen])
        data = encode_part(f"result{st.me}", mean, self.codec, **self.codec_options)
        digest = _auth.body_digest(data)
        fut = st.my_results.setdefault(tag, asyncio.get_running_loop().create_future())
        if not fut.done():  # for the client-only members that pull it
            fut.set_result((data, digest, repr(float(total))))
        out = np.empty(st.n_elements, dtype=np.float32)
        if self.codec == "fp32":  # lossless: decode(encode(mean)) == mean bit for bit
            out[st.lo : st.hi] = mean
        else:
            out[st.lo : st.hi] = decode_part(data, name=f"result{st.me}", length=plen, codec=self.codec)
        del mean
        t_end = min(time.monotonic() + self.timeouts.part, deadline)
        headers = {H_CONTRIB: tag, H_MANIFEST: st.manifest}
        mine.update(
            tag=tag,
            digest=digest,
            total=total,
            out=out,
            pushes=[
                self._send(st, membership[g], "results", st.me, data, digest, headers, t_end - time.monotonic())
                for k, g in enumerate(st.group)
                if k != st.me and g in membership and g not in st.pullers
            ],
        )
