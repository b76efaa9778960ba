"""When an :class:`~ravnest_jax.sync.OuterSync`'s rounds start, with what weight and overlap, and
which swarm round each one is."""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from statistics import median
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

    Rounds start at ``tx.due_fragments(step)``. Exchange ``seq`` is swarm round ``base +
    (seq - seq_base)`` once :attr:`swarm_base` ``= (base, seq_base)`` is known (learned from the
    first round that ran): a late peer then fails fast instead of mixing an old
    pseudo-gradient into a later round.

    Args:
      tx: the :func:`rj.diloco` transformation.
      overlap_steps: tau (an int) or ``"auto"`` (:class:`AutoTau` with ``cap``).
      samples_per_step: samples per inner step (weights).
    """

    def __init__(self, tx: Any, overlap_steps: int | str, cap: int, samples_per_step: float):
        self.tx, self.overlap_steps, self.samples_per_step = tx, overlap_steps, samples_per_step
        self.tau = AutoTau(cap, tx.sync_every, tx.sync_every // tx.fragments)  # the steps between round starts
        self.rounds_started = 0
        self.swarm_base: tuple[int, int] | None = None
        self._last_round_step = dict.fromkeys(range(tx.fragments), 0)  # fragment -> step of its last round

    def restart(
        self, step: int | None, rounds_started: int | None = None, swarm_base: tuple[int, int] | None = None
    ) -> None:
        """The step counter is ``step`` now (first call, restore, state download; ``None``: a
        restore of a driver that had not run, known at its first call, which restarts again):
        every fragment's next weight counts from here; with ``rounds_started``, the new counters
        and round mapping (``swarm_base``) too."""
        self._last_round_step = dict.fromkeys(range(self.tx.fragments), step)
        if rounds_started is not None:
            self.rounds_started, self.swarm_base = rounds_started, swarm_base
        self.tau.reset()

    def plan(self, fragment: int, step: int, stall_seconds: float) -> Plan:
        """Takes the next exchange number for ``fragment``'s round at ``step``."""
        seq = self.rounds_started
        self.rounds_started += 1
        steps_done = step - self._last_round_step[fragment]
        self._last_round_step[fragment] = step
        tau = int(self.overlap_steps) if self.overlap_steps != "auto" else self.tau.choose(step, stall_seconds)

        def learn(r: int, ran: bool = False) -> None:
            # learned from the first round; learned anew from a round that ran with this
            # peer's contribution as another number than expected (the rounds between failed
            # for everybody, see Swarm.all_reduce's round=)
            if r >= 0 and (self.swarm_base is None or (ran and expected is not None and r != expected)):
                self.swarm_base = (r, seq)

        expected = None if self.swarm_base is None else self.swarm_base[0] + (seq - self.swarm_base[1])
        return Plan(seq, tau, max(steps_done, 1) * self.samples_per_step, expected, learn)


class AutoTau:
    """tau per round with ``overlap_steps="auto"``: ``ceil(1.25 * t_x / t_s)`` within ``[1, cap]``,
    ``t_x`` the longest of the last 4 exchanges (boundary to result in, seconds), ``t_s`` the
    mean inner-step time between round starts with stalls excluded (seconds); 1 until a round
    has completed. Host-side arithmetic on a few floats, once per round.

    The "the device waits" warning is judged on what was measured, not on what the exchange
    times predict: each round's stall (the device idle waiting for its result, see
    ``_pipeline.idle_since``) against the time since the previous merge, i.e. the round's
    ``compute_utilisation`` (:meth:`observe`). It needs sustained evidence: at least
    :attr:`WARN_ROUNDS` of the last :attr:`WARN_WINDOW` judged rounds each with a utilisation
    under ``1 - WARN_FRACTION`` (0.95), and the utilisation over those rounds together under it
    too. Not judged: the start-up, rounds whose tau was chosen from fewer than 4 measured
    exchanges (tau 1 in the first round, then the longest of the few seen; peers still joining
    and compiling), and rounds merged early by a flush; one slow round (a join, a resync, a
    compile) is not warned about; at most one warning every 50 judged rounds. The warning names
    the measured stall and utilisation and the tau that would have hidden the wait (the round's
    tau plus the steps the device sat idle for), and what to set for it."""

    WARN_ROUNDS = 3
    WARN_WINDOW = 4
    WARN_FRACTION = 0.05

    def __init__(self, cap: int, sync_every: int | None = None, gap: int | None = None):
        self.cap = cap
        self.sync_every, self.gap = sync_every, gap  # H, and the steps between round starts
        self.needed = 0  # the last round's uncapped ceil(1.25 * t_x / t_s): what hiding it would take
        self._warned_at = -(10**9)  # the judged round of the last warning
        self._judged = 0  # rounds judged by observe()
        self.exchanges: collections.deque[float] = collections.deque(maxlen=4)  # the last 4 exchange times (s)
        # the last WARN_WINDOW judged rounds: (tau, stall s, seconds since the previous merge, exchange s)
        self._rounds: collections.deque[tuple[int, float, float, float]] = collections.deque(maxlen=self.WARN_WINDOW)
        self._clock: tuple[float, int, float] | None = None  # (perf_counter, step, total stall)
        self._step_seconds: float | None = None

    def reset(self) -> None:
        """The step counter jumped (a state download, a restore): measure afresh."""
        self._clock = None

    def choose(self, step: int, stall_seconds: float) -> int:
        now = time.perf_counter()
        if self._clock is not None:
            t0, s0, stall0 = self._clock
            if step > s0:
                per_step = max(now - t0 - (stall_seconds - stall0), 0.0) / (step - s0)
                self._step_seconds = per_step if self._step_seconds is None else 0.5 * (self._step_seconds + per_step)
        self._clock = (now, step, stall_seconds)
        if not self.exchanges or not self._step_seconds:
            return 1
        need = 1.25 * max(self.exchanges) / max(self._step_seconds, 1e-6)
        self.needed = max(1, math.ceil(need))
        return max(1, min(self.cap, self.needed))

    def observe(self, tau: int, stall: float, window: float, exchange: float) -> None:
        """A round merged at its due step (not by a flush), before its exchange time is appended:
        ``tau`` the steps it overlapped, ``stall`` the seconds the device sat idle waiting for
        it (measured), ``window`` the seconds since the previous merge (stall included),
        ``exchange`` its exchange seconds. Warns on a sustained, material wait (see the class)."""
        if len(self.exchanges) < self.WARN_WINDOW or not self._step_seconds:
            return  # the start-up: its tau was chosen from fewer than 4 measured exchanges
        self._judged += 1
        self._rounds.append((tau, stall, max(window, 1e-9), exchange))
        limit = 1.0 - self.WARN_FRACTION
        slow = [r for r in self._rounds if 1.0 - r[1] / r[2] < limit]
        utilisation = 1.0 - sum(r[1] for r in self._rounds) / sum(r[2] for r in self._rounds)
        if len(slow) < self.WARN_ROUNDS or utilisation >= limit or self._judged - self._warned_at < 50:
            return
        self._warned_at = self._judged
        t_s = self._step_seconds
        # the tau that would have hidden each slow round's wait: its tau + the steps it sat idle for
        hide = math.ceil(median([r[0] + r[1] / t_s for r in slow]) - 1e-9)
        log.warning(
            "the device waited for the outer rounds: in %d of the last %d rounds it sat idle for the result, "
            "%.3f s per round (median, measured), compute utilisation %.2f over those %d rounds; tau=%d inner "
            "steps (%.3f s each) did not hide the exchange (median %.2f s), tau=%d would. %s",
            len(slow),
            len(self._rounds),
            median([r[1] for r in slow]),
            utilisation,
            len(self._rounds),
            round(median([float(r[0]) for r in slow])),
            t_s,
            median([r[3] for r in slow]),
            hide,
            self._advice(hide),
        )

    def _advice(self, hide: int) -> str:
        """What to set so that auto tau may reach ``hide``."""
        if self.gap is not None and hide >= self.gap:
            return (
                f"No tau below the {self.gap} steps between round starts hides it: use a larger H (sync_every) "
                "or a smaller codec"
            )
        if hide > self.cap:
            budget = ""
            if self.sync_every:
                from ravnest_jax._staleness import staleness_cost

                cost = staleness_cost(hide, self.sync_every)
                budget = f", or staleness_budget={math.ceil(cost * 1000 - 1e-9) / 1000:g} (predicted eval-loss cost)"
            return (
                f"The staleness budget caps auto tau at {self.cap}: set overlap_steps={hide}{budget}; "
                "or use a larger H, or a smaller codec"
            )
        return (
            f"auto tau may go up to {self.cap} but chose from the longest of the last 4 exchanges, which these "
            f"rounds outlasted: set overlap_steps={hide}, or use a larger H"
        )
