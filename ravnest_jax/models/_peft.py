"""LoRA adapters in Hugging Face PEFT's format: ``adapter_config.json`` and
``adapter_model.safetensors`` as ``peft.PeftModel.save_pretrained`` writes them for a causal LM,
so ``PeftModel.from_pretrained(base, dir)`` (or ``AutoPeftModelForCausalLM``) loads them.

The map: qwix's update is ``alpha / rank * x @ A @ B`` with ``A`` ``(in, r)`` and ``B``
``(r, out)``; PEFT's is ``lora_alpha / r * x @ lora_A.T @ lora_B.T`` with ``lora_A.weight``
``(r, in)`` and ``lora_B.weight`` ``(out, r)``: the same scale, the matrices transposed.
Tensor names are the base kernel's Hugging Face name (:func:`hf_name`) under PEFT's
``base_model.model.`` prefix, ``.weight`` replaced by ``.lora_A.weight`` / ``.lora_B.weight``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from ._files import default_mode
from ._hf_names import state_peft_tensors
from ._lora import LoraModel

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def peft_config(lm: Any, base_model_name_or_path: str | None = None) -> dict:
    """The ``adapter_config.json`` dict of ``lm``'s adapters (PEFT's ``LoraConfig`` fields that
    PEFT >= 0.9 knows; the rest take PEFT's defaults when it loads them). ``lm``: a
    :class:`LoraModel`, or its :class:`LoraConfig` itself (a pipeline stage has no whole model)."""
    lora = getattr(lm, "lora", lm)
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": lora.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(lora.targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def peft_tensors(lm: LoraModel, adapters: nnx.State, dtype: Any = None) -> dict[str, np.ndarray]:
    """PEFT's tensors for ``adapters`` (``lm.adapters``' structure; a frozen ``A`` is read from
    ``lm.frozen``): name -> host array, ``lora_A.weight`` ``(r, in)`` and ``lora_B.weight``
    ``(out, r)`` per adapted projection and layer (a scanned model's stacked ``(layers, ...)``
    adapters unstacked), in the adapters' dtype or ``dtype``.

    Raises:
      ValueError: a projection with ``A`` but no ``B`` (or the reverse), or no adapters at all.
    """
    return state_peft_tensors(adapters, lm.frozen, dtype)


def save_peft_adapters(
    lm: LoraModel,
    adapters: nnx.State,
    path: str | Path,
    *,
    base_model_name_or_path: str | None = None,
    dtype: Any = None,
    overwrite: bool = False,
) -> Path:
    """Writes ``adapters`` as a PEFT LoRA adapter directory: ``adapter_config.json`` (``peft_type``
    LORA, ``task_type`` CAUSAL_LM, ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` in
    Hugging Face names, ``bias`` none, ``base_model_name_or_path``) and
    ``adapter_model.safetensors`` with ``base_model.model.model.layers.<i>.<module>.lora_A.weight``
    ``(r, in)`` and ``...lora_B.weight`` ``(out, r)`` per adapted projection (PEFT's names
    without the adapter name, as ``PeftModel.save_pretrained`` writes them). Loaded on the base
    checkpoint, ``peft.PeftModel.from_pretrained(base, path)`` computes what ``lm.model(adapters,
    lm.frozen)`` computes on the unquantised base.

    Args:
      lm: the split LoRA model (:func:`split_lora`); a frozen ``A`` (``train_a=False``) is read
        from ``lm.frozen``.
      adapters: the adapters to write, ``lm.adapters``' structure (e.g. trained or global
        params); scanned (``(layers, ...)``, written layer by layer) or per-layer.
      path: the directory; created if missing.
      base_model_name_or_path: recorded in the config (the Hub id or directory of the base).
      dtype: the stored dtype (default: the adapters' own, float32 for float32 masters).
      overwrite: replace the two files in a non-empty directory.

    Returns:
      the directory.

    Raises:
      ValueError: ``lm`` is not a :class:`LoraModel` or has no adapters, an adapter without its
        pair, or ``path`` is a file or a non-empty directory (without ``overwrite``).
    """
    from safetensors.numpy import save_file

    if not isinstance(lm, LoraModel):
        raise ValueError(f"save_peft_adapters needs a LoraModel (split_lora(model)), got {type(lm).__name__}")
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root} exists and is not a directory")
    if root.is_dir() and any(root.iterdir()) and not overwrite:
        raise ValueError(f"{root} is not empty (pass overwrite=True to replace its adapters)")
    tensors = peft_tensors(lm, adapters, dtype)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
    default_mode(root / WEIGHTS)  # safetensors writes 0600
    config = peft_config(lm, base_model_name_or_path)
    (root / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return root
