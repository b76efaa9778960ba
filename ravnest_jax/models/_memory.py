"""Device bytes as the device holds them, and the pool JAX's allocator may use.

``device_bits`` measures how many bits one element of a dtype takes in device memory instead
of assuming it: ``np.dtype(jnp.int4).itemsize`` is 1 (numpy has no sub-byte types), while XLA
packs int4 two to a byte. Where the backend reports allocator statistics (GPU, TPU), the
width is the growth of ``bytes_in_use`` when a jitted function's output of 1 Mi elements is
placed on the device; elsewhere (CPU) it is XLA's own buffer size for that output
(``compiled.memory_analysis().output_size_in_bytes``), which matches the resident memory the
process gains (measured: 4.00 bits per int4 element on CPU, whereas
``jax.Array.on_device_size_in_bytes()`` reports 8 there). See docs/finetuning.md, "Quantised
base: int8, int4, nf4", for the figures measured here.

``allocator_pool_bytes`` is what JAX's GPU allocator may hand out, from the same environment
variables ``jaxlib.xla_client.generate_pjrt_gpu_plugin_options`` reads: the BFC allocator (the
default) is capped at ``memory_fraction`` of the card (XLA's default 0.75;
``XLA_CLIENT_MEM_FRACTION``, or the deprecated ``XLA_PYTHON_CLIENT_MEM_FRACTION``, sets it),
whether it preallocates that pool at start (``XLA_PYTHON_CLIENT_PREALLOCATE`` unset or true) or
grows into it on demand (``XLA_PYTHON_CLIENT_PREALLOCATE=false``: same cap, allocated lazily);
``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` allocates with ``cudaMalloc`` on demand, capped by
the card only.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DEFAULT_MEM_FRACTION", "allocator_pool_bytes", "device_bits", "nbytes"]

#: XLA's GPU allocator's default share of the card (``GpuAllocatorConfig.memory_fraction``)
DEFAULT_MEM_FRACTION = 0.75
_ALLOCATORS = ("default", "platform", "bfc", "cuda_async", "vmm")
_PROBE = 1 << 20  # elements placed to measure a width


def device_bits(dtype: Any, backend: str | None = None) -> int:
    """The bits one element of ``dtype`` occupies in the memory of a ``backend`` device,
    measured once per ``(dtype, backend)`` and cached.

    A jitted function returning ``1 Mi`` elements of ``dtype`` (zeros) is compiled for the
    backend's first device; the width is ``bytes_in_use`` growth of that device when it runs,
    where the device reports memory statistics (GPU, TPU), else the size XLA gives its output
    buffer (``memory_analysis().output_size_in_bytes``; CPU), times 8, over ``1 Mi``.

    Args:
      dtype: a numpy / JAX dtype (``jnp.int4``, ``jnp.bfloat16``, ...) or its name.
      backend: ``"cpu"``, ``"gpu"``, ``"tpu"`` (None: ``jax.default_backend()``).

    Returns:
      bits per element (int4: 4 where XLA packs it, 8 where it does not).

    Raises:
      ValueError: not a dtype, or no device of ``backend``.
    """
    try:
        name = jnp.dtype(dtype).name
    except TypeError as e:
        raise ValueError(f"device_bits: {dtype!r} is not a dtype") from e
    backend = backend or jax.default_backend()
    try:
        jax.devices(backend)
    except RuntimeError as e:
        raise ValueError(f"device_bits: no {backend!r} device in this process ({e})") from e
    return _measure(name, backend)[0]


@functools.cache
def _measure(name: str, backend: str) -> tuple[int, str]:
    """``(bits, how)``: ``how`` is ``"memory_stats"`` or ``"memory_analysis"``."""
    from jax.sharding import SingleDeviceSharding

    dtype = jnp.dtype(name)
    device = jax.devices(backend)[0]
    make = jax.jit(lambda: jnp.zeros((_PROBE,), dtype), out_shardings=SingleDeviceSharding(device))
    compiled = make.lower().compile()
    analysed = compiled.memory_analysis()
    planned = None if analysed is None else int(analysed.output_size_in_bytes)
    stats = device.memory_stats() or {}
    if "bytes_in_use" in stats:
        before = int(stats["bytes_in_use"])
        x = compiled()
        x.block_until_ready()
        grown = int((device.memory_stats() or {}).get("bytes_in_use", before)) - before
        del x
        if grown > 0:
            return _bits(grown), "memory_stats"
    if planned:
        return _bits(planned), "memory_analysis"
    # no statistics, no analysis: the host's width (what numpy stores)
    return 8 * np.dtype(dtype).itemsize, "itemsize"


def _bits(size: int) -> int:
    return max(1, round(8 * size / _PROBE))


def nbytes(tree: Any, backend: str | None = None) -> int:
    """Device bytes of ``tree``'s arrays at their measured widths (:func:`device_bits`).

    Args:
      tree: a pytree whose leaves have ``shape`` and ``dtype``: ``jax.Array``, numpy arrays,
        ``jax.ShapeDtypeStruct`` (abstract shapes: nothing is allocated), ``nnx.State`` of
        those; a qwix ``QArray`` counts its values and scales. Other leaves count 0.
      backend: whose widths (None: ``jax.default_backend()``).

    Returns:
      the bytes, each leaf rounded up to whole bytes.
    """
    total = 0
    for x in jax.tree.leaves(tree):
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or dtype is None:
            continue
        total += math.ceil(int(np.prod(shape, dtype=np.int64)) * device_bits(dtype, backend) / 8)
    return int(total)


def allocator_pool_bytes(device_bytes: int, env: Mapping[str, str] = os.environ) -> int:
    """The bytes JAX's GPU allocator may use on a card of ``device_bytes``, as the environment
    ``env`` configures it (module docstring): ``device_bytes`` with
    ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``, else the memory fraction (``XLA_CLIENT_MEM_FRACTION``
    or ``XLA_PYTHON_CLIENT_MEM_FRACTION``, default 0.75) of it; ``XLA_PYTHON_CLIENT_PREALLOCATE``
    changes when the pool is taken, not its size.

    Raises:
      ValueError: ``device_bytes`` < 0, an unknown allocator, a fraction that is not a number in
        (0, 1], or both fraction variables set (as jaxlib refuses them).
    """
    if device_bytes < 0:
        raise ValueError(f"device_bytes must be >= 0, got {device_bytes}")
    allocator = env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower()
    if allocator not in _ALLOCATORS:
        raise ValueError(f"XLA_PYTHON_CLIENT_ALLOCATOR={allocator!r}: jaxlib takes {', '.join(_ALLOCATORS)}")
    if allocator == "platform":
        return int(device_bytes)
    return int(mem_fraction(env) * device_bytes)


def mem_fraction(env: Mapping[str, str] = os.environ) -> float:
    """The allocator's share of the card that ``env`` sets (default 0.75).

    Raises:
      ValueError: as :func:`allocator_pool_bytes`.
    """
    new, old = env.get("XLA_CLIENT_MEM_FRACTION", ""), env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    if new and old:
        raise ValueError("XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both set: keep one")
    raw = new or old
    if not raw:
        return DEFAULT_MEM_FRACTION
    name = "XLA_CLIENT_MEM_FRACTION" if new else "XLA_PYTHON_CLIENT_MEM_FRACTION"
    try:
        fraction = float(raw)
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:
        raise ValueError(f"{name}={raw!r}: a fraction of the card in (0, 1]")
    return fraction
