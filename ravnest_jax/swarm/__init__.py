"""The swarm: rendezvous service, aiohttp peer mesh and fault-tolerant all-reduce.

This package never imports jax: it moves numpy float32 buffers and bytes.
"""

from ._codec import available_codecs as available_codecs
from ._peer import Swarm as Swarm
from ._preflight import check_listen as check_listen
from ._preflight import check_rendezvous as check_rendezvous
from ._preflight import read_token as read_token
from ._rendezvous import Rendezvous as Rendezvous
from ._rendezvous_serve import serve as serve_rendezvous
from ._types import ManifestMismatch as ManifestMismatch
from ._types import PeerInfo as PeerInfo
from ._types import RoundFailed as RoundFailed
from ._types import RoundRecord as RoundRecord
from ._types import SwarmError as SwarmError
from ._types import Timeouts as Timeouts

__all__ = [
    "ManifestMismatch",
    "PeerInfo",
    "Rendezvous",
    "RoundFailed",
    "RoundRecord",
    "Swarm",
    "SwarmError",
    "Timeouts",
    "available_codecs",
    "check_listen",
    "check_rendezvous",
    "read_token",
    "serve_rendezvous",
]
