"""rj.compress.tune_host_allocator: glibc mallopt settings for round buffers, once per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

import ravnest_jax.compress as C

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


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_applied_once_by_a_swarm_and_kept():
    code = """
import json
import ravnest_jax as rj
import ravnest_jax.compress as C
before = C.host_allocator_settings()
s = rj.Swarm("http://127.0.0.1:1", run_id="r", token="t", listen="127.0.0.1:0")  # not started
after = C.host_allocator_settings()
again = C.tune_host_allocator(mmap_threshold=1 << 20)  # later calls change nothing
print(json.dumps({"before": before, "after": after, "again": again}))
"""
    r = _run(code, RAVNEST_JAX_KEEP_MALLOC="")
    assert r["before"] is None
    assert r["after"] == r["again"] == {"mmap_threshold": 32 << 20, "trim_threshold": 256 << 20}


def test_opt_out_leaves_malloc_alone():
    code = """
import json
import ravnest_jax.compress as C
print(json.dumps({"applied": C.tune_host_allocator(), "settings": C.host_allocator_settings()}))
"""
    assert _run(code, RAVNEST_JAX_KEEP_MALLOC="1") == {"applied": None, "settings": None}
