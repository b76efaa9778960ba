"""How much device memory each pipeline stage needs, from abstract shapes (nothing allocated).

A stage's bytes are the sum of four parts:

- **base**: its frozen parameters at their measured device width
  (:func:`rj.models.nbytes`: int4 / nf4 at 4 bits where XLA packs them, their scales float32);
- **adapters + optimizer + outer**: the trainable leaves (float32), AdamW's two moments
  (``jax.eval_shape`` of the optimizer's ``init``) and DiLoCo's anchor and outer momentum (two
  more copies);
- **activations in flight**: what the stage keeps between a micro-batch's forward and its
  backward (the residuals of ``jax.vjp``, from ``jax.eval_shape``; with gradient checkpointing
  each block's input), times the micro-batches the 1F1B schedule keeps in flight on that stage
  (stage ``s`` of ``S`` at depth ``D``: ``w_s + 1``, ``S - s`` at the default depth ``D = S``;
  :mod:`._schedule`);
- **one unit's working set**: the temporary bytes of the largest of its units' forward plus
  backward for one micro-batch, from XLA's plan of that unit compiled (not run) on this
  machine (``jax.jit(...).lower(ShapeDtypeStructs).compile().memory_analysis()``). XLA on CPU
  multiplies bfloat16 in float32 and keeps float32 copies of the bfloat16 operands that a GPU
  never makes, so the unit is compiled in float32 and its temporary bytes are scaled to the
  compute dtype's width (half for bfloat16): an estimate of the GPU program, not a bound (the
  GPU's scheduler, cuDNN attention and fusion change it; measure on the card to be sure).

Every decoder block of a model is the same, so :func:`plan_stage_memory` measures the model cut
to one block (three units: prologue, block, epilogue) and composes the stages from those
figures: seconds on 2 CPU cores for a 70B model. The bounds are :func:`balance` of the units'
parameter bytes, as ``plan_stages(split, S)`` cuts.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ravnest_jax.models import POOL_RESERVE

from ._balance import balance
from ._schedule import _warmup

__all__ = ["POOL_RESERVE", "StageMemory", "UnitMemory", "plan_stage_memory", "stage_memory", "unit_memory"]

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class UnitMemory:
    """Device bytes of one unit (prologue, one block, epilogue) of a split.

    Attributes:
      base: frozen parameters at their device width.
      adapters: trainable parameters.
      optimizer: the inner optimizer's state over them (AdamW: two moments and a count).
      outer: DiLoCo's anchor and outer momentum (two copies of the trainable parameters).
      kept: bytes kept per micro-batch between its forward and backward (residuals beyond the
        parameters: with gradient checkpointing, the block's input).
      working: XLA's temporary bytes of the unit's forward plus backward on one micro-batch
        (see the module docstring).
    """

    base: int
    adapters: int
    optimizer: int
    outer: int
    kept: int
    working: int

    @property
    def params(self) -> int:
        """The parameter bytes (base and adapters): what the stages are balanced by."""
        return self.base + self.adapters


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """One stage's device bytes, by part (module docstring).

    Attributes:
      stage: its index; ``lo``, ``hi``: it holds units ``[lo, hi)``.
      in_flight: micro-batches the schedule keeps in flight on it.
      base, trainable (adapters, optimizer and outer state), activations (in flight),
      working_set (its largest unit's, one micro-batch): bytes.
    """

    stage: int
    lo: int
    hi: int
    in_flight: int
    base: int
    trainable: int
    activations: int
    working_set: int

    @property
    def total(self) -> int:
        return self.base + self.trainable + self.activations + self.working_set

    def headroom(self, pool_bytes: int) -> float:
        """``1 - total / pool_bytes``: the share of the pool left free (negative: over)."""
        return 1.0 - self.total / max(pool_bytes, 1)

    def fits(self, pool_bytes: int, *, reserve: float = POOL_RESERVE) -> bool:
        """Whether the stage stays within ``1 - reserve`` of an allocator pool of ``pool_bytes``."""
        return self.total <= (1 - reserve) * pool_bytes


def unit_memory(
    split: Any,
    unit: int,
    *,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    tx: Any = None,
    outer: bool = True,
    work_split: Any = None,
    work_scale: float = 1.0,
) -> UnitMemory:
    """The :class:`UnitMemory` of unit ``unit`` of ``split`` (a ``LayerSplit`` whose leaves may
    be abstract), without allocating.

    Args:
      micro_batch, seq_len: the micro-batch's shape; None: ``kept`` and ``working`` are 0 (the
        static bytes only).
      tx: the inner optimizer (default ``optax.adamw``).
      outer: count DiLoCo's anchor and outer momentum (two copies of the adapters), unless
        ``tx`` is ``rj.diloco(...)`` already (its state holds them: counted in ``optimizer``).
      work_split: the split to compile for the working set (default ``split``; e.g. the same
        model in float32, see the module docstring), its temporary bytes times ``work_scale``.
    """
    import optax

    from ravnest_jax.models import nbytes

    st = split.stage(unit, unit + 1, check=False, load=False)
    tx = optax.adamw(1e-4) if tx is None else tx
    adapters = nbytes(st.params)
    state = jax.eval_shape(tx.init, st.params)
    optimizer = nbytes(state)
    outer = outer and not hasattr(state, "global_params")  # an rj.diloco state counts its own
    base = nbytes(st.frozen)
    kept = working = 0
    if micro_batch is not None and seq_len is not None:
        kept = max(0, nbytes(_residuals(split, st, micro_batch, seq_len)) - adapters - base)
        ws = split if work_split is None else work_split
        wst = ws.stage(unit, unit + 1, check=False, load=False)
        working = int(math.ceil(work_scale * _temp_bytes(ws, wst, micro_batch, seq_len)))
    return UnitMemory(base, adapters, optimizer, 2 * adapters if outer else 0, kept, working)


def _inputs(split: Any, st: Any, micro_batch: int, seq_len: int) -> tuple[Any, Any]:
    tokens = jax.ShapeDtypeStruct((micro_batch, seq_len), jnp.int32)
    if st.first:
        return tokens, tokens
    h = split.hidden(micro_batch, seq_len)
    return jax.ShapeDtypeStruct(h.shape, h.dtype), tokens


def _residuals(split: Any, st: Any, micro_batch: int, seq_len: int) -> Any:
    x, _ = _inputs(split, st, micro_batch, seq_len)

    def fwd(p, f, x):
        if st.first:
            return jax.vjp(lambda p: st.apply(p, f, x), p)[1]
        return jax.vjp(lambda p, x: st.apply(p, f, x), p, x)[1]

    return jax.eval_shape(fwd, st.params, st.frozen, x)


def _temp_bytes(split: Any, st: Any, micro_batch: int, seq_len: int) -> int:
    x, targets = _inputs(split, st, micro_batch, seq_len)
    out = jax.eval_shape(st.apply, st.params, st.frozen, x)

    def step(p, f, x, g, t):
        if st.last:
            loss = (lambda p, x: st.loss(st.apply(p, f, x), t)) if not st.first else None
            if st.first:
                return jax.grad(lambda p: st.loss(st.apply(p, f, x), t))(p)
            return jax.grad(loss, argnums=(0, 1))(p, x)
        if st.first:
            return jax.vjp(lambda p: st.apply(p, f, x), p)[1](g)
        return jax.vjp(lambda p, x: st.apply(p, f, x), p, x)[1](g)

    g = jax.ShapeDtypeStruct(out.shape, out.dtype)
    compiled = jax.jit(step).lower(st.params, st.frozen, x, g, targets).compile()
    analysis = compiled.memory_analysis()
    return 0 if analysis is None else int(analysis.temp_size_in_bytes)


def in_flight_per_stage(num_stages: int, in_flight: int | None = None) -> list[int]:
    """Micro-batches the 1F1B schedule keeps in flight on each stage: ``w_s + 1`` (warm-up plus
    one) at depth ``in_flight`` (default ``num_stages``): ``S, S - 1, ..., 1`` by default."""
    depth = num_stages if in_flight is None else int(in_flight)
    return [_warmup(s, num_stages, depth) + 1 for s in range(num_stages)]


def stage_memory(
    units: Sequence[UnitMemory], bounds: Sequence[tuple[int, int]], *, in_flight: int | None = None
) -> list[StageMemory]:
    """The :class:`StageMemory` of each stage ``[lo, hi)`` of ``bounds`` from its units' figures,
    with the micro-batches in flight of :func:`in_flight_per_stage`."""
    flights = in_flight_per_stage(len(bounds), in_flight)
    out = []
    for s, ((lo, hi), n) in enumerate(zip(bounds, flights)):
        us = units[lo:hi]
        out.append(
            StageMemory(
                stage=s,
                lo=lo,
                hi=hi,
                in_flight=n,
                base=sum(u.base for u in us),
                trainable=sum(u.adapters + u.optimizer + u.outer for u in us),
                activations=n * sum(u.kept for u in us),
                working_set=max((u.working for u in us), default=0),
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class StagePlanMemory:
    """:func:`plan_stage_memory`'s result: the stages and how they were computed.

    Attributes:
      stages: one :class:`StageMemory` per stage.
      units: the unit figures the stages are composed of (prologue, each block, epilogue).
      widths: the measured device bits of the dtypes counted (``{"int4": 4, ...}``).
    """

    stages: tuple[StageMemory, ...]
    units: tuple[UnitMemory, ...]
    widths: dict[str, int]

    def table(self, pool_bytes: int) -> str:
        """A per-stage table (GiB, or MiB for models under 0.1 GiB a stage), with the headroom in
        a pool of ``pool_bytes``."""
        big = max(s.total for s in self.stages) >= GIB / 10
        unit, scale = ("GiB", GIB) if big else ("MiB", 1024**2)
        head = (
            f"{'stage':<6}{'units':>9}{'in flight':>10}{'base':>8}{'adapt+opt':>10}{'acts':>8}"
            f"{'working':>9}{'total':>8}{'pool':>10}{'headroom':>10}   ({unit})"
        )
        rows = [head]
        for s in self.stages:
            rows.append(
                f"{s.stage:<6}{f'{s.lo}..{s.hi - 1}':>9}{s.in_flight:>10}{s.base / scale:>8.2f}"
                f"{s.trainable / scale:>10.2f}{s.activations / scale:>8.2f}{s.working_set / scale:>9.2f}"
                f"{s.total / scale:>8.2f}{pool_bytes / scale:>10.2f}{s.headroom(pool_bytes):>10.1%}"
            )
        return "\n".join(rows)


def plan_stage_memory(
    config: Any,
    *,
    stages: int,
    lora: Any = None,
    quantize: str | None = None,
    micro_batch: int = 1,
    seq_len: int = 2048,
    dtype: str = "bfloat16",
    in_flight: int | None = None,
    remat: bool = True,
) -> StagePlanMemory:
    """Each stage's device bytes when a LoRA / QLoRA model is split into ``stages`` pipeline
    stages (module docstring), from abstract shapes: nothing is allocated.

    Args:
      config: a ``config.json``, a checkpoint directory, a preset name (``llama-3.1-70b``, ...)
        or an ``rj.models.TransformerConfig``.
      stages: the number of stages ``S``.
      lora: an ``rj.models.LoraConfig`` (default: rank 16 on every projection).
      quantize: None, ``"int8"``, ``"int4"`` or ``"nf4"``: the frozen base's storage.
      micro_batch, seq_len: a micro-batch's sequences and tokens per sequence.
      dtype: ``"bfloat16"`` or ``"float32"``: compute and unquantised parameter dtype.
      in_flight: the schedule's depth ``D`` (default ``S``).
      remat: gradient checkpointing of each block (the default of ``load_pretrained``).

    Returns:
      a :class:`StagePlanMemory`.

    Raises:
      ValueError: a bad config, ``quantize``, ``dtype``, shape, ``stages`` (more than the
        model's units) or ``in_flight``.
    """
    from flax import nnx

    from ravnest_jax.models import (
        LoraConfig,
        Transformer,
        apply_lora,
        check_quantize,
        device_bits,
        load_config,  # the presets' one reader
        split_lora,
    )

    from ._model import transformer_split
    from ._schedule import check_depth

    cfg = load_config(config)
    lora = lora or LoraConfig()
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    for name, v in (("micro_batch", micro_batch), ("seq_len", seq_len), ("stages", stages)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    units_total = cfg.num_hidden_layers + 2
    if stages > units_total:
        raise ValueError(f"stages={stages}: the model has {units_total} units (embedding, blocks, head)")
    if cfg.tie_word_embeddings and stages > 1:
        raise ValueError("the model ties its input embedding to its head: one stage only (untie the embeddings)")
    check_quantize(quantize)
    depth = check_depth(in_flight, stages, max(stages, in_flight or stages))
    one = dataclasses.replace(cfg, num_hidden_layers=1)

    def split_in(jdtype: Any) -> Any:
        def build():
            m = apply_lora(Transformer(one, nnx.Rngs(0), dtype=jdtype, param_dtype=jdtype), lora, quantize=quantize)
            m.remat = remat
            return m

        return transformer_split(split_lora(nnx.eval_shape(build)))

    jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    split = split_in(jdtype)
    work = split if jdtype == jnp.float32 else split_in(jnp.float32)
    scale = jnp.dtype(jdtype).itemsize / 4
    prologue, block, epilogue = (
        unit_memory(split, u, micro_batch=micro_batch, seq_len=seq_len, work_split=work, work_scale=scale)
        for u in range(3)
    )
    units = (prologue, *([block] * cfg.num_hidden_layers), epilogue)
    bounds = balance([u.params for u in units], stages)
    names = {jnp.dtype(x.dtype).name for x in jax.tree.leaves(split.stage(0, 3, check=False, load=False).frozen)}
    widths = {n: device_bits(n) for n in sorted(names | {"int4", "int8", jnp.dtype(jdtype).name})}
    return StagePlanMemory(tuple(stage_memory(units, bounds, in_flight=depth)), units, widths)


def stage_need_bytes(split: Any, bounds: Sequence[tuple[int, int]], *, tx: Any = None) -> list[int]:
    """The static bytes of each stage ``[lo, hi)`` of ``split``: frozen base at its measured
    width, trainable leaves, ``tx``'s state and DiLoCo's anchor and outer momentum (what
    placement compares with a peer's pool when the micro-batch shape is not known yet; pass
    ``need_bytes`` from :func:`plan_stage_memory` to count activations too)."""
    units = [unit_memory(split, u, tx=tx) for u in range(split.num_units)]
    return [m.total for m in stage_memory(units, bounds)]


def pool_message(env: Mapping[str, str] = os.environ) -> str:
    """How to get a larger pool, for a refusal's message."""
    from ravnest_jax.models import allocator_pool_bytes

    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return "the pool is the whole card already (XLA_PYTHON_CLIENT_ALLOCATOR=platform)"
    f = allocator_pool_bytes(GIB, env) / GIB
    return f"JAX's allocator takes {f:.2f} of the card: raise it with XLA_PYTHON_CLIENT_MEM_FRACTION=0.9"
