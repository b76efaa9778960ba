"""Test configuration: 4 forced CPU devices (for shard_map tests), float32 everywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Must happen before the CPU backend initialises (first device query).
jax.config.update("jax_num_cpu_devices", 4)
