"""An in-process swarm: N peers of one run in one process, averaging in memory.

``rj.OuterSync`` talks to its swarm through one contract (:class:`ravnest_jax.sync.SwarmContract`);
:class:`LocalSwarm` fulfils all of it without a rendezvous, sockets or threads of its own, so a
training loop, its checkpoints and its failure handling can be tested in threads of one
process in a fraction of a second per round (as torchft tests its DiLoCo against a mock
manager). Rounds are the real swarm's in what the driver sees: numbered rounds in call order,
the weighted mean of the contributions (float32, summed in sorted peer-id order, then divided by
the total weight; with a lossy mean codec, encoded and decoded as every receiver decodes it),
the state-digest check that leaves a diverged peer out (the rendezvous' own rule), a joiner on
standby until it is ready, the state download from a live peer, and round outcomes.

A round waits for every active member until ``timeouts.part`` seconds after its first
contribution; members missing then are left out (a contribution that comes later fails, as on
the real swarm), and a member that closes is left out at once. What it does not model: the
network (bytes are counted, not sent), the clipped mean (the plain weighted mean), the mean's
error feedback, retries. Use a real :class:`~ravnest_jax.Swarm` for those.

    run = rj.testing.LocalRun(codec="int8")
    with run.swarm("p0") as a, run.swarm("p1") as b:
        ...  # one rj.OuterSync per peer, each in its own thread
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ravnest_jax import compress
from ravnest_jax.compress import Codec
from ravnest_jax.swarm import ManifestMismatch, PeerInfo, RoundFailed, RoundRecord, Timeouts, diverged_peers

__all__ = ["LocalRun", "LocalSwarm"]


@dataclasses.dataclass
class _Round:
    number: int
    entries: dict[str, tuple[np.ndarray, float, Any, concurrent.futures.Future, Any]] = dataclasses.field(
        default_factory=dict
    )  # peer -> (flat float32, weight, state, future, specs)
    outcome: str = "running"
    group: tuple[str, ...] = ()  # the active members when it was created (and who joined it)
    contributors: tuple[str, ...] = ()
    digest: str = ""
    deadline: threading.Timer | None = None  # timeouts.part after the first contribution


class LocalRun:
    """The shared side of an in-process run (what the rendezvous is to real peers).

    Args:
      codec: the run's :class:`~ravnest_jax.Codec` (or a codec name), taken by every peer;
        ``Codec.mean_ef`` is not modelled (``ValueError``).
      run_id: the run's id (``summary()["run_id"]``).
      timeouts: the peers' deadlines (``swarm.timeouts``): a round leaves out the members that
        did not contribute ``timeouts.part`` seconds after its first contribution.

    Raises:
      ValueError: a bad codec, or ``mean_ef``.
    """

    def __init__(self, codec: Codec | str | None = None, *, run_id: str = "local", timeouts: Timeouts | None = None):
        self.codec = Codec.of(codec)
        if self.codec.mean_ef:
            raise ValueError("LocalRun does not model Codec.mean_ef (the owners' error feedback): use rj.Swarm")
        self.run_id, self.timeouts = run_id, timeouts or Timeouts()
        self.cond = threading.Condition()
        self.members: dict[str, LocalSwarm] = {}
        self.rounds: dict[int, _Round] = {}
        self.manifest: dict[str, Any] | None = None
        self.init: dict[str, Any] | None = None
        self._fail: collections.Counter[str] = collections.Counter()  # peer -> next rounds left out
        self._fail_all = 0

    def swarm(self, peer_id: str) -> LocalSwarm:
        """A new peer of this run (not started: use it as a context manager)."""
        return LocalSwarm(self, peer_id)

    def leave_out(self, peer_id: str | None = None, rounds: int = 1) -> None:
        """Fault injection: ``peer_id`` is left out of the next ``rounds`` rounds it contributes
        to (its round fails, the others' succeed without it: it then resyncs); ``None``: those
        rounds fail for everybody."""
        with self.cond:
            if peer_id is None:
                self._fail_all += rounds
            else:
                self._fail[peer_id] += rounds

    def _active(self) -> list[str]:
        return sorted(p for p, s in self.members.items() if not s.standby)

    def _next_round(self) -> int:
        return max(self.rounds, default=-1) + 1

    def _contribute(self, me: str, flat: np.ndarray, weight: float, state: Any, number: int | None, specs: Any):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            s = self.members[me]
            s.standby = False
            if number is None:  # the next round: the oldest one running without this peer, else a new one
                running = [
                    r.number
                    for r in self.rounds.values()
                    if r.outcome == "running" and me not in r.entries and r.number > s.last_round
                ]
                number = min(running) if running else max(self._next_round(), s.last_round + 1)
            rnd = self.rounds.get(number)
            if rnd is not None and (rnd.outcome != "running" or me in rnd.entries):
                rec = self._record(rnd, me, ok=False, error="the swarm is past this round (it ran without this peer)")
                fut.set_exception(RoundFailed(rec))
                return fut
            if rnd is None:
                rnd = self.rounds[number] = _Round(number, group=tuple(sorted({*self._active(), me})))
                rnd.deadline = threading.Timer(self.timeouts.part, self._expire, (rnd,))
                rnd.deadline.daemon = True
                rnd.deadline.start()
            if me not in rnd.group:
                rnd.group = tuple(sorted({*rnd.group, me}))
            rnd.entries[me] = (flat, float(weight), state, fut, specs)
            s.last_round = number
            self._complete_ready()
        return fut

    def _complete_ready(self) -> None:
        """Completes every running round that every member of its group still in the run
        contributed to (held: cond)."""
        for rnd in sorted(self.rounds.values(), key=lambda r: r.number):
            if rnd.outcome == "running" and rnd.entries and set(rnd.group) & set(self.members) <= set(rnd.entries):
                self._finish(rnd)
        self.cond.notify_all()

    def _expire(self, rnd: _Round) -> None:
        """The part deadline of ``rnd``: it completes with the members that contributed."""
        with self.cond:
            if rnd.outcome == "running" and rnd.entries:
                self._finish(rnd)
                self.cond.notify_all()

    def close(self) -> None:
        """Cancels the deadlines of rounds still running (their timer threads end at once)."""
        with self.cond:
            for rnd in self.rounds.values():
                if rnd.deadline is not None:
                    rnd.deadline.cancel()

    def _finish(self, rnd: _Round) -> None:
        if rnd.deadline is not None:
            rnd.deadline.cancel()
        ids = sorted(rnd.entries)
        states = {p: rnd.entries[p][2] for p in ids}
        diverged = tuple(diverged_peers({p: list(s) if s is not None else None for p, s in states.items()}))
        left: set[str] = set(diverged)
        everyone_fails = self._fail_all > 0
        if everyone_fails:
            self._fail_all -= 1
        for p in ids:
            if self._fail[p] > 0:
                self._fail[p] -= 1
                left.add(p)
        kept = [p for p in ids if p not in left]
        if everyone_fails or not kept:
            rnd.outcome = "failed"
            for p in ids:
                why = "failed for everybody (LocalRun.leave_out)" if everyone_fails else "no contributor left"
                rnd.entries[p][3].set_exception(RoundFailed(self._record(rnd, p, ok=False, error=why)))
            rnd.entries.clear()
            return
        acc = np.zeros_like(rnd.entries[kept[0]][0])
        total = np.float32(0.0)
        for p in kept:  # float32, sorted-id order: the same bits on every peer
            x, w = rnd.entries[p][0], np.float32(rnd.entries[p][1])
            acc += w * x
            total = np.float32(total + w)
        mean = acc / total
        mean = self._through_mean_codec(mean, rnd.entries[kept[0]][4])
        rnd.contributors, rnd.outcome = tuple(kept), "ok"
        rnd.digest = hashlib.blake2b(mean.tobytes(), digest_size=16).hexdigest()
        total_w = float(total)
        for p in ids:
            fut = rnd.entries[p][3]
            if p in left:
                why = "diverged: its state differs from the swarm's" if p in diverged else "left out (LocalRun)"
                fut.set_exception(RoundFailed(self._record(rnd, p, ok=False, error=why, diverged=diverged)))
            else:
                rec = self._record(rnd, p, ok=True, total=total_w, diverged=diverged, n=mean.size)
                fut.set_result((mean.copy(), rec))
        rnd.entries.clear()

    def _through_mean_codec(self, mean: np.ndarray, specs: Any) -> np.ndarray:
        """The mean as every receiver decodes it: encoded leaf by leaf with the mean codec."""
        name = self.codec.mean_name
        if name == "fp32":
            return mean
        opts = compress.mean_codec_options(self.codec.name, name, self.codec.options)
        leaves, lo = [], 0
        for spec in specs:
            n = int(np.prod(spec.shape, dtype=np.int64))
            leaves.append(mean[lo : lo + n].reshape(spec.shape))
            lo += n
        decoded = jax.tree.leaves(compress.decode(compress.encode(leaves, name, **opts)))
        return np.concatenate([np.ravel(a) for a in decoded]).astype(np.float32)

    def _record(
        self,
        rnd: _Round,
        me: str,
        *,
        ok: bool,
        error: str | None = None,
        total: float = 0.0,
        diverged: tuple[str, ...] = (),
        n: int = 0,
    ) -> RoundRecord:
        return RoundRecord(
            round=rnd.number,
            ok=ok,
            attempts=1,
            group=rnd.group,
            contributors=rnd.contributors if ok else (),
            total_weight=total,
            bytes_sent=4 * n,
            bytes_received=4 * n,
            seconds=0.0,
            digest=rnd.digest if ok else "",
            codec=self.codec.name,
            algorithm="local",
            error=error,
            diverged=diverged,
        )


class LocalSwarm:
    """One peer of a :class:`LocalRun`: the whole ``rj.Swarm`` contract that ``rj.OuterSync``
    uses (:class:`ravnest_jax.sync.SwarmContract`), in memory. Get one with
    :meth:`LocalRun.swarm`; use it as a context manager (``start`` / ``close``).

    Raises (its methods): ``RuntimeError`` when not running; :class:`~ravnest_jax.RoundFailed`
    through a round's future; :class:`~ravnest_jax.ManifestMismatch` for a manifest other
    than the run's.
    """

    def __init__(self, run: LocalRun, peer_id: str):
        self.run, self.peer_id, self.run_id = run, peer_id, run.run_id
        self.codec, self.timeouts = run.codec, run.timeouts
        self.started = False
        self.standby = False
        self.last_round = -1
        self._info: dict[str, Any] = {}
        self._provider: Callable[[], Any] | None = None

    def __enter__(self) -> LocalSwarm:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Joins the run: on standby when it has had rounds (until :meth:`ready` or a round)."""
        with self.run.cond:
            if self.peer_id in self.run.members:
                raise RuntimeError(f"peer {self.peer_id!r} is already in the run")
            self.standby = bool(self.run.rounds)
            self.started = True
            self.run.members[self.peer_id] = self
            self.run.cond.notify_all()

    def close(self) -> None:
        """Leaves the run; rounds waiting for this peer complete without it (the last peer to
        leave cancels the run's deadlines). Safe to call twice."""
        with self.run.cond:
            if self.run.members.get(self.peer_id) is self:
                del self.run.members[self.peer_id]
                self.started = False
                self.run._complete_ready()
                if not self.run.members:
                    self.run.close()

    def _running(self) -> None:
        if not self.started:
            raise RuntimeError("LocalSwarm is not running (use it as a context manager)")

    def all_reduce_packed_async(
        self, packed: Any, *, weight: float = 1.0, round: int | None = None, state: tuple[int, str] | None = None
    ) -> concurrent.futures.Future[tuple[np.ndarray, RoundRecord]]:
        """The weighted mean of this round's contributions: a future of ``(mean, record)``,
        ``mean`` float32 ``(n,)`` (the leaves raveled in order), as ``rj.Swarm``'s. ``packed``:
        the host :class:`~ravnest_jax.compress.Packed` of the run's codec. Raises ``ValueError``
        for another codec or a weight that is not a finite number > 0."""
        self._running()
        if packed.codec != self.codec.name:
            raise ValueError(
                f"the contribution is encoded with {packed.codec!r}, the run's codec is {self.codec.name!r}"
            )
        if not (np.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {weight!r}")
        leaves = jax.tree.leaves(compress.decode(compress.packed_to_bytes(packed)))
        flat = np.concatenate([np.ravel(a) for a in leaves]).astype(np.float32, copy=False)
        return self.run._contribute(self.peer_id, flat, weight, state, round, list(packed.specs))

    def ready(self) -> concurrent.futures.Future[Any]:
        """Ends the standby: the next round created waits for this peer. A done future."""
        self._running()
        with self.run.cond:
            self.standby = False
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result({"ok": True})
        return fut

    def serve_state(self, provider: Callable[[], Any] | None) -> None:
        """``provider()`` returns the state bytes, a future of them, or ``None``."""
        self._provider = provider

    def fetch_state(self, timeout: float = 120.0, *, prefer: str | None = None) -> bytes | None:
        """The state of another live peer (``prefer`` first, then the most advanced), or
        ``None`` when no other peer has one. Waits at most ``timeout`` seconds for a future."""
        self._running()
        with self.run.cond:
            others = [s for p, s in self.run.members.items() if p != self.peer_id and s._provider is not None]
        others.sort(key=lambda s: (s.peer_id != prefer, -s.last_round, s.peer_id))
        deadline = time.monotonic() + timeout
        for s in others:
            got = s._provider() if s._provider is not None else None
            if isinstance(got, concurrent.futures.Future):
                got = got.result(timeout=max(0.0, deadline - time.monotonic()))
            if got is not None:
                return bytes(got)
        return None

    def round_outcome(self, round_: int) -> str:
        """``"ok"``, ``"failed"``, ``"running"`` or ``"unknown"``."""
        with self.run.cond:
            rnd = self.run.rounds.get(round_)
            return "unknown" if rnd is None else rnd.outcome

    def status(self) -> dict[str, Any]:
        """The run's status as the rendezvous reports it (peers, rounds)."""
        with self.run.cond:
            rounds = [
                {
                    "round": r.number,
                    "outcome": r.outcome,
                    "group": list(r.group),
                    "contributors": list(r.contributors),
                    "digest": r.digest,
                }
                for r in sorted(self.run.rounds.values(), key=lambda r: r.number)
            ]
        return {"run_id": self.run_id, "peers": [dataclasses.asdict(p) for p in self.peers()], "rounds": rounds}

    def peers(self) -> list[PeerInfo]:
        """The live peers, sorted by id."""
        with self.run.cond:
            members = sorted(self.run.members.values(), key=lambda s: s.peer_id)
            return [PeerInfo(s.peer_id, f"local://{s.peer_id}", s.last_round, 0.0, dict(s._info)) for s in members]

    def wait_for_peers(self, n: int, timeout: float = 60.0) -> list[PeerInfo]:
        """Blocks until ``n`` peers are live (``TimeoutError`` after ``timeout`` seconds)."""
        with self.run.cond:
            if not self.run.cond.wait_for(lambda: len(self.run.members) >= n, timeout):
                raise TimeoutError(f"{len(self.run.members)} of {n} peers after {timeout} s")
        return self.peers()

    @property
    def info(self) -> dict[str, Any]:
        """A copy of the JSON object this peer publishes."""
        return dict(self._info)

    def set_info(self, info: dict[str, Any]) -> None:
        """Replaces the JSON object this peer publishes (:attr:`PeerInfo.info`)."""
        self._info = dict(info)

    def declare_manifest(
        self, manifest: dict[str, Any], *, init: str | None = None, timeout: float | None = None
    ) -> dict[str, Any] | None:
        """The first declared manifest is the run's; another one raises ``ManifestMismatch``
        naming the differing keys. Returns the run's reference initial state once started."""
        with self.run.cond:
            ref = self.run.manifest
            if ref is not None and ref != manifest:
                diff = sorted(k for k in set(ref) | set(manifest) if ref.get(k) != manifest.get(k))
                raise ManifestMismatch(f"settings differ from the run's: {', '.join(diff)}", diff)
            self.run.manifest = dict(manifest)
            if not self.started:
                return None
            if self.run.init is None and init is not None:
                self.run.init = {"init": init, "init_from": self.peer_id}
            return dict(self.run.init) if self.run.init is not None else {"init": None, "init_from": None}
