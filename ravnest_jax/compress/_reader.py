"""The one streaming reader of the wire format (``_wire.py``; jax-free, numpy only): a message fed
as a socket delivers it, its prefix and header parsed and checked once, its payload then handed
to a sink region by region.

Every streaming decoder is a sink of it: :class:`~ravnest_jax.compress.StreamDecoder` (the whole
payload, decoded once its checksum is checked), :class:`~ravnest_jax.compress.RangeDecoder` (a
part, decoded grid chunk by grid chunk as it arrives), and the swarm's activation and part
decoders (a StreamDecoder whose ``check`` refuses another leaf before the payload is allocated).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from ._errors import WireFormatError
from ._wire import PREFIX_NBYTES, Manifest, _as_view, _check_limit, _crc32, _parse_header, _parse_prefix

Sink = Callable[[Manifest], Generator["int | np.ndarray", np.ndarray, Any]]
"""``sink(manifest)``: a generator over the payload's regions, in order. It yields each region as
a byte count (it is sent the reader's scratch buffer of that length, valid until its next yield)
or as a contiguous uint8 array (the reader fills it in place), and is sent it filled; what it
returns is what :meth:`Reader.finish` returns. It raises :class:`WireFormatError` to refuse the
message (a header it does not expect, a bad value)."""


class Reader:
    """Reads one message fed in chunks into ``sink`` (see :data:`Sink`).

    The prefix and header are checked as soon as they arrive (:attr:`header` is then set) and the
    declared sizes against ``max_bytes`` / ``max_decoded_bytes`` / ``max_header_bytes`` before the
    sink is started, so before any payload buffer is allocated; the CRC-32 is computed as the
    bytes arrive. Errors are sticky: after a :class:`WireFormatError` every further call raises it
    again.

    Args:
      sink: the payload's consumer, started once the header is checked.
      max_bytes: largest accepted message (bytes).
      max_decoded_bytes: largest accepted decoded size (float32 bytes).
      max_header_bytes: largest accepted prefix + header (bytes), or None: no limit of its own.
    """

    # the error texts (``n``: bytes received, ``total``: declared bytes); a subclass may reword them
    _NO_HEADER = "truncated message: {n} bytes received, the header is incomplete"
    _TRUNCATED = "truncated message: {n} of {total} bytes received"
    _PAST_END = "bytes past the declared end of a message of {total} bytes"
    _CORRUPT = "payload checksum mismatch (corrupted message)"

    def __init__(self, sink: Sink, *, max_bytes: int, max_decoded_bytes: int, max_header_bytes: int | None = None):
        self._sink, self._max_header = sink, max_header_bytes
        self._max_bytes = _check_limit("max_bytes", max_bytes)
        self._max_decoded = _check_limit("max_decoded_bytes", max_decoded_bytes)
        self.nbytes = 0  # bytes fed
        self._head = bytearray()
        self._header_len: int | None = None
        self._manifest: Manifest | None = None
        self._plan: Generator[Any, np.ndarray, Any] | None = None
        self._buf: np.ndarray | None = None  # the region being filled (None: no region left)
        self._scratch = np.empty(0, np.uint8)
        self._fill = 0
        self._crc = 0
        self._value: Any = None  # what the sink returned
        self._error: WireFormatError | None = None
        self._finished = False

    @property
    def header(self) -> Manifest | None:
        """The validated :class:`Manifest` once the header arrived, else None."""
        return self._manifest

    def _sticky(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._error is not None:
            raise self._error
        try:
            return fn(*args)
        except WireFormatError as e:
            self._error, self._plan = e, None
            raise

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Adds the next bytes of the message.

        Raises:
          WireFormatError: the bytes so far are not a valid start of a message, exceed a maximum,
            go past the declared end of the message, or the sink refused them.
        """
        self._sticky(self._feed, chunk)

    def _feed(self, chunk: Any) -> None:
        if self._finished:
            raise WireFormatError("feed() after finish()")
        mv = _as_view(chunk)
        self.nbytes += len(mv)
        while len(mv):
            if self._manifest is None:
                target = PREFIX_NBYTES if self._header_len is None else PREFIX_NBYTES + self._header_len
                take = min(target - len(self._head), len(mv))
                self._head += mv[:take]
                mv = mv[take:]
                if len(self._head) < target:
                    return
                if self._header_len is None:
                    self._header_len = _parse_prefix(self._head, self._max_bytes)[0]
                    if self._max_header is not None and PREFIX_NBYTES + self._header_len > self._max_header:
                        raise WireFormatError(f"header of {self._header_len} bytes, above {self._max_header}")
                    continue
                self._manifest = _parse_header(
                    self._head[:PREFIX_NBYTES], self._head[PREFIX_NBYTES:], self._max_bytes, self._max_decoded
                )
                self._plan = self._sink(self._manifest)
                self._next(None)
                continue
            if self._buf is None:
                raise WireFormatError(self._PAST_END.format(total=self._manifest.total_nbytes))
            take = min(len(self._buf) - self._fill, len(mv))
            self._buf[self._fill : self._fill + take] = mv[:take]
            self._crc = _crc32(mv[:take], self._crc)
            self._fill += take
            mv = mv[take:]
            if self._fill == len(self._buf):
                self._next(self._buf)

    def _next(self, filled: np.ndarray | None) -> None:
        """Sends the filled region to the sink and takes its next one (an empty one goes back at
        once); ``None`` starts the sink."""
        assert self._plan is not None
        while True:
            try:
                want = next(self._plan) if filled is None else self._plan.send(filled)
            except StopIteration as stop:
                self._buf, self._plan, self._value = None, None, stop.value
                return
            if not isinstance(want, np.ndarray) and self._scratch.size != want:
                self._scratch = np.empty(want, np.uint8)
            buf = want if isinstance(want, np.ndarray) else self._scratch
            self._fill = 0
            if len(buf):
                self._buf = buf
                return
            filled = buf

    def finish(self) -> Any:
        """Checks that the whole message arrived intact; returns what the sink returned (handed
        over: a second call returns None).

        Raises:
          WireFormatError: a message cut short (or never started), or a checksum mismatch.
        """
        return self._sticky(self._complete)

    def _complete(self) -> Any:
        m = self._manifest
        if m is None:
            raise WireFormatError(self._NO_HEADER.format(n=len(self._head)))
        if self._buf is not None:
            raise WireFormatError(self._TRUNCATED.format(n=self.nbytes, total=m.total_nbytes))
        if self._crc != m.payload_crc32:
            raise WireFormatError(self._CORRUPT)
        self._finished = True
        value, self._value = self._value, None
        return value
