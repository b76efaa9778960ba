"""The swarm: rendezvous service, aiohttp peer mesh and fault-tolerant all-reduce.

This package never imports jax: it moves numpy float32 buffers and bytes. Three rooms:
:mod:`.wire` (what both sides share), :mod:`.rendezvous` and :mod:`.peer`, each of the last two
importing the wire only.
"""

from .peer._activations import ActivationLink as ActivationLink
from .peer._activations import PipelineBroken as PipelineBroken
from .peer._activations import encoded_activation as encoded_activation
from .peer._allreduce import AllReduce as AllReduce
from .peer._peer import Swarm as Swarm
from .peer._preflight import check_listen as check_listen
from .peer._preflight import check_rendezvous as check_rendezvous
from .peer._preflight import preflight as preflight
from .peer._preflight import read_token as read_token
from .rendezvous._rendezvous import Rendezvous as Rendezvous
from .rendezvous._rendezvous import serve as serve_rendezvous
from .rendezvous._rounds import diverged_peers as diverged_peers
from .wire._codec import available_codecs as available_codecs
from .wire._codec import check_codec as check_codec
from .wire._codec import decode_activation as decode_activation
from .wire._codec import decode_part as decode_part
from .wire._codec import encode_part as encode_part
from .wire._http import HTTPStatusError as HTTPStatusError
from .wire._http import signed_json as signed_json
from .wire._types import TLS as TLS
from .wire._types import ManifestMismatch as ManifestMismatch
from .wire._types import PeerInfo as PeerInfo
from .wire._types import RoundFailed as RoundFailed
from .wire._types import RoundRecord as RoundRecord
from .wire._types import SwarmError as SwarmError
from .wire._types import Timeouts as Timeouts

__all__ = [
    "TLS",
    "ActivationLink",
    "AllReduce",
    "HTTPStatusError",
    "ManifestMismatch",
    "PeerInfo",
    "PipelineBroken",
    "Rendezvous",
    "RoundFailed",
    "RoundRecord",
    "Swarm",
    "SwarmError",
    "Timeouts",
    "available_codecs",
    "check_codec",
    "check_listen",
    "check_rendezvous",
    "preflight",
    "decode_activation",
    "decode_part",
    "diverged_peers",
    "encode_part",
    "encoded_activation",
    "read_token",
    "serve_rendezvous",
    "signed_json",
]
