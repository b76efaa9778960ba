"""Chunked cross-entropy: the language-model loss from the final hidden state, one sequence chunk
at a time, so that no (batch, seq, vocab) float32 logits ever exist.

The head of a modern LLM is wide (Llama 3: 128,256 tokens): at 4 x 2048 tokens its float32
logits alone are 3.9 GiB, and a plain ``log_softmax`` keeps them (and their softmax) for the
backward pass. Here the final norm, the head matmul (in the compute dtype), the log-sum-exp (in
float32) and the negative log-likelihood run per chunk of ``chunk_size`` positions inside a
``lax.scan`` under ``jax.checkpoint``: the forward pass keeps only each chunk's hidden state, the
backward pass recomputes that chunk's logits, so the working set is one chunk's logits, about
``chunk_size x vocab`` float32 (a chunk is ``chunk_size // batch`` positions of every row). The same idea as Liger Kernel's fused linear cross-entropy
(Hsu et al., arXiv 2410.10989) and Apple's cut cross-entropy (Wijmans et al., arXiv 2411.09009),
written with JAX transformations instead of a kernel.
"""

from __future__ import annotations

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


def chunked_cross_entropy(
    model: Any,
    hidden: jax.Array,
    targets: jax.Array,
    loss_mask: jax.Array | None = None,
    *,
    chunk_size: int = 1024,
) -> tuple[jax.Array, jax.Array]:
    """The summed next-token negative log-likelihood of ``targets`` from the final hidden state,
    computed per sequence chunk (see the module docstring): never the whole logits in float32.

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
        with masked positions). The peak temporary is about ``chunk_size x vocab`` float32
        (twice that in the backward pass: logits and their gradient): 0.5 GiB for Llama 3's
        128,256 tokens at the default 1024.

    Returns:
      ``(nll_sum, tokens)``: float32 scalars, the sum of ``-log p(target)`` (nats) over the
      masked positions weighted by ``loss_mask``, and the sum of ``loss_mask`` (the token count).
      The mean loss is ``nll_sum / tokens``.

    Raises:
      ValueError: ``chunk_size`` < 1, or ``hidden`` / ``targets`` / ``loss_mask`` shapes that do
        not agree.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
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
