"""rj.host_memory: glibc mallopt settings for round buffers, once per process, and the arena cap
that `import ravnest_jax` applies."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

import ravnest_jax.host_memory as C

GLIBC = platform.libc_ver()[0] == "glibc"


def _run(code: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **env}, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bad_thresholds_are_value_errors():
    with pytest.raises(ValueError, match="mmap_threshold"):
        C.tune_host_allocator(mmap_threshold=64 << 20)
    with pytest.raises(ValueError, match="mmap_threshold"):
        C.tune_host_allocator(mmap_threshold=0)
    with pytest.raises(ValueError, match="trim_threshold"):
        C.tune_host_allocator(trim_threshold=0)
    with pytest.raises(ValueError, match="arena_max"):
        C.cap_host_arenas(arena_max=0)


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_applied_once_by_a_swarm_and_kept():
    code = """
import json
import ravnest_jax as rj
import ravnest_jax.host_memory as C
before = C.host_allocator_settings()
s = rj.Swarm("http://127.0.0.1:1", run_id="r", token="t", listen="127.0.0.1:0")  # not started
after = C.host_allocator_settings()
again = C.tune_host_allocator(mmap_threshold=1 << 20)  # later calls change nothing
print(json.dumps({"before": before, "after": after, "again": again}))
"""
    r = _run(code, RAVNEST_JAX_KEEP_MALLOC="", MALLOC_ARENA_MAX="")
    assert r["before"] is None
    want = {"mmap_threshold": 32 << 20, "trim_threshold": 256 << 20, "arena_max": 2}
    assert r["after"] == r["again"] == want, r
    # a user's MALLOC_ARENA_MAX stands
    r = _run(code, RAVNEST_JAX_KEEP_MALLOC="", MALLOC_ARENA_MAX="6")
    assert r["after"] == {"mmap_threshold": 32 << 20, "trim_threshold": 256 << 20}, r


@pytest.mark.integration  # a process that starts jax: seconds
@pytest.mark.skipif(not GLIBC, reason="malloc arenas are glibc's")
@pytest.mark.parametrize("keep", ["", "1"])
def test_import_caps_the_arenas_before_jax_makes_them(keep):
    """Threads that come and go (orbax starts ~28 per checkpoint save) spread a peer's heap over
    every arena glibc allows (8 per core); ``import ravnest_jax`` caps them at 2 before jax's
    backend starts its threads (``RAVNEST_JAX_KEEP_MALLOC=1``: glibc's default)."""
    code = """
import ctypes, json, threading, xml.etree.ElementTree as ET, tempfile, os
import ravnest_jax
import jax, jax.numpy as jnp
jax.jit(lambda x: (x @ x.T).sum())(jnp.ones((64, 64))).block_until_ready()  # jax's threads
gate = threading.Barrier(16)
def work():
    bufs = [bytearray(300_000) for _ in range(4)]
    gate.wait()  # all 16 alive at once, like a save's threads
for _ in range(10):
    ts = [threading.Thread(target=work) for _ in range(16)]
    [t.start() for t in ts]
    [t.join() for t in ts]
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
fd, path = tempfile.mkstemp()
os.close(fd)
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
n = len(ET.parse(path).getroot().findall("heap"))
os.unlink(path)
print(json.dumps({"arenas": n, "cap": ravnest_jax.host_memory.cap_host_arenas()}))
"""
    r = _run(code, RAVNEST_JAX_KEEP_MALLOC=keep, MALLOC_ARENA_MAX="")
    if keep:
        assert r["cap"] is None and r["arenas"] > 2, r
    else:
        assert r["cap"] == 2 and r["arenas"] <= 2, r
