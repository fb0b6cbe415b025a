"""soapjax.checkpoint: a run saved under one plan and mesh restores, value for value, under
another plan, another mesh and fewer devices (float64), and a save killed with SIGKILL loses
nothing: the previous checkpoint still restores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from soapjax import checkpoint
from soapjax.base.errors import PlanError
from soapjax.training import shard_training

ROOT = Path(__file__).resolve().parent.parent


def _model():
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((16, 64))),
              "w2": jnp.asarray(rng.standard_normal((64, 8)))}
    batch = {"x": jnp.asarray(rng.standard_normal((16, 16))),
             "y": jnp.asarray(rng.standard_normal((16, 8)))}

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    return loss, params, batch


def _run(mesh, strategy):
    loss, params, batch = _model()
    return shard_training(loss, params, batch, optax.adam(1e-2), mesh=mesh, strategy=strategy,
                          name="ckpt", donate=False), batch


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _close(a, b, rel=1e-12):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        scale = float(np.max(np.abs(np.asarray(y)))) or 1.0
        assert float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) <= rel * scale


@pytest.mark.parametrize("mesh, strategy", [("cpu8", "megatron"), ("cpu4", "fsdp"),
                                            ("cpu4", "data-parallel")])
def test_a_checkpoint_restores_under_another_plan_and_device_count(tmp_path, mesh, strategy):
    with jax.enable_x64(True):
        run, batch = _run("cpu8", "data-parallel")
        params, opt_state, _ = run.step(run.params, run.opt_state, run.shard_batch(batch))
        checkpoint.save(tmp_path, run, 1, params=params, opt_state=opt_state)
        assert checkpoint.steps(tmp_path) == (1,) and checkpoint.latest_step(tmp_path) == 1

        other, _ = _run(mesh, strategy)
        got_params, got_state = checkpoint.restore(tmp_path, other)
        _equal(got_params, params)
        _equal(got_state, opt_state)
        for x, s in zip(jax.tree.leaves(got_params), jax.tree.leaves(other.shardings.params)):
            assert x.sharding == s and len(x.sharding.device_set) == len(other.mesh.devices.flat)
        # training goes on as it would have: the next step under the new plan
        want = run.step(params, opt_state, run.shard_batch(batch))
        got = other.step(got_params, got_state, other.shard_batch(batch))
        _close(got[0], want[0])
        _close(got[2], want[2])


def test_a_missing_or_foreign_checkpoint_is_one_clear_error(tmp_path):
    with jax.enable_x64(True):
        run, _ = _run("cpu8", "data-parallel")
        with pytest.raises(PlanError, match="no checkpoint under"):
            checkpoint.restore(tmp_path, run)
        checkpoint.save(tmp_path, run, 3)
        with pytest.raises(PlanError, match=r"no finished checkpoint .*step_00000004.*: 3"):
            checkpoint.restore(tmp_path, run, 4)
        with pytest.raises(PlanError, match="exists already"):
            checkpoint.save(tmp_path, run, 3)


_CHILD = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, optax
from soapjax import checkpoint
from soapjax.training import shard_training

def loss(p, b):
    return jnp.mean((b["x"] @ p["w"]) ** 2)

params = {"w": jnp.zeros((2048, 2048))}   # 16 MiB a copy: saves that take a while
batch = {"x": jnp.ones((8, 2048))}
run = shard_training(loss, params, batch, optax.sgd(0.1), mesh="cpu8",
                     strategy="data-parallel", name="kill", donate=False)
for step in range(1, 10_000):
    p = {"w": jnp.full((2048, 2048), float(step))}
    checkpoint.save(sys.argv[1], run, step, params=jax.device_put(p, run.shardings.params))
    print(step, flush=True)
"""


def test_a_save_killed_midway_loses_nothing(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, str(script), str(ckpt)], stdout=subprocess.PIPE,
                             text=True, env=env, start_new_session=True)
    try:
        saved = [int(child.stdout.readline()) for _ in range(2)]  # two saves finished
        # kill the third in the middle: once orbax's temporary folder for it is there
        deadline = time.monotonic() + 60
        while not _unfinished(ckpt) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.killpg(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert saved == [1, 2]
    found = checkpoint.steps(ckpt)
    assert found == (1, 2), found  # the third never finished ...
    assert _unfinished(ckpt), sorted(p.name for p in ckpt.iterdir())  # ... it was under way
    for step in found:  # every finished checkpoint restores whole
        params, _ = checkpoint.restore(ckpt, _kill_run(), step)
        assert float(np.min(np.asarray(params["w"]))) == float(step) == \
            float(np.max(np.asarray(params["w"])))


def _unfinished(ckpt: Path) -> list[str]:
    """The folders of saves under way (orbax's temporary ones)."""
    return [p.name for p in ckpt.iterdir() if "tmp" in p.name] if ckpt.is_dir() else []


def _kill_run():
    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"]) ** 2)

    return shard_training(loss, {"w": jnp.zeros((2048, 2048))}, {"x": jnp.ones((8, 2048))},
                          optax.sgd(0.1), mesh="cpu8", strategy="data-parallel", name="kill",
                          donate=False)


@pytest.mark.parametrize("interleave", [1, 2], ids=["1f1b", "interleaved"])
def test_a_data_parallel_checkpoint_restores_under_a_pipelined_plan(tmp_path, interleave):
    """Saved from data parallelism on `cpu8`, restored under Megatron's TP 2 x PP 2 on
    ``cpu8-nodes`` (1F1B: the pipelined step keeps the model's layout; interleaved: it keeps
    the stacked layers in chunk order, and `restore` puts them so), the arrays equal in the
    model's layout; the next step under the pipeline is the next data-parallel step; saved
    again from the pipeline, it restores under data parallelism equal to the pipeline's."""
    from conftest import float64_model

    from soapjax.apply import ChunkOrdered, model_layout
    from soapjax.apply._pipeline_layout import stacked_params
    from soapjax.strategy.baselines import megatron_3d
    from soapjax.strategy.plan import Plan
    from soapjax.topology.cluster import load_topology

    nodes = load_topology(str(ROOT / "tests" / "meshes" / "cpu8-nodes.toml"))
    w, params, batch, graph, _ = float64_model("llama", 2 * interleave, 8)
    with jax.enable_x64(True):
        flat = shard_training(w.loss_fn, params, batch, optax.adam(1e-3), mesh="cpu8",
                              strategy="data-parallel", name="llama", donate=False)
        p1, s1, _ = flat.step(flat.params, flat.opt_state, flat.shard_batch(batch))
        checkpoint.save(tmp_path, flat, 1, params=p1, opt_state=s1)
        plan = Plan.make(graph, nodes, megatron_3d(graph, nodes, tp=2, pp=2,
                                                   interleave=interleave,
                                                   microbatch_size=2, recompute="full"))
        piped = shard_training(w.loss_fn, params, batch, optax.adam(1e-3), mesh=nodes,
                               strategy=plan, name="llama", donate=False)
        assert piped.strategy.pipelined
        got_params, got_state = checkpoint.restore(tmp_path, piped, 1)
        wrapped = [x for x in jax.tree.leaves(got_params, is_leaf=lambda x: isinstance(
            x, ChunkOrdered)) if isinstance(x, ChunkOrdered)]
        assert len(wrapped) == (0 if interleave == 1 else len(stacked_params(graph)))
        _equal(model_layout(got_params), p1)
        _equal(model_layout(got_state), s1)
        want = flat.step(p1, s1, flat.shard_batch(batch))
        got = piped.step(got_params, got_state, piped.shard_batch(batch))
        _close(piped.model_params(got[0]), want[0], rel=1e-10)
        checkpoint.save(tmp_path, piped, 2, params=got[0], opt_state=got[1])
        back_params, back_state = checkpoint.restore(tmp_path, flat, 2)
        _equal(back_params, piped.model_params(got[0]))
        _equal(back_state, model_layout(got[1]))
