"""The trainer's part of the run manifest (``ravnest_jax/swarm/wire/_manifest.py``): what every peer
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

from ._digest import CHUNK, device_digest, digest_hex
from ._pipeline import mesh_of

log = logging.getLogger("ravnest_jax.sync")


def params_fingerprint(params: Any) -> dict[str, Any]:
    """``{"leaves", "elements", "sha256"}`` of a params pytree (structure, shapes, dtypes); its
    leaves may be arrays or ``jax.ShapeDtypeStruct`` (``jax.eval_shape``: nothing computed)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    lines = [f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{np.dtype(x.dtype).name}" for p, x in leaves]
    return {
        "leaves": len(leaves),
        "elements": int(sum(int(np.prod(x.shape, dtype=np.int64)) for _, x in leaves)),
        "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16],
    }


def trainer_manifest(sync: Any, params: Any) -> dict[str, Any]:
    """The settings of an ``rj.OuterSync`` and its ``rj.diloco`` that every peer must share:
    the params' fingerprint, H (``sync_every``), the fragments and
    their schedule (each fragment's step offset), the overlap mode and tau."""
    tx = sync.tx
    return {
        "params": params_fingerprint(params),
        "sync_every": int(tx.sync_every),
        "fragments": int(tx.fragments),
        "fragment_offsets": [int(tx.fragment_offset(f)) for f in range(tx.fragments)],
        "mode": sync.mode,
        "overlap_steps": sync.overlap_steps,
    }


class ManifestDeclaration:
    """The part of ``rj.OuterSync`` that declares the run manifest (:func:`trainer_manifest`)."""

    def declare_manifest(self, params: Any) -> None:
        """Declares this peer's run manifest with the swarm (``Swarm.declare_manifest``): the
        params' fingerprint (tree structure, shapes, dtypes), H, the fragments and their
        schedule, the overlap mode and tau, with the swarm's codec, aggregator, algorithm and
        protocol version; and a digest of the params' values as this peer's initial state
        (``initial_digest``; the run's, the first declarer's, in ``run_initial``: a fresh peer
        whose own differs takes the swarm's state in :func:`rj.join_or_resume`). Called before
        the swarm starts it is a check only (refused before compiling) and counts once started.
        :func:`rj.join_or_resume` calls it before anything loads, else the first ``sync`` call
        does; later calls do nothing. ``params``: the params pytree (with flax nnx,
        ``nnx.as_pure(nnx.state(model, nnx.Param))``: the arrays the driver averages).

        Raises:
          ManifestMismatch: the rendezvous refused this peer: one line naming every setting
            that differs from the run's, with both values.
        """
        if self._declared:
            return
        if self.swarm is None:  # a process other than 0 of a peer: process 0 declares
            self._declared = True
            return
        if not self.swarm.started:  # a check only (no digest, a compile, yet): declared again once started
            self.swarm.declare_manifest(trainer_manifest(self, params))
            return
        # a peer over several processes declares on process 0 alone: a jitted digest there would wait
        # forever for the other processes (and such a peer downloads no state anyway)
        mine = None
        if jax.process_count() == 1:  # 32 hex digits, computed on the device (jitted once per params layout)
            chunk = 0 if mesh_of(params) is not None else CHUNK  # a sharded leaf hashed whole, not gathered
            mine = digest_hex(device_digest(params, chunk=chunk))
        self.run_initial = self.swarm.declare_manifest(trainer_manifest(self, params), init=mine)
        self._declared, self.initial_digest = self.run_initial is not None, mine
