"""One round's exchange between the device and the swarm, run beside training: the encoded
pseudo-gradient to the host, into the swarm's all-reduce, and the mean back; and what a peer
over several processes shares of it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ravnest_jax import compress


def exchange(
    swarm: Any,
    packed: Any,
    weight: float,
    expected: int | None,
    state: tuple[int, str] | None,
    learn_round: Callable[[int], None],
) -> tuple[np.ndarray, Any, int, int, float]:
    """Background thread: device -> host, the all-reduce, the mean.

    The packed parts (each device's slices, copied once) are fed as buffers, with no copy into
    one large bytes object, straight into the stream decoder: this peer's own contribution is
    decoded as every receiver decodes it, and its float32 vector is what the swarm averages.

    Args:
      swarm: the :class:`~ravnest_jax.sync._contract.Exchange`.
      packed: the ``Packed`` parts from the device encode (their host copies already started).
      weight: this peer's weight (samples since its last round).
      expected: the swarm round this exchange belongs to, or ``None`` (not known yet).
      state: ``(swarm round, state digest)`` after the last merged round, or ``None``.
      learn_round: called with the swarm round number the round ran as (also when it failed).

    Returns:
      ``(mean, record, payload_bytes, float32_bytes, seconds)``: the mean as float32 ``(n,)``,
      the swarm's ``RoundRecord``, this peer's encoded bytes, its float32 bytes, wall seconds.

    Raises:
      compress.NonFiniteError: the pseudo-gradient holds NaN or infinity (this peer diverged).
      RoundFailed: the round failed on this peer.
    """
    t0 = time.perf_counter()
    host = jax.device_get(packed)
    chunks = compress.packed_to_chunks(host)
    dec = compress.StreamDecoder()
    for c in chunks:
        dec.feed(c)
    nbytes = dec.nbytes_received
    del chunks, host
    leaves = jax.tree.leaves(dec.finish())
    if len(leaves) == 1:  # one leaf: its flat view (fp32 leaves are views of the payload)
        vec = np.ravel(leaves[0])
    else:
        vec = np.concatenate([np.ravel(a) for a in leaves]) if leaves else np.zeros((0,), np.float32)
    del leaves
    kwargs: dict[str, Any] = {} if expected is None else {"round": expected}
    if state is not None:  # the rendezvous compares it with the other peers' (divergence)
        kwargs["state"] = state
    fut = swarm.all_reduce_async({"pg": vec}, weight=weight, **kwargs)
    try:
        mean, record = fut.result()
    except Exception as e:
        r = getattr(getattr(e, "record", None), "round", -1)
        if r is not None:
            learn_round(int(r))
        raise
    learn_round(int(getattr(record, "round", -1)))
    return np.asarray(mean["pg"], np.float32), record, nbytes, 4 * vec.size, time.perf_counter() - t0


def share_result(
    leader: bool, pseudo_gradient: Any, mean: np.ndarray | None, error: str | None
) -> tuple[np.ndarray | None, str | None]:
    """A peer over several processes: process 0 tells the others whether the round worked and
    sends them the mean, float32 ``(n,)`` with ``n`` the elements of ``pseudo_gradient`` (two
    broadcasts, in the training thread of every process). Returns ``(mean, error)``."""
    ok = multihost_utils.broadcast_one_to_all(np.asarray([error is None], np.int32))
    if not int(np.asarray(ok).reshape(-1)[0]):
        return None, error or "the round failed on process 0 of this peer"
    n = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in jax.tree.leaves(pseudo_gradient))
    buf = mean if leader else np.zeros((n,), np.float32)
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(buf, np.float32)), np.float32), None


def needs_resync(swarm: Any, exc: BaseException | None) -> bool:
    """After a failed round: False only when the rendezvous says the round failed for everyone
    (then nobody applied it and the local state is still the swarm's)."""
    if isinstance(exc, compress.NonFiniteError):
        return True  # this peer diverged
    record = getattr(exc, "record", None)
    outcome = getattr(swarm, "round_outcome", None)
    if record is None or outcome is None or getattr(record, "round", -1) < 0:
        return True
    try:
        return outcome(record.round) != "failed"
    except Exception:  # noqa: BLE001 - rendezvous unreachable: try to resync
        return True
