"""Files written for users (exported checkpoints, adapters): the mode a newly created file gets.

``safetensors``' ``save_file`` creates its file with mode 0600 (owner only): an exported model
that another user, a web server or a container cannot read. :func:`default_mode` puts such a file
back to what ``open(path, "w")`` gives: ``0o666 & ~umask`` (0644 under the usual umask 022)."""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process' umask (read from /proc on Linux: setting it to read it races with threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(path: str | Path) -> None:
    """Gives ``path`` the mode a newly created file has: ``0o666 & ~umask``."""
    os.chmod(path, 0o666 & ~umask())
