"""How much device memory one LoRA / QLoRA fine-tuning peer needs, without allocating any.

Parameters and optimizer state come from ``jax.eval_shape`` of the real objects (the qwix
model, ``rj.diloco(optax.adamw)``'s state), counted at their storage width (int4: half a byte):
``f(1) + (layers - 1) * (f(2) - f(1))`` from one and two layers, exact (every layer is the
same; tested against ``eval_shape`` of the whole model). Activations come from XLA itself: the
library's training step (:func:`make_train_step`, the step the example runs: bf16 compute,
chunked cross-entropy, remat, micro-batches, donation, the attention the model will run, with
the same knobs) is compiled (not run) for ``jax.ShapeDtypeStruct`` inputs at the real width,
depth, batch and sequence length, and the temporary bytes XLA plans for it
(``compiled.memory_analysis()``) are taken.

The model is the one ``load_pretrained`` builds by default: the blocks stacked under one
``jax.lax.scan`` (``scan_layers=True``): one layer wrapped by qwix and stacked, its stacked
leaves given the real depth (the same step as the model loaded, byte for byte: tested), so the
whole depth is compiled in seconds and the plan is the step's own analysis
(``benchmarks/validate_memory_plan.py`` compares it with a step built separately, qwix over
every layer). With ``scan_layers=False`` (the unrolled model of a pipeline stage; tracing
it costs time quadratic in depth) the activations are extrapolated linearly from 3 and 4
layers: XLA's plan grows by the same bytes with every layer from the third on.

The plan is XLA's **CPU** plan. With ``remat=True`` (the default) each block is recomputed in
the backward pass, so the step holds every block's input (the scan's saved carry, bfloat16),
one block's working set (with ``attention="auto"``, the chunked kernel on CPU for sequences
longer than a chunk: no ``seq x seq`` scores) and one chunk of the cross-entropy's float32
logits and their gradient. On CPU the step compiles with XLA's loop-invariant code motion off
(:func:`~ravnest_jax.models._step.loop_compiler_options`; with it, XLA converted the whole
stacked int4 kernels to int8 and the saved block inputs to float32 outside the loops: 16.05
instead of 6.17 GiB for Llama 3.1 8B int4 at 4 x 2048). XLA on CPU still computes bfloat16
matmuls in float32 and makes float32 copies of the bfloat16 weights it multiplies (for Llama
3.1 8B the output head's, 1.96 GiB, is the largest) and float32 matmul outputs: a GPU, which
multiplies bfloat16 natively, makes none, so for a GPU the plan is an upper bound. See
docs/finetuning.md for the figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._config import TransformerConfig
from ._hf import adapter_sharding, base_sharding, batch_sharding, split_axis
from ._lora import LoraConfig, _trainable, _wrap, check_quantize
from ._memory import allocator_pool_bytes, nbytes
from ._step import adapter_layouts, check_attention, check_remat
from ._transformer import Transformer

GIB = 1024**3
#: the share of the allocator's pool a plan leaves free (fragmentation) in :meth:`MemoryPlan.fits`
POOL_RESERVE = 0.05

#: shapes of well-known checkpoints (their config.json values that matter here)
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "llama-3.1-70b": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, qk_norm=True,
    ),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A peer's device bytes, by part.

    Attributes:
      base: the frozen model (quantised projections at their bit width, the frozen ``A``).
      adapters: the trainable adapters (float32).
      optimizer: AdamW's two moments and step count over the adapters.
      outer: ``rj.diloco``'s anchor (global adapters) and outer momentum.
      activations: XLA's temporary buffers of one training step (forward, backward, update),
        as XLA on CPU plans them (an upper bound for a GPU: see the module docstring).
      adapter_params: the number of trainable parameters.
      base_params: the number of parameters of the base.
      devices: the peer's devices; with more than one, every byte figure is one device's
        (FSDP layout, batch split).
    """

    base: int
    adapters: int
    optimizer: int
    outer: int
    activations: int
    adapter_params: int
    base_params: int
    devices: int = 1

    @property
    def total(self) -> int:
        return self.base + self.adapters + self.optimizer + self.outer + self.activations

    def fits(self, device_bytes: int, *, env: Mapping[str, str] = os.environ, reserve: float = POOL_RESERVE) -> bool:
        """Whether the total stays within ``1 - reserve`` of the pool JAX's allocator may use on
        a card of ``device_bytes`` (:func:`~ravnest_jax.models._memory.allocator_pool_bytes`
        under ``env``: 0.75 of the card by default, ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.9`` raises
        it). ``reserve`` (default 5%) is left for the allocator's fragmentation; the CUDA
        context lives outside the pool (in the card's rest) unless the platform allocator
        takes the whole card."""
        return self.total <= (1 - reserve) * allocator_pool_bytes(device_bytes, env)

    def table(self) -> str:
        rows = [
            ("base (frozen)", self.base),
            ("adapters", self.adapters),
            ("optimizer (AdamW)", self.optimizer),
            ("anchor + outer momentum", self.outer),
            ("activations (one step)", self.activations),
            ("total", self.total),
        ]
        part = "part" if self.devices == 1 else f"one of {self.devices} devices"
        out = [f"{part:<26}{'bytes':>16}{'GiB':>10}"]
        out += [f"{name:<26}{b:>16,}{b / GIB:>10.2f}" for name, b in rows]
        out.append(
            f"trainable parameters: {self.adapter_params:,} of {self.base_params:,} ({self.adapter_fraction:.3%})"
        )
        return "\n".join(out)

    @property
    def adapter_fraction(self) -> float:
        return self.adapter_params / max(self.base_params, 1)

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def _bytes(tree: Any) -> int:
    """Device bytes of ``tree`` at the widths measured on this process's backend
    (:func:`~ravnest_jax.models._memory.nbytes`; int4 as the device stores it)."""
    return nbytes(tree)


def _count(tree: Any) -> int:
    return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)))


def load_config(config: str | Path | TransformerConfig) -> TransformerConfig:
    """A :class:`TransformerConfig` from a ``config.json`` path, a checkpoint directory, a
    :data:`PRESETS` name, or as given.

    Raises:
      ValueError: none of those, or the config is not a supported architecture.
    """
    if isinstance(config, TransformerConfig):
        return config
    if str(config) in PRESETS:
        return TransformerConfig(**PRESETS[str(config)])
    path = Path(config)
    if path.is_dir() or path.is_file():
        return TransformerConfig.from_hf(path)
    raise ValueError(f"--config {config}: no such file or directory, and not a preset ({', '.join(PRESETS)})")


def _abstract(
    cfg: TransformerConfig,
    lora: LoraConfig,
    quantize: str | None,
    dtype: Any,
    remat: Any = False,
    mesh: Any = None,
    *,
    scan_layers: bool = False,
):
    """The qwix model's graph, adapters and frozen rest as shapes, built the way
    ``load_pretrained(..., mesh=mesh, scan_layers=scan_layers)`` builds them: qwix applied to the
    per-layer model, then (``scan_layers``) its state stacked (:func:`stack_layers`), laid out on
    ``mesh`` (stacked leaves with the layer axis whole)."""
    from flax import nnx

    from ._scan import is_stacked, stack_layers

    def build():
        model = _wrap(Transformer(cfg, nnx.Rngs(0), dtype=dtype, param_dtype=dtype), lora, quantize)
        model.remat = check_remat(remat)  # after qwix's first call (it creates the adapters; not under remat)
        model.batch_sharding = batch_sharding(mesh)
        return model

    if scan_layers:
        # every layer is the same: one layer wrapped by qwix and stacked, its stacked leaves
        # given the real depth (tracing qwix over every layer costs time quadratic in depth)
        one = cfg
        cfg = dataclasses.replace(cfg, num_hidden_layers=1)
        model = stack_layers(nnx.eval_shape(build))
        flat = nnx.to_flat_state(nnx.state(model.layers))
        for _, var in flat:
            v = var.get_value()
            if isinstance(v, jax.ShapeDtypeStruct):
                var.set_value(jax.ShapeDtypeStruct((one.num_hidden_layers, *v.shape[1:]), v.dtype))
        nnx.update(model.layers, nnx.from_flat_state(flat))
        model.config = cfg = one
    else:
        model = nnx.eval_shape(build)
    graphdef, adapters, frozen = nnx.split(model, _trainable(lora), ...)
    adapters = nnx.from_flat_state(
        [(p, v.replace(jax.ShapeDtypeStruct(v.get_value().shape, jnp.float32))) for p, v in nnx.to_flat_state(adapters)]
    )
    if mesh is not None:
        flat = nnx.to_flat_state(adapters)
        for p, var in flat:
            v = var.get_value()
            var.set_value(_on(v, adapter_sharding(mesh, v.shape, stacked=is_stacked(tuple(p)))))
        adapters = nnx.from_flat_state(flat)
        flat = nnx.to_flat_state(frozen)
        for p, var in flat:
            v = var.get_value()
            layout = adapter_sharding if _is_lora(tuple(p)) else base_sharding
            var.set_value(_on(v, layout(mesh, v.shape, stacked=is_stacked(tuple(p)))))
        frozen = nnx.from_flat_state(flat)
    return graphdef, adapters, frozen


def _on(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _is_lora(path: tuple) -> bool:
    return str(path[-1]).endswith(("_lora_a", "_lora_b"))


def abstract_step(
    cfg: TransformerConfig,
    lora: LoraConfig,
    quantize: str | None,
    dtype: Any,
    batch: int,
    seq_len: int,
    remat: Any = True,
    mesh: Any = None,
    *,
    attention: str | None = None,
    loss_chunk: int = 1024,
    micro_batches: int = 1,
    scan_layers: bool = True,
) -> Any:
    """:func:`~ravnest_jax.models.make_train_step` of ``cfg``'s LoRA model with
    ``rj.diloco(optax.adamw)``, lowered (not compiled) for ``jax.ShapeDtypeStruct`` inputs: the
    adapters, their optimizer state, the frozen base and a :class:`TokenBatch` of ``(batch,
    seq_len)`` (a device's, on ``mesh``: the FSDP layout of ``load_pretrained(..., mesh=)``, the
    batch split), the blocks stacked under one scan as ``load_pretrained`` loads them
    (``scan_layers``, default) or unrolled. ``.compile().memory_analysis()`` is XLA's plan of the
    step that trains."""
    import optax

    from ..optim import diloco
    from ._lora import LoraModel
    from ._step import TokenBatch, make_train_step

    graphdef, adapters, frozen = _abstract(cfg, lora, quantize, dtype, remat, mesh, scan_layers=scan_layers)
    lm = LoraModel(graphdef, adapters, frozen, lora, graphdef if lora.dropout > 0 else None)
    tx = diloco(optax.adamw(1e-4), sync_every=100)
    step = make_train_step(
        lm, tx, micro_batches=micro_batches, loss_chunk=loss_chunk, remat=remat, attention=attention, dtype=dtype
    )
    state = jax.eval_shape(tx.init, adapters)
    row = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    if mesh is not None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        row = _on(row, NamedSharding(mesh, P(tuple(mesh.axis_names))))
        # the optimizer state as init_opt_state lays it out: like the adapters, counters replicated
        state = jax.tree.map(_on, state, adapter_layouts(mesh, state))
    mask = jax.ShapeDtypeStruct(row.shape, jnp.float32, sharding=row.sharding)
    tokens = TokenBatch(row, row, mask, row, row)
    return step.lower(adapters, state, frozen, tokens, jax.ShapeDtypeStruct((), jnp.int32))


def step_memory(compiled: Any) -> dict[str, int]:
    """XLA's memory analysis of a compiled step: ``temp`` (the activations of :class:`MemoryPlan`),
    ``arguments``, ``outputs``, ``aliased`` (donated outputs written over their inputs) and
    ``total = arguments + temp + outputs - aliased`` (bytes, a device's)."""
    m = compiled.memory_analysis()
    out = {
        "temp": int(m.temp_size_in_bytes),
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "aliased": int(m.alias_size_in_bytes),
    }
    out["total"] = out["arguments"] + out["temp"] + out["outputs"] - out["aliased"]
    return out


def _step_temp_bytes(
    cfg: TransformerConfig,
    lora: LoraConfig,
    quantize: str | None,
    dtype: Any,
    batch: int,
    seq_len: int,
    remat: Any,
    mesh: Any = None,
    **knobs: Any,
) -> int:
    """XLA's temporary bytes for the compiled (not run) training step of ``cfg``
    (:func:`abstract_step`)."""
    compiled = abstract_step(cfg, lora, quantize, dtype, batch, seq_len, remat, mesh, **knobs).compile()
    return step_memory(compiled)["temp"]


def _static_bytes(
    cfg: TransformerConfig, lora: LoraConfig, quantize: str | None, dtype: Any, devices: int = 1
) -> dict[str, int]:
    """Parameter and optimizer bytes (a device's, laid out FSDP-style over ``devices``) and
    parameter counts of the whole ``cfg`` (``jax.eval_shape``)."""
    import optax

    from ..optim import diloco

    _, adapters, frozen = _abstract(cfg, lora, quantize, dtype)
    state = jax.eval_shape(diloco(optax.adamw(1e-4), sync_every=100).init, adapters)
    # the frozen A are adapter machinery and the scales of quantised kernels storage details,
    # not parameters of the model
    not_model = sum(
        _count(v)
        for p, v in _flat(frozen)
        if str(p[-1]).endswith("_lora_a") or ("array" in map(str, p) and str(p[-1]) != "qvalue")
    )

    def shard(x: Any, last_first: bool) -> Any:  # one device's part of x
        axis = split_axis(tuple(x.shape), devices, last_first=last_first)
        if axis is None:
            return x
        shape = list(x.shape)
        shape[axis] //= devices
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    def per_device(tree: Any, last_first: bool = False) -> int:
        return _bytes(jax.tree.map(lambda x: shard(x, last_first), tree))

    base = sum(_bytes(shard(v, last_first=not _is_lora(tuple(p)))) for p, v in _flat(frozen))
    return {
        "base": base,
        "adapters": per_device(adapters),
        "optimizer": per_device(state.inner_state),
        "outer": per_device(state.global_params) + per_device(state.outer_state),
        "adapter_params": _count(adapters),
        "base_params": _count(frozen) - not_model,
    }


def by_layers(fn: Any, cfg: TransformerConfig, first: int = 1) -> dict[str, int]:
    """``fn(config)`` (a dict of ints) for ``cfg``, from ``cfg`` cut to ``first`` and to
    ``first + 1`` layers: ``f(first) + (layers - first) * (f(first + 1) - f(first))`` (every
    layer is the same); ``fn(cfg)`` itself when ``cfg`` has no more than ``first + 1`` layers."""
    layers = cfg.num_hidden_layers
    if layers <= first + 1:
        return fn(cfg)
    a = fn(dataclasses.replace(cfg, num_hidden_layers=first))
    b = fn(dataclasses.replace(cfg, num_hidden_layers=first + 1))
    return {k: a[k] + (layers - first) * (b[k] - a[k]) for k in a}


def plan_memory(
    config: str | Path | TransformerConfig,
    *,
    lora: LoraConfig | None = None,
    quantize: str | None = None,
    batch: int = 1,
    seq_len: int = 2048,
    dtype: str = "bfloat16",
    remat: bool | str = True,
    devices: int = 1,
    attention: str | None = None,
    loss_chunk: int = 1024,
    micro_batches: int = 1,
    scan_layers: bool = True,
) -> MemoryPlan:
    """A peer's device bytes for LoRA (QLoRA with ``quantize``) fine-tuning with ``rj.diloco``
    over AdamW, computed without allocating (see the module docstring for how): under a minute
    on 2 CPU cores for the scanned model, whatever the depth.

    Args:
      config: a ``config.json``, a checkpoint directory, a :data:`PRESETS` name or a
        :class:`TransformerConfig`.
      lora: the adapters (default ``LoraConfig()``: rank 16 on every projection, ``A`` and
        ``B`` trained).
      quantize: None, ``"int8"`` or ``"int4"``: the frozen base's storage.
      batch, seq_len: sequences per step and tokens per sequence.
      dtype: ``"bfloat16"`` or ``"float32"``: compute and unquantised parameter dtype.
      remat: recompute each block in the backward pass (``load_pretrained(..., remat=True)``),
        the default (True or ``"full"``; ``"dots"``, ``"offload"``: the model's policies;
        False or ``"none"``: every block's activations, and a quantised base's dequantised
        weights, are kept for the backward pass).
      devices: a peer's local devices: with more than one, the bytes of one device when the
        base and adapters lie FSDP-style over all of them (``load_pretrained(..., mesh=)``)
        and the batch is split over them; the step is compiled for that many CPU devices,
        which the process must have (``jax.config.update("jax_num_cpu_devices", n)`` before
        any jax use; the command does it).
      attention: ``model.attention`` (``"auto"``, ``"cudnn"``, ``"chunked"``, ``"xla"``) where
        the model has it; None: the model's default, ``"auto"``, which on this CPU plan is
        the chunked kernel for sequences longer than one chunk (256 tokens), XLA's otherwise
        (a GPU's ``"auto"`` runs cuDNN's flash attention: plan ``"chunked"`` as its bound).
      loss_chunk: positions per chunk of the chunked cross-entropy (``make_train_step``).
      micro_batches: gradient-accumulation slices of the batch (``make_train_step``); the
        batch must divide by ``micro_batches x devices``.
      scan_layers: the blocks stacked under one ``jax.lax.scan`` (``load_pretrained``'s
        default): the whole depth is compiled. False: the unrolled model
        (``load_pretrained(..., scan_layers=False)``, a pipeline stage's), its activations
        extrapolated from 3 and 4 layers.

    Returns:
      a :class:`MemoryPlan` (bytes; a device's).

    Raises:
      ValueError: a bad config path, ``quantize``, ``dtype``, ``batch``, ``seq_len``,
        ``remat``, ``attention``, ``loss_chunk``, ``micro_batches`` or ``devices`` (``batch``
        must be a multiple of ``micro_batches x devices``), or fewer CPU devices than
        ``devices``.
    """
    cfg = load_config(config)
    lora = lora or LoraConfig()
    check_quantize(quantize)
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    for name, v in (("batch", batch), ("seq_len", seq_len)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    for name, v in (("devices", devices), ("loss_chunk", loss_chunk), ("micro_batches", micro_batches)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if batch % devices:
        raise ValueError(f"batch ({batch}) must be a multiple of devices ({devices}): the batch is split over them")
    if batch % (micro_batches * devices):
        raise ValueError(
            f"batch ({batch}) must be a multiple of micro_batches x devices ({micro_batches} x {devices}): "
            "each micro-batch is split over the devices"
        )
    remat, attention = check_remat(remat), check_attention(attention)
    mesh = None
    if devices > 1:
        from jax.sharding import AxisType

        cpus = jax.devices("cpu")
        if len(cpus) < devices:
            raise ValueError(
                f"devices={devices}: this process has {len(cpus)} CPU devices to plan with; call "
                f'jax.config.update("jax_num_cpu_devices", {devices}) before any jax use'
            )
        mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,), devices=cpus[:devices])
    jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    static = by_layers(lambda c: _static_bytes(c, lora, quantize, jdtype, devices), cfg)

    def temp(c: TransformerConfig) -> dict[str, int]:
        knobs = dict(attention=attention, loss_chunk=loss_chunk, micro_batches=micro_batches, scan_layers=scan_layers)
        return {"activations": _step_temp_bytes(c, lora, quantize, jdtype, batch, seq_len, remat, mesh, **knobs)}

    # scanned (the default, as load_pretrained loads): the whole depth is compiled, one loop
    # body whatever the depth (seconds to a minute), so the plan is the step's own analysis.
    # Unrolled: tracing costs time quadratic in depth, so the activations are extrapolated from
    # 3 and 4 layers (XLA's plan grows by the same bytes with every layer from the third on:
    # one block's input; within 0.1% of the compiled 32-layer step of Llama 3.1 8B at 4 x 2048)
    act = temp(cfg) if scan_layers else by_layers(temp, cfg, first=3)
    return MemoryPlan(**static, activations=act["activations"], devices=devices)


def _flat(state: Any) -> list:
    from flax import nnx

    return [(p, v.get_value() if hasattr(v, "get_value") else v) for p, v in nnx.to_flat_state(state)]


def plan_json(plan: MemoryPlan, **meta: Any) -> str:
    return json.dumps({**meta, **plan.as_dict()})
