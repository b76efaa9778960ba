"""The recipe's schema and its check (``ravnest_jax.recipe``'s first half): the sections as frozen
dataclasses, each key's check, ``--set`` overrides, paths, and :func:`load_recipe`, which checks a
recipe in full before anything loads: every wrong key, type or value is one line naming the key,
an unknown key names the nearest valid one, and the lines are raised together as one
``ValueError``. Paths in the file are relative to the recipe file; paths given with ``--set``
relative to the current directory. No jax import.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
]

QUANTIZE = ("int8", "int4", "nf4")  # ravnest_jax.models.QUANTIZE (not imported: it imports jax)
DTYPES = ("auto", "float32", "bfloat16")
FORMATS = ("auto", "text", "prompt_completion", "messages", "alpaca")
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
SCHEDULES = ("constant", "cosine", "linear")
REMAT = ("full", "dots", "offload", "none")
ATTENTION = ("auto", "cudnn", "chunked", "xla")
PIPELINE_MODES = ("sync", "async", "stash", "predict", "2bw")  # train.py --pipeline-mode
ACTIVATION_CODECS = ("fp32", "bf16", "int8", "int4", "fp4")  # train.py --activation-codec
MERGE_INTO = ("original", "dequantized")  # train.py --merge-into
REQUIRED = object()  # the default of a key the recipe must give


@dataclass(frozen=True)
class ModelSection:
    """``model``: the base checkpoint (a Hugging Face directory: ``config.json``, safetensors,
    ``tokenizer.json``), its storage (``quantize``: None, int8, int4 or nf4, QLoRA) and the
    compute dtype (auto: bfloat16 on accelerators, float32 on CPU)."""

    checkpoint: str
    quantize: str | None = None
    dtype: str = "auto"


@dataclass(frozen=True)
class LoraSection:
    """``lora``: adapter rank, alpha (None: 2 x rank), dropout in [0, 1), the projections with
    adapters, and ``frozen_a`` (train B only)."""

    rank: int = 8
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    frozen_a: bool = False


@dataclass(frozen=True)
class DataSection:
    """``data``: jsonl / parquet files, directories or globs (``files``), their record
    ``format``, tokens per sequence, packing several documents a row, learning the prompt
    tokens too, what happens to documents longer than ``seq_len`` (split or drop), and the
    held-out batches of the eval loss."""

    files: tuple[str, ...]
    format: str = "auto"
    seq_len: int = 64
    packing: bool = True
    train_on_prompt: bool = False
    overlong: str = "split"
    eval_batches: int = 4


@dataclass(frozen=True)
class OptimSection:
    """``optim``: inner AdamW lr, its schedule after ``warmup`` linear steps, sequences per
    micro-batch, micro-batches per step (gradient accumulation: a step is ``micro_batch x
    micro_batches`` sequences), how long: inner ``steps`` or ``epochs`` (passes over this peer's
    data shard, fractions allowed; the steps are counted once the data are read), exactly one of
    the two, and the seed."""

    lr: float = 3e-3
    schedule: str = "constant"
    warmup: int = 0
    micro_batch: int = 8
    micro_batches: int = 1
    steps: int | None = None
    epochs: float | None = None
    seed: int = 0


@dataclass(frozen=True)
class OuterSection:
    """``outer``: inner steps per DiLoCo round (H), the wire codec of the rounds (None: the
    swarm's default or the launcher's ``--codec``), steps a round overlaps (0 blocks), the outer
    step's learning rate and Nesterov momentum (0: plain SGD; lr 1 and momentum 0 average)."""

    sync_every: int = 20
    codec: str | None = None
    overlap_steps: int = 1
    lr: float = 0.7
    momentum: float = 0.5


@dataclass(frozen=True)
class PipelineSection:
    """``pipeline`` (docs/pipeline.md): ``stages`` peers each hold a slice of the layers (1: none;
    peers / stages clusters average each stage with DiLoCo), micro-batches stage 0 holds (None:
    ``stages``), the schedule (sync: exact; async, stash, 2bw: no flush), the activations' codec."""

    stages: int = 1
    in_flight: int | None = None
    mode: str = "sync"
    activation_codec: str = "int8"


@dataclass(frozen=True)
class CheckpointSection:
    """``checkpoint``: where to save and resume from (None: no checkpoints), inner steps between
    saves (None: ``outer.sync_every``)."""

    dir: str | None = None
    every: int | None = None


@dataclass(frozen=True)
class ExportSection:
    """``export``: directories for the merged model and for the PEFT adapters, a file for the
    JSON summary (each None: not written; first peer only), and what a quantised base's merged
    model folds the adapters into (``merge_into``: ``original``, the checkpoint's float weights,
    or ``dequantized``, the dequantised base they trained against; docs/finetuning.md, Export)."""

    merged: str | None = None
    adapters: str | None = None
    summary: str | None = None
    merge_into: str = "original"


@dataclass(frozen=True)
class RuntimeSection:
    """``runtime``: gradient checkpointing, attention implementation, local devices per peer,
    the share of the accelerator JAX takes (None: the environment's, else 0.9)."""

    remat: str = "full"
    attention: str = "auto"
    devices: int = 1
    mem_fraction: float | None = None


@dataclass(frozen=True)
class Recipe:
    """A checked recipe; paths are absolute."""

    path: str
    model: ModelSection
    data: DataSection
    lora: LoraSection = field(default_factory=LoraSection)
    optim: OptimSection = field(default_factory=OptimSection)
    outer: OuterSection = field(default_factory=OuterSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    export: ExportSection = field(default_factory=ExportSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "lora": LoraSection,
    "data": DataSection,
    "optim": OptimSection,
    "outer": OuterSection,
    "pipeline": PipelineSection,
    "checkpoint": CheckpointSection,
    "export": ExportSection,
    "runtime": RuntimeSection,
}


class _Bad(Exception):
    """A value's problem: the text after ``key: ``."""


def _int(lo: int | None = None) -> Callable[[Any], int]:
    what = "an int" if lo is None else f"an int >= {lo}"

    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
            raise _Bad(f"expected {what}, got {v!r}")
        return v

    return check


def _float(ok: Callable[[float], bool], what: str) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(float(v)):
            raise _Bad(f"expected {what}, got {v!r}")
        return float(v)

    return check


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad(f"expected true or false, got {v!r}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _Bad(f"expected a non-empty string, got {v!r}")
    return v


def _choice(options: Sequence[str]) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in options:
            near = difflib.get_close_matches(str(v), options, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise _Bad(f"expected one of {', '.join(options)}, got {v!r}{hint}")
        return v

    return check


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def inner(v: Any) -> Any:
        return None if v is None else check(v)

    return inner


def _strings(options: Sequence[str] | None = None) -> Callable[[Any], tuple[str, ...]]:
    def check(v: Any) -> tuple[str, ...]:
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
            raise _Bad(f"expected a string or a non-empty list of strings, got {v!r}")
        if options is not None:
            bad = [x for x in items if x not in options]
            if bad:
                raise _Bad(f"expected names among {', '.join(options)}, got {', '.join(map(repr, bad))}")
        return tuple(items)

    return check


_codecs: tuple[str, ...] | None = None


def _codec(v: Any) -> str:
    global _codecs
    if _codecs is None:
        from ravnest_jax.swarm import available_codecs  # no jax import

        _codecs = tuple(available_codecs())
    return _choice(_codecs)(v)


#: each key's check (a value to the field's value, or _Bad)
CHECKS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "model": {"checkpoint": _str, "quantize": _optional(_choice(QUANTIZE)), "dtype": _choice(DTYPES)},
    "lora": {
        "rank": _int(1),
        "alpha": _optional(_float(lambda x: x > 0, "a number > 0")),
        "dropout": _float(lambda x: 0 <= x < 1, "a number in [0, 1)"),
        "targets": _strings(TARGETS),
        "frozen_a": _bool,
    },
    "data": {
        "files": _strings(),
        "format": _choice(FORMATS),
        "seq_len": _int(2),
        "packing": _bool,
        "train_on_prompt": _bool,
        "overlong": _choice(("split", "drop")),
        "eval_batches": _int(1),
    },
    "optim": {
        "lr": _float(lambda x: x > 0, "a number > 0"),
        "schedule": _choice(SCHEDULES),
        "warmup": _int(0),
        "micro_batch": _int(1),
        "micro_batches": _int(1),
        "steps": _optional(_int(1)),
        "epochs": _optional(_float(lambda x: x > 0, "a number > 0")),
        "seed": _int(0),
    },
    "outer": {
        "sync_every": _int(1),
        "codec": _optional(_codec),
        "overlap_steps": _int(0),
        "lr": _float(lambda x: x > 0, "a number > 0"),
        "momentum": _float(lambda x: 0 <= x < 1, "a number in [0, 1)"),
    },
    "pipeline": {
        "stages": _int(1),
        "in_flight": _optional(_int(1)),
        "mode": _choice(PIPELINE_MODES),
        "activation_codec": _choice(ACTIVATION_CODECS),
    },
    "checkpoint": {"dir": _optional(_str), "every": _optional(_int(1))},
    "export": {
        "merged": _optional(_str),
        "adapters": _optional(_str),
        "summary": _optional(_str),
        "merge_into": _choice(MERGE_INTO),
    },
    "runtime": {
        "remat": _choice(REMAT),
        "attention": _choice(ATTENTION),
        "devices": _int(1),
        "mem_fraction": _optional(_float(lambda x: 0 < x <= 1, "a number in (0, 1]")),
    },
}
PATH_KEYS = ("model.checkpoint", "data.files", "checkpoint.dir", "export.merged", "export.adapters", "export.summary")


def _unknown(what: str, name: Any, valid: Sequence[str]) -> str:
    near = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else f"; valid: {', '.join(valid)}"
    return f"{what}: unknown key{hint}"


def _apply_set(raw: dict, item: str, problems: list[str]) -> str | None:
    """Puts one ``--set section.key=value`` into ``raw``; returns the dotted key or None."""
    key, eq, text = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not eq or not dot or not section or not name or "." in name:
        problems.append(f"--set {item!r}: expected section.key=value (e.g. lora.rank=16)")
        return None
    import yaml

    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        problems.append(f"--set {key}: the value is not YAML: {str(e).splitlines()[0]}")
        return None
    if section in raw and not isinstance(raw[section], dict):
        return key  # reported as the section's shape
    raw.setdefault(section, {})[name] = value
    return f"{section}.{name}"


def _resolve(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _check_files(values: dict[str, dict[str, Any]], problems: list[str]) -> None:
    """The paths among the keys that passed their own checks (so each problem shows at once)."""
    get = lambda s, k: values.get(s, {}).get(k)  # noqa: E731
    ckpt = Path(get("model", "checkpoint") or "")
    if get("model", "checkpoint") is not None and not ckpt.is_dir():
        problems.append(f"model.checkpoint: {ckpt} is not a directory")
    elif get("model", "checkpoint") is not None:
        for name in ("config.json", "tokenizer.json"):
            if not (ckpt / name).is_file():
                problems.append(f"model.checkpoint: {ckpt} has no {name}")
        if not any(ckpt.glob("*.safetensors")):
            problems.append(f"model.checkpoint: {ckpt} has no .safetensors file")
    for f in get("data", "files") or ():
        if not (Path(f).exists() or glob.glob(f)):
            problems.append(f"data.files: {f} does not exist (and matches nothing as a glob)")
    for key, out in (("export.merged", get("export", "merged")), ("export.adapters", get("export", "adapters"))):
        if out and Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
            problems.append(
                f"{key}: {out} exists and is not an empty directory (remove it, or --set {key}=ANOTHER_DIR)"
            )
    if get("checkpoint", "dir") and Path(get("checkpoint", "dir")).is_file():
        problems.append(f"checkpoint.dir: {get('checkpoint', 'dir')} is a file, not a directory")
    if get("export", "summary") and Path(get("export", "summary")).is_dir():
        problems.append(f"export.summary: {get('export', 'summary')} is a directory, not a file")


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = (), *, check_files: bool = True) -> Recipe:
    """Reads, overrides and checks a recipe; nothing is loaded or compiled.

    Args:
      path: the YAML file.
      overrides: ``"section.key=value"`` strings (``--set``); the value is parsed as YAML
        (``lora.targets=[q,v]``, ``model.quantize=null``).
      check_files: check that the checkpoint, data files and output paths are usable (off for
        recipes that name files not on this machine).

    Returns:
      The :class:`Recipe`, its paths absolute (file values relative to the recipe's folder,
      ``--set`` values to the current directory).

    Raises:
      ValueError: every problem, one line each naming the key (``lora.rank: expected an int
        >= 1, got 'x'``), joined by newlines.
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the recipe: {e.strerror or e}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML: {' '.join(str(e).split())}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a recipe is a mapping of sections (model, data, ...), got {type(raw).__name__}")
    problems: list[str] = []
    from_set = {k for item in overrides if (k := _apply_set(raw, item, problems))}
    values: dict[str, dict[str, Any]] = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            problems.append(_unknown(str(section), section, list(SECTIONS)))
            continue
        if body is None:
            body = {}
        if not isinstance(body, dict):
            problems.append(f"{section}: expected a mapping of keys, got {body!r}")
            continue
        checks, out = CHECKS[section], values.setdefault(section, {})
        for name, v in body.items():
            key = f"{section}.{name}"
            if name not in checks:
                problems.append(_unknown(key, name, list(checks)))
                continue
            try:
                out[name] = checks[name](v)
            except _Bad as e:
                problems.append(f"{key}: {e}")
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                if f.name not in values.get(section, {}) and f"{section}.{f.name}" not in {
                    p.split(":")[0] for p in problems
                }:
                    problems.append(f"{section}.{f.name}: missing (required)")
    base = path.resolve().parent
    for key in PATH_KEYS:
        section, name = key.split(".")
        v = values.get(section, {}).get(name)
        if v is None:
            continue
        where = Path.cwd() if key in from_set else base
        values[section][name] = tuple(_resolve(x, where) for x in v) if isinstance(v, tuple) else _resolve(v, where)
    if check_files:
        _check_files(values, problems)
    if problems:
        raise ValueError("\n".join(problems))
    recipe = Recipe(path=str(path.resolve()), **{s: SECTIONS[s](**values.get(s, {})) for s in SECTIONS})
    o, opt = recipe.outer, recipe.optim
    if o.overlap_steps >= o.sync_every:
        problems.append(f"outer.overlap_steps: expected < outer.sync_every ({o.sync_every}), got {o.overlap_steps}")
    if (opt.steps is None) == (opt.epochs is None):
        got = "both" if opt.steps is not None else "neither"
        problems.append(f"optim.steps, optim.epochs: expected exactly one of them (how long to train), got {got}")
    elif opt.steps is not None and opt.warmup >= opt.steps:
        problems.append(f"optim.warmup: expected < optim.steps ({opt.steps}), got {opt.warmup}")
    if opt.micro_batch % recipe.runtime.devices:
        problems.append(
            f"optim.micro_batch: expected a multiple of runtime.devices ({recipe.runtime.devices}), "
            f"got {opt.micro_batch}"
        )
    if recipe.pipeline.stages > 1:
        _check_stages(recipe, problems)
    if problems:
        raise ValueError("\n".join(problems))
    return recipe


def _check_stages(r: Recipe, problems: list[str]) -> None:
    """What ``pipeline.stages > 1`` cannot run with (``train.py`` refuses the same): a line each."""
    S, M, d = r.pipeline.stages, r.optim.micro_batches, r.pipeline.in_flight
    why, hi = f"with pipeline.stages > 1 ({S})", max(S, M + 1)
    if d is not None and not S <= d <= hi:
        problems.append(
            f"pipeline.in_flight: expected in [pipeline.stages, optim.micro_batches + 1] = [{S}, {hi}], got {d}"
        )
    if r.pipeline.mode == "2bw" and M < S - 1:
        problems.append(f"optim.micro_batches: expected >= pipeline.stages - 1 ({S - 1}) with mode 2bw, got {M}")
    if r.data.packing:
        problems.append(f"data.packing: expected false {why}: the stages carry no segment ids (one document a row)")
    if r.export.merged:
        problems.append(
            f"export.merged: not supported {why}: no peer holds the whole model; set export.adapters (each "
            "stage writes its part, assembled into PEFT's files) and merge afterwards on one machine with "
            "ravnest-jax merge-adapters --model CHECKPOINT --adapters DIR --out OUT (one shard at a time)"
        )
    if r.lora.dropout > 0:
        problems.append(f"lora.dropout: expected 0 {why} (not supported yet), got {r.lora.dropout}")
    if r.runtime.devices > 1:
        problems.append(f"runtime.devices: expected 1 {why} (not supported yet), got {r.runtime.devices}")
    if r.runtime.attention != "auto":
        problems.append(f"runtime.attention: expected auto {why} (not supported yet), got {r.runtime.attention!r}")
