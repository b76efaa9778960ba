"""The 1F1B schedule of one stage: the order of its forwards, backwards and updates.

Micro-batches are numbered through the run: micro-batch ``g`` is number ``g % M`` of step
``g // M`` (``M`` micro-batches a step). Stage ``s`` of ``S`` first runs ``w = S - s - 1``
forwards (the warm-up), then alternates one forward and one backward, then runs the last ``w``
backwards: at most ``w + 1 <= S`` micro-batches are in flight on a stage (forwarded, not yet
backwarded), which bounds the activations it keeps (Narayanan et al., PipeDream, arXiv
1806.03377; the flushed variant is PipeDream-Flush / 1F1B of arXiv 2006.09503).

*Depth* ``D`` (``in_flight``, default ``S``): the most micro-batches stage 0 holds. A stage
runs its forward of micro-batch ``g`` in the same 1F1B slot as its backward of micro-batch
``g - w_s`` (``w_s``: its warm-up), so between two neighbours ``s, s + 1`` an activation and the
returning activation-gradient must both cross the link within ``w_s - w_{s+1}`` slots: with a
stage's compute ``T = t_f + t_b`` per micro-batch and a transfer of ``L`` seconds (message bytes
over the link rate, plus the one-way delay), the stages never wait when
``(w_s - w_{s+1}) T >= T + 2 L``. 1F1B's ``w_s = S - s - 1`` gives every pair a difference of
one slot, which no link with ``L > 0`` satisfies: the stages then wait in every slot. With
``D > S`` the warm-ups are spread evenly over the pairs: ``w_s = floor((S - 1 - s)(D - 1) /
(S - 1))`` (the last stage ``w = 0``: its forward and backward are one call), so every pair gets
``(D - 1) / (S - 1)`` slots (rounded), and the stages are never starved with
``D = 1 + (S - 1) ceil(1 + 2 L / T)`` (tested with an event model of the schedule). Free of
deadlock (each stage's warm-up exceeds its successor's).
Cost: stage ``s`` keeps up to ``w_s + 1`` activations (stage 0 ``D``).

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


def _warmup(stage: int, num_stages: int, depth: int) -> int:
    if stage == num_stages - 1:
        return 0
    return ((num_stages - 1 - stage) * (depth - 1)) // (num_stages - 1)


def _one_f_one_b(stage: int, num_stages: int, lo: int, count: int, micro: int, depth: int) -> Iterator[Op]:
    """1F1B over micro-batches ``lo .. lo + count - 1``; ("U", t) after the last backward of
    each step ``t`` (micro-batches ``t * micro .. (t + 1) * micro - 1``)."""
    w = min(_warmup(stage, num_stages, depth), count)

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


def check_depth(in_flight: int | None, num_stages: int, micro_batches: int) -> int:
    """The depth ``D`` (module docstring) for ``in_flight`` (``None``: ``num_stages``).

    A ``D`` above ``S`` is at most ``M + 1``: then no forward runs more than one update ahead of
    its stage's weights (what the asynchronous modes' weight versions assume).

    Raises:
      ValueError: ``in_flight`` not an int, below ``num_stages``, or above both ``num_stages``
        and ``micro_batches + 1``.
    """
    if in_flight is None:
        return num_stages
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or not num_stages <= in_flight:
        raise ValueError(f"in_flight must be an int >= the stage count {num_stages}, got {in_flight!r}")
    if in_flight > max(num_stages, micro_batches + 1):
        raise ValueError(
            f"in_flight {in_flight} needs more micro-batches per step: at most micro_batches + 1 = {micro_batches + 1}"
        )
    return in_flight


def stage_ops(
    stage: int,
    num_stages: int,
    micro_batches: int,
    steps: int,
    mode: str,
    start: int = 0,
    in_flight: int | None = None,
) -> Iterator[Op]:
    """The ops of ``stage`` for steps ``start .. start + steps - 1``; ``in_flight``: the depth
    (module docstring; default ``num_stages``).

    Raises:
      ValueError: a bad stage, stage count, micro-batch count, step count, mode or depth.
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if micro_batches < 1 or steps < 0 or start < 0:
        raise ValueError(f"need micro_batches >= 1, steps >= 0, start >= 0; got {micro_batches}, {steps}, {start}")
    depth = check_depth(in_flight, num_stages, micro_batches)
    if mode == "sync":
        for t in range(start, start + steps):
            yield from _one_f_one_b(stage, num_stages, t * micro_batches, micro_batches, micro_batches, depth)
    elif mode == "async":
        yield from _one_f_one_b(stage, num_stages, start * micro_batches, steps * micro_batches, micro_batches, depth)
    else:
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")


def in_flight_bound(stage: int, num_stages: int, in_flight: int | None = None) -> int:
    """The most micro-batches stage ``stage`` holds between their forward and backward."""
    depth = num_stages if in_flight is None else in_flight
    return _warmup(stage, num_stages, depth) + 1
