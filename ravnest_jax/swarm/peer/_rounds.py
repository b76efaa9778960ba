"""The round driver of one peer: begins a round with the rendezvous, runs its attempts with the
all-reduce algorithm, votes, and turns the outcome into a :class:`RoundRecord`.

Also the part owner's bookkeeping every algorithm shares: the open attempts by ``(round,
attempt)`` (a faster member's request may arrive before this peer entered the attempt), and the
members the rendezvous reports as gone (a phase stops waiting for them).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from ..wire._http import HTTPStatusError
from ..wire._relay import is_relay_address
from ..wire._types import RoundFailed, RoundRecord
from ._attempt import Algorithm, Attempt, AttemptInput, Reduced, Retry, RoundFail, RoundUnknown, decided, route_ints
from ._contrib import Contribution
from ._transport import Transport

log = logging.getLogger("ravnest_jax.swarm")

MAX_EARLY_PARTS = 64  # part requests at most that wait for this peer to begin their round
GC_GENERATION = 1  # collected after every round (cheap: young objects only)


class Rounds:
    """Rounds of one peer, one at a time, in call order (see the module docstring).

    Args:
      transport: the peer's transport (its ``timeouts``: round, part and grace deadlines, in
        seconds, and the attempt limit).
      codec: the wire codec of the rounds (recorded in every attempt and record).
      hello: returns this peer's registration payload (id, address, last round, info).
      spawn: starts a background task that the swarm's close cancels.
    """

    def __init__(
        self,
        transport: Transport,
        codec: str,
        hello: Callable[[], dict[str, Any]],
        spawn: Callable[[Any], asyncio.Task[Any]],
    ):
        self.transport, self.timeouts, self.codec = transport, transport.timeouts, codec
        self.peer_id = transport.peer_id
        self._hello, self._spawn = hello, spawn
        self.algorithm: Algorithm | None = None  # set by the swarm (the algorithm needs us first)
        self.attempts: dict[tuple[int, int], Attempt] = {}
        self.last_round = -1
        self.current_round = -1
        self.diverged: set[str] = set()  # peers the last round found diverged: no state source
        self._early_parts = 0  # requests waiting for this peer to begin their round
        self._next: dict[str, Any] | None = None  # the next round, handed out with a commit
        self._lock = asyncio.Lock()
        # (round, attempt) -> members the rendezvous says left; the event is set when that grows
        self._gone: dict[tuple[int, int], set[str]] = {}
        self._gone_event = asyncio.Event()

    # ------------------------------------------------------------------ shared bookkeeping
    def note_left(self, left: Any) -> None:
        """Members of running attempts that left the run (from a heartbeat answer)."""
        if not isinstance(left, list):
            return
        changed = False
        for item in left:
            if isinstance(item, list) and len(item) == 3 and all(isinstance(x, int) for x in item[:2]):
                key = (int(item[0]), int(item[1]))
                if key in self.attempts and str(item[2]) not in self._gone.setdefault(key, set()):
                    self._gone[key].add(str(item[2]))
                    changed = True
        for key in [k for k in self._gone if k not in self.attempts]:
            del self._gone[key]
        if changed:
            self._gone_event.set()
            self._gone_event = asyncio.Event()

    def gone(self, r: int, a: int) -> set[str]:
        """The members of attempt ``a`` of round ``r`` that left the run (:meth:`note_left`)."""
        return self._gone.get((r, a), set())

    def left_event(self) -> asyncio.Event:
        """Set when a heartbeat answer names a member that left a running attempt (the next
        change sets a new event: ask again after each)."""
        return self._gone_event

    async def wait_phase(
        self,
        st: Attempt,
        missing: Callable[[], set[str]],
        event: asyncio.Event,
        t_end: float,
        arrive: asyncio.Task[Any] | None = None,
        epoch: str | None = None,
    ) -> None:
        """Waits until no member is ``missing()`` (asked again whenever ``event`` is set), until
        ``t_end``, or until every member still missing left the run (:meth:`note_left`).
        ``arrive``: the arrival request of a round handed out with the last commit (in the
        rendezvous epoch ``epoch``): its answer may bring ``t_end`` forward (the round's part
        clock started earlier elsewhere), or end the wait: the round went on without this
        attempt (it ended, was retried, or is not this process'), which the vote then says."""
        while not missing() <= self.gone(st.round, st.attempt) and (left := t_end - time.monotonic()) > 0:
            event.clear()
            waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._gone_event.wait())}
            try:
                done, _ = await asyncio.wait(
                    waits | ({arrive} if arrive is not None and not arrive.done() else set()),
                    timeout=left,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                for t in waits:
                    t.cancel()
            if arrive is not None and arrive in done:
                res = arrive.result()
                if res.get("round") == st.round:
                    t_end = min(t_end, time.monotonic() + float(res.get("part_left", self.timeouts.part)))
                elif res.get("epoch") == epoch and "round" in res:
                    # the round ended, was retried, or is not this process' (it hung past its
                    # eviction): nothing more comes for this attempt; the vote says what happened
                    log.info("%s: round %d went on without this attempt: stops waiting", self.peer_id, st.round)
                    return

    def gathered(self, gather: dict[str, Any]) -> tuple[str, ...]:
        """Checks a gather decision (:func:`decided`); returns the peers it found diverged (noted
        in :attr:`diverged`)."""
        decided(gather, "ok")
        diverged = tuple(str(d) for d in gather.get("diverged") or ())
        self.diverged = set(diverged)
        return diverged

    async def wait_entered(self, request: web.Request, *names: str) -> tuple[Any, ...]:
        """``(attempt, *ints)``: the attempt of ``request``'s round and attempt path fields once this
        peer entered it (a request of a faster member waits), and the integer path fields ``names``.

        Raises:
          web.HTTPBadRequest: a path field is not an integer. web.HTTPConflict: the round is not
          open here (over, or too far ahead), or this peer did not enter it within a part
          deadline, or is closing.
        """
        r, a, *ints = route_ints(request, "round", "attempt", *names)
        ahead = lambda: r > max(self.current_round, self.last_round) + 2  # noqa: E731
        st = self.attempts.get((r, a))
        if st is None and ahead():
            # Further ahead than this peer has seen: a new process (joined, restarted) learns the
            # swarm's round number only from its own begin, which may answer a moment after a
            # faster member's part arrives. Wait for it (bounded in time and in number of such
            # requests) rather than refuse the part and be dropped from the round as unreachable.
            if self._early_parts >= MAX_EARLY_PARTS:
                raise web.HTTPConflict(text=f"round {r} is not open here")
            self._early_parts += 1
            try:
                until = time.monotonic() + self.timeouts.part
                while ahead() and (r, a) not in self.attempts and time.monotonic() < until:
                    await asyncio.sleep(0.01)
            finally:
                self._early_parts -= 1
            st = self.attempts.get((r, a))
        if st is None:
            if r <= self.last_round or ahead():
                raise web.HTTPConflict(text=f"round {r} is not open here")
            assert self.algorithm is not None
            st = self.attempts[(r, a)] = self.algorithm.attempt(r, a)
        if not st.entered.is_set():
            try:
                await asyncio.wait_for(st.entered.wait(), self.timeouts.part)
            except TimeoutError:
                raise web.HTTPConflict(text=f"round {r} attempt {a} not started here") from None
        if st.closed and not st.group:
            raise web.HTTPConflict(text="peer is closing")
        return (st, *ints)

    def close_all(self) -> None:
        """The swarm closes: every open attempt refuses further requests."""
        for st in self.attempts.values():
            st.close()

    # ------------------------------------------------------------------ talking to the rendezvous
    async def _ask(
        self, what: str, refused: str, rest: str, payload: dict, deadline: float, round_: int | None = None
    ) -> Any:
        """A rendezvous request retried on connection errors until ``deadline``.

        Raises:
          RoundFail: the deadline passed, or the rendezvous refused (an HTTP error)."""
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RoundFail(f"no {what} from the rendezvous before the round deadline ({last!r})")
            if "wait_s" in payload:
                payload["wait_s"] = max(left - 0.5, 0.0)
            try:
                return await self.transport.rendezvous("POST", rest, payload, left, round_=round_)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = e  # rendezvous down or restarting: try again until the deadline
                await asyncio.sleep(min(0.25, max(left, 0)))
            except (HTTPStatusError, PermissionError) as e:
                raise RoundFail(f"rendezvous refused the {refused}: {e}") from e

    async def vote(
        self, r: int, epoch: str, a: int, phase: str, data: dict[str, Any], deadline: float
    ) -> dict[str, Any]:
        """This peer's ``phase`` vote (``"gather"`` / ``"commit"``) of attempt ``a``; the decision."""
        payload = {"peer_id": self.peer_id, "epoch": epoch, "attempt": a, "phase": phase, "data": data}
        return await self._ask(f"{phase} decision", f"{phase} vote", f"/rounds/{r}/vote", payload, deadline, round_=r)

    async def _begin(self, deadline: float, expected: int | None = None) -> dict[str, Any]:
        after = self.last_round if expected is None else expected - 1
        payload = {
            **self._hello(),
            "after": after,
            "part_s": self.timeouts.part,
            "grace_s": self.timeouts.grace,
            "max_attempts": self.timeouts.max_attempts,
            "expect": expected is not None,
            "wait_s": 0.0,
        }
        while True:
            res = await self._ask("round", "round", "/rounds/begin", payload, deadline)
            if res.get("missed") is not None:
                raise RoundFail(
                    f"missed round {expected}: the swarm is at round {res['missed']}, running without this peer"
                )
            if res.get("round") is not None:
                return res

    async def _arrival(self, deadline: float, r: int) -> dict[str, Any]:
        """Tells the rendezvous this member is at round ``r`` (handed out with the last commit):
        the round's part clock starts. Returns the answer (``{}`` when none came)."""
        payload = {**self._hello(), "after": r - 1, "arrive": r}
        try:
            return await self._ask("arrival answer", "arrival", "/rounds/begin", payload, deadline)
        except Exception as e:  # noqa: BLE001 - only a hint; the votes decide
            log.info("%s: arrival at round %d: %r", self.peer_id, r, e)
            return {}

    # ------------------------------------------------------------------ one round
    async def run(
        self,
        contrib: Contribution,
        manifest: str,
        expected: int | None = None,
    ) -> tuple[np.ndarray, RoundRecord]:
        """One round: the weighted mean of ``contrib`` (flat, float32) over the round's contributors.

        Raises:
          RoundFailed: the round failed on this peer (its record says why).
        """
        algorithm = self.algorithm
        assert algorithm is not None
        weight, state = contrib.weight, contrib.state
        async with self._lock:
            t0 = time.monotonic()
            deadline = t0 + self.timeouts.round
            stats = {"sent": 0, "received": 0}
            r, attempts, group = -1, 0, ()
            diverged: tuple[str, ...] = ()

            def record(ok: bool, **kw: Any) -> RoundRecord:
                return RoundRecord(
                    round=r,
                    ok=ok,
                    attempts=attempts,
                    group=group,
                    bytes_sent=stats["sent"],
                    bytes_received=stats["received"],
                    seconds=time.monotonic() - t0,
                    codec=self.codec,
                    algorithm=algorithm.name,
                    diverged=tuple(diverged),
                    **kw,
                )

            try:
                arrive: asyncio.Task[Any] | None = None
                nxt, self._next = self._next, None
                if (
                    nxt is not None
                    and self.peer_id in nxt["group"]
                    and int(nxt["round"]) > self.last_round
                    and (expected is None or expected == int(nxt["round"]))
                ):
                    # the rendezvous handed us this round's group with the last commit: start at
                    # once; the begin request only marks our arrival (it starts the round's
                    # clock) and, when its answer comes, tightens our part deadline (left to
                    # finish in the background: cancelling it would close a keep-alive
                    # connection to the rendezvous)
                    begin = nxt
                    arrive = self._spawn(
                        self._arrival(min(deadline, time.monotonic() + self.timeouts.part), int(nxt["round"]))
                    )
                else:
                    begin = await self._begin(deadline, expected)
                given = weight
                while True:  # once more in a restarted rendezvous' new epoch (see RoundUnknown)
                    r, epoch = int(begin["round"]), str(begin["epoch"])
                    log.debug(
                        "%s: round %d attempt %s with %s, %.3f s after the call%s",
                        self.peer_id,
                        r,
                        begin.get("attempt"),
                        begin.get("group"),
                        time.monotonic() - t0,
                        " (handed with the last commit)" if begin is nxt else "",
                    )
                    # not missed when every round since the expected one failed for everybody,
                    # or when this peer is the round's only member: nobody to be inconsistent
                    # with (a lone peer restarted from its checkpoint: it goes on from it)
                    missed = (
                        expected is not None
                        and r != expected
                        and not (r > expected and (begin.get("rounds_failed") or begin.get("group") == [self.peer_id]))
                    )
                    if expected is not None and r > expected and not missed and not begin.get("rounds_failed"):
                        # the only member: rounds expected..r-1 committed without this peer, and no
                        # live peer holds their state (their progress is not in the run any more)
                        log.warning(
                            "%s: rounds %d to %d ran without this peer (it resumed from an older state) and "
                            "no live peer holds their state: the run goes on from this peer's own",
                            self.peer_id,
                            expected,
                            r - 1,
                        )
                    if missed:
                        # Too late for `expected`; this peer is in round r's group, so it takes part
                        # as an abstainer (weight 0: it sends no values, see AttemptInput) rather
                        # than make the others wait out the part deadline; then it reports the miss.
                        weight = np.float32(0.0)
                    a, group = int(begin["attempt"]), tuple(begin["group"])
                    log.debug(
                        "%s: in round %d attempt %d",
                        self.peer_id,
                        r,
                        a,
                        extra={"rj_event": "round_begin", "rj_round": r, "rj_attempt": a},
                    )
                    membership = dict(begin.get("addresses") or {})
                    # who is relayed, from the rendezvous' addresses (the same view on every member)
                    relayed = frozenset(
                        p for p, addr in membership.items() if is_relay_address(str(addr), self.transport.run_id, p)
                    )
                    membership[self.peer_id] = self.transport.address or ""
                    self.current_round = r
                    inp = AttemptInput(
                        membership,
                        epoch,
                        contrib,
                        weight,
                        deadline,
                        stats,
                        float(begin.get("part_left", self.timeouts.part)),
                    )
                    inp.arrive, inp.state, inp.relayed = arrive, state, relayed
                    while True:
                        attempts += 1
                        try:
                            out = await self._attempt(r, a, group, manifest, inp)
                        except RoundUnknown as e:
                            if e.epoch in (None, epoch) or time.monotonic() >= deadline:
                                raise
                            break
                        except Retry as retry:
                            a, group = retry.attempt, retry.group
                            inp.arrive, inp.part_left = None, self.timeouts.part  # the arrival: the first attempt only
                            log.info("%s: round %d retry %d with %s", self.peer_id, r, a, group)
                            if self.peer_id not in group:
                                raise RoundFail("left out of the retry group (too late)") from None
                            continue
                        diverged = out.diverged
                        if missed:
                            # only abstainers (every member missed its round): no peer is ahead
                            nobody = not out.total > 0
                            raise RoundFail(
                                f"missed round {expected}: the swarm is at round {r}"
                                + (" (no peer contributed to it)" if nobody else ""),
                                total_weight=out.total,
                                all_abstained=nobody,
                            )
                        if self.peer_id in diverged:
                            raise RoundFail(
                                f"diverged: this peer's global state after round {state[0] if state else '?'} "
                                "differs from the swarm's; its contribution was left out"
                            )
                        rec = record(
                            True,
                            contributors=out.contributors,
                            total_weight=out.total,
                            digest=out.digest,
                            clipped=dict(out.clipped),
                        )
                        return out.out, rec
                    # The rendezvous restarted (a new epoch) and does not know round r: the
                    # peers are the source of truth. Every member asks again for the round its
                    # schedule expects; the new rendezvous numbers it from the rounds the peers
                    # report (their last round), so the same round runs anew with the same
                    # contributions: no failed round, nothing to resync.
                    log.info("%s: the rendezvous restarted during round %d: beginning it again", self.peer_id, r)
                    for key in [key for key in self.attempts if key[0] == r]:
                        self.attempts.pop(key).close()
                    begin = await self._begin(deadline, expected)
                    weight, arrive = given, None
            except RoundFail as e:
                rec = record(
                    False,
                    contributors=(),
                    total_weight=e.total_weight,
                    digest="",
                    error=str(e),
                    all_abstained=e.all_abstained,
                )
                raise RoundFailed(rec) from None
            finally:
                if r >= 0:
                    self.last_round = max(self.last_round, r)
                for key in [key for key in self.attempts if key[0] <= self.last_round]:
                    self.attempts.pop(key).close()
                # a round leaves reference cycles (tasks, exceptions and their frames) that hold
                # payload-sized buffers; collect the young generations now so RSS stays flat
                gc.collect(GC_GENERATION)

    async def _attempt(self, r: int, a: int, group: tuple[str, ...], manifest: str, inp: AttemptInput) -> Reduced:
        """Attempt ``a`` of round ``r`` with ``group``; raises :class:`Retry` for another one."""
        if self.peer_id not in group:
            raise RoundFail("not in the round's group")
        algorithm = self.algorithm
        assert algorithm is not None
        st = self.attempts.get((r, a)) or algorithm.attempt(r, a)
        self.attempts[(r, a)] = st
        st.group, st.me, st.manifest, st.codec = group, group.index(self.peer_id), manifest, self.codec
        algorithm.prepare(st, inp.contrib.layout, inp.relayed)
        out = await algorithm.run(st, inp)
        self._next = out.next  # the next round's group, handed out with the commit
        return out
