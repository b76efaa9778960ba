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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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
    and placed before the next is read: the unquantised model never exists in memory. With a
    ``mesh`` each tensor is read one device shard at a time.

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
      mesh: None (the default device), or a ``jax.sharding.Mesh`` of this process's devices
        with automatic axes: the peer's devices. Every tensor is laid out FSDP-style over all
        the mesh's devices: a frozen one split along its last axis whose size divides by the
        number of devices (a kernel ``(in, out)``: its outputs, so each device quantises its
        own columns), an adapter along its first (:func:`base_sharding`,
        :func:`adapter_sharding`); replicated when no axis divides. Each device's shard is
        read on its own from the memory-mapped file and sent to that device only: no device
        ever holds more than its shard of a split tensor, the host one tensor at a time. XLA
        gathers each weight where a jitted step uses it (docs/multi-device.md).

    Returns:
      The model with every parameter from the checkpoint (and initial adapters).

    Raises:
      ValueError: no such directory, an unsupported architecture, a tensor missing from the
        files, a tensor whose shape differs from the model's (each named; all checked before
        any tensor is read), an unknown ``quantize``, or a ``mesh`` that is not a mesh of this
        process's devices with automatic axes.
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {root} does not exist")
    check_quantize(quantize)
    check_mesh(mesh)
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
        model.batch_sharding = batch_sharding(mesh)
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
    # every file and every shape is checked (headers only) before anything is read
    for file, items in by_file.items():
        if not file.is_file():
            raise ValueError(f"{file} (listed in {INDEX}) does not exist")
        with safe_open(str(file), framework="numpy") as f:
            for p, name, transposed in items:
                shape = tuple(f.get_slice(name).get_shape())
                want = shapes[p + ("array", "qvalue")] if p not in shapes else shapes[p]
                if (shape[::-1] if transposed else shape) != want:
                    raise ValueError(
                        f"tensor {name} has shape {list(shape)}, the model needs "
                        f"{list(want[::-1] if transposed else want)} (config.json and weights disagree)"
                    )
    values: dict[tuple, Any] = {}
    jitted: dict = {}
    for file, items in by_file.items():
        with safe_open(str(file), framework="numpy") as f:
            for p, name, transposed in items:
                quantized = p not in shapes
                shape = shapes[p + ("array", "qvalue")] if quantized else shapes[p]
                w = _read(f, name, transposed, shape, param_dtype, base_sharding(mesh, shape))
                if quantized:
                    values.update(_quantized_leaves(abstract, p, w, jitted, mesh))
                else:
                    values[p] = w
                del w
    for p, var in flat:
        p = tuple(p)
        if isinstance(var, nnx.LoRAParam):
            var.set_value(jax.ShapeDtypeStruct(var.get_value().shape, adapter_dtype))
        else:
            var.set_value(values[p])
    state = nnx.from_flat_state(flat)
    if lora is not None:
        init_adapters(state, lora.seed, sharding=None if mesh is None else lambda shape: adapter_sharding(mesh, shape))
    return nnx.merge(graphdef, state)


def _read(f: Any, name: str, transposed: bool, shape: tuple, dtype: Any, sharding: Any) -> jax.Array:
    """Tensor ``name`` of the open safetensors file ``f`` on the devices, ``shape`` (ours:
    transposed from Hugging Face's ``(out, in)`` when ``transposed``), cast to ``dtype``.

    On one device: one host copy (numpy, cast and transposed in place of the memory-mapped
    bytes), then one device copy; the host copy is dropped at once. Laid out over a mesh: each
    device's shard is read on its own from the memory-mapped file (only its bytes) and cast,
    and each device receives its shard only: the host holds this one tensor's shards for the
    transfer, no device more than its shard (a replicated tensor is read once)."""
    if sharding is None:
        t = f.get_tensor(name)
        return jax.device_put(np.ascontiguousarray(t.T if transposed else t, dtype=dtype))
    part = f.get_slice(name)

    def shard(index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if transposed:
            return np.ascontiguousarray(part[index[::-1]].T, dtype=dtype)
        return np.ascontiguousarray(part[index], dtype=dtype)

    return jax.make_array_from_callback(shape, sharding, shard)


def _quantized_leaves(
    abstract: Any, path: tuple, weight: jax.Array, cache: dict, mesh: Any = None
) -> dict[tuple, jax.Array]:
    """Quantises one kernel ``(in, out)`` the way the abstract qwix model stores it: jitted
    (one program per shape and format, shared by every layer), so that no full-size temporary
    of the eager ops is held beside the tensor. On a mesh the kernel and its quantised leaves
    are split along the outputs (:func:`base_sharding`): the scales are per output column (int8)
    or per tile of inputs and output column (int4), so each device quantises its own columns
    and nothing is gathered."""
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

        if mesh is None:
            cache[key] = jax.jit(quantize)
        else:
            leaves = jax.eval_shape(quantize, jax.ShapeDtypeStruct(weight.shape, weight.dtype))
            cache[key] = jax.jit(
                quantize,
                in_shardings=base_sharding(mesh, weight.shape),
                out_shardings={k: base_sharding(mesh, v.shape) for k, v in leaves.items()},
            )
    return {path + ("array", k): v for k, v in cache[key](weight).items()}


def check_mesh(mesh: Any) -> None:
    """``mesh`` is None or a ``jax.sharding.Mesh`` with automatic axes over this process's
    devices; else ValueError saying what is wrong."""
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if mesh.explicit_axes:
        raise ValueError(
            f"mesh axes {mesh.explicit_axes} are explicit; the model needs automatic axes (XLA gathers each "
            "weight where it is used): jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))"
        )
    here = jax.process_index()
    if any(d.process_index != here for d in mesh.devices.flat):
        raise ValueError("mesh has devices of other processes; load_pretrained takes this process's devices only")


def split_axis(shape: tuple, n: int, *, last_first: bool) -> int | None:
    """The axis of ``shape`` that an FSDP layout over ``n`` devices splits: the last (or first)
    whose size divides by ``n``; None (replicated) when none does or ``n`` is 1."""
    if n <= 1:
        return None
    axes = reversed(range(len(shape))) if last_first else range(len(shape))
    return next((a for a in axes if shape[a] % n == 0), None)


def _split(mesh: Any, shape: tuple, last_first: bool) -> Any:
    axis = split_axis(shape, mesh.size, last_first=last_first)
    if axis is None:
        return NamedSharding(mesh, P())
    spec: list = [None] * len(shape)
    spec[axis] = tuple(mesh.axis_names)
    return NamedSharding(mesh, P(*spec))


def batch_sharding(mesh: Any) -> Any:
    """Activations ``(batch, ...)`` split by batch over all the devices of ``mesh`` (data
    parallelism beside the FSDP weights); ``None`` without a mesh."""
    return None if mesh is None else NamedSharding(mesh, P(tuple(mesh.axis_names)))


def base_sharding(mesh: Any, shape: tuple) -> Any:
    """Where a frozen tensor of ``shape`` lies on ``mesh`` (FSDP-style): split over all the
    mesh's devices along its last axis that divides by their number (a kernel ``(in, out)``:
    the outputs), replicated when none does; ``None`` without a mesh."""
    if mesh is None:
        return None
    return _split(mesh, shape, last_first=True)


def adapter_sharding(mesh: Any, shape: tuple) -> Any:
    """Where an adapter (or anything shaped like one: its optimizer moments, anchor, outer
    momentum) of ``shape`` lies on ``mesh``: split along its first axis that divides by the
    number of devices (whole rows: the blocks of a round's codec stay on one device,
    docs/multi-device.md), replicated when none does; ``None`` without a mesh."""
    if mesh is None:
        return None
    return _split(mesh, shape, last_first=False)


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
