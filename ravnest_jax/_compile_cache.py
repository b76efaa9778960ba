"""JAX's persistent compilation cache, turned on in one call.

A restarted peer otherwise compiles its jitted steps again (minutes for a large model on a GPU).
Nothing here imports jax at module import: :func:`default_compilation_cache_dir` is used by the
launcher, which must stay free of jax.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["DEFAULT_MIN_COMPILE_TIME_SECS", "default_compilation_cache_dir", "enable_compilation_cache"]

#: programs that compile faster than this (seconds) are not written to the cache (JAX's own
#: default is 1 s; the steps worth caching take longer, tiny helpers would only fill the disk)
DEFAULT_MIN_COMPILE_TIME_SECS = 0.5

#: set to ``0`` (or ``off``, ``false``, ``no``) to make :func:`enable_compilation_cache` do
#: nothing (``ravnest-jax local --no-compile-cache`` sets it for its peers)
OFF_ENV = "RAVNEST_COMPILE_CACHE"


def default_compilation_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/ravnest_jax/xla``, or ``~/.cache/ravnest_jax/xla`` when
    ``XDG_CACHE_HOME`` is unset or empty (the XDG base directory rule)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "ravnest_jax" / "xla"


def enable_compilation_cache(
    path: str | os.PathLike[str] | None = None,
    *,
    min_compile_time_secs: float | None = None,
) -> Path | None:
    """Turns on JAX's persistent compilation cache for this process: a compiled program is
    written to ``path`` and a later process (a restarted peer) loads it instead of compiling.

    Call it before the first ``jax.jit`` compiles (at the top of a training script). Entries
    are keyed by the program, the jax/jaxlib version, the backend, the devices and the compile
    flags, so one directory may serve every peer and every model of a machine. Peers started
    by ``ravnest-jax local`` get the same settings through ``JAX_COMPILATION_CACHE_DIR`` even
    without this call.

    Args:
      path: the cache directory (created if missing). Default: ``JAX_COMPILATION_CACHE_DIR``
        when set, else :func:`default_compilation_cache_dir`.
      min_compile_time_secs: programs that compile faster than this (seconds) are not cached.
        Default: ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` when set, else
        :data:`DEFAULT_MIN_COMPILE_TIME_SECS`.

    Returns:
      The cache directory, or ``None`` when ``RAVNEST_COMPILE_CACHE=0`` turned it off (nothing
      is changed then).

    Raises:
      ValueError: ``min_compile_time_secs`` < 0.
      OSError: the directory cannot be created.
    """
    if os.environ.get(OFF_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    if min_compile_time_secs is None:
        min_compile_time_secs = float(
            os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", DEFAULT_MIN_COMPILE_TIME_SECS)
        )
    if not min_compile_time_secs >= 0:
        raise ValueError(f"min_compile_time_secs must be >= 0, got {min_compile_time_secs!r}")
    if path is None:
        path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_compilation_cache_dir()
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    return path
