"""The jitted round functions of :class:`~ravnest_jax.sync.OuterSync`: the DiLoCo math of
:class:`~ravnest_jax.optim.DiLoCo` (``round_start``, ``speculate``, ``round_merge``) with the
device-side encode and the state digest, compiled once per fragment and params/state layout."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ravnest_jax import compress
from ravnest_jax.optim import DiLoCo

from ._digest import CHUNK, device_digest

#: jitted round functions shared by the drivers of one ``tx`` in a process (peers in threads of
#: one test, a driver rebuilt after a restart): the same function object, so jax traces and
#: compiles it once; the oldest entries go beyond _SHARED_MAX
_SHARED: dict[tuple, Callable] = {}
_SHARED_LOCK = threading.Lock()
_SHARED_MAX = 64


def _spread(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Dim 0 spread over every device of ``mesh`` when it divides evenly, else replicated."""
    if shape and shape[0] % mesh.size == 0:
        return NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return NamedSharding(mesh, P())


def encode_on_mesh(encode: Callable, mesh: Mesh | None, leaves: list, residual: Any, key: Any) -> tuple[Any, Any]:
    """``encode(leaves, residual, key)`` (a ``device_encode``) inside jit, for leaves laid out on
    ``mesh``: every device encodes the blocks of its own shards (XLA's partitioner) and the
    packed parts come out spread over the devices, so that the device-to-host copy takes one
    slice from each device and no device gathers the pseudo-gradient. (On a mesh with explicit
    axes ``device_encode`` lays its outputs out the same way itself.)"""
    if mesh is None or mesh.explicit_axes:
        return encode(leaves, residual, key)
    packed, new_res = encode(leaves, residual, key)
    return jax.lax.with_sharding_constraint(packed, jax.tree.map(lambda a: _spread(mesh, a.shape), packed)), new_res


class RoundFunctions:
    """Builds and caches the jitted round functions of one ``tx`` and codec.

    Every function is keyed by ``(kind, fragment, layout)``, with ``layout`` from
    :func:`~ravnest_jax.sync._pipeline.layout_of` (``None`` on one device); on a mesh the merged
    params and state come back with exactly the shardings they had.

    Args:
      tx: the :func:`rj.diloco` transformation.
      codec, codec_options: the device-side encode of the pseudo-gradient.
      keep_local_progress: the merge keeps the local progress since the boundary (every mode
        but ``"blocking"``).
      error_feedback_decay: beta: the residual carried into a round is ``beta * residual``.
      donate: the merge donates the params and the state it is given (their buffers hold the
        merged ones; the arrays passed in are deleted).
    """

    def __init__(
        self,
        tx: DiLoCo,
        codec: str,
        codec_options: dict,
        keep_local_progress: bool,
        error_feedback_decay: float = 1.0,
        donate: bool = False,
    ):
        self.tx, self.codec, self.codec_options = tx, codec, dict(codec_options)
        self.keep_local_progress = keep_local_progress
        self.error_feedback_decay = float(error_feedback_decay)
        self.donate = bool(donate)
        self.cache: dict[tuple, Callable] = {}  # (kind, fragment, layout) -> jitted function

    def frag(self, fragment: int) -> int | None:
        """The fragment as ``tx``'s round functions take it: ``None`` without fragments."""
        return None if self.tx.fragments == 1 else fragment

    @staticmethod
    def _shardings(layout: tuple | None) -> tuple[Any, Any]:
        if layout is None:
            return None, None
        return jax.tree.unflatten(layout[1], list(layout[2])), jax.tree.unflatten(layout[3], list(layout[4]))

    def _cached(self, kind: str, fragment: int, layout: tuple | None, build: Callable[[], Callable]) -> Callable:
        key = (kind, fragment, layout)
        fn = self.cache.get(key)
        if fn is None:
            shared = (self.tx, self.codec, tuple(sorted(self.codec_options.items())), self.keep_local_progress,
                      self.error_feedback_decay, self.donate, key)  # fmt: skip
            with _SHARED_LOCK:
                fn = _SHARED.get(shared)
                if fn is None:
                    fn = _SHARED[shared] = build()
                    while len(_SHARED) > _SHARED_MAX:
                        _SHARED.pop(next(iter(_SHARED)))
            self.cache[key] = fn
        return fn

    def start(self, fragment: int, layout: tuple | None) -> Callable:
        """``start(params, state, residual, key) -> (snapshot, packed, new_residual)``: the
        round's :class:`RoundSnapshot` and its pseudo-gradient encoded on the device (one packed
        leaf per pseudo-gradient leaf: blocks never straddle two leaves, so every shard of a leaf
        encodes on its own device), with error feedback when ``residual`` is given."""
        tx, frag, codec, opts = self.tx, self.frag(fragment), self.codec, self.codec_options
        mesh = None if layout is None else layout[0]
        beta = self.error_feedback_decay

        def build() -> Callable:
            def encode(leaves, residual, key):
                if residual is not None and beta != 1.0:
                    residual = [beta * r for r in residual]
                return compress.device_encode(leaves, codec, key=key, residual=residual, **opts)

            def start(params, state, residual, key):
                snap = tx.round_start(params, state, frag)
                leaves = list(jax.tree.leaves(snap.pseudo_gradient))
                packed, new_res = encode_on_mesh(encode, mesh, leaves, residual, key)
                return snap, packed, new_res

            return jax.jit(start)

        return self._cached("start", fragment, layout, build)

    def merge(self, fragment: int, layout: tuple | None) -> Callable:
        """``merge(params, state, mean_leaves, snapshot, alpha) -> (params, state, digest)``:
        ``tx.round_merge`` with the mean (a list of float32 leaves like the snapshot's
        pseudo-gradient) and the device digest of ``(global_params, outer_state)`` after it."""
        tx, frag, keep = self.tx, self.frag(fragment), self.keep_local_progress
        params_sh, state_sh = self._shardings(layout)
        donate = (0, 1) if self.donate else ()

        def build() -> Callable:
            def merge(params, state, mean_leaves, snap, alpha):
                mean = jax.tree.unflatten(jax.tree.structure(snap.pseudo_gradient), list(mean_leaves))
                params, state = tx.round_merge(
                    params, state, mean, snap, fragment=frag, alpha=alpha, keep_local_progress=keep
                )
                # on a mesh each leaf at once: a chunk's slice of a sharded leaf would gather it
                chunk = CHUNK if layout is None else 0
                return params, state, device_digest((state.global_params, state.outer_state), chunk=chunk)

            if layout is None:
                return jax.jit(merge, donate_argnums=donate)
            return jax.jit(merge, out_shardings=(params_sh, state_sh, None), donate_argnums=donate)

        return self._cached("merge", fragment, layout, build)

    def speculate(self, fragment: int, layout: tuple | None) -> Callable:
        """``speculate(params, state, snapshot) -> (params, anchor)``: ``tx.speculate`` (eager
        updates, arXiv 2502.12996)."""
        tx, frag = self.tx, self.frag(fragment)
        params_sh, _ = self._shardings(layout)

        def build() -> Callable:
            def speculate(params, state, snap):
                return tx.speculate(params, state, snap, frag)

            return jax.jit(speculate) if layout is None else jax.jit(speculate, out_shardings=(params_sh, None))

        return self._cached("speculate", fragment, layout, build)
