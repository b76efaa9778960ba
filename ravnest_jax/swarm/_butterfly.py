"""Butterfly all-reduce: a reduce-scatter to part owners, then an all-gather of the reduced parts.

Every member owns one part of the vector (``part_bounds``); it receives that part from every
other member, reduces it over the contributors the gather vote decides, encodes the mean once and
pushes it to everybody. A member that misses the part deadline is left out of the mean (the other
members still finish the round); an owner that never delivers fails the attempt, and the
rendezvous retries it without that owner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
from aiohttp import web

from . import _auth
from ._allreduce import contributors_tag, max_message_bytes, mean_of_scaled, part_bounds
from ._attempt import Attempt, AttemptInput, Reduced, Retry, RoundFail, Voter, decided, route_ints
from ._codec import PartDecoder, decode_part, encode_part
from ._transport import Transport
from ._types import Timeouts, result_digest

log = logging.getLogger("ravnest_jax.swarm")

H_WEIGHT = "X-RJ-Weight"
H_MANIFEST = "X-RJ-Manifest"
H_CONTRIB = "X-RJ-Contributors"  # tag of the contributor set a pushed result part was reduced over
PARTS = "/rounds/{round}/{attempt}/parts/{part}"
RESULTS = "/rounds/{round}/{attempt}/results/{part}"


class Butterfly:
    """The butterfly algorithm of one peer (see the module docstring).

    Args:
      transport: the peer's transport (its routes are added here).
      rounds: the round driver (votes, attempts, members that left).
      codec, codec_options: the wire codec of parts and results.
      timeouts: the part deadline (seconds) of each phase.
    """

    name = "butterfly"

    def __init__(
        self, transport: Transport, rounds: Voter, codec: str, codec_options: dict[str, Any], timeouts: Timeouts
    ):
        self.transport, self.rounds = transport, rounds
        self.codec, self.codec_options, self.timeouts = codec, codec_options, timeouts
        self.peer_id = transport.peer_id
        self._scratch = np.empty(0, np.float32)  # own weighted part + the mean, reused
        transport.route("PUT", PARTS, self._h_put_part)
        transport.route("PUT", RESULTS, self._h_put_result)

    def wire(self) -> str:
        return f"{self.codec}/butterfly"

    def prepare(self, st: Attempt, n_elements: int) -> None:
        st.bounds = part_bounds(n_elements, len(st.group))
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
        own = np.multiply(inp.vec[st.lo : st.hi], inp.weight, out=self._scratch[:plen])
        st.received[self.peer_id] = (inp.weight, own)
        if len(st.received) == n:
            st.complete.set()
        st.entered.set()

        # phase 1: reduce-scatter (push part k to owner k) -------------------------------------
        part_s = self.timeouts.part if inp.part_left is None else min(inp.part_left, self.timeouts.part)
        t_part = min(time.monotonic() + part_s, deadline)
        weight_s = repr(float(inp.weight))
        sends = {}
        for k, owner in enumerate(group):
            if k == st.me or owner not in membership:
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
        if len(st.received) == n:
            self._reduce_and_push(st, group, membership, deadline, mine)
        vote: dict[str, Any] = {"received": sorted(st.received)}
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
            if missing:  # cannot happen with an honest rendezvous
                raise RoundFail(f"contributors {missing} not received here")
            tag = contributors_tag(contributors)
            if mine.get("tag") != tag:  # the optimistic result is not the round's
                for t in mine.get("pushes", ()):
                    t.cancel()
                mine.clear()
                self._reduce_and_push(st, contributors, membership, deadline, mine)
            st.received.clear()
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
        """Phase 2: the result parts pushed to us by their owners, then the commit vote."""
        r, a, group, n, stats = st.round, st.attempt, st.group, len(st.group), inp.stats
        out = mine.pop("out")
        shas = {st.me: mine["digest"]}
        t_gather = min(time.monotonic() + self.timeouts.part, inp.deadline)
        others = [k for k in range(n) if k != st.me]
        while True:
            have = [k for k in others if (k, tag) in st.results]
            left = t_gather - time.monotonic()
            if (
                len(have) == len(others)
                or left <= 0
                or {group[k] for k in others if k not in have} <= self.rounds.gone(r, a)
            ):
                break  # complete, the deadline, or the owners still missing left the run
            st.result_arrived.clear()
            arrived = asyncio.ensure_future(st.result_arrived.wait())
            gone = self.rounds.gone_wait()
            try:
                await asyncio.wait({arrived, gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrived.cancel()
                gone.cancel()
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
        # the result is a pure function of the encoded result parts: hash their digests
        digest = result_digest([shas[k] for k in range(n)]) if ok else ""
        commit = await self.rounds.vote(
            r, inp.epoch, a, "commit", {"ok": ok, "digest": digest, "failed_owners": failed_owners}, inp.deadline
        )
        # the pushes of this peer's result: by a commit every member has them (a push whose
        # answer is still on its way is waited for briefly); counted before, one still in
        # flight was left out (a butterfly of 2 reported half its bytes)
        pushes = [t for t in mine.get("pushes", ()) if not t.done()]
        if pushes:
            await asyncio.wait(pushes, timeout=1.0)
        for t in mine.get("pushes", ()):
            if t.done() and not t.cancelled() and t.exception() is None:
                stats["sent"] += t.result()
        retry = decided(commit, "commit")
        if retry is not None:
            return retry
        if not ok:  # pragma: no cover - the rendezvous commits only if everyone is ok
            raise RoundFail("all-gather failed here")
        return Reduced(out, contributors, float(mine["total"]), digest, diverged, commit.get("next"))

    def _reduce_and_push(
        self,
        st: Attempt,
        contributors: tuple[str, ...],
        membership: dict[str, str],
        deadline: float,
        mine: dict[str, Any],
    ) -> None:
        """Reduce own part over ``contributors``, encode it once, and push it to every other
        member (tasks in ``mine["pushes"]``); ``mine`` also gets the tag, digest, total weight
        and the round's output buffer with this part filled in."""
        plen = st.hi - st.lo
        mean, total = mean_of_scaled(st.received, contributors, out=self._scratch[plen : 2 * plen])
        tag = contributors_tag(contributors)
        data = encode_part(f"result{st.me}", mean, self.codec, **self.codec_options)
        digest = _auth.body_digest(data)
        out = np.empty(st.bounds[-1][1], dtype=np.float32)
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
                if k != st.me and g in membership
            ],
        )
