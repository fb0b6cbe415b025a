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
    nnx.update(model, run.model_params(params))

**Planning.** The strategy defaults to ``"plan"``: `soapjax.search.find.find_plan` searches the
topology (``search=SearchSettings(...)``, default 20 s; ``costs="auto"`` measures operators where
the topology's devices are attached) and prints one line of progress. The plan is cached on disk
(``$SOAPJAX_CACHE_DIR/plans``, default ``~/.cache/soapjax/plans``), keyed by the graph's
fingerprint (`OpGraph.fingerprint`), the topology's, the soapjax version, the search settings,
where costs come from, the optimizer's state size and the dims its update multiplies whole
(`soapjax.cost.updates.update_signature`); the next run with the same key reads it instead
("reusing cached plan ... from <path>"; docs/apply.md says how long each takes). Other strategies:
a `Strategy`, a `Plan`, a baseline by name (`PLANNERS`: ``"data-parallel"``, ``"megatron"``,
``"fsdp"``, ``"expert-cnn"``, ``"expert-rnn"``), or a ``planner(graph, mesh_shape) -> Strategy``. A
pipelined strategy or plan (`soapjax.strategy.baselines.megatron_3d` with ``pp``) runs too, on the
topology's mesh with its outermost axis cut into stages (`soapjax.apply.step`); the parameters stay
in the model's layout, but for an interleaved pipeline's (virtual stages): the step keeps its
stacked layer parameters and their optimizer state in the order its chunks run them
(`soapjax.apply._layer_order`), so ``run.params`` and what ``run.step`` returns hold them wrapped
in `soapjax.apply.ChunkOrdered` (used as arrays they raise a PlanError).
``run.model_params(params)`` gives the model's layout (for evaluation, ``nnx.update``, an export);
`soapjax.checkpoint` saves and restores in the model's layout by itself.

**A raw `jax.sharding.Mesh`** carries no topology, which planning needs. The named planners then
use the local devices' shipped topology (`soapjax.cost.operators.local_topology`: ``cpu8`` on a
CPU) cut to the mesh's device count and given the mesh's axes: right for virtual CPU devices and
one node of identical accelerators, a guess for anything with a network between nodes; pass
``mesh=`` a topology name, file or `Topology` to plan a real cluster. Where no shipped topology has
the local device kind, the error says so.

Multi-host: every process runs the same script: `initialize_distributed` connects them, the mesh
spans every process's devices, `shard_training` builds global arrays from each process's values
(`jax.make_array_from_callback`), and with ``strategy="plan"`` process 0 plans (or reads its cache)
and sends the plan to the others (a timed search can end differently on each process).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import sys
import tempfile
import types
import warnings
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from soapjax._nnx import optax_of, pure_loss
from soapjax.apply._validation import validate_trainable
from soapjax.apply.step import (
    ChunkOrdered,
    PartitionedStep,
    TrainShardings,
    device_put_global,
    model_layout,
    sharded_train_step,
    validate_strategy,
)
from soapjax.base._cache import cache_root
from soapjax.base._progress import end_progress, print_progress
from soapjax.base.errors import ArgumentError, PlanError, SoapjaxError
from soapjax.cost.operators import local_backend_matches, local_topology
from soapjax.cost.reshard import DEFAULT_MODE
from soapjax.cost.updates import freeze, update_signature
from soapjax.exactness import (
    NUMBERS_TOLERANCE,
    GradientComparison,
    VerificationError,
    first_step,
    reference_inputs,
    reference_value_and_grad,
    step_difference,
)
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.search import SearchSettings, checked_finalist, find_plan
from soapjax.simulate.front import opt_state_factor
from soapjax.strategy._arguments import check_optimizer, check_settings
from soapjax.strategy.baselines import NAMES as BASELINE_NAMES, baselines
from soapjax.strategy.plan import Plan, untied_warning
from soapjax.strategy.space import MeshShape, Strategy
from soapjax.topology.cluster import Topology, load_topology, make_mesh, scaled_topology

__all__ = ["PLANNERS", "CountingStep", "PlanOptions", "ShardedTraining", "VerificationError",
           "initialize_distributed", "shard_training", "verify_first_step"]

# Environment variables `scripts/launch_local.py` sets for each process.
ENV_COORDINATOR = "SOAPJAX_COORDINATOR"
ENV_NUM_PROCESSES = "SOAPJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SOAPJAX_PROCESS_ID"

# A planner of your own: ``planner(graph, mesh_shape) -> Strategy`` (`shard_training`).
Planner = Callable[[OpGraph, MeshShape], Strategy]


class PlanOptions(NamedTuple):
    """What `shard_training` gives a named planner besides the graph and topology.

    Attributes:
      search: the search settings (None: `SearchSettings()`).
      costs: ``"auto"``, ``"measured"`` or ``"analytic"`` (`soapjax.cost.operators.cost_model`).
      optimizer: the training step's optax optimizer.
    """

    search: SearchSettings | None
    costs: str
    optimizer: Any


class NamedPlanner(Protocol):
    """An entry of `PLANNERS`: a strategy, or a plan, for a graph on a topology."""

    def __call__(self, graph: OpGraph, topology: Topology,
                 options: PlanOptions) -> Strategy | Plan: ...


def _baseline(name: str) -> NamedPlanner:
    def planner(graph: OpGraph, topology: Topology, options: PlanOptions) -> Strategy:
        return baselines(graph, topology)[name]

    planner.__name__ = planner.__qualname__ = name.replace("-", "_")
    planner.__doc__ = f"The {name!r} baseline (`soapjax.strategy.baselines`)."
    return planner
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


class CountingStep:
    """A `PartitionedStep` that passes its own call count as the step number.

    Given the traced `graph`, a call whose batch is not the traced one (a key missing or
    extra, another leaf's shape) raises PlanError naming the leaf, instead of jit's pytree
    error; checked only when the call fails, so a step costs nothing more.
    """

    def __init__(self, step: PartitionedStep, graph: OpGraph | None = None):
        self.partitioned = step
        self.graph = graph
        self.count = 0

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> Any:
        _check_not_donated(params, opt_state)
        try:
            out = self.partitioned(params, opt_state, batch, np.int32(self.count))
        except (ValueError, TypeError):
            if self.graph is not None:
                check_params(self.graph, params, "run.step")
                check_batch(self.graph, batch, "run.step")
                _check_layer_order(params, opt_state, self.partitioned)
            raise
        self.count += 1
        return out

    def lower(self, params: Any, opt_state: Any, batch: Any) -> Any:
        return self.partitioned.lower(params, opt_state, batch, np.int32(self.count))

    @property
    def partitioner(self) -> str:
        return self.partitioned.partitioner

    def __repr__(self) -> str:
        return f"CountingStep({self.partitioned!r}, count={self.count})"


@dataclasses.dataclass(frozen=True)
class ShardedTraining:
    """What `shard_training` returns: the sharded step and the placed training state.

    Attributes:
      step: jitted ``step(params, opt_state, batch) -> (params, opt_state, loss)`` (``loss``
        is ``(loss, aux)`` with `shard_training`'s ``has_aux=True``); it donates
        params and opt_state, so keep only what it returns. It counts its calls and passes the
        count as the step number (`apply.sharded_train_step`): the first call computes exactly
        your loss's gradient, later ones draw fresh dropout masks from the keys your loss holds
        (an nnx model's `Rngs`, a linen dropout key). Every process counts alike.
      params: the parameters on their shardings (for nnx: the `nnx.Param` state); an
        interleaved pipeline's stacked layer parameters in chunk order (`model_params`).
      opt_state: the optimizer state on its shardings.
      shardings: every sharding of the step.
      graph: the traced operator graph.
      strategy: the applied strategy.
      mesh: the device mesh.
      plan: the plan applied, searched or read from the cache (None for a strategy given
        otherwise): its predicted step time, baselines and search statistics.
    """

    step: CountingStep
    params: Any
    opt_state: Any
    shardings: TrainShardings
    graph: OpGraph
    strategy: Strategy
    mesh: Mesh
    plan: Plan | None = None

    def model_params(self, params: Any = None) -> Any:
        """`params` (default ``self.params``; or gradients, or an optimizer state) in the
        model's layout, as ``loss_fn`` and the model take them: an interleaved pipeline's
        stacked layer parameters back from the chunk order the step keeps them in
        (`soapjax.apply.model_layout`; the same tree where the plan has no virtual stages)."""
        return model_layout(self.params if params is None else params)

    def shard_batch(self, batch: Any) -> Any:
        """Puts a batch on the batch shardings.

        Each leaf is either the global batch (the same on every process) or, in a multi-process
        run, this process's rows of it (dim 0 of size global / `jax.process_count()`, in
        process order), as a per-host data loader yields them.
        """
        check_batch(self.graph, batch, "shard_batch")
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
                   strategy: Strategy | Plan | Planner | str | None = "plan",
                   search: SearchSettings | None = None, costs: str = "auto",
                   opt_state: Any = None, name: str | None = None, donate: bool = True,
                   compiler_options: Mapping[str, Any] | None = None,
                   verify: bool = False, has_aux: bool = False, wrt: Any = None
                   ) -> ShardedTraining:
    """Traces the loss, applies a strategy, and places the training state on the mesh.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``; for an nnx model,
        ``loss_fn(model, batch) -> scalar``.
      params: the parameters (a pytree of arrays), or an `nnx.Module` whose `nnx.Param` state
        is trained (its other state is held constant; with `wrt`, the parameters it selects).
        `jax.ShapeDtypeStruct`s give the step and shardings only (``params`` and
        ``opt_state`` are then None; initialise with
        ``jax.jit(init, out_shardings=run.shardings.params)``).
      batch: an example batch (arrays or `jax.ShapeDtypeStruct`s); dim 0 is the batch.
      optimizer: the optax transformation (for an nnx model, an `nnx.Optimizer` too: its
        ``tx`` and ``wrt``).
      mesh: a `jax.sharding.Mesh` (Auto axes), a `Topology`, or a topology name or path; a
        topology's mesh is built over ``jax.devices()`` (every process's devices).
      strategy: ``"plan"`` (default, as is None: search, or reuse the cached plan; module
        doc), another name in `PLANNERS` (a baseline), a `Strategy`, a `Plan`, or a planner
        ``(graph, mesh_shape) -> Strategy``.
      search: the search settings of ``"plan"`` (default `SearchSettings()`: 20 s).
      costs: how ``"plan"`` prices operators: ``"auto"`` (measured where the topology's
        devices are attached, else the analytic roofline), ``"measured"`` or ``"analytic"``.
      opt_state: an existing optimizer state to place; default ``optimizer.init(params)``,
        computed directly on its shardings.
      name: the graph's name (default: a `Plan`'s model's, so that a plan made by ``soapjax
        plan --model file.py:fn`` binds to the same model here; else the loss's, or the nnx
        model's class name).
      donate: donate params and optimizer state to the step.
      compiler_options: XLA options for the step's `jax.jit`.
      verify: run the first step both sharded and unsharded before returning, on ``batch``
        (`verify_first_step`): the loss and every gradient leaf against ``jax.grad`` of your
        loss on one device, each leaf relative to its own scale, then the updated parameters
        and optimizer state; a difference beyond the float type's rounding raises
        `VerificationError` naming the leaf and the operator that reads it. Its cost: two
        more compiles (the sharded gradients, the unsharded step) and three step-sized runs;
        docs/apply.md has the figures.
      has_aux: ``loss_fn`` returns ``(loss, aux)`` (as for ``jax.value_and_grad(...,
        has_aux=True)``: metrics, a linen model's updated ``batch_stats``); the step then
        returns ``(params, opt_state, (loss, aux))``, aux computed inside the sharded step,
        not differentiated. Plans keep one microbatch and no pipeline stages.
      wrt: for an nnx model, the filter of the parameters to train, as ``nnx.Optimizer(model,
        tx, wrt=nnx.LoRAParam)`` takes it: the others stay parameters (a plan may split
        them), left as they are and no gradient computed for them (docs/apply.md).

    Returns:
      The `ShardedTraining`.

    Raises:
      PlanError: the strategy does not fit the traced graph or the mesh, or is an unknown name;
        no topology for a raw mesh.
      TopologyError: the topology needs devices that are not attached.
      VerificationError: with ``verify=True``, the sharded step computes other numbers.
    """
    optimizer = optax_of(params, optimizer, wrt)
    check_optimizer(optimizer, "shard_training")
    check_settings(search, SearchSettings, "shard_training", name="search")
    strategy = "plan" if strategy is None else strategy
    if name is None and isinstance(strategy, Plan):
        # the graph named as the plan's (`soapjax plan --model file.py:fn` names it after the
        # file): the operators outside any module take the graph's name
        name = strategy.model
    loss_fn, params, name = pure_loss(loss_fn, params, name)
    mesh, topology = _resolve_mesh(mesh)
    mesh_shape = MeshShape.of(topology) if topology is not None else None
    graph = freeze(trace(loss_fn, params, batch, name=name, has_aux=has_aux), optimizer)
    validate_trainable(graph)  # before any planning
    options = PlanOptions(search, costs, optimizer)
    strategy = _resolve_strategy(strategy, graph, mesh, topology, options)
    plan = strategy if isinstance(strategy, Plan) else None
    strategy = validate_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)  # a plan's, too
    untied = untied_warning(graph, strategy)
    if untied:  # it runs (XLA moves the slices); a plan's predicted step leaves them out
        warnings.warn(untied.removeprefix("warning: "), stacklevel=2)
    step, shardings = sharded_train_step(graph, strategy, mesh, optimizer, params=params,
                                         batch=batch, mesh_shape=mesh_shape, donate=donate,
                                         compiler_options=compiler_options)
    placed = opt = None
    if not _is_abstract(params):
        placed = device_put_global(params, shardings.params)
        if opt_state is None:
            with jax.set_mesh(shardings.loss.mesh):  # not a caller's (docs/apply.md)
                opt = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(placed)
        else:
            opt = device_put_global(opt_state, shardings.opt_state)
    run = ShardedTraining(CountingStep(step, graph), placed, opt, shardings, graph, strategy,
                          mesh, plan)
    if verify:
        if _is_abstract(params) or _is_abstract(batch):
            raise ArgumentError("shard_training(verify=True) runs the first step, so it needs "
                                "values; got jax.ShapeDtypeStructs for the parameters or the "
                                "batch")
        verify_first_step(run, loss_fn, params, batch, optimizer, opt_state=opt_state,
                          compiler_options=compiler_options)
    return run


def verify_first_step(run: ShardedTraining, loss_fn: Callable[[Any, Any], Any], params: Any,
                      batch: Any, optimizer: optax.GradientTransformation, *,
                      opt_state: Any = None, compiler_options: Mapping[str, Any] | None = None,
                      tolerance: float | None = None) -> GradientComparison:
    """The first step of `run`, sharded and unsharded, on `batch`; raises unless they agree.

    First the loss and every gradient leaf (`soapjax.exactness.first_step`: the sharded
    gradients against ``jax.grad`` of `loss_fn` on one device, each leaf relative to its own
    scale, within `tolerance`, default the rounding of the float type the model computes in);
    then the step itself (``run.step`` on copies of its state, so `run` is untouched, against
    the unsharded step): the updated parameters and optimizer state within
    `soapjax.exactness.NUMBERS_TOLERANCE`, absolute, as `soapjax check` holds them.

    Raises:
      VerificationError: naming the worst gradient leaf and the operator that reads it, or
        the step's largest difference.
    """
    comparison = first_step(run.graph, run.strategy, run.mesh, loss_fn, params, batch,
                            tolerance=tolerance,
                            compiler_options=dict(compiler_options) if compiler_options
                            else None,
                            sharded=(run.step.partitioned.value_and_grad, run.shardings))
    if not comparison.passed:
        raise VerificationError(
            f"shard_training(verify=True): the sharded step computes other gradients than "
            f"your loss's on one device: {comparison.describe()}. The strategy is wrong for "
            "this model; please report it (with the plan) and train with another strategy "
            "(e.g. strategy='data-parallel') meanwhile")
    state = optimizer.init(params) if opt_state is None else opt_state
    options = dict(compiler_options) if compiler_options else None
    value_and_grad = reference_value_and_grad(loss_fn, run.graph, run.strategy)

    def unsharded(p, o, b):
        loss, grads = value_and_grad(p, b)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    want = jax.jit(unsharded, compiler_options=options)(
        *reference_inputs((params, state, batch)))
    sh = run.shardings
    got = run.step.partitioned(device_put_global(params, sh.params),
                               device_put_global(state, sh.opt_state),
                               device_put_global(batch, sh.batch), np.int32(0))
    diff = step_difference(model_layout(got), want, gradients=comparison)
    if not diff <= NUMBERS_TOLERANCE:
        raise VerificationError(
            f"shard_training(verify=True): the loss and gradients agree ({comparison.describe()}"
            f"), but after one step of the optimizer the parameters or optimizer state differ "
            f"from the unsharded step's by {diff:.3g} (bar {NUMBERS_TOLERANCE:g}, absolute): "
            "the optimizer state's sharding computes another update; please report it")
    return comparison


def check_batch(graph: OpGraph, batch: Any, where: str) -> None:
    """PlanError unless `batch` has the leaves (pytree paths) the graph was traced with, each
    of its shape and dtype (dim 0 may be one process's rows of the batch in a run of several
    processes); the message names the first leaf missing, extra or of another shape or type."""
    _check_leaves(graph.batch, batch, where, "batch", rows=jax.process_count())


def check_params(graph: OpGraph, params: Any, where: str) -> None:
    """PlanError unless `params` has the leaves (pytree paths), shapes and dtypes the graph was
    traced with; the message names the first leaf missing, extra or of another shape or type."""
    _check_leaves(graph.params, params, where, "parameters")


def _check_layer_order(params: Any, opt_state: Any, step: PartitionedStep) -> None:
    """PlanError where the step keeps stacked layers in chunk order (an interleaved
    pipeline's) and `params` or `opt_state` come without it (in the model's layout)."""
    given = [x for tree in (params, opt_state)
             for x in jax.tree.leaves(tree, is_leaf=_is_ordered)]
    if step.chunk_ordered and not any(isinstance(x, ChunkOrdered) for x in given):
        raise PlanError(
            "run.step: this plan's step keeps its stacked layer parameters and their optimizer "
            "state in the order its interleaved pipeline's chunks run them (ChunkOrdered "
            "leaves, as run.params and run.opt_state hold them and run.step returns them), "
            "but it was given them in the model's layout; pass what run.step returned, or "
            "place yours with soapjax.apply.device_put_global(params, run.shardings.params) "
            "(and the same for the optimizer state), which puts them in that order")


def _is_ordered(x: Any) -> bool:
    return isinstance(x, ChunkOrdered)


def _check_leaves(traced_leaves, tree: Any, where: str, what: str, rows: int = 0) -> None:
    tree = jax.tree.map(lambda x: x.value if _is_ordered(x) else x, tree, is_leaf=_is_ordered)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    found = {jax.tree_util.keystr(path): x for path, x in flat}
    traced = {leaf.path: leaf for leaf in traced_leaves}
    missing = [p for p in traced if p not in found]
    extra = [p for p in found if p not in traced]
    if missing or extra:
        has = "have" if what == "parameters" else "has"
        problem = (f"{has} no leaf {_few(missing)}" if missing else
                   f"{has} leaf {_few(extra)}, which the step was not traced with")
        raise PlanError(f"{where}: the {what} {problem} (traced with {_few(list(traced))}; "
                        f"found {_few(list(found)) or 'none'}); expected the {what} of the "
                        f"structure shard_training was given")
    for path, leaf in traced.items():
        x = found[path]
        shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", None) or np.result_type(x)
        ok_rows = shape[:1] == leaf.shape[:1] or (
            rows > 1 and len(shape) and shape[0] * rows == leaf.shape[0])
        if len(shape) != len(leaf.shape) or shape[1:] != leaf.shape[1:] or not ok_rows:
            hint = (" (dim 0 may be one process's rows)" if rows > 1 else
                    f"; dim 0 is the batch, {leaf.shape[0]} samples: give batches of that "
                    "size (a batch of another size needs its own shard_training)"
                    if what == "batch" and shape[1:] == leaf.shape[1:] else "")
            raise PlanError(f"{where}: {what} leaf {path} has shape {shape}, but the step was "
                            f"traced with {leaf.shape}{hint}")
        # as jax.jit takes it: a NumPy int64 or float64 array is int32 or float32 without x64
        if str(jax.dtypes.canonicalize_dtype(dtype)) != str(leaf.dtype):
            raise PlanError(f"{where}: {what} leaf {path} is {dtype}, but the step was traced "
                            f"with {leaf.dtype}; pass {leaf.dtype} (e.g. x.astype("
                            f"jnp.{leaf.dtype}))")


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def _check_not_donated(*trees: Any) -> None:
    """PlanError for an array an earlier step consumed: the step donates its parameters and
    optimizer state, and reading a donated buffer ends the process (XLA: "Buffer has been
    deleted or donated")."""
    for name, tree in zip(("parameters", "optimizer state"), trees):
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(x, jax.Array) and x.is_deleted():
                raise PlanError(
                    f"run.step: {name} leaf {jax.tree_util.keystr(path)} was donated to an "
                    "earlier step and is gone; pass the params and opt_state the last step "
                    "returned (params, opt_state, loss = run.step(params, opt_state, batch)), "
                    "or shard_training(..., donate=False) to keep the inputs")


def _resolve_mesh(mesh) -> tuple[Mesh, Topology | None]:
    if isinstance(mesh, Mesh):
        return mesh, None
    topology = mesh if isinstance(mesh, Topology) else load_topology(mesh)
    return make_mesh(topology), topology


def _resolve_strategy(strategy, graph: OpGraph, mesh: Mesh, topology: Topology | None,
                      options: PlanOptions):
    if isinstance(strategy, str):
        if strategy not in PLANNERS:
            near = difflib.get_close_matches(strategy, list(PLANNERS), n=1)
            raise PlanError(f"unknown strategy {strategy!r}; expected one of "
                            f"{', '.join(PLANNERS)}, a Strategy, a Plan, or a planner "
                            "(graph, mesh_shape) -> Strategy"
                            + (f"; did you mean {near[0]!r}?" if near else ""))
        return PLANNERS[strategy](graph, topology or mesh_topology(mesh), options)
    if callable(strategy) and not isinstance(strategy, (Strategy, Plan)):
        return strategy(graph, MeshShape.of(topology) if topology is not None
                        else MeshShape.of(mesh))
    return strategy


def mesh_topology(mesh: Mesh) -> Topology:
    """The topology a named planner assumes for a raw `jax.sharding.Mesh` (module doc).

    The local devices' shipped topology (`soapjax.cost.operators.local_topology`), cut to the mesh's
    device count (`soapjax.topology.cluster.scaled_topology`), with the mesh's axis names and sizes;
    e.g. a ``Mesh(devices.reshape(4, 2), ("data", "model"))`` of 8 CPU devices plans on
    ``cpu8`` as ``data=4, model=2``, named ``cpu8-as-data4-model2``.

    Raises:
      PlanError: no shipped topology has the local device kind, or it cannot be cut to the
        mesh's device count; the message says to pass a topology instead.
    """
    names, sizes = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    try:
        local = local_topology()
        base = scaled_topology(local, mesh.devices.size)
    except SoapjaxError as e:
        raise PlanError(f"a jax.sharding.Mesh {dict(zip(names, sizes))} carries no topology and "
                        f"none can be assumed ({e}); pass mesh= a topology name, a .toml path or "
                        "a soapjax.Topology (see `soapjax meshes`) to plan") from None
    return dataclasses.replace(
        base, name=f"{local.name}-as-" + "-".join(f"{a}{n}" for a, n in zip(names, sizes)),
        axis_names=names, axis_sizes=sizes, device_order=tuple(range(base.num_devices)),
        description=f"{base.description} (mesh axes of a jax.sharding.Mesh)")


# --- "plan": find_plan, cached on disk ---------------------------------------------------------


def _plan(graph: OpGraph, topology: Topology, options: PlanOptions) -> Plan:
    """Searches `graph` on `topology`, or reads the plan an earlier run cached (module doc)."""
    settings = options.search if options.search is not None else SearchSettings()
    if jax.process_index() != 0:
        return _shared(None)
    key = _cache_key(graph, topology, settings, options)
    path = _cache_path(graph, topology, key)
    plan = _read_cached(path, key)
    if plan is not None:
        _say(f"soapjax: reusing cached plan for {graph.name} on {topology.name} (predicted "
             f"{plan.step_time_s * 1e3:.4g} ms per step) from {path}")
        return _shared(plan)
    _say(f"soapjax: planning {graph.name} ({len(graph.operators)} operators) on {topology.name} "
         f"({topology.num_devices} devices): " + (f"{settings.max_proposals} proposals per chain"
                                                  if settings.max_proposals else
                                                  f"{settings.budget_s:g} s search"))
    plan = find_plan(graph, topology, settings=settings, costs=options.costs,
                     optimizer=options.optimizer, progress=print_progress)
    end_progress()
    _write_cached(path, key, plan)
    info, dp = dict(plan.search), dict(plan.baselines).get("data-parallel")
    versus = f" (data parallel {dp * 1e3:.4g} ms)" if dp else ""
    _say(f"soapjax: plan for {graph.name} on {topology.name}: predicted "
         f"{plan.step_time_s * 1e3:.4g} ms per step{versus}, {info['proposals']:,} proposals in "
         f"{info['search_time_s']:.1f} s; cached in {path}")
    for line in _plan_caveats(info):
        _say(f"soapjax: {line}")
    return _shared(plan)


def _plan_caveats(info: dict) -> list[str]:
    """What a user should know of a plan just searched (its search info): layout changes XLA
    makes by replicating whole (XLA warns of each: priced so, not a fault), and operators
    priced by estimate when the measuring budget ran out (`CostModel.estimated_in`)."""
    lines, chosen = [], checked_finalist(info)
    if chosen and chosen.get("replicated_whole"):
        lines.append(f"XLA makes {chosen['replicated_whole']} of the plan's layout changes by "
                     "replicating the tensor whole (its 'Involuntary full rematerialization' "
                     "warnings); the predicted time prices them so")
    if estimated := list(info.get("estimated_operators") or ()):
        lines.append(f"{len(estimated)} of the plan's operators are priced by estimate, not "
                     "measured (the search's measuring budget ran out); a larger search "
                     "budget measures them")
    return lines


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _cache_key(graph: OpGraph, topology: Topology, settings: SearchSettings,
               options: PlanOptions) -> dict[str, Any]:
    measured = options.costs == "measured" or (options.costs == "auto"
                                               and local_backend_matches(topology)[0])
    params = graph.abstract_params()
    factor = 2.0 if options.optimizer is None else opt_state_factor(options.optimizer, params)
    return {"graph": graph.fingerprint(), "topology": topology.fingerprint(),
            "soapjax": _version(), "search": settings.to_json(), "reshard": DEFAULT_MODE,
            "costs": "measured" if measured else "analytic", "opt_state_factor": round(factor, 9),
            **update_signature(options.optimizer, params)}


def _version() -> str:
    try:
        return metadata.version("soapjax")
    except metadata.PackageNotFoundError:
        return "unknown"


def _cache_path(graph: OpGraph, topology: Topology, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in
                   f"{graph.name}-{topology.name}")[:80]
    return cache_root() / "plans" / f"{slug}-{digest}.json"


def _read_cached(path: Path, key: dict[str, Any]) -> Plan | None:
    """The plan cached at `path` for `key`; None (with a warning if unreadable) otherwise."""
    try:
        entry = json.loads(path.read_text())
        if entry["key"] != key:
            return None
        return Plan.from_json(entry["plan"], where=str(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # PlanError is a ValueError
        _say(f"soapjax: warning: ignoring the unreadable cached plan {path} "
             f"({type(e).__name__}: {e}); planning again")
        return None


def _write_cached(path: Path, key: dict[str, Any], plan: Plan) -> None:
    """Writes atomically (a temp file, then a rename); a failure costs a search next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "plan": plan.to_json()}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        _say(f"soapjax: warning: cannot cache the plan in {path} ({e})")


def _shared(plan: Plan | None) -> Plan:
    """Process 0's plan on every process (the plan itself in a one-process run)."""
    if jax.process_count() == 1:
        return plan
    text = json.dumps(plan.to_json()).encode() if plan is not None else b""
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(text))))
    data = np.frombuffer(text, np.uint8) if plan is not None else np.zeros(n, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(data), np.uint8)
    return Plan.from_json(json.loads(data.tobytes()), where="the plan process 0 sent")


# Named planners for `shard_training(strategy=...)`: "plan" searches (or reuses its cache), the
# others are the baselines every plan is compared with (`soapjax.strategy.baselines`).
PLANNERS: Mapping[str, NamedPlanner] = types.MappingProxyType(
    {"plan": _plan, **{name: _baseline(name) for name in BASELINE_NAMES}})


def _is_abstract(tree: Any) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))
