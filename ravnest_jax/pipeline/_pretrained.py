"""A stage of a pretrained model straight from its Hugging Face checkpoint: the split of an
abstract model (shapes only), each stage reading only its own tensors (docs/finetuning.md,
"Loading a stage from a checkpoint")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ._model import LayerSplit, _transformer_layers, adapter_filter, token_cross_entropy

__all__ = ["pretrained_split"]


def pretrained_split(
    path: str | Path,
    *,
    loss: Callable[[jax.Array, jax.Array], jax.Array] = token_cross_entropy,
    dtype: Any = jnp.float32,
    param_dtype: Any = None,
    quantize: str | None = None,
    lora: Any = None,
    adapter_dtype: Any = jnp.float32,
    remat: bool | str = True,
    mesh: Any = None,
) -> LayerSplit:
    """The :class:`LayerSplit` of the Hugging Face checkpoint at ``path`` whose stages each read
    only their own tensors: a stage peer of a model too large for one machine loads its slice.

    The split is the one of ``transformer_split(split_lora(load_pretrained(path, ...)))`` (or
    ``transformer_split(load_pretrained(path, ...))`` without ``lora``): the same units, trainable
    leaves (the adapters, or every ``nnx.Param`` without LoRA), paths, dtypes and values, and the
    same refusal of tied embeddings split from the head. But the model it holds is abstract
    (``jax.ShapeDtypeStruct`` leaves, never materialised as a whole): ``split.stage(lo, hi)`` reads
    from the safetensors files the tensors of units ``[lo, hi)`` only (cast to ``param_dtype``,
    quantised, laid out on ``mesh`` as :func:`rj.models.load_pretrained` does) and initialises
    their adapters (keyed by path: equal to a whole load's). ``split.unit_nbytes()``,
    ``split.hidden(...)`` and ``plan_stages(split, S)`` read no tensor (the shapes come from
    ``config.json``); ``plan_stages(split, S, by="time")`` reads one unit at a time. The
    adapters' graph is the one without dropout (as ``LoraModel.model`` without a key).

    Args:
      path: a checkpoint directory (``config.json``, ``model.safetensors`` or its shards listed
        in ``model.safetensors.index.json``). A shard listed in the index may be absent from the
        directory as long as no stage that is loaded needs it: a peer downloads the shards of
        its own stage only.
      loss: ``loss(logits, targets) -> scalar`` of the last stage.
      dtype, param_dtype, quantize, lora, adapter_dtype, remat, mesh: as
        :func:`rj.models.load_pretrained` (``lora`` an ``rj.models.LoraConfig``; ``quantize``
        None, ``"int8"`` or ``"int4"``, QLoRA arXiv 2305.14314; ``remat`` default True: each
        stage recomputes its blocks in the backward pass). A stage's blocks are unrolled (not
        scanned): its compile time grows with the number of blocks it holds.

    Returns:
      the split; its stages' ``params`` (the trainable leaves) and ``frozen`` are ``nnx.State``
      of arrays in the whole model's paths.

    Raises:
      ValueError: here, before any tensor is read: no such directory, a bad ``config.json``, an
        unsupported architecture, a tensor missing from the index, a tensor whose shape (in the
        header of its file, where the file exists) differs from the model's, an unknown
        ``quantize``, a bad ``mesh``. From ``split.stage(lo, hi)``: a file that the stage needs
        is absent (named, with the stage's units), before any of its tensors is read.
    """
    from ravnest_jax.models import INDEX, open_checkpoint

    ck = open_checkpoint(
        path,
        dtype=dtype,
        param_dtype=param_dtype,
        quantize=quantize,
        lora=lora,
        adapter_dtype=adapter_dtype,
        remat=remat,
        mesh=mesh,
        dropout=False,  # transformer_split of a LoraModel holds its graph without dropout
        require_files=False,
    )
    names: tuple[str, ...] = ()

    def load(lo: int, hi: int, params: Any, frozen: Any) -> tuple[Any, Any]:
        def missing(file: Path) -> str:
            units = ", ".join(names[lo:hi])
            return (
                f"{file} (listed in {INDEX}) does not exist; the stage of units [{lo}, {hi}) ({units}) "
                "needs its tensors"
            )

        return ck.fill(params, frozen, missing=missing)

    trainable = nnx.Param if lora is None else adapter_filter(lora)
    split = _transformer_layers(ck.model(), loss, trainable, load)
    names = split.unit_names
    return split
