"""Helpers for the replica simulation: N DiLoCo replicas in one process under ``jax.vmap``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["replicate", "unreplicate"]


def replicate(tree: Any, num_replicas: int) -> Any:
    """Stacks ``num_replicas`` identical copies of every leaf on a new leading axis.

    All replicas must start from identical params (DiLoCo's anchor is shared), so this is how
    params and the optimizer state enter ``jax.vmap(step, axis_name=...)``.

    Args:
      tree: pytree of arrays, leaf shapes ``S``.
      num_replicas: N >= 1.

    Returns:
      The pytree with leaf shapes ``(N, *S)`` and the same dtypes (a copy).

    Raises:
      ValueError: ``num_replicas`` is not an int >= 1.
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x), (num_replicas, *jnp.shape(x))).copy(), tree)


def unreplicate(tree: Any, index: int = 0) -> Any:
    """Takes replica ``index`` out of a replicated pytree (leaf shapes ``(N, *S)`` -> ``S``)."""
    return jax.tree.map(lambda x: x[index], tree)
