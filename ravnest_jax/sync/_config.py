"""The options of :class:`~ravnest_jax.sync.OuterSync`, checked before anything compiles."""

from __future__ import annotations

import math
from typing import Any

from ravnest_jax._staleness import overlap_cap
from ravnest_jax.compress import Codec
from ravnest_jax.optim import DiLoCo

from ._contract import check_contract

MODES = ("blocking", "delayed", "eager")  # what the run manifest and the metrics call them


def check_options(
    tx: Any,
    swarm: Any,
    eager: Any,
    overlap_steps: Any,
    alpha: Any,
    samples_per_step: Any,
    codec: str | None,
    *,
    processes: int,
    leader: bool,
    staleness_budget: float = 0.01,
) -> int | None:
    """Checks :class:`OuterSync`'s options (see its docstring); returns the cap of ``"auto"``
    (the largest tau within ``staleness_budget``), else ``None``.

    Raises:
      ValueError: one line naming the bad option and what it must be.
    """
    if not isinstance(tx, DiLoCo):
        raise ValueError("tx must be the transformation returned by rj.diloco")
    if tx.axis_name is not None:
        raise ValueError("tx: OuterSync drives rounds from the host; build it with axis_name=None")
    if swarm is None and not (processes > 1 and not leader):
        raise ValueError(
            "swarm must be an rj.Swarm; None only on the processes other than 0 of a peer that "
            "spans several processes (jax.distributed)"
        )
    if swarm is None and codec is None:
        raise ValueError("codec must be given with swarm=None (the codec of process 0's swarm)")
    if swarm is not None:
        check_contract(swarm)
        if codec is not None and Codec.of(codec) != Codec.of(swarm.codec):
            raise ValueError(
                f"codec {Codec.of(codec)} is not the swarm's {Codec.of(swarm.codec)}: OuterSync takes the swarm's "
                "(rj.Swarm(codec=...)); codec= is for swarm=None"
            )
    if not isinstance(eager, bool):
        raise ValueError(f"eager must be True or False, got {eager!r}")
    auto = overlap_steps == "auto"
    gap = tx.sync_every // tx.fragments
    if auto:
        if processes > 1:
            raise ValueError(
                "overlap_steps='auto' needs a peer of one process (every process "
                "of a multi-process peer must merge at the same step)"
            )
        if gap < 2:
            raise ValueError(f"overlap_steps='auto' needs at least 2 steps between rounds, got {gap}")
        if not (isinstance(staleness_budget, (int, float)) and 0 < staleness_budget < 1):
            raise ValueError(f"staleness_budget must be a fraction in (0, 1), got {staleness_budget!r}")
        cap = overlap_cap(tx.sync_every, gap, float(staleness_budget))
    else:
        if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or overlap_steps < 0:
            raise ValueError(f"overlap_steps must be an int >= 0 or 'auto', got {overlap_steps!r}")
        if eager and overlap_steps < 1:
            raise ValueError("overlap_steps must be >= 1 with eager=True (tau = 0 is a blocking round)")
        if overlap_steps >= gap:
            raise ValueError(
                f"overlap_steps ({overlap_steps}) must be smaller than the steps between rounds "
                f"({gap} = sync_every / fragments)"
            )
    if not (isinstance(alpha, (int, float)) and 0.0 <= float(alpha) <= 1.0):
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    if not (isinstance(samples_per_step, (int, float)) and math.isfinite(samples_per_step) and samples_per_step > 0):
        raise ValueError(f"samples_per_step must be a finite number > 0, got {samples_per_step!r}")
    return cap if auto else None
