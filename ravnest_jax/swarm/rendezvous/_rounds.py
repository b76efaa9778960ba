"""The rendezvous' round handlers: a round's creation (its group), the begin and arrival of a
member, the votes of an attempt and what is decided from them, and the next round handed out with
a commit (the rules in ``docs/swarm.md``, *Round numbers*). A mixin of
:class:`~ravnest_jax.swarm.rendezvous._rendezvous.Rendezvous`, which keeps the membership (join, heartbeat,
leave, ready, eviction); the decisions over the votes are :mod:`._votes`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiohttp import web

from ._votes import KEEP_ROUNDS, _Attempt, _Peer, _Round, _Run, decide, failed_between, is_int, is_number

log = logging.getLogger("ravnest_jax.swarm.rendezvous")


class RoundHandlers:
    """``Rendezvous``'s rounds: ``/rounds/begin`` and ``/rounds/{r}/vote`` (and their helpers). Uses
    the host's ``epoch``, ``boot``, ``heartbeat_s``, ``_auth``, ``_reply``, ``_touch`` and ``_live``."""

    epoch: str
    boot: float
    heartbeat_s: float

    # -- rounds --------------------------------------------------------------------------
    def _create_round(
        self, run: _Run, after: int, p: dict[str, Any], asker: str, ahead: bool = False, first_ask: bool = False
    ) -> _Round:
        number = max(-1 if run.latest is None else run.latest, after, run.max_reported_round) + 1
        live = self._live(run, for_group=True)
        ready = [e for e in live if not e.standby]
        if first_ask and not any(e.peer_id != asker for e in ready):
            # the first ask of a process that joined with nobody else ready: the whole swarm is
            # coming back (restarted from checkpoints), so every live peer is in the round
            ready = live
        group = tuple(e.peer_id for e in ready) or (asker,)  # none (only suspects left?): the asker is alive
        now = time.monotonic()
        rnd = _Round(
            number=number,
            created=now,
            part_s=float(min(max(p.get("part_s", 30.0), 0.01), 3600.0)),
            grace_s=float(min(max(p.get("grace_s", 1.0), 0.0), 600.0)),
            max_attempts=int(min(max(p.get("max_attempts", 3), 1), 10)),
            attempts={0: _Attempt(0, group, now, started=not ahead)},
        )
        run.rounds[number] = rnd
        run.latest = number
        for old in sorted(run.rounds)[:-KEEP_ROUNDS]:
            del run.rounds[old]
        log.info("run %s: round %d with %d peers", run.run_id, number, len(group))
        return rnd

    async def _begin(self, request: web.Request) -> web.Response:
        run, peer, p = await self._auth(request)
        # every field is checked before it has any effect (a malformed begin must not register its sender)
        after = p.get("after", -1)
        if not is_int(after):
            raise web.HTTPBadRequest(text="after must be an int")
        for name in ("wait_s", "part_s", "grace_s", "max_attempts"):
            if not is_number(p.get(name, 0)):
                raise web.HTTPBadRequest(text=f"{name} must be a finite number")
        arrive = p.get("arrive")
        if not (arrive is None or is_int(arrive)):
            raise web.HTTPBadRequest(text="arrive must be an int")
        expect = p.get("expect", False)
        if not isinstance(expect, bool):
            raise web.HTTPBadRequest(text="expect must be a boolean")
        me, _ = self._touch(run, peer, p)
        if arrive is not None:
            return self._reply(request, run, self._arrival(run, me, arrive))
        was = (me.standby, me.fresh)
        first_ask, me.standby, me.fresh = me.fresh, False, False
        deadline = time.monotonic() + float(min(max(p.get("wait_s", 30.0), 0.0), 3600.0))
        while True:
            rnd = run.rounds.get(run.latest) if run.latest is not None else None
            me = run.peers.get(peer) or me
            running = rnd is not None and rnd.outcome == "running"
            # a member: in the round's group, and the process that was in it when it was created
            member = (
                running
                and peer in rnd.attempts[0].group
                and peer in rnd.attempts[max(rnd.attempts)].group
                and me.joined <= rnd.created
            )
            if member and after < rnd.number:
                return self._reply(request, run, self._handout(run, rnd, arrived=True, after=after))
            if running and not member and expect and after < rnd.number and self._has_live_member(run, rnd, peer):
                # the round this peer's schedule expects (or a later one) runs without it: it
                # was too late (for example, its state download finished after the round was
                # created). Said at once, so that it resyncs instead of waiting for the round.
                # A peer on standby stays so: it is in no group until it is ready again (its
                # resync is under way; a group that waited for it would wait a part deadline).
                me.standby, me.fresh = was
                return self._reply(request, run, {"epoch": self.epoch, "round": None, "missed": rnd.number})
            if (
                not running
                or (member and after >= rnd.number)
                or not self._has_live_member(run, rnd, peer)
                or time.monotonic() >= rnd.stale_at()  # stale: long past the time its attempts may take
            ):
                # just (re)started: give every live peer one heartbeat to re-register first
                settle = self.boot + 2 * self.heartbeat_s - time.monotonic()
                if settle > 0:
                    await asyncio.sleep(settle)
                    self._touch(run, peer, p)
                    continue
                rnd = self._create_round(run, after, p, peer, first_ask=first_ask)
                first_ask = False
                await self._notify(run)
                continue
            # joined while this round runs: wait for the next one (a new round, or this one's end)
            stale_at = rnd.stale_at()
            left = min(deadline, stale_at) - time.monotonic()
            if left <= 0 and time.monotonic() < stale_at:
                return self._reply(request, run, {"epoch": self.epoch, "round": None, "wait": True})
            with contextlib.suppress(TimeoutError):
                async with run.new_round:
                    await asyncio.wait_for(run.new_round.wait(), max(left, 0.0))
            self._touch(run, peer, p)

    def _has_live_member(self, run: _Run, rnd: _Round, asker: str) -> bool:
        """Whether a member of ``rnd``'s latest attempt other than ``asker`` is still alive (the
        process that was in the group when the round was created)."""
        group = set(rnd.attempts[max(rnd.attempts)].group) - {asker}
        return any(e.peer_id in group and e.joined <= rnd.created for e in self._live(run))

    def _handout(self, run: _Run, rnd: _Round, *, arrived: bool, after: int | None = None) -> dict[str, Any]:
        """The begin answer for a member of ``rnd``: its attempt 0 group, addresses and the part
        time left. ``arrived``: the member is here, so the part clock starts if it has not.
        ``after``: the asker's last round (adds ``rounds_failed``, :func:`failed_between`)."""
        att = rnd.attempts[max(rnd.attempts)]
        if arrived:
            att.arrive()
        # the part phase ends at the same moment for everyone: the attempt's start plus
        # part_s, whenever a peer arrives (a late arrival has less time, not more)
        part_left = att.start + rnd.part_s - time.monotonic() if att.started else rnd.part_s
        out = {**self._group(run, rnd), "part_left": max(part_left, 0.0)}
        if after is not None:
            out["rounds_failed"] = failed_between(run, after, rnd.number)
        return out

    def _group(self, run: _Run, rnd: _Round) -> dict[str, Any]:
        """``rnd``'s latest attempt as its members are told: its epoch, round, attempt, group and
        the group's addresses."""
        att = rnd.attempts[max(rnd.attempts)]
        return {
            "epoch": self.epoch,
            "round": rnd.number,
            "attempt": att.number,
            "group": list(att.group),
            "addresses": {g: run.peers[g].address for g in att.group if g in run.peers},
        }

    def _arrival(self, run: _Run, me: _Peer, number: int) -> dict[str, Any]:
        """A member that was handed round ``number`` with the last commit says it is here: the
        part clock starts (if it has not). Never creates a round: an arrival that comes after
        the round ended (a fast peer, alone or not) is answered ``round: None``."""
        rnd = run.rounds.get(number)
        member = rnd is not None and me.peer_id in rnd.attempts[0].group and me.joined <= rnd.created
        if not member or rnd.outcome != "running" or len(rnd.attempts) > 1:
            return {"epoch": self.epoch, "round": None}
        return self._handout(run, rnd, arrived=True)

    async def _vote(self, request: web.Request) -> web.Response:
        run, peer, p = await self._auth(request)
        try:
            number = int(request.match_info["round"])
            attempt = int(p["attempt"])
            phase = str(p["phase"])
            data = p.get("data") or {}
        except (KeyError, ValueError, TypeError, OverflowError):
            raise web.HTTPBadRequest(text="bad vote") from None
        if phase not in ("gather", "commit") or not isinstance(data, dict):
            raise web.HTTPBadRequest(text="bad vote")
        state = data.get("state")
        pair = isinstance(state, list) and len(state) == 2 and is_int(state[0]) and isinstance(state[1], str)
        if state is not None and not (pair and 0 < len(state[1]) <= 128):
            raise web.HTTPBadRequest(text="state must be [round, digest]: an int and a string of 1-128 chars")
        rnd = run.rounds.get(number)
        if p.get("epoch") != self.epoch or rnd is None:
            # its epoch: another than the round's when the rendezvous restarted (the round begins anew)
            why = "the rendezvous does not know this round (it restarted or the round is too old)"
            return self._reply(request, run, {"decision": "fail", "reason": why, "unknown": True, "epoch": self.epoch})
        att = rnd.attempts.get(attempt)
        if att is None or peer not in att.group:
            return self._reply(request, run, {"decision": "fail", "reason": "not in this attempt's group"})
        if phase == "commit" and "gather" not in att.decisions:
            raise web.HTTPBadRequest(text="commit before gather")
        att.arrive()
        ev = att.events.setdefault(phase, asyncio.Event())
        if phase not in att.decisions:
            att.votes.setdefault(phase, {})[peer] = data
            log.debug("run %s round %d attempt %d: %s vote from %s", run.run_id, rnd.number, att.number, phase, peer)
            if set(att.votes[phase]) | att.left >= set(att.group):
                self._decide(run, rnd, att, phase)
        while phase not in att.decisions:
            start = att.start if phase == "gather" else (att.gather_decided_at or att.start)
            left = start + rnd.part_s + rnd.grace_s - time.monotonic()
            if left <= 0:
                self._decide(run, rnd, att, phase)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), left)
        return self._reply(request, run, att.decisions[phase])

    def _decide(self, run: _Run, rnd: _Round, att: _Attempt, phase: str) -> None:
        if phase in att.decisions:
            return
        decision = decide(run, rnd, att, phase, lambda: self._create_ahead(run, rnd))
        if decision["decision"] == "fail":
            rnd.outcome, rnd.reason = "failed", str(decision.get("reason", ""))[:300]
        att.decisions[phase] = decision
        att.events.setdefault(phase, asyncio.Event()).set()
        if rnd.outcome != "running":  # peers waiting for this round's end ask again
            asyncio.ensure_future(self._notify(run))
        log.info("run %s round %d attempt %d %s: %s", run.run_id, rnd.number, att.number, phase, decision)

    def _create_ahead(self, run: _Run, rnd: _Round) -> dict[str, Any] | None:
        """At a commit: create the next round now (its group: the live peers now) and hand it to
        the committing peers with the decision, so that their next ``all_reduce`` starts sending
        at once instead of asking first (one round trip less on the critical path). Its part
        clock starts when the first member arrives; a peer that joins from now on waits for
        the round after it, as it would while a round runs."""
        if (
            run.latest != rnd.number
            or len(rnd.attempts) > 1
            or any(e.suspect_since is not None or e.standby for e in run.peers.values())
        ):
            # after a retry, or while a peer left out of one has not beaten again, the group
            # of the next round is fixed when its first member asks (as without this): a peer
            # that was left out must be able to come back at once, not one round later; and
            # while a peer is on standby (downloading the state), so that it is in the next
            # round if it is ready by then
            return None
        knobs = {"part_s": rnd.part_s, "grace_s": rnd.grace_s, "max_attempts": rnd.max_attempts}
        nxt = self._create_round(run, rnd.number, knobs, rnd.attempts[max(rnd.attempts)].group[0], ahead=True)
        asyncio.ensure_future(self._notify(run))
        return self._group(run, nxt)

    @staticmethod
    async def _notify(run: _Run) -> None:
        async with run.new_round:
            run.new_round.notify_all()
