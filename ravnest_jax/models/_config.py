"""The configuration of a decoder-only transformer in the Llama 3 / Qwen 2.5 / Qwen 3 / Mistral
layout, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The shape of a decoder-only transformer (names as in Hugging Face's ``config.json``).

    Attributes:
      model_type: ``"llama"``, ``"mistral"``, ``"qwen2"`` or ``"qwen3"``.
      vocab_size, hidden_size, intermediate_size, num_hidden_layers: the sizes.
      num_attention_heads, num_key_value_heads: query heads and key/value heads (grouped-query
        attention: the first divides by the second).
      head_dim: per head (default ``hidden_size // num_attention_heads``; Qwen 3 sets it).
      rms_norm_eps: the RMSNorm epsilon.
      rope_theta: the RoPE base; ``rope_scaling``: ``None`` or Llama 3's
        ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}``.
      tie_word_embeddings: the output projection is the embedding matrix.
      attention_bias: q, k, v projections have biases (Qwen 2.5 does).
      qk_norm: RMSNorm over each head of q and k before RoPE (Qwen 3).
      max_position_embeddings: the longest sequence (tokens).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"config: {name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.num_attention_heads < 1 or self.num_key_value_heads < 1:
            raise ValueError("config: num_attention_heads and num_key_value_heads must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"config: head_dim must be even for RoPE, got {self.head_dim}")
        rope = self.rope_scaling
        if rope is not None and rope.get("rope_type", rope.get("type")) not in ("llama3", "default"):
            raise ValueError(f"config: rope_scaling {rope!r} is not supported (only llama3 or default)")

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | Path) -> TransformerConfig:
        """From a Hugging Face ``config.json`` (a dict, or the path of the file or its directory).

        Raises:
          ValueError: an unsupported architecture, or a missing or bad field (named).
        """
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"no config.json at {path}")
            config = json.loads(path.read_text())
        c = dict(config)
        model_type = c.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {model_type!r} (architectures {c.get('architectures')}); "
                f"supported model_type: {', '.join(ARCHITECTURES)}"
            )
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if k not in c
        ]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        heads = int(c["num_attention_heads"])
        # transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; 4.x rope_theta and
        # rope_scaling at the top level
        params = dict(c.get("rope_parameters") or {})
        rope = c.get("rope_scaling") or ({k: v for k, v in params.items() if k != "rope_theta"} or None)
        if rope is not None and rope.get("rope_type", rope.get("type")) == "default":
            rope = None
        theta = c.get("rope_theta", params.get("rope_theta", 10000.0))
        return cls(
            model_type=model_type,
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_hidden_layers=int(c["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=dict(rope) if rope else None,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        )

    def num_params(self) -> int:
        """Parameters of the model (embedding counted once when tied)."""
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * hd * (h + 2 * kv) + h * hd * d + (hd * (h + 2 * kv) if self.attention_bias else 0)
        attn += 2 * hd if self.qk_norm else 0
        layer = attn + 3 * d * self.intermediate_size + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_hidden_layers * layer + d + head


def rope_frequencies(cfg: TransformerConfig) -> list[float]:
    """The RoPE inverse frequencies, ``head_dim // 2`` floats (Llama 3's scaling applied), as
    Hugging Face's ``_compute_llama3_parameters`` computes them."""
    dim = cfg.head_dim
    inv = [1.0 / (cfg.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
    rope = cfg.rope_scaling
    if rope is None:
        return inv
    factor = float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_len = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out
