"""A pipeline run's adapters in PEFT's format, written stage by stage and assembled into one
``adapter_model.safetensors``.

No peer of a pipeline holds the whole model: each stage peer writes the adapters of its own
layers under their global PEFT names (:func:`save_peft_part`, one
``adapter_model.stage-<k>-of-<S>.safetensors`` a stage), and the parts become PEFT's two files
(``adapter_config.json``, ``adapter_model.safetensors``) as soon as every stage's part is in the
directory (peers on one machine, or a shared filesystem), or later with
:func:`assemble_peft_parts` (``ravnest-jax assemble-adapters OUT PART...``) once the parts written
on several machines are copied to one. Each part carries its stage, the stage count and the
adapter config in its safetensors header, so the parts alone are enough to assemble.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._files import default_mode
from ._hf_names import state_peft_tensors
from ._peft import CONFIG, WEIGHTS, peft_config

__all__ = ["assemble_peft_parts", "part_name", "save_peft_part"]

PART = re.compile(r"^adapter_model\.stage-(\d+)-of-(\d+)\.safetensors$")


def part_name(stage: int, num_stages: int) -> str:
    """The file name of stage ``stage``'s part (0-based) of ``num_stages``."""
    return f"adapter_model.stage-{stage}-of-{num_stages}.safetensors"


def save_peft_part(
    adapters: Any,
    lora: Any,
    path: str | Path,
    *,
    stage: int,
    num_stages: int,
    frozen: Any = None,
    base_model_name_or_path: str | None = None,
) -> Path | None:
    """Writes one pipeline stage's adapters as a part of a PEFT adapter directory, and assembles
    the directory when every stage's part is there.

    Args:
      adapters: the stage's trainable state (``nnx.State`` in the whole model's paths, as a
        ``rj.pipeline.StageModel``'s ``params`` or a ``StagePeer``'s trained ``worker.params``).
      lora: the run's ``rj.models.LoraConfig`` (rank, alpha, dropout, targets).
      path: the export directory (created if missing).
      stage, num_stages: this part's stage (0-based) and the pipeline's stage count.
      frozen: the stage's frozen state, where a frozen ``A`` lives (``train_a=False``).
      base_model_name_or_path: recorded in ``adapter_config.json``.

    Returns:
      the directory once it holds the assembled ``adapter_model.safetensors`` (this part was
      the last one missing), else None (other stages' parts are still to come).

    Raises:
      ValueError: ``path`` is a file or already holds an assembled export, a bad stage, no
        adapters in ``adapters``, or parts that do not fit together (:func:`assemble_peft_parts`).
    """
    from safetensors.numpy import save_file

    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in [0, {num_stages})")
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root} exists and is not a directory")
    if (root / WEIGHTS).exists():
        raise ValueError(f"{root} already holds an assembled {WEIGHTS}")
    tensors = state_peft_tensors(adapters, frozen)
    meta = {
        "format": "pt",
        "ravnest_stage": str(stage),
        "ravnest_stages": str(num_stages),
        "ravnest_adapter_config": json.dumps(peft_config(lora, base_model_name_or_path), sort_keys=True),
    }
    root.mkdir(parents=True, exist_ok=True)
    final = root / part_name(stage, num_stages)
    tmp = root / f".{final.name}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata=meta)
    default_mode(tmp)
    os.replace(tmp, final)  # a part is whole or absent: a peer assembling beside it never reads half of one
    if any(not (root / part_name(k, num_stages)).exists() for k in range(num_stages)):
        return None
    try:
        return assemble_peft_parts([root], root, remove_parts=True)
    except Exception:
        if (root / WEIGHTS).exists():  # another stage's peer assembled them first (and removed the parts)
            return root
        raise


def _parts(sources: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for src in map(Path, sources):
        if src.is_dir():
            files += sorted(p for p in src.iterdir() if PART.match(p.name))
        elif src.is_file() and PART.match(src.name):
            files.append(src)
        elif src.exists():
            raise ValueError(f"{src} is not a stage part (adapter_model.stage-<k>-of-<S>.safetensors) or a directory")
        else:
            raise ValueError(f"{src} does not exist")
    if not files:
        names = ", ".join(map(str, sources))
        raise ValueError(f"no stage parts (adapter_model.stage-<k>-of-<S>.safetensors) in {names}")
    return files


def assemble_peft_parts(sources: Sequence[str | Path], out: str | Path, *, remove_parts: bool = False) -> Path:
    """PEFT's ``adapter_config.json`` and ``adapter_model.safetensors`` in ``out`` from the parts
    of every stage (:func:`save_peft_part`), found in ``sources`` (part files, or directories
    holding them). ``peft.PeftModel.from_pretrained(base, out)`` loads the result as it loads
    an unsplit run's export (:func:`save_peft_adapters`).

    Args:
      sources: part files or directories (e.g. one copied from each stage's machine).
      out: the directory to write (created if missing; its parts may be among ``sources``).
      remove_parts: delete the part files inside ``out`` once the assembled file is written.

    Returns:
      ``out``.

    Raises:
      ValueError: one line naming the problem, before anything is written: no parts, a stage
        missing or given twice, parts of different stage counts or adapter configs, the same
        tensor in two parts, or ``out`` already holding an assembled export.
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

    dest = Path(out)
    if (dest / WEIGHTS).exists():
        raise ValueError(f"{dest} already holds an assembled {WEIGHTS}")
    by_stage: dict[int, Path] = {}
    counts: set[int] = set()
    config: str | None = None
    tensors: dict[str, Any] = {}
    owner: dict[str, Path] = {}
    for file in _parts(sources):
        with safe_open(str(file), framework="numpy") as f:
            meta = f.metadata() or {}
            try:
                stage, count = int(meta["ravnest_stage"]), int(meta["ravnest_stages"])
                cfg = meta["ravnest_adapter_config"]
            except (KeyError, ValueError):
                raise ValueError(f"{file} has no ravnest stage header: not written by save_peft_part") from None
            if stage in by_stage and by_stage[stage].resolve() != file.resolve():
                raise ValueError(f"stage {stage} is given twice: {by_stage[stage]} and {file}")
            if config is not None and cfg != config:
                raise ValueError(f"{file} was written with other LoRA settings than {next(iter(by_stage.values()))}")
            by_stage[stage], config = file, cfg
            counts.add(count)
            for name in f.keys():
                if name in owner and owner[name].resolve() != file.resolve():
                    raise ValueError(f"tensor {name} is in two parts: {owner[name]} and {file}")
                owner[name], tensors[name] = file, f.get_tensor(name)
    if len(counts) != 1:
        raise ValueError(f"the parts come from pipelines of different stage counts: {sorted(counts)}")
    (count,) = counts
    missing = [k for k in range(count) if k not in by_stage]
    if missing:
        raise ValueError(
            f"stage {', '.join(map(str, missing))} of {count} missing (have {sorted(by_stage)}): copy "
            f"{part_name(missing[0], count)} from the peer that held that stage"
        )
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".{WEIGHTS}.{os.getpid()}.tmp"
    save_file(dict(sorted(tensors.items())), str(tmp), metadata={"format": "pt"})
    default_mode(tmp)
    assert config is not None
    (dest / CONFIG).write_text(json.dumps(json.loads(config), indent=2, sort_keys=True))
    os.replace(tmp, dest / WEIGHTS)
    if remove_parts:
        for file in by_stage.values():
            if file.resolve().parent == dest.resolve():
                file.unlink(missing_ok=True)
    return dest
