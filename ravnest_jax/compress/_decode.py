"""Decoding messages of the wire format (``_wire.py``) on the host, numpy only: whole messages
(:func:`decode`) and streams fed chunk by chunk as a socket delivers them (:class:`StreamDecoder`, a
sink of the one streaming reader, ``_reader.py``).

Every leaf is decoded in chunks of :data:`_CHUNK` elements with lookup tables built from the
same ``_formats`` functions as the device-side math, and checked finite; see ``_wire.py`` for
the layout and the validation that runs before any buffer is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from functools import partial
from typing import Any

import numpy as np

from . import _formats as F
from . import _tree
from ._bits import MAX_ABS, bf16_bits_to_f32, e8m0_scale_values
from ._errors import WireFormatError
from ._reader import Reader
from ._wire import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_BYTES, LeafInfo, Manifest, _as_view, _crc32, read_header


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
) -> Any:
    """Decodes a message into a pytree of numpy float32 arrays (host, numpy only).

    Args:
      data: one whole message, as produced by ``encode`` or ``packed_to_bytes``.
      max_bytes: largest accepted message (bytes), default :data:`DEFAULT_MAX_BYTES`.
      max_decoded_bytes: largest accepted decoded size (float32 bytes), default
        :data:`DEFAULT_MAX_DECODED_BYTES`.

    Returns:
      The encoded nesting (dicts with sorted str keys, lists, tuples) with writable float32 numpy
      arrays of the encoded shapes.

    Raises:
      WireFormatError: anything wrong with ``data`` (see :class:`WireFormatError`).
      TypeError: ``data`` is not bytes-like.
    """
    mv = _as_view(data)
    manifest = read_header(mv, max_bytes=max_bytes, max_decoded_bytes=max_decoded_bytes)
    if len(mv) < manifest.total_nbytes:
        raise WireFormatError(f"truncated message: {len(mv)} bytes, the header declares {manifest.total_nbytes}")
    if len(mv) > manifest.total_nbytes:
        raise WireFormatError(
            f"{len(mv) - manifest.total_nbytes} trailing bytes after a message of {manifest.total_nbytes}"
        )
    payload = mv[manifest.header_nbytes :]
    if _crc32(payload) != manifest.payload_crc32:
        raise WireFormatError("payload checksum mismatch (corrupted message)")
    return decode_payload(manifest, payload)


# lookup tables, built from the one implementation in _formats
_BYTES = np.arange(256, dtype=np.uint8)[:, None]
_E8M0_LUT = e8m0_scale_values(np, _BYTES[:, 0])
_LUT = {c: np.ascontiguousarray(F.code_values(np, c, _BYTES), np.float32) for c in ("int4", "fp4", "int2", "sign")}
"""(256, 2) / (256, 2) / (256, 4) / (256, 8) float32: an int4 / fp4 / int2 / sign payload byte ->
the unscaled values of its codes, first element first (``_formats.code_values`` of every byte,
the device-side math); one ``np.take`` of these rows writes every value of a payload byte."""

# Largest valid scales: q * s stays finite (the encoder stays below these for |x| <= 2**127).
_MAX_INT_SCALE = {
    "int8": 1.5 * MAX_ABS / 127,
    "int4": 1.5 * MAX_ABS / 7,
    "sign": 1.5 * MAX_ABS,
    "int2": 1.3 * MAX_ABS,
}
_MAX_E8M0 = 252

_F32_MAX = float(np.finfo(np.float32).max)

_CHUNK = 1 << 16
"""Elements decoded per numpy pass: a chunk's source bytes and its float32 output (256 KiB) stay
in the L2 cache while the few passes over it (convert, scale, finiteness check) run."""


def _check_finite(name: str, a: np.ndarray) -> None:
    # one BLAS pass, no temporary: a finite sum of squares means every value is finite (NaN and
    # Inf propagate into it); only when it is not (or the squares overflow) the exact test runs,
    # two reductions in which NaN propagates through max/min and fails
    if not a.size:
        return
    if a.dtype == np.float32 and a.ndim == 1:
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.dot(a, a)):
                return
    if not (float(a.max()) <= _F32_MAX and float(a.min()) >= -_F32_MAX):
        raise WireFormatError(f"leaf {name!r} decodes to non-finite values")


def _decode_dense(codec: str, name: str, src: np.ndarray) -> np.ndarray:
    """fp32 / bf16 payload -> new float32 array, chunk by chunk, each chunk checked finite.

    fp32 is a copy; bf16 the bits shifted into the high half of a uint32
    (``_formats.bf16_bits_to_f32``, in place). Inf and NaN (possible in bf16 bits of a malformed
    message) fail the finiteness check.
    """
    n = src.shape[0]
    out = np.empty(n, np.float32)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        o = out[a:b]
        if codec == "bf16":
            u = o.view(np.uint32)
            np.copyto(u, src[a:b])  # uint16 -> uint32, zero-extended
            np.left_shift(u, 16, out=u)
        else:
            np.copyto(o, src[a:b])
        _check_finite(name, o)
    return out


def _decode_blocks(codec: str, B: int, s: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """int8 / int4 / fp4 / int2 / sign payload -> new float32 array of ``nb * B`` values (block padding
    included): the code values times their block's scale, chunk by chunk.

    int8: the byte read as int8 (``_formats.code_values``) converted to float32; int4, fp4,
    int2 and sign: the 2, 2, 4 or 8 values of each byte from :data:`_LUT`. Then one in-place
    multiply by the scales. The scales were checked, so every product is finite.
    """
    total = s.shape[0] * B
    out = np.empty(total, np.float32)
    step = B * max(1, _CHUNK // B)
    per = F.CODES_PER_BYTE[codec]
    rows = out.reshape(-1, per)  # B is a multiple of per: a block is B / per whole bytes
    for a in range(0, total, step):
        b = min(total, a + step)
        if codec == "int8":
            np.copyto(out[a:b], codes[a:b].view(np.int8))
        else:  # mode="clip" (indices are bytes < 256 anyway): "raise" would buffer the output
            np.take(_LUT[codec], codes[a // per : b // per], axis=0, out=rows[a // per : b // per], mode="clip")
        o = out[a:b].reshape(-1, B)
        np.multiply(o, s[a // B : b // B, None], out=o)
    return out


def scales(codec: str, name: str, raw: np.ndarray) -> np.ndarray:
    """The block scales of a non-empty leaf as float32, checked: bf16 bits in ``[0, max]`` (int8 /
    int4 / int2 / sign), E8M0 codes at most 252 (fp4)."""
    if codec == "fp4":
        if int(raw.max()) > _MAX_E8M0:
            raise WireFormatError(f"leaf {name!r}: E8M0 scale code above {_MAX_E8M0}")
        return _E8M0_LUT[raw]
    s = bf16_bits_to_f32(np, raw)
    if not (bool(np.all(s >= 0)) and float(s.max()) <= _MAX_INT_SCALE[codec]):
        raise WireFormatError(f"leaf {name!r}: block scales negative, non-finite or too large")
    return s


def check_topk(name: str, idx: np.ndarray, vals: np.ndarray, n: int) -> None:
    """topk indices strictly increasing below ``n``, values finite."""
    if idx.size:
        if int(idx[-1]) >= n or (idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1]))):
            raise WireFormatError(f"leaf {name!r}: topk indices not strictly increasing below {n}")
        _check_finite(name, vals)


def _views(codec: str, leaf: LeafInfo, buf: memoryview) -> list[np.ndarray]:
    """The wire parts of one leaf (``_formats.part_dtypes`` / ``part_lengths``) as views of ``buf``."""
    parts, off = [], leaf.offset
    for length, dt in zip(F.part_lengths(codec, leaf.size, leaf.block_size, leaf.k), F.part_dtypes(codec)):
        parts.append(np.frombuffer(buf, dt, length, off))
        off += length * dt.itemsize
    return parts


def leaf_parts(codec: str, leaf: LeafInfo, buf: memoryview, *, decode: bool = False, owned: bool = False) -> Any:
    """The wire parts of one leaf as views of ``buf`` (``_formats.part_dtypes`` /
    ``part_lengths``), checked; with ``decode``, the leaf's float32 values instead: a new array,
    or with ``owned`` (``buf`` is a writable buffer nothing else uses) fp32 values in place.

    The parts are for a decode elsewhere, on an accelerator with ``_formats.dequantize(jax.numpy,
    ...)``, which then gives the same float32 values as the host decode, and finite ones. Checks:
    fp32 and topk values finite; bf16 bits not Inf or NaN (exponent all ones; a decode checks the
    values as it converts them); int8 / int4 / int2 / sign scales in ``[0, max]``; fp4 scale codes
    at most 252; topk indices strictly increasing below the size.

    Raises:
      WireFormatError: a check failed.
    """
    parts = _views(codec, leaf, buf)
    name, n = leaf.name, leaf.size
    if codec == "fp32" and (not decode or owned and parts[0].dtype.isnative and parts[0].flags.writeable):
        _check_finite(name, parts[0].view(np.float32))
        if decode:  # the values are already where they can stay
            return parts[0].view(np.float32).reshape(leaf.shape)
    elif codec in ("fp32", "bf16") and decode:
        return _decode_dense(codec, name, parts[0]).reshape(leaf.shape)
    elif codec == "bf16":
        if parts[0].size and bool(np.any((parts[0] & 0x7F80) == 0x7F80)):
            raise WireFormatError(f"leaf {name!r} decodes to non-finite values")
    elif codec == "topk":
        check_topk(name, *parts, n)
        if decode:
            out = np.zeros(n, np.float32)
            out[parts[0].astype(np.intp)] = parts[1]
            return out.reshape(leaf.shape)
    elif n:
        s = scales(codec, name, parts[0])
        if decode:
            return _decode_blocks(codec, leaf.block_size, s, parts[1])[:n].reshape(leaf.shape)
    return np.zeros(leaf.shape, np.float32) if decode else tuple(parts)


def decode_payload(manifest: Manifest, payload: memoryview, *, owned: bool = False) -> Any:
    """Decodes a payload (already length- and checksum-checked) described by ``manifest``.

    ``owned``: the payload is a writable buffer that nothing else uses (the StreamDecoder's):
    fp32 leaves are then returned as views into it instead of copies.
    """
    leaves = [leaf_parts(manifest.codec, leaf, payload, decode=True, owned=owned) for leaf in manifest.leaves]
    return _tree.unflatten(manifest.structure, leaves)


def _whole(check: Callable[[Manifest], None] | None, manifest: Manifest) -> Generator[np.ndarray, np.ndarray, Any]:
    """The :class:`Reader` sink of a :class:`StreamDecoder`: ``check(manifest)``, then the whole
    payload in one buffer, returned."""
    if check is not None:
        check(manifest)
    # numpy's buffer (not bytearray(n), which zero-fills): large ones get huge pages
    return (yield np.empty(manifest.payload_nbytes, np.uint8))


class StreamDecoder(Reader):
    """Incremental decoder for a message arriving in chunks (for example aiohttp
    ``request.content.iter_chunked``).

    The prefix and header are validated as soon as they arrive (:attr:`header` is then set, so a
    server can check leaf names, shapes and codec and stop early); the payload buffer is
    allocated only after the declared sizes passed ``max_bytes`` / ``max_decoded_bytes`` (and
    ``check``); the CRC is computed incrementally. Errors are sticky: after a
    :class:`WireFormatError` every further call raises it again.

    Example::

        dec = rj.compress.StreamDecoder(max_bytes=limit)
        async for chunk in request.content.iter_chunked(1 << 16):
            dec.feed(chunk)
            if dec.header is not None and dec.header.names != expected_names: ...
        tree = dec.finish()

    Args:
      max_bytes: largest accepted message (bytes).
      max_decoded_bytes: largest accepted decoded size (float32 bytes).
      check: ``check(manifest)``, called once the header is validated and before the payload
        buffer is allocated; it raises :class:`WireFormatError` to refuse the message.
    """

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
        check: Callable[[Manifest], None] | None = None,
    ):
        super().__init__(partial(_whole, check), max_bytes=max_bytes, max_decoded_bytes=max_decoded_bytes)
        self._result: tuple[Any] | None = None

    def finish_parts(self) -> list[tuple[np.ndarray, ...]]:
        """Checks that the whole message arrived intact and returns each leaf's wire parts,
        checked but not decoded (:func:`leaf_parts`; views into the decoder's payload buffer),
        in the header's leaf order. Call it instead of :meth:`finish`, once.

        Raises:
          WireFormatError: truncated message, checksum mismatch, bad payload contents.
        """
        payload, m = memoryview(super().finish()), self.header
        return self._sticky(lambda: [leaf_parts(m.codec, leaf, payload) for leaf in m.leaves])

    def finish(self) -> Any:
        """Checks that the whole message arrived intact and decodes it.

        fp32 leaves are views into the decoder's payload buffer (no copy); other codecs decode
        into new arrays. A second call returns the same pytree.

        Returns:
          The pytree of writable float32 numpy arrays (as :func:`decode`).

        Raises:
          WireFormatError: truncated message, checksum mismatch, bad payload contents.
        """
        if self._result is None:
            payload = memoryview(super().finish())  # handed over: fp32 leaves view it
            self._result = (self._sticky(lambda: decode_payload(self.header, payload, owned=True)),)
        return self._result[0]
