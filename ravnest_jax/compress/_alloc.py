"""Host allocator settings for round buffers (glibc ``mallopt``).

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
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit on 64-bit (HEAP_MAX_SIZE / 2)
DEFAULT_TRIM_THRESHOLD = 256 << 20
ENV_OPT_OUT = "RAVNEST_JAX_KEEP_MALLOC"

_lock = threading.Lock()
_applied: dict[str, int] | None = None


def tune_host_allocator(
    mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = DEFAULT_TRIM_THRESHOLD
) -> dict[str, int] | None:
    """Makes glibc keep and reuse round-sized host buffers instead of mapping fresh pages.

    Sets ``M_MMAP_THRESHOLD`` (allocations up to this many bytes come from the heap) and
    ``M_TRIM_THRESHOLD`` (up to this many free bytes stay at the top of the heap) with
    ``mallopt(3)``, once per process; :class:`ravnest_jax.OuterSync` and
    :class:`ravnest_jax.Swarm` call it when they are created. Measured on one core with a 64 MiB
    float32 pseudo-gradient: a jitted fp16 encode 18 ms with the settings, 27 ms without
    (``benchmarks/bench_codecs.py --keep-malloc`` runs without). The cost is memory: up to
    ``trim_threshold`` bytes of freed heap stay mapped (counted in RSS). Setting the environment
    variable ``RAVNEST_JAX_KEEP_MALLOC=1`` leaves the allocator alone.

    Args:
      mmap_threshold: bytes, at most 32 MiB (glibc's limit on 64-bit).
      trim_threshold: bytes, > 0.

    Returns:
      The settings applied (``{"mmap_threshold": ..., "trim_threshold": ...}``, bytes), also on
      later calls; None if not applied: not glibc (musl, macOS, Windows), the opt-out variable is
      set, or ``mallopt`` refused.

    Raises:
      ValueError: a threshold out of range.
    """
    global _applied
    if not 0 < mmap_threshold <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_threshold must be in (0, {MMAP_THRESHOLD_MAX}] bytes, got {mmap_threshold!r}")
    if not trim_threshold > 0:
        raise ValueError(f"trim_threshold must be > 0 bytes, got {trim_threshold!r}")
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
