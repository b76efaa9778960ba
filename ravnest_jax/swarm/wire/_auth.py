"""Request authentication: HMAC-SHA256 over the request line, the round and the body digest.

Every request between peers and to the rendezvous carries these headers:

``X-RJ-Peer``       the sender's peer id
``X-RJ-Round``      the round the request belongs to (``-`` when none)
``X-RJ-Time``       UNIX time of signing, seconds (float as text)
``X-RJ-Nonce``      16 random bytes, hex
``X-RJ-Body``       BLAKE3-256 of the body, hex (of ``b""`` for an empty body)
``X-RJ-Signature``  HMAC-SHA256(token, canonical string), hex

The canonical string is ``method \\n path \\n run_id \\n round \\n peer \\n time \\n nonce \\n body
\\n extra``.
The body digest is BLAKE3 (collision resistant like SHA-256, about twice as fast here: it is
the one cryptographic pass over every payload byte, on both sides), computed incrementally as
a body is streamed (:func:`body_hasher`). Signatures are compared with :func:`hmac.compare_digest`. Responses that carry a payload are
signed the same way with the method ``RESPONSE`` so that a client can check who answered.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import blake3

H_PEER = "X-RJ-Peer"
H_ROUND = "X-RJ-Round"
H_TIME = "X-RJ-Time"
H_NONCE = "X-RJ-Nonce"
H_BODY = "X-RJ-Body"
H_SIG = "X-RJ-Signature"


def body_hasher() -> Any:
    """A fresh incremental hasher of request/response bodies (``.update(chunk)``,
    ``.hexdigest()``): BLAKE3, 32 bytes."""
    return blake3.blake3()


def body_digest(data: bytes | bytearray | memoryview) -> str:
    """The body digest (hex) that ``X-RJ-Body`` carries: BLAKE3-256 of ``data``."""
    return blake3.blake3(data).hexdigest()


EMPTY_BODY = body_digest(b"")
MAX_CLOCK_SKEW_S = 300.0
MAX_NONCES = 200_000


class AuthError(Exception):
    """A request's proof of the run token is missing, malformed, stale or wrong."""


def _mac(token: str | bytes, *fields: str) -> str:
    """HMAC-SHA256 (hex) with the run token over ``fields``, one a line."""
    key = token.encode() if isinstance(token, str) else token
    if not key:
        raise ValueError("the run token must not be empty")
    return hmac.new(key, "\n".join(fields).encode(), hashlib.sha256).hexdigest()


def _fresh(ts: str, nonce: str, nonces: NonceCache | None, max_skew_s: float) -> None:
    """Refuses (:class:`AuthError`) a malformed or stale signing time and a replayed nonce."""
    try:
        t = float(ts)
    except ValueError:
        raise AuthError("malformed auth time") from None
    if abs(time.time() - t) > max_skew_s:
        raise AuthError("auth time outside the allowed clock skew")
    if nonces is not None and not nonces.check_and_add(nonce):
        raise AuthError("replayed nonce")


def sign(
    token: str | bytes,
    *,
    method: str,
    path: str,
    run_id: str,
    peer: str,
    round_: int | str | None = None,
    body_digest: str = EMPTY_BODY,
    extra: str = "",
) -> dict[str, str]:
    """Return the auth headers for one request (or, with ``method="RESPONSE"``, one response).

    ``extra`` is covered by the signature but not sent: both sides build it from values they
    send in other headers (e.g. a part's weight and round manifest).
    """
    ts = f"{time.time():.6f}"
    nonce = secrets.token_hex(16)
    r = "-" if round_ is None else str(round_)
    mac = _mac(token, method.upper(), path, run_id, r, peer, ts, nonce, body_digest, extra)
    return {H_PEER: peer, H_ROUND: r, H_TIME: ts, H_NONCE: nonce, H_BODY: body_digest, H_SIG: mac}


class NonceCache:
    """Remembers recently seen nonces to refuse replayed requests (bounded in size and age:
    ``MAX_NONCES``, twice the allowed clock skew)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check_and_add(self, nonce: str) -> bool:
        now = time.monotonic()
        while self._seen and (
            len(self._seen) >= MAX_NONCES or now - next(iter(self._seen.values())) > 2 * MAX_CLOCK_SKEW_S
        ):
            self._seen.popitem(last=False)  # the oldest
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True


def verify(
    token: str | bytes,
    headers: Mapping[str, str],
    *,
    method: str,
    path: str,
    run_id: str,
    nonces: NonceCache | None = None,
    extra: str = "",
    max_skew_s: float = MAX_CLOCK_SKEW_S,
) -> tuple[str, str, str]:
    """Check the auth headers of a request; return ``(peer, round, body_digest)``.

    The body digest is only *claimed* here: the caller must hash the body it reads and compare it
    with :func:`digest_matches` before acting on it.

    Raises:
      AuthError: a header is missing or malformed, the time is off by more than ``max_skew_s``
        seconds, the nonce was seen before, or the signature does not match.
    """
    try:
        peer, r, ts, nonce, body_sha, sig = (headers[h] for h in (H_PEER, H_ROUND, H_TIME, H_NONCE, H_BODY, H_SIG))
    except KeyError as e:
        raise AuthError(f"missing auth header {e.args[0]}") from None
    if len(sig) != 64 or len(body_sha) != 64 or not (8 <= len(nonce) <= 64):
        raise AuthError("malformed auth header")
    if not hmac.compare_digest(_mac(token, method.upper(), path, run_id, r, peer, ts, nonce, body_sha, extra), sig):
        raise AuthError("bad signature")
    _fresh(ts, nonce, nonces, max_skew_s)
    return peer, r, body_sha


def digest_matches(claimed_hex: str, actual_hex: str) -> bool:
    """Constant-time comparison of two hex digests."""
    return hmac.compare_digest(claimed_hex.encode(), actual_hex.encode())


H_HOP = "X-RJ-Hop"  # proof for a relay on the way: HMAC over the request line as sent


def hop_sign(token: str | bytes, method: str, url_path: str, signed: Mapping[str, str]) -> str:
    """The ``X-RJ-Hop`` value of a request whose auth headers are ``signed`` (see :func:`sign`),
    sent to ``url_path`` (the full path of the URL, a relay's prefix included). A relay checks it
    with :func:`hop_verify` without knowing what the end-to-end signature covers (its ``extra``)."""
    return _mac(token, "HOP", method.upper(), url_path, *(signed[h] for h in (H_PEER, H_TIME, H_NONCE, H_BODY)))


def hop_verify(
    token: str | bytes,
    headers: Mapping[str, str],
    *,
    method: str,
    url_path: str,
    nonces: NonceCache | None = None,
    max_skew_s: float = MAX_CLOCK_SKEW_S,
) -> str:
    """Checks the ``X-RJ-Hop`` proof of a request on its way through a relay; returns the sender.

    Raises:
      AuthError: a header is missing or malformed, stale, replayed, or the proof does not match.
    """
    try:
        hop = headers[H_HOP]
        fields = {h: headers[h] for h in (H_PEER, H_TIME, H_NONCE, H_BODY)}
    except KeyError as e:
        raise AuthError(f"missing auth header {e.args[0]}") from None
    if len(hop) != 64:
        raise AuthError("malformed hop proof")
    if not hmac.compare_digest(hop_sign(token, method, url_path, fields), hop):
        raise AuthError("bad hop proof")
    _fresh(fields[H_TIME], "hop:" + fields[H_NONCE], nonces, max_skew_s)
    return fields[H_PEER]
