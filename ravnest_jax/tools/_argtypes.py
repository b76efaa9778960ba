"""The argparse ``type=`` checks shared by the commands of ``ravnest-jax`` (``ravnest_jax.cli``
and the command modules of ``ravnest_jax.tools``): a value that is not what the flag takes is a
usage error naming what was expected and what was given."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


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
    return checked(value, float, lambda v: 0 < v < float("inf"), "a number > 0")


def positive_int(value: str) -> int:
    return checked(value, int, lambda v: v >= 1, "an integer >= 1")


def port(value: str) -> int:
    return checked(value, int, lambda v: 0 <= v <= 65535, "a port in 0-65535")
