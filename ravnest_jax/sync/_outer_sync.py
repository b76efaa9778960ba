"""The host-side driver of outer rounds: overlaps the swarm's all-reduce with inner steps.

The only layer that crosses between the jitted world and the swarm's event loop. The DiLoCo
math lives in :mod:`ravnest_jax.optim` (jitted in ``_pipeline.py``); this module schedules it:
when a round starts, when its result merges, what a failed round costs.

References:
  Douillard et al., DiLoCo, https://arxiv.org/abs/2311.08105
  Douillard et al., Streaming DiLoCo with overlapping communication, https://arxiv.org/abs/2501.18512
  Kale et al., Eager updates for overlapped communication and computation in DiLoCo,
  https://arxiv.org/abs/2502.12996
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from ravnest_jax import host_memory
from ravnest_jax.compress import Codec
from ravnest_jax.optim import DiLoCo, DiLoCoState

from . import _nnx
from ._config import MODES, check_options
from ._contract import SwarmContract
from ._metrics import RoundMetrics, Totals, report_summary, round_metrics, summarize
from ._pipeline import Pending, RoundFunctions, RoundPipeline
from ._recovery import after_failure, taken_again
from ._run_manifest import ManifestDeclaration
from ._schedule import Schedule
from ._state_msg import StateExchange, StateServer
from ._stats import PeerStats

log = logging.getLogger("ravnest_jax.sync")

__all__ = ["OuterSync", "RoundMetrics", "MODES"]


def _check_plain(params: Any, state: Any) -> None:
    """Raises TypeError when the params and the state's anchor differ in tree structure (the
    round functions need one). The common cause: ``nnx.state(model)`` (``Param`` variables) with
    an ``nnx.Optimizer``'s state (``OptVariable`` wrappers over the same arrays)."""
    anchor = getattr(state, "global_params", None)
    if anchor is None or jax.tree.structure(anchor) == jax.tree.structure(params):
        return
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if any(is_var(x) for x in jax.tree.leaves((params, anchor), is_leaf=is_var)):
        raise TypeError(
            "params and state.global_params differ in their nnx variable wrappers (nnx.state(model) "
            "next to an nnx.Optimizer's state): call sync(model, optimizer) with the nnx.Module and its "
            "nnx.Optimizer(model, rj.diloco(...), wrt=nnx.Param)"
        )
    raise TypeError(
        f"params and state.global_params differ in tree structure: {jax.tree.structure(params)} vs "
        f"{jax.tree.structure(anchor)}: pass the state tx.init(params) made for these params"
    )


class OuterSync(ManifestDeclaration, StateExchange):
    """Drives DiLoCo outer rounds over a swarm, overlapped with inner steps.

    Call it after every train step: ``params, state = sync(params, state)``. On most steps it
    only counts. At a round boundary it takes the pseudo-gradient with the jitted round
    functions of ``tx``, encodes it on the device with the swarm's codec (``swarm.codec``, an
    ``rj.Codec``: its options and error feedback),
    starts a non-blocking device-to-host copy, hands the encoded bytes to the swarm's background
    loop and returns at once. When the averaged result is due it is merged with the jitted merge
    function; if it is not in yet, the step blocks and the stall is counted.

    How a round meets the training (``mode``, as the run manifest and the docs name it):

    - ``overlap_steps=0`` (``"blocking"``): plain DiLoCo; the round is exchanged and applied at
      the boundary step.
    - ``overlap_steps=tau`` (``"delayed"``, the default with tau = 1): Streaming DiLoCo's overlap
      (arXiv 2501.18512): the result is merged tau inner steps after the boundary, keeping the
      local progress made meanwhile, mixed with ``alpha``.
    - ``eager=True`` (``"eager"``, arXiv 2502.12996; tau >= 1): at the boundary the local
      pseudo-gradient stands in for the average (the params restart from the speculative anchor
      at once); when the true average arrives tau steps later the anchor is recomputed from it
      and the local progress since the boundary is rebased onto it. The global state stays
      identical on all peers.

    With ``tx.fragments > 1`` each fragment has its own rounds (``tx.due_fragments``), in the same
    order on every peer. Contributions are weighted by samples processed (``samples_per_step``
    times the steps since this peer's last round).

    Args:
      tx: the :func:`rj.diloco` transformation (``axis_name=None``).
      swarm: an ``rj.Swarm`` (or anything with ``codec``, an ``rj.Codec``, and
        ``all_reduce_async(tree, weight)``). Its codec value sets the device-side encode: the
        codec and its options, error feedback and its decay (``rj.Codec``).
      overlap_steps: tau, inner steps between a round's boundary and its merge; ``0 <= tau <
        sync_every / fragments``. ``"auto"``: chosen per round so that the exchange hides behind
        the inner steps (``ceil(1.25 * t_x / t_s)`` in ``[1, cap]``, ``t_x`` the longest of the
        last 4 exchanges, ``t_s`` the inner-step time; see ``_schedule.AutoTau``; ``cap``, the
        largest tau within ``staleness_budget``, is the attribute ``max_overlap_steps``).
        Peers may then merge at different steps: the global state stays identical, only local
        progress differs (not bit-reproducible). Not for a peer over several processes.
      staleness_budget: the eval-loss cost (a fraction, default 0.01) that ``"auto"`` may spend
        on staleness: a larger tau merges staler averages, predicted to cost ``0.00275 + 0.0625
        * tau / H`` (fitted to ``benchmarks/bench_convergence.py``, H = 50: tau = 1 +0.4 %, tau
        = 5 +0.9 % against blocking DiLoCo), so 0.01 allows tau <= 0.116 H (5 at H = 50, 58 at
        H = 500). ``RoundMetrics.needed_overlap_steps`` reports the tau a round would have
        needed, and a warning says when the device measurably waits for the rounds: at least 3
        of the last 4 rounds with a utilisation under 0.95, and those rounds together too
        (never after one slow round; at most every 50 rounds); it names the tau that would
        have hidden the wait and what to set.
      eager: the eager rounds above (default False).
      alpha: mixing weight of the local params at the merge, in ``[0, 1]``.
      samples_per_step: this peer's samples per inner step (the weight of its contribution is
        samples processed since its last round).
      on_round: callback ``f(RoundMetrics)`` after every round (called from the training thread).
      donate: the merge reuses the buffers of the params and state passed to that ``sync`` call
        (XLA buffer donation): a round's device memory drops by their size (about 5x the params
        with Adam inside), and those arrays are deleted: keep only what ``sync`` returns.
      codec: only with ``swarm=None``: the ``rj.Codec`` (or name) of process 0's swarm, on the
        processes other than 0 of a peer that spans several processes (``jax.distributed``),
        which encode with process 0 (docs/multi-device.md). With a swarm, its codec is used
        (``codec`` may be given too, equal to it: one line for every process).

    ``metrics`` holds the :class:`RoundMetrics` of the last 10,000 rounds (older ones are
    dropped, so memory stays flat); :meth:`summary` counts every round.

    A peer may span several processes (``jax.distributed``): all run the same loop and calls,
    process 0 holds the swarm and broadcasts each mean; such a peer serves and downloads no
    state, a failed round is skipped (docs/multi-device.md).

    Raises:
      ValueError: a bad eager, overlap, alpha, samples_per_step, a tx with
        ``axis_name`` set, a swarm without ``all_reduce_async`` (``None`` is accepted only on the
        processes other than 0 of a multi-process peer, with ``codec``), a ``codec`` that is not
        the swarm's.
    """

    def __init__(
        self,
        tx: DiLoCo,
        swarm: SwarmContract | None,
        *,
        overlap_steps: int | str = 1,
        eager: bool = False,
        staleness_budget: float = 0.01,
        alpha: float = 0.0,
        samples_per_step: float = 1.0,
        on_round: Callable[[RoundMetrics], None] | None = None,
        codec: Codec | str | None = None,
        donate: bool = False,
    ):
        self._processes = jax.process_count()
        opts = (eager, overlap_steps, alpha, samples_per_step, codec)
        leader = jax.process_index() == 0
        cap = check_options(
            tx, swarm, *opts, processes=self._processes, leader=leader, staleness_budget=staleness_budget
        )
        self.tx = tx
        self.swarm = swarm
        host_memory.tune_host_allocator()  # round buffers reused from the heap (see its docstring)
        # "blocking" (tau 0), "delayed" or "eager": the run manifest's and the docs' names
        self.mode = "eager" if eager else ("blocking" if overlap_steps == 0 else "delayed")
        self.overlap_steps: int | str = overlap_steps
        self.max_overlap_steps = cap  # auto tau's cap, from staleness_budget (None: a fixed tau)
        self._schedule = Schedule(tx, self.overlap_steps, cap or 1, float(samples_per_step))
        # (swarm round, state digest) after the last merged round: sent with the next exchange
        self._last_state: tuple[int, str] | None = None
        self._state_digest: str | None = None
        self.alpha = float(alpha)
        self.codec = Codec.of(codec if swarm is None else swarm.codec)
        self.samples_per_step = float(samples_per_step)
        self.on_round = on_round
        c = self.codec
        self._fns = RoundFunctions(tx, c.name, c.options, self.mode != "blocking", c.error_feedback_decay, bool(donate))
        self._rounds = RoundPipeline(tx, swarm, self._fns, c, alpha=self.alpha, eager=eager)
        self._pending = self._rounds.pending  # rounds in flight, oldest first

        self.step: int | None = None  # inner steps taken (== state.count), known after 1st call
        self.metrics: list[RoundMetrics] = []  # the last _metrics.METRICS_KEPT rounds
        self._totals = Totals()  # over every round (summary())
        self.stall_seconds = 0.0
        self.failed_rounds = 0
        self.resyncs = 0
        self._window_start = time.perf_counter()
        self._server = StateServer()
        self._stats = PeerStats()
        self._closed = False
        self._readied = False
        self._ready: Any = None  # the future of the last ready() (the rendezvous' answer)
        self._downloaded = False  # the state came from a peer: ready again, and check (taken_again)
        self._declared = False  # the run manifest (declare_manifest)
        # the run's reference initial state ({"init", "init_from"}) and this peer's digest of its own
        self.run_initial: dict | None = None
        self.initial_digest: str | None = None
        # this driver serves its own state to peers that join or resync, and downloads the
        # current state from a live peer after a failed round (a multi-process peer does
        # neither: its state lives on several hosts)
        self._serving = self._processes == 1 and swarm is not None
        if self._serving:
            swarm.serve_state(self.request_state)

    # ------------------------------------------------------------------ public API
    def __call__(self, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        """Counts one inner step; starts, merges or waits for rounds when they are due.

        Args:
          params: the local params after this step's inner update.
          state: the :class:`DiLoCoState` after this step.

        Returns:
          ``(params, state)``, unchanged on most steps.

        With flax nnx, pass the model and its ``nnx.Optimizer(model, rj.diloco(...),
        wrt=nnx.Param)`` instead: ``sync(model, optimizer)`` updates both in place (and returns
        them); on steps with nothing due it only counts, as with pytrees.

        Raises:
          RuntimeError: called after :meth:`close`.
          TypeError: on the first call, when ``params`` and ``state.global_params`` differ in
            tree structure (for example ``nnx.state(model)`` next to an ``nnx.Optimizer``'s
            state: pass the model and the optimizer).
        """
        if self._closed:
            raise RuntimeError("OuterSync is closed")
        if _nnx.is_optimizer(state):
            return self._call_nnx(params, state)
        if self.step is None:
            if not isinstance(state, DiLoCoState):
                raise TypeError(
                    f"state must be the DiLoCoState of tx.init(params), got {type(state).__name__} (with flax "
                    "nnx: sync(model, optimizer) with the nnx.Optimizer itself)"
                )
            _check_plain(params, state)
            self.declare_manifest(params)
            self.step = int(state.count) - 1  # one host read, on the first call only
            self._schedule.restart(self.step)
            self._mark_ready()
        elif not self._readied:
            self._mark_ready()
            data = taken_again(self, params, state) if self._downloaded else None
            self._downloaded = False
            if data:  # rounds ran without this peer since its download: their state, before its first
                params, state = self.load_state_bytes(data, params, state)
                self._readied, self._downloaded = True, False
                return params, state
        self.step += 1
        step = self.step  # a resync in the first merge may move self.step: the rounds due are this step's
        # merge what is due (oldest first), start what is due, merge what is due at once (tau=0)
        params, state = self._merge_due(params, state)
        for fragment in self.tx.due_fragments(step):
            params, state = self._start(fragment, params, state)
        params, state = self._merge_due(params, state)
        # Serve a requested state only now, with no round in flight: the state of this step
        # after its round (if one was due) started and merged. Served before the round start,
        # the receiver would continue after this step and never start or merge that round.
        if self._server.wanted and not self._pending:
            self._serve_state(params, state)
        return params, state

    def _call_nnx(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        nxt = None if self.step is None else self.step + 1
        busy = (
            nxt is None
            or not self._readied
            or self._server.wanted
            or bool(self._pending and self._pending[0].due_step <= nxt)
            or bool(self.tx.due_fragments(nxt))
        )
        if not busy:  # most steps: count only, no tree walk
            self.step = nxt
            return model, optimizer
        return _nnx.through(self, model, optimizer)

    def _mark_ready(self) -> None:
        """The first step: tell the swarm this peer trains (ends a joiner's standby at once, so
        that the next round created includes it). Non-blocking."""
        self._readied = True
        if self.swarm is None:  # a process other than 0 of a peer: process 0 tells it
            return
        with contextlib.suppress(RuntimeError):  # a swarm that is not running: nothing to tell
            self._ready = self.swarm.ready()

    def _merge_due(self, params: Any, state: DiLoCoState, flush: bool = False) -> tuple[Any, DiLoCoState]:
        while self._pending and (flush or self._pending[0].due_step <= self.step):
            params, state = self._finish(self._pending.popleft(), params, state)
        return params, state

    def warmup(self, params: Any, state: DiLoCoState) -> None:
        """Compiles the round functions ahead of time (they otherwise compile at the first round
        boundary, which would make this peer late for its first round). Runs nothing."""
        if _nnx.is_optimizer(state):
            params, state = _nnx.split(params, state)
        self._rounds.compile(params, state)

    def flush(self, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        """Waits for every round in flight and merges it now (for example before a checkpoint
        or at the end of training). Returns ``(params, state)`` (nnx: the model and optimizer,
        updated in place)."""
        if _nnx.is_optimizer(state):
            return _nnx.through(self.flush, params, state) if self._pending else (params, state)
        return self._merge_due(params, state, flush=True)

    @property
    def global_state_digest(self) -> str | None:
        """Hex digest (32 characters) of ``(state.global_params, state.outer_state)`` after the
        last merged round: the value every live peer reports as ``RoundMetrics.state_digest``,
        computed inside the jitted merge (no extra device work or compilation). None before the
        first merge, and after ``load_state_dict`` or a state download until the next merge."""
        return self._state_digest

    @property
    def rounds_started(self) -> int:
        """Exchanges started by this driver (its round counter; restored with its state)."""
        return self._schedule.rounds_started

    @property
    def pending(self) -> int:
        """Rounds in flight (started, not merged)."""
        return len(self._pending)

    def report(self, **scalars: Any) -> None:
        """Publishes scalars of this peer (``train_loss=``, ``eval_loss=``, up to 8 names) with
        its round stats, for the rendezvous' status page (per peer, and averaged per round).
        Floats, or device scalars (a jitted step's loss: read at the next round, steps later,
        so that the step never waits for the host). ``None`` removes a name.

        Raises:
          ValueError: a name that is not an identifier, a ninth name, a value that is not a scalar.
        """
        self._stats.report(scalars)

    def summary(self) -> dict:
        """Totals so far: rounds, failures, resyncs, bytes, stall seconds, mean utilisation,
        mean overlap tau (steps), the swarm's ``run_id``. Means over no round are ``None`` (the
        dict is strict JSON)."""
        out = summarize(self._totals, self.failed_rounds, self.resyncs, self.stall_seconds)
        return {**out, "run_id": self.swarm.run_id if self.swarm is not None else None}

    def state_dict(self, params: Any) -> dict:
        """The driver's own state for a checkpoint (a pytree of numpy values with a fixed
        structure for given params): the step, exchanges started, the swarm-round mapping and
        the error-feedback residual of every fragment (float32, zeros before its first round).

        Args:
          params: the params (only their shapes are read), or the nnx model.

        Raises:
          RuntimeError: rounds are in flight (call :meth:`flush` first, or save between rounds).
        """
        if isinstance(params, nnx.Module):
            params = nnx.as_pure(nnx.state(params, nnx.Param))
        if self._pending:
            raise RuntimeError("rounds are in flight: call flush(params, state) before state_dict()")
        base = self._schedule.swarm_base if self._schedule.swarm_base is not None else (-1, -1)
        return {
            "step": np.int64(-1 if self.step is None else self.step),
            "rounds_started": np.int64(self._schedule.rounds_started),
            "swarm_base": np.asarray(base, np.int64),
            "residual": self._rounds.residual_state(params),
        }

    def load_state_dict(self, d: dict, *, round_mapping: bool = True) -> None:
        """Restores what :meth:`state_dict` returned (for example from an ``rj.Checkpointer``).

        Args:
          d: the dict :meth:`state_dict` returned.
          round_mapping: keep the saved mapping from this driver's exchanges to the swarm's
            round numbers. Pass ``False`` when the whole swarm restarts from a common
            checkpoint (:func:`common_checkpoint_step`): the rendezvous may have numbered
            rounds on since, so the mapping is learned afresh from the first round, which every
            restarted peer enters together.
        """
        step, started = int(d["step"]), int(d["rounds_started"])
        self.step = None if step < 0 else step
        base = [int(x) for x in np.asarray(d.get("swarm_base", (-1, -1))).reshape(-1)]
        mapping = (base[0], base[1]) if round_mapping and len(base) == 2 and base[0] >= 0 else None
        self._schedule.restart(self.step, started, mapping)
        self._rounds.load_residual(d.get("residual", {}))
        self._pending.clear()
        self._last_state = None
        self._state_digest = None

    def close(self) -> None:
        """Stops the background worker (rounds in flight are abandoned). Idempotent."""
        if self._closed:
            return
        self._closed = True
        report_summary(self.summary())
        self._rounds.close()
        self._server.close()
        if self._serving:
            self.swarm.serve_state(None)  # the endpoint answers 404: requesters try another peer
        # an exchange in flight ends when the swarm closes (it cancels its rounds): do not wait

    def __enter__(self) -> OuterSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ rounds
    def _start(self, fragment: int, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        plan = self._schedule.plan(fragment, self.step, self.stall_seconds)
        return self._rounds.start(fragment, params, state, self.step, plan, self._last_state), state

    def _finish(self, p: Pending, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        out, params, state, digest = self._rounds.finish(p, params, state)
        stall = out.stall_seconds
        self.stall_seconds += stall
        now = time.perf_counter()
        window = now - self._window_start  # since the previous merge, this stall included
        utilisation = max(0.0, 1.0 - stall / max(window, 1e-9))
        self._window_start = now
        timing = (p.seq, p.fragment, p.step, self.step, out.exchange_seconds, stall, utilisation)
        m = round_metrics(
            *timing,
            record=out.record,
            payload_bytes=out.payload_bytes,
            float_bytes=out.float_bytes,
            state_digest=digest or "",
            error=out.error,
            needed_overlap_steps=self._schedule.tau.needed if self.overlap_steps == "auto" else 0,
        )
        if m.ok:
            if out.record is not None:
                if self.overlap_steps == "auto" and self.step >= p.due_step:  # merged when due, not by a flush
                    self._schedule.tau.observe(p.due_step - p.step, stall, window, out.exchange_seconds)
                self._schedule.tau.exchanges.append(out.exchange_seconds)
            self._state_digest = m.state_digest
            if m.swarm_round >= 0:
                self._last_state = (m.swarm_round, m.state_digest)
        else:
            self.failed_rounds += 1
            log.warning("round %d (fragment %d) failed on this peer: %s", p.seq, p.fragment, out.error)
            params, state = after_failure(self, p, out.exc, params, state)
        self._totals.add(m, self.metrics)
        self._stats.publish(self.swarm, m, self)
        if self.on_round is not None:
            self.on_round(m)
        return params, state
