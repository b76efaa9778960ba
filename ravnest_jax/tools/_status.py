"""A run's status asked of its rendezvous (``ravnest-jax status``), and request failures told in
words (one line each) instead of exception reprs (``ClientConnectorError(ConnectionKey(...))``)."""

from __future__ import annotations

import asyncio
import socket
import ssl

import aiohttp

from ravnest_jax.swarm import HTTPStatusError

_STATUS_WORDS = {
    400: "refused the request",
    401: "refused the token",
    403: "refused the token",
    404: "has no such page (is the URL a rendezvous?)",
    413: "found the request too large",
    429: "is too busy (too many requests)",
    500: "failed on its side",
    502: "sent a bad answer",
    503: "is too busy",
}


def _os_error_words(e: BaseException | None) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, socket.gaierror):
        return "unknown host name"
    if isinstance(e, (TimeoutError, socket.timeout)):
        return "connection timed out"
    if isinstance(e, ssl.SSLError):
        return f"TLS failed ({e.reason or e})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror[0].lower() + e.strerror[1:]
    return str(e) or type(e).__name__


def describe_request_error(
    e: BaseException, url: str, *, what: str = "the rendezvous", timeout: float | None = None
) -> str:
    """One line that says why a request to ``url`` failed, in words.

    Args:
      e: what :func:`ravnest_jax.swarm.signed_json` (or aiohttp) raised.
      url: the base URL that was asked.
      what: the name of the service, for the sentence.
      timeout: the request's total timeout in seconds, to name it when it ran out.
    """
    at = f"{what} at {url}"
    if isinstance(e, HTTPStatusError):
        words = _STATUS_WORDS.get(e.status, "answered with an error")
        detail = str(e).split(":", 1)[-1].strip().splitlines()[0][:120] if ":" in str(e) else ""
        detail = "" if detail.startswith("<") else detail  # another web server's HTML error page
        if e.status == 404 and detail.startswith("no run "):  # the rendezvous' own 404
            return f"{at}: {detail}"
        line = f"{at} {words} ({e.status})"
        return f"{line}: {detail}" if detail and e.status not in (401, 403) else line
    if isinstance(e, (aiohttp.InvalidURL, getattr(aiohttp, "NonHttpUrlClientError", aiohttp.InvalidURL))):
        return f"not an http(s) URL: {url} (expected e.g. http://10.0.0.1:8765)"
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        return f"cannot reach {at}: its TLS certificate is not trusted ({e.certificate_error})"
    if isinstance(e, aiohttp.ClientSSLError):
        return f"cannot reach {at}: TLS failed"
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot reach {at}: {_os_error_words(e.os_error)}"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return f"{at} closed the connection without answering (is it a rendezvous? http vs https?)"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        within = f" within {timeout:g} s" if timeout is not None else ""
        return f"no answer from {at}{within}"
    if isinstance(e, PermissionError):
        return f"{at} answered, but not signed with this run token (a different token or run?): {e}"
    if isinstance(e, aiohttp.ClientResponseError):
        return f"{at} answered with an error ({e.status} {e.message})"
    if isinstance(e, aiohttp.ClientError):
        return f"cannot talk to {at}: {str(e) or type(e).__name__}"
    if isinstance(e, ValueError):  # json: the answer is not JSON
        return f"{at} sent an answer that is not JSON: {e}"
    if isinstance(e, OSError):
        return f"cannot reach {at}: {_os_error_words(e)}"
    return f"{at}: {str(e) or type(e).__name__}"


def fetch_status(url: str, run_id: str, token: bytes, *, timeout: float) -> object:
    """The status of run ``run_id`` from the rendezvous at ``url`` (its JSON answer): live peers,
    membership version, recent rounds. Raises what the request raised (see
    :func:`describe_request_error`)."""
    from ravnest_jax.swarm import signed_json

    async def fetch() -> object:
        async with aiohttp.ClientSession() as s:
            return await signed_json(
                s,
                url,
                "GET",
                f"/v1/runs/{run_id}/status",
                token=token,
                run_id=run_id,
                peer="cli-status",
                timeout=aiohttp.ClientTimeout(total=timeout),
            )

    return asyncio.run(fetch())
