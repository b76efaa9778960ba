"""A decoder-only transformer in flax nnx, in the Llama 3 / Qwen 2.5 / Qwen 3 / Mistral layout:
RMSNorm, rotary position embeddings (with Llama 3's scaling), grouped-query attention with a
causal mask, SwiGLU, tied or untied embeddings, Qwen 3's per-head q/k norm.

The computation follows Hugging Face ``transformers``' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``
(float32 logits equal within 1e-4 on the fixtures in ``tests/fixtures/``). Parameters live in
``param_dtype``; ``dtype`` is the compute dtype (bfloat16 or float32); norms and the softmax run
in float32.

References: Touvron et al., Llama 2, arXiv 2307.09288; Su et al., RoFormer (RoPE), arXiv
2104.09864; Ainslie et al., GQA, arXiv 2305.13245; Shazeer, GLU variants (SwiGLU), arXiv
2002.05202; Qwen 3 technical report, arXiv 2505.09388.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ._attention import DEFAULT_CHUNK, attention, check_implementation
from ._config import TransformerConfig, rope_frequencies
from ._remat import block_fn, check_remat, recompute_in_backward, remat_policy, token_chunks
from ._scan import scan_blocks, stack_layers


def _has_rng(module: nnx.Module) -> bool:
    """Whether ``module`` holds random streams (qwix's LoRA dropout keys)."""
    return bool(jax.tree.leaves(nnx.state(module, nnx.RngState)))


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32, returned in ``x``'s dtype."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * h.astype(x.dtype)


def _linear(din: int, dout: int, bias: bool, rngs: nnx.Rngs, dtype, param_dtype) -> nnx.Linear:
    init = nnx.initializers.normal(0.02)
    return nnx.Linear(din, dout, use_bias=bias, kernel_init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates ``x`` ``(batch, seq, heads, head_dim)`` by ``positions`` ``(batch, seq)`` int32:
    the two halves of each head are the pair (Hugging Face's ``rotate_half`` convention)."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # (b, t, head_dim / 2)
    cos, sin = jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, a causal mask and optional segment ids (packed
    documents), computed by :func:`ravnest_jax.models.attention` with ``implementation`` and
    ``chunk_size`` (plain attributes, static in ``nnx.split``; the :class:`Transformer` sets them
    on every block from ``model.attention`` and ``model.attention_chunk``)."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype, param_dtype):
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        self.implementation, self.chunk_size = "auto", DEFAULT_CHUNK
        self.dtype = dtype  # a LoRA delta in float32 (adapters) is cast back to the compute dtype
        self.q_proj = _linear(d, h * hd, cfg.attention_bias, rngs, dtype, param_dtype)
        self.k_proj = _linear(d, kv * hd, cfg.attention_bias, rngs, dtype, param_dtype)
        self.v_proj = _linear(d, kv * hd, cfg.attention_bias, rngs, dtype, param_dtype)
        # Llama and Qwen 3 put the bias on o_proj too when attention_bias is set; Qwen 2.5 never
        self.o_proj = _linear(h * hd, d, cfg.attention_bias and cfg.model_type != "qwen2", rngs, dtype, param_dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        b, t, _ = x.shape
        q = self.q_proj(x).astype(self.dtype).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).astype(self.dtype).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).astype(self.dtype).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out = attention(
            q, k, v, segment_ids=segment_ids, implementation=self.implementation, chunk_size=self.chunk_size
        )
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)).astype(self.dtype)


#: tokens per chunk of every block's MLP (``Transformer.mlp_chunk``)
DEFAULT_MLP_CHUNK = 2048


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``token_chunk`` tokens at a time (a static
    argument, default None; the :class:`Transformer` passes ``model.mlp_chunk`` to every block
    when ``model.remat`` recomputes the blocks). Each chunk is
    ``max(1, token_chunk // batch)`` positions of every row (the last one padded with zero
    tokens), run by :func:`token_chunks`: the ``(tokens, intermediate_size)`` activations and
    their gradients are one chunk's, in the forward and in the backward pass, and the backward
    pass runs the MLP's forward again, chunk by chunk. ``None``, a sequence of one chunk, or
    random streams on the module (LoRA dropout) run all the tokens at once. Outputs and input
    gradients are the same per token either way; parameter gradients are summed over the chunks
    in float32."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype, param_dtype):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(d, f, False, rngs, dtype, param_dtype)
        self.up_proj = _linear(d, f, False, rngs, dtype, param_dtype)
        self.down_proj = _linear(f, d, False, rngs, dtype, param_dtype)
        self.dtype = dtype

    def __call__(self, x: jax.Array, token_chunk: int | None = None) -> jax.Array:
        if x.ndim != 3 or not token_chunk or _has_rng(self):
            return self._swiglu(x)
        b, t, d = x.shape
        chunk = min(max(1, token_chunk // b), t)  # positions of every row
        n = -(-t // chunk)
        if n == 1:
            return self._swiglu(x)
        pad = n * chunk - t  # zero tokens: outputs dropped, no gradient
        xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))) if pad else x
        # (n, batch, chunk, hidden): the batch axis stays whole (and stays split on a mesh)
        xs = xs.reshape(b, n, chunk, d).swapaxes(0, 1)
        graphdef, state = nnx.split(self)
        ys = token_chunks(lambda st, h: nnx.merge(graphdef, st)._swiglu(h), state, xs)
        return ys.swapaxes(0, 1).reshape(b, n * chunk, ys.shape[-1])[:, :t]

    def _swiglu(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.gate_proj(x).astype(self.dtype)) * self.up_proj(x).astype(self.dtype)
        return self.down_proj(h).astype(self.dtype)


class Block(nnx.Module):
    """Pre-norm attention and MLP with residuals."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype, param_dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, rngs, dtype, param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(cfg, rngs, dtype, param_dtype)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        inv_freq: jax.Array,
        segment_ids: jax.Array | None = None,
        mlp_chunk: int | None = None,
    ) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, inv_freq, segment_ids)
        return x + self.mlp(self.post_attention_layernorm(x), mlp_chunk)


def _run_block(
    layer: nnx.Module,
    x: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    segment_ids: Any,
    remat: str,
    mlp_chunk: int | None = None,
) -> jax.Array:
    """One block of the unrolled layer loop under the ``remat`` policy: ``"full"`` through
    :func:`recompute_in_backward` (``jax.checkpoint``'s barrier is removed by XLA's CPU
    pipeline), ``"dots"`` and ``"offload"`` through ``jax.checkpoint`` with their policy; its
    MLP ``mlp_chunk`` tokens at a time."""
    if remat == "none":
        return layer(x, positions, inv_freq, segment_ids, mlp_chunk)
    graphdef, state = nnx.split(layer)
    fn = block_fn(graphdef, mlp_chunk)
    if remat == "full":
        return recompute_in_backward(
            lambda st, h, pos, seg: fn(st, h, pos, inv_freq, seg), state, x, positions, segment_ids
        )
    return jax.checkpoint(fn, policy=remat_policy(remat))(state, x, positions, inv_freq, segment_ids)


class Transformer(nnx.Module):
    """The causal language model: ``model(tokens) -> logits``.

    Args:
      cfg: the :class:`TransformerConfig`.
      rngs: initialisation randomness (normal(0.02) weights, unit norms), e.g. ``nnx.Rngs(0)``.
      dtype: compute dtype (``jnp.float32`` or ``jnp.bfloat16``).
      param_dtype: parameter dtype.
      remat: gradient checkpointing (Chen et al., arXiv 1604.06174), one of :data:`REMAT`:
        ``False``/``"none"`` keeps every block's activations for the backward pass;
        ``True``/``"full"`` keeps each block's input only and recomputes the block in the
        backward pass (about a third more compute, the same gradients: what fits a long sequence
        on a 24 GB card); ``"dots"`` also keeps the outputs of the projections (matmuls without
        batch dimensions, ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``) and
        recomputes the rest (norms, rotary, attention, activations); ``"offload"`` keeps each
        block's input in host memory (``pinned_host``) instead of the device's and recomputes the
        block. Read at call time: it can be switched on a built model (docs/memory-and-compile.md).
      scan_layers: store the blocks' parameters stacked (a leading layer axis, one ``Block`` in
        ``self.layers``) and run them with one ``jax.lax.scan``: trace and compile time do not
        grow with depth (MaxText's ``scan_layers``). False: ``self.layers`` is an ``nnx.List`` of
        blocks, unrolled (what pipeline stages slice). :func:`stack_layers` /
        :func:`unstack_layers` convert a built model.
      attention: how each block computes attention (:func:`ravnest_jax.models.attention`):
        ``"auto"`` (cuDNN's flash attention on NVIDIA GPUs in bfloat16 / float16, else the
        chunked kernel, or XLA's for sequences of one chunk), ``"cudnn"``, ``"chunked"`` or
        ``"xla"``. An attribute: ``model.attention = "xla"`` on a built model switches every
        block (a plain string, static: kept by ``nnx.split`` / ``nnx.merge``).

    ``attention_chunk`` (attribute, default 256): tokens per query / key chunk of the chunked
    attention (and the ``"auto"`` threshold below which XLA's attention is used).

    ``mlp_chunk`` (attribute, default :data:`DEFAULT_MLP_CHUNK`, 2048; None: off): tokens per
    chunk of every block's MLP (:class:`MLP`) when ``remat`` is ``"full"`` or ``"offload"``
    (the block is recomputed in the backward pass anyway; the MLP's backward pass then runs its
    forward again chunk by chunk): the ``(tokens, intermediate_size)`` activations of a block,
    and their gradients, are one chunk's at a time. With ``"none"`` or ``"dots"`` (activations
    kept instead of recomputed) every MLP runs all its tokens at once.

    ``batch_sharding`` (attribute, default None; ``load_pretrained(..., mesh=)`` sets it): a
    ``NamedSharding`` that splits the batch axis; the embeddings, every block's output and the
    logits are constrained to it when the batch divides by its device count.

    Call with ``tokens`` int32 ``(batch, seq)``, optionally ``positions`` int32 ``(batch, seq)``
    (default ``0..seq-1``; for packed documents, restarting at 0 with each document) and
    ``segment_ids`` int32 ``(batch, seq)`` (a token attends only to earlier tokens of its own
    segment; None: one segment per row); returns float32 logits ``(batch, seq, vocab_size)``,
    or with ``head=False`` the final hidden state ``(batch, seq, hidden_size)`` in the compute
    dtype before the final norm (for a chunked cross-entropy that applies the norm and head
    itself).

    A pipeline stage holds a slice of the model (:func:`ravnest_jax.pipeline.transformer_split`):
    ``stage_ends = (first, last)`` says whether it starts with the embedding (else it is called
    with the hidden state ``(batch, seq, hidden_size)`` in the compute dtype) and whether it ends
    with the norm and head (else it returns the hidden state); ``(True, True)``, the whole model,
    by default.

    Raises:
      ValueError: a ``remat`` not in :data:`REMAT` (or a bool).
    """

    stage_ends: tuple[bool, bool] = (True, True)  # a class default: a whole model

    def __init__(
        self,
        cfg: TransformerConfig,
        rngs: nnx.Rngs,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        remat: bool | str = False,
        attention: str = "auto",
        scan_layers: bool = False,
    ):
        check_implementation(attention)
        self.config = cfg
        self.remat = check_remat(remat)
        self.scan_layers = False
        self.batch_sharding = None  # set by load_pretrained(..., mesh=): activations split by batch
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            embedding_init=nnx.initializers.normal(0.02),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.layers = nnx.List([Block(cfg, rngs, dtype, param_dtype) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _linear(cfg.hidden_size, cfg.vocab_size, False, rngs, dtype, param_dtype)
        )
        self._inv_freq = tuple(rope_frequencies(cfg))  # static floats: a constant of the jitted program
        self.attention, self.attention_chunk = attention, DEFAULT_CHUNK
        self.mlp_chunk = DEFAULT_MLP_CHUNK
        if scan_layers:  # the same initial values as the per-layer model
            stack_layers(self)

    @property
    def attention(self) -> str:
        """The attention implementation of every block: ``"auto"``, ``"cudnn"``, ``"chunked"``
        or ``"xla"`` (setting it validates it and sets it on every block)."""
        return self._attention

    @attention.setter
    def attention(self, value: str) -> None:
        check_implementation(value)
        self._attention = value
        for _, module in nnx.iter_modules(self):
            if isinstance(module, Attention):
                module.implementation = value

    @property
    def attention_chunk(self) -> int:
        """Tokens per chunk of the chunked attention, >= 1 (set on every block)."""
        return self._attention_chunk

    @attention_chunk.setter
    def attention_chunk(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"attention_chunk={value!r}: want an int >= 1")
        self._attention_chunk = int(value)
        for _, module in nnx.iter_modules(self):
            if isinstance(module, Attention):
                module.chunk_size = int(value)

    @property
    def mlp_chunk(self) -> int | None:
        """Tokens per chunk of every block's MLP under ``remat`` ``"full"`` / ``"offload"``,
        >= 1, or None: all at once."""
        return self._mlp_chunk

    @mlp_chunk.setter
    def mlp_chunk(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1):
            raise ValueError(f"mlp_chunk={value!r}: want an int >= 1 or None")
        self._mlp_chunk = None if value is None else int(value)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        head: bool = True,
    ) -> jax.Array:
        first, last = self.stage_ends
        remat = check_remat(self.remat)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape[:2])
        inv_freq = jnp.asarray(np.asarray(self._inv_freq, np.float32))
        mlp_chunk = self.mlp_chunk if remat in ("full", "offload") else None  # recomputed blocks only
        x = self._by_batch(self.embed_tokens(tokens)) if first else tokens
        if self.scan_layers:
            x = scan_blocks(
                self.layers,
                x,
                positions,
                inv_freq,
                segment_ids,
                remat=remat,
                by_batch=self._by_batch,
                mlp_chunk=mlp_chunk,
            )
        else:
            for layer in self.layers:
                if layer is None:  # held by another pipeline stage
                    continue
                x = self._by_batch(_run_block(layer, x, positions, inv_freq, segment_ids, remat, mlp_chunk))
        if not last or not head:
            return x
        x = self.norm(x)
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        return self._by_batch(logits.astype(jnp.float32))

    def _by_batch(self, x: jax.Array) -> jax.Array:
        """``x`` (batch, ...) split by batch over the mesh of ``batch_sharding`` (FSDP with data
        parallelism: without it XLA's partitioner may keep activations whole on every device,
        measured: a replicated copy of every block's input), when the batch divides."""
        s = self.batch_sharding
        if s is None or x.shape[0] % s.mesh.size:
            return x
        return jax.lax.with_sharding_constraint(x, s)
