"""Checks a peer runs before any long work (loading a model, compiling): the token, the port it
will listen on, and that the rendezvous answers and accepts the token.

Each failure is one line (``SwarmError`` or ``ValueError``) that names what is wrong, so that a
user learns of a typo in seconds rather than after minutes of compiling.
"""

from __future__ import annotations

import logging
import os
import socket
import stat

from ..wire._http import ask_once

log = logging.getLogger("ravnest_jax.swarm")

TOKEN_ENV = "RAVNEST_TOKEN"


def read_token(token_file: str | None = None, *, env: str = TOKEN_ENV) -> str:
    """The run token from ``token_file``, else from the environment variable ``env``, else from
    the file named by ``$RAVNEST_TOKEN_FILE`` (as :class:`~ravnest_jax.swarm.Swarm` reads it).

    Warns (a logged warning) when the file can be read by other users than its owner: the token
    is the only secret of a run (``chmod 600 FILE``).

    Args:
      token_file: path of a file holding the token (surrounding whitespace is stripped).
      env: the environment variable read when ``token_file`` is None.

    Returns:
      The token (a non-empty str).

    Raises:
      ValueError: the file is missing, unreadable or empty, or no token is set (one line).
    """
    if not token_file and not os.environ.get(env, "").strip():
        token_file = os.environ.get("RAVNEST_TOKEN_FILE") or None
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
            mode = os.stat(token_file).st_mode
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--token-file {token_file}: {getattr(e, 'strerror', None) or e}") from None
        if not token:
            raise ValueError(f"--token-file {token_file} is empty")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(
                "token file %s can be read by other users (mode %o); run: chmod 600 %s",
                token_file,
                stat.S_IMODE(mode),
                token_file,
            )
        return token
    token = os.environ.get(env, "").strip()
    if not token:
        raise ValueError(f"no token: pass --token-file FILE or set ${env} (or $RAVNEST_TOKEN_FILE)")
    return token


def check_listen(listen: str) -> None:
    """Binds ``"host:port"`` once and releases it: raises at once when the port is taken.

    Raises:
      ValueError: ``listen`` is not ``host:port``, or the address cannot be bound (in use, not
        an address of this machine); one line naming it.
    """
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen must be 'host:port', got {listen!r}")
    if int(port) == 0:
        return
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {listen}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        # as aiohttp binds (reuse_address): a port in TIME_WAIT is free, one that listens is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
            s.listen(1)
        except OSError as e:
            raise ValueError(f"cannot listen on {listen}: {e.strerror or e}") from None


def check_rendezvous(url: str, *, run_id: str, token: str | bytes, timeout: float = 10.0, ssl: object = None) -> None:
    """Asks the rendezvous for the run's peers with a signed request: it must answer and accept
    the token. Retries connection failures until ``timeout`` (a rendezvous that is starting).

    Raises:
      SwarmError: the rendezvous cannot be reached within ``timeout`` seconds, refuses the token
        (401), or does not answer like a rendezvous; one line naming the URL.
    """
    key = token.encode() if isinstance(token, str) else bytes(token)
    ask_once(url, run_id, key, "preflight", "GET", "/peers", None, timeout, ssl, retry=True)


def preflight(timeout: float = 10.0) -> None:
    """The checks that ``Swarm()`` (every argument from the environment, as ``ravnest-jax local``
    sets it) would fail on when it starts, made now, before a model loads or compiles: the
    rendezvous URL, run id and token are set, the listen port (``$RAVNEST_LISTEN``) is free, and
    the rendezvous answers within ``timeout`` seconds and accepts the token.

    Raises:
      ValueError: a setting is missing or malformed, or the port is taken (one line).
      SwarmError: the rendezvous is unreachable or refuses the token (one line naming the URL).
    """
    url, run_id, token, _, listen, _ = from_environment(None, None, None, None, "auto", None)
    if listen is not None:
        check_listen(listen)
    check_rendezvous(url, run_id=run_id, token=token, timeout=timeout)


__all__ = ["TOKEN_ENV", "check_listen", "check_rendezvous", "preflight", "read_token"]


#: what ``ravnest-jax local`` hands each peer process (read by ``rj.Swarm()``)
ENV_VARS = {
    "rendezvous_url": "RAVNEST_RENDEZVOUS",
    "run_id": "RAVNEST_RUN_ID",
    "token": TOKEN_ENV,
    "token_file": "RAVNEST_TOKEN_FILE",
    "codec": "RAVNEST_CODEC",
    "listen": "RAVNEST_LISTEN",
    "peer_id": "RAVNEST_PEER_ID",
}


def from_environment(
    rendezvous_url: str | None,
    run_id: str | None,
    token: str | bytes | None,
    codec: str | None,
    listen: str | None,
    peer_id: str | None,
) -> tuple:
    """The :class:`Swarm` arguments with every ``None`` filled from the environment
    (:data:`ENV_VARS`), then from the defaults (codec ``"fp32"``, listen ``"0.0.0.0:0"``, a random
    peer id: ``None``).

    Raises:
      ValueError: ``rendezvous_url``, ``run_id`` or ``token`` is neither given nor set (the
        message names the variable), or ``RAVNEST_TOKEN_FILE`` cannot be read.
    """
    env = os.environ

    def need(value, name: str, what: str):
        value = value if value is not None else env.get(ENV_VARS[name], "").strip() or None
        if value is None:
            raise ValueError(f"no {what}: pass {name}= or set ${ENV_VARS[name]} (ravnest-jax local sets it)")
        return value

    rendezvous_url = need(rendezvous_url, "rendezvous_url", "rendezvous URL")
    run_id = need(run_id, "run_id", "run id")
    if token is None and not env.get(TOKEN_ENV, "").strip() and env.get(ENV_VARS["token_file"]):
        token = read_token(env[ENV_VARS["token_file"]])
    token = need(token, "token", "run token")
    if codec is None and env.get(ENV_VARS["codec"]):
        from ..wire._codec import available_codecs

        codec = env[ENV_VARS["codec"]].strip()
        if codec not in available_codecs():
            raise ValueError(
                f"${ENV_VARS['codec']}={codec!r}: unknown codec; available: {', '.join(available_codecs())}"
            )
    codec = codec if codec is not None else "fp32"
    if listen == "auto":
        listen = env.get(ENV_VARS["listen"]) or "0.0.0.0:0"
    if listen is not None and listen.strip().lower() == "none":
        listen = None  # client-only (no inbound port)
    peer_id = peer_id if peer_id is not None else env.get(ENV_VARS["peer_id"]) or None
    return rendezvous_url, run_id, token, codec, listen, peer_id
