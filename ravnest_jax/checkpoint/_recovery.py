"""Damaged checkpoints, told in one line: orbax's own logging and tensorstore's late callbacks
kept off the console while a checkpoint is read, the ``fresh`` start, and the refusal of a
directory that holds only unreadable (``<step>.corrupt``) checkpoints.

Reading a damaged step makes orbax log an ``ERROR`` through absl for every metadata file it
cannot parse (three times per step: the manager, ``all_steps`` and the restore), and a failed
tensorstore read leaves the reads still in flight to complete after orbax closed its event loop:
each one's callback raises ``RuntimeError('Event loop is closed')`` in a tensorstore thread,
which Python prints as a five-line traceback (hundreds of them for a model of many arrays).
A failed read of one item can also leave orbax's read of another item as an asyncio task whose
tensorstore error nobody retrieves: when that task is collected (at any later time, often after
the restore returned), asyncio logs "Task exception was never retrieved" with tensorstore's
whole spec dump. None of it says more than the one
:class:`~ravnest_jax.checkpoint.CheckpointError` the :class:`~ravnest_jax.checkpoint.Checkpointer`
raises, so all three are sent to the ``ravnest_jax.checkpoint`` logger at DEBUG level instead.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("ravnest_jax.checkpoint")

_STEP = re.compile(r"^\d+$")
_QUARANTINED = re.compile(r"^(\d+)\.corrupt(\.\d+)?$")
#: the name of the folder ``fresh=True`` moves a directory's earlier checkpoints into
SET_ASIDE_PREFIX = "previous-"


class _QuietReads(logging.Filter):
    """On the ``absl`` logger: while a read is in progress (``depth`` > 0, any thread: orbax logs
    from its own thread pools), its records below CRITICAL go to DEBUG on our logger."""

    def __init__(self) -> None:
        super().__init__("rj-quiet-reads")
        self.depth = 0
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.depth and record.levelno < logging.CRITICAL:
            log.debug("orbax (while reading a checkpoint): %s", record.getMessage())
            return False
        return True


class _UnretrievedReads(logging.Filter):
    """On the ``asyncio`` logger, for the life of the process: "Task exception was never
    retrieved" for a tensorstore read error (its message carries ``tensorstore_spec``) goes to
    DEBUG on our logger; every other record passes."""

    def __init__(self) -> None:
        super().__init__("rj-unretrieved-reads")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and "tensorstore_spec" in str(exc) and "never retrieved" in str(record.msg):
            log.debug("tensorstore read failed in a task nobody awaited: %s", str(exc).split("[", 1)[0])
            return False
        return True


_filter = _QuietReads()
_installed = False
_install_lock = threading.Lock()


def _late_event_loop_callback(u: Any) -> bool:
    """Whether an unraisable exception is a tensorstore read completing after orbax's event loop
    closed (``call_soon_threadsafe`` on a closed loop): harmless, the restore already failed."""
    e = u.exc_value
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
        return False
    tb = u.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("asyncio/base_events.py")


def install() -> None:
    """Installs the absl filter, the asyncio filter and the unraisable-exception filter, once
    per process. The last passes every other unraisable exception to the hook that was there before."""
    global _installed
    with _install_lock:
        if _installed:
            return
        logging.getLogger("absl").addFilter(_filter)
        logging.getLogger("asyncio").addFilter(_UnretrievedReads())
        previous = sys.unraisablehook

        def hook(u: Any) -> None:
            if _late_event_loop_callback(u):
                log.debug("tensorstore read finished after a failed restore: %s", u.exc_value)
                return
            previous(u)

        sys.unraisablehook = hook
        _installed = True


@contextlib.contextmanager
def quiet_reads() -> Iterator[None]:
    """Within: orbax's absl log records (below CRITICAL) go to DEBUG on
    ``ravnest_jax.checkpoint`` instead of the console."""
    install()
    with _filter.lock:
        _filter.depth += 1
    try:
        yield
    finally:
        with _filter.lock:
            _filter.depth -= 1


def quarantined_steps(directory: Path) -> list[str]:
    """Names of the ``<step>.corrupt[.<n>]`` entries in ``directory``, by step, newest first."""
    try:
        names = [p.name for p in directory.iterdir() if _QUARANTINED.match(p.name)]
    except OSError:
        return []
    return sorted(names, key=lambda n: (int(_QUARANTINED.match(n).group(1)), n), reverse=True)  # type: ignore[union-attr]


def set_aside(directory: Path) -> Path | None:
    """``fresh=True``: moves every checkpoint step of ``directory`` (``<step>`` and
    ``<step>.corrupt[.<n>]``) into a new ``directory/previous-<UTC time>/`` (nothing is deleted)
    and returns that folder, or None when there was nothing to move.

    Raises:
      OSError: a step could not be moved.
    """
    try:
        steps = [p for p in directory.iterdir() if p.is_dir() and (_STEP.match(p.name) or _QUARANTINED.match(p.name))]
    except FileNotFoundError:
        return None
    if not steps:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = directory / f"{SET_ASIDE_PREFIX}{stamp}"
    n = 1
    while dest.exists():
        dest = directory / f"{SET_ASIDE_PREFIX}{stamp}.{n}"
        n += 1
    dest.mkdir()
    for p in steps:
        p.rename(dest / p.name)
    log.warning("fresh start in %s: its earlier checkpoints (%d) were moved to %s", directory, len(steps), dest)
    return dest


def refusal(directory: Path, names: list[str]) -> str:
    """The one line that refuses a directory holding only unreadable checkpoints."""
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (
        f"checkpoint directory {directory} has no readable checkpoint, only unreadable ones an earlier run "
        f"moved aside ({shown}): not starting over from step 0 by itself; pass fresh=True (--fresh on the "
        f"command line) to start from step 0 (they are kept, moved to {directory}/{SET_ASIDE_PREFIX}<time>/)"
    )


def all_unreadable(directory: Path, errors: list[tuple[int, str, str]]) -> str:
    """The one line of a restore that found no readable step: ``errors`` holds ``(step, brief
    error, where it was moved)``, newest first."""
    tried = ", ".join(str(s) for s, _, _ in errors)
    first_step, first_error, _ = errors[0]
    if len(first_error) > 200:
        first_error = first_error[:197] + "..."
    moved = ", ".join(Path(m).name if m.startswith(str(directory)) else m for _, _, m in errors)
    return (
        f"no readable checkpoint in {directory}: tried step{'s' if len(errors) > 1 else ''} {tried}, "
        f"none could be read (step {first_step}: {first_error}); moved to {directory}/{{{moved}}}; "
        f"to start from step 0 pass fresh=True (--fresh on the command line)"
    )
