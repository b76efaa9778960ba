"""The parameters of a Hugging Face ``config.json`` (a decoder-only transformer), or of its LoRA
adapters, for ``ravnest-jax plan --config``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _hf_sizes(config: str) -> dict[str, Any]:
    """The sizes of a Hugging Face ``config.json`` (a file, its directory, or a preset name)."""
    path = Path(config)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--config {config}: the directory has no config.json")
        path = path / "config.json"
    if path.is_file():
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--config {config}: not a readable JSON file ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"--config {config}: not a config.json (a JSON object of the model's sizes)")
        return d
    try:
        from ravnest_jax.models import PRESETS
    except ImportError:
        PRESETS = {}
    if config in PRESETS:
        return dict(PRESETS[config])
    raise ValueError(
        f"--config {config}: no such file or directory"
        + (f", and not a preset ({', '.join(PRESETS)})" if PRESETS else "")
    )


def params_of_config(config: str, lora_rank: int | None = None) -> int:
    """Parameters of a decoder-only transformer's ``config.json`` (Llama / Mistral / Qwen
    layout), or of its LoRA adapters on every projection with ``lora_rank``.

    Raises:
      ValueError: the file is missing or lacks a size (one line naming it).
    """
    if lora_rank is not None and (not isinstance(lora_rank, int) or lora_rank < 1):
        raise ValueError(f"--lora-rank must be an int >= 1, got {lora_rank!r}")
    c = _hf_sizes(config)
    try:
        d, ff, layers, vocab = (
            int(c[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
        )
        heads = int(c["num_attention_heads"])
    except KeyError as e:
        raise ValueError(f"--config {config}: no {e} in it") from None
    except (TypeError, ValueError):
        raise ValueError(f"--config {config}: a size is not a whole number") from None
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or d // heads)
    shapes = {
        "q": (d, heads * hd),
        "k": (d, kv * hd),
        "v": (d, kv * hd),
        "o": (heads * hd, d),
        "gate": (d, ff),
        "up": (d, ff),
        "down": (ff, d),
    }
    if lora_rank:
        return layers * sum(lora_rank * (i + o) for i, o in shapes.values())
    per_layer = sum(i * o for i, o in shapes.values()) + 2 * d
    emb = vocab * d * (1 if c.get("tie_word_embeddings") else 2)
    return layers * per_layer + emb + d
