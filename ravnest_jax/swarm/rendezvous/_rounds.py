"""The rendezvous' rounds: its model of a run (peers, rounds, attempts, its manifest), the
round handlers (a round's creation and group, the begin and arrival of a member, the votes of an
attempt, the next round handed out with a commit; the rules in ``docs/swarm.md``, *Round
numbers*) and the decisions over the votes (which contributions count, when to retry without
whom, when a round commits, which peers diverged) and over a peer's manifest
(:meth:`_Run.admit`). :class:`RoundHandlers` is a mixin of
:class:`~ravnest_jax.swarm.rendezvous._rendezvous.Rendezvous`, which keeps the membership (join,
heartbeat, leave, ready, eviction)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from aiohttp import web

log = logging.getLogger("ravnest_jax.swarm.rendezvous")

KEEP_ROUNDS = 32
MAX_PEERS_PER_RUN = 4096
MAX_RUNS = 1024


def is_int(x: Any) -> bool:
    """Whether ``x`` is a JSON integer (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """Whether ``x`` is a finite JSON number (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass
class _Peer:
    peer_id: str
    address: str
    joined: float
    last_seen: float
    last_round: int = -1
    # in no new round's group until it asks for a round or says it is ready: it joined a run
    # that has had rounds (it is downloading the swarm's state, or restoring a checkpoint), came
    # back from its eviction, or was left out of a retry (see ``retry``)
    standby: bool = False
    fresh: bool = False  # joined a run that has had rounds and has not asked for a round yet
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Attempt:
    number: int
    group: tuple[str, ...]
    start: float
    votes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    decisions: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    events: dict[str, asyncio.Event] = dataclasses.field(default_factory=dict)
    gather_decided_at: float | None = None
    left: set[str] = dataclasses.field(default_factory=set)  # members that said they leave
    started: bool = True  # False: created ahead (at the previous round's commit); the clock
    # (``start``) starts when the first member arrives (its begin or a vote)

    def arrive(self) -> None:
        if not self.started:
            self.start, self.started = time.monotonic(), True


@dataclasses.dataclass
class _Round:
    number: int
    created: float
    part_s: float
    grace_s: float
    max_attempts: int
    attempts: dict[int, _Attempt]
    outcome: str = "running"
    contributors: tuple[str, ...] = ()
    digest: str = ""
    diverged: tuple[str, ...] = ()  # left out of the contributors: their state differed
    reason: str | None = None  # why the round failed
    abandoned: bool = False  # failed, created ahead, and every member left before it began

    def stale_at(self) -> float:
        """When the round is long past the time its attempts may take (``time.monotonic()``)."""
        return max(self.created, self.attempts[0].start) + self.max_attempts * 2 * (self.part_s + self.grace_s) + 1.0


class _Run:
    def __init__(self, run_id: str):
        self.run_id = run_id
        self.peers: dict[str, _Peer] = {}
        self.version = 0
        self.rounds: dict[int, _Round] = {}
        self.latest: int | None = None
        self.max_reported_round = -1
        self.new_round = asyncio.Condition()
        self.reports: dict[int, dict[str, dict[str, float]]] = {}  # round -> peer -> losses
        self.evicted: dict[str, None] = {}  # evicted peers, oldest first (see back_from_eviction)
        self.manifest: dict[str, Any] | None = None  # the run's (None before any peer declared one)
        self.holders: set[str] = set()  # the peers that declared it
        # the run's reference initial state: its digest and the peer whose it is (both None before
        # a peer declared one); a fresh peer whose initial state differs (another seed) takes that
        # peer's state before its first round
        self.init: dict[str, str | None] = {"init": None, "init_from": None}

    def note_evicted(self, peer: str) -> None:
        """``peer`` was evicted (silent for the eviction time): remembered, at most
        ``MAX_PEERS_PER_RUN`` of them."""
        self.evicted.pop(peer, None)
        self.evicted[peer] = None
        while len(self.evicted) > MAX_PEERS_PER_RUN:
            del self.evicted[next(iter(self.evicted))]

    def back_from_eviction(self, peer: str) -> bool:
        """Whether ``peer``, registering again, was evicted (forgotten now). Such a process hung
        and resumed: it is still in its old exchange and does not hold the swarm's state."""
        return self.evicted.pop(peer, 0) is None

    # -- the run manifest (docs/swarm.md, "The run manifest") ---------------------------------
    def refusal(self, peer: str, manifest: dict[str, Any], live: set[str]) -> list[str]:
        """The differences that refuse ``peer``'s ``manifest`` (:func:`differences`); ``[]`` when
        it would be admitted: the run has none yet, it equals the run's, or no live peer other
        than ``peer`` holds the run's (``live``: the ids of the run's live peers). Changes nothing."""
        if self.manifest is not None and self.manifest != manifest and (self.holders & live) - {peer}:
            return differences(manifest, self.manifest)
        return []

    def admit(self, peer: str, manifest: dict[str, Any], live: set[str], init: str | None = None) -> list[str]:
        """Admits ``peer``'s ``manifest`` (returns ``[]``; it is now the run's) or refuses it
        (returns the differences, see :meth:`refusal`). ``init``: the digest of the peer's
        initial state; the peer that fixes the run's manifest fixes the run's reference initial
        state (:attr:`init`), kept while that peer lives."""
        diffs = self.refusal(peer, manifest, live)
        if diffs:
            return diffs
        if self.manifest != manifest:
            self.manifest = manifest
            self.holders = set()
            self.init = {"init": None, "init_from": None}
        self.holders.add(peer)
        if isinstance(init, str) and self.init["init_from"] not in live:
            self.init = {"init": init, "init_from": peer}
        return []


def _show(value: Any) -> str:
    if isinstance(value, dict) and {"leaves", "elements", "sha256"} <= value.keys():
        return f"{value['leaves']} leaves, {value['elements']:,} elements (fingerprint {value['sha256']})"
    if value is None:
        return "none"
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True)


def differences(mine: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """Every setting where ``mine`` differs from ``run``, one ``"key: this peer A, the run B"``
    each, in key order (a setting one side lacks shows as ``none``)."""
    keys = sorted(mine.keys() | run.keys())
    return [
        f"{k}: this peer {_show(mine.get(k))}, the run {_show(run.get(k))}" for k in keys if mine.get(k) != run.get(k)
    ]


def failed_between(run: _Run, after: int, number: int) -> bool:
    """Whether every round numbered ``after + 1 .. number - 1`` is known here and failed for
    everybody (none, when ``after + 1 == number``: False). A peer whose schedule expected round
    ``after + 1`` missed nothing then: no peer applied a round since (a lone peer restarted
    after its previous process began a round and died). Unknown numbers (from before a
    rendezvous restart, or pruned) count as not failed."""
    between = range(after + 1, number)
    return len(between) > 0 and all(n in run.rounds and run.rounds[n].outcome == "failed" for n in between)


def decide(run: _Run, rnd: _Round, att: _Attempt, phase: str, ahead: Callable[[], dict[str, Any] | None]) -> dict:
    """The rendezvous' decision of ``phase`` (``"gather"`` or ``"commit"``) of attempt ``att``
    from the votes it has (all of the group's, or those in by the deadline).

    gather: ``ok`` with the contributors (the parts every voting owner received, less the
    diverged peers), ``retry`` without members that did not vote or that most owners could not
    reach, or ``fail``. commit: ``commit`` when every member got the same result digest (then
    ``ahead()`` may hand out the next round's group), else ``retry`` without the owners blamed,
    or ``fail`` when the digests differ. Marks the round's outcome and contributors.
    """
    votes = att.votes.get(phase, {})
    voters = tuple(sorted(votes))
    group = set(att.group)
    everyone = set(voters) >= group
    again = partial(retry, run, rnd, att)
    decision: dict[str, Any]
    diverged: list[str] = []
    if phase == "gather":
        att.gather_decided_at = time.monotonic()
        n = len(group)
        got = {k: set(v.get("received", [])) & group for k, v in votes.items()}
        # an owner that received from at most half of the group (while most owners did
        # better) is the problem, not the senders: retry without it rather than keep only
        # the senders that reached it (n >= 3; with 2 peers the fault cannot be placed)
        unreachable = {k for k, g in got.items() if 2 * len(g) <= n} if n >= 3 else set()
        diverged = diverged_peers({k: v.get("state") for k, v in votes.items()})
        contributors = group.intersection(*got.values())
        if any(v.get("ring") for v in votes.values()):
            # a ring's partial sums hold everybody: all complete, or retry the survivors
            # (a diverged peer cannot be taken out of them: it is only told to resync)
            if everyone and all(g >= group for g in got.values()):
                decision = {"decision": "ok", "contributors": sorted(group)}
            else:
                decision = again(voters, "ring incomplete")
        elif not everyone:
            decision = again(voters, "missing gather votes from " + ",".join(sorted(group - set(voters))))
        elif unreachable and 2 * len(unreachable) < n:
            why = "owners that most peers could not reach: " + ",".join(sorted(unreachable))
            decision = again(tuple(v for v in voters if v not in unreachable), why)
        elif att.number == 0 and 2 * len(contributors) <= n and any(len(g) > len(contributors) for g in got.values()):
            # Everybody is here (all voted) but the intersection kept at most half of the
            # group: typically a peer that reached the round late, whose own part window was
            # too short to receive the others' parts (with 2 peers that made the *on-time* peer
            # the one left out: a 1-contributor round). Try once more with everyone; a second
            # shortfall is taken as it is.
            late = ",".join(f"{k}:{len(g)}" for k, g in sorted(got.items()))
            decision = again(voters, "most contributions were late at some part owner: " + late)
        elif contributors - set(diverged):
            # a peer whose global state differs from the swarm's computed its pseudo-gradient
            # against a wrong anchor: left out, and told to resync
            decision = {"decision": "ok", "contributors": sorted(contributors - set(diverged))}
        else:
            decision = {"decision": "fail", "reason": "no contribution reached every part owner"}
        if decision["decision"] == "ok" and diverged:
            decision["diverged"] = diverged
            rnd.diverged = tuple(diverged)
        if decision["decision"] == "ok" and any("sqnorms" in v for v in votes.values()):
            decision["norms"] = summed(votes, "sqnorms", decision["contributors"], root=True)
    else:
        digests = {v.get("digest") for v in votes.values()}
        if everyone and all(v.get("ok") for v in votes.values()) and len(digests) == 1:
            decision = {"decision": "commit"}
            rnd.outcome = "ok"
            rnd.contributors = tuple(att.decisions["gather"]["contributors"])
            rnd.digest = str(digests.pop())
            if (nxt := ahead()) is not None:
                decision["next"] = nxt
        elif everyone and len({v.get("digest") for v in votes.values() if v.get("ok")}) > 1:
            decision = {"decision": "fail", "reason": "result digests differ"}
        else:
            missing = sorted(group - set(voters))
            bad = sorted(k for k, v in votes.items() if not v.get("ok"))
            blamed = {str(o) for v in votes.values() for o in v.get("failed_owners") or []}
            decision = again(
                tuple(v for v in voters if v not in blamed),
                f"all-gather incomplete (missing {missing}, failed {bad}, unreachable owners {sorted(blamed)})",
            )
    if decision["decision"] == "fail" and not att.started and att.left >= group:
        # created ahead at the last commit, and every member left before it began (the end of
        # a run, or a lone peer's process that died): nothing was lost in it
        decision["reason"] = "abandoned: every member left before it began (it was created ahead at the last commit)"
        rnd.abandoned = True
    return decision


def summed(votes: dict[str, dict[str, Any]], key: str, contributors: list[str], root: bool = False) -> dict[str, float]:
    """Per contributor, the sum over the voters of ``vote[key][contributor]`` (the clipped
    mean's squared part norms, ``root=True`` for the whole-vector L2 norm). A value that is not a finite number >= 0 counts as 0."""
    out = {}
    for c in contributors:
        xs = [d.get(c) for v in votes.values() if isinstance(d := v.get(key), dict)]
        total = sum(float(x) for x in xs if is_number(x) and x >= 0)
        out[c] = math.sqrt(total) if root else total
    return out


def retry(run: _Run, rnd: _Round, att: _Attempt, voters: tuple[str, ...], reason: str) -> dict[str, Any]:
    """Attempt ``att`` failed: retry with ``voters``, or ``fail`` when no attempt is left. The
    others are on standby until they next ask for a round or say they are ready: a member left
    out (it hung past the part deadline, under its eviction) is still in this round when it beats
    again, and resyncs next if the round goes on without it; in a new group before then, it
    would cost the others a second part deadline."""
    now = time.monotonic()
    for left_out in set(att.group) - set(voters):
        if left_out in run.peers:
            run.peers[left_out].standby = True
    nxt = att.number + 1
    if not voters or nxt >= rnd.max_attempts:
        return {"decision": "fail", "reason": reason + "; no attempts left"}
    rnd.attempts[nxt] = _Attempt(nxt, voters, now)
    return {"decision": "retry", "attempt": nxt, "group": list(voters), "reason": reason}


def diverged_peers(states: dict[str, Any]) -> list[str]:
    """Peers whose global state differs from the swarm's, from the ``[round, digest]`` each
    voter reported for the state after its last merged round (``None``: not reported).

    Compared among the peers that report the most recent round reported by at least two: the
    digest most of them hold is the swarm's (a tie goes to the digest of the smallest peer id
    among the tied ones); every other peer reporting that round has diverged. Returns their
    sorted ids (empty when fewer than two peers report a common round).
    """
    reported = {p: (int(s[0]), str(s[1])) for p, s in states.items() if s is not None}
    common = [r for r, c in Counter(r for r, _ in reported.values()).items() if c >= 2]
    if not common:
        return []
    r = max(common)
    same = {p: d for p, (rr, d) in reported.items() if rr == r}
    tally = Counter(same.values())
    top = max(tally.values())
    winner = same[min(p for p, d in same.items() if tally[d] == top)]
    return sorted(p for p, d in same.items() if d != winner)


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
        live = self._live(run)
        ready = [e for e in live if not e.standby]
        if first_ask and not any(e.peer_id != asker for e in ready):
            # the first ask of a process that joined with nobody else ready: the whole swarm is
            # coming back (restarted from checkpoints), so every live peer is in the round
            ready = live
        group = tuple(e.peer_id for e in ready) or (asker,)  # none (only peers on standby?): the asker is alive
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
        log.debug("run %s: round %d with %d peers", run.run_id, number, len(group))
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
            if p.get("epoch") != self.epoch:
                why = "the rendezvous restarted since this round began"
            else:  # a member that hung (or lagged) long after the others went on
                why = f"the rendezvous no longer has round {number}: the swarm went on (it is at round {run.latest})"
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
        # one INFO line per round that works (its commit); each retry and failure says why
        what = decision["decision"]
        if what == "commit":
            log.info(
                "run %s: round %d ok, %d contributors%s",
                run.run_id,
                rnd.number,
                len(rnd.contributors),
                f" ({att.number + 1} attempts)" if att.number else "",
            )
        level = logging.DEBUG if what in ("ok", "commit") or rnd.abandoned else logging.INFO
        level = logging.WARNING if what == "fail" and not rnd.abandoned else level
        log.log(level, "run %s round %d attempt %d %s: %s", run.run_id, rnd.number, att.number, phase, decision)

    def _create_ahead(self, run: _Run, rnd: _Round) -> dict[str, Any] | None:
        """At a commit: create the next round now (its group: the live peers now) and hand it to
        the committing peers with the decision, so that their next ``all_reduce`` starts sending
        at once instead of asking first (one round trip less on the critical path). Its part
        clock starts when the first member arrives; a peer that joins from now on waits for
        the round after it, as it would while a round runs."""
        if run.latest != rnd.number or len(rnd.attempts) > 1 or any(e.standby for e in run.peers.values()):
            # after a retry, or while a peer is on standby (downloading the state, or left out
            # of a retry), the group of the next round is fixed when its first member asks (as
            # without this): a peer on standby is in the next round if it is ready by then
            return None
        knobs = {"part_s": rnd.part_s, "grace_s": rnd.grace_s, "max_attempts": rnd.max_attempts}
        nxt = self._create_round(run, rnd.number, knobs, rnd.attempts[max(rnd.attempts)].group[0], ahead=True)
        asyncio.ensure_future(self._notify(run))
        return self._group(run, nxt)

    @staticmethod
    async def _notify(run: _Run) -> None:
        async with run.new_round:
            run.new_round.notify_all()
