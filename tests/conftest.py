"""Test configuration: 4 forced CPU devices (for shard_map tests), float32 everywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Must happen before the CPU backend initialises (first device query).
jax.config.update("jax_num_cpu_devices", 4)

# The test process and the processes it starts (peers of the example, workers) share one
# persistent XLA compilation cache for the session: the same tiny programs are compiled once
# instead of in every process (a tiny peer starts in about 8 s instead of 27 s here), and the
# in-process tests that build the same program again (a fixture model in another test) load it
# (the unit tier: 247 s -> 227 s here). jax's own compile counts and caches are unchanged.
import glob  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

_PREFIX = "ravnest-test-xla-cache-"


def _remove_stale_caches() -> None:
    """Removes the caches of earlier sessions whose controller is gone (SIGTERM, SIGKILL, a
    crash: no session end ran). The directory name starts with the controller's pid."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), _PREFIX + "*")):
        pid = os.path.basename(path)[len(_PREFIX) :].partition("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(path, ignore_errors=True)


# With pytest-xdist the workers inherit the controller's environment: one cache for all of
# them, made and removed by the controller (the process without PYTEST_XDIST_WORKER).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and os.environ.get("RAVNEST_TEST_XLA_CACHE"):
    _CACHE, _OWNED = os.environ["RAVNEST_TEST_XLA_CACHE"], False
else:
    _remove_stale_caches()
    _CACHE, _OWNED = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"), True
    os.environ["RAVNEST_TEST_XLA_CACHE"] = _CACHE
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_collection_modifyitems(config, items):
    """``slow`` tests run only with ``RAVNEST_SLOW_TESTS=1`` (``python -m pytest -m slow``): LLM
    fine-tuning end to end, and process tests whose ground the default suite covers another way
    (each says which); with them the suite exceeds CI's 20 minutes on 2 cores."""
    import pytest

    if os.environ.get("RAVNEST_SLOW_TESTS", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="slow: set RAVNEST_SLOW_TESTS=1 (python -m pytest -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    if _OWNED:
        shutil.rmtree(_CACHE, ignore_errors=True)
