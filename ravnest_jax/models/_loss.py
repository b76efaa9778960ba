"""Chunked cross-entropy: the language-model loss from the final hidden state, one sequence chunk
at a time and, within a chunk, one vocabulary chunk at a time, so that neither the (batch, seq,
vocab) float32 logits nor a float32 copy of the head ever exist.

The head of a modern LLM is wide (Llama 3: 128,256 tokens): at 4 x 2048 tokens its float32
logits alone are 3.9 GiB, and a plain ``log_softmax`` keeps them (and their softmax) for the
backward pass. Here the final norm, the head matmul (in the compute dtype, float32 accumulation),
an online log-sum-exp (in float32) and the negative log-likelihood run per chunk of
``chunk_size`` positions inside a ``lax.scan``; within a chunk the head is applied
``vocab_chunk`` columns at a time (a custom VJP: the forward pass keeps each chunk's normalised
input and log-sum-exp, the backward pass recomputes one vocabulary block's logits at a time and
accumulates the input gradient). The working set is one block of ``chunk_size x vocab_chunk``
float32 logits (and, on backends that compute bfloat16 matmuls in float32, such as XLA's CPU, one
``hidden x vocab_chunk`` float32 slice of the head instead of the whole head). The same idea as
Liger Kernel's fused linear cross-entropy (Hsu et al., arXiv 2410.10989) and Apple's cut
cross-entropy (Wijmans et al., arXiv 2411.09009), written with JAX transformations instead of a
kernel.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def _head_modules(model: Any) -> tuple[Any, Any, bool]:
    """The final norm, the output head module and whether the head is tied (the embedding's
    ``attend``)."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return model.norm, model.embed_tokens, True
    return model.norm, head, False


def _plain_head(head: Any, tied: bool) -> bool:
    """Whether the head is a plain weight the vocabulary-blocked path can slice: an ``nnx.Embed``
    (tied) or a bias-free ``nnx.Linear`` holding an array (not quantised)."""
    if tied:
        return isinstance(head, nnx.Embed) and isinstance(head.embedding[...], jax.Array)
    return (
        isinstance(head, nnx.Linear) and getattr(head, "bias", None) is None and isinstance(head.kernel[...], jax.Array)
    )


def _block(w: jax.Array, k: jax.Array, vc: int, tied: bool, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Block ``k`` of the head: ``(w_k, cols, valid)``: ``vc`` columns starting at
    ``min(k * vc, vocab - vc)`` (the last block overlaps the one before rather than padding a copy
    of the head), their vocabulary ids, and which of them belong to block ``k``.

    ``k`` passes an optimisation barrier with the block's input ``x``: without it, under the
    sequence-chunk scan, JAX's partial evaluation finds the slices loop-invariant and hoists the
    whole vocabulary loop's slices out, a stacked copy of the head."""
    k = jax.lax.optimization_barrier((k, x))[0]
    vocab = w.shape[0] if tied else w.shape[1]
    start = k * vc
    lo = jnp.minimum(start, vocab - vc)
    wk = jax.lax.dynamic_slice_in_dim(w, lo, vc, axis=0 if tied else 1)
    cols = lo + jnp.arange(vc, dtype=jnp.int32)
    return wk, cols, cols >= start


def _logits(x: jax.Array, wk: jax.Array, tied: bool) -> jax.Array:
    """``(b, c, vc)`` float32 logits of one block: the matmul in ``x``'s dtype, float32 accumulation."""
    dims = ((2,), (1,)) if tied else ((2,), (0,))
    return jax.lax.dot_general(x, wk.astype(x.dtype), (dims, ((), ())), preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocked_nll(x: jax.Array, w: jax.Array, tgt: jax.Array, vc: int, tied: bool) -> jax.Array:
    """``-log softmax(x @ head)[tgt]``, ``(b, c)`` float32, one vocabulary block at a time."""
    return _blocked_scan(x, w, tgt, vc, tied)[0]


def _blocked_fwd(x, w, tgt, vc, tied):
    # symbolic zeros: ``w.perturbed`` says whether the head's gradient is wanted (a frozen head,
    # as under LoRA, is not: the backward pass then keeps no head-sized float32 accumulator)
    nll, lse = _blocked_scan(x.value, w.value, tgt.value, vc, tied)
    return nll, (x.value, w.value, tgt.value, lse, jnp.zeros(()) if w.perturbed else None)


def _blocked_scan(x, w, tgt, vc, tied):
    vocab = w.shape[0] if tied else w.shape[1]
    n = -(-vocab // vc)
    shape = x.shape[:2]

    def body(carry, k):
        m, s, picked = carry
        wk, cols, valid = _block(w, k, vc, tied, x)
        logits = jnp.where(valid, _logits(x, wk, tied), -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[..., None]).sum(axis=-1)
        hit = valid & (cols == tgt[..., None])
        picked = picked + jnp.where(hit, logits, 0.0).sum(axis=-1)
        return (m_new, s, picked), None

    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    (m, s, picked), _ = jax.lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    lse = m + jnp.log(s)
    return lse - picked, lse


def _blocked_bwd(vc, tied, res, g):
    x, w, tgt, lse, head_grad = res
    want_dw = head_grad is not None
    vocab = w.shape[0] if tied else w.shape[1]
    n = -(-vocab // vc)
    g = g.astype(jnp.float32)

    def body(carry, k):
        dx, dw = carry
        wk, cols, valid = _block(w, k, vc, tied, x)
        p = jnp.exp(_logits(x, wk, tied) - lse[..., None])
        onehot = (cols == tgt[..., None]).astype(jnp.float32)
        dlogits = jnp.where(valid, (p - onehot) * g[..., None], 0.0)  # (b, c, vc) float32
        d = dlogits.astype(x.dtype)
        spec = "bcv,vd->bcd" if tied else "bcv,dv->bcd"  # tied: logits = x @ wk.T
        dx = dx + jnp.einsum(spec, d, wk.astype(x.dtype), preferred_element_type=jnp.float32)
        if not want_dw:
            return (dx, dw), None
        dwk = jnp.einsum("bcv,bcd->vd" if tied else "bcv,bcd->dv", d, x, preferred_element_type=jnp.float32)
        # the blocks' invalid columns carry zero gradient: adding keeps the overlap right
        lo = jnp.minimum(k * vc, vocab - vc)
        axis = 0 if tied else 1
        dw = jax.lax.dynamic_update_slice_in_dim(
            dw, jax.lax.dynamic_slice_in_dim(dw, lo, vc, axis=axis) + dwk, lo, axis=axis
        )
        return (dx, dw), None

    init = (jnp.zeros(x.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32) if want_dw else None)
    (dx, dw), _ = jax.lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return dx.astype(x.dtype), (dw.astype(w.dtype) if want_dw else None), None


_blocked_nll.defvjp(_blocked_fwd, _blocked_bwd, symbolic_zeros=True)


def chunked_cross_entropy(
    model: Any,
    hidden: jax.Array,
    targets: jax.Array,
    loss_mask: jax.Array | None = None,
    *,
    chunk_size: int = 1024,
    vocab_chunk: int | None = 16384,
) -> tuple[jax.Array, jax.Array]:
    """The summed next-token negative log-likelihood of ``targets`` from the final hidden state,
    computed per sequence chunk and vocabulary block (see the module docstring): never the whole
    logits in float32.

    Args:
      model: the :class:`~ravnest_jax.models.Transformer` (plain, LoRA or quantised by qwix)
        whose ``norm`` and head (``lm_head``, or the tied ``embed_tokens.attend``) are applied;
        the head is neither quantised nor adapted by :func:`~ravnest_jax.models.apply_lora`.
      hidden: ``(batch, seq, hidden_size)`` in the compute dtype: ``model(tokens, head=False)``,
        the last block's output before the final norm.
      targets: int32 ``(batch, seq)``: the token each position predicts.
      loss_mask: float32 ``(batch, seq)``: the weight of each position's loss (1 counts, 0 does
        not: padding, prompt); None counts every position.
      chunk_size: tokens per chunk: each chunk is ``max(1, chunk_size // batch)`` positions
        of every row (the batch axis stays whole, and split on a mesh; the last chunk is padded
        with masked positions).
      vocab_chunk: head columns per block (>= 1; a vocabulary that does not divide by it gets a
        last block overlapping the one before, nothing padded). The peak temporary is about
        ``chunk_size x vocab_chunk`` float32 logits and their gradient: 64 MiB each at the
        defaults (1024 x 16384), where whole-vocabulary chunks of Llama 3's 128,256 tokens
        would take 0.5 GiB each. ``None`` applies the whole head per sequence chunk under
        ``jax.checkpoint`` (the backward pass recomputes the chunk's logits), as does a head the
        blocks cannot slice: quantised, or a ``Linear`` with a bias.

    Returns:
      ``(nll_sum, tokens)``: float32 scalars, the sum of ``-log p(target)`` (nats) over the
      masked positions weighted by ``loss_mask``, and the sum of ``loss_mask`` (the token count).
      The mean loss is ``nll_sum / tokens``.

    Raises:
      ValueError: ``chunk_size`` or ``vocab_chunk`` < 1, or ``hidden`` / ``targets`` / ``loss_mask`` shapes that do
        not agree.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if vocab_chunk is not None and (
        isinstance(vocab_chunk, bool) or not isinstance(vocab_chunk, int) or vocab_chunk < 1
    ):
        raise ValueError(f"vocab_chunk must be an int >= 1 or None, got {vocab_chunk!r}")
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden {hidden.shape} must be (batch, seq, hidden) with targets (batch, seq), got {targets.shape}"
        )
    if loss_mask is None:
        loss_mask = jnp.ones(targets.shape, jnp.float32)
    elif loss_mask.shape != targets.shape:
        raise ValueError(f"loss_mask {loss_mask.shape} must have the targets' shape {targets.shape}")
    b, t, d = hidden.shape
    chunk = min(max(1, chunk_size // b), t)
    n = -(-t // chunk)
    pad = n * chunk - t
    mask = loss_mask.astype(jnp.float32)
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        mask = jnp.pad(mask, ((0, 0), (0, pad)))
    # (n, batch, chunk, ...): scan over the sequence chunks, the batch axis stays (and stays split)
    hs = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)
    ts = targets.astype(jnp.int32).reshape(b, n, chunk).swapaxes(0, 1)
    ms = mask.reshape(b, n, chunk).swapaxes(0, 1)

    norm, head, tied = _head_modules(model)
    if vocab_chunk is not None and _plain_head(head, tied):
        w = head.embedding[...] if tied else head.kernel[...]
        vc = min(vocab_chunk, w.shape[0] if tied else w.shape[1])

        # no checkpoint here: the custom VJP keeps the chunk's normalised input and its
        # log-sum-exp, and recomputes one vocabulary block's logits at a time
        def body(total, xs):
            h, tgt, m = xs
            nll = _blocked_nll(norm(h), w, tgt, vc, tied)
            return total + jnp.sum(nll * m), None

        nll, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs, ts, ms))
        return nll, jnp.sum(mask)

    graphdef, params = nnx.split((norm, head))

    @jax.checkpoint  # the backward pass recomputes the chunk's logits; only the chunk's input is kept
    def chunk_nll(params, h, tgt, m):
        norm, head = nnx.merge(graphdef, params)
        x = norm(h)
        logits = head.attend(x) if tied else head(x)  # (b, chunk, vocab), compute dtype
        logits = logits.astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
        return jnp.sum((lse - picked) * m)

    def body(total, xs):
        h, tgt, m = xs
        return total + chunk_nll(params, h, tgt, m), None

    nll, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs, ts, ms))
    return nll, jnp.sum(mask)
