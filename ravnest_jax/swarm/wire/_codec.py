"""The one place where the swarm touches the wire format (:mod:`ravnest_jax.compress`).

The butterfly sends parts of an encoded contribution as they are (:class:`PartLayout`,
:func:`part_chunks`: views of the encoded payload) and reads them as they stream in
(:class:`RangeDecoder`); the ring and the state transfer send one named float32 vector encoded
by a codec (:func:`encode_part`, :class:`PartDecoder`); a pipeline activation (or
activation-gradient) is one named array of a known shape, read with :class:`ActivationDecoder`.
The peer takes the rest of what it needs of :mod:`ravnest_jax.compress` from here (re-exported).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from ravnest_jax.compress import CODECS, Manifest, StreamDecoder, WireFormatError, encode
from ravnest_jax.compress import Codec as Codec
from ravnest_jax.compress import LeafSpec as LeafSpec
from ravnest_jax.compress import NonFiniteError as NonFiniteError
from ravnest_jax.compress import Packed as Packed
from ravnest_jax.compress import PartLayout as PartLayout
from ravnest_jax.compress import RangeDecoder as RangeDecoder
from ravnest_jax.compress import host_pack as host_pack
from ravnest_jax.compress import mean_codec_options as mean_codec_options
from ravnest_jax.compress import part_chunks as part_chunks
from ravnest_jax.compress import part_dtypes as part_dtypes
from ravnest_jax.compress import part_lengths as part_lengths


def available_codecs() -> tuple[str, ...]:
    """Codec names usable by the swarm."""
    return tuple(CODECS)


def check_codec(codec: str, options: dict[str, Any] | None = None) -> None:
    """Raise ``ValueError`` when ``codec`` is unknown or ``options`` do not apply to it."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; available: {', '.join(CODECS)}")
    encode({"probe": np.zeros(4, np.float32)}, codec=codec, **(options or {}))


def encode_part(name: str, vec: np.ndarray, codec: str, **options: Any) -> bytes:
    """Encode a float32 vector of shape ``(n,)`` under a leaf name. Returns the message bytes."""
    vec = np.ascontiguousarray(vec, dtype=np.float32)
    return encode({name: vec}, codec=codec, max_bytes=max(1 << 20, 8 * vec.size + (1 << 20)), **options)


def decode_part(data: bytes, *, name: str, length: int, codec: str) -> np.ndarray:
    """Decode a whole message at once (the owner's own result part)."""
    return decode_activation(data, name=name, shape=(length,), codec=codec)


def _expect_leaf(name: str, shape: tuple[int, ...], codec: str, hdr: Manifest) -> None:
    """Refuses a header that is not one leaf ``name`` of ``shape`` in ``codec``."""
    if hdr.codec != codec:
        raise WireFormatError(f"codec {hdr.codec!r}, expected {codec!r}")
    leaves = [(leaf.name, tuple(int(s) for s in leaf.shape)) for leaf in hdr.leaves]
    if leaves != [(name, shape)]:
        raise WireFormatError(f"leaves {leaves}, expected [({name!r}, {shape})]")


class ActivationDecoder:
    """Incremental decoder of one message holding a single leaf named ``name`` of shape
    ``shape`` in ``codec``: a pipeline activation (or activation-gradient), or, as
    :class:`PartDecoder`, a part of a round (a :class:`StreamDecoder` whose ``check`` is the
    expected leaf).

    ``feed`` raises :class:`WireFormatError` as soon as the header shows another leaf, shape or
    codec (before the payload is allocated), or when the message is garbage or exceeds
    ``max_bytes``; ``finish`` returns the float32 array of shape ``shape`` (finite: the decoder
    checks every value) or raises :class:`WireFormatError` (truncated, corrupt, non-finite).
    """

    def __init__(self, *, name: str, shape: tuple[int, ...], codec: str, max_bytes: int):
        self.name, self.shape, self.codec, self.max_bytes = name, tuple(int(s) for s in shape), codec, max_bytes
        self.nbytes = 0
        n = int(np.prod(self.shape, dtype=np.int64))
        check = partial(_expect_leaf, self.name, self.shape, codec)
        self._dec = StreamDecoder(max_bytes=max_bytes, max_decoded_bytes=4 * n + (1 << 16), check=check)

    def feed(self, chunk: bytes | memoryview) -> None:
        self.nbytes += len(chunk)
        if self.nbytes > self.max_bytes:
            raise WireFormatError(f"message longer than {self.max_bytes} bytes")
        self._dec.feed(chunk)

    def finish(self) -> np.ndarray:
        return self._dec.finish()[self.name].reshape(self.shape)


class PartDecoder(ActivationDecoder):
    """Incremental decoder of one part of a round, checked against the round manifest: the leaf
    ``name`` of ``length`` float32 elements in ``codec`` (:class:`ActivationDecoder` with shape
    ``(length,)``); ``finish`` returns the vector ``(length,)``.
    """

    def __init__(self, *, name: str, length: int, codec: str, max_bytes: int):
        super().__init__(name=name, shape=(int(length),), codec=codec, max_bytes=max_bytes)


def decode_activation(data: bytes | memoryview, *, name: str, shape: tuple[int, ...], codec: str) -> np.ndarray:
    """Decodes a whole activation message at once (float32, ``shape``); raises like
    :class:`ActivationDecoder`."""
    dec = ActivationDecoder(name=name, shape=shape, codec=codec, max_bytes=len(data))
    dec.feed(data)
    return dec.finish()
