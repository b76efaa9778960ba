"""Exception types of :mod:`ravnest_jax.compress` (jax-free)."""

from __future__ import annotations


class WireFormatError(ValueError):
    """A pseudo-gradient message is malformed, truncated, corrupted or too large.

    Raised by :func:`ravnest_jax.compress.decode`, :func:`~ravnest_jax.compress.read_header` and
    :class:`~ravnest_jax.compress.StreamDecoder` for *anything* wrong with received bytes: wrong
    magic, unsupported format version, truncated prefix/header/body, trailing bytes, bad
    checksum, an undecodable or inconsistent header (unknown codec, bad shape, a payload length
    that does not match the shape), a declared size above the configured maximum, or payload
    contents that decode to non-finite values or out-of-range indices. The parser raises no other
    exception type for bad input. The message says what was wrong.
    """


class NonFiniteError(ValueError):
    """A pseudo-gradient leaf holds NaN, +-Inf, or a value of magnitude above ``2**127``.

    Raised at encode time (:func:`~ravnest_jax.compress.encode`,
    :func:`~ravnest_jax.compress.packed_to_bytes`) so that a diverged peer cannot poison the
    swarm. The message names the leaf. Attribute ``leaf`` holds the leaf name.
    """

    def __init__(self, message: str, leaf: str | None = None):
        super().__init__(message)
        self.leaf = leaf
