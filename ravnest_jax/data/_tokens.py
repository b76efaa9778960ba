"""Token data for language-model fine-tuning: text tokenised with a Hugging Face ``tokenizer.json``
(the ``tokenizers`` library), packed into fixed-length sequences, sharded per peer, and read in
an order that depends only on (seed, shard, position), so that a checkpointed position resumes
the exact same batches.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` or from a checkpoint directory holding
    one.

    Raises:
      ValueError: no such file, or it is not a tokenizer (the library's message included).
    """
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"no tokenizer file {p}")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception with its message
        raise ValueError(f"{p} is not a tokenizers tokenizer.json: {e}") from None


def eos_token_id(checkpoint: str | os.PathLike[str]) -> int | None:
    """The end-of-text token id of a Hugging Face checkpoint directory (``config.json``'s
    ``eos_token_id``, its first if a list), or None."""
    cfg = Path(checkpoint) / "config.json"
    if not cfg.is_file():
        return None
    eos = json.loads(cfg.read_text()).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def tokenize(
    documents: Iterable[str], tokenizer: Any, *, eos_id: int | None = None, batch_size: int = 256
) -> np.ndarray:
    """Tokenises ``documents`` and concatenates them, ``eos_id`` after each (when given).

    Returns:
      int32 ``(num_tokens,)``.

    Raises:
      ValueError: the documents hold no tokens.
    """
    parts: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            ids = enc.ids + ([eos_id] if eos_id is not None else [])
            parts.append(np.asarray(ids, np.int32))
        batch.clear()

    for doc in documents:
        batch.append(doc)
        if len(batch) >= batch_size:
            flush()
    if batch:
        flush()
    tokens = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    if tokens.size == 0:
        raise ValueError("the text has no tokens")
    return tokens


class PackedTokens:
    """Fixed-length training sequences from one token stream, one shard per peer, with an exact
    position.

    The stream is cut into ``n = (len(tokens) - 1) // seq_len`` windows of ``seq_len + 1``
    tokens (inputs and their next-token targets, packed across document boundaries); shard
    ``shard`` of ``num_shards`` owns the windows ``i`` with ``i % num_shards == shard``. Batch
    ``k`` holds windows ``k * batch .. (k + 1) * batch - 1`` of the shard's order, a fresh
    permutation each epoch from ``(seed, shard, epoch)``: a function of the position only, so
    :meth:`state` / :meth:`load_state` (saved in a checkpoint's ``extra``) resume exactly.

    Args:
      tokens: int32 ``(num_tokens,)``.
      seq_len: tokens per sequence (the model's input length).
      batch: sequences per batch.
      shard, num_shards: this peer's shard (0-based) of how many.
      seed: the order's seed (the same on every peer; shards differ by ``shard``).

    Raises:
      ValueError: a bad size, or the shard holds fewer windows than one batch.
    """

    def __init__(
        self, tokens: np.ndarray, *, seq_len: int, batch: int, shard: int = 0, num_shards: int = 1, seed: int = 0
    ):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-d integer array, got {tokens.dtype} {tokens.shape}")
        for name, v in (("seq_len", seq_len), ("batch", batch), ("num_shards", num_shards)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(shard, int) or not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards}), got {shard!r}")
        self.tokens = tokens.astype(np.int32, copy=False)
        self.seq_len, self.batch, self.shard, self.num_shards, self.seed = seq_len, batch, shard, num_shards, seed
        windows = (len(tokens) - 1) // seq_len
        self.windows = np.arange(shard, windows, num_shards, dtype=np.int64)
        if len(self.windows) < batch:
            raise ValueError(
                f"shard {shard} of {num_shards} has {len(self.windows)} sequences of {seq_len} tokens, fewer than one "
                f"batch of {batch}: {len(tokens)} tokens is too little text"
            )
        self.position = 0  # batches taken
        self._epoch, self._order = -1, self.windows

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self.shard, epoch])
            self._order, self._epoch = rng.permutation(self.windows), epoch
        return self._order

    def batch_at(self, position: int) -> np.ndarray:
        """Batch number ``position``: int32 ``(batch, seq_len + 1)``."""
        n = len(self.windows)
        rows = []
        for g in range(position * self.batch, (position + 1) * self.batch):
            w = int(self._order_of(g // n)[g % n])
            rows.append(self.tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1])
        return np.stack(rows)

    def next(self) -> np.ndarray:
        """The next batch, int32 ``(batch, seq_len + 1)``; advances :attr:`position`."""
        out = self.batch_at(self.position)
        self.position += 1
        return out

    @property
    def epoch(self) -> float:
        """Passes over this shard so far."""
        return self.position * self.batch / len(self.windows)

    def state(self) -> dict[str, int]:
        """What to checkpoint: ``{"position", "shard", "num_shards", "seed"}``."""
        return {"position": self.position, "shard": self.shard, "num_shards": self.num_shards, "seed": self.seed}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continues from a :meth:`state`.

        Raises:
          ValueError: the state is of another shard layout or seed (resuming it would repeat or
            skip data).
        """
        for k in ("shard", "num_shards", "seed"):
            if int(state[k]) != getattr(self, k):
                raise ValueError(f"data state has {k}={int(state[k])}, this loader {getattr(self, k)}")
        self.position = int(state["position"])


def split_held_out(tokens: np.ndarray, fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held_out)``: the last ``fraction`` of the stream is held out for evaluation."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
    cut = int(len(tokens) * (1 - fraction))
    return tokens[:cut], tokens[cut:]
