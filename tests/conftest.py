"""Test set-up: 8 virtual CPU devices, so sharded execution in the tests is real.

These variables must be set before jax is imported anywhere, as flax and optax do in their own
suites.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
