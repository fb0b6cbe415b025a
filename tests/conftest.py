"""Test set-up: 8 virtual CPU devices, so sharded execution in the tests is real.

These variables must be set before jax is imported anywhere, as flax and optax do in their own
suites. Tests marked ``gpu`` are skipped where jax finds no GPU (asked in a subprocess, since
this one runs on the CPU).
"""

import functools
import os
import shutil
import subprocess
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()


@functools.cache
def _has_gpu() -> bool:
    """Whether jax, left to pick its backend, picks a GPU (this process is held to the CPU)."""
    if shutil.which("nvidia-smi") is None:
        return False
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                           check=False, env=env, capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "gpu"


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _has_gpu():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="marked gpu: jax finds no GPU here"))
