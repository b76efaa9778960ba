"""Pseudo-gradient compression: codecs, error feedback and the wire format.

The host API (``encode``, ``decode``, ``read_header``, ``StreamDecoder``, ``weighted_mean``,
``packed_to_bytes``, ``packed_to_chunks``) is numpy-only and does not import jax, so the swarm
layer can use it. The device API (``device_encode``, ``init_error_feedback``, ``simulated``, ``ErrorFeedbackState``)
imports jax on first access.

Codecs (see ``docs/compression.md`` for byte costs, error bounds and when to use which):

======  =============================================  ==================================
name    format                                          bytes per float32 (large leaf)
======  =============================================  ==================================
fp32    IEEE float32, lossless                          1
bf16    bfloat16, round-to-nearest (or stochastic)      0.5
int8    blockwise absmax int8, bf16 scale per block     (B + 2) / (4 B)   (0.258 at B = 64)
int4    blockwise absmax int4, two a byte, bf16 scale   (B / 2 + 2) / (4 B) (0.133 at B = 64)
fp4     E2M1 values, E8M0 power-of-two block scale (MX) (B / 2 + 1) / (4 B) (0.133 at B = 32)
int2    2-bit midrise grid, bf16 step of 1.25 mean|x|    (B / 4 + 2) / (4 B) (0.070 at B = 64)
sign    scaled sign: 1 bit, bf16 mean|x| per block      (B / 8 + 2) / (4 B) (0.039 at B = 64)
topk    k = ceil(fraction n) largest magnitudes         2 fraction (uint32 index + float32)
======  =============================================  ==================================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._codec_value import Codec as Codec
from ._decode import StreamDecoder as StreamDecoder
from ._decode import decode as decode
from ._errors import NonFiniteError as NonFiniteError
from ._errors import WireFormatError as WireFormatError
from ._formats import CODECS as CODECS
from ._formats import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from ._formats import DEFAULT_TOPK_FRACTION as DEFAULT_TOPK_FRACTION
from ._formats import MAX_ABS as MAX_ABS
from ._formats import dequantize as dequantize
from ._formats import mean_codec_options as mean_codec_options
from ._formats import part_dtypes as part_dtypes
from ._formats import part_lengths as part_lengths
from ._formats import payload_nbytes as payload_nbytes
from ._formats import resolve as resolve_codec  # noqa: F401 - public (in __all__)
from ._formats import topk_count as topk_count
from ._host import encode as encode
from ._host import host_pack as host_pack
from ._host import payload_ratio as payload_ratio
from ._host import weighted_mean as weighted_mean
from ._parts import GRID as GRID
from ._parts import PartLayout as PartLayout
from ._parts import RangeDecoder as RangeDecoder
from ._parts import part_chunks as part_chunks
from ._wire import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES
from ._wire import DEFAULT_MAX_DECODED_BYTES as DEFAULT_MAX_DECODED_BYTES
from ._wire import FORMAT_VERSION as FORMAT_VERSION
from ._wire import MAGIC as MAGIC
from ._wire import PREFIX_NBYTES as PREFIX_NBYTES
from ._wire import LeafInfo as LeafInfo
from ._wire import LeafSpec as LeafSpec
from ._wire import Manifest as Manifest
from ._wire import Packed as Packed
from ._wire import message_nbytes as message_nbytes
from ._wire import packed_to_bytes as packed_to_bytes
from ._wire import packed_to_chunks as packed_to_chunks
from ._wire import read_header as read_header

_DEVICE = {
    "ErrorFeedbackState",
    "SimulatedCodecImpl",
    "device_encode",
    "init_error_feedback",
    "simulated",
}

if TYPE_CHECKING:  # pragma: no cover
    from ._device import ErrorFeedbackState as ErrorFeedbackState
    from ._device import SimulatedCodecImpl as SimulatedCodecImpl
    from ._device import device_encode as device_encode
    from ._device import init_error_feedback as init_error_feedback
    from ._device import simulated as simulated

# every name imported above but this module's own helpers, and the device names
__all__ = sorted(
    {n for n in globals() if not n.startswith("_")} - {"annotations", "importlib", "TYPE_CHECKING", "Any"} | _DEVICE
)


def __getattr__(name: str) -> Any:
    if name in _DEVICE:
        value = getattr(importlib.import_module(f"{__name__}._device"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ravnest_jax.compress' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _DEVICE)
