"""Where to cut: contiguous stages of units balanced by parameter bytes or by measured time."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["StagePlan", "balance", "plan_stages", "unit_seconds"]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Which units each stage holds.

    Attributes:
      bounds: ``((lo, hi), ...)``, stage ``s`` holds units ``[lo, hi)``; contiguous, covering
        every unit once.
      costs: the cost of each stage under ``by`` (bytes or seconds).
      by: ``"bytes"`` or ``"time"``: what was balanced.
      unit_names: the split's unit names.
    """

    bounds: tuple[tuple[int, int], ...]
    costs: tuple[float, ...]
    by: str
    unit_names: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    @property
    def imbalance(self) -> float:
        """Largest stage cost over the mean stage cost (1.0: perfectly balanced)."""
        return max(self.costs) / max(float(np.mean(self.costs)), 1e-30)

    def describe(self) -> str:
        """One line per stage: its units and cost."""
        unit = "MB" if self.by == "bytes" else "ms"
        scale = 1e-6 if self.by == "bytes" else 1e3
        lines = []
        for s, ((lo, hi), c) in enumerate(zip(self.bounds, self.costs)):
            names = self.unit_names[lo:hi] if self.unit_names else [str(i) for i in range(lo, hi)]
            lines.append(f"stage {s}: units {lo}..{hi - 1} ({', '.join(names)}), {c * scale:.3g} {unit}")
        return "\n".join(lines)


def balance(costs: Sequence[float], num_stages: int) -> tuple[tuple[int, int], ...]:
    """Cuts ``costs`` (one per unit, >= 0) into ``num_stages`` contiguous non-empty runs that
    minimise the largest run's sum (exact dynamic programme, O(S n^2)); among the optimal cuts
    the one that makes earlier stages no larger (ties toward later cuts) is returned, so the
    result depends on the costs only.

    Raises:
      ValueError: ``num_stages`` < 1 or more stages than units; a negative or non-finite cost.
    """
    c = [float(x) for x in costs]
    n = len(c)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"{num_stages} stages need at least as many units; the model has {n}")
    if any(not np.isfinite(x) or x < 0 for x in c):
        raise ValueError(f"unit costs must be finite and >= 0, got {c}")
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    inf = float("inf")
    # best[k][i]: the smallest possible max over the first i units cut into k runs
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):  # the last run is units [j, i)
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v <= best[k][i] * (1 + 1e-12):  # ties: the later cut (a smaller last run)
                    best[k][i], cut[k][i] = min(v, best[k][i]), j
    bounds = []
    i = n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return tuple(reversed(bounds))


def unit_seconds(split: Any, micro_batch: int, seq_len: int, repeats: int = 3) -> list[float]:
    """Measures each unit's forward plus backward time on this machine (seconds per micro-batch
    of ``micro_batch`` sequences of ``seq_len`` tokens): the unit alone, jitted, the median of
    ``repeats`` runs after a compile run. The epilogue includes the loss."""
    import jax
    import jax.numpy as jnp

    hidden = split.hidden(micro_batch, seq_len)
    out = []
    for u in range(split.num_units):
        st = split.stage(u, u + 1, check=False)
        if st.first:
            x = jnp.zeros((micro_batch, seq_len), jnp.int32)
        else:
            x = jnp.zeros(hidden.shape, hidden.dtype)
        targets = jnp.zeros((micro_batch, seq_len), jnp.int32)

        def f(p, fr, x, st=st, targets=targets):
            y = st.apply(p, fr, x)
            return st.loss(y, targets) if st.last else jnp.sum(y.astype(jnp.float32))

        if st.first:
            step = jax.jit(jax.grad(f))
        else:
            step = jax.jit(jax.grad(f, argnums=(0, 2)))
        jax.block_until_ready(step(st.params, st.frozen, x))
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            jax.block_until_ready(step(st.params, st.frozen, x))
            times.append(time.perf_counter() - t0)
        out.append(float(np.median(times)))
    return out


def plan_stages(
    split: Any,
    num_stages: int,
    *,
    by: str = "bytes",
    micro_batch: int | None = None,
    seq_len: int | None = None,
    costs: Sequence[float] | None = None,
) -> StagePlan:
    """The :class:`StagePlan` of ``split`` (a :class:`LayerSplit`) into ``num_stages`` stages.

    Args:
      by: ``"bytes"``: balance the parameter bytes each stage holds (memory, and compute when
        the units are alike); ``"time"``: balance forward plus backward seconds measured per unit
        here (:func:`unit_seconds`; needs ``micro_batch`` and ``seq_len``), for models whose
        units differ (a large vocabulary head).
      costs: use these per-unit costs instead of measuring (e.g. measured once and shipped to
        every stage, so all stages cut alike; stages that measure on their own may disagree).

    Raises:
      ValueError: an unknown ``by``, ``by="time"`` without the shape, or as :func:`balance`.
    """
    if by not in ("bytes", "time"):
        raise ValueError(f"by must be 'bytes' or 'time', got {by!r}")
    if costs is None:
        if by == "bytes":
            costs = split.unit_nbytes()
        else:
            if micro_batch is None or seq_len is None:
                raise ValueError("by='time' needs micro_batch and seq_len (the shape to time)")
            costs = unit_seconds(split, micro_batch, seq_len)
    bounds = balance(costs, num_stages)
    per = tuple(float(sum(costs[lo:hi])) for lo, hi in bounds)
    return StagePlan(bounds, per, by, tuple(getattr(split, "unit_names", ())))
