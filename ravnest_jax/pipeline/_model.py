"""A model cut into units at layer boundaries, and the slice of it that one stage holds.

A *unit* is the smallest piece a stage boundary may fall between: the prologue (embeddings),
each block, the epilogue (final norm and head). A stage holds a contiguous run of units
``[lo, hi)``. The slice is the model itself with the units it does not hold set to ``None``
(the blocks list keeps its length, so every parameter keeps the path it has in the whole
model) and ``stage_ends = (first, last)``: the model's ``__call__`` starts from the hidden
state when it lacks the prologue and returns the hidden state when it lacks the epilogue
(``rj.models.Transformer`` and the char-LM example do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = ["LayerSplit", "StageModel", "token_cross_entropy", "transformer_split", "whole_params"]


def token_cross_entropy(logits: jax.Array, targets: Any) -> jax.Array:
    """Next-token cross-entropy (nats) of ``logits`` float ``(batch, seq, vocab)``.

    ``targets`` int32 ``(batch, seq)``: the mean over every position. Or a pair ``(ids,
    weights)``, int32 and float32 ``(batch, seq)``: the weighted sum ``sum(weights * ce)``, for a
    loss-masked batch whose weights are its mask already divided by the tokens counted (what the
    stage driver passes for masked batches, ``_drive.Batches``)."""
    if isinstance(targets, tuple):
        ids, weights = targets
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids)
        return jnp.sum(ce * weights.astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


@dataclasses.dataclass(frozen=True)
class StageModel:
    """The part of a model one stage holds.

    Attributes:
      lo, hi: the units ``[lo, hi)`` of the split.
      first, last: the stage starts with the prologue (its input is int32 tokens ``(batch,
        seq)``) / ends with the epilogue (its output is the logits).
      graphdef: the nnx graph of the slice.
      params: the trainable parameters (an ``nnx.State``; paths as in the whole model).
      frozen: the rest of the slice's state (a LoRA model's base; empty otherwise).
      loss: ``loss(logits, targets) -> scalar`` (the last stage uses it).
    """

    lo: int
    hi: int
    first: bool
    last: bool
    graphdef: Any
    params: Any
    frozen: Any
    loss: Callable[[jax.Array, jax.Array], jax.Array]

    def apply(self, params: Any, frozen: Any, x: jax.Array) -> jax.Array:
        """The slice's output for input ``x`` (tokens on the first stage, else the hidden state);
        pure and jittable."""
        return nnx.merge(self.graphdef, params, frozen)(x)

    @property
    def nbytes(self) -> int:
        """Bytes of the slice's parameters (trainable and frozen)."""
        return _nbytes(self.params) + _nbytes(self.frozen)


def _nbytes(tree: Any) -> int:
    from ravnest_jax.models import nbytes  # at the measured device width (int4: 4 bits, not 8)

    return nbytes(tree)


class LayerSplit:
    """An nnx model seen as ``prologue, blocks..., epilogue`` units, to be cut into stages.

    Args:
      model: the whole model (an ``nnx.Module``). Its ``__call__(x)`` must honour
        ``stage_ends`` and skip ``None`` entries of the blocks list (see the module docstring).
      blocks: the attribute holding the blocks (an ``nnx.List``).
      prologue: the attributes of the first unit (embeddings).
      epilogue: the attributes of the last unit (final norm, head).
      loss: ``loss(logits, targets) -> scalar`` (default: mean token cross-entropy).
      trainable: the nnx filter of what trains (default ``nnx.Param``); the rest is frozen.
      hidden_dtype: dtype of the activations between stages (default: what the prologue returns).
      tied: the epilogue uses a prologue parameter (tied embeddings): a split that separates
        the first and last unit is refused.
      load: for a ``model`` whose leaves are abstract (``jax.ShapeDtypeStruct``, as in
        :func:`pretrained_split`): ``load(lo, hi, params, frozen) -> (params, frozen)`` gives
        the slice's states with arrays (read from a checkpoint); :meth:`stage` calls it.
        Shapes, bytes and the plan (:meth:`unit_nbytes`, :meth:`hidden`) never call it.

    Raises:
      ValueError: ``blocks`` is not a list attribute, or an attribute is missing.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        blocks: str,
        prologue: Sequence[str],
        epilogue: Sequence[str],
        loss: Callable[[jax.Array, jax.Array], jax.Array] = token_cross_entropy,
        trainable: Any = nnx.Param,
        tied: bool = False,
        load: Callable[[int, int, Any, Any], tuple[Any, Any]] | None = None,
    ):
        if not isinstance(getattr(model, blocks, None), (list, nnx.List)):
            raise ValueError(f"model.{blocks} is not a list of blocks")
        for a in (*prologue, *epilogue):
            if not hasattr(model, a):
                raise ValueError(f"the model has no attribute {a!r}")
        self.model = model
        self.blocks, self.prologue, self.epilogue = blocks, tuple(prologue), tuple(epilogue)
        self.loss = loss
        self.trainable = trainable
        self.tied = bool(tied)
        self.load = load
        n = len(getattr(model, blocks))
        self.unit_names: tuple[str, ...] = ("prologue", *(f"{blocks}.{i}" for i in range(n)), "epilogue")

    @property
    def num_units(self) -> int:
        return len(self.unit_names)

    def unit_nbytes(self) -> list[int]:
        """Parameter bytes of each unit (trainable and frozen), in unit order (from the shapes:
        nothing is loaded)."""
        return [self.stage(i, i + 1, check=False, load=False).nbytes for i in range(self.num_units)]

    def stage(self, lo: int, hi: int, *, check: bool = True, load: bool = True) -> StageModel:
        """The slice holding units ``[lo, hi)``.

        Args:
          check: refuse tied embeddings split from the head.
          load: with a ``load`` function (:func:`pretrained_split`), read the slice's arrays;
            False: the slice as the model holds it (abstract leaves ``jax.ShapeDtypeStruct``
            there: shapes and bytes only).

        Raises:
          ValueError: an empty or out-of-range slice; tied embeddings split from the head.
        """
        n = self.num_units
        if not 0 <= lo < hi <= n:
            raise ValueError(f"a stage holds units [lo, hi) with 0 <= lo < hi <= {n}, got [{lo}, {hi})")
        first, last = lo == 0, hi == n
        if check and self.tied and first != last:
            raise ValueError(
                "the model ties its input embedding to its head: the first and last unit cannot be on "
                "different stages (untie the embeddings, or use one stage)"
            )
        s = nnx.clone(self.model)  # a new graph over the same (immutable) arrays: no copy
        blocks = list(getattr(s, self.blocks))
        setattr(s, self.blocks, nnx.List([b if lo <= i + 1 < hi else None for i, b in enumerate(blocks)]))
        if not first:
            for a in self.prologue:
                setattr(s, a, None)
        if not last:
            for a in self.epilogue:
                setattr(s, a, None)
        s.stage_ends = (first, last)
        graphdef, params, frozen = nnx.split(s, self.trainable, ...)
        if load and self.load is not None:
            params, frozen = self.load(lo, hi, params, frozen)
        return StageModel(lo, hi, first, last, graphdef, params, frozen, self.loss)

    def hidden(self, batch: int, seq: int) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the activation between two stages for ``batch`` sequences of
        ``seq`` tokens (of the prologue's output; abstract evaluation, no compute)."""
        st = self.stage(0, 1, check=False, load=False)
        return jax.eval_shape(st.apply, st.params, st.frozen, jax.ShapeDtypeStruct((batch, seq), jnp.int32))


def transformer_split(
    model: Any,
    loss: Callable[[jax.Array, jax.Array], jax.Array] = token_cross_entropy,
    *,
    remat: bool | str | None = True,
) -> LayerSplit:
    """The :class:`LayerSplit` of an ``rj.models.Transformer`` (units: the embedding, each
    decoder layer, the final norm with the head) or of a LoRA model from
    ``rj.models.split_lora`` (then only the adapters train; the base is frozen).

    A scanned model (``scan_layers``, stacked blocks) is split into per-layer blocks (a copy of
    the graph; ``model`` keeps its form): a stage's blocks run unrolled.

    Args:
      remat: the stages' gradient checkpointing policy (``rj.models.REMAT``; default True:
        each block is recomputed in the backward pass, arXiv 1604.06174); None keeps the
        model's own ``remat``.

    Raises:
      TypeError: not a Transformer or LoraModel.
      ValueError: a ``remat`` not in ``rj.models.REMAT``.
    """
    from ravnest_jax.models import REMAT, LoraModel, Transformer, unstack_layers

    if remat is not None and not isinstance(remat, bool) and remat not in REMAT:
        raise ValueError(f"remat={remat!r}: choose None, False/'none', True/'full', 'dots' or 'offload'")
    trainable: Any = nnx.Param
    if isinstance(model, LoraModel):
        lora = model
        model = lora.model(lora.adapters, lora.frozen)
        trainable = adapter_filter(lora.lora)
    if not isinstance(model, Transformer):
        raise TypeError(f"expected an rj.models.Transformer or LoraModel, got {type(model).__name__}")
    if model.scan_layers or remat is not None:
        model = unstack_layers(nnx.clone(model))
    if remat is not None:
        model.remat = remat
    return _transformer_layers(model, loss, trainable)


def adapter_filter(lora: Any) -> Callable[[tuple, Any], bool]:
    """The nnx filter of the adapters ``split_lora`` trains under ``lora`` (a ``LoraConfig``):
    ``A`` and ``B``, or ``B`` only with ``train_a=False``."""

    def trainable(path: tuple, value: Any) -> bool:
        return isinstance(value, nnx.LoRAParam) and (lora.train_a or str(path[-1]).endswith("_lora_b"))

    return trainable


def _transformer_layers(model: Any, loss: Callable, trainable: Any, load: Any = None) -> LayerSplit:
    return LayerSplit(
        model,
        blocks="layers",
        prologue=("embed_tokens",),
        epilogue=("norm", "lm_head"),
        loss=loss,
        trainable=trainable,
        tied=model.config.tie_word_embeddings,
        load=load,
    )


def whole_params(*stage_params: Any) -> Any:
    """The whole model's parameters (an ``nnx.State``) from the stages' (their paths are the
    whole model's, so this is their union): e.g. for an evaluation of the unsplit model."""
    return nnx.merge_state(*stage_params)
