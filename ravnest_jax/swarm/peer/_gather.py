"""The butterfly's all-gather: every part owner's mean, encoded once, pushed to every member (or
pulled by a client-only one) and decoded straight into the round's output buffer; then the
commit vote. :class:`AllGather` is a base of :class:`~ravnest_jax.swarm.peer._butterfly.Butterfly`,
which runs the reduce-scatter before it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
from aiohttp import web

from ..wire._codec import PartLayout, RangeDecoder, host_pack, mean_codec_options, packed_to_chunks
from ..wire._types import result_digest
from ._allreduce import part_limit
from ._attempt import H_MANIFEST, Attempt, AttemptInput, Reduced, RoundFail, decided, receive
from ._transport import Body, Transport, body_digest, body_nbytes

log = logging.getLogger("ravnest_jax.swarm")

H_CONTRIB = "X-RJ-Contributors"  # tag of the contributor set a pushed result part was reduced over
H_TOTAL = "X-RJ-Total"  # a pulled result part's total weight (covered by the answer's signature)
RESULTS = "/rounds/{round}/{attempt}/results/{part}"
PULL = "/rounds/{round}/{attempt}/results/{part}/{tag}"  # a client-only member collects a result part


def send(
    transport: Transport,
    st: Attempt,
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


class AllGather:
    """The all-gather half of one peer's butterfly (see the module docstring), a base of
    ``Butterfly``, whose constructor sets what it uses (transport, rounds, codec, its options,
    timeouts, aggregator, peer id, name) and calls :meth:`_init_gather`."""

    def _init_gather(self, mean_error_feedback: bool, mean_codec: str | None) -> None:
        """``mean_error_feedback``: keep a :class:`MeanResidual` of this peer's part (lossy codecs).
        ``mean_codec``: the codec of the result parts (the mean), ``None``: ``codec``; a block codec
        of the same block size as a block ``codec`` (checked by the swarm)."""
        self.mean_codec = mean_codec or self.codec
        self.mean_options = mean_codec_options(self.codec, self.mean_codec, self.codec_options)
        self.mean_residual = MeanResidual() if mean_error_feedback and self.mean_codec != "fp32" else None
        self.transport.route("PUT", RESULTS, self._h_put_result)
        self.transport.route("GET", PULL, self._h_get_result)

    def result_layout(self, st: Attempt) -> PartLayout:
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
        st: Attempt,
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

    async def _pull(self, st: Attempt, k: int, tag: str, address: str, t_end: float, mine: dict[str, Any]) -> None:
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
        self, st: Attempt, inp: AttemptInput, contributors: tuple[str, ...], mine: dict[str, Any], tag: str
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
        data = packed_to_chunks(host_pack(pieces, self.mean_codec, **self.mean_options))
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
