"""Test set-up: 8 virtual CPU devices, so sharded execution in the tests is real.

These variables must be set before jax is imported anywhere, as flax and optax do in their own
suites. Tests marked ``gpu`` are skipped where jax finds no GPU (asked in a subprocess, since
this one runs on the CPU).
"""

import dataclasses
import fnmatch
import functools
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# The suite's time is mostly XLA compiling small steps, and LLVM optimising their code is
# much of that, for steps run once or twice; the HLO passes (SPMD partitioning, fusion, the
# collectives the tests read) run as ever. Timings measured here are the unoptimised code's.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# XLA:CPU's fusion emitters compile a step's fusions about a third slower than its older
# loop emitter (tests/test__pipelined.py: 74-82 s of CPU time against 50-51 s); the tests that
# hold XLA:CPU's own counts (FLOPs, kernels) compile with them on (`XLA_DEFAULT_EMITTERS`).
if "xla_cpu_use_fusion_emitters" not in _flags:
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _flags.strip()

# compiler options that put back XLA:CPU's default emitters for one compile
XLA_DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}

# jax only now, once its flags are set.
import jax
import jax.numpy as jnp
import numpy as np

from soapjax.graph.opgraph import trace
from soapjax_zoo.gpt import GPT_CONFIGS, build_gpt
from soapjax_zoo.llama import LLAMA_CONFIGS, build_llama

# One run's compiled programs shared by its processes (JAX's persistent compilation cache, in
# a directory of this run's own, removed at its end): the pytest-xdist workers make the same
# models (a zoo model's init, a corpus model's) and compile the same steps in many files. An
# entry is keyed by the program, its compile options and XLA's flags, so what is read back is
# what would have been compiled; the directory dies with the run, so no run reads another's.
# (Unlocked: an entry read while the other worker still writes it fails to decompress, and
# JAX warns and compiles instead.) make test: 536 -> 513 s of tests (2026-12-05).
_CACHE = "SOAPJAX_TEST_COMPILE_CACHE"


def pytest_configure(config):
    if not hasattr(config, "workerinput") and _CACHE not in os.environ:  # the run's first
        os.environ[_CACHE] = config._soapjax_compile_cache = tempfile.mkdtemp(
            prefix="soapjax-test-compiles-")
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    made = getattr(config, "_soapjax_compile_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[_CACHE]


@functools.cache
def _has_gpu() -> bool:
    """Whether jax, left to pick its backend, picks a GPU (this process is held to the CPU)."""
    if shutil.which("nvidia-smi") is None:
        return False
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                           check=False, env=env, capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "gpu"


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: the whole files are seen
def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _has_gpu():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="marked gpu: jax finds no GPU here"))
    _mark_long(config, items)


def _mark_long(config, items) -> None:
    """Marks the tests tests/long_tests.py lists ``long``; where a file was collected whole,
    an entry of it that names no collected test is an error (a renamed test, a dropped
    parameter), so the list cannot go stale silently."""
    from long_tests import LONG

    def names(key: str, nodeid: str) -> bool:  # the test, all its parameters, or a pattern
        return (nodeid == key or nodeid.split("[")[0] == key
                or ("*" in key and fnmatch.fnmatchcase(nodeid, key.replace("[", "[[]"))))

    matched = set()
    for item in items:
        keys = [key for key in LONG if names(key, item.nodeid)]
        if keys:
            item.add_marker(pytest.mark.long)
            matched.update(keys)
    whole = {item.nodeid.split("::")[0] for item in items} - {
        arg.split("::")[0] for arg in config.args if "::" in arg}
    stale = [key for key in LONG if key.split("::")[0] in whole and key not in matched]
    if stale:
        raise pytest.UsageError("tests/long_tests.py names tests that are not collected "
                                f"(renamed or removed?): {', '.join(stale)}")


_LAYERED = {"gpt": (GPT_CONFIGS, build_gpt), "llama": (LLAMA_CONFIGS, build_llama)}


@functools.cache
def float64_model(name: str, layers: int, batch_size: int, *, fast: bool = False):
    """The pipelining tests' model (tests/test__pipelined.py, tests/test_apply_pipelined.py):
    the tiny GPT or Llama (`name`) with `layers` layers and `batch_size` samples, in float64.

    Returns its workload, parameters (0.1 x a seeded normal), batch (seeded tokens), graph, and
    the unsharded ``jax.value_and_grad`` of its loss (compiled at XLA's optimization level 0
    where `fast`), each made once per session.
    """
    configs, build = _LAYERED[name]
    cfg = dataclasses.replace(configs["tiny"], num_layers=layers, batch_size=batch_size)
    w = build(name, "tiny", cfg, "linen")
    rng = np.random.default_rng(0)
    options = {"xla_backend_optimization_level": 0} if fast else None
    with jax.enable_x64(True):
        params = jax.tree.map(lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape),
                                                    jnp.float64), w.abstract_params())
        batch = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, cfg.vocab_size, s.shape),
                                                   s.dtype), w.abstract_batch())
        graph = trace(w.loss_fn, params, batch, name=name)
        want = jax.jit(jax.value_and_grad(w.loss_fn), compiler_options=options)(params, batch)
    return w, params, batch, graph, want


def assert_delta_equals_full(graph, topology, strategy, moves: int, seed: int = 1,
                             optimizer=None) -> None:
    """`moves` random single-operator moves from `strategy` (analytic costs, ideal resharding,
    the step's `optimizer` if given), each accepted or rejected at random: after each, the
    delta simulation's timeline equals a fresh full simulation's, task by task."""
    import random

    from soapjax.cost.operators import cost_model
    from soapjax.cost.reshard import Resharder
    from soapjax.simulate.front import Simulation
    from soapjax.strategy import space

    mesh = space.MeshShape.of(topology)
    cm = cost_model(graph, topology, mode="analytic", optimizer=optimizer)
    rng = random.Random(seed)
    choices = [space.configs(op, mesh) for op in graph.operators]
    with Resharder(mesh, mode="ideal") as resharder:
        current = strategy
        sim = Simulation(graph, topology, cm, resharder, current)
        for _ in range(moves):
            i = rng.randrange(len(choices))
            config = rng.choice(choices[i])
            candidate = current.replace(i, config)
            sim.propose(i, config)
            assert sim.timeline() == Simulation(graph, topology, cm, resharder,
                                                candidate).timeline()
            if rng.random() < 0.5:
                sim.accept()
                current = candidate
            else:
                sim.reject()
        assert sim.timeline() == Simulation(graph, topology, cm, resharder, current).timeline()
