"""LoRA and QLoRA on the :class:`Transformer`, with qwix: low-rank adapters on chosen projections,
the frozen base optionally quantised to int8, int4 or nf4.

Why qwix (Google's JAX quantisation library) and not ``flax.nnx.LoRA``: qwix's ``LoraProvider``
adds adapters to the model's existing ``nnx.Linear`` layers by intercepting their
``dot_general`` (no module surgery), has the LoRA scale ``alpha / rank`` and dropout, and
quantises the frozen base in the same pass (its PTQ path: int8, int4 or nf4 weights with
per-channel or per-tile scales, dequantised inside the matmul), which is QLoRA. ``nf4`` is
QLoRA's NormalFloat4: 16 levels at the quantiles of a normal distribution, one absmax scale per
block of 64 weights along the contraction axis (qwix stores the level index as uint4); int4 is
uniform with one scale per tile; int8 one scale per output channel. Scales are float32 (QLoRA's
double quantisation of the scales is not done: 0.5 extra bits per weight at blocks of 64). ``nnx.LoRA`` has neither a scale, dropout
nor a quantised base. Adapters are ``nnx.LoRAParam`` variables named ``<kernel>_lora_a``
``(in, rank)`` and ``<kernel>_lora_b`` ``(rank, out)``, so optax, ``rj.diloco`` and the
checkpointer see them as one ordinary pytree (:func:`split_lora`).

Averaging adapters (FLoRA, arXiv 2409.05976): the mean of the peers' ``A`` and ``B`` is not the
mean of their products ``A @ B``. With ``train_a=False`` ``A`` is a frozen random projection,
the same on every peer (FFA-LoRA, arXiv 2403.12313), only ``B`` trains, and the average of the
``B`` is exactly the average of the deltas, at half the bytes. ``benchmarks/bench_finetune.py``
measures both: the separate averages miss the mean update by 4-8% a round, yet training ``A``
reached the lower eval loss (and matched its one-process reference), so it is the default
(docs/finetuning.md).

References: Hu et al., LoRA, arXiv 2106.09685; Dettmers et al., QLoRA, arXiv 2305.14314.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ._config import TransformerConfig
from ._transformer import Transformer

#: short name -> the projection's attribute name in the model
PROJECTIONS = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
#: the quantised base formats, stored in qwix's QArray (values and scales): int8 (per channel),
#: int4 (per tile), nf4 (NormalFloat4 per block of 64, QLoRA arXiv 2305.14314)
QUANTIZE = ("int8", "int4", "nf4")
_SAMPLE = (1, 8)  # the token shape qwix traces the model with to find the projections


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters, and how.

    Args:
      rank: the adapters' rank r (``A``: ``(in, r)``, ``B``: ``(r, out)``).
      alpha: the scale of the update is ``alpha / rank`` (Hugging Face PEFT's ``lora_alpha``).
      dropout: dropout rate on the adapters' input, in training steps only (a step passes a key
        to :meth:`LoraModel.model`); 0 disables it.
      targets: projections that get adapters: ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``,
        ``down`` (or their ``*_proj`` names).
      train_a: train ``A`` too (default, standard LoRA; peers average ``A`` and ``B``
        separately). False: ``A`` is a frozen random projection (FFA-LoRA, arXiv 2403.12313),
        the same on every peer: averaging ``B`` averages the updates exactly, and rounds are
        about half as large.
      seed: the adapters' initial values (``A`` He-uniform, ``B`` zeros) depend on this and the
        parameter's name only: equal on every peer.

    Raises:
      ValueError: a rank < 1, alpha <= 0, dropout outside [0, 1), an unknown or empty target.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    train_a: bool = True
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an int >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        names = []
        for t in targets:
            name = PROJECTIONS.get(t, t)
            if name not in PROJECTIONS.values():
                raise ValueError(f"unknown LoRA target {t!r}; choose from {', '.join(PROJECTIONS)}")
            names.append(name)
        if not names:
            raise ValueError("LoRA targets must name at least one projection")
        object.__setattr__(self, "targets", tuple(dict.fromkeys(names)))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_quantize(quantize: str | None) -> None:
    """Raises ``ValueError`` (one line) unless ``quantize`` is None or one of :data:`QUANTIZE`."""
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r}: choose None, {', '.join(map(repr, QUANTIZE))}")


def _tile_size(cfg: TransformerConfig, quantize: str | None) -> int | None:
    """The block of the contraction axis that shares one scale: for int4 the largest of 128,
    64, 32, 16 that divides every projection's input width; for nf4 QLoRA's 64 (arXiv
    2305.14314), or 32 / 16 where 64 does not divide a width (tiny test models); int8 one scale
    per output channel (None)."""
    if quantize not in ("int4", "nf4"):
        return None
    widths = math.gcd(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim)
    for t in (128, 64, 32, 16) if quantize == "int4" else (64, 32, 16):
        if widths % t == 0:
            return t
    return None


def _provider(cfg: TransformerConfig, lora: LoraConfig | None, quantize: str | None, *, dropout: bool):
    import qwix

    tile = _tile_size(cfg, quantize)
    if lora is None:
        return qwix.PtqProvider(
            [qwix.QuantizationRule(module_path=_all_linear(cfg), weight_qtype=quantize, tile_size=tile)]
        )
    rules = [
        qwix.LoraRule(
            module_path=r"(.*/)?(" + "|".join(lora.targets) + r")$",
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout if dropout else 0.0,
            weight_qtype=quantize,
            tile_size=tile,
        )
    ]
    if quantize is not None:  # the projections without adapters are quantised too
        rules.append(qwix.QuantizationRule(module_path=_all_linear(cfg), weight_qtype=quantize, tile_size=tile))
    return qwix.LoraProvider(rules)


def _all_linear(cfg: TransformerConfig) -> str:
    return r"(.*/)?(" + "|".join(PROJECTIONS.values()) + r")$"


def _wrap(model: Transformer, lora: LoraConfig | None, quantize: str | None, *, dropout: bool = True) -> Transformer:
    import qwix

    if getattr(model, "scan_layers", False):
        # qwix creates the adapters and quantises in a first call, which must see every layer's
        # modules: wrap the per-layer form, then stack its state again. Concrete arrays only:
        # under tracing (nnx.eval_shape) qwix does not find an int4 kernel sliced from a stacked
        # one and adds no adapter; abstract builds wrap a per-layer Transformer and stack it
        from ._scan import stack_layers, unstack_layers

        out = _wrap(unstack_layers(nnx.clone(model)), lora, quantize, dropout=dropout)
        if lora is not None and not jax.tree.leaves(nnx.state(out, nnx.LoRAParam)):
            raise ValueError(
                "qwix added no adapters to the scanned model (under tracing, e.g. nnx.eval_shape): "
                "apply LoRA to the per-layer model (scan_layers=False), then stack_layers it"
            )
        return stack_layers(out)
    provider = _provider(model.config, lora, quantize, dropout=dropout)
    sample = jnp.zeros(_SAMPLE, jnp.int32)
    # qwix's first call creates the adapters: never inside a recomputed block (they would be
    # created on a copy and lost); the model's remat is restored after
    remat, model = model.remat, nnx.clone(model)
    model.remat = "none"
    if lora is None:
        out = qwix.quantize_model(model, provider, sample)
    else:
        out = qwix.apply_lora_to_model(model, provider, sample, rngs=nnx.Rngs(lora.seed))
    out.remat = remat
    out.lora_setup = (lora, quantize)  # static: what split_lora needs to rebuild the graph
    return out


def is_adapter(path: tuple, value: Any) -> bool:
    """An nnx filter: ``value`` at ``path`` is a LoRA adapter (``A`` or ``B``)."""
    return isinstance(value, nnx.LoRAParam)


def _trainable(lora: LoraConfig):
    def keep(path: tuple, value: Any) -> bool:
        if not isinstance(value, nnx.LoRAParam):
            return False
        return lora.train_a or str(path[-1]).endswith("_lora_b")

    return keep


def init_adapters(state: nnx.State, seed: int, sharding: Any = None) -> None:
    """Sets every adapter in ``state`` (in place) to its initial value: ``A`` He-uniform
    ``(in, rank)``, ``B`` zeros ``(rank, out)``, from ``seed`` and the parameter's path only, so
    every peer starts from the same adapters. ``sharding(shape)``, if given, is where each
    adapter goes: each device computes its own shard (the same values as on one device:
    ``jax_threefry_partitionable``).

    A scanned model's adapter ``(layers, in, rank)`` (or ``(layers, rank, out)``) gets, layer by
    layer, the value the per-layer model's adapter of that layer gets (keyed by its per-layer
    path ``layers.<i>...``); its layer axis is never split."""
    from ._scan import _stack, is_stacked, layer_path

    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.LoRAParam):
            continue
        v = var.get_value()
        path = tuple(path)
        if is_stacked(path):
            values = [
                _init_adapter(layer_path(path, i), v.shape[1:], v.dtype, seed, sharding) for i in range(v.shape[0])
            ]
            var.set_value(_stack(values))
        else:
            var.set_value(_init_adapter(path, v.shape, v.dtype, seed, sharding))


def _init_adapter(path: tuple, shape: tuple, dtype: Any, seed: int, sharding: Any) -> jax.Array:
    """The initial value of the (per-layer) adapter at ``path``."""
    shape = tuple(shape)
    name = ".".join(map(str, path))
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)
    if name.endswith("_lora_b"):

        def init(key):
            return jnp.zeros(shape, dtype)
    else:

        def init(key):
            return jax.nn.initializers.he_uniform()(key, shape, dtype)

    return init(key) if sharding is None else jax.jit(init, out_shardings=sharding(shape))(key)


def apply_lora(
    model: Transformer,
    lora: LoraConfig | None = None,
    *,
    quantize: str | None = None,
    adapter_dtype: Any = jnp.float32,
) -> Transformer:
    """Adds LoRA adapters to ``model`` and/or quantises its projections (QLoRA), with qwix.

    For a checkpoint on disk, ``load_pretrained(path, lora=..., quantize=...)`` does the same
    one tensor at a time, never holding the unquantised model.

    Args:
      model: a :class:`Transformer` (its weights are read, not changed).
      lora: the adapters (None: quantise only, an inference base).
      quantize: None, ``"int8"``, ``"int4"`` or ``"nf4"``: the frozen projections' storage.
      adapter_dtype: the adapters' dtype (float32 default; the update is cast to the compute
        dtype).

    Returns:
      a new model: ``model(tokens)`` as before, plus ``alpha / rank * x @ A @ B`` on each target.

    Raises:
      ValueError: an unknown ``quantize``.
    """
    check_quantize(quantize)
    if lora is None and quantize is None:
        return model
    out = _wrap(model, lora, quantize)
    if lora is not None:
        state = nnx.state(out, nnx.LoRAParam)
        for _, var in nnx.to_flat_state(state):
            var.set_value(var.get_value().astype(adapter_dtype))
        init_adapters(state, lora.seed)
        nnx.update(out, state)
    return out


class LoraModel(NamedTuple):
    """A LoRA model split for training (:func:`split_lora`): ``adapters`` (what trains: what
    optax, ``rj.diloco``, outer rounds and checkpoints cover) and ``frozen`` (the base,
    quantised or not, and the frozen ``A``), with the graph that puts them back together.

    Inside a jitted function, ``lm.model(adapters, frozen)`` is the callable model (no dropout:
    evaluation); ``lm.model(adapters, frozen, key)`` with a ``jax.random`` key applies the
    adapters' dropout (a training step; fold the step number into the key).
    """

    graphdef: Any
    adapters: nnx.State
    frozen: nnx.State
    lora: LoraConfig
    train_graphdef: Any = None  # the graph with dropout (None: no dropout)

    def model(self, adapters: nnx.State, frozen: nnx.State, key: jax.Array | None = None) -> Transformer:
        if key is None or self.train_graphdef is None:
            return nnx.merge(self.graphdef, adapters, frozen)
        m = nnx.merge(self.train_graphdef, adapters, frozen)
        i = 0
        for _, module in nnx.iter_modules(m):
            if _has_adapter(module):
                module.qwix_rngs = nnx.Rngs(dropout=jax.random.fold_in(key, i))
                i += 1
        return m

    def merged(self, adapters: nnx.State | None = None, *, base: Transformer | None = None) -> Transformer:
        """The plain float :class:`Transformer` with ``alpha / rank * A @ B`` folded into each
        kernel: what ``save_pretrained`` writes.

        Args:
          adapters: the adapters (default: :attr:`adapters`; a frozen ``A`` from :attr:`frozen`).
          base: None: fold them into this model's own kernels, a quantised base dequantised
            first (a new model, in the parameter dtype): the weights the adapters trained
            against, so the merged model computes what the adapted one does, to float rounding.
            Or a plain per-layer :class:`Transformer` of the same architecture, usually the
            checkpoint's original float weights (``load_pretrained(path, dtype=...,
            scan_layers=False)``): folded into its kernels in place, in float32 cast to their
            dtype (PEFT's ``merge_and_unload``), and returned. Of a QLoRA model that is the base
            before quantisation: the result differs from the adapted model by the quantisation
            error (docs/finetuning.md, Export).

        Raises:
          ValueError: a ``base`` that is scanned, or lacks or misfits an adapted projection.
        """
        adapters = self.adapters if adapters is None else adapters
        if base is None:
            return merge_adapters(self.model(adapters, self.frozen), self.lora)
        from ._hf_names import fold_peft_tensors, state_peft_tensors

        return fold_peft_tensors(base, state_peft_tensors(adapters, self.frozen, jnp.float32), self.lora.scale)

    @property
    def num_adapter_params(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self.adapters))


def _has_adapter(module: Any) -> bool:
    return any(k.endswith("_lora_b") for k in vars(module))


def split_lora(model: Transformer) -> LoraModel:
    """Splits a model made by :func:`apply_lora` or ``load_pretrained(..., lora=...)`` into the
    trainable adapters and the frozen rest (:class:`LoraModel`).

    With ``train_a`` False only the ``B`` matrices ``(rank, out)`` are adapters; the ``A``
    ``(in, rank)`` stay with the frozen base.

    Raises:
      ValueError: ``model`` has no adapters.
    """
    lora, quantize = getattr(model, "lora_setup", (None, None))
    if lora is None:
        raise ValueError("the model has no LoRA adapters: make it with apply_lora or load_pretrained(lora=...)")
    from ._scan import stack_layers

    keep = _trainable(lora)
    train_graphdef = None
    if lora.dropout > 0:
        # qwix reads the dropout rate from its rule, in the model's class: evaluation needs the
        # same graph with a rule without dropout
        train_graphdef, adapters, frozen = nnx.split(model, keep, ...)
        cfg = model.config
        dtype, param_dtype = model.embed_tokens.dtype, model.embed_tokens.embedding.get_value().dtype

        def build():
            # qwix wraps the per-layer form (under tracing it does not find an int4 kernel sliced
            # from a stacked one: no adapters), stacked after
            m = _wrap(
                Transformer(cfg, nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype), lora, quantize, dropout=False
            )
            if model.scan_layers:
                stack_layers(m)
            m.remat, m.batch_sharding = model.remat, model.batch_sharding
            m.attention, m.attention_chunk = model.attention, model.attention_chunk
            m.mlp_chunk = model.mlp_chunk
            return m

        graphdef = nnx.split(nnx.eval_shape(build), keep, ...)[0]
    else:
        graphdef, adapters, frozen = nnx.split(model, keep, ...)
    return LoraModel(graphdef, adapters, frozen, lora, train_graphdef)


def merge_adapters(model: Transformer, lora: LoraConfig) -> Transformer:
    """A plain :class:`Transformer` (no qwix) whose kernels are ``W + alpha / rank * A @ B``,
    with quantised kernels dequantised; in the model's parameter dtype; scanned (stacked
    layers) when ``model`` is."""
    import qwix

    from ._scan import stack_layers, unstack_layers

    scanned = model.scan_layers
    if scanned:  # per-layer copies of the stacked leaves (the model itself is not changed)
        model = unstack_layers(nnx.clone(model))
    cfg = model.config
    first = model.embed_tokens.embedding.get_value()
    plain = nnx.eval_shape(
        lambda: Transformer(cfg, nnx.Rngs(0), dtype=model.embed_tokens.dtype, param_dtype=first.dtype)
    )
    graphdef, state = nnx.split(plain)
    src = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        path = tuple(path)
        want = var.get_value()
        if path in src:
            w = src[path]
        else:  # a quantised kernel: its QArray lives under kernel/array
            arr = _qarray_at(model, path)
            if arr is None:
                raise ValueError(f"parameter {'.'.join(map(str, path))} is missing from the model")
            w = qwix.dequantize(arr)
        w = jnp.asarray(w, jnp.float32)
        a = src.get(path[:-1] + (path[-1] + "_lora_a",))
        b = src.get(path[:-1] + (path[-1] + "_lora_b",))
        if a is not None and b is not None:
            w = w + lora.scale * (a.astype(jnp.float32) @ b.astype(jnp.float32))
        var.set_value(w.reshape(want.shape).astype(want.dtype))
    out = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return stack_layers(out) if scanned else out


def _qarray_at(model: Any, path: tuple) -> Any:
    obj = model
    for p in path:
        obj = obj[p] if isinstance(p, int) else getattr(obj, str(p), None)
        if obj is None:
            return None
    return getattr(obj, "array", None)


def adapter_names(lora_model: LoraModel) -> list[str]:
    """The dotted paths of the trainable adapters."""
    return [".".join(map(str, p)) for p, _ in nnx.to_flat_state(lora_model.adapters)]
