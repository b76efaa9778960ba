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
from collections.abc import Callable, Generator, Sequence
from functools import partial
from typing import Any

import numpy as np

from . import _formats as F
from ._decode import _check_finite, _decode_blocks, _decode_dense, check_topk, scales
from ._errors import WireFormatError
from ._reader import Reader
from ._wire import LeafSpec, Manifest, Packed, frame, header_bytes

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
    specs: list[LeafSpec] = []
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
        specs.append(LeafSpec(str(j), (b - a,), spec.dtype, layout.block_size, k))
    return frame(header_bytes(codec, specs, ("l", tuple(range(len(specs))))), views)


def chunks_nbytes(chunks: Sequence[bytes | memoryview]) -> int:
    """Total bytes of a message given as buffers."""
    return sum(len(c) for c in chunks)


def _part_sink(
    layout: PartLayout,
    pieces: list[tuple[int, int, int]],
    sink: Callable[[int, np.ndarray], None],
    into: Callable[[int], np.ndarray] | None,
    m: Manifest,
) -> Generator[int | np.ndarray, np.ndarray, None]:
    """The :class:`Reader` sink of a :class:`RangeDecoder`: checks the header against the part's
    pieces, then reads each piece grid chunk by grid chunk and hands the decoded values to
    ``sink(j, values)`` in order."""
    codec, B, grid = layout.codec, layout.block_size, layout.grid
    if m.codec != codec:
        raise WireFormatError(f"codec {m.codec!r} does not match the round's {codec!r}")
    if len(m.leaves) != len(pieces):
        raise WireFormatError(f"{len(m.leaves)} leaves where this part has {len(pieces)} pieces")
    for leaf, (_, a, b) in zip(m.leaves, pieces):
        if leaf.shape != (b - a,) or leaf.block_size != B:
            raise WireFormatError("leaf shapes or block size do not match the round's parts")
    j = 0

    def emit(values: np.ndarray, name: str) -> None:
        nonlocal j
        _check_finite(name, values)
        j += 1
        sink(j - 1, values)

    for leaf in m.leaves:
        name, length = leaf.name, leaf.size
        chunks = [(s, min(length, s + grid)) for s in range(0, length, grid)]
        if codec == "fp32":  # the collected bytes are the values: handed over, not copied
            for s, e in chunks:
                dst = into(j) if into is not None else np.empty(e - s, np.float32)
                if dst.dtype != np.float32 or dst.size != e - s or not dst.flags.c_contiguous:
                    raise ValueError(f"into({j}) is not a contiguous float32 array of {e - s} values")
                emit((yield dst.view(np.uint8)).view(np.float32), name)
        elif codec == "bf16":
            for s, e in chunks:
                emit(_decode_dense(codec, name, (yield 2 * (e - s)).view("<u2")), name)
        elif codec == "topk":
            idx = (yield 4 * leaf.k).view("<u4").astype(np.intp)
            vals = (yield 4 * leaf.k).view("<f4")
            check_topk(name, idx, vals, length)
            for s, e in chunks:  # zeros but for the k values
                out = np.zeros(e - s, np.float32)
                a, b = int(np.searchsorted(idx, s)), int(np.searchsorted(idx, e))
                out[idx[a:b] - s] = vals[a:b]
                emit(out, name)
        else:
            sdt = F.part_dtypes(codec)[0]
            sc = scales(codec, name, (yield F.num_blocks(length, B) * sdt.itemsize).view(sdt).copy())
            for s, e in chunks:
                nb = F.num_blocks(e - s, B)
                codes = yield nb * B // F.CODES_PER_BYTE[codec]
                emit(_decode_blocks(codec, B, sc[s // B : s // B + nb], codes)[: e - s], name)


class RangeDecoder(Reader):
    """Streams one part's message (:func:`part_chunks` or any encoder of the same pieces) into a
    sink, grid chunk by grid chunk, checking it as :class:`~ravnest_jax.compress.StreamDecoder`
    does (header before payload, sizes before allocation, CRC-32, finite values): a sink of the
    one streaming reader (``_reader.py``).

    Args:
      layout: the contribution's :class:`PartLayout` (codec, leaves, block size).
      lo, hi: the part's element range.
      sink: ``sink(j, values)``: grid chunk ``j`` of :meth:`PartLayout.chunk_grid` as a new float32
        array of its length (the sink owns it), called in order ``j = 0, 1, ...``.
      out: instead of ``sink``, where the part's values go: a contiguous float32 array of
        ``hi - lo`` values (e.g. the part's region of the caller's output); ``fp32`` payload bytes
        are collected straight into it (no second copy), other codecs' values are written into
        it chunk by chunk. On an error it holds garbage.

    ``feed(chunk)`` raises :class:`WireFormatError` as soon as what arrived cannot be this part
    (another codec, other pieces, a bad scale, a non-finite value, bytes past the end);
    ``finish()`` raises it for a message cut short or a CRC mismatch. Errors are sticky.
    """

    _NO_HEADER = "truncated part: {n} bytes, the header is incomplete"
    _TRUNCATED = "truncated part: {n} bytes received"
    _PAST_END = "bytes past the declared end of the part"
    _CORRUPT = "payload checksum mismatch (corrupted part)"

    def __init__(
        self,
        layout: PartLayout,
        lo: int,
        hi: int,
        sink: Callable[[int, np.ndarray], None] | None = None,
        *,
        out: np.ndarray | None = None,
    ):
        into = None
        if out is not None:
            if sink is not None or out.dtype != np.float32 or out.shape != (hi - lo,) or not out.flags.c_contiguous:
                raise ValueError(f"out must be a contiguous float32 array of {hi - lo} values, instead of a sink")
            grid = layout.chunk_grid(lo, hi)
            into = lambda j: out[grid[j][0] : grid[j][1]]  # noqa: E731

            def sink(j: int, values: np.ndarray) -> None:
                a, b = grid[j]
                if not np.may_share_memory(values, out[a:b]):  # fp32 collected it there already
                    out[a:b] = values

        elif sink is None:
            raise ValueError("RangeDecoder needs a sink or an out array")
        plan = partial(_part_sink, layout, layout.pieces(lo, hi), sink, into if layout.codec == "fp32" else None)
        # sizes are checked against the layout's pieces; the header (one leaf per piece) is small
        super().__init__(plan, max_bytes=1 << 40, max_decoded_bytes=1 << 40, max_header_bytes=1 << 20)
