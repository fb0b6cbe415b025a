"""The few lines a Flax training loop adds to run sharded: trace, plan, place, step.

linen (or any ``loss_fn(params, batch)``)::

    from soapjax import training
    training.initialize_distributed()            # no-op in one process
    run = training.shard_training(loss_fn, params, example_batch, optimizer, mesh="cpu8")
    params, opt_state = run.params, run.opt_state
    for batch in batches:
        params, opt_state, loss = run.step(params, opt_state, run.shard_batch(batch))

nnx (``loss_fn(model, batch)``; the step trains the model's `nnx.Param` state)::

    run = training.shard_training(loss_fn, model, example_batch, optimizer, mesh="cpu8")
    params, opt_state = run.params, run.opt_state
    for batch in batches:
        params, opt_state, loss = run.step(params, opt_state, run.shard_batch(batch))
    nnx.update(model, params)

The strategy defaults to data parallelism. The planning hook is the `strategy` argument: a
`Strategy`, a plan, a name in `PLANNERS`, or any ``planner(graph, mesh_shape) -> Strategy``;
once `soapjax.search` lands, a ``"plan"`` entry in `PLANNERS` will search (or load a cached
plan for the same graph fingerprint and topology) and become the default.

Multi-host: every process runs the same script. `initialize_distributed` connects them, the
mesh spans every process's devices, and `shard_training` builds global arrays from the values
each process holds (`jax.make_array_from_callback`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from soapjax import space
from soapjax.apply import (
    PartitionedStep,
    TrainShardings,
    check_strategy,
    device_put_global,
    sharded_train_step,
)
from soapjax.errors import PlanError
from soapjax.graph import OpGraph, trace
from soapjax.space import MeshShape, Strategy
from soapjax.topology import Topology, load_topology, make_mesh

__all__ = ["PLANNERS", "ShardedTraining", "initialize_distributed", "shard_training"]

# Environment variables `scripts/launch_local.py` sets for each process.
ENV_COORDINATOR = "SOAPJAX_COORDINATOR"
ENV_NUM_PROCESSES = "SOAPJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SOAPJAX_PROCESS_ID"

Planner = Callable[[OpGraph, MeshShape], Strategy]

# Named planners for `shard_training(strategy=...)`. The search stage adds "plan" here.
PLANNERS: Mapping[str, Planner] = {
    "data_parallel": space.data_parallel,
}


def initialize_distributed(*, auto: bool = False, timeout_s: int = 300) -> bool:
    """Connects this process to the others with `jax.distributed.initialize`, if there are any.

    Reads ``SOAPJAX_COORDINATOR`` (host:port of process 0), ``SOAPJAX_NUM_PROCESSES`` and
    ``SOAPJAX_PROCESS_ID``, as `scripts/launch_local.py` sets them. Without them and with
    ``auto=True``, calls ``jax.distributed.initialize()`` with no arguments, which detects
    SLURM (``srun``), Open MPI / ``mpirun`` (``OMPI_*``), and TPU or Kubernetes environments.
    On other clusters call ``jax.distributed.initialize(coordinator_address, num_processes,
    process_id)`` yourself. Call it before any other JAX call.

    Args:
      auto: fall back to JAX's cluster auto-detection when the soapjax variables are absent.
      timeout_s: how long to wait for every process to connect.

    Returns:
      Whether this process is now part of a multi-process run.
    """
    coordinator = os.environ.get(ENV_COORDINATOR)
    if coordinator:
        try:
            num, pid = int(os.environ[ENV_NUM_PROCESSES]), int(os.environ[ENV_PROCESS_ID])
        except (KeyError, ValueError) as e:
            raise PlanError(f"{ENV_COORDINATOR}={coordinator} is set, so {ENV_NUM_PROCESSES} and "
                            f"{ENV_PROCESS_ID} must be integers too ({e})") from None
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num,
                                   process_id=pid, initialization_timeout=timeout_s)
        return True
    if auto:
        jax.distributed.initialize(initialization_timeout=timeout_s)
        return jax.process_count() > 1
    return False


@dataclasses.dataclass(frozen=True)
class ShardedTraining:
    """What `shard_training` returns: the sharded step and the placed training state.

    Attributes:
      step: jitted ``step(params, opt_state, batch) -> (params, opt_state, loss)``; it donates
        params and opt_state, so keep only what it returns.
      params: the parameters on their shardings (for nnx: the `nnx.Param` state).
      opt_state: the optimizer state on its shardings.
      shardings: every sharding of the step.
      graph: the traced operator graph.
      strategy: the applied strategy.
      mesh: the device mesh.
    """

    step: PartitionedStep
    params: Any
    opt_state: Any
    shardings: TrainShardings
    graph: OpGraph
    strategy: Strategy
    mesh: Mesh

    def shard_batch(self, batch: Any) -> Any:
        """Puts a batch on the batch shardings.

        Each leaf is either the global batch (the same on every process) or, in a multi-process
        run, this process's rows of it (dim 0 of size global / `jax.process_count()`, in
        process order), as a per-host data loader yields them.
        """
        leaves, treedef = jax.tree.flatten(batch)
        shardings = jax.tree.leaves(self.shardings.batch)
        out = []
        for x, s, info in zip(leaves, shardings, self.graph.batch):
            if s.is_fully_addressable or np.shape(x)[0] == info.shape[0]:
                out.append(device_put_global(x, s))
            else:
                out.append(jax.make_array_from_process_local_data(s, np.asarray(x), info.shape))
        return jax.tree.unflatten(treedef, out)


def shard_training(loss_fn: Callable[[Any, Any], jax.Array], params: Any, batch: Any,
                   optimizer: optax.GradientTransformation, *,
                   mesh: Mesh | Topology | str = "cpu8",
                   strategy: Strategy | Planner | str | Any = "data_parallel",
                   opt_state: Any = None, name: str | None = None, donate: bool = True,
                   compiler_options: Mapping[str, Any] | None = None) -> ShardedTraining:
    """Traces the loss, applies a strategy, and places the training state on the mesh.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``; for an nnx model,
        ``loss_fn(model, batch) -> scalar``.
      params: the parameters (a pytree of arrays), or an `nnx.Module` whose `nnx.Param` state
        is trained (its other state is held constant). `jax.ShapeDtypeStruct`s give the step
        and shardings only (``params`` and ``opt_state`` are then None; initialise with
        ``jax.jit(init, out_shardings=run.shardings.params)``).
      batch: an example batch (arrays or `jax.ShapeDtypeStruct`s); dim 0 is the batch.
      optimizer: the optax transformation.
      mesh: a `jax.sharding.Mesh` (Auto axes), a `Topology`, or a topology name or path; a
        topology's mesh is built over ``jax.devices()`` (every process's devices).
      strategy: a `Strategy`, a plan, a name in `PLANNERS` (default ``"data_parallel"``), or a
        planner ``(graph, mesh_shape) -> Strategy``.
      opt_state: an existing optimizer state to place; default ``optimizer.init(params)``,
        computed directly on its shardings.
      name: the graph's name (default: the loss's, or the nnx model's class name).
      donate: donate params and optimizer state to the step.
      compiler_options: XLA options for the step's `jax.jit`.

    Returns:
      The `ShardedTraining`.

    Raises:
      PlanError: the strategy does not fit the traced graph or the mesh, or is an unknown name.
      TopologyError: the topology needs devices that are not attached.
    """
    loss_fn, params, name = _pure_loss(loss_fn, params, name)
    mesh, mesh_shape = _resolve_mesh(mesh)
    graph = trace(loss_fn, params, batch, name=name)
    strategy = _resolve_strategy(strategy, graph, mesh_shape or MeshShape.of(mesh))
    strategy = check_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)  # a plan's, too
    step, shardings = sharded_train_step(graph, strategy, mesh, optimizer, params=params,
                                         batch=batch, mesh_shape=mesh_shape, donate=donate,
                                         compiler_options=compiler_options)
    placed = opt = None
    if not _is_abstract(params):
        placed = device_put_global(params, shardings.params)
        if opt_state is None:
            opt = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(placed)
        else:
            opt = device_put_global(opt_state, shardings.opt_state)
    return ShardedTraining(step, placed, opt, shardings, graph, strategy, mesh)


def _pure_loss(loss_fn, params, name):
    from flax import nnx

    if not isinstance(params, nnx.Module):
        return loss_fn, params, name
    model = params
    graphdef, trained, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, batch):
        # A fresh copy of the other state (batch statistics, RNG streams) on every call: merged
        # as it is, its Variables belong to the caller's trace level, and a model that applies
        # nnx.scan or nnx.vmap inside (scan over layers) fails to trace with "Cannot extract
        # graph node from different trace level".
        return loss_fn(nnx.merge(graphdef, p, jax.tree.map(jnp.asarray, rest)), batch)

    return loss, trained, name or type(model).__name__


def _resolve_mesh(mesh) -> tuple[Mesh, MeshShape | None]:
    if isinstance(mesh, Mesh):
        return mesh, None
    topology = mesh if isinstance(mesh, Topology) else load_topology(mesh)
    return make_mesh(topology), MeshShape.of(topology)


def _resolve_strategy(strategy, graph: OpGraph, mesh_shape: MeshShape):
    if isinstance(strategy, str):
        if strategy not in PLANNERS:
            raise PlanError(f"unknown strategy {strategy!r}; expected one of {sorted(PLANNERS)}, "
                            "a Strategy, a plan, or a planner (graph, mesh_shape) -> Strategy")
        strategy = PLANNERS[strategy]
    if callable(strategy) and not isinstance(strategy, Strategy):
        return strategy(graph, mesh_shape)
    return strategy


def _is_abstract(tree: Any) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))
