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
from ._files import default_mode
from ._hf_names import hf_name as hf_name
from ._lora import LoraConfig, _wrap, check_quantize, init_adapters
from ._remat import check_remat
from ._scan import stack_layers, unstack_layers
from ._transformer import Transformer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


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
    remat: bool | str = True,
    mesh: Any = None,
    scan_layers: bool = True,
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
      remat: gradient checkpointing per block, a policy of :data:`REMAT` (default True,
        ``"full"``: recompute each block in the backward pass; ``"dots"``, ``"offload"``,
        False; see :class:`Transformer` and docs/memory-and-compile.md).
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
      scan_layers: store the blocks stacked and run them under one ``jax.lax.scan`` (default;
        compile time flat in depth, :func:`stack_layers`): loaded per layer, then stacked leaf
        by leaf (peak: the model plus one leaf's stack). False: an ``nnx.List`` of blocks.
    """
    check_remat(remat)
    ck = open_checkpoint(
        path,
        dtype=dtype,
        param_dtype=param_dtype,
        quantize=quantize,
        lora=lora,
        adapter_dtype=adapter_dtype,
        remat=remat,
        mesh=mesh,
    )
    (state,) = ck.fill(ck.state)
    model = nnx.merge(ck.graphdef, state)
    del state
    return stack_layers(model) if scan_layers else model


class OpenCheckpoint:
    """A checkpoint directory opened for loading: the abstract model (``jax.ShapeDtypeStruct``
    leaves, adapters in ``adapter_dtype``), the checkpoint tensor of each of its weights, every
    header checked. :meth:`fill` reads the tensors of any part of the model's state.

    Attributes:
      root: the directory.
      graphdef, state: the abstract model, ``nnx.split``; ``state``'s leaves are
        ``jax.ShapeDtypeStruct`` (never arrays: :meth:`fill` works on copies).
      wanted: the path of each checkpoint weight in the model (a quantised kernel's path, without
        its ``array/...`` leaves) -> ``(tensor name, stored transposed)``.
      files: tensor name -> the safetensors file listed for it (it may be absent when opened with
        ``require_files=False``).
      missing: the listed files that do not exist (only with ``require_files=False``).
    """

    def __init__(
        self,
        root: Path,
        graphdef: Any,
        state: Any,
        wanted: dict,
        files: dict,
        missing: set,
        *,
        param_dtype: Any,
        lora: LoraConfig | None,
        mesh: Any,
    ):
        self.root, self.graphdef, self.state = root, graphdef, state
        self.wanted, self.files, self.missing = wanted, files, missing
        self.param_dtype, self.lora, self.mesh = param_dtype, lora, mesh
        self.shapes = {tuple(p): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(state)}
        self._jitted: dict = {}  # the quantisers, one per shape, shared by every fill

    def model(self) -> Transformer:
        """The abstract model (a new graph; its leaves ``jax.ShapeDtypeStruct``)."""
        return nnx.merge(self.graphdef, _copy(self.state))

    def tensors_of(self, state: Any) -> list[tuple]:
        """The checkpoint weights (keys of :attr:`wanted`) that the leaves of ``state`` (a part
        of the model's state, paths as in the whole model) need, in state order."""
        out: dict[tuple, None] = {}
        for p, var in nnx.to_flat_state(state):
            p = tuple(p)
            if isinstance(var, nnx.LoRAParam):
                continue
            out[p[: p.index("array")] if "array" in p else p] = None
        return list(out)

    def fill(self, *states: Any, missing: Any = None) -> tuple:
        """Copies of ``states`` (abstract parts of the model's state, paths as in the whole
        model) with arrays: each weight read from its file (cast, transposed, quantised and laid
        out as :func:`load_pretrained` does) and the adapters at their initial values
        (``init_adapters``: keyed by path, so equal to a whole load's).

        Args:
          missing: ``missing(file) -> str``, the message when a file the states need does not
            exist (default: the file is named).

        Raises:
          ValueError: a file the states need does not exist (before any tensor is read).
        """
        need = list(dict.fromkeys(w for s in states for w in self.tensors_of(s)))
        values = self._read(need, missing)
        out = []
        for s in states:
            flat = nnx.to_flat_state(_copy(s))
            for p, var in flat:
                if not isinstance(var, nnx.LoRAParam):
                    var.set_value(values[tuple(p)])
            s = nnx.from_flat_state(flat)
            if self.lora is not None:
                init_adapters(s, self.lora.seed, sharding=None if self.mesh is None else self._adapter_sharding)
            out.append(s)
        return tuple(out)

    def _adapter_sharding(self, shape: tuple) -> Any:
        return adapter_sharding(self.mesh, shape)

    def _read(self, weights: list[tuple], missing: Any = None) -> dict[tuple, Any]:
        """The leaves of ``weights`` (keys of :attr:`wanted`): path -> array (a quantised
        kernel's ``array/...`` leaves)."""
        from safetensors import safe_open

        by_file: dict[Path, list] = {}
        for p in weights:
            name, transposed = self.wanted[p]
            by_file.setdefault(self.files[name], []).append((p, name, transposed))
        for file in by_file:
            if not file.is_file():
                raise ValueError(missing(file) if missing else f"{file} (listed in {INDEX}) does not exist")
        values: dict[tuple, Any] = {}
        abstract = None
        for file, items in by_file.items():
            for p, name, transposed in items:
                quantized = p not in self.shapes
                shape = self.shapes[p + ("array", "qvalue")] if quantized else self.shapes[p]
                # the file is mapped for one tensor at a time: the pages read count in the
                # process's RSS until it is unmapped (a whole shard's otherwise)
                with safe_open(str(file), framework="numpy") as f:
                    w = _read(f, name, transposed, shape, self.param_dtype, base_sharding(self.mesh, shape))
                if quantized:
                    abstract = self.model() if abstract is None else abstract
                    values.update(_quantized_leaves(abstract, p, w, self._jitted, self.mesh))
                else:
                    values[p] = w
                del w
        return values


def _copy(state: Any) -> Any:
    """A new ``nnx.State`` with new variables over the same values."""
    return nnx.from_flat_state([(p, var.replace(var.get_value())) for p, var in nnx.to_flat_state(state)])


def open_checkpoint(
    path: str | Path,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = None,
    quantize: str | None = None,
    lora: LoraConfig | None = None,
    adapter_dtype: Any = jnp.float32,
    remat: bool | str = True,
    mesh: Any = None,
    dropout: bool = True,
    require_files: bool = True,
) -> OpenCheckpoint:
    """Opens the checkpoint at ``path`` for :func:`load_pretrained` (same arguments) without
    reading a tensor: builds the abstract model (per layer: ``load_pretrained`` stacks it after
    :meth:`OpenCheckpoint.fill` when it scans), maps each weight to its tensor and checks every
    header against the model's shapes.

    Args:
      dropout: the graph with the adapters' dropout (False: the evaluation graph, as
        ``split_lora``'s ``graphdef``).
      require_files: False: a file listed in the index but absent is no error here (only where
        :meth:`OpenCheckpoint.fill` needs it); its headers are not checked.

    Raises:
      ValueError: as :func:`load_pretrained`.
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {root} does not exist")
    check_quantize(quantize)
    remat = check_remat(remat)
    check_mesh(mesh)
    cfg = TransformerConfig.from_hf(root)
    param_dtype = dtype if param_dtype is None else param_dtype
    files = _tensor_files(root)

    def build():
        # qwix creates the adapters in a first call, which must not run inside a recomputed
        # block: remat is switched on after (it is read at call time only)
        model = Transformer(cfg, nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype)
        if lora is not None or quantize is not None:
            model = _wrap(model, lora, quantize, dropout=dropout)
        model.remat = remat
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
            var.set_value(jax.ShapeDtypeStruct(var.get_value().shape, adapter_dtype))
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
    missing = set()
    # every file and every shape is checked (headers only) before anything is read
    for file, items in by_file.items():
        if not file.is_file():
            if require_files:
                raise ValueError(f"{file} (listed in {INDEX}) does not exist")
            missing.add(file)
            continue
        with safe_open(str(file), framework="numpy") as f:
            for p, name, transposed in items:
                shape = tuple(f.get_slice(name).get_shape())
                want = shapes[p + ("array", "qvalue")] if p not in shapes else shapes[p]
                if (shape[::-1] if transposed else shape) != want:
                    raise ValueError(
                        f"tensor {name} has shape {list(shape)}, the model needs "
                        f"{list(want[::-1] if transposed else want)} (config.json and weights disagree)"
                    )
    state = nnx.from_flat_state(flat)
    return OpenCheckpoint(root, graphdef, state, wanted, files, missing, param_dtype=param_dtype, lora=lora, mesh=mesh)


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


def _split(mesh: Any, shape: tuple, last_first: bool, stacked: bool = False) -> Any:
    if stacked:  # a scanned model's leaf: the layer axis stays whole, the rest as one layer's
        inner = _split(mesh, tuple(shape[1:]), last_first)
        return inner if inner.spec == P() else NamedSharding(mesh, P(None, *inner.spec))
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


def base_sharding(mesh: Any, shape: tuple, *, stacked: bool = False) -> Any:
    """Where a frozen tensor of ``shape`` lies on ``mesh`` (FSDP-style): split over all the
    mesh's devices along its last axis that divides by their number (a kernel ``(in, out)``:
    the outputs), replicated when none does; ``None`` without a mesh. ``stacked``: a scanned
    model's leaf ``(layers, ...)``: the layer axis is never split, the rest as one layer's."""
    if mesh is None:
        return None
    return _split(mesh, shape, last_first=True, stacked=stacked)


def adapter_sharding(mesh: Any, shape: tuple, *, stacked: bool = False) -> Any:
    """Where an adapter (or anything shaped like one: its optimizer moments, anchor, outer
    momentum) of ``shape`` lies on ``mesh``: split along its first axis that divides by the
    number of devices (whole rows: the blocks of a round's codec stay on one device,
    docs/multi-device.md), replicated when none does; ``None`` without a mesh. ``stacked``: a
    scanned model's adapter ``(layers, ...)``: the layer axis is never split."""
    if mesh is None:
        return None
    return _split(mesh, shape, last_first=False, stacked=stacked)


def save_pretrained(model: Transformer, path: str | Path) -> Path:
    """Writes ``model`` as a Hugging Face checkpoint directory (``config.json`` and one
    ``model.safetensors``) that ``transformers`` loads. A scanned model's stacked leaves are
    written layer by layer (``model.layers.<i>...``); ``model`` is not changed.

    Returns:
      the directory. Raises ValueError if ``path`` exists and is not an empty directory.
    """
    from safetensors.flax import save_file

    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"{root} exists and is not an empty directory")
    root.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    if model.scan_layers:  # per-layer views of a copy of the graph: the model keeps its form
        model = unstack_layers(nnx.clone(model))
    tensors = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transposed = hf_name(p)
        a = var.get_value()
        tensors[name] = jnp.asarray(a.T if transposed else a)
    save_file(tensors, str(root / SINGLE), metadata={"format": "pt"})
    default_mode(root / SINGLE)  # safetensors writes 0600
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
