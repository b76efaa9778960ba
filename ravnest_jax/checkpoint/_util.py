"""Small helpers of the Checkpointer: versions, the directory lock, argument checks, errors in
one line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no checkpoint in the directory could be read."""


def library_version() -> str:
    from ravnest_jax._version import __version__

    return __version__


def orbax_version() -> str:
    try:
        from importlib.metadata import version

        return version("orbax-checkpoint")
    except Exception:  # pragma: no cover - metadata missing in odd installs
        return "unknown"


def lock_directory(path: Path):
    """Holds an exclusive ``flock`` on ``path/.rj-lock`` (the file is kept; the lock ends with
    the process). Returns the open lock file.

    Raises:
      CheckpointError: the lock is held by another Checkpointer.
    """
    import fcntl

    path.mkdir(parents=True, exist_ok=True)
    f = open(path / ".rj-lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} is in use by another Checkpointer (process {holder}): "
            "give every peer its own directory"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def brief(e: BaseException, limit: int = 500) -> str:
    """``e`` as one short line: tensorstore appends its whole spec (JSON, or a multi-line repr
    after "See full TensorStore details") to a read error; what failed comes before it."""
    text = str(e)
    for cut in (" [tensorstore_spec", "See full TensorStore details"):
        text = text.split(cut, 1)[0]
    lines = text.strip().splitlines()
    text = lines[0].rstrip(" .") if lines else ""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
