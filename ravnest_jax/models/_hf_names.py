"""Our parameters under Hugging Face's and PEFT's names, and the LoRA tensors each side keeps:
the name of a parameter in a ``transformers`` checkpoint (:func:`hf_name`), the PEFT tensors of
our adapters (:func:`state_peft_tensors`) and PEFT tensors folded into a model's kernels
(:func:`fold_peft_tensors`). Below ``_hf`` (checkpoints), ``_peft`` (PEFT directories),
``_generate`` and ``_lora`` (``LoraModel.merged``), which all use it."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ._scan import is_stacked, layer_path

PREFIX = "base_model.model."
"""PEFT's prefix of a causal LM's tensor names."""


def hf_name(path: tuple) -> tuple[str, bool]:
    """The Hugging Face tensor name of a parameter at nnx state ``path``, and whether it is
    stored transposed (a linear kernel: ours is ``(in, out)``, theirs ``(out, in)``)."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    if parts[0] == "embed_tokens":
        return "model.embed_tokens.weight", False
    if parts[0] == "lm_head":
        return "lm_head.weight", True
    if parts[0] == "norm":
        return "model.norm.weight", False
    if parts[0] == "layers":
        mod = ".".join(parts[1:-1])
        if leaf == "kernel":
            return f"model.layers.{mod}.weight", True
        return f"model.layers.{mod}.{leaf}", False
    raise KeyError(f"no Hugging Face name for parameter {'.'.join(parts)}")


def state_peft_tensors(
    adapters: nnx.State, frozen: nnx.State | None = None, dtype: Any = None
) -> dict[str, np.ndarray]:
    """:func:`peft_tensors` of bare states: the ``nnx.LoRAParam`` leaves of ``adapters`` and of
    ``frozen`` (a frozen ``A``; the adapters win where both hold one), in the whole model's
    paths. A pipeline stage's ``params`` / ``frozen`` (``rj.pipeline.StageModel``) keep those
    paths, so a stage gives the tensors of its own layers under their global names.

    Raises:
      ValueError: a projection with ``A`` but no ``B`` (or the reverse), or no adapters at all.
    """
    found: dict[tuple, Any] = {}
    for state in (frozen if frozen is not None else nnx.State({}), adapters):
        for path, var in nnx.to_flat_state(state):
            if isinstance(var, nnx.LoRAParam):
                found[tuple(path)] = var.get_value()
    if not found:
        raise ValueError("no LoRA adapters in the model: make it with apply_lora or load_pretrained(lora=...)")
    out: dict[str, np.ndarray] = {}
    for path, value in sorted(found.items(), key=lambda kv: tuple(map(str, kv[0]))):
        leaf = str(path[-1])
        if not leaf.endswith(("_lora_a", "_lora_b")):
            raise ValueError(f"adapter {'.'.join(map(str, path))} is neither a LoRA A nor a B")
        kernel, which = leaf[: -len("_lora_a")], "A" if leaf.endswith("_lora_a") else "B"
        other = path[:-1] + (kernel + ("_lora_b" if which == "A" else "_lora_a"),)
        if other not in found:
            raise ValueError(f"adapter {'.'.join(map(str, path))} has no {'.'.join(map(str, other))}")
        host = np.asarray(value if dtype is None else jnp.asarray(value, dtype))
        layers = (
            [(layer_path(path[:-1], i), host[i]) for i in range(host.shape[0])]
            if is_stacked(path)
            else [(path[:-1], host)]
        )
        for module, v in layers:
            name, _ = hf_name(module + (kernel,))
            out[PREFIX + name.removesuffix(".weight") + f".lora_{which}.weight"] = np.ascontiguousarray(v.T)
    return out


def fold_peft_tensors(model: Any, tensors: dict[str, Any], scale: float) -> Any:
    """:func:`merge_peft_adapters` from PEFT's tensors in memory (name -> ``lora_A.weight`` ``(r,
    in)`` / ``lora_B.weight`` ``(out, r)`` host arrays, as ``_peft.peft_tensors`` gives them) and
    the LoRA scale ``alpha / r``: ``W += scale * lora_A.T @ lora_B.T`` in float32, cast to the
    kernel's dtype, in place. Returns ``model``.

    Raises:
      ValueError: a scanned model; an adapter of a module the model does not have, or of the
        wrong shape.
    """
    if model.scan_layers:
        raise ValueError("merge_peft_adapters: load the model with scan_layers=False")
    kernels = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if str(p[-1]) == "kernel":
            kernels[hf_name(p)[0].removesuffix(".weight")] = var
    for name in sorted({n.removesuffix(".lora_A.weight") for n in tensors if n.endswith(".lora_A.weight")}):
        module = name.removeprefix(PREFIX)
        if module not in kernels:
            raise ValueError(f"adapters: {name} names no projection of the model")
        var = kernels[module]
        a = np.asarray(tensors[name + ".lora_A.weight"], np.float32)  # (r, in)
        b = np.asarray(tensors[name + ".lora_B.weight"], np.float32)  # (out, r)
        w = var.get_value()
        if a.shape[1] != w.shape[0] or b.shape[0] != w.shape[1] or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"adapters: {name}: lora_A {a.shape} and lora_B {b.shape} do not fit the kernel (out, in) "
                f"{(w.shape[1], w.shape[0])}"
            )
        delta = jnp.asarray(a.T @ b.T * np.float32(scale))
        var.set_value((w.astype(jnp.float32) + delta).astype(w.dtype))
    return model
