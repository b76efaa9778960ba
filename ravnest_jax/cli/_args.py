"""What the commands of ``ravnest-jax`` share: the argparse ``type=`` checks (a value that is not
what the flag takes is a usage error naming what was expected and what was given), the options
several commands take, the run token, and a command's failure as one ``error:`` line."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

TOKEN_ENV = "RAVNEST_TOKEN"


def checked(value: str, cast: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Any:
    """``cast(value)`` if it succeeds and ``ok`` of it holds; else ``argparse.ArgumentTypeError``
    ("expected WHAT, got 'VALUE'")."""
    try:
        v = cast(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    return v


def positive_float(value: str) -> float:
    """A finite number > 0."""
    return checked(value, float, lambda v: 0 < v < float("inf"), "a number > 0")


def non_negative_float(value: str) -> float:
    """A finite number >= 0."""
    return checked(value, float, lambda v: 0 <= v < float("inf"), "a number >= 0")


def unit_interval(value: str) -> float:
    """A number in (0, 1]."""
    return checked(value, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def positive_int(value: str) -> int:
    """An integer >= 1."""
    return checked(value, int, lambda v: v >= 1, "an integer >= 1")


def non_negative_int(value: str) -> int:
    """An integer >= 0."""
    return checked(value, int, lambda v: v >= 0, "an integer >= 0")


def port(value: str) -> int:
    """A TCP port, 0 to 65535."""
    return checked(value, int, lambda v: 0 <= v <= 65535, "a port in 0-65535")


def add_token_file(p: argparse.ArgumentParser) -> None:
    """``--token-file``: the file holding the run token (else ``$RAVNEST_TOKEN``)."""
    p.add_argument("--token-file", help=f"file holding the run token (else ${TOKEN_ENV})")


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    """``--json PATH``: also write ``what`` as JSON there."""
    p.add_argument("--json", default=None, metavar="PATH", help=f"also write {what} as JSON here")


def run_token(token_file: str | None) -> str:
    """The run token from ``token_file`` or ``$RAVNEST_TOKEN``; else ``SystemExit`` with one line."""
    from ravnest_jax.swarm import read_token

    try:
        return read_token(token_file, env=TOKEN_ENV)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def check_eviction(heartbeat: float, eviction: float) -> None:
    """``SystemExit`` unless ``--eviction`` is longer than ``--heartbeat``."""
    if eviction <= heartbeat:
        raise SystemExit(f"error: --eviction ({eviction}) must be longer than --heartbeat ({heartbeat})")


class CommandError(Exception):
    """Ends a command: :func:`ravnest_jax.cli.main` prints ``error: MESSAGE`` on stderr and returns
    ``status``."""

    def __init__(self, message: object, status: int = 2) -> None:
        super().__init__(str(message))
        self.status = status


def fail(message: object, status: int = 2) -> int:
    """Prints ``error: MESSAGE`` on stderr; returns ``status``, the command's exit status."""
    print(f"error: {message}", file=sys.stderr)
    return status


@contextlib.contextmanager
def errors(*kinds: type[BaseException], prefix: str = "", status: int = 2) -> Iterator[None]:
    """An exception of ``kinds`` (default ``ValueError``) raised inside ends the command with
    ``error: PREFIX{exception}`` and exit status ``status`` (a :class:`CommandError`)."""
    caught = kinds or (ValueError,)
    try:
        yield
    except caught as e:
        raise CommandError(f"{prefix}{e}", status) from None
