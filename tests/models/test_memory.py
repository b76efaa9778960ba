"""Device widths measured (not assumed), bytes of pytrees at those widths, and the pool JAX's
allocator takes of a card (``XLA_PYTHON_CLIENT_MEM_FRACTION`` / ``XLA_PYTHON_CLIENT_ALLOCATOR``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ravnest_jax.models import allocator_pool_bytes, device_bits, nbytes
from ravnest_jax.models._memory import _measure
from ravnest_jax.models._plan import MemoryPlan

GIB = 1024**3


@pytest.mark.parametrize(
    "dtype, bits", [(jnp.int4, 4), (jnp.uint4, 4), (jnp.int8, 8), (jnp.bfloat16, 16), (jnp.float32, 32)]
)
def test_cpu_widths_are_measured_from_xla(dtype, bits):
    assert device_bits(dtype, "cpu") == bits
    assert _measure(jnp.dtype(dtype).name, "cpu") == (bits, "memory_analysis")
    # the resident size of a jitted int4 output is what XLA plans, not numpy's one byte
    assert device_bits(jnp.dtype(dtype).name) == bits


def test_nbytes_counts_arrays_and_shapes_at_device_width():
    tree = {
        "q": jax.ShapeDtypeStruct((64, 32), jnp.int4),  # 1024 bytes, not 2048
        "s": jax.ShapeDtypeStruct((4, 32), jnp.float32),
        "odd": jax.ShapeDtypeStruct((3,), jnp.int4),  # rounded up to whole bytes
        "w": jnp.zeros((8, 8), jnp.bfloat16),
        "n": np.zeros(5, np.int8),
        "none": None,
    }
    assert nbytes(tree) == 1024 + 512 + 2 + 128 + 5


def test_nbytes_of_a_qwix_qarray_counts_values_and_scales():
    qwix = pytest.importorskip("qwix")
    w = jax.random.normal(jax.random.key(0), (128, 64))
    q = qwix.quantize(w, "int4", channelwise_axes=[1], tiled_axes={0: 64})
    assert nbytes(q) == 128 * 64 // 2 + 2 * 64 * 4


def test_device_bits_rejects_a_non_dtype_in_one_line():
    with pytest.raises(ValueError, match="'int3x' is not a dtype"):
        device_bits("int3x")
    with pytest.raises(ValueError, match="no 'tpu' device"):
        device_bits(jnp.int8, "tpu")


@pytest.mark.parametrize(
    "env, pool",
    [
        ({}, 0.75),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, 0.9),
        ({"XLA_CLIENT_MEM_FRACTION": "0.5"}, 0.5),
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, 0.75),  # lazily, up to the same cap
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".95"}, 0.95),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, 1.0),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}, 0.75),
    ],
)
def test_allocator_pool_follows_jax_environment(env, pool):
    assert allocator_pool_bytes(24 * GIB, env) == int(pool * 24 * GIB)


@pytest.mark.parametrize(
    "env, msg",
    [
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"}, "XLA_PYTHON_CLIENT_MEM_FRACTION='1.5'"),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"}, "'lots'"),
        ({"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, "both set"),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "magic"}, "'magic'"),
    ],
)
def test_allocator_pool_rejects_bad_settings_in_one_line(env, msg):
    with pytest.raises(ValueError, match=msg):
        allocator_pool_bytes(GIB, env)


def test_memory_plan_fits_the_pool_not_the_card():
    plan = MemoryPlan(base=16 * GIB, adapters=0, optimizer=0, outer=0, activations=0, adapter_params=0, base_params=0)
    card = 24 * GIB  # the default pool is 18 GiB; the plan leaves 5% of it (17.1 GiB usable)
    assert plan.fits(card, env={})
    assert not plan.fits(card, env={}, reserve=0.15)
    # 18 GiB is 75% of the card (the old "90% of the card" said it fits) but all of the pool
    big = MemoryPlan(base=18 * GIB, adapters=0, optimizer=0, outer=0, activations=0, adapter_params=0, base_params=0)
    assert not big.fits(card, env={})
    assert big.fits(card, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"})
    assert big.fits(card, env={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
