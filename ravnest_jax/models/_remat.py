"""Gradient checkpointing for the transformer's blocks: the :data:`REMAT` policies, a
recomputation no compiler can merge back into the forward pass (:func:`recompute_in_backward`),
the token-chunked MLP's custom VJP (:func:`token_chunks`) and the pure block function that the
unrolled loop (``_transformer``) and the layer scan (``_scan``) both checkpoint.

Reference: Chen et al., Training deep nets with sublinear memory cost, arXiv 1604.06174.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name


def recompute_in_backward(fn: Callable[..., jax.Array], params: Any, x: jax.Array, *rest: Any) -> jax.Array:
    """``fn(params, x, *rest)``, an array, whose intermediate values are not kept for the
    backward pass: the backward pass runs ``fn`` again, only when it reaches this call, and
    differentiates that (gradient checkpointing, Chen et al., arXiv 1604.06174).

    ``jax.checkpoint`` does the same with an optimization barrier on the recomputation's inputs,
    which XLA's CPU pipeline removes before its common-subexpression pass: measured on a 4-layer
    model, the recomputation is merged back into the forward pass and every block's activations
    stay live (XLA's GPU and TPU pipelines keep the barrier to the end). Here every input of the
    recomputation is tied to the output's cotangent (plus ``keep - 1``, zero, where ``keep`` is
    False only when the cotangent is not finite, and then the gradient is not either), and in the
    forward pass ``params`` are tied to ``x`` the same way: no compiler can merge the
    recomputation with the forward pass, run it before the backward pass reaches this point, or
    hoist work on ``params`` alone (casts, dequantisation) out of the block, so that the memory
    is the same on every backend and the CPU plan of ``plan_memory`` is the plan of a
    recomputing step. ``fn`` is traced once, here (``jax.closure_convert``): interceptors active
    now (qwix's LoRA) are part of it.

    Gradients equal those of ``fn`` without recomputation (the same operations in the same
    order). Costs one more forward pass of ``fn`` and an elementwise add on its inputs.
    """
    leaves, treedef = jax.tree.flatten((params, x, *rest))
    num_params = len(jax.tree.leaves(params))

    def flat_fn(*flat):
        return fn(*jax.tree.unflatten(treedef, list(flat)))

    converted, consts = jax.closure_convert(flat_fn, *leaves)

    def forward(inputs):
        keep = _finite_at_origin(inputs[num_params])
        return converted(*(_tie(keep, v) for v in inputs[:num_params]), *inputs[num_params:])

    @jax.custom_vjp
    def run(*inputs):
        return forward(inputs)

    def fwd(*inputs):
        return forward(inputs), inputs

    def bwd(inputs, ct):
        keep = _finite_at_origin(ct)
        _, vjp = jax.vjp(converted, *(_tie(keep, v) for v in inputs))
        return vjp(ct)

    run.defvjp(fwd, bwd)
    return run(*leaves, *consts)


def _finite_at_origin(a: jax.Array) -> jax.Array:
    """``a[0, ..., 0] * 0 == 0``: True unless that element is not finite; a scalar no compiler
    can know in advance."""
    return a[(0,) * a.ndim] * 0 == 0 if a.size else jnp.bool_(True)


def _tie(keep: jax.Array, x: Any) -> Any:
    """``x`` plus ``keep - 1`` (zero: ``keep`` is True in practice), a value no compiler can fold
    or see through, so everything computed from the result is computed anew."""
    if not hasattr(x, "dtype"):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(x)
        return jax.random.wrap_key_data(data + (keep.astype(data.dtype) - 1), impl=jax.random.key_impl(x))
    if x.dtype == jnp.bool_:
        return x & keep
    return x + (keep.astype(x.dtype) - jnp.ones((), x.dtype))


def token_chunks(fn: Callable[[Any, jax.Array], jax.Array], params: Any, xs: jax.Array) -> jax.Array:
    """``fn(params, x)`` on each chunk ``x`` of ``xs`` ``(chunks, tokens, ...)``, stacked, for a
    ``fn`` that treats every token alone (an MLP): one chunk's intermediate values live at a time,
    in the forward and in the backward pass. Only ``xs`` is kept for the backward pass, which
    runs ``fn`` again chunk by chunk and differentiates that; the gradients of ``params`` are
    summed over the chunks in float32. ``fn`` is traced once, here (``jax.closure_convert``, as
    in :func:`recompute_in_backward`): interceptors active now (qwix's LoRA) are part of it."""
    leaves, treedef = jax.tree.flatten(params)
    num = len(leaves)

    def flat_fn(*flat):
        return fn(jax.tree.unflatten(treedef, list(flat[:num])), flat[num])

    converted, consts = jax.closure_convert(flat_fn, *leaves, xs[0])
    leaves = [*leaves, *consts]

    def apply(ps, x):
        return converted(*ps[:num], x, *ps[num:])

    def forward(ps, xs):
        return jax.lax.map(lambda x: apply(ps, x), xs)

    @jax.custom_vjp
    def run(ps, xs):
        return forward(ps, xs)

    def fwd(ps, xs):
        return forward(ps, xs), (ps, xs)

    def bwd(res, cts):
        ps, xs = res
        inexact = [jnp.issubdtype(p.dtype, jnp.inexact) for p in ps]

        def body(acc, inp):
            x, ct = inp
            _, vjp = jax.vjp(apply, ps, x)
            dps, dx = vjp(ct)
            acc = [a + d.astype(jnp.float32) if a is not None else None for a, d in zip(acc, dps, strict=True)]
            return acc, dx

        init = [jnp.zeros(p.shape, jnp.float32) if f else None for p, f in zip(ps, inexact, strict=True)]
        acc, dxs = jax.lax.scan(body, init, (xs, cts))
        dps = [
            a.astype(p.dtype) if f else np.zeros(p.shape, jax.dtypes.float0)
            for a, p, f in zip(acc, ps, inexact, strict=True)
        ]
        return dps, dxs

    run.defvjp(fwd, bwd)
    return run(leaves, xs)


#: the gradient checkpointing policies of ``Transformer.remat`` (False is "none", True "full")
REMAT = ("none", "full", "dots", "offload")
#: the name of a block's input in ``jax.checkpoint`` policies (``"offload"`` moves it to the host)
BLOCK_INPUT = "block_input"


def check_remat(remat: Any) -> str:
    """``remat`` as one of :data:`REMAT`: False (or None) is ``"none"``, True is ``"full"``.

    Raises:
      ValueError: anything else, naming it.
    """
    if remat is None or remat is False:
        return "none"
    if remat is True:
        return "full"
    if isinstance(remat, str) and remat in REMAT:
        return remat
    raise ValueError(f"remat={remat!r}: choose False/'none', True/'full', 'dots' or 'offload'")


def remat_policy(remat: str) -> Callable | None:
    """The ``jax.checkpoint`` policy of a :data:`REMAT` name (``"none"`` has none: no
    checkpoint): ``"full"`` saves nothing (the block's input is the checkpoint's own residual),
    ``"dots"`` saves matmul outputs without batch dimensions (the projections, not attention's
    scores), ``"offload"`` saves the block input (named :data:`BLOCK_INPUT`) in ``pinned_host``
    memory."""
    remat = check_remat(remat)
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if remat == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[BLOCK_INPUT],
            offload_src="device",
            offload_dst="pinned_host",
        )
    return None


def block_fn(graphdef: Any, mlp_chunk: int | None = None) -> Callable:
    """``fn(state, x, positions, inv_freq, segment_ids)``: the block of ``graphdef`` with
    ``state`` on ``x``, its MLP ``mlp_chunk`` tokens at a time, a pure function (nothing is
    written back)."""

    def fn(state, x, positions, inv_freq, segment_ids):
        x = checkpoint_name(x, BLOCK_INPUT)
        return nnx.merge(graphdef, state)(x, positions, inv_freq, segment_ids, mlp_chunk)

    return fn
