"""The swarm peer id kept with a checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

PEER_ID_FILE = "peer_id"


def persistent_peer_id(directory: str | os.PathLike[str]) -> str:
    """The swarm peer id kept with a checkpoint directory: read from ``<directory>/peer_id``, or
    made (16 random hex characters) and written there on first use. A peer restarted on the same
    directory is then the same peer to the swarm (its checkpoints, logs and status entries match).

    Raises:
      ValueError: the directory is a file, or the id file holds no usable id (1-64 characters of
        letters, digits, ``-``, ``_`` and ``.``).
      OSError: the directory cannot be created or the file written.
    """
    import re
    import secrets

    path = Path(directory).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} is a file")
    path.mkdir(parents=True, exist_ok=True)
    f = path / PEER_ID_FILE
    if not f.exists():
        tmp = path / f".{PEER_ID_FILE}.{os.getpid()}.tmp"
        tmp.write_text(secrets.token_hex(8) + "\n")
        try:  # two processes on one directory agree: the first link wins
            os.link(tmp, f)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    value = f.read_text().strip()
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", value):
        raise ValueError(f"{f} holds no usable peer id ({value[:40]!r}); delete it or pass a peer id")
    return value
