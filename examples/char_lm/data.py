"""The text the char-LM trains on: bytes of real text (the standard library's ``.py`` files,
or a file), split into train and eval, and random windows of it as int32 batches."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

VOCAB = 256


# ----------------------------------------------------------------------------------------- data
def stdlib_files() -> list[Path]:
    """The ``.py`` files of this interpreter's standard library (site-packages excluded), sorted;
    of the folder ``$CHAR_LM_STDLIB`` instead when that is set (the same text under another
    Python, for example another machine's interpreter).

    Raises:
      ValueError: ``$CHAR_LM_STDLIB`` is not a folder.
    """
    env = os.environ.get("CHAR_LM_STDLIB")
    if env and not Path(env).is_dir():
        raise ValueError(f"CHAR_LM_STDLIB: not a folder: {env}")
    root = Path(env or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel and rel[0] in ("site-packages", "dist-packages"):
            continue
        files.append(path)
    return files


def load_corpus(
    text: str | None = None, *, eval_every: int = 10, max_bytes: int = 64 << 20
) -> tuple[np.ndarray, np.ndarray]:
    """Loads real text as bytes.

    Args:
      text: path of a text file; ``None`` means the standard library's ``.py`` files, split by
        file (every ``eval_every``-th file, in sorted order, goes to eval).
      eval_every: see above.
      max_bytes: cap on the bytes read (the stdlib is ~30 MB).

    Returns:
      ``(train, eval)``: 1-D uint8 arrays of bytes (vocabulary 256).

    Raises:
      ValueError: the text is missing or too short to make batches.
    """
    if text is not None:
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"--text: no such file: {text}")
        data = np.frombuffer(path.read_bytes()[:max_bytes], dtype=np.uint8)
        if data.size < 4096:
            raise ValueError(f"--text: {text} has {data.size} bytes; need at least 4096")
        cut = int(data.size * 0.9)
        return data[:cut].copy(), data[cut:].copy()
    train, evals, total = [], [], 0
    for i, path in enumerate(stdlib_files()):
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        (evals if i % eval_every == 0 else train).append(raw)
        total += len(raw)
        if total >= max_bytes:
            break
    if not train or not evals:
        raise ValueError("found no standard-library .py files; pass --text FILE")
    sep = b"\n\n"
    return (
        np.frombuffer(sep.join(train), dtype=np.uint8).copy(),
        np.frombuffer(sep.join(evals), dtype=np.uint8).copy(),
    )


def sample_batch(data: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> np.ndarray:
    """Random windows of ``seq_len + 1`` bytes: int32 array ``(batch, seq_len + 1)``."""
    starts = rng.integers(0, data.size - seq_len - 1, size=batch)
    return data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def eval_batches(data: np.ndarray, *, batch: int, seq_len: int, num_batches: int, seed: int = 1234) -> np.ndarray:
    """Fixed eval windows: int32 array ``(num_batches, batch, seq_len + 1)``."""
    rng = np.random.default_rng(seed)
    return np.stack([sample_batch(data, rng, batch, seq_len) for _ in range(num_batches)])


def check_text(text: str | None) -> None:
    """Fails fast (one line) on a ``--text`` that :func:`load_corpus` would refuse."""
    if text is None:
        return
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"--text: no such file: {text}")
    if path.stat().st_size < 4096:
        raise ValueError(f"--text: {text} has {path.stat().st_size} bytes; need at least 4096")
