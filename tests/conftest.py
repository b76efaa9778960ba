"""Test configuration: 4 forced CPU devices (for shard_map tests), float32 everywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Must happen before the CPU backend initialises (first device query).
jax.config.update("jax_num_cpu_devices", 4)

# Processes the tests start (peers of the example, workers) share one persistent XLA compilation
# cache for the session: the same tiny programs are compiled once instead of in every process
# (a tiny peer starts in about 8 s instead of 27 s here). Set after jax is imported, so the
# compilation counts of the in-process tests are untouched.
import shutil  # noqa: E402
import tempfile  # noqa: E402

_CACHE = tempfile.mkdtemp(prefix="ravnest-test-xla-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"


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
    shutil.rmtree(_CACHE, ignore_errors=True)
