"""Test set-up: 8 virtual CPU devices, so sharded execution in the tests is real.

These variables must be set before jax is imported anywhere, as flax and optax do in their own
suites.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

# TEMPORARY, tests only: the zoo is now `soapjax_zoo`; tests/test_graph.py and tests/test_apply.py
# (being edited in another change) still say `import models`. This alias lets them run until
# they import soapjax_zoo; it is not installed anywhere, so no user environment sees `models`.
import sys  # noqa: E402

import soapjax_zoo  # noqa: E402

sys.modules.setdefault("models", soapjax_zoo)
