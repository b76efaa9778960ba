"""The wire format of a compressed pseudo-gradient pytree (jax-free).

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic b"RJPG"
    4       1     format version (1)
    5       1     flags (0)
    6       2     reserved (0)
    8       4     header_len: bytes of the msgpack header that follows the prefix
    12      8     payload_len: bytes of the payload that follows the header
    20      4     payload_crc32: zlib.crc32 of the payload
    24      4     header_crc32: zlib.crc32 of bytes 0..23 followed by the header
    28      ...   header: msgpack map {"codec": str,
                                       "leaves": [[name, shape, dtype, block_size, k], ...],
                                       "tree": nested structure (leaf indices in maps/arrays),
                                       "pad": bytes (optional, <= 64; the encoder uses it to
                                               start the payload at a multiple of 8 bytes)}
    ...     ...   payload: for each leaf in order, its parts (see ``_formats``), no padding

The header is validated completely (types, codec, dtypes, block sizes, shapes, and that the sum
of the per-leaf payload sizes implied by codec/shape/block size equals ``payload_len``) and the
declared sizes are checked against ``max_bytes`` / ``max_decoded_bytes`` before any buffer is
allocated for the payload or the decoded arrays. CRC-32 detects corruption, not tampering:
authenticate peers at the transport level.

The CRC-32 is zlib's (polynomial 0xEDB88320); it is computed with ISA-L's carry-less-multiply
implementation (``isal.isal_zlib.crc32``, the same values, about 3x faster than zlib 1.2's on
x86-64) when the ``isal`` package imports, else with ``zlib.crc32``.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from . import _formats as F
from . import _tree
from ._errors import NonFiniteError, WireFormatError

try:  # the same CRC-32 as zlib.crc32, computed with PCLMULQDQ / PMULL
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    from zlib import crc32 as _crc32

CRC32_IMPL: str = f"{_crc32.__module__}.crc32"
"""Which function computes the CRC-32 (``isal.isal_zlib.crc32`` or ``zlib.crc32``)."""

MAGIC = b"RJPG"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sBBHIQII")
PREFIX_NBYTES: int = _PREFIX.size  # 28
"""Bytes of the fixed prefix; :func:`read_header` needs ``PREFIX_NBYTES + header_len`` bytes."""

DEFAULT_MAX_BYTES: int = 1 << 32
"""Default limit on the size of one message (4 GiB), checked against the declared sizes."""

DEFAULT_MAX_DECODED_BYTES: int = 1 << 34
"""Default limit on the float32 bytes a message decodes to (16 GiB; topk messages are small but
decode to full size)."""

MAX_HEADER_BYTES = 64 << 20
MAX_LEAVES = 1 << 20
MAX_NDIM = 32
MAX_NAME_LEN = 4096
ALLOWED_DTYPES = ("float32", "float16", "bfloat16", "float64")
_ALIGN = 8


class LeafSpec(NamedTuple):
    """Static description of one encoded leaf (hashable; part of :class:`Packed`'s tree aux).

    Attributes:
      name: path name, for example ``"layer0/w"``.
      shape: the leaf's shape.
      dtype: the source dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float64"``);
        informational, decode always yields float32.
      block_size: elements per block (int8/int4/fp4) or 0.
      k: elements sent (topk) or 0.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    block_size: int
    k: int


class Packed:
    """Encoded pytree before serialisation: the output of ``device_encode`` (jax arrays) or of the
    host encoder (numpy arrays). :func:`packed_to_bytes` turns it into wire bytes.

    A pytree node (registered with jax by ``ravnest_jax.compress._device``): children are
    ``parts`` (per leaf, a tuple of arrays: uint8/uint16/uint32 payloads and scales; a part from
    ``device_encode`` above ``SEGMENT_BYTES`` is a tuple of consecutive 1-D slices) and
    ``ok`` (per leaf, a bool scalar: False if the input had NaN/Inf/too-large values); the static
    aux data is ``(codec, specs, structure)``.
    """

    __slots__ = ("codec", "specs", "structure", "parts", "ok")

    def __init__(
        self,
        codec: str,
        specs: tuple[LeafSpec, ...],
        structure: Any,
        parts: tuple[tuple[Any, ...], ...],
        ok: tuple[Any, ...],
    ):
        self.codec = codec
        self.specs = tuple(specs)
        self.structure = structure
        self.parts = tuple(tuple(p) for p in parts)
        self.ok = tuple(ok)

    def __repr__(self) -> str:
        return f"Packed(codec={self.codec!r}, leaves={[s.name for s in self.specs]})"

    @property
    def nbytes(self) -> int:
        """Payload bytes (without header)."""
        return sum(F.payload_nbytes(self.codec, math.prod(s.shape), s.block_size, s.k) for s in self.specs)


class LeafInfo(NamedTuple):
    """One leaf of a parsed header.

    Attributes:
      name: path name (``"layer0/w"``).
      shape: decoded shape.
      dtype: source dtype name (decode yields float32).
      block_size: block size (int8/int4/fp4) or 0.
      k: elements sent (topk) or 0.
      offset: byte offset of the leaf's payload from the start of the payload.
      nbytes: payload bytes of the leaf.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    block_size: int
    k: int
    offset: int
    nbytes: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


class Manifest(NamedTuple):
    """A validated header: what a message holds and how long it is.

    Attributes:
      version: wire format version.
      codec: codec name.
      leaves: tuple of :class:`LeafInfo` in payload order.
      structure: hashable tree-structure descriptor.
      header_nbytes: prefix + header bytes (the payload starts here).
      payload_nbytes: payload bytes.
      total_nbytes: bytes of the whole message.
      decoded_nbytes: float32 bytes the decoder allocates (including block padding).
      payload_crc32: declared CRC-32 of the payload.
    """

    version: int
    codec: str
    leaves: tuple[LeafInfo, ...]
    structure: Any
    header_nbytes: int
    payload_nbytes: int
    total_nbytes: int
    decoded_nbytes: int
    payload_crc32: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(leaf.name for leaf in self.leaves)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {leaf.name: leaf.shape for leaf in self.leaves}


# ----------------------------------------------------------------------------- encode


def segments(part: Any) -> list[np.ndarray]:
    """A part's arrays: the part itself, or the consecutive 1-D slices of a large device output."""
    return [np.asarray(q) for q in part] if isinstance(part, (tuple, list)) else [np.asarray(part)]


def check_finite_leaf(name: str, ok: Any) -> None:
    """Raises :class:`NonFiniteError` naming leaf ``name`` unless its ``ok`` flag is true."""
    if not bool(np.asarray(ok)):
        raise NonFiniteError(
            f"pseudo-gradient leaf {name!r} has NaN, Inf or |x| > 2**127 values; "
            "refusing to encode it (a diverged peer must not poison the swarm)",
            leaf=name,
        )


def packed_to_chunks(packed: Packed, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[bytes | memoryview]:
    """Serialises a :class:`Packed` to the message of :func:`packed_to_bytes` as a list of
    buffers, without copying the payload.

    The first chunk (``bytes``) is the prefix and header; then one read-only ``memoryview`` per
    part array (uint8 view of the fetched array, which it keeps alive). ``b"".join(chunks)`` is
    the message; a sender can write the chunks one by one (aiohttp: an async generator body) and
    a receiver feed them to :class:`StreamDecoder`. The CRC is computed over the parts in place.

    Args:
      packed: the encoded pytree (numpy arrays, or jax arrays fetched with ``np.asarray``).
      max_bytes: refuse to build a message larger than this (bytes).

    Returns:
      The chunks; their lengths add up to the message size.

    Raises:
      NonFiniteError: a leaf's input held NaN, Inf or ``|x| > 2**127`` (names the leaf).
      ValueError: the message would exceed ``max_bytes``, or parts do not match the specs.
    """
    codec = packed.codec
    dts = F.part_dtypes(codec)
    arrays = []
    for spec, parts, ok in zip(packed.specs, packed.parts, packed.ok, strict=True):
        check_finite_leaf(spec.name, ok)
        lens = F.part_lengths(codec, math.prod(spec.shape), spec.block_size, spec.k)
        if len(parts) != len(lens):
            raise ValueError(f"leaf {spec.name!r}: expected {len(lens)} parts, got {len(parts)}")
        for p, length, dt in zip(parts, lens, dts):
            segs = segments(p)
            size = sum(a.size for a in segs)
            for a in segs:
                if size != length or a.dtype.kind != dt.kind or a.dtype.itemsize != dt.itemsize:
                    raise ValueError(
                        f"leaf {spec.name!r}: part {a.dtype} x {size} ({len(segs)} slice(s)) "
                        f"does not match {dt} x {length}"
                    )
                arrays.append(np.ascontiguousarray(a.reshape(-1), dtype=dt))
    header = header_bytes(codec, packed.specs, packed.structure)
    total = PREFIX_NBYTES + len(header) + sum(a.nbytes for a in arrays)
    if total > max_bytes:
        raise ValueError(f"encoded message would have {total} bytes, above max_bytes={max_bytes}")
    return frame(header, arrays)


def frame(header: bytes, arrays: list[np.ndarray]) -> list[bytes | memoryview]:
    """A message as buffers: the prefix and ``header`` (``bytes``), then a read-only uint8
    ``memoryview`` of each non-empty payload array, in order (the CRC computed over them in place)."""
    views = [memoryview(a.view(np.uint8)).toreadonly() for a in arrays if a.nbytes]
    payload_crc = 0
    for v in views:
        payload_crc = _crc32(v, payload_crc)
    payload_len = sum(len(v) for v in views)
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, 0, len(header), payload_len, payload_crc, 0)[:24]
    header_crc = zlib.crc32(header, zlib.crc32(head))
    return [head + struct.pack("<I", header_crc) + header, *views]


def header_bytes(codec: str, specs: Sequence[LeafSpec], structure: Any) -> bytes:
    """The msgpack header of a message of ``specs`` (in payload order) in tree ``structure``
    (the hashable descriptor of ``_tree``)."""
    obj = {
        "codec": codec,
        "leaves": [[s.name, list(s.shape), s.dtype, s.block_size, s.k] for s in specs],
        "tree": _tree.structure_to_wire(structure),
    }
    header = msgpack.packb(obj, use_bin_type=True)
    if (PREFIX_NBYTES + len(header)) % _ALIGN:
        # pad the header so that the payload starts 8-byte aligned (numpy reads aligned float32
        # several times faster); "pad": bin8 costs 6 bytes + its length
        obj["pad"] = b"\0" * (-(PREFIX_NBYTES + len(header) + 6) % _ALIGN)
        header = msgpack.packb(obj, use_bin_type=True)
    return header


def message_nbytes(packed: Packed) -> int:
    """Bytes of the message :func:`packed_to_chunks` makes of ``packed`` (prefix, header and
    payload), without building it."""
    return PREFIX_NBYTES + len(header_bytes(packed.codec, packed.specs, packed.structure)) + packed.nbytes


def packed_to_bytes(packed: Packed, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Serialises a :class:`Packed` (numpy or device arrays, fetched with ``np.asarray``) to bytes.

    jax-free: call it on the output of a jitted ``device_encode`` (optionally after
    ``jax.device_get``); the bytes equal ``encode(tree, codec, ...)`` for the deterministic codecs.
    One copy of the payload into the new ``bytes`` (:func:`packed_to_chunks` makes none).

    Args:
      packed: the encoded pytree.
      max_bytes: refuse to build a message larger than this (bytes).

    Returns:
      The message: prefix, header, payload.

    Raises:
      NonFiniteError: a leaf's input held NaN, Inf or ``|x| > 2**127`` (names the leaf).
      ValueError: the message would exceed ``max_bytes``, or parts do not match the specs.
    """
    return b"".join(packed_to_chunks(packed, max_bytes=max_bytes))


# ----------------------------------------------------------------------------- parse


def _check_limit(name: str, value: Any) -> int:
    if not F.is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _parse_prefix(prefix: Any, max_bytes: int) -> tuple[int, int, int, int]:
    """-> (header_len, payload_len, payload_crc, header_crc); raises WireFormatError."""
    magic, version, flags, reserved, header_len, payload_len, payload_crc, header_crc = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise WireFormatError(
            f"bad magic {bytes(magic)!r}: not a ravnest_jax pseudo-gradient message (expected {MAGIC!r})"
        )
    if version != FORMAT_VERSION:
        raise WireFormatError(f"unsupported wire format version {version} (this library reads {FORMAT_VERSION})")
    if flags or reserved:
        raise WireFormatError(f"reserved prefix fields must be 0, got flags={flags} reserved={reserved}")
    if header_len == 0 or header_len > MAX_HEADER_BYTES:
        raise WireFormatError(f"declared header length {header_len} outside [1, {MAX_HEADER_BYTES}]")
    total = PREFIX_NBYTES + header_len + payload_len
    if total > max_bytes:
        raise WireFormatError(f"message declares {total} bytes, above max_bytes={max_bytes}")
    return header_len, payload_len, payload_crc, header_crc


def _parse_header(prefix: Any, header: Any, max_bytes: int, max_decoded_bytes: int) -> Manifest:
    header_len, payload_len, payload_crc, header_crc = _parse_prefix(prefix, max_bytes)
    header = bytes(header)
    if zlib.crc32(header, zlib.crc32(bytes(prefix[:24]))) != header_crc:
        raise WireFormatError("header checksum mismatch (corrupted or not a message)")
    try:
        obj = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types for bad input; all mean "malformed"
        raise WireFormatError(f"undecodable header: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict) or set(obj) - {"pad"} != {"codec", "leaves", "tree"}:
        raise WireFormatError("header must be a map with keys 'codec', 'leaves', 'tree' (and optional 'pad')")
    if "pad" in obj and (not isinstance(obj["pad"], bytes) or len(obj["pad"]) > 64):
        raise WireFormatError("header 'pad' must be at most 64 bytes")
    codec = obj["codec"]
    if not isinstance(codec, str) or codec not in F.CODECS:
        raise WireFormatError(f"unknown codec {codec!r} in header")
    entries = obj["leaves"]
    if not isinstance(entries, list) or len(entries) > MAX_LEAVES:
        raise WireFormatError("header 'leaves' must be an array of at most 2**20 entries")
    leaves, offset, decoded = [], 0, 0
    for i, e in enumerate(entries):
        if not isinstance(e, list) or len(e) != 5:
            raise WireFormatError(f"leaf entry {i} must be [name, shape, dtype, block_size, k]")
        name, shape, dtype, block, k = e
        if not isinstance(name, str) or len(name) > MAX_NAME_LEN:
            raise WireFormatError(f"leaf {i}: name must be a str of at most {MAX_NAME_LEN} chars")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(F.is_int(d) and 0 <= d < 2**62 for d in shape)
        ):
            raise WireFormatError(f"leaf {name!r}: shape must be at most {MAX_NDIM} non-negative ints, got {shape!r}")
        if dtype not in ALLOWED_DTYPES:
            raise WireFormatError(f"leaf {name!r}: unsupported dtype {dtype!r}")
        if not F.is_int(block) or not F.is_int(k):
            raise WireFormatError(f"leaf {name!r}: block_size and k must be ints")
        n = math.prod(shape)
        if codec in F.BLOCK_CODECS and not F.block_size_ok(codec, block):
            raise WireFormatError(f"leaf {name!r}: block_size {block} is not valid for codec {codec!r}")
        if codec not in F.BLOCK_CODECS and block != 0:
            raise WireFormatError(f"leaf {name!r}: block_size must be 0 for codec {codec!r}")
        if codec == "topk" and not 0 <= k <= n:
            raise WireFormatError(f"leaf {name!r}: topk count {k} outside [0, {n}]")
        if codec != "topk" and k != 0:
            raise WireFormatError(f"leaf {name!r}: k must be 0 for codec {codec!r}")
        decoded += 4 * (F.num_blocks(n, block) * block if block else n)  # block padding included
        if decoded > max_decoded_bytes:
            raise WireFormatError(f"message decodes to more than max_decoded_bytes={max_decoded_bytes} bytes")
        nbytes = F.payload_nbytes(codec, n, block, k)
        leaves.append(LeafInfo(name, tuple(shape), dtype, block, k, offset, nbytes))
        offset += nbytes
        if offset > payload_len:
            break
    if offset != payload_len:
        raise WireFormatError(
            f"shapes in the header imply a payload of {offset} bytes (or more), but it declares {payload_len}"
        )
    try:
        structure = _tree.structure_from_wire(obj["tree"], len(leaves))
        expected = _tree.structure_names(structure, len(leaves))
    except ValueError as e:
        raise WireFormatError(f"bad tree structure in header: {e}") from None
    for leaf, want in zip(leaves, expected):
        if leaf.name != want:
            raise WireFormatError(f"leaf name {leaf.name!r} does not match its tree path {want!r}")
    return Manifest(
        version=FORMAT_VERSION,
        codec=codec,
        leaves=tuple(leaves),
        structure=structure,
        header_nbytes=PREFIX_NBYTES + header_len,
        payload_nbytes=payload_len,
        total_nbytes=PREFIX_NBYTES + header_len + payload_len,
        decoded_nbytes=decoded,
        payload_crc32=payload_crc,
    )


def _as_view(data: Any) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, bytearray or memoryview, got {type(data).__name__}")
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def read_header(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
) -> Manifest:
    """Parses and validates the prefix and header of a message, not the payload.

    Lets a server check the codec, leaf names and shapes and the size of a message before it
    reads the body. ``data`` may be only the first bytes of the message: at least
    :data:`PREFIX_NBYTES`, then ``manifest.header_nbytes``.

    Args:
      data: the start of a message (or all of it).
      max_bytes: largest accepted message (bytes).
      max_decoded_bytes: largest accepted decoded size (float32 bytes).

    Returns:
      The :class:`Manifest`.

    Raises:
      WireFormatError: too few bytes for the prefix or the header, bad magic or version, a
        declared size above a maximum, bad header checksum, a malformed or inconsistent header.
    """
    max_bytes = _check_limit("max_bytes", max_bytes)
    max_decoded_bytes = _check_limit("max_decoded_bytes", max_decoded_bytes)
    mv = _as_view(data)
    if len(mv) < PREFIX_NBYTES:
        raise WireFormatError(f"truncated message: {len(mv)} bytes, the prefix alone needs {PREFIX_NBYTES}")
    header_len, *_ = _parse_prefix(mv[:PREFIX_NBYTES], max_bytes)
    if len(mv) < PREFIX_NBYTES + header_len:
        raise WireFormatError(f"truncated message: {len(mv)} bytes, the header needs {PREFIX_NBYTES + header_len}")
    return _parse_header(
        mv[:PREFIX_NBYTES], mv[PREFIX_NBYTES : PREFIX_NBYTES + header_len], max_bytes, max_decoded_bytes
    )
