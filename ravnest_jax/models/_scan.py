"""The transformer's blocks under one ``jax.lax.scan`` (MaxText's ``scan_layers``): parameters
stored stacked with a leading layer axis, the forward pass one loop over that axis, so trace and
compile time do not grow with depth.

A scanned model (``Transformer(..., scan_layers=True)``) holds one :class:`Block` in
``model.layers`` whose every variable has a leading axis of ``num_hidden_layers``; its paths are
those of the per-layer model without the layer index (``layers/self_attn/q_proj/kernel``, shape
``(layers, in, out)``). qwix (LoRA, int4/int8) is applied to the per-layer model and its state
stacked afterwards (:func:`stack_layers`): the scan body merges the block's graph (qwix's
attributes included) with one layer's slice, inside the top-level call that qwix intercepts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._remat import block_fn, remat_policy

__all__ = ["scan_blocks", "stack_layers", "unstack_layers", "is_stacked"]


def is_stacked(path: tuple) -> bool:
    """``path`` (an nnx state path of a :class:`Transformer`) is a leaf of stacked blocks (its
    first axis is the layer): under ``layers`` without a layer index."""
    return len(path) > 1 and str(path[0]) == "layers" and not isinstance(path[1], int)


def layer_path(path: tuple, layer: int) -> tuple:
    """The per-layer model's path of layer ``layer`` of the stacked leaf at ``path``."""
    return (path[0], layer, *path[1:])


def scan_blocks(
    block: nnx.Module,
    x: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    segment_ids: jax.Array | None,
    *,
    remat: str,
    by_batch: Callable[[jax.Array], jax.Array],
    mlp_chunk: int | None = None,
) -> jax.Array:
    """The stacked ``block`` (every variable ``(layers, ...)``) applied layer after layer to
    ``x`` ``(batch, seq, hidden)`` with one ``jax.lax.scan``; the body is ``jax.checkpoint``-ed
    with :func:`remat_policy` unless ``remat`` is ``"none"`` (under a scan XLA cannot merge
    the backward loop's recomputation into the forward loop, on CPU too); each block's MLP
    runs ``mlp_chunk`` tokens at a time (:class:`~ravnest_jax.models._transformer.MLP`).

    Random streams on the block (qwix's ``qwix_rngs`` for the adapters' dropout, set by
    ``LoraModel.model``) are not stacked: each layer gets its keys folded with its index."""
    graphdef, rngs, state = nnx.split(block, nnx.RngState, ...)
    n = jax.tree.leaves(state)[0].shape[0]
    fn = block_fn(graphdef, mlp_chunk)

    def step(h, st, rng, i, pos, seg):
        rng = jax.tree.map(lambda k: _fold(k, i), rng)
        return fn(nnx.merge_state(st, rng) if jax.tree.leaves(rng) else st, h, pos, inv_freq, seg)

    if remat != "none":
        step = jax.checkpoint(step, policy=remat_policy(remat), prevent_cse=False)

    def body(h, xs):
        st, i = xs
        return by_batch(step(h, st, rngs, i, positions, segment_ids)), None

    x, _ = jax.lax.scan(body, x, (state, jnp.arange(n, dtype=jnp.uint32)))
    return x


def _fold(k: Any, i: jax.Array) -> Any:
    if hasattr(k, "dtype") and jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key):
        return jax.random.fold_in(k, i)
    return k


def _stack(values: list) -> Any:
    """``values`` stacked on a new first axis; a sharded array's stack keeps its layout on the
    other axes (the layer axis is never split)."""
    v0 = values[0]
    sharding = getattr(v0, "sharding", None)
    if isinstance(v0, jax.Array) and isinstance(sharding, NamedSharding) and not isinstance(v0, jax.core.Tracer):
        # a replicated leaf stays replicated (P(), as base_sharding(stacked=True) says)
        out = NamedSharding(sharding.mesh, P(None, *sharding.spec) if sharding.spec != P() else P())
        return jax.jit(lambda *v: jnp.stack(v), out_shardings=out)(*values)
    if isinstance(v0, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(values), *v0.shape), v0.dtype)
    return jnp.stack(values)


def _unstack(value: Any, n: int) -> list:
    if isinstance(value, jax.ShapeDtypeStruct):
        return [jax.ShapeDtypeStruct(value.shape[1:], value.dtype)] * n
    sharding = getattr(value, "sharding", None)
    if isinstance(sharding, NamedSharding) and not isinstance(value, jax.core.Tracer):
        out = NamedSharding(sharding.mesh, P(*sharding.spec[1:]) if sharding.spec != P() else P())
        take = jax.jit(lambda v, i: jax.lax.dynamic_index_in_dim(v, i, keepdims=False), out_shardings=out)
        return [take(value, i) for i in range(n)]  # one program for every layer
    return [value[i] for i in range(n)]


def stack_layers(model: Any) -> Any:
    """Converts ``model`` (a :class:`Transformer`, maybe with qwix's adapters and quantised
    kernels) in place to the scanned form and returns it: its ``nnx.List`` of blocks becomes one
    block whose every variable (qwix's QArray values and scales, ``nnx.LoRAParam`` adapters
    included) has a leading layer axis. Leaf by leaf: peak memory is the model plus one leaf's
    stack (the per-layer arrays are dropped as they are stacked, unless the caller holds them).
    A scanned model is returned as it is.

    Raises:
      ValueError: a model with layers held by another pipeline stage (``None``).
    """
    if getattr(model, "scan_layers", False):
        return model
    blocks = model.layers
    if any(b is None for b in blocks):
        raise ValueError("a pipeline stage's slice (layers set to None) cannot be stacked")
    n = len(blocks)
    graphdef = nnx.graphdef(blocks[0])
    _, state = nnx.split(blocks)
    model.layers = None
    del blocks
    flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    del state
    groups: dict[tuple, list] = {}
    for p in flat:
        groups.setdefault(p[1:], []).append(p)
    out = []
    for rest, paths in groups.items():
        if len(paths) != n:
            raise ValueError(f"layers differ: {'.'.join(map(str, rest))} is in {len(paths)} of {n} layers")
        variables = [flat.pop(p) for p in sorted(paths)]
        if isinstance(variables[0], nnx.RngState):  # random streams are not stacked (scan_blocks)
            out.append((rest, variables[0]))
        else:
            out.append((rest, variables[0].replace(_stack([v.get_value() for v in variables]))))
        del variables
    model.layers = nnx.merge(graphdef, nnx.from_flat_state(out))
    model.scan_layers = True
    return model


def unstack_layers(model: Any) -> Any:
    """The inverse of :func:`stack_layers` (in place, leaf by leaf): ``model.layers`` an
    ``nnx.List`` of blocks again (paths ``layers/<i>/...``), e.g. for a pipeline split. A
    per-layer model is returned as it is."""
    if not getattr(model, "scan_layers", False):
        return model
    graphdef, state = nnx.split(model.layers)
    model.layers = None
    n = model.config.num_hidden_layers
    per_layer: list[list] = [[] for _ in range(n)]
    flat = list(nnx.to_flat_state(state))
    del state
    while flat:
        p, var = flat.pop(0)
        values = [var.get_value()] * n if isinstance(var, nnx.RngState) else _unstack(var.get_value(), n)
        for i, v in enumerate(values):
            per_layer[i].append((tuple(p), var.replace(v)))
        del var
    model.layers = nnx.List([nnx.merge(graphdef, nnx.from_flat_state(f)) for f in per_layer])
    model.scan_layers = False
    return model
