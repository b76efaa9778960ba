"""``rj.enable_compilation_cache``: JAX's persistent compilation cache in one call."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

import ravnest_jax as rj


@pytest.fixture
def jax_cache_config():
    """Restores the two settings the function changes (this process' other tests compile)."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    old = {k: getattr(jax.config, k) for k in keys}
    yield
    for k, v in old.items():
        jax.config.update(k, v)


@pytest.mark.parametrize(
    ("env", "arg", "want_min"),
    [({}, None, 0.5), ({"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2.5"}, None, 2.5), ({}, 0.0, 0.0)],
)
def test_it_sets_the_directory_and_the_threshold(tmp_path, monkeypatch, jax_cache_config, env, arg, want_min):
    for k in ("RAVNEST_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    got = rj.enable_compilation_cache(min_compile_time_secs=arg)
    assert got == tmp_path / "xdg" / "ravnest_jax" / "xla" and got.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(got)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == want_min
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert rj.enable_compilation_cache() == tmp_path / "env"  # the environment's directory
    assert rj.enable_compilation_cache(tmp_path / "arg") == tmp_path / "arg"  # the argument wins
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "arg")


@pytest.mark.parametrize("off", ["0", "off", "false", "NO"])
def test_ravnest_compile_cache_0_turns_it_off(tmp_path, monkeypatch, jax_cache_config, off):
    monkeypatch.setenv("RAVNEST_COMPILE_CACHE", off)
    before = jax.config.jax_compilation_cache_dir
    assert rj.enable_compilation_cache(tmp_path / "c") is None
    assert jax.config.jax_compilation_cache_dir == before and not (tmp_path / "c").exists()


def test_a_negative_threshold_is_refused(monkeypatch):
    monkeypatch.delenv("RAVNEST_COMPILE_CACHE", raising=False)
    with pytest.raises(ValueError, match=r"min_compile_time_secs must be >= 0, got -1"):
        rj.enable_compilation_cache(min_compile_time_secs=-1)


def test_importing_the_package_imports_no_jax():
    code = "import sys, ravnest_jax as rj; rj.enable_compilation_cache; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


_CHILD = """
import sys, jax, jax.numpy as jnp
import ravnest_jax as rj
rj.enable_compilation_cache(sys.argv[1], min_compile_time_secs=0)
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e == "/jax/compilation_cache/cache_hits" else None)
jax.jit(lambda x: jnp.sin(x) @ x.T).lower(jnp.ones((8, 8))).compile()
print(len(hits))
"""


@pytest.mark.integration  # two jax processes: seconds
@pytest.mark.timeout(120)
def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAVNEST_COMPILE_CACHE"}
    run = [sys.executable, "-c", _CHILD, str(tmp_path / "c")]
    first = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert first.stdout.split() == ["0"] and os.listdir(tmp_path / "c"), first
    second = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert int(second.stdout) >= 1, second  # the jitted function (and jnp.ones) from the cache
