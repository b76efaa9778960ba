"""When an :class:`~ravnest_jax.sync.OuterSync`'s rounds start, with what weight and overlap, and
which swarm round each one is."""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

log = logging.getLogger("ravnest_jax.sync")


class Plan(NamedTuple):
    """A round about to start.

    Attributes:
      seq: this driver's exchange number (0, 1, ...).
      tau: inner steps until its merge.
      weight: samples since the fragment's last round (its weight in the mean).
      expected: the swarm round it belongs to, once the mapping is known, else ``None``.
      learn_round: called (from the exchange worker) with the swarm round it ran as, and
        ``True`` when it ran with this peer's contribution.
    """

    seq: int
    tau: int
    weight: float
    expected: int | None
    learn_round: Callable[[int, bool], None]


class Schedule:
    """The round schedule of one driver.

    Rounds start at ``tx.due_fragments(step)`` or, with ``sync_every_seconds``, every that many
    seconds of wall time with no round in flight. Exchange ``seq`` is swarm round ``base +
    (seq - seq_base)`` once :attr:`swarm_base` ``= (base, seq_base)`` is known (learned from the
    first round that ran): a late peer then fails fast instead of mixing an old
    pseudo-gradient into a later round.

    Args:
      tx: the :func:`rj.diloco` transformation.
      overlap_steps: tau (an int) or ``"auto"`` (:class:`AutoTau` with ``cap``).
      samples_per_step: samples per inner step (weights).
      sync_every_seconds: wall-time rounds, or ``None``.
    """

    def __init__(
        self, tx: Any, overlap_steps: int | str, cap: int, samples_per_step: float, sync_every_seconds: float | None
    ):
        self.tx, self.overlap_steps = tx, overlap_steps
        self.samples_per_step, self.sync_every_seconds = samples_per_step, sync_every_seconds
        self.tau = AutoTau(cap)
        self.rounds_started = 0
        self.swarm_base: tuple[int, int] | None = None
        self._last_round_step: dict[int, int] = {}
        self._first_step = 0
        self._clock = time.monotonic()

    def restart(self, step: int, rounds_started: int | None = None, swarm_base: Any = False) -> None:
        """The step counter is ``step`` now (first call, restore, state download): every
        fragment's next weight counts from here; optionally new counters and mapping."""
        self._first_step = step
        self._last_round_step = {f: step for f in range(self.tx.fragments)} if rounds_started is not None else {}
        if rounds_started is not None:
            self.rounds_started = rounds_started
        if swarm_base is not False:
            self.swarm_base = swarm_base
        self._clock = time.monotonic()
        self.tau.reset()

    def wall_due(self, idle: bool) -> bool:
        """With ``sync_every_seconds``: a round is due (the interval passed, nothing in flight)."""
        return (
            self.sync_every_seconds is not None and idle and time.monotonic() - self._clock >= self.sync_every_seconds
        )

    def due(self, step: int, idle: bool) -> tuple[int, ...]:
        """The fragments whose round starts at ``step`` (``idle``: no round in flight)."""
        if self.sync_every_seconds is not None:
            if self.wall_due(idle):
                self._clock = time.monotonic()
                return (0,)
            return ()
        return self.tx.due_fragments(step)

    def plan(self, fragment: int, step: int, stall_seconds: float) -> Plan:
        """Takes the next exchange number for ``fragment``'s round at ``step``."""
        seq = self.rounds_started
        self.rounds_started += 1
        steps_done = step - self._last_round_step.get(fragment, self._first_step)
        self._last_round_step[fragment] = step
        base = self.swarm_base
        tau = int(self.overlap_steps) if self.overlap_steps != "auto" else self.tau.choose(step, stall_seconds)

        def learn(r: int, ran: bool = False) -> None:
            # learned from the first round; learned anew from a round that ran with this
            # peer's contribution as another number than expected (the rounds between failed
            # for everybody, see Swarm.all_reduce's round=)
            if r >= 0 and (self.swarm_base is None or (ran and expected is not None and r != expected)):
                self.swarm_base = (r, seq)

        expected = None if base is None else base[0] + (seq - base[1])
        return Plan(seq, tau, max(steps_done, 1) * self.samples_per_step, expected, learn)


class _Exchanges(collections.deque):
    """The last 4 exchange times (seconds), and how many were ever appended (the rounds)."""

    def __init__(self) -> None:
        super().__init__(maxlen=4)
        self.appended = 0

    def append(self, seconds: float) -> None:
        super().append(seconds)
        self.appended += 1


class AutoTau:
    """tau per round with ``overlap_steps="auto"``: ``ceil(1.25 * t_x / t_s)`` within ``[1, cap]``,
    ``t_x`` the longest of the last 4 exchanges (boundary to result in, seconds), ``t_s`` the
    mean inner-step time between round starts with stalls excluded (seconds); 1 until a round
    has completed. Host-side arithmetic on a few floats, once per round.

    The "cap binds" warning needs sustained evidence: at least :attr:`WARN_ROUNDS` of the last
    :attr:`WARN_WINDOW` rounds each had an exchange longer than ``cap * t_s`` (a round whose step
    waited), judged when the round's exchange comes in; the wait it names is the median of those
    rounds' exchanges minus ``cap * t_s``, and it must be material: at least
    :attr:`WARN_FRACTION` of the steps' time between round starts (a utilisation under 0.95).
    One slow round (a join, a resync, a compile) is not warned about; at most one warning every
    50 rounds."""

    WARN_ROUNDS = 3
    WARN_WINDOW = 4
    WARN_FRACTION = 0.05

    def __init__(self, cap: int):
        self.cap = cap
        self.needed = 0  # the last round's uncapped ceil(1.25 * t_x / t_s): what hiding it would take
        self._warned_at = -(10**9)  # the choose() call of the last "cap binds" warning
        self._calls = 0
        self.exchanges: _Exchanges = _Exchanges()
        self._judged = 0  # exchanges already judged for the warning
        self._waited: collections.deque[tuple[bool, float]] = collections.deque(maxlen=self.WARN_WINDOW)
        self._clock: tuple[float, int, float] | None = None  # (perf_counter, step, total stall)
        self._step_seconds: float | None = None
        self._round_steps = 0  # inner steps between the last two round starts

    def reset(self) -> None:
        """The step counter jumped (a state download, a restore): measure afresh."""
        self._clock = None

    def choose(self, step: int, stall_seconds: float) -> int:
        now = time.perf_counter()
        if self._clock is not None:
            t0, s0, stall0 = self._clock
            if step > s0:
                self._round_steps = step - s0
                per_step = max(now - t0 - (stall_seconds - stall0), 0.0) / (step - s0)
                self._step_seconds = per_step if self._step_seconds is None else 0.5 * (self._step_seconds + per_step)
        self._clock = (now, step, stall_seconds)
        self._calls += 1
        if not self.exchanges or not self._step_seconds:
            return 1
        need = 1.25 * max(self.exchanges) / max(self._step_seconds, 1e-6)
        self.needed = max(1, math.ceil(need))
        self._warn_if_sustained()
        return max(1, min(self.cap, self.needed))

    def _warn_if_sustained(self) -> None:
        """Judges the exchanges that came in since the last call; warns on sustained waits."""
        assert self._step_seconds is not None
        hidden = self.cap * self._step_seconds  # what tau = cap hides, seconds
        new = min(self.exchanges.appended - self._judged, len(self.exchanges))
        self._judged = self.exchanges.appended
        for x in list(self.exchanges)[len(self.exchanges) - new :]:
            self._waited.append((x > hidden, x))
        slow = sorted(x for waited, x in self._waited if waited)
        if len(slow) < self.WARN_ROUNDS or self._calls - self._warned_at < 50:
            return
        mid = len(slow) // 2
        median = slow[mid] if len(slow) % 2 else 0.5 * (slow[mid - 1] + slow[mid])
        if median - hidden < self.WARN_FRACTION * self._round_steps * self._step_seconds:
            return  # waits too short to matter (utilisation >= 0.95)
        self._warned_at = self._calls
        log.warning(
            "in %d of the last %d rounds the exchange (median %.2f s) outlasted the overlap: it needs tau=%d "
            "inner steps (%.3f s each) to hide; the staleness budget caps auto tau at %d, so the step waits "
            "about %.2f s per round (raise staleness_budget or max_overlap_steps, use a larger H, or a "
            "smaller codec)",
            len(slow),
            len(self._waited),
            median,
            max(1, math.ceil(1.25 * median / max(self._step_seconds, 1e-6))),
            self._step_seconds,
            self.cap,
            median - hidden,
        )
