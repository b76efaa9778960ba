"""ravnest_jax: decentralized DiLoCo training for JAX.

Public names are re-exported here and loaded on first use, so that the jax-free layers
(``ravnest_jax.swarm``, the wire format of ``ravnest_jax.compress``) can be imported without
importing jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .host_memory import cap_host_arenas as _cap_host_arenas

# the one import-time effect: before jax starts its threads (a long-running peer's RSS; see its docstring)
_cap_host_arenas()

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CheckpointError": "ravnest_jax.checkpoint",
    "Codec": "ravnest_jax.compress",
    "Checkpointer": "ravnest_jax.checkpoint",
    "CorruptCheckpointWarning": "ravnest_jax.checkpoint",
    "DiLoCo": "ravnest_jax.optim",
    "DiLoCoState": "ravnest_jax.optim",
    "Restored": "ravnest_jax.checkpoint",
    "RoundSnapshot": "ravnest_jax.optim",
    "SimulatedCodec": "ravnest_jax.optim",
    "default_outer": "ravnest_jax.optim",
    "diloco": "ravnest_jax.optim",
    "replicate": "ravnest_jax.optim",
    "unreplicate": "ravnest_jax.optim",
    "Swarm": "ravnest_jax.swarm",
    "AllReduce": "ravnest_jax.swarm",
    "TLS": "ravnest_jax.swarm",
    "Timeouts": "ravnest_jax.swarm",
    "RoundRecord": "ravnest_jax.swarm",
    "RoundFailed": "ravnest_jax.swarm",
    "ManifestMismatch": "ravnest_jax.swarm",
    "PeerInfo": "ravnest_jax.swarm",
    "OuterSync": "ravnest_jax.sync",
    "RoundMetrics": "ravnest_jax.sync",
    "Joined": "ravnest_jax.sync",
    "join_or_resume": "ravnest_jax.sync",
    "checkpoint_extra": "ravnest_jax.sync",
    "persistent_peer_id": "ravnest_jax.checkpoint",
    "enable_compilation_cache": "ravnest_jax._compile_cache",
}
_SUBMODULES = {
    "optim",
    "compress",
    "swarm",
    "sync",
    "checkpoint",
    "models",
    "data",
    "pipeline",
    "host_memory",
    "testing",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from . import checkpoint as checkpoint
    from . import host_memory as host_memory
    from . import optim as optim
    from . import pipeline as pipeline
    from . import testing as testing
    from ._compile_cache import enable_compilation_cache as enable_compilation_cache
    from .checkpoint import Checkpointer as Checkpointer
    from .checkpoint import CheckpointError as CheckpointError
    from .checkpoint import CorruptCheckpointWarning as CorruptCheckpointWarning
    from .checkpoint import Restored as Restored
    from .checkpoint import persistent_peer_id as persistent_peer_id
    from .compress import Codec as Codec
    from .optim import DiLoCo as DiLoCo
    from .optim import DiLoCoState as DiLoCoState
    from .optim import RoundSnapshot as RoundSnapshot
    from .optim import SimulatedCodec as SimulatedCodec
    from .optim import default_outer as default_outer
    from .optim import diloco as diloco
    from .optim import replicate as replicate
    from .optim import unreplicate as unreplicate
    from .swarm import TLS as TLS
    from .swarm import AllReduce as AllReduce
    from .swarm import ManifestMismatch as ManifestMismatch
    from .swarm import PeerInfo as PeerInfo
    from .swarm import RoundFailed as RoundFailed
    from .swarm import RoundRecord as RoundRecord
    from .swarm import Swarm as Swarm
    from .swarm import Timeouts as Timeouts
    from .sync import Joined as Joined
    from .sync import OuterSync as OuterSync
    from .sync import RoundMetrics as RoundMetrics
    from .sync import checkpoint_extra as checkpoint_extra
    from .sync import join_or_resume as join_or_resume

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'ravnest_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
