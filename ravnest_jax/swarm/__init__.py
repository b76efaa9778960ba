"""The swarm: rendezvous service, aiohttp peer mesh and fault-tolerant all-reduce.

This package never imports jax: it moves numpy float32 buffers and bytes.
"""

from ._activations import ActivationLink as ActivationLink
from ._activations import PipelineBroken as PipelineBroken
from ._activations import encoded_activation as encoded_activation
from ._allreduce import AllReduce as AllReduce
from ._codec import available_codecs as available_codecs
from ._codec import check_codec as check_codec
from ._codec import decode_activation as decode_activation
from ._codec import decode_part as decode_part
from ._codec import encode_part as encode_part
from ._http import HTTPStatusError as HTTPStatusError
from ._http import signed_json as signed_json
from ._peer import Swarm as Swarm
from ._preflight import check_listen as check_listen
from ._preflight import check_rendezvous as check_rendezvous
from ._preflight import read_token as read_token
from ._rendezvous import Rendezvous as Rendezvous
from ._rendezvous_serve import serve as serve_rendezvous
from ._types import TLS as TLS
from ._types import ManifestMismatch as ManifestMismatch
from ._types import PeerInfo as PeerInfo
from ._types import RoundFailed as RoundFailed
from ._types import RoundRecord as RoundRecord
from ._types import SwarmError as SwarmError
from ._types import Timeouts as Timeouts
from ._votes import diverged_peers as diverged_peers

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
    "decode_activation",
    "decode_part",
    "diverged_peers",
    "encode_part",
    "encoded_activation",
    "read_token",
    "serve_rendezvous",
    "signed_json",
]
