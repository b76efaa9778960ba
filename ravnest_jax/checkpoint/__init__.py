"""Checkpoint and exact resume of one peer with orbax (knows optimizer and sync state, not the
network). See ``docs/checkpointing.md``."""

from ._checkpointer import Checkpointer as Checkpointer
from ._checkpointer import CheckpointError as CheckpointError
from ._checkpointer import CorruptCheckpointWarning as CorruptCheckpointWarning
from ._checkpointer import NoReadableCheckpointError as NoReadableCheckpointError
from ._checkpointer import Restored as Restored
from ._peer_id import PEER_ID_FILE as PEER_ID_FILE
from ._peer_id import persistent_peer_id as persistent_peer_id
