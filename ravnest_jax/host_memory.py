"""Host memory: glibc ``mallopt`` settings for round buffers and a peer's long-running heap.

``rj.host_memory`` is a leaf of the house (it imports nothing of ravnest_jax), used by the swarm,
the outer loop and the checkpointer. ``import ravnest_jax`` calls :func:`cap_host_arenas`: the
one thing the package does at import, because it has to come before jax starts its threads
(docs/architecture.md, "Layers").

glibc serves an allocation at or above its *mmap threshold* with a fresh ``mmap`` and returns it
with ``munmap`` when freed, so the next round's buffer of the same size is faulted in again,
4 KiB page by page (about 1 GB/s on a loaded core, slower than the codec itself). The threshold
starts at 128 KiB and only rises as large blocks are freed, and freed memory at the top of the
heap is given back above the *trim threshold*. A round allocates and frees the same sizes every
time (the encoded slices, which ``device_encode`` keeps at most ``SEGMENT_BYTES``, and the
received parts), so fixing both thresholds lets the heap keep and reuse them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit on 64-bit (HEAP_MAX_SIZE / 2)
DEFAULT_TRIM_THRESHOLD = 256 << 20
DEFAULT_ARENA_MAX = 2
ENV_OPT_OUT = "RAVNEST_JAX_KEEP_MALLOC"

_lock = threading.Lock()
_applied: dict[str, int] | None = None
_arenas: list[int | None] = []  # [the cap applied, or None] once cap_host_arenas has run


def _user_chose_arenas() -> bool:
    return bool(os.environ.get("MALLOC_ARENA_MAX")) or "arena_max" in os.environ.get("GLIBC_TUNABLES", "")


def cap_host_arenas(arena_max: int = DEFAULT_ARENA_MAX) -> int | None:
    """Caps glibc's malloc arenas (``mallopt(M_ARENA_MAX)``), once per process; ``import
    ravnest_jax`` calls it, before jax starts its threads.

    glibc gives threads up to 8 heaps (arenas) per core. Orbax starts about 28 short-lived
    threads per checkpoint save, new threads take the arenas in turn, and each arena's heap grew
    until it had held a save's peak once: a long-running peer's RSS rose for hundreds of saves
    (a 4-peer chaos run's survivor +366 MB/h over 60 rounds; with 2 arenas +56 MB/h, within its
    noise; docs/swarm.md, "Chaos"). Only arenas not created yet are capped: a process whose
    threads already made them keeps them (jax makes up to the maximum when its backend starts).
    ``MALLOC_ARENA_MAX`` (or ``glibc.malloc.arena_max`` in ``GLIBC_TUNABLES``) in the
    environment, and ``RAVNEST_JAX_KEEP_MALLOC=1``, leave it as it is.

    Args:
      arena_max: arenas at most, int >= 1.

    Returns:
      The cap applied, also on later calls; None if left alone (not glibc, the environment
      chose, the opt-out variable is set, or ``mallopt`` refused).

    Raises:
      ValueError: ``arena_max`` is not an int >= 1.
    """
    if isinstance(arena_max, bool) or not isinstance(arena_max, int) or arena_max < 1:
        raise ValueError(f"arena_max must be an int >= 1, got {arena_max!r}")
    with _lock:
        if _arenas:
            return _arenas[0]
        cap: int | None = None
        if (
            os.environ.get(ENV_OPT_OUT, "") in ("", "0")
            and platform.libc_ver()[0] == "glibc"
            and not _user_chose_arenas()
        ):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                cap = arena_max if libc.mallopt(M_ARENA_MAX, int(arena_max)) == 1 else None
            except (OSError, AttributeError):
                cap = None
        _arenas.append(cap)
        return cap


def tune_host_allocator(
    mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = DEFAULT_TRIM_THRESHOLD
) -> dict[str, int] | None:
    """Makes glibc keep and reuse round-sized host buffers instead of mapping fresh pages.

    Sets ``M_MMAP_THRESHOLD`` (allocations up to this many bytes come from the heap) and
    ``M_TRIM_THRESHOLD`` (up to this many free bytes stay at the top of the heap) with
    ``mallopt(3)``, once per process; :class:`ravnest_jax.OuterSync` and
    :class:`ravnest_jax.Swarm` call it when they are created. Measured on one core with a 64 MiB
    float32 pseudo-gradient: a jitted encode to 2-byte values (the fp16 codec, since dropped) 18 ms
    with the settings, 27 ms without (``benchmarks/bench_codecs.py --keep-malloc`` runs without).
    The cost is memory: up to ``trim_threshold`` bytes of freed heap stay mapped (counted in RSS).
    Setting the environment variable ``RAVNEST_JAX_KEEP_MALLOC=1`` leaves the allocator alone. The
    arena cap (:func:`cap_host_arenas`) is applied too if ``import ravnest_jax`` has not yet.

    Args:
      mmap_threshold: bytes, at most 32 MiB (glibc's limit on 64-bit).
      trim_threshold: bytes, > 0.

    Returns:
      The settings applied (``{"mmap_threshold": ..., "trim_threshold": ...}``, bytes, and
      ``"arena_max"`` when the arenas are capped), also on later calls; None if not applied:
      not glibc (musl, macOS, Windows), the opt-out variable is set, or ``mallopt`` refused.

    Raises:
      ValueError: a threshold out of range.
    """
    global _applied
    if not 0 < mmap_threshold <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_threshold must be in (0, {MMAP_THRESHOLD_MAX}] bytes, got {mmap_threshold!r}")
    if not trim_threshold > 0:
        raise ValueError(f"trim_threshold must be > 0 bytes, got {trim_threshold!r}")
    arenas = cap_host_arenas()
    with _lock:
        if _applied is not None:
            return dict(_applied)
        if os.environ.get(ENV_OPT_OUT, "") not in ("", "0") or platform.libc_ver()[0] != "glibc":
            return None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = libc.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
            ok = ok and libc.mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) == 1
        except (OSError, AttributeError):
            return None
        if not ok:
            return None
        _applied = {"mmap_threshold": int(mmap_threshold), "trim_threshold": int(trim_threshold)}
        if arenas is not None:
            _applied["arena_max"] = arenas
        return dict(_applied)


def host_allocator_settings() -> dict[str, int] | None:
    """What :func:`tune_host_allocator` applied in this process (bytes), or None."""
    return None if _applied is None else dict(_applied)


def release_free_heap() -> bool:
    """Returns the heap's free memory to the operating system (glibc ``malloc_trim(0)``).

    The allocator settings keep freed buffers for reuse, which suits round buffers (the same
    sizes every round) but not the one-off buffers of a state transfer (several copies of the
    whole state): without this, a peer serving the state to joiners kept up to about 15 times
    the state's size of freed memory in its RSS (measured: 20 MB state, 300 downloads, +300 MB,
    of which ``malloc_trim`` returned 230 MB). Called after a state is served or downloaded
    (rare: once per join or resync). A few milliseconds; safe from any thread.

    Returns:
      True if glibc's ``malloc_trim`` ran (and released something), False otherwise (not glibc,
      or nothing to release).
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
