"""The LLM training step of LoRA / QLoRA fine-tuning: one jitted function that the example, the
memory planner (``plan_memory`` compiles this very step) and the benchmarks all run.

What it does, as fine-tuners expect on a real card (peft, unsloth, torchtune do the same):

- mixed precision: the model computes in its compute dtype (``load_pretrained(...,
  dtype=jnp.bfloat16)``), the adapters stay float32 masters in the optimizer and are cast to
  the compute dtype for the forward pass (so the LoRA delta ``x @ A @ B`` is a bfloat16
  matmul), their gradients come back float32 (Micikevicius et al., arXiv 1710.03740);
- the loss from the final hidden state by :func:`chunked_cross_entropy`: never the whole
  ``(batch, seq, vocab)`` logits in float32; with a loss mask (prompt and padding do not count);
- gradient accumulation over ``micro_batches`` slices of the batch in a ``lax.scan`` (one
  slice's activations live at a time), float32 sums weighted by tokens, so that the result is
  the full-batch step's: ``loss = sum of -log p over all masked tokens / their number``;
- the adapters and optimizer state donated (updated in place), and on a mesh kept in their
  layouts (nothing compiles twice);
- gradient checkpointing and the attention implementation as the model's attributes
  (``model.remat``, ``model.attention``), settable here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ._loss import chunked_cross_entropy

REMAT = ("none", "full", "dots", "offload")
ATTENTION = ("auto", "cudnn", "chunked", "xla")


class TokenBatch(NamedTuple):
    """One batch of a language-model step (a pytree of arrays: it goes through ``jax.jit``,
    ``jax.device_put`` and ``jax.tree.map`` whole).

    Attributes:
      tokens: int32 ``(batch, seq)``: the inputs.
      targets: int32 ``(batch, seq)``: the next token at each position.
      loss_mask: float32 ``(batch, seq)``: 1 where the loss counts (completion or assistant
        tokens), 0 elsewhere (padding, prompt).
      positions: int32 ``(batch, seq)``: each token's position (restarting at 0 per packed
        document, or ``0..seq-1``).
      segment_ids: int32 ``(batch, seq)``: tokens attend only within their segment (one packed
        document each); all equal: one segment.
    """

    tokens: Any
    targets: Any
    loss_mask: Any
    positions: Any
    segment_ids: Any

    @classmethod
    def from_windows(cls, windows: Any) -> TokenBatch:
        """Plain packed language-model text: ``windows`` int32 ``(batch, seq + 1)`` (numpy or
        jax; the result is of the same kind) -> inputs ``windows[:, :-1]``, targets
        ``windows[:, 1:]``, every position counted, positions ``0..seq-1``, one segment.

        Raises:
          ValueError: ``windows`` is not 2-D with at least 2 tokens per row.
        """
        xp = np if isinstance(windows, np.ndarray) else jnp
        if windows.ndim != 2 or windows.shape[1] < 2:
            raise ValueError(f"windows must be (batch, seq + 1) with seq >= 1, got shape {tuple(windows.shape)}")
        b, t = windows.shape[0], windows.shape[1] - 1
        return cls(
            tokens=windows[:, :-1].astype(xp.int32),
            targets=windows[:, 1:].astype(xp.int32),
            loss_mask=xp.ones((b, t), xp.float32),
            positions=xp.broadcast_to(xp.arange(t, dtype=xp.int32), (b, t)),
            segment_ids=xp.zeros((b, t), xp.int32),
        )


def check_remat(remat: Any) -> Any:
    """``remat`` as the model's attribute takes it: False (``"none"``), True (``"full"``),
    ``"dots"`` or ``"offload"``; None: leave the model's as loaded.

    Raises:
      ValueError: anything else.
    """
    if remat is None or isinstance(remat, bool):
        return remat
    if remat not in REMAT:
        raise ValueError(f"remat={remat!r}: choose one of {', '.join(REMAT)} (or True / False)")
    return {"none": False, "full": True}.get(remat, remat)


def check_attention(attention: str | None) -> str | None:
    """Raises ValueError unless ``attention`` is None or one of :data:`ATTENTION`."""
    if attention is not None and attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: choose one of {', '.join(ATTENTION)}")
    return attention


def _configured(model: Any, remat: Any, attention: str | None) -> Any:
    if remat is not None:
        model.remat = remat
    if attention is not None and hasattr(model, "attention"):
        model.attention = attention
    return model


def compute_dtype(lm: Any) -> Any:
    """The compute dtype of ``lm``'s model (how it was loaded: ``load_pretrained(...,
    dtype=)``)."""
    model = nnx.merge(lm.graphdef, lm.adapters, lm.frozen)
    embed = getattr(model, "embed_tokens", None)
    return jnp.dtype(getattr(embed, "dtype", None) or jnp.float32)


def _cast_floats(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _cast_frozen_a(frozen: Any, dtype: Any) -> Any:
    """The frozen LoRA ``A`` (``train_a=False``) in the compute dtype, the rest as it is."""
    flat = nnx.to_flat_state(frozen)
    if not any(str(p[-1]).endswith("_lora_a") for p, _ in flat):
        return frozen
    out = []
    for p, var in flat:
        if str(p[-1]).endswith("_lora_a"):
            var = var.replace(var.get_value().astype(dtype))
        out.append((p, var))
    return nnx.from_flat_state(out)


def _mesh_layouts(lm: Any, tx: optax.GradientTransformation) -> tuple[Any, Any] | None:
    """The adapters' layouts and the optimizer state's (each leaf laid out like an adapter of
    its shape: moments split like the adapters, step counters replicated) when ``lm`` lies on a
    mesh of several devices (``load_pretrained(..., mesh=)``); None otherwise."""
    from jax.sharding import NamedSharding

    meshes = {
        s.mesh
        for s in (getattr(x, "sharding", None) for x in jax.tree.leaves(lm.adapters))
        if isinstance(s, NamedSharding)
    }
    if len(meshes) != 1:
        return None
    (mesh,) = meshes
    if mesh.size == 1:
        return None
    return adapter_layouts(mesh, lm.adapters), adapter_layouts(mesh, jax.eval_shape(tx.init, lm.adapters))


def _stacked_key_path(path: tuple) -> bool:
    """A pytree key path that leads to a scanned model's stacked leaf: ``layers`` followed by a
    name, not a layer index (:func:`~ravnest_jax.models._scan.is_stacked`), anywhere in the
    path (an optimizer state's moments hold the adapters' tree)."""
    keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
    return any(a == "layers" and isinstance(b, str) for a, b in zip(keys, keys[1:], strict=False))


def adapter_layouts(mesh: Any, tree: Any) -> Any:
    """The layout on ``mesh`` of every leaf of ``tree`` (adapters, or a pytree holding trees
    shaped like them: an optimizer state): like an adapter of its shape
    (:func:`~ravnest_jax.models.adapter_sharding`), the layer axis of a scanned model's stacked
    leaf never split (``stacked=True``), scalars replicated."""
    from ._hf import adapter_sharding

    return jax.tree_util.tree_map_with_path(
        lambda p, x: adapter_sharding(mesh, tuple(x.shape), stacked=_stacked_key_path(p) and len(x.shape) > 0),
        tree,
    )


def init_opt_state(lm: Any, tx: optax.GradientTransformation, adapters: Any = None) -> Any:
    """``tx.init(adapters)`` (default ``lm.adapters``) laid out as :func:`make_train_step` keeps
    it: on a mesh every leaf like an adapter of its shape (``tx.init`` leaves its step counters
    on one device; placed here, the first step's state has the layouts of every later one, and
    the step compiles once); without a mesh, ``tx.init``'s own."""
    adapters = lm.adapters if adapters is None else adapters
    state = tx.init(adapters)
    layouts = _mesh_layouts(lm, tx)
    return state if layouts is None else jax.device_put(state, layouts[1])


def _loss_sums(lm, adapters, frozen, batch: TokenBatch, key, dtype, remat, attention, loss_chunk):
    """``(nll_sum, tokens)`` of ``batch`` (float32 scalars), the adapters cast to ``dtype``."""
    if dtype != jnp.float32:
        adapters = _cast_floats(adapters, dtype)
        frozen = _cast_frozen_a(frozen, dtype)
    model = _configured(lm.model(adapters, frozen, key), remat, attention)
    hidden = model(batch.tokens, batch.positions, batch.segment_ids, head=False)
    return chunked_cross_entropy(model, hidden, batch.targets, batch.loss_mask, chunk_size=loss_chunk)


#: XLA's CPU pipeline hoists a convert of a loop-invariant operand out of a while loop onto the
#: whole operand (``WhileLoopInvariantCodeMotion`` with size-inflating ops): under the layer scan
#: that is an int8 copy of every layer's int4 kernels before the loop and a float32 copy of the
#: saved bfloat16 block inputs before the backward loop. Measured on Llama 3.1 8B int4 rank 16 at
#: 4 x 2048 (remat full, chunked attention): 16.05 GiB of temporaries with the pass, 6.17 without
#: (docs/finetuning.md). Only the CPU's step turns the pass off.
CPU_DISABLED_PASSES = "while-loop-invariant-code-motion"


def loop_compiler_options(backend: str | None = None) -> dict[str, Any]:
    """``jax.jit`` keyword arguments of the library's steps on ``backend`` (default: JAX's
    default backend): on CPU, XLA's loop-invariant code motion off (:data:`CPU_DISABLED_PASSES`),
    so that a scanned model's stacked weights and saved block inputs are sliced and converted
    one layer at a time instead of converted whole; nothing elsewhere."""
    if (backend or jax.default_backend()) != "cpu":
        return {}
    return {"compiler_options": {"xla_disable_hlo_passes": CPU_DISABLED_PASSES}}


def make_train_step(
    lm: Any,
    tx: optax.GradientTransformation,
    *,
    micro_batches: int = 1,
    loss_chunk: int = 1024,
    donate: bool = True,
    remat: bool | str | None = None,
    attention: str | None = None,
    dtype: Any = None,
    seed: int = 0,
) -> Callable:
    """The jitted training step of ``lm``'s adapters with the optimizer ``tx``.

    ``step(adapters, opt_state, frozen, batch, step) -> (adapters, opt_state, metrics)``:

    - ``adapters``: ``lm.adapters``' pytree (float32 masters); ``opt_state``: ``tx.init`` of
      them, on a mesh laid out by :func:`init_opt_state` (both donated unless ``donate=False``: do not use the arrays passed in afterwards);
      ``frozen``: ``lm.frozen``;
    - ``batch``: a :class:`TokenBatch` of ``(batch, seq)`` arrays (``batch`` divisible by
      ``micro_batches``);
    - ``step``: int32 scalar, the inner step number: LoRA dropout's key is
      ``fold_in(key(seed), step)`` (then the micro-batch index), so no two steps share a mask;
    - ``metrics``: ``{"loss": mean -log p per masked token (nats), "tokens": masked tokens}``,
      float32 scalars on the device (reading them is the caller's host round-trip).

    The gradient is that of ``sum of -log p over all masked tokens of the batch / their
    number``, accumulated over ``micro_batches`` equal slices of the batch's axis 0 in float32
    (a ``lax.scan``: one slice's activations at a time): equal to one step on the whole batch.
    Compiles once per batch shape; no host round-trip inside. On CPU it compiles with XLA's
    loop-invariant code motion off (:func:`loop_compiler_options`: without it XLA's CPU plan of
    a scanned model holds an int8 copy of every int4 kernel and float32 copies of the saved
    block inputs); such options are taken by a top-level ``jax.jit`` only, so call the step
    itself (``step(...)``, ``step.lower``, ``step.trace``), not from inside another ``jax.jit``.

    Args:
      lm: a :class:`~ravnest_jax.models.LoraModel` (:func:`split_lora`); its leaves may be
        ``jax.ShapeDtypeStruct`` to ``.lower()`` the step without arrays (the planner does).
        On a mesh (``load_pretrained(..., mesh=)``) the returned adapters and optimizer state
        keep the layouts of ``lm.adapters`` (the optimizer state's leaves laid out like an
        adapter of their shape, step counters replicated).
      tx: the optimizer over the adapters, typically ``rj.diloco(optax.adamw(...))``.
      micro_batches: gradient-accumulation slices per step.
      loss_chunk: tokens per chunk of :func:`chunked_cross_entropy` (of a micro-batch: its
        peak is about ``loss_chunk x vocab`` float32 logits and their gradient).
      donate: donate the adapters and optimizer state (``donate_argnums=(0, 1)``).
      remat: set ``model.remat`` (``"none"``/False, ``"full"``/True, ``"dots"``,
        ``"offload"``); None keeps the model's (``load_pretrained(remat=)``).
      attention: set ``model.attention`` (``"auto"``, ``"cudnn"``, ``"chunked"``, ``"xla"``)
        where the model has that attribute; None keeps the model's.
      dtype: the compute dtype the adapters are cast to for the forward pass; None: the
        model's (``load_pretrained(dtype=)``).
      seed: the dropout key's seed (only used with ``LoraConfig(dropout > 0)``).

    Returns:
      the jitted step (a ``jax.jit`` function: ``.lower(...)`` works).

    Raises:
      ValueError: ``micro_batches`` or ``loss_chunk`` < 1, an unknown ``remat`` or
        ``attention``; at the first
        call, a batch that does not divide by ``micro_batches``.
    """
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if not isinstance(loss_chunk, int) or loss_chunk < 1:
        raise ValueError(f"loss_chunk must be an int >= 1, got {loss_chunk!r}")
    remat, attention = check_remat(remat), check_attention(attention)
    dtype = jnp.dtype(dtype) if dtype is not None else compute_dtype(lm)
    dropout = lm.lora.dropout > 0 and lm.train_graphdef is not None
    base_key = jax.random.key(seed)

    def step_fn(adapters, opt_state, frozen, batch: TokenBatch, step):
        b = batch.tokens.shape[0]
        if b % micro_batches:
            raise ValueError(f"batch ({b}) must be a multiple of micro_batches ({micro_batches})")
        key = jax.random.fold_in(base_key, step) if dropout else None

        def sums(a, mb, i):
            k = None if key is None else jax.random.fold_in(key, i)
            return _loss_sums(lm, a, frozen, mb, k, dtype, remat, attention, loss_chunk)

        grad_fn = jax.value_and_grad(sums, has_aux=True)
        if micro_batches == 1:
            (nll, tokens), grads = grad_fn(adapters, batch, 0)
        else:
            slices = jax.tree.map(lambda x: x.reshape(micro_batches, b // micro_batches, *x.shape[1:]), batch)

            def body(carry, xs):
                g_acc, nll_acc, tok_acc = carry
                mb, i = xs
                (nll, tok), g = grad_fn(adapters, mb, i)
                g_acc = jax.tree.map(lambda s, x: s + x.astype(jnp.float32), g_acc, g)
                return (g_acc, nll_acc + nll, tok_acc + tok), None

            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), adapters)
            init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
            (grads, nll, tokens), _ = jax.lax.scan(body, init, (slices, jnp.arange(micro_batches)))
        denom = jnp.maximum(tokens, 1.0)
        grads = jax.tree.map(lambda g, a: (g / denom).astype(a.dtype), grads, adapters)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        adapters = optax.apply_updates(adapters, updates)
        return adapters, opt_state, {"loss": nll / denom, "tokens": tokens}

    layouts = _mesh_layouts(lm, tx)
    kwargs: dict[str, Any] = {"donate_argnums": (0, 1) if donate else (), **loop_compiler_options()}
    if layouts is not None:
        kwargs["out_shardings"] = (layouts[0], layouts[1], None)
    return jax.jit(step_fn, **kwargs)


def make_eval_loss(
    lm: Any,
    *,
    loss_chunk: int = 1024,
    remat: bool | str | None = None,
    attention: str | None = None,
    dtype: Any = None,
) -> Callable:
    """The jitted evaluation loss: ``eval_loss(adapters, frozen, batches) -> float32 scalar``,
    the mean ``-log p`` per masked token (nats) over ``batches``, a :class:`TokenBatch` of
    stacked ``(n, batch, seq)`` arrays, evaluated one batch at a time (``lax.map``), without
    dropout. Token-weighted: ``sum of -log p over all masked tokens / their number``.

    Args and Raises: as :func:`make_train_step` (``loss_chunk``, ``remat``, ``attention``,
    ``dtype``).
    """
    if not isinstance(loss_chunk, int) or loss_chunk < 1:
        raise ValueError(f"loss_chunk must be an int >= 1, got {loss_chunk!r}")
    remat, attention = check_remat(remat), check_attention(attention)
    dtype = jnp.dtype(dtype) if dtype is not None else compute_dtype(lm)

    @jax.jit(**loop_compiler_options())
    def eval_loss(adapters, frozen, batches: TokenBatch):
        nll, tokens = jax.lax.map(
            lambda b: _loss_sums(lm, adapters, frozen, b, None, dtype, remat, attention, loss_chunk), batches
        )
        return jnp.sum(nll) / jnp.maximum(jnp.sum(tokens), 1.0)

    return eval_loss
