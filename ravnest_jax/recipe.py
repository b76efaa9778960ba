"""Fine-tuning recipes: ``ravnest-jax finetune recipe.yaml [--set key.sub=value ...]``.

A recipe is a YAML file of sections (``model``, ``lora``, ``data``, ``optim``, ``outer``,
``pipeline``, ``checkpoint``, ``export``, ``runtime``), loaded into frozen dataclasses and
checked in full before anything loads (:func:`load_recipe`, ``ravnest_jax/_recipe_schema.py``):
every wrong key, type or value is one line naming the key. :func:`train_argv` maps a recipe onto
the options of the fine-tuning example (``examples/finetune/train.py``), which does the
training, and :func:`run` runs it as one peer. No jax import until :func:`run`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ravnest_jax._recipe_schema import (
    SECTIONS,
    CheckpointSection,
    DataSection,
    ExportSection,
    LoraSection,
    ModelSection,
    OptimSection,
    OuterSection,
    PipelineSection,
    Recipe,
    RuntimeSection,
    load_recipe,
)

__all__ = [
    "CheckpointSection",
    "DataSection",
    "ExportSection",
    "LoraSection",
    "ModelSection",
    "OptimSection",
    "OuterSection",
    "PipelineSection",
    "Recipe",
    "RuntimeSection",
    "load_recipe",
    "recipe_dict",
    "run",
    "train_argv",
]


def train_argv(r: Recipe) -> list[str]:
    """The options of ``examples/finetune/train.py`` that run recipe ``r`` (one peer)."""
    a = ["--checkpoint", r.model.checkpoint, "--dtype", r.model.dtype]
    if r.model.quantize:
        a += ["--quantize", r.model.quantize]
    a += ["--lora-rank", str(r.lora.rank), "--lora-dropout", repr(r.lora.dropout), "--lora-targets", *r.lora.targets]
    if r.lora.alpha is not None:
        a += ["--lora-alpha", repr(r.lora.alpha)]
    if r.lora.frozen_a:
        a.append("--frozen-a")
    a += ["--data", *r.data.files, "--data-format", r.data.format, "--seq-len", str(r.data.seq_len)]
    a += ["--overlong", r.data.overlong, "--eval-batches", str(r.data.eval_batches)]
    if not r.data.packing:
        a.append("--no-packing")
    if r.data.train_on_prompt:
        a.append("--train-on-prompt")
    o = r.optim
    a += ["--lr", repr(o.lr), "--lr-schedule", o.schedule, "--warmup-steps", str(o.warmup)]
    a += ["--batch-size", str(o.micro_batch * o.micro_batches), "--micro-batches", str(o.micro_batches)]
    a += ["--max-steps", str(o.steps)] if o.steps is not None else ["--epochs", repr(o.epochs)]
    a += ["--seed", str(o.seed)]
    a += ["--sync-every", str(r.outer.sync_every), "--overlap-steps", str(r.outer.overlap_steps)]
    a += ["--outer-lr", repr(r.outer.lr), "--outer-momentum", repr(r.outer.momentum)]
    pl = r.pipeline
    if pl.stages > 1:
        a += ["--stages", str(pl.stages), "--pipeline-mode", pl.mode, "--activation-codec", pl.activation_codec]
        a += ["--in-flight", str(pl.in_flight)] if pl.in_flight is not None else []
    if r.checkpoint.dir:
        a += ["--checkpoint-dir", r.checkpoint.dir]
    if r.checkpoint.every:
        a += ["--checkpoint-every", str(r.checkpoint.every)]
    if r.export.merged:
        a += ["--export", r.export.merged, "--merge-into", r.export.merge_into]
    if r.export.adapters:
        a += ["--export-adapters", r.export.adapters]
    rt = r.runtime
    a += ["--remat", rt.remat, "--attention", rt.attention, "--devices", str(rt.devices)]
    if rt.mem_fraction is not None:
        a += ["--mem-fraction", repr(rt.mem_fraction)]
    return a


def recipe_dict(r: Recipe) -> dict[str, Any]:
    """The recipe as plain data (lists for tuples), e.g. to print or to store beside a run."""
    return {
        s: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(r, s)).items()}
        for s in SECTIONS
    }


def _example_train() -> Any:
    """The fine-tuning example's ``train`` module (``examples/finetune/train.py`` of this source tree).

    Raises:
      ValueError: the installation has no examples folder (not a source checkout).
    """
    import importlib
    import sys

    examples = Path(__file__).resolve().parents[1] / "examples"
    if not (examples / "finetune" / "train.py").is_file():
        raise ValueError(f"finetune runs examples/finetune/train.py of a source checkout; {examples} has none")
    if str(examples) not in sys.path:
        sys.path.insert(0, str(examples))
    return importlib.import_module("finetune.train")


def run(r: Recipe, *, fresh: bool = False) -> dict:
    """Runs recipe ``r`` as one peer (the swarm from ``RAVNEST_*``, as the launcher sets them):
    ``train.main(train_argv(r))``; writes ``export.summary`` (first peer; with stages the first
    cluster's last stage). ``fresh``: start from step 0, the earlier checkpoints of
    ``checkpoint.dir`` moved aside (``train.py --fresh``). Returns the summary dict of ``train.py``.

    Raises:
      ValueError: as ``train.py`` (bad data, a checkpoint it cannot read), before it compiles;
        ``pipeline.stages`` that does not divide the swarm's peers (``RAVNEST_WORLD_SIZE``).
    """
    import json

    argv = train_argv(r) + (["--fresh"] if fresh else [])
    world, S = int(os.environ.get("RAVNEST_WORLD_SIZE", "1")), r.pipeline.stages
    if world % S:
        raise ValueError(
            f"pipeline.stages: {S} stages need a multiple of {S} peers, got {world} (ravnest-jax local --peers {S} "
            f"-- ravnest-jax finetune RECIPE; at a --rendezvous, RAVNEST_WORLD_SIZE on every peer)"
        )
    if r.outer.codec:
        os.environ.setdefault("RAVNEST_CODEC", r.outer.codec)  # the launcher's --codec wins
    train = _example_train()
    train.set_memory_fraction(argv)  # before jax is imported
    import ravnest_jax as rj

    rj.enable_compilation_cache()
    summary = train.main(argv)
    last = (summary.get("stage"), summary.get("cluster")) == (S - 1, 0)  # stages: the one with the eval loss
    if r.export.summary and (last if S > 1 else os.environ.get("RAVNEST_RANK", "0") == "0"):
        out = Path(r.export.summary)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"recipe": r.path, **summary}, indent=1) + "\n")
    return summary
