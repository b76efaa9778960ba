"""PEFT LoRA adapters merged into a Hugging Face checkpoint file by file: the merged model of a
run too large for one machine's memory (a 70B trained in pipeline stages), what PEFT's
``merge_and_unload`` computes on the float model, with one safetensors shard in host memory at a
time and no accelerator."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from ._files import default_mode

__all__ = ["merge_adapters_into_files"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PREFIX = "base_model.model."


def _shards(root: Path) -> list[Path]:
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{root / INDEX} is not a safetensors index ({e})") from None
        return [root / name for name in sorted(set(weight_map.values()))]
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    raise ValueError(f"{root} holds neither {SINGLE} nor {INDEX}")


def merge_adapters_into_files(checkpoint: str | Path, adapters: str | Path, out: str | Path) -> Path:
    """Writes ``checkpoint`` with the PEFT LoRA ``adapters`` folded in to ``out``, shard by shard:
    each adapted weight ``W`` (Hugging Face's ``(out, in)``) becomes ``W + lora_alpha / r *
    lora_B @ lora_A``, computed in float32 and stored in ``W``'s dtype; every other tensor, the
    shard layout, the index and the other files of the directory (``config.json``, the
    tokenizer's, ``generation_config.json``) are copied as they are. Host memory: one shard's
    tensors plus one float32 weight; nothing touches an accelerator.

    This is merging into the original float weights (docs/finetuning.md, "Export": what users
    merge); a QLoRA run trained its adapters against the quantised base, so the merged model
    differs from the one trained by the quantisation error of ``W``.

    Args:
      checkpoint: a Hugging Face checkpoint directory (``model.safetensors``, or shards listed in
        ``model.safetensors.index.json``).
      adapters: a PEFT LoRA directory (``adapter_config.json``, ``adapter_model.safetensors``; from
        ``save_peft_adapters``, the assembled stage parts, or ``peft``).
      out: the directory to write: new or empty.

    Returns:
      ``out``.

    Raises:
      ValueError: one line, before anything is written: ``out`` not empty, a shard missing, an
        adapter config that is not plain LoRA, an adapter of a weight the checkpoint does not
        have, or of the wrong shape.
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from ._generate import read_peft_adapters

    src, dest = Path(checkpoint), Path(out)
    if not src.is_dir():
        raise ValueError(f"--model: {src} is not a directory")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"--out: {dest} exists and is not an empty directory")
    if dest.resolve() == src.resolve():
        raise ValueError("--out must differ from --model")
    config, tensors = read_peft_adapters(adapters)
    scale = np.float32(float(config["lora_alpha"]) / config["r"])
    shards = _shards(src)
    for shard in shards:
        if not shard.is_file():
            raise ValueError(f"{shard} (listed in {src / INDEX}) does not exist")
    modules = {n.removesuffix(".lora_A.weight") for n in tensors if n.endswith(".lora_A.weight")}
    targets = {m.removeprefix(PREFIX) + ".weight": m for m in modules}
    where: dict[str, Path] = {}
    for shard in shards:  # headers only: every adapter checked before a byte is written
        with safe_open(str(shard), framework="numpy") as f:
            for name in f.keys():
                if name in targets:
                    where[name] = shard
                    out_dim, in_dim = f.get_slice(name).get_shape()
                    a, b = tensors[targets[name] + ".lora_A.weight"], tensors[targets[name] + ".lora_B.weight"]
                    if a.shape[1] != in_dim or b.shape[0] != out_dim or a.shape[0] != b.shape[1]:
                        raise ValueError(
                            f"adapters: {targets[name]}: lora_A {a.shape} and lora_B {b.shape} do not fit "
                            f"{name} {(out_dim, in_dim)}"
                        )
    missing = sorted(set(targets) - set(where))
    if missing:
        raise ValueError(f"adapters: {len(missing)} adapted weights are not in {src}, e.g. {missing[0]}")
    dest.mkdir(parents=True, exist_ok=True)
    for shard in shards:
        merged: dict[str, np.ndarray] = {}
        with safe_open(str(shard), framework="numpy") as f:
            meta = f.metadata() or {"format": "pt"}
            for name in f.keys():
                w = f.get_tensor(name)
                if name in targets:
                    m = targets[name]
                    a = np.asarray(tensors[m + ".lora_A.weight"], np.float32)  # (r, in)
                    b = np.asarray(tensors[m + ".lora_B.weight"], np.float32)  # (out, r)
                    w = (w.astype(np.float32) + scale * (b @ a)).astype(w.dtype)
                merged[name] = w
        tmp = dest / f".{shard.name}.tmp"
        save_file(merged, str(tmp), metadata=meta)
        os.replace(tmp, dest / shard.name)
        default_mode(dest / shard.name)
        del merged
    for extra in sorted(src.iterdir()):  # config, index, tokenizer files: copied as they are
        if extra.is_file() and extra.suffix != ".safetensors":
            shutil.copyfile(extra, dest / extra.name)
    return dest
