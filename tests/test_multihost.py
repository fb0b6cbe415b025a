"""Multi-host: two processes of four CPU devices each run a planned step over a global mesh.

`scripts/launch_local.py` starts two processes on 127.0.0.1 (jax.distributed, gloo); each runs
`scripts/train_example.py` with the Megatron-like strategy on the ``cpu8`` mesh (data=2 x
model=4), whose ``data`` axis spans the two processes, so the gradients of every weight are
all-reduced across processes. Both must print the losses and parameter checksum of the
unsharded step run here in one process. The pipelined case runs a 2-stage plan on
``tests/meshes/cpu8-nodes.toml``, one stage per process, so the pipeline's sends cross them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import soapjax_zoo as zoo
from soapjax_zoo import gpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3


def _port_error() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
    except OSError as e:
        return str(e)
    return None


def _unsharded(model: str, steps: int, seed: int = 0) -> tuple[list[float], list[float]]:
    """Losses and checksum (sum, sum of squares per leaf) of the example's run, unsharded."""
    w = zoo.get(model, "tiny")
    params = w.init_params(jax.random.key(seed))
    opt_state = w.optimizer.init(params)
    step = jax.jit(w.train_step())
    losses = []
    for i in range(steps):
        batch = w.make_batch(jax.random.key(seed + 1 + i))
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    checksum = [float(f(x)) for x in jax.tree.leaves(params)
                for f in (jnp.sum, lambda y: jnp.sum(y * y))]
    return losses, checksum


def _tiny(model: str, layers: int | None = None):
    """The zoo's tiny `model`, with `layers` layers where given (as `PIPELINED_WORKER` builds
    it)."""
    if layers is None:
        return zoo.get(model, "tiny")
    return gpt.build_gpt("gpt", "tiny", dataclasses.replace(gpt.GPT_CONFIGS["tiny"],
                                                            num_layers=layers), "linen")


def _numpy_case(model: str, steps: int,
                layers: int | None = None) -> tuple[list[float], list[float]]:
    """Losses and checksum of `steps` unsharded steps from numpy-drawn parameters and batches
    (as `PIPELINED_WORKER` draws them: no jitted init to compile)."""
    w = _tiny(model, layers)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype),
                          w.abstract_params())
    batches = [jax.tree.map(lambda s: rng.integers(0, 64, s.shape).astype(s.dtype),  # vocab 64
                            w.abstract_batch()) for _ in range(steps)]
    opt_state = w.optimizer.init(params)
    step = jax.jit(w.train_step())
    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    checksum = [float(f(x)) for x in jax.tree.leaves(params)
                for f in (jnp.sum, lambda y: jnp.sum(y * y))]
    return losses, checksum


def _records(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"\[p(\d+)\] (\{.*\})$", line)
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    return out


@pytest.mark.slow
def test_two_processes_compute_the_single_process_step():
    reason = _port_error()
    if reason is not None:
        pytest.skip(f"cannot bind a TCP port on 127.0.0.1 for the coordinator: {reason}")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the launcher sets them
    cmd = [sys.executable, "scripts/launch_local.py", "--processes", "2",
           "--devices-per-process", "4", "--timeout", "400", "--",
           "scripts/train_example.py", "--model", "mlp", "--strategy", "megatron",
           "--steps", str(STEPS), "--json", "--collectives"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=450,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = _records(proc.stdout)
    assert sorted(records) == [0, 1], proc.stdout[-4000:]

    losses, checksum = _unsharded("mlp", STEPS)
    for pid, r in records.items():
        assert (r["processes"], r["devices"]) == (2, 8)
        # the mesh's data axis is the process: rows of the mesh belong to different processes
        assert r["mesh_processes"] == [[0, 0, 0, 0], [1, 1, 1, 1]]
        # gradients all-reduced over data, across the processes; fc2's row-parallel partial
        # sums over model, inside each process
        reduces = [(c["axes"], c["cross_process"]) for c in r["collectives"]
                   if c["kind"] == "all-reduce"]
        assert (["data"], True) in reduces and (["model"], False) in reduces, r["collectives"]
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5, err_msg=f"process {pid}")
        np.testing.assert_allclose(r["checksum"], checksum, rtol=1e-4, atol=1e-5,
                                   err_msg=f"process {pid}")
    assert records[0]["losses"] == records[1]["losses"]  # one replicated value, bit for bit
    assert re.search(r"^\[p1\] step +3 +loss", proc.stdout, re.MULTILINE)


# One process of the pipelined case: GPT tiny under megatron_3d(tp=2, pp=2) on cpu8-nodes, whose
# `node` axis (the processes) the two stages cut. Prints the losses, the parameters' checksum,
# which process each stage's devices belong to and the compiled step's collective-permutes.
PIPELINED_WORKER = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from soapjax import training
training.initialize_distributed()
import jax, jax.numpy as jnp, numpy as np
import soapjax_zoo as zoo
from soapjax.measure import hlo
from soapjax_zoo import gpt
from soapjax.strategy.baselines import megatron_3d
from soapjax.graph.opgraph import trace
from soapjax.topology.cluster import load_topology

topology = load_topology(sys.argv[2])
layers, stage_layers = int(sys.argv[4]), tuple(int(n) for n in sys.argv[5].split(",") if n)
w = gpt.build_gpt("gpt", "tiny", dataclasses.replace(gpt.GPT_CONFIGS["tiny"], num_layers=layers),
                  "linen")
rng = np.random.default_rng(0)  # as _numpy_case: no jitted init to compile
params = jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype),
                      w.abstract_params())
batches = [jax.tree.map(lambda s: rng.integers(0, 64, s.shape).astype(s.dtype),  # vocab 64
                        w.abstract_batch()) for _ in range(int(sys.argv[3]))]
graph = trace(w.loss_fn, params, batches[0], name="gpt")
strategy = megatron_3d(graph, topology, tp=2, pp=2, microbatch_size=1)
strategy = strategy.with_pipeline(2, 1, "1f1b", stage_layers)
run = training.shard_training(w.loss_fn, params, batches[0], w.optimizer, mesh=topology,
                              strategy=strategy, name="gpt",
                              compiler_options={"xla_backend_optimization_level": 0,
                                                "xla_cpu_use_fusion_emitters": False,
                                                "xla_llvm_disable_expensive_passes": True})
params, opt_state = run.params, run.opt_state
step = run.step.lower(params, opt_state, run.shard_batch(batches[0])).compile()
losses = []
for i, batch in enumerate(batches):
    params, opt_state, loss = step(params, opt_state, run.shard_batch(batch), np.int32(i))
    losses.append(float(loss))
mesh = run.shardings.loss.mesh
process = [d.process_index for d in mesh.devices.flat]
permutes = [sorted({(process[a], process[b]) for a, b in c.source_target_pairs})
            for c in hlo.collectives(step.as_text(), mesh) if c.kind == "collective-permute"]
checksum = jax.jit(lambda p: jnp.stack([f(x) for x in jax.tree.leaves(p)
                                        for f in (jnp.sum, lambda y: jnp.sum(y * y))]),
                   out_shardings=run.shardings.loss)(params)
print(json.dumps({"losses": losses, "checksum": [float(x) for x in jax.device_get(checksum)],
                  "stages": strategy.stages, "microbatches": strategy.microbatches,
                  "stage_layers": list(strategy.stage_layers),
                  "mesh": dict(mesh.shape), "permutes": permutes,
                  "stage_processes": [sorted({d.process_index for d in row.flat})
                                      for row in mesh.devices]}), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("layers,stage_layers", [(2, ""), (4, "1,3")], ids=["equal", "uneven"])
def test_two_processes_run_a_pipelined_plan_one_stage_each(tmp_path, layers, stage_layers):
    """A pipelined plan over two processes: GPT tiny, megatron_3d(tp=2, pp=2) on cpu8-nodes
    (node=2 x data=2 x model=2, a node per process), so stage 0 is process 0's four devices,
    stage 1 process 1's, and the pipeline's activations and gradients cross processes by
    collective-permute (gloo). Both processes must compute the unsharded step's losses and
    parameters (adamw, 2 steps). Uneven: 4 layers cut 1 / 3, so layer 1, kept by process 0,
    goes to process 1 every step and its gradient back (`stage_router`), by collective-permutes
    across the processes too."""
    reason = _port_error()
    if reason is not None:
        pytest.skip(f"cannot bind a TCP port on 127.0.0.1 for the coordinator: {reason}")
    worker = tmp_path / "pipelined_worker.py"
    worker.write_text(PIPELINED_WORKER)
    steps = 2
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "scripts/launch_local.py", "--processes", "2",
           "--devices-per-process", "4", "--timeout", "400", "--", str(worker), str(ROOT),
           str(ROOT / "tests" / "meshes" / "cpu8-nodes.toml"), str(steps), str(layers),
           stage_layers]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=450,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = _records(proc.stdout)
    assert sorted(records) == [0, 1], proc.stdout[-4000:]

    losses, checksum = _numpy_case("gpt", steps, layers)
    for pid, r in records.items():
        assert (r["stages"], r["microbatches"]) == (2, 4)
        assert r["mesh"] == {"stage": 2, "data": 2, "model": 2}
        assert r["stage_processes"] == [[0], [1]]
        assert r["stage_layers"] == [int(n) for n in stage_layers.split(",") if n]
        # 1F1B over 2 stages: activations 0 -> 1, gradients 1 -> 0, across the processes; the
        # uneven cut's layers 0 -> 1 and their gradients 1 -> 0 (16 stacked parameters each)
        want = [[[0, 1]], [[1, 0]]] if not stage_layers else [[[0, 1]]] * 17 + [[[1, 0]]] * 17
        assert sorted(r["permutes"]) == want, r["permutes"]
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5, err_msg=f"process {pid}")
        np.testing.assert_allclose(r["checksum"], checksum, rtol=1e-4, atol=1e-5,
                                   err_msg=f"process {pid}")
    assert records[0]["losses"] == records[1]["losses"]


def test_launcher_reports_a_failing_process():
    reason = _port_error()
    if reason is not None:
        pytest.skip(f"cannot bind a TCP port on 127.0.0.1: {reason}")
    code = ("import os, sys; pid = int(os.environ['SOAPJAX_PROCESS_ID']); "
            "print('hello from', pid, os.environ['XLA_FLAGS']); sys.exit(3 if pid == 1 else 0)")
    proc = subprocess.run([sys.executable, "scripts/launch_local.py", "--processes", "2",
                           "--devices-per-process", "3", "--", sys.executable, "-c", code],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 3
    assert re.search(r"^\[p0\] hello from 0 .*--xla_force_host_platform_device_count=3$",
                     proc.stdout, re.MULTILINE)
    assert "[p1] hello from 1" in proc.stdout
    assert "process 1 exited with status 3" in proc.stderr
