"""The one place where the swarm touches a wire format.

Everything the all-reduce sends is one named float32 vector (a *part*) encoded by a codec.
:func:`encode_part` and :class:`PartDecoder` are the only functions the rest of the swarm uses;
they delegate to :mod:`ravnest_jax.compress` when it is importable and otherwise fall back to a
tiny private fp32 format (``codec="fp32"`` only), so the swarm works and is testable on its own.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np

try:  # the shared, jax-free wire format (branch `compress`)
    from ravnest_jax import compress as _compress  # type: ignore[attr-defined]

    _compress.encode  # noqa: B018 - make sure it is the real module
except Exception:  # pragma: no cover - depends on what is installed
    _compress = None


class WireFormatError(ValueError):
    """A message is not a valid encoding, or does not match what the round expects."""


class NonFiniteError(ValueError):
    """A vector holds NaN or infinity."""


if _compress is not None:  # share the exception types so callers catch one family
    WireFormatError = _compress.WireFormatError  # type: ignore[misc]  # noqa: F811
    NonFiniteError = _compress.NonFiniteError  # type: ignore[misc]  # noqa: F811

_MAGIC = b"RJS0"


def available_codecs() -> tuple[str, ...]:
    """Codec names usable by the swarm."""
    if _compress is not None:
        return tuple(_compress.CODECS)
    return ("fp32",)


def check_codec(codec: str) -> None:
    """Raise ``ValueError`` when ``codec`` is unknown."""
    if codec not in available_codecs():
        raise ValueError(f"unknown codec {codec!r}; available: {', '.join(available_codecs())}")


def encode_part(name: str, vec: np.ndarray, codec: str) -> bytes:
    """Encode a float32 vector of shape ``(n,)`` under a leaf name. Returns the message bytes."""
    vec = np.ascontiguousarray(vec, dtype=np.float32)
    if _compress is not None:
        return _compress.encode({name: vec}, codec=codec)
    check_codec(codec)
    header = msgpack.packb({"codec": codec, "leaves": [[name, [int(vec.shape[0])]]]})
    return b"".join([_MAGIC, struct.pack("<I", len(header)), header, vec.tobytes()])


class PartDecoder:
    """Incremental decoder of one part, checked against the round manifest.

    Args:
      name: expected leaf name.
      length: expected number of float32 elements.
      codec: expected codec name.
      max_bytes: the most bytes accepted in all.

    ``feed`` raises :class:`WireFormatError` as soon as the header is known and does not match
    (or the message is garbage, or longer than ``max_bytes``); ``finish`` returns the float32
    vector of shape ``(length,)`` or raises :class:`WireFormatError` (truncated) /
    :class:`NonFiniteError`.
    """

    def __init__(self, *, name: str, length: int, codec: str, max_bytes: int):
        self.name, self.length, self.codec, self.max_bytes = name, int(length), codec, max_bytes
        self.nbytes = 0
        self._header_ok = False
        if _compress is not None:
            self._dec = _compress.StreamDecoder(max_bytes=max_bytes)
        else:
            self._buf = bytearray()
            self._out: np.ndarray | None = None
            self._pos = 0

    # -- header checks -------------------------------------------------------------------
    def _check_manifest(self, codec: str, leaves: list[tuple[str, tuple[int, ...]]]) -> None:
        if codec != self.codec:
            raise WireFormatError(f"codec {codec!r} does not match the round's {self.codec!r}")
        if [(n, tuple(int(s) for s in shp)) for n, shp in leaves] != [(self.name,
                                                                         (self.length,))]:
            raise WireFormatError("leaf names/shapes do not match the round manifest")
        self._header_ok = True

    def feed(self, chunk: bytes) -> None:
        self.nbytes += len(chunk)
        if self.nbytes > self.max_bytes:
            raise WireFormatError(f"message longer than {self.max_bytes} bytes")
        if _compress is not None:
            self._dec.feed(chunk)
            hdr = self._dec.header
            if hdr is not None and not self._header_ok:
                self._check_manifest(*_manifest_of(hdr))
            return
        if self._out is not None:
            self._write(chunk)
            return
        self._buf += chunk
        if len(self._buf) < 8:
            return
        if bytes(self._buf[:4]) != _MAGIC:
            raise WireFormatError("not a ravnest swarm message")
        (hlen,) = struct.unpack("<I", self._buf[4:8])
        if hlen > 1 << 20:
            raise WireFormatError("header too long")
        if len(self._buf) < 8 + hlen:
            return
        try:
            hdr = msgpack.unpackb(bytes(self._buf[8:8 + hlen]))
            codec, leaves = hdr["codec"], [(str(n), tuple(s)) for n, s in hdr["leaves"]]
        except Exception as e:
            raise WireFormatError(f"bad header: {e}") from None
        self._check_manifest(codec, leaves)
        rest = bytes(self._buf[8 + hlen:])
        self._buf = bytearray()
        self._out = np.empty(self.length, dtype=np.float32)
        self._write(rest)

    def _write(self, data: bytes) -> None:
        assert self._out is not None
        raw = self._out.view(np.uint8)
        if self._pos + len(data) > raw.size:
            raise WireFormatError("message longer than its header says")
        raw[self._pos:self._pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._pos += len(data)

    def finish(self) -> np.ndarray:
        if _compress is not None:
            tree = self._dec.finish()
            if not self._header_ok:
                self._check_manifest(*_manifest_of(self._dec.header))
            vec = np.asarray(tree[self.name], dtype=np.float32).reshape(self.length)
        else:
            if self._out is None or self._pos != self._out.nbytes:
                raise WireFormatError("truncated message")
            vec = self._out
        if not np.isfinite(vec).all():
            raise NonFiniteError("part holds NaN or infinity")
        return vec


def _manifest_of(header: object) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:  # pragma: no cover
    """Adapt the compress header object to ``(codec, [(name, shape), ...])``."""
    if isinstance(header, dict):
        codec = header["codec"]
        leaves = header["leaves"]
    else:
        codec = header.codec
        leaves = header.leaves
    out = []
    for leaf in leaves:
        if isinstance(leaf, dict):
            out.append((leaf["name"], tuple(leaf["shape"])))
        elif hasattr(leaf, "name"):
            out.append((leaf.name, tuple(leaf.shape)))
        else:
            out.append((leaf[0], tuple(leaf[1])))
    return codec, out


def decode_part(data: bytes, *, name: str, length: int, codec: str) -> np.ndarray:
    """Decode a whole message at once (the owner's own result part)."""
    dec = PartDecoder(name=name, length=length, codec=codec, max_bytes=len(data))
    dec.feed(data)
    return dec.finish()
