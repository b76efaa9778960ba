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
from ._wire import LeafSpec, Manifest, Packed, frame, header_bytes, segments

GRID = 1 << 16
"""Elements of one grid chunk (at most; 256 KiB of float32): small enough to stay in the CPU
caches while a chunk is decoded, checked, weighted and added."""

ChunkSink = Callable[[int, np.ndarray], None]


def _views(part: Any, dtype: np.dtype, lo: int, hi: int) -> list[np.ndarray]:
    """Elements ``[lo, hi)`` of a part (an array, or consecutive 1-D slices: a device output above
    ``SEGMENT_BYTES``) as views of its arrays, without a copy."""
    out, start = [], 0
    for a in segments(part):
        a = np.ascontiguousarray(a.reshape(-1)).view(dtype)
        if max(lo, start) < min(hi, start + a.size):
            out.append(a[max(lo, start) - start : min(hi, start + a.size) - start])
        start += a.size
    return out


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
        blocks = sorted({s.block_size for s in packed.specs})
        if len(blocks) > 1 and packed.codec in F.BLOCK_CODECS:
            raise ValueError(f"leaves with different block sizes {blocks}")
        block = blocks[0] if blocks else F.DEFAULT_BLOCK_SIZE.get(packed.codec, 0)
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
        out, lo, end = [], 0, 0
        for k in range(n_parts):
            end += base + (k < rem)
            hi = self.n if k == n_parts - 1 else max(lo, self._snap(end))
            out.append((lo, hi))
            lo = hi
        return out

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The leaf ranges of elements ``[lo, hi)``: ``[(leaf, a, b), ...]`` with ``a, b``
        offsets inside the leaf (empty leaves are skipped)."""
        out = []
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
        k = 0
        if codec in ("fp32", "bf16"):
            views += _views(parts[0], dts[0], a, b)
        elif codec == "topk":
            idx = _views(parts[0], dts[0], 0, spec.k)
            idx = np.concatenate(idx) if len(idx) > 1 else idx[0] if idx else np.zeros(0, dts[0])
            s, e = int(np.searchsorted(idx, a)), int(np.searchsorted(idx, b))
            k = e - s
            views.append((idx[s:e] - np.uint32(a)).astype("<u4"))
            views += _views(parts[1], dts[1], s, e)
        else:
            B, per_byte = layout.block_size, F.CODES_PER_BYTE[codec]
            nb_a, nb_b = a // B, -(-b // B)
            views += _views(parts[0], dts[0], nb_a, nb_b)
            views += _views(parts[1], dts[1], nb_a * B // per_byte, nb_b * B // per_byte)
        specs.append(LeafSpec(str(j), (b - a,), spec.dtype, layout.block_size, k))
    return frame(header_bytes(codec, specs, ("l", tuple(range(len(specs))))), views)


def _part_sink(
    layout: PartLayout,
    pieces: list[tuple[int, int, int]],
    sink: ChunkSink | None,
    out: np.ndarray | None,
    m: Manifest,
) -> Generator[int | np.ndarray, np.ndarray, None]:
    """The :class:`Reader` sink of a :class:`RangeDecoder`: checks the header against the part's
    pieces, then reads each piece grid chunk by grid chunk and hands the decoded values to
    ``sink(j, values)`` in order, or writes them into ``out``."""
    codec, B, grid = layout.codec, layout.block_size, layout.grid
    if m.codec != codec:
        raise WireFormatError(f"codec {m.codec!r} does not match the round's {codec!r}")
    if len(m.leaves) != len(pieces):
        raise WireFormatError(f"{len(m.leaves)} leaves where this part has {len(pieces)} pieces")
    for leaf, (_, a, b) in zip(m.leaves, pieces):
        if leaf.shape != (b - a,) or leaf.block_size != B:
            raise WireFormatError("leaf shapes or block size do not match the round's parts")
    j = base = 0
    for leaf in m.leaves:
        name, n = leaf.name, leaf.size
        if codec == "topk":
            idx = (yield 4 * leaf.k).view("<u4").astype(np.intp)
            vals = (yield 4 * leaf.k).view("<f4")
            check_topk(name, idx, vals, n)
        elif codec in F.BLOCK_CODECS:
            sdt = F.part_dtypes(codec)[0]
            sc = scales(codec, name, (yield F.num_blocks(n, B) * sdt.itemsize).view(sdt).copy())
        for s in range(0, n, grid):
            e = min(n, s + grid)
            dst = None if out is None else out[base + s : base + e]
            if codec == "fp32":  # the collected bytes are the values: handed over, not copied
                values = (yield (np.empty(e - s, np.float32) if dst is None else dst).view(np.uint8)).view(np.float32)
                _check_finite(name, values)
            elif codec == "bf16":
                values = _decode_dense(codec, name, (yield 2 * (e - s)).view("<u2"))
            elif codec == "topk":  # zeros but for the k values
                values = np.zeros(e - s, np.float32)
                a, b = int(np.searchsorted(idx, s)), int(np.searchsorted(idx, e))
                values[idx[a:b] - s] = vals[a:b]
            else:  # the scales were checked: every value is finite
                nb = F.num_blocks(e - s, B)
                codes = yield nb * B // F.CODES_PER_BYTE[codec]
                values = _decode_blocks(codec, B, sc[s // B : s // B + nb], codes)[: e - s]
            if dst is None:
                sink(j, values)
            elif codec != "fp32":
                dst[...] = values
            j += 1
        base += n


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
        self, layout: PartLayout, lo: int, hi: int, sink: ChunkSink | None = None, *, out: np.ndarray | None = None
    ):
        if out is not None and (
            sink is not None or out.dtype != np.float32 or out.shape != (hi - lo,) or not out.flags.c_contiguous
        ):
            raise ValueError(f"out must be a contiguous float32 array of {hi - lo} values, instead of a sink")
        if sink is None and out is None:
            raise ValueError("RangeDecoder needs a sink or an out array")
        plan = partial(_part_sink, layout, layout.pieces(lo, hi), sink, out)
        # sizes are checked against the layout's pieces; the header (one leaf per piece) is small
        super().__init__(plan, max_bytes=1 << 40, max_decoded_bytes=1 << 40, max_header_bytes=1 << 20)
