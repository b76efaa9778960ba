"""The 1F1B schedule of one stage: the order of its forwards, backwards and updates.

Micro-batches are numbered through the run: micro-batch ``g`` is number ``g % M`` of step
``g // M`` (``M`` micro-batches a step). Stage ``s`` of ``S`` first runs ``w = S - s - 1``
forwards (the warm-up), then alternates one forward and one backward, then runs the last ``w``
backwards: at most ``w + 1 <= S`` micro-batches are in flight on a stage (forwarded, not yet
backwarded), which bounds the activations it keeps (Narayanan et al., PipeDream, arXiv
1806.03377; the flushed variant is PipeDream-Flush / 1F1B of arXiv 2006.09503).

``"sync"``: the schedule restarts every step (a flush: every backward of step ``t`` before
any forward of step ``t + 1``), so the update of step ``t`` sees the gradients of all its
micro-batches at the weights they were computed with: the same as the unsplit model.
``"async"``: one schedule through the whole run; forwards of step ``t + 1`` start while
backwards of step ``t`` are still in flight (no bubble between steps), so some micro-batches
see weights one update old (see :mod:`._worker` for which).
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["Op", "stage_ops", "in_flight_bound"]

Op = tuple[str, int]  # ("F", g) forward of micro-batch g, ("B", g) its backward, ("U", t) update of step t


def _one_f_one_b(stage: int, num_stages: int, lo: int, count: int, micro: int) -> Iterator[Op]:
    """1F1B over micro-batches ``lo .. lo + count - 1``; ("U", t) after the last backward of
    each step ``t`` (micro-batches ``t * micro .. (t + 1) * micro - 1``)."""
    w = min(num_stages - stage - 1, count)

    def backward(i: int) -> Iterator[Op]:
        g = lo + i
        yield ("B", g)
        if g % micro == micro - 1:
            yield ("U", g // micro)

    for i in range(w):
        yield ("F", lo + i)
    for i in range(count - w):
        yield ("F", lo + w + i)
        yield from backward(i)
    for i in range(count - w, count):
        yield from backward(i)


def stage_ops(stage: int, num_stages: int, micro_batches: int, steps: int, mode: str, start: int = 0) -> Iterator[Op]:
    """The ops of ``stage`` for steps ``start .. start + steps - 1``.

    Raises:
      ValueError: a bad stage, stage count, micro-batch count, step count or mode.
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if micro_batches < 1 or steps < 0 or start < 0:
        raise ValueError(f"need micro_batches >= 1, steps >= 0, start >= 0; got {micro_batches}, {steps}, {start}")
    if mode == "sync":
        for t in range(start, start + steps):
            yield from _one_f_one_b(stage, num_stages, t * micro_batches, micro_batches, micro_batches)
    elif mode == "async":
        yield from _one_f_one_b(stage, num_stages, start * micro_batches, steps * micro_batches, micro_batches)
    else:
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")


def in_flight_bound(stage: int, num_stages: int) -> int:
    """The most micro-batches stage ``stage`` holds between their forward and backward."""
    return num_stages - stage
