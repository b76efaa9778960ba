"""The model tests compile many small programs on CPU whose run time is microseconds: XLA's
optimisation of them was most of these tests' time. On CPU they compile with little of it:

- ``jax_disable_most_optimizations`` (LLVM at -O0, none of its expensive passes);
- ``xla_cpu_use_fusion_emitters=False``: XLA's CPU fusions through its LLVM IR emitters
  instead of the MLIR fusion pipeline.

Together the tiny Llama's int4 LoRA train step compiles in about 0.8 s of CPU instead of 5.5 s
here, with the same loss to the last bit; the memory tests' bounds (XLA's temporary bytes) and
the exact equalities hold as before. Only while this directory's tests run (a module fixture
sets and restores both) and in the processes they start (the ``fast_compile_env`` fixture).
"""

from __future__ import annotations

import os

import jax
import pytest

#: XLA flags of a process that the tests start (XLA reads ``XLA_FLAGS`` once, at start-up)
XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false"


@pytest.fixture(scope="session")
def fast_compile_env() -> dict[str, str]:
    """``os.environ`` for a child process (XLA reads ``XLA_FLAGS`` once, at start-up) that
    compiles as this directory's tests do."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_FLAGS}".strip()
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    return env


def _with_cpu_overrides(get_compile_options):
    def wrapped(*args, **kwargs):
        backend = kwargs.get("backend")
        if backend is None or getattr(backend, "platform", "cpu") == "cpu":
            overrides = dict(kwargs.get("env_options_overrides") or {})
            overrides.setdefault("xla_cpu_use_fusion_emitters", False)
            kwargs["env_options_overrides"] = overrides
        return get_compile_options(*args, **kwargs)

    return wrapped


@pytest.fixture(autouse=True, scope="module")
def _fast_cpu_compiles(request):
    from jax._src import compiler

    # a module whose bitwise equalities need XLA's default compiles (remat against no remat
    # rounds alike only when both are optimised) sets DEFAULT_XLA_COMPILES = True
    if jax.default_backend() != "cpu" or getattr(request.module, "DEFAULT_XLA_COMPILES", False):
        yield
        return
    before = jax.config.read("jax_disable_most_optimizations")
    with pytest.MonkeyPatch.context() as mp:
        jax.config.update("jax_disable_most_optimizations", True)
        # jax has no public knob for XLA's per-compile options (``jax.jit(compiler_options=)``
        # is per function, and the library's steps set their own): the one place that builds them
        if hasattr(compiler, "get_compile_options"):
            mp.setattr(compiler, "get_compile_options", _with_cpu_overrides(compiler.get_compile_options))
        try:
            yield
        finally:
            jax.config.update("jax_disable_most_optimizations", before)
