"""The loop of one stage over its schedule, written once as a generator that asks its driver to
receive and send (:func:`run_stage`), and the in-process driver of all stages at once
(:func:`simulate`), which gives exactly the numbers the peer processes give (same schedule,
same compute, same encoded bytes) in one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ravnest_jax.compress import packed_to_bytes
from ravnest_jax.swarm import decode_activation, encoded_activation

from ._schedule import stage_ops
from ._worker import StageWorker

__all__ = ["Batches", "SimResult", "encode_message", "read_batch", "run_stage", "simulate"]


class Batches:
    """A stage's view of the data: ``batches(step)`` gives the step's batch (:func:`read_batch`):
    int32 tokens ``(B, T + 1)``, or a loss-masked batch of ``TokenBatch`` fields. Micro-batch
    ``g`` is rows ``[m * B / M, (m + 1) * B / M)`` of step ``g // M``, ``m = g % M``: its inputs
    int32 ``(B / M, T)`` and its targets, int32 ``(B / M, T)`` or, for a masked batch, the pair
    ``(targets, weights)`` with ``weights`` the loss mask times ``M / n``, ``n`` the tokens the
    whole step's mask counts: the last stage's loss is ``sum(weights * ce)``
    (:func:`token_cross_entropy`), so the mean of a step's M micro-batch losses, and of their
    gradients, is the step's token mean, as the unsplit step (``rj.models.make_train_step``)
    takes it.

    Raises (on use):
      ValueError: as :func:`read_batch`; rows that do not divide by M.
    """

    def __init__(self, batches: Callable[[int], Any], micro_batches: int):
        self.batches, self.micro_batches = batches, int(micro_batches)
        self._step: int | None = None
        self._parts: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None

    def _rows(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        step, m = divmod(int(g), self.micro_batches)
        if self._step != step:
            inputs, targets, mask = read_batch(self.batches(step), f"batches({step})")
            if inputs.shape[0] % self.micro_batches:
                raise ValueError(
                    f"batch of {inputs.shape[0]} rows does not split into {self.micro_batches} micro-batches"
                )
            weights = None
            if mask is not None:
                weights = (mask * (self.micro_batches / max(float(mask.sum()), 1.0))).astype(np.float32)
            self._step, self._parts = step, (inputs, targets, weights)
        assert self._parts is not None
        r = self._parts[0].shape[0] // self.micro_batches
        return tuple(None if a is None else a[m * r : (m + 1) * r] for a in self._parts)  # type: ignore[return-value]

    def inputs(self, g: int) -> np.ndarray:
        return np.ascontiguousarray(self._rows(g)[0])

    def targets(self, g: int) -> Any:
        _, targets, weights = self._rows(g)
        targets = np.ascontiguousarray(targets)
        return targets if weights is None else (targets, np.ascontiguousarray(weights))


def read_batch(batch: Any, what: str = "batch") -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A pipeline batch as ``(inputs, targets, loss_mask)``, int32, int32 and float32 ``(B, T)``
    (``loss_mask`` None: every position counts).

    ``batch``: int tokens ``(B, T + 1)`` (inputs the first ``T`` columns, targets the last
    ``T``), or a mapping with the ``rj.models.TokenBatch`` fields ``tokens``, ``targets``,
    ``loss_mask`` and optionally ``positions`` and ``segment_ids``, each ``(B, T)``, holding one
    document a row from its first column, padding after (``rj.data.PackedExamples(...,
    packing=False)``). The stages carry no segment ids or positions: causal attention alone keeps
    a row's padding out of its document, which is exact for such rows and wrong for packed ones.

    Raises:
      ValueError: tokens that are not 2-D int with ``T >= 1``; a mapping without a field or with
        fields of different shapes; a row with several documents (packed) or one that does not
        start at its first column.
    """
    if not isinstance(batch, Mapping):
        tok = np.asarray(batch)
        if tok.ndim != 2 or not np.issubdtype(tok.dtype, np.integer) or tok.shape[1] < 2:
            raise ValueError(f"{what} must be int tokens (batch, seq + 1), got {tok.dtype} {tok.shape}")
        tok = tok.astype(np.int32, copy=False)
        return tok[:, :-1], tok[:, 1:], None
    missing = [k for k in ("tokens", "targets", "loss_mask") if k not in batch]
    if missing:
        raise ValueError(f"{what}: a masked batch needs tokens, targets and loss_mask; {', '.join(missing)} missing")
    parts = {
        k: np.asarray(v)
        for k, v in batch.items()
        if k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")
    }
    shape = parts["tokens"].shape
    if len(shape) != 2 or shape[1] < 1 or any(v.shape != shape for v in parts.values()):
        raise ValueError(
            f"{what}: the fields must be (batch, seq) alike, got { ({k: v.shape for k, v in parts.items()}) }"
        )
    seg = parts.get("segment_ids")
    if seg is not None and seg.max(initial=0) > 1:
        raise ValueError(
            f"{what}: rows hold several documents (segment ids up to {int(seg.max())}); pipeline stages carry no "
            "segment ids: give one document a row (PackedExamples(..., packing=False))"
        )
    pos = parts.get("positions")
    if pos is not None:
        doc = seg > 0 if seg is not None else parts["loss_mask"] > 0
        cols = np.broadcast_to(np.arange(shape[1], dtype=pos.dtype), shape)
        if not np.array_equal(pos[doc], cols[doc]):
            raise ValueError(
                f"{what}: a document does not start at its row's first column (positions); pipeline stages need "
                "one document a row from column 0"
            )
    return (
        parts["tokens"].astype(np.int32, copy=False),
        parts["targets"].astype(np.int32, copy=False),
        parts["loss_mask"].astype(np.float32, copy=False),
    )


def run_stage(
    worker: StageWorker,
    ops: Any,
    data: Batches | None,
    on_update: Callable[[int, Any], None] | None = None,
) -> Generator[tuple, Any, None]:
    """The loop of one stage over ``ops`` (from :func:`stage_ops`), as a generator of requests
    to its driver: ``("recv", kind, g)`` (send back the array), ``("send", kind, g, packed,
    op)`` and ``("ready", arrays, op)`` (``op``: the op that made them, ``"F"``, ``"B"`` or
    ``"U"``; the driver may wait for them to time the op). ``on_update(step, loss)`` runs after each update (``loss``: the
    step's mean micro-batch loss, a device scalar, on the last stage; else ``None``)."""
    losses: list[Any] = []
    for op, n in ops:
        if op == "F":
            x = data.inputs(n) if worker.first else (yield ("recv", "act", n))
            targets = data.targets(n) if worker.last else None
            packed, loss = worker.forward(n, x, targets)
            if loss is not None:
                losses.append(loss)
            if not worker.last:
                yield ("send", "act", n, packed, "F")
            elif not worker.first:
                yield ("send", "grad", n, packed, "F")
            else:
                yield ("ready", loss, "F")
        elif op == "B":
            if worker.last:
                continue
            grad = yield ("recv", "grad", n)
            packed = worker.backward(n, grad)
            if not worker.first:
                yield ("send", "grad", n, packed, "B")
            else:
                yield ("ready", worker._acc, "B")
        else:
            worker.update()
            step_loss = None
            if worker.last:
                mine, losses = losses[: worker.micro_batches], losses[worker.micro_batches :]
                step_loss = jnp.mean(jnp.stack(mine))
            if on_update is not None:
                on_update(n, step_loss)
            yield ("ready", worker.params, "U")


def encode_message(packed: Any) -> bytes:
    """The wire message of an encoded activation (fetched from the device)."""
    return packed_to_bytes(jax.device_get(packed))


@dataclasses.dataclass
class SimResult:
    """What :func:`simulate` returns.

    Attributes:
      losses: the mean training loss of each step (floats).
      workers: the stages' :class:`StageWorker` s (final params and optimizer state).
      bytes_sent: message bytes each stage sent (activations forward, gradients back).
    """

    losses: list[float]
    workers: list[StageWorker]
    bytes_sent: list[int]


def simulate(
    split: Any,
    plan: Any,
    tx: Any,
    batches: Callable[[int], Any],
    *,
    steps: int,
    micro_batches: int,
    mode: str = "sync",
    codec: str = "fp32",
    codec_options: dict | None = None,
    recompute: bool = False,
    in_flight: int | None = None,
    keep_grads: bool = False,
    on_step: Callable[[int, list[StageWorker]], None] | None = None,
    workers: list[StageWorker] | None = None,
    start: int = 0,
    decode_on_device: bool = True,
) -> SimResult:
    """Runs the pipeline of ``plan`` over ``split`` with every stage in this process: the same
    schedule, compute and encoded messages as stage peers, without the network.

    Args:
      split: a :class:`LayerSplit`.
      plan: a :class:`StagePlan`.
      tx: an optax optimizer, or ``tx(stage) -> optimizer``.
      batches: ``batches(step)`` -> int32 tokens ``(B, T + 1)``, or a loss-masked batch of one
        document a row (:func:`read_batch`); ``B`` divisible by ``micro_batches``.
      steps, micro_batches, mode, codec, codec_options, recompute: see :class:`StageWorker`.
      in_flight: the schedule's depth (:func:`stage_ops`; default the stage count).
      on_step: called with ``(step, workers)`` once every stage applied step ``step``'s update
        (sync mode: between steps; asynchronous modes: when the last stage did).
      workers: continue with these workers (from an earlier result) at step ``start``.
      decode_on_device: hand each received message to its stage undecoded, as stage peers do
        (its jitted step decodes it); ``False``: decoded to float32 on the host first. The
        results are the same bit for bit.

    Returns:
      a :class:`SimResult`.
    """
    S = plan.num_stages
    if workers is None:
        sample, _, _ = read_batch(batches(start), f"batches({start})")
        rows = sample.shape[0] // micro_batches
        hidden = split.hidden(rows, sample.shape[1])
        workers = []
        for s, (lo, hi) in enumerate(plan.bounds):
            workers.append(
                StageWorker(
                    split.stage(lo, hi),
                    tx(s) if callable(tx) and not hasattr(tx, "init") else tx,
                    num_stages=S,
                    micro_batches=micro_batches,
                    hidden=hidden,
                    codec=codec,
                    codec_options=codec_options,
                    mode=mode,
                    recompute=recompute,
                    keep_grads=keep_grads,
                )
            )
    hidden = workers[0].hidden
    losses: dict[int, float] = {}
    updated: dict[int, int] = {}

    def make_on_update(s: int):
        def f(step: int, loss: Any) -> None:
            if loss is not None:
                losses[step] = float(loss)
            updated[step] = updated.get(step, 0) + 1
            if updated[step] == S and on_step is not None:
                on_step(step, workers)

        return f

    sched = "sync" if mode == "sync" else "async"
    gens = [
        run_stage(
            w,
            stage_ops(s, S, micro_batches, steps, sched, start, in_flight),
            Batches(batches, micro_batches),
            make_on_update(s),
        )
        for s, w in enumerate(workers)
    ]
    mailbox: dict[tuple[str, int, int], Any] = {}
    sent = [0] * S
    pending: list[Any] = [None] * S
    done = [False] * S
    for s in range(S):
        pending[s] = _advance(gens[s], None)
        done[s] = pending[s] is _DONE
    while not all(done):
        progress = False
        for s in range(S):
            while not done[s]:
                req = pending[s]
                if req[0] == "send":
                    _, kind, g, packed, _op = req
                    data = encode_message(packed)
                    sent[s] += len(data)
                    dest = s + 1 if kind == "act" else s - 1
                    dec = encoded_activation if decode_on_device else decode_activation
                    mailbox[(kind, dest, g)] = dec(data, name="x", shape=hidden.shape, codec=workers[0].codec)
                    val = None
                elif req[0] == "recv":
                    key = (req[1], s, req[2])
                    if key not in mailbox:
                        break
                    val = mailbox.pop(key)
                else:
                    val = None
                pending[s] = _advance(gens[s], val)
                done[s] = pending[s] is _DONE
                progress = True
        if not progress:
            raise RuntimeError(f"pipeline simulation deadlocked; waiting: {pending}")
    return SimResult([losses[t] for t in sorted(losses)], workers, sent)


_DONE = object()


def _advance(gen: Generator, value: Any) -> Any:
    try:
        return gen.send(value)
    except StopIteration:
        return _DONE
