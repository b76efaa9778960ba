"""The staleness model of overlapped rounds (no jax import: the planner uses it too)."""

from __future__ import annotations

import math

# Eval-loss cost of merging a round tau inner steps late, as a fraction: a + b * tau / H, fitted
# to benchmarks/bench_convergence.py (char-LM, H = 50, against blocking DiLoCo: tau 1 +0.4 %,
# tau 5 +0.9 %; tau about H/2 cost some +4 % in the example, the line predicts +3.4 %).
STALENESS_COST = (0.00275, 0.0625)


def overlap_cap(sync_every: int, gap: int, budget: float) -> int:
    """The largest tau in ``[1, gap - 1]`` whose predicted staleness cost (``STALENESS_COST``)
    stays within ``budget`` (a fraction of eval loss; 1 when even tau = 1 is over it)."""
    a, b = STALENESS_COST
    fit = math.floor((budget - a) / b * sync_every + 1e-9) if budget > a else 1
    return max(1, min(gap - 1, fit))


def staleness_cost(tau: int, sync_every: int) -> float:
    """The predicted eval-loss cost (fraction) of merging ``tau`` steps late at H = ``sync_every``."""
    a, b = STALENESS_COST
    return a + b * tau / sync_every if tau > 0 else 0.0
