"""Apply: a strategy becomes `NamedSharding`s and sharding constraints under `jax.jit`.

A step without pipeline stages is the traced loss re-evaluated inside `jax.jit` with a sharding
constraint on every operator output and operand (`soapjax.apply._flatstep`: no model code changes,
autodiff carries the constraints to the backward pass, XLA's SPMD partitioner inserts the
collectives); a step with stages runs the schedule in one `shard_map` (`soapjax.apply._pipelined`).
Parameters, optimizer state and the batch enter and leave
the jitted step with the shardings that follow from the configs:

* a parameter takes the operand spec of the first operator that reads it
  (``config.operand_spec(operand.dims)``), then is split further over `Strategy.zero_axes`
  (ZeRO-3), each on its largest dim that stays divisible (`soapjax.strategy.space.param_specs`, the
  same specs the simulator prices);
* optimizer state leaves that mirror a parameter take that parameter's sharding (found with
  `optax.tree_map_params`), split further over `Strategy.optimizer_axes` (Megatron's
  distributed optimizer, `soapjax.strategy.space.optimizer_specs`); everything else (step counts,
  scalars) is replicated;
* a batch leaf takes the operand spec of its first consumer.

Example (a Dense layer ``fc1`` reads a kernel f32[16, 32]; mesh ``data=2, model=4``)::

    config of fc1:    Config((("data",), ("model",), ()))    # [S:data, P:model | R:-]
    kernel operand:   dims (2, 1)                             # in -> R dim, out -> P dim
    kernel spec:      PartitionSpec(None, 'model')
    with zero_axes=("data",):  PartitionSpec('data', 'model')  # shard 16/1 beats 32/4

Usage::

    graph = soapjax.graph.opgraph.trace(w.loss_fn, params, batch)
    strategy = soapjax.strategy.space.data_parallel(graph, MeshShape.of(mesh))
    step, shardings = sharded_train_step(graph, strategy, mesh, optimizer, params=params)
    params, opt_state = device_put_global((params, opt_state),
                                          (shardings.params, shardings.opt_state))
    params, opt_state, loss = step(params, opt_state, device_put_global(batch, shardings.batch))

**Pipelined strategies** (`Strategy.pipelined`: S stages, v virtual stages, a schedule) run
through `sharded_train_step` as one SPMD program (`soapjax.apply._pipelined`) on the user's mesh
reshaped: its outermost axis of size n becomes ``stage`` (S) x that axis (n / S, dropped at 1),
e.g. ``node=2, data=2, model=2`` -> ``stage=2, data=2, model=2``. The configs are over one
stage's mesh, the parameters keep the model's layout with each stacked layer parameter split
over ``stage`` on its layer dim (`train_shardings`; an interleaved pipeline's in the order its
chunks run them: `soapjax.apply._layer_order`), and the step keeps its interface.

Every function takes a `Strategy` or a plan (`soapjax.strategy.plan.Plan`: its ``strategy(graph)``
checks the plan was made for the graph, and its ``mesh`` is checked against the mesh).
Everything is validated before anything is compiled (`validate_strategy`); mistakes raise
`PlanError`. Strategies that split convolutions spatially are refused too: XLA computes them
wrongly (see `constrained_loss`).

The stage is six modules, in the order data flows, their public names re-exported here: a
pipelined strategy's layout (`soapjax.apply._pipeline_layout`: its mesh, where its layers live), the
check where a strategy enters (`soapjax.apply._validation`), the two step programs (the constrained
loss of a strategy without stages, `soapjax.apply._flatstep`; the pipeline,
`soapjax.apply._pipelined`), the shardings of parameters, optimizer state and batch with the choice
between the two programs (`soapjax.apply._shardings.step_program`, the stage's one question whether
a strategy is pipelined after its check), and this one, the jitted step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
import optax
from jax._src import config as _jax_config  # the scoped partitioner switch has no public home
from jax.sharding import Mesh

from soapjax.apply._flatstep import constrained_loss, recompute_segments
from soapjax.apply._layer_order import ChunkOrdered, model_layout, step_layout
from soapjax.apply._pipeline_layout import chunk_ordered
from soapjax.apply._pipelined import branch_runs, check_compiled, count_branch_runs
from soapjax.apply._shardings import (
    TrainShardings,
    batch_shardings,
    checked,
    opt_state_shardings,
    param_shardings,
    step_program,
    train_shardings,
)
from soapjax.apply._validation import Checked, validate_strategy
from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy.space import MeshShape, strategy_from_names

__all__ = [
    "Checked",
    "ChunkOrdered",
    "PartitionedStep",
    "Partitioner",
    "TrainShardings",
    "batch_shardings",
    "collectives_as_run",
    "constrained_loss",
    "device_put_global",
    "model_layout",
    "opt_state_shardings",
    "param_shardings",
    "recompute_segments",
    "sharded_train_step",
    "sharded_value_and_grad",
    "step_layout",
    "strategy_from_names",
    "train_shardings",
    "validate_strategy",
]


# --- the sharded train step ---------------------------------------------------------------------


def sharded_train_step(graph: OpGraph, strategy: Any, mesh: Mesh,
                       optimizer: optax.GradientTransformation, *, params: Any = None,
                       batch: Any = None, mesh_shape: MeshShape | None = None,
                       donate: bool = True, compiler_options: Mapping[str, Any] | None = None,
                       allow_spatial_convolutions: bool = False,
                       partitioner: Partitioner = "auto") -> tuple[PartitionedStep, TrainShardings]:
    """A jitted ``step(params, opt_state, batch[, step]) -> (params, opt_state, loss)``.

    The step is the loss and gradients of the strategy's step program
    (`soapjax.apply._shardings.step_program`: ``jax.value_and_grad`` of `constrained_loss`, or the
    pipeline below), gradients constrained to the parameters' shardings (with ZeRO axes this
    is a reduce-scatter), or under the distributed optimizer (`Strategy.optimizer_axes`) to
    the optimizer state's (a reduce-scatter over those axes; each device updates its shard and
    XLA all-gathers the updated parameters to their own sharding), ``optimizer.update`` and
    ``optax.apply_updates``, jitted with
    `TrainShardings` as in/out shardings. ``step``, the training step's number (an int32
    scalar; default 0), advances the PRNG keys the loss makes from constants
    (`soapjax.apply._flatstep.step_keys`): pass a new number every step for fresh dropout masks
    (`training.ShardedTraining.step` counts for you); step 0 computes the traced function.

    A pipelined strategy (`Strategy.pipelined`) runs on `mesh` with its outermost axis cut
    into a ``stage`` axis (`soapjax.apply._pipeline_layout.pipelined_mesh`; the shardings are on
    that mesh). Inside the step the parameters are reshaped to the pipelined layout
    (`soapjax.apply._pipeline_layout.to_pipelined`), ``pipelined_value_and_grad`` runs the
    strategy's schedule over M = ``strategy.microbatches`` microbatches, and the gradients are
    reshaped back, so the optimizer updates the model's layout. The layers recompute as
    `soapjax.apply._pipeline_layout.layer_recompute` says: in full from each chunk's input if a
    layer operator's policy is ``"full"``, keeping the projections' and MLP's matmul outputs and
    recomputing the attention core if one is ``"selective"`` (but for the attention-core
    operators whose policy is ``"none"``, which keep their outputs:
    `soapjax.apply._pipeline_layout.kept_positions`).
    With 1F1B the model layout's stage split is each stage's chunk, so nothing moves but the
    pipeline's sends; with v > 1 virtual stages a stage's chunks are not one run of layers,
    so the step keeps the stacked layer parameters, their gradients and the optimizer state
    that mirrors them in chunk order (`soapjax.apply._layer_order`: `ChunkOrdered` leaves in
    the shardings, the step's inputs and outputs; `device_put_global` puts a tree in the
    model's layout so, `model_layout` takes it back) and nothing moves either.

    Args:
      graph: the traced graph of ``loss_fn(params, batch)``.
      strategy: a `Strategy` or plan.
      mesh: the mesh, with Auto axes; it may span processes (`jax.distributed`).
      optimizer: the optax transformation.
      params: the parameters or their shapes (pytree structure; see `param_shardings`).
      batch: the batch or its shapes (pytree structure; see `batch_shardings`).
      mesh_shape: the mesh the strategy was planned for, when known.
      donate: donate the params and optimizer state buffers to the step.
      compiler_options: XLA options for `jax.jit`, e.g. ``{"xla_backend_optimization_level":
        0}`` to compile faster in tests.
      allow_spatial_convolutions: see `constrained_loss`.
      partitioner: ``"shardy"`` (jax's default), ``"gspmd"``, or ``"auto"``: Shardy, unless
        spatially split convolutions are allowed and present (GSPMD gets some of those right).

    Returns:
      ``(step, shardings)``. The step is a `PartitionedStep`: called, lowered and compiled
      under its partitioner; ``step.lower(...)`` works as for `jax.jit`. Put the step's inputs
      on their shardings first (`device_put_global`). ``step.value_and_grad`` is the step's
      loss and gradients alone (`sharded_value_and_grad`), compiled only when called.

    Raises:
      PlanError: see `validate_strategy`; raised before anything is compiled. A pipelined
        strategy also for a graph `soapjax.apply._pipelined` cannot run: one that draws random bits
        (dropout), has no layer scan (or several), or whose layers do not divide into S x v
        chunks.
    """
    check = checked(graph, strategy, mesh, mesh_shape)
    chosen = _choose_partitioner(check, partitioner)
    shardings = train_shardings(graph, check, mesh, optimizer, params=params, batch=batch)
    value_and_grad = _value_and_grad(check, shardings, allow_spatial_convolutions)

    def step(params, opt_state, batch, count):
        loss, grads = value_and_grad(params, batch, count)
        read = params if shardings.update_params is None else \
            jax.lax.with_sharding_constraint(params, shardings.update_params)
        updates, opt_state = optimizer.update(grads, opt_state, read)
        if shardings.whole_updates:
            # computed where the gradient was put, so the partitioner does not split an
            # update's matrix products after the parameters' sharding
            updates = jax.lax.with_sharding_constraint(updates, shardings.grads)
        return optax.apply_updates(params, updates), opt_state, loss

    options = dict(compiler_options) if compiler_options else None
    jitted = jax.jit(step, in_shardings=(shardings.params, shardings.opt_state, shardings.batch,
                                         shardings.loss),
                     out_shardings=(shardings.params, shardings.opt_state, shardings.loss),
                     donate_argnums=(0, 1) if donate else (), compiler_options=options)
    guard = _guard(check)
    partitioned = PartitionedStep(jitted, chosen, guard=guard, mesh=shardings.loss.mesh)
    partitioned.chunk_ordered = chunk_ordered(check.strategy)
    partitioned.value_and_grad = _jitted_value_and_grad(value_and_grad, shardings, chosen,
                                                        options, guard)
    return partitioned, shardings


def sharded_value_and_grad(graph: OpGraph, strategy: Any, mesh: Mesh, *, params: Any = None,
                           batch: Any = None, mesh_shape: MeshShape | None = None,
                           compiler_options: Mapping[str, Any] | None = None,
                           allow_spatial_convolutions: bool = False,
                           partitioner: Partitioner = "auto"
                           ) -> tuple[PartitionedStep, TrainShardings]:
    """A jitted ``value_and_grad(params, batch[, step]) -> (loss, grads)``: the loss and the
    gradients `sharded_train_step` computes and hands its optimizer, on their shardings (the
    gradients as the step constrains them), so they can be held against ``jax.grad`` of the
    unsharded loss (`soapjax.exactness`). Arguments as for `sharded_train_step`; the returned
    shardings' ``opt_state`` is for no optimizer (an empty state).
    """
    check = checked(graph, strategy, mesh, mesh_shape)
    chosen = _choose_partitioner(check, partitioner)
    shardings = train_shardings(graph, check, mesh, optax.identity(), params=params, batch=batch)
    value_and_grad = _value_and_grad(check, shardings, allow_spatial_convolutions)
    return _jitted_value_and_grad(value_and_grad, shardings, chosen,
                                  dict(compiler_options) if compiler_options else None,
                                  _guard(check)), shardings


def _jitted_value_and_grad(value_and_grad: Callable, shardings: TrainShardings,
                           partitioner: Literal["shardy", "gspmd"],
                           options: dict[str, Any] | None,
                           guard: Callable[[str], None] | None) -> PartitionedStep:
    jitted = jax.jit(value_and_grad,
                     in_shardings=(shardings.params, shardings.batch, shardings.loss),
                     out_shardings=(shardings.loss, shardings.grads), compiler_options=options)
    return PartitionedStep(jitted, partitioner, arity=3, guard=guard,
                           mesh=shardings.loss.mesh)


def _guard(check: Checked) -> Callable[[str], None] | None:
    """What the compiled step is checked by before it first runs: a pipelined step's program
    for collectives inside a stage's own action (`soapjax.apply._pipelined.check_compiled`)."""
    return check_compiled if check.strategy.pipelined else None


def _value_and_grad(check: Checked, shardings: TrainShardings, allow_spatial: bool
                    ) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """The step program's ``(params, batch, step) -> (loss, grads)``, the gradients
    constrained where the step's optimizer reads them (`TrainShardings.grads`)."""
    value_and_grad = step_program(check).value_and_grad(
        shardings.params, shardings.batch, allow_spatial_convolutions=allow_spatial)

    def constrained(params, batch, count):
        loss, grads = value_and_grad(params, batch, count)
        return loss, jax.lax.with_sharding_constraint(grads, shardings.grads)

    return constrained


Partitioner = Literal["auto", "shardy", "gspmd"]


class PartitionedStep:
    """A jitted function that is traced, lowered, compiled and run under one SPMD partitioner.

    Attributes:
      partitioner: ``"shardy"`` or ``"gspmd"``.
      jitted: the `jax.jit` function.
      value_and_grad: a training step's loss and gradients alone, ``(params, batch[, step])
        -> (loss, grads)`` (`sharded_train_step`); None otherwise.
      chunk_ordered: whether the step takes and returns stacked layer parameters (and their
        optimizer state) in an interleaved pipeline's chunk order (`ChunkOrdered` leaves).
    """

    def __init__(self, jitted: Callable, partitioner: Literal["shardy", "gspmd"],
                 arity: int = 4, guard: Callable[[str], None] | None = None,
                 mesh: Mesh | None = None):
        self.jitted = jitted
        self.partitioner = partitioner
        self.mesh = mesh
        self._arity = arity
        self._guard = guard
        self._compiled: Any = None
        self.value_and_grad: PartitionedStep | None = None
        self.chunk_ordered = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = _with_step(args, self._arity)
        with _use_shardy(self.partitioner == "shardy"), _in_mesh(self.mesh):
            if self._guard is None or kwargs:
                return self.jitted(*args, **kwargs)
            if self._compiled is None:  # compiled once, its program checked before it runs
                self._compiled = self.lower(*args).compile()
            return self._compiled(*args)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """`jax.jit(...).lower`; the result's ``compile()`` uses the same partitioner (and
        checks the compiled program, where the step has a guard: a pipelined one's)."""
        with _use_shardy(self.partitioner == "shardy"), _in_mesh(self.mesh):
            return _Lowered(self.jitted.lower(*_with_step(args, self._arity), **kwargs),
                            self.partitioner, self._guard)

    def __repr__(self) -> str:
        return f"PartitionedStep({self.jitted!r}, partitioner={self.partitioner!r})"


def _in_mesh(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """`mesh` as jax's context mesh (`jax.set_mesh`) while a step runs, whatever the caller's:
    under a user's ``with jax.set_mesh(their_mesh)`` (MaxText-style code), a jitted function
    whose shardings name another mesh, or the same devices in another order, is refused
    ("Received incompatible devices for jitted computation"). None: the caller's context.
    Called under a trace (the step inside the caller's ``jax.jit`` or ``jax.eval_shape``), the
    context is the outermost call's, and jax refuses to set it there: left as it is."""
    if mesh is None:
        return contextlib.nullcontext()
    try:
        return jax.set_mesh(mesh)
    except ValueError as e:  # "`set_mesh` can only be used outside of `jax.jit`"
        if "outside of" not in str(e):
            raise
        return contextlib.nullcontext()


def _with_step(args: tuple, arity: int) -> tuple:
    """``(params, opt_state, batch)`` (or ``(params, batch)``) -> with step number 0 (the
    traced keys, unchanged)."""
    return (*args, np.int32(0)) if len(args) == arity - 1 else args


class _Lowered:
    def __init__(self, lowered: Any, partitioner: str, guard: Callable[[str], None] | None):
        self._lowered, self._partitioner, self._guard = lowered, partitioner, guard

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        with _use_shardy(self._partitioner == "shardy"):
            compiled = self._lowered.compile(*args, **kwargs)
        if self._guard is not None:
            self._guard(compiled.as_text())
        return compiled

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)


def _choose_partitioner(check: Checked, partitioner: str) -> Literal["shardy", "gspmd"]:
    if partitioner in ("shardy", "gspmd"):
        return partitioner
    if partitioner != "auto":
        raise PlanError(f"unknown partitioner {partitioner!r}; expected 'auto', 'shardy' or "
                        "'gspmd'")
    return "gspmd" if check.spatial is not None else "shardy"


def _use_shardy(enabled: bool) -> Any:
    """A scope for ``jax_use_shardy_partitioner`` (part of jit's cache key)."""
    state = getattr(_jax_config, "use_shardy_partitioner", None)
    return contextlib.nullcontext() if state is None else state(enabled)


def collectives_as_run(collectives: Sequence[Any], strategy: Any) -> list[Any]:
    """The compiled step's collectives (`soapjax.measure.hlo.collectives` of its HLO) with
    the executions one step runs: a pipelined step's collectives inside a branch of its
    schedule's switches as often as the schedule takes the branch
    (`soapjax.apply._pipelined.count_branch_runs`; HLO's loop count says every tick), summed
    over the stages as the simulator prices one stage's devices running the whole model. A
    flat step's are as they are."""
    if not getattr(strategy, "pipelined", False):
        return list(collectives)
    return count_branch_runs(collectives, branch_runs(
        strategy.schedule, strategy.stages, strategy.microbatches, strategy.virtual_stages))


def device_put_global(tree: Any, shardings: Any) -> Any:
    """`jax.device_put` that also builds arrays spanning several processes.

    Within one process it is `jax.device_put` of a host copy (never an alias of `tree`'s
    buffers, so a step that donates its inputs leaves `tree` intact). When a sharding has
    devices of other processes, every process must hold the same global value; each builds its
    own shards with
    `jax.make_array_from_callback`. (For data that differs per process, use
    `jax.make_array_from_process_local_data`.)

    Where `shardings` keeps stacked layer parameters in chunk order (an interleaved
    pipeline's `TrainShardings`: `ChunkOrdered` nodes) and `tree` is in the model's layout,
    those leaves are put in chunk order first (`step_layout`); `model_layout` undoes it.

    Args:
      tree: a pytree of arrays (host or device).
      shardings: a pytree like `tree` of `NamedSharding`s (or one sharding for all).
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    tree = step_layout(tree, shardings)  # stacked layers in chunk order where the step keeps so

    def put(x, sharding):
        if sharding.is_fully_addressable:
            # Through host memory: device_put of a one-device array onto a replicated sharding
            # reuses its buffer (even with may_alias=False), and a donating step would delete it.
            return jax.device_put(np.asarray(x) if isinstance(x, jax.Array) else x, sharding)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            with _in_mesh(getattr(sharding, "mesh", None)):
                return jax.jit(lambda a: a, out_shardings=sharding)(x)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)
