"""Parts of an encoded message: cut on codec block boundaries, sent as they are, decoded as they
stream in (jax-free, numpy only).

An all-reduce gives every member one contiguous range of a contribution's elements (its *part*,
the leaves raveled and concatenated in leaf order). :class:`PartLayout` cuts an encoded
contribution (a :class:`~ravnest_jax.compress.Packed`: per leaf, its payload arrays) at leaf and
block boundaries, so that the bytes of a part are slices of the contribution's own payload:
:func:`part_chunks` builds a complete wire message for a part from views of those arrays (no
copy of the payload, no re-encoding: the message a peer encoded once, on its device, is what
goes on the wire). A part's message holds one leaf per *piece* (the part's range within one leaf
of the contribution), named ``"0"``, ``"1"``, ... in order.

:class:`RangeDecoder` reads such a message as the socket delivers it and hands the decoded
float32 values to a sink in *grid chunks*: fixed element ranges of the part (at most
:data:`GRID` elements, never across a piece, a multiple of the block size), the same on every
peer for a given layout, so that whatever consumes them (a reduction in a fixed order, norms
summed chunk by chunk) gets the same floating-point result wherever and however the bytes arrive.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from . import _formats as F
from . import _tree
from ._decode import _E8M0_LUT, _MAX_E8M0, _MAX_INT_SCALE, _check_finite, _decode_blocks, _decode_dense
from ._errors import WireFormatError
from ._wire import (
    _ALIGN,
    _PREFIX,
    FORMAT_VERSION,
    MAGIC,
    PREFIX_NBYTES,
    LeafInfo,
    Manifest,
    Packed,
    _crc32,
    _parse_header,
    _parse_prefix,
)

__all__ = ["GRID", "PartLayout", "RangeDecoder", "part_chunks", "chunks_nbytes"]

GRID = 1 << 16
"""Elements of one grid chunk (at most; 256 KiB of float32): small enough to stay in the CPU
caches while a chunk is decoded, checked, weighted and added."""

_DENSE = ("fp32", "bf16")


class _Segments:
    """One payload array of a leaf given as consecutive 1-D segments (a device output above
    ``SEGMENT_BYTES`` comes in slices): :meth:`views` of any element range without a copy."""

    __slots__ = ("arrays", "starts")

    def __init__(self, part: Any, dtype: np.dtype):
        segs = [np.asarray(q) for q in part] if isinstance(part, (tuple, list)) else [np.asarray(part)]
        self.arrays = [np.ascontiguousarray(a.reshape(-1)).view(dtype) for a in segs]
        self.starts = np.cumsum([0] + [a.size for a in self.arrays])

    @property
    def size(self) -> int:
        return int(self.starts[-1])

    def views(self, lo: int, hi: int) -> list[np.ndarray]:
        out = []
        for a, s in zip(self.arrays, self.starts[:-1]):
            s = int(s)
            a_lo, a_hi = max(lo, s), min(hi, s + a.size)
            if a_lo < a_hi:
                out.append(a[a_lo - s : a_hi - s])
        return out

    def gather(self, lo: int, hi: int) -> np.ndarray:
        """The range as one array (a view when it lies in one segment, else a copy)."""
        v = self.views(lo, hi)
        if len(v) == 1:
            return v[0]
        return np.concatenate(v) if v else self.arrays[0][:0]


class PartLayout:
    """Where a contribution's parts may be cut, and which leaf ranges (*pieces*) a part holds.

    Args:
      codec: the codec of the contribution (``compress.CODECS``).
      sizes: element count of every leaf, in leaf order.
      block_size: the block size of a block codec (int8 / int4 / fp4 / sign), else 0.

    The elements of the contribution are numbered leaf after leaf (the leaves raveled and
    concatenated, as a flat float32 vector of :attr:`n` elements). A block codec's part starts at
    a block boundary of its leaf (or a leaf boundary), so that its bytes are whole blocks of the
    encoded leaf. Every method is a pure function of the constructor's arguments: every peer
    computes the same cuts.
    """

    def __init__(self, codec: str, sizes: Sequence[int], block_size: int = 0):
        if codec not in F.CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        self.codec = codec
        self.block_size = int(block_size) if codec in F.BLOCK_CODECS else 0
        if codec in F.BLOCK_CODECS and not F.block_size_ok(codec, self.block_size):
            raise ValueError(f"block_size {block_size!r} is not valid for codec {codec!r}")
        self.sizes = tuple(int(s) for s in sizes)
        self.offsets = np.cumsum((0,) + self.sizes, dtype=np.int64)
        self.grid = (GRID // self.block_size) * self.block_size if self.block_size else GRID

    @classmethod
    def of(cls, packed: Packed) -> PartLayout:
        """The layout of an encoded contribution (its codec, leaf sizes and block size)."""
        blocks = {s.block_size for s in packed.specs}
        block = blocks.pop() if len(blocks) == 1 else 0
        if packed.codec in F.BLOCK_CODECS and (blocks or not packed.specs):
            if blocks:
                raise ValueError(f"leaves with different block sizes {sorted(blocks | {block})}")
            block = F.DEFAULT_BLOCK_SIZE[packed.codec]
        return cls(packed.codec, [math.prod(s.shape) for s in packed.specs], block)

    @property
    def n(self) -> int:
        """Elements of the whole contribution."""
        return int(self.offsets[-1])

    def key(self) -> str:
        """What two contributions must share to be reduced part by part: codec, block size and
        leaf sizes (a short string for the round manifest)."""
        return f"{self.codec}:{self.block_size}:{','.join(map(str, self.sizes))}"

    def _snap(self, t: int) -> int:
        """The cut position nearest to element ``t`` (a block or leaf boundary)."""
        if not self.block_size or t <= 0 or t >= self.n:
            return min(max(t, 0), self.n)
        i = int(np.searchsorted(self.offsets, t, side="right")) - 1
        off, size = int(self.offsets[i]), self.sizes[i]
        j = round((t - off) / self.block_size)
        return off + min(j * self.block_size, size)

    def bounds(self, n_parts: int) -> list[tuple[int, int]]:
        """``n_parts`` contiguous ``(lo, hi)`` element ranges covering ``[0, n)``, as equal as the
        cut positions allow (dense codecs: exactly ``swarm``'s ``part_bounds``, the first
        ``n % n_parts`` one longer; block codecs: each end snapped to the nearest block or leaf
        boundary). A part may be empty when there are fewer blocks than parts."""
        if n_parts < 1:
            raise ValueError(f"n_parts must be >= 1, got {n_parts}")
        base, rem = divmod(self.n, n_parts)
        ends, acc = [], 0
        for k in range(n_parts):
            acc += base + (1 if k < rem else 0)
            ends.append(acc)
        out, lo = [], 0
        for k, t in enumerate(ends):
            hi = self.n if k == n_parts - 1 else max(lo, self._snap(t))
            out.append((lo, hi))
            lo = hi
        return out

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The leaf ranges of elements ``[lo, hi)``: ``[(leaf, a, b), ...]`` with ``a, b``
        offsets inside the leaf (empty leaves are skipped)."""
        out = []
        if hi <= lo:
            return out
        i = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        while i < len(self.sizes) and int(self.offsets[i]) < hi:
            off = int(self.offsets[i])
            a, b = max(lo, off) - off, min(hi, off + self.sizes[i]) - off
            if b > a:
                out.append((i, a, b))
            i += 1
        return out

    def chunk_grid(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The grid chunks of part ``[lo, hi)``: ``(a, b)`` element ranges relative to ``lo``,
        in order, each inside one piece and at most :attr:`grid` long (a multiple of the block
        size except at a piece's end)."""
        out, base = [], 0
        for _, a, b in self.pieces(lo, hi):
            for s in range(0, b - a, self.grid):
                out.append((base + s, base + min(b - a, s + self.grid)))
            base += b - a
        return out


def _header_bytes(codec: str, entries: list[list[Any]]) -> bytes:
    obj = {
        "codec": codec,
        "leaves": entries,
        "tree": _tree.structure_to_wire(("l", tuple(range(len(entries))))),
    }
    header = msgpack.packb(obj, use_bin_type=True)
    if (PREFIX_NBYTES + len(header)) % _ALIGN:  # the payload starts 8-byte aligned, as packed_to_chunks does
        obj["pad"] = b"\0" * (-(PREFIX_NBYTES + len(header) + 6) % _ALIGN)
        header = msgpack.packb(obj, use_bin_type=True)
    return header


def _message(codec: str, entries: list[list[Any]], views: list[np.ndarray]) -> list[bytes | memoryview]:
    header = _header_bytes(codec, entries)
    mvs = [memoryview(v.view(np.uint8)).toreadonly() for v in views if v.nbytes]
    crc = 0
    for v in mvs:
        crc = _crc32(v, crc)
    payload_len = sum(len(v) for v in mvs)
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, 0, len(header), payload_len, crc, 0)[:24]
    return [head + struct.pack("<I", zlib.crc32(header, zlib.crc32(head))) + header, *mvs]


def part_chunks(packed: Packed, layout: PartLayout, lo: int, hi: int) -> list[bytes | memoryview]:
    """The wire message of part ``[lo, hi)`` of ``packed`` (host numpy arrays), as buffers.

    The first buffer (``bytes``) is the prefix and header, the others are read-only views of the
    payload arrays of ``packed`` (for topk, the piece's indices are rebased to the piece: a small
    copy). ``b"".join(chunks)`` is a complete message of one leaf per piece (``"0"``, ``"1"``,
    ...; shapes ``(b - a,)``) that :func:`ravnest_jax.compress.decode` reads; decoded and
    concatenated, it equals elements ``[lo, hi)`` of the decoded contribution.

    Raises:
      ValueError: ``[lo, hi)`` is not a range of the layout, or not on its cut positions.
    """
    codec = packed.codec
    if not (0 <= lo <= hi <= layout.n) or (layout.block_size and lo != layout._snap(lo)):
        raise ValueError(f"[{lo}, {hi}) is not a part of this layout (n={layout.n})")
    dts = F.part_dtypes(codec)
    entries: list[list[Any]] = []
    views: list[np.ndarray] = []
    for j, (i, a, b) in enumerate(layout.pieces(lo, hi)):
        spec, parts = packed.specs[i], packed.parts[i]
        segs = [_Segments(p, dt) for p, dt in zip(parts, dts)]
        k = 0
        if codec in _DENSE:
            views += segs[0].views(a, b)
        elif codec == "topk":
            idx = segs[0].gather(0, segs[0].size)
            s, e = int(np.searchsorted(idx, a)), int(np.searchsorted(idx, b))
            k = e - s
            views.append((idx[s:e] - np.uint32(a)).astype("<u4"))
            views += segs[1].views(s, e)
        else:
            B = layout.block_size
            nb_a, nb_b = a // B, -(-b // B)
            per_byte = F.CODES_PER_BYTE[codec]
            views += segs[0].views(nb_a, nb_b)
            views += segs[1].views(nb_a * B // per_byte, nb_b * B // per_byte)
        entries.append([str(j), [b - a], spec.dtype, layout.block_size, k])
    return _message(codec, entries, views)


def chunks_nbytes(chunks: Sequence[bytes | memoryview]) -> int:
    """Total bytes of a message given as buffers."""
    return sum(len(c) for c in chunks)


class RangeDecoder:
    """Streams one part's message (:func:`part_chunks` or any encoder of the same pieces) into a
    sink, grid chunk by grid chunk, checking it as :class:`~ravnest_jax.compress.StreamDecoder`
    does (header before payload, sizes before allocation, CRC-32, finite values).

    Args:
      layout: the contribution's :class:`PartLayout` (codec, leaves, block size).
      lo, hi: the part's element range.
      sink: ``sink(j, values)``: grid chunk ``j`` of :meth:`PartLayout.chunk_grid` as a new float32
        array of its length (the sink owns it), called in order ``j = 0, 1, ...``.
      max_header_bytes: the most prefix + header bytes accepted.
      into: for ``fp32`` only, ``into(j)``: where grid chunk ``j``'s values go (a contiguous
        float32 array of its length, e.g. a view of the caller's output): the payload bytes are
        collected straight into it (no second copy) and ``sink(j, that array)`` follows. On an
        error the array holds garbage. Other codecs ignore it.

    ``feed(chunk)`` raises :class:`WireFormatError` as soon as what arrived cannot be this part
    (another codec, other pieces, a bad scale, a non-finite value, bytes past the end);
    ``finish()`` raises it for a message cut short or a CRC mismatch. Errors are sticky.
    """

    def __init__(
        self,
        layout: PartLayout,
        lo: int,
        hi: int,
        sink: Callable[[int, np.ndarray], None],
        *,
        max_header_bytes: int = 1 << 20,
        into: Callable[[int], np.ndarray] | None = None,
    ):
        self.layout, self.lo, self.hi, self.sink = layout, lo, hi, sink
        self.into = into if layout.codec == "fp32" else None
        self.codec = layout.codec
        self.pieces = layout.pieces(lo, hi)
        self.grid = layout.chunk_grid(lo, hi)
        self.max_header_bytes = max_header_bytes
        self.nbytes = 0
        self.manifest: Manifest | None = None
        self._head = bytearray()
        self._header_len: int | None = None
        self._crc = 0
        self._error: WireFormatError | None = None
        self._done = False
        self._chunk = 0  # next grid chunk to emit
        self._plan: list[tuple[Any, ...]] = []  # per piece, the byte regions to read (see _start)
        self._step = 0  # index into _plan
        self._buf = np.empty(0, np.uint8)  # bytes of the region being collected
        self._fill = 0
        self._scales: np.ndarray | None = None  # decoded scales of the current block piece
        self._topk_idx: np.ndarray | None = None

    @property
    def n_chunks(self) -> int:
        return len(self.grid)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._error
        try:
            mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
            self.nbytes += len(mv)
            self._feed(mv)
        except WireFormatError as e:
            self._error = e
            raise

    def _feed(self, mv: memoryview) -> None:
        while len(mv):
            if self.manifest is None:
                target = PREFIX_NBYTES if self._header_len is None else PREFIX_NBYTES + self._header_len
                take = min(target - len(self._head), len(mv))
                self._head += mv[:take]
                mv = mv[take:]
                if len(self._head) < target:
                    return
                if self._header_len is None:
                    self._header_len = _parse_prefix(self._head, 1 << 40)[0]
                    if PREFIX_NBYTES + self._header_len > self.max_header_bytes:
                        raise WireFormatError(f"header of {self._header_len} bytes, above {self.max_header_bytes}")
                    continue
                self.manifest = _parse_header(self._head[:PREFIX_NBYTES], self._head[PREFIX_NBYTES:], 1 << 40, 1 << 40)
                self._start(self.manifest)
                continue
            if self._step >= len(self._plan):
                raise WireFormatError("bytes past the declared end of the part")
            need = len(self._buf) - self._fill
            take = min(need, len(mv))
            self._buf[self._fill : self._fill + take] = mv[:take]
            self._crc = _crc32(mv[:take], self._crc)
            self._fill += take
            mv = mv[take:]
            if self._fill == len(self._buf):
                self._region_done()

    def _start(self, m: Manifest) -> None:
        """Checks the header against the expected pieces and plans the payload regions."""
        if m.codec != self.codec:
            raise WireFormatError(f"codec {m.codec!r} does not match the round's {self.codec!r}")
        if len(m.leaves) != len(self.pieces):
            raise WireFormatError(f"{len(m.leaves)} leaves where this part has {len(self.pieces)} pieces")
        B = self.layout.block_size
        plan = []
        base = 0
        for leaf, (_, a, b) in zip(m.leaves, self.pieces):
            length = b - a
            if leaf.shape != (length,) or leaf.block_size != B:
                raise WireFormatError("leaf shapes or block size do not match the round's parts")
            first = next(j for j, (ga, _) in enumerate(self.grid) if ga == base) if self.grid else 0
            if self.codec in _DENSE:
                item = F.part_dtypes(self.codec)[0].itemsize
                for ga, gb in self.grid[first:]:
                    if gb > base + length:
                        break
                    plan.append(("dense", leaf, ga - base, gb - ga, (gb - ga) * item))
            elif self.codec == "topk":
                plan.append(("topk_idx", leaf, length, 4 * leaf.k))
                plan.append(("topk_val", leaf, length, 4 * leaf.k))
            else:
                nb = F.num_blocks(length, B)
                sdt = F.part_dtypes(self.codec)[0]
                plan.append(("scales", leaf, nb * sdt.itemsize))
                per_byte = F.CODES_PER_BYTE[self.codec]
                for ga, gb in self.grid[first:]:
                    if gb > base + length:
                        break
                    blocks = F.num_blocks(gb - ga, B)
                    plan.append(("codes", leaf, ga - base, gb - ga, blocks * B // per_byte))
            base += length
        self._plan = plan
        self._step = -1
        self._next_region()

    def _next_region(self) -> None:
        self._step += 1
        while self._step < len(self._plan) and self._plan[self._step][-1] == 0:
            self._region_done(empty=True)
            return
        if self._step < len(self._plan):
            n = self._plan[self._step][-1]
            if self.into is not None:  # fp32: every region is the next grid chunk's values
                dst = self.into(self._chunk)
                if dst.dtype != np.float32 or dst.nbytes != n or not dst.flags.c_contiguous:
                    raise ValueError(f"into({self._chunk}) is not a contiguous float32 array of {n // 4} values")
                self._buf = dst.view(np.uint8)
            elif self._buf.size != n:
                self._buf = np.empty(n, np.uint8)
            self._fill = 0

    def _emit(self, values: np.ndarray, name: str) -> None:
        _check_finite(name, values)
        j = self._chunk
        self._chunk += 1
        self.sink(j, values)

    def _region_done(self, empty: bool = False) -> None:
        kind, leaf = self._plan[self._step][0], self._plan[self._step][1]
        buf = self._buf if not empty else np.empty(0, np.uint8)
        if kind == "dense":
            _, _, start, count, _ = self._plan[self._step]
            src = buf.view(F.part_dtypes(self.codec)[0])
            info = LeafInfo(leaf.name, (count,), leaf.dtype, 0, 0, 0, buf.size)
            if self.codec == "fp32":  # the collected bytes are the values: handed over, not copied
                vals, self._buf = src, np.empty(0, np.uint8)
            else:
                vals = _decode_dense(self.codec, info, src)
            self._emit(vals, leaf.name)
        elif kind == "scales":
            raw = buf.view(F.part_dtypes(self.codec)[0]).copy()
            if self.codec == "fp4":
                if raw.size and int(raw.max()) > _MAX_E8M0:
                    raise WireFormatError(f"leaf {leaf.name!r}: E8M0 scale code above {_MAX_E8M0}")
                self._scales = _E8M0_LUT[raw]
            else:
                s = F.bf16_bits_to_f32(np, raw)
                if s.size and not (bool(np.all(s >= 0)) and float(s.max()) <= _MAX_INT_SCALE[self.codec]):
                    raise WireFormatError(f"leaf {leaf.name!r}: block scales negative, non-finite or too large")
                self._scales = s
        elif kind == "codes":
            _, _, start, count, _ = self._plan[self._step]
            B = self.layout.block_size
            assert self._scales is not None
            s = self._scales[start // B : start // B + F.num_blocks(count, B)]
            info = LeafInfo(leaf.name, (count,), leaf.dtype, B, 0, 0, buf.size)
            self._emit(_decode_blocks(self.codec, info, s, buf)[:count], leaf.name)
        elif kind == "topk_idx":
            self._topk_idx = buf.view("<u4").astype(np.intp)
        else:  # topk values: the piece's grid chunks, zeros but for the k values
            length = self._plan[self._step][2]
            idx, vals = self._topk_idx, buf.view("<f4")
            assert idx is not None
            if idx.size:
                if int(idx[-1]) >= length or (idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1]))):
                    raise WireFormatError(f"leaf {leaf.name!r}: topk indices not strictly increasing below {length}")
                _check_finite(leaf.name, vals)
            for s in range(0, length, self.layout.grid):
                e = min(length, s + self.layout.grid)
                out = np.zeros(e - s, np.float32)
                a, b = int(np.searchsorted(idx, s)), int(np.searchsorted(idx, e))
                out[idx[a:b] - s] = vals[a:b]
                self._emit(out, leaf.name)
        self._next_region()

    def finish(self) -> None:
        """Checks that the whole part arrived intact (every grid chunk went to the sink).

        Raises:
          WireFormatError: a message cut short (or never started), or a CRC mismatch.
        """
        if self._error is not None:
            raise self._error
        if self._done:
            return
        try:
            if self.manifest is None:
                raise WireFormatError(f"truncated part: {len(self._head)} bytes, the header is incomplete")
            if self._step < len(self._plan):
                raise WireFormatError(f"truncated part: {self.nbytes} bytes received")
            if self._crc != self.manifest.payload_crc32:
                raise WireFormatError("payload checksum mismatch (corrupted part)")
            if self._chunk != len(self.grid):  # pragma: no cover - the plan covers the grid
                raise WireFormatError("part decoded to the wrong number of chunks")
            self._done = True
        except WireFormatError as e:
            self._error = e
            raise
