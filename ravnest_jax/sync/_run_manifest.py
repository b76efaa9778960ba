"""The trainer's part of the run manifest (``ravnest_jax/swarm/_manifest.py``): what every peer
of a run must share beyond the swarm's own settings, declared before the first step.

The params' fingerprint is their tree structure, leaf shapes and dtypes (never their values: a
peer initialised from another seed is a joiner, it takes the swarm's state), as leaf count,
element count and the first 16 hex digits of a sha256 over ``path:shape:dtype`` lines.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import jax
import numpy as np

log = logging.getLogger("ravnest_jax.sync")


def params_fingerprint(params: Any) -> dict[str, Any]:
    """``{"leaves", "elements", "sha256"}`` of a params pytree (structure, shapes, dtypes)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    lines = [f"{jax.tree_util.keystr(p)}:{tuple(np.shape(x))}:{np.dtype(x.dtype).name}" for p, x in leaves]
    return {
        "leaves": len(leaves),
        "elements": int(sum(int(np.prod(np.shape(x), dtype=np.int64)) for _, x in leaves)),
        "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16],
    }


def trainer_manifest(sync: Any, params: Any) -> dict[str, Any]:
    """The settings of an ``rj.OuterSync`` and its ``rj.diloco`` that every peer must share:
    the params' fingerprint, H (``sync_every``, or ``sync_every_seconds``), the fragments and
    their schedule (each fragment's step offset), the overlap mode and tau."""
    tx = sync.tx
    return {
        "params": params_fingerprint(params),
        "sync_every": int(tx.sync_every),
        "sync_every_seconds": sync.sync_every_seconds,
        "fragments": int(tx.fragments),
        "fragment_offsets": [int(tx.fragment_offset(f)) for f in range(tx.fragments)],
        "mode": sync.mode,
        "overlap_steps": sync.overlap_steps,
    }


def declare(sync: Any, params: Any) -> None:
    """Declares ``sync``'s manifest with its swarm (once; a swarm without ``declare_manifest``,
    or none on a multi-process peer's other processes, declares nothing).

    Raises:
      ManifestMismatch: the rendezvous refused this peer (one line naming every difference).
    """
    declare_fn = getattr(sync.swarm, "declare_manifest", None)
    if declare_fn is None:
        return
    declare_fn(trainer_manifest(sync, params))
