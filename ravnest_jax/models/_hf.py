"""Hugging Face checkpoints: a directory with ``config.json`` and ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``) into a :class:`Transformer`, and back.

Tensors are read with ``safetensors`` one at a time (the files are memory-mapped; no file is
held twice in host memory) and checked against the model's shapes before anything is placed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ._config import TransformerConfig
from ._lora import LoraConfig, _wrap, check_quantize, init_adapters
from ._transformer import Transformer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


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


def _tensor_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = root / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        return {name: root / f for name, f in weight_map.items()}
    single = root / SINGLE
    if not single.is_file():
        raise ValueError(f"no {SINGLE} or {INDEX} in {root}")
    from safetensors import safe_open

    with safe_open(str(single), framework="flax") as f:
        return {name: single for name in f.keys()}


def load_pretrained(
    path: str | Path,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = None,
    quantize: str | None = None,
    lora: LoraConfig | None = None,
    adapter_dtype: Any = jnp.float32,
    remat: bool = False,
    mesh: Any = None,
) -> Transformer:
    """Loads a Hugging Face checkpoint directory into a :class:`Transformer`, optionally with
    LoRA adapters and a quantised frozen base (QLoRA).

    Tensors are read one at a time from the memory-mapped safetensors files, cast (or quantised)
    and placed before the next is read: the unquantised model never exists in memory.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` or its shards with
        ``model.safetensors.index.json`` (Llama 3, Mistral, Qwen 2.5, Qwen 3 layouts).
      dtype: the compute dtype (``jnp.float32`` or ``jnp.bfloat16``).
      param_dtype: the parameter dtype (default: ``dtype``); tensors are cast on load.
      quantize: None, ``"int8"`` (one scale per output channel) or ``"int4"`` (one scale per
        tile of 16-128 inputs): the projections' storage, with qwix (arXiv 2305.14314).
      lora: adds adapters (:class:`LoraConfig`); split them out with :func:`split_lora`.
      adapter_dtype: the adapters' dtype (default float32).
      remat: gradient checkpointing per block (see :class:`Transformer`).
      mesh: not yet supported (``None`` only: the default device).

    Returns:
      The model with every parameter from the checkpoint (and initial adapters).

    Raises:
      ValueError: no such directory, an unsupported architecture, a tensor missing from the
        files, a tensor whose shape differs from the model's (each named), an unknown
        ``quantize``, or a ``mesh``.
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {root} does not exist")
    check_quantize(quantize)
    if mesh is not None:
        raise ValueError("mesh= is not supported yet (None only)")
    cfg = TransformerConfig.from_hf(root)
    param_dtype = dtype if param_dtype is None else param_dtype
    files = _tensor_files(root)

    def build():
        # qwix creates the adapters in a first call, which must not run inside a recomputed
        # block: remat is switched on after (it is read at call time only)
        model = Transformer(cfg, nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype)
        if lora is not None or quantize is not None:
            model = _wrap(model, lora, quantize)
        model.remat = bool(remat)
        return model

    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    # one entry per checkpoint tensor: the model path of the weight (a quantised kernel's
    # leaves sit under <kernel>/array/...)
    wanted: dict[tuple, tuple] = {}
    for p, var in flat:
        p = tuple(p)
        if isinstance(var, nnx.LoRAParam):
            continue
        if "array" in p:
            p = p[: p.index("array")]
        if p in wanted:
            continue
        name, transposed = hf_name(p)
        if name not in files:
            raise ValueError(f"tensor {name} (for {'.'.join(map(str, p))}) is missing from the checkpoint in {root}")
        wanted[p] = (name, transposed)
    from safetensors import safe_open

    by_file: dict[Path, list] = {}
    for p, item in wanted.items():
        by_file.setdefault(files[item[0]], []).append((p, *item))
    shapes = {tuple(p): tuple(v.get_value().shape) for p, v in flat}
    values: dict[tuple, Any] = {}
    jitted: dict = {}
    for file, items in by_file.items():
        if not file.is_file():
            raise ValueError(f"{file} (listed in {INDEX}) does not exist")
        with safe_open(str(file), framework="numpy") as f:
            for p, name, transposed in items:
                shape = tuple(f.get_slice(name).get_shape())
                quantized = p not in shapes
                want = shapes[p + ("array", "qvalue")] if quantized else shapes[p]
                got = shape[::-1] if transposed else shape
                if got != want:
                    raise ValueError(
                        f"tensor {name} has shape {list(shape)}, the model needs "
                        f"{list(want[::-1] if transposed else want)} (config.json and weights disagree)"
                    )
                # one host copy of this tensor (numpy, cast and transposed in place of the
                # memory-mapped bytes), then one device copy; the host copy is dropped at once
                t = np.ascontiguousarray(f.get_tensor(name).T if transposed else f.get_tensor(name), dtype=param_dtype)
                if quantized:
                    values.update(_quantized_leaves(abstract, p, jax.device_put(t), jitted))
                else:
                    values[p] = jax.device_put(t)
                del t
    for p, var in flat:
        p = tuple(p)
        if isinstance(var, nnx.LoRAParam):
            var.set_value(jnp.zeros(var.get_value().shape, adapter_dtype))
        else:
            var.set_value(values[p])
    state = nnx.from_flat_state(flat)
    if lora is not None:
        init_adapters(state, lora.seed)
    return nnx.merge(graphdef, state)


def _quantized_leaves(abstract: Any, path: tuple, weight: jax.Array, cache: dict) -> dict[tuple, jax.Array]:
    """Quantises one kernel ``(in, out)`` the way the abstract qwix model stores it: jitted
    (one program per shape and format, shared by every layer), so that no full-size temporary
    of the eager ops is held beside the tensor."""
    import qwix

    node = abstract
    for k in path:
        node = node[k] if isinstance(k, int) else getattr(node, str(k))
    key = (tuple(weight.shape), str(weight.dtype), repr(getattr(node, "how", None)))
    if key not in cache:

        def quantize(w, path=path):
            tree: dict = {}
            leaf = tree
            for k in path[:-1]:
                leaf = leaf.setdefault(k, {})
            leaf[path[-1]] = w
            out = qwix.quantize_params(tree, abstract)
            for k in path:
                out = out[k]
            arr = out["array"] if isinstance(out, dict) else out.array
            if not isinstance(arr, dict):
                arr = {f.name: getattr(arr, f.name) for f in dataclasses.fields(arr)}
            return {k: v for k, v in arr.items() if isinstance(v, jax.Array)}

        cache[key] = jax.jit(quantize)
    return {path + ("array", k): v for k, v in cache[key](weight).items()}


def save_pretrained(model: Transformer, path: str | Path) -> Path:
    """Writes ``model`` as a Hugging Face checkpoint directory (``config.json`` and one
    ``model.safetensors``) that ``transformers`` loads.

    Returns:
      the directory. Raises ValueError if ``path`` exists and is not an empty directory.
    """
    from safetensors.flax import save_file

    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"{root} exists and is not an empty directory")
    root.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transposed = hf_name(p)
        a = var.get_value()
        tensors[name] = jnp.asarray(a.T if transposed else a)
    save_file(tensors, str(root / SINGLE), metadata={"format": "pt"})
    (root / "config.json").write_text(
        json.dumps(hf_config(cfg, dtype=str(jax.tree.leaves(tensors)[0].dtype)), indent=2)
    )
    return root


def hf_config(cfg: TransformerConfig, dtype: str = "float32") -> dict:
    """``cfg`` as a Hugging Face ``config.json`` dict."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    out = {
        "architectures": [arch.get(cfg.model_type, "Qwen3ForCausalLM")],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    return out
