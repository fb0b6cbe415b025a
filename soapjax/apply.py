"""Apply: a strategy becomes `NamedSharding`s and sharding constraints under `jax.jit`.

The traced forward pass is re-evaluated equation by equation inside `jax.jit`
(`OpGraph.evaluate`), and every operator output gets
``jax.lax.with_sharding_constraint(value, NamedSharding(mesh, config.output_spec(op, k)))``;
an operator whose equations run together (`OpGraph.replaceable`: most of them) is computed by
its own program (`soapjax._local.operator_fn`) with its operands constrained to the specs its
config gives them too, and the operands of the others (a loss interleaved with its labels'
preprocessing) are constrained where their equations read them. No model code changes;
autodiff carries the constraints to the backward pass, and XLA's SPMD partitioner inserts the
collectives. Parameters, optimizer state and the batch enter and leave
the jitted step with the shardings that follow from the configs:

* a parameter takes the operand spec of the first operator that reads it
  (``config.operand_spec(operand.dims)``), then is split further over `Strategy.zero_axes`
  (ZeRO-3), each on its largest dim that stays divisible (`soapjax.space.param_specs`, the
  same specs the simulator prices);
* optimizer state leaves that mirror a parameter take that parameter's sharding (found with
  `optax.tree_map_params`); everything else (step counts, scalars) is replicated;
* a batch leaf takes the operand spec of its first consumer.

Example (a Dense layer ``fc1`` reads a kernel f32[16, 32]; mesh ``data=2, model=4``)::

    config of fc1:    Config((("data",), ("model",), ()))    # [S:data, P:model | R:-]
    kernel operand:   dims (2, 1)                             # in -> R dim, out -> P dim
    kernel spec:      PartitionSpec(None, 'model')
    with zero_axes=("data",):  PartitionSpec('data', 'model')  # shard 16/1 beats 32/4

Usage::

    graph = soapjax.graph.trace(w.loss_fn, params, batch)
    strategy = soapjax.space.data_parallel(graph, MeshShape.of(mesh))
    step, shardings = sharded_train_step(graph, strategy, mesh, optimizer, params=params)
    params, opt_state = device_put_global((params, opt_state),
                                          (shardings.params, shardings.opt_state))
    params, opt_state, loss = step(params, opt_state, device_put_global(batch, shardings.batch))

**Pipelined strategies** (`Strategy.pipelined`: S stages, v virtual stages, a schedule) run
through `sharded_train_step` as one SPMD program (`soapjax._pipelined`) on the user's mesh
reshaped: its outermost axis of size n becomes ``stage`` (S) x that axis (n / S, dropped at 1),
e.g. ``node=2, data=2, model=2`` -> ``stage=2, data=2, model=2``. The configs are over one
stage's mesh, the parameters keep the model's layout with each stacked layer parameter split
over ``stage`` on its layer dim (`train_shardings`), and the step keeps its interface.

Every function takes a `Strategy` or a plan (`soapjax.plan.Plan`: its ``strategy(graph)``
checks the plan was made for the graph, and its ``mesh`` is checked against the mesh).
Everything is validated before anything is compiled (`validate_strategy`); mistakes raise
`PlanError`. Strategies that split convolutions spatially are refused too: XLA computes them
wrongly (see `constrained_loss`).

The stage is three modules, re-exported here: the validation (`soapjax._validation`), the
shardings of parameters, optimizer state and batch (`soapjax._shardings`), and this one, the
constrained loss and the jitted step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src import config as _jax_config  # the scoped partitioner switch has no public home
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from soapjax import space
from soapjax._local import draws_random_bits, has_custom_rules, operator_fn
from soapjax._pipelined import train_value_and_grad
from soapjax._shardings import (
    TrainShardings,
    batch_shardings,
    checked,
    opt_state_shardings,
    param_shardings,
    train_shardings,
)
from soapjax._validation import (
    Checked,
    refuse_spatial_convolutions,
    validate_leaves,
    validate_program_inputs,
    validate_strategy,
)
from soapjax.errors import PlanError
from soapjax.graph import OpGraph
from soapjax.memory import Segments, recomputes
from soapjax.space import Config, MeshShape, Strategy, strategy_from_names

__all__ = [
    "Checked",
    "PartitionedStep",
    "Partitioner",
    "TrainShardings",
    "batch_shardings",
    "constrained_loss",
    "device_put_global",
    "opt_state_shardings",
    "param_shardings",
    "recompute_segments",
    "sharded_train_step",
    "strategy_from_names",
    "train_shardings",
    "validate_strategy",
]


# --- the constrained loss -----------------------------------------------------------------------


def constrained_loss(graph: OpGraph, strategy: Any, mesh: Mesh, *,
                     mesh_shape: MeshShape | None = None,
                     allow_spatial_convolutions: bool = False,
                     constrain_operands: bool = True) -> Callable[[Any, Any], jax.Array]:
    """The traced loss with the strategy's sharding constraint on every operator output.

    Call the result inside your own jitted step (``jax.value_and_grad`` of it gives gradients
    whose backward pass follows the same shardings).

    Strategies that split a convolution's spatial dims are refused: XLA's SPMD partitioner (jax
    0.10.2) computes such convolutions wrongly. With Shardy, jax's default, a convolution whose
    output is split over height or width loses part of its kernel gradient (and with the
    channels split too, its forward result); with either partitioner, one whose input arrives
    split spatially while its kernel is split over input channels computes a wrong forward
    result. Plan convolutions without attribute splits (`SpaceLimits(allow_attribute=False)`).

    Args:
      graph: the traced graph of ``loss_fn(params, batch)``.
      strategy: a `Strategy` or plan (see `validate_strategy`).
      mesh: the mesh, with Auto axes.
      mesh_shape: the mesh the strategy was planned for, when known.
      allow_spatial_convolutions: apply a strategy that splits convolutions spatially anyway
        (to check whether a newer XLA computes it correctly).
      constrain_operands: constrain every operator's operands to the specs its config gives
        them too (the layouts the simulator reshards them to): inside its own program for an
        operator computed at once (`OpGraph.replaceable`), where its equations read them for
        the others (a dim that does not divide by its axes is left alone). Without these XLA
        chooses how to move an operator's operands itself: for a convolution that splits its
        input channels it often gathers the kernel instead of reducing partial sums (AlexNet
        tiny's searched plan: 89 KB where the plan says 50 KB); for a cross-entropy whose
        vocabulary arrives split it reduces over the split vocabulary instead of the
        all-to-all the plan makes (rnnlm tiny: 11 collectives over all three axis sets where
        the plan has 5 over `data`, 6.4 ms where it runs in 4.3).

    Returns:
      ``loss(params, batch, step=None) -> scalar``; params and batch must have the traced
      leaves. With ``step`` (an int32 scalar, the training step's number), every PRNG key the
      program makes from constants (dropout's) is folded with it (`step_keys`): step 0 computes
      exactly the traced function, later steps draw fresh masks.

    Raises:
      PlanError: see `validate_strategy`; a convolution split spatially; and, when called, leaves
        that differ from the traced ones.
    """
    check = checked(graph, strategy, mesh, mesh_shape)
    strategy = check.strategy
    if strategy.pipelined:
        raise PlanError(f"the strategy has {strategy.stages} pipeline stages, and "
                        "constrained_loss is one SPMD loss without stages; run a pipelined "
                        "strategy with sharded_train_step (or training.shard_training)")
    if not allow_spatial_convolutions:
        refuse_spatial_convolutions(check)
    validate_program_inputs(graph)
    out_shardings = {
        op.name: [NamedSharding(mesh, cfg.output_spec(op, k)) for k in range(len(op.outputs))]
        for op, cfg in zip(graph.operators, strategy.configs)
    }

    def constrain(op, k, value):
        return jax.lax.with_sharding_constraint(value, out_shardings[op.name][k])

    in_shardings = {
        op.name: [_operand_sharding(mesh, cfg, o) for o in op.inputs]
        for op, cfg in zip(graph.operators, strategy.configs)
    } if constrain_operands else {}

    def constrain_input(op, o, value):
        sharding = in_shardings[op.name][o]
        return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)

    grouped = _operator_programs(graph, strategy, mesh, constrain_operands)
    checkpoints = recompute_segments(graph, strategy)

    # Operators that make keys from constants run equation by equation when keys advance.
    keyless = {name: fn for name, fn in grouped.items() if not graph.makes_keys(name)}

    def loss(params: Any, batch: Any, step: Any = None) -> jax.Array:
        flat_params, flat_batch = jax.tree.leaves(params), jax.tree.leaves(batch)
        validate_leaves(graph.params, flat_params, "params")
        validate_leaves(graph.batch, flat_batch, "batch")
        keys = None if step is None else functools.partial(step_keys, step=step)
        return graph.evaluate(*flat_params, *flat_batch, on_output=constrain,
                              replace=grouped if keys is None else keyless,
                              checkpoints=checkpoints, keys=keys,
                              on_input=constrain_input if constrain_operands else None)

    return loss


def step_keys(key: jax.Array, *, step: jax.Array) -> jax.Array:
    """`key` (any shape of typed keys) for training step `step`: itself at step 0, else each
    key folded with the step number, so every step draws fresh, independent random bits."""
    flat = key.reshape(-1)
    folded = jax.vmap(lambda k: jax.random.fold_in(k, step))(flat)
    data = jnp.where(step == 0, jax.random.key_data(flat), jax.random.key_data(folded))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key)).reshape(key.shape)


def recompute_segments(graph: OpGraph, strategy: Strategy) -> list[list[str]]:
    """The operators that recompute, as `soapjax.memory` segments (names in graph order):
    each runs inside one ``jax.checkpoint`` that saves nothing, so what crosses its border is
    kept and what stays inside is recomputed, as the simulator prices it."""
    flags = [recomputes(op, strategy.recompute_of(j)) for j, op in enumerate(graph.operators)]
    out: dict[int, list[str]] = {}
    for j, first in enumerate(Segments(graph).segments(flags)):
        if first >= 0:
            out.setdefault(first, []).append(graph.operators[j].name)
    return list(out.values())


def _operator_programs(graph: OpGraph, strategy: Strategy, mesh: Mesh,
                       constrain_operands: bool) -> dict[str, Callable]:
    """Operator name -> the program that computes it at once, for every operator whose
    equations run together (`OpGraph.replaceable`): a loop split over its batch per group of
    samples (`_grouped_loop`), any other its own program (`soapjax._local.operator_fn`); with
    `constrain_operands`, its operands constrained to the specs its config gives them."""
    programs = {}
    for op, cfg in zip(graph.operators, strategy.configs):
        if not graph.replaceable(op.name):
            continue
        fn = _grouped_loop(graph, op, cfg, mesh) or operator_fn(graph, op.name)[0]
        if constrain_operands:
            fn = _with_operand_constraints(
                fn, [NamedSharding(mesh, cfg.operand_spec(o.dims)) for o in op.inputs])
        programs[op.name] = fn
    return programs


def _operand_sharding(mesh: Mesh, cfg: Config, operand: Any) -> NamedSharding | None:
    """The sharding `cfg` gives `operand`, or None where a dim does not divide by its axes
    (a dim that follows an iteration dim at another extent: XLA would pad it)."""
    shape = MeshShape.of(mesh)
    axes = cfg.operand_axes(operand.dims)
    if any(size % shape.degree(ax) for size, ax in zip(operand.shape, axes)):
        return None
    return NamedSharding(mesh, cfg.operand_spec(operand.dims))


def _with_operand_constraints(fn: Callable, shardings: Sequence[NamedSharding]) -> Callable:
    def run(*operands):
        return fn(*(jax.lax.with_sharding_constraint(x, s) for x, s in zip(operands, shardings)))
    return run


def _grouped_loop(graph: OpGraph, op: Any, cfg: Config, mesh: Mesh) -> Callable | None:
    """A loop operator split over its batch, computed as one group of samples per device
    group: ``vmap`` of its shard program over a leading group dim split like the batch, with
    its parameters broadcast along that dim.

    Evaluated as traced, a scan whose batch is split makes XLA (both partitioners, jax 0.10.2)
    all-reduce the gradient of every parameter the loop reads inside the backward loop, once
    per step: T times the bytes of one gradient synchronisation (rnnlm tiny: 549 KB where data
    parallelism needs 83 KB). With a group dim the gradient comes out per group, summed over the
    groups once after the loop: one all-reduce, as the simulator prices it. The result is the
    same function (float32 rounding aside). None where this does not apply: not a loop, batch
    not split, no parameters read, an output without the batch dim, equations interleaved with
    other operators', constants that carry the batch, a custom derivative rule inside (it
    was traced for the whole batch and cannot be re-bound per group), or random bits drawn
    inside (dropout: drawn per group, the masks would differ from the traced program's).
    """
    d = space.sample_dim(op)
    if not op.is_loop or d is None or d >= len(cfg.axes) or not cfg.axes[d]:
        return None
    if not any(o.kind == "param" for o in op.inputs) or not graph.replaceable(op.name):
        return None
    if has_custom_rules(graph, op.name) or draws_random_bits(graph, op.name):
        return None  # rules traced for the whole batch; random bits drawn at the whole shape
    out_pos = [t.dims.index(d) if d in t.dims else None for t in op.outputs]
    if None in out_pos or any(o.kind == "const" and d in o.dims for o in op.inputs):
        return None
    axes = tuple(cfg.axes[d])
    groups = int(np.prod([mesh.shape[a] for a in axes]))
    degrees = [1] * len(op.iteration_sizes)
    degrees[d] = groups
    shard_fn, _ = operator_fn(graph, op.name, degrees)
    in_pos = [o.dims.index(d) if d in o.dims else None for o in op.inputs]
    by_group = NamedSharding(mesh, PartitionSpec(axes))

    def split(x, p):
        if p is None:
            x = jax.numpy.broadcast_to(x, (groups, *x.shape))
        else:
            x = x.reshape(*x.shape[:p], groups, x.shape[p] // groups, *x.shape[p + 1:])
            x = jax.numpy.moveaxis(x, p, 0)
        return jax.lax.with_sharding_constraint(x, by_group)

    def merge(y, p):
        y = jax.numpy.moveaxis(y, 0, p)
        return y.reshape(*y.shape[:p], y.shape[p] * y.shape[p + 1], *y.shape[p + 2:])

    def run(*operands):
        outs = jax.vmap(lambda *xs: list(shard_fn(*xs)))(
            *(split(x, p) for x, p in zip(operands, in_pos)))
        return [merge(y, p) for y, p in zip(outs, out_pos)]

    return run


# --- the sharded train step ---------------------------------------------------------------------


def sharded_train_step(graph: OpGraph, strategy: Any, mesh: Mesh,
                       optimizer: optax.GradientTransformation, *, params: Any = None,
                       batch: Any = None, mesh_shape: MeshShape | None = None,
                       donate: bool = True, compiler_options: Mapping[str, Any] | None = None,
                       allow_spatial_convolutions: bool = False,
                       partitioner: Partitioner = "auto") -> tuple[PartitionedStep, TrainShardings]:
    """A jitted ``step(params, opt_state, batch[, step]) -> (params, opt_state, loss)``.

    The step is ``jax.value_and_grad`` of `constrained_loss`, gradients constrained to the
    parameters' shardings (with ZeRO axes this is a reduce-scatter), ``optimizer.update`` and
    ``optax.apply_updates``, jitted with `TrainShardings` as in/out shardings. ``step``, the
    training step's number (an int32 scalar; default 0), advances the PRNG keys the loss makes
    from constants (`step_keys`): pass a new number every step for fresh dropout masks
    (`training.ShardedTraining.step` counts for you); step 0 computes the traced function.

    A pipelined strategy (`Strategy.pipelined`) runs on `mesh` with its outermost axis cut
    into a ``stage`` axis (`soapjax._pipelined.pipelined_mesh`; the shardings are on that
    mesh). Inside the step the parameters are reshaped to the pipelined layout
    (`soapjax._pipelined.to_pipelined`), ``pipelined_value_and_grad`` runs the strategy's
    schedule over M = ``strategy.microbatches`` microbatches, and the gradients are reshaped
    back, so the optimizer updates the model's layout. The layers recompute as
    `soapjax._pipelined.layer_recompute` says: in full from each chunk's input if a layer
    operator's policy is ``"full"``, keeping matmul outputs only if one is ``"selective"``.
    With 1F1B the model layout's stage split is each stage's chunk, so nothing moves but the
    pipeline's sends; with v > 1 virtual stages a stage's chunks are not one run of layers,
    and the parameters and gradients move between stages (all-to-alls) at the reshapes.

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
      on their shardings first (`device_put_global`).

    Raises:
      PlanError: see `validate_strategy`; raised before anything is compiled. A pipelined
        strategy also for a graph `soapjax._pipelined` cannot run: one that draws random bits
        (dropout), has no layer scan (or several), or whose layers do not divide into S x v
        chunks.
    """
    check = checked(graph, strategy, mesh, mesh_shape)
    strategy = check.strategy
    chosen = _choose_partitioner(check, partitioner)
    shardings = train_shardings(graph, check, mesh, optimizer, params=params, batch=batch)
    if strategy.pipelined:
        validate_program_inputs(graph)
        pipelined = train_value_and_grad(graph, strategy, shardings.loss.mesh,
                                         shardings.params)

        def value_and_grad(params, batch, count):
            del count  # a pipelined graph draws no random bits (validate_strategy)
            return pipelined(params, batch)
    else:
        value_and_grad = _value_and_grad(graph, check, mesh, shardings,
                                         allow_spatial_convolutions)

    def step(params, opt_state, batch, count):
        loss, grads = value_and_grad(params, batch, count)
        grads = jax.lax.with_sharding_constraint(grads, shardings.params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, in_shardings=(shardings.params, shardings.opt_state, shardings.batch,
                                         shardings.loss),
                     out_shardings=(shardings.params, shardings.opt_state, shardings.loss),
                     donate_argnums=(0, 1) if donate else (),
                     compiler_options=dict(compiler_options) if compiler_options else None)
    return PartitionedStep(jitted, chosen), shardings


def _value_and_grad(graph: OpGraph, check: Checked, mesh: Mesh, shardings: TrainShardings,
                    allow_spatial_convolutions: bool) -> Callable:
    """``(params, batch, step) -> (loss, grads)`` of the constrained loss (its PRNG keys
    advanced by the step number: `step_keys`); with M microbatches
    (`Strategy.microbatches`), the graph traced again at batch / M (same operator names, so
    the same configs), ``value_and_grad`` of it over the M microbatches in a ``lax.scan``,
    losses and gradients summed and divided by M: the mean over the whole batch, for a loss
    that is a mean over its samples (as the zoo's are). Microbatch k holds samples k, k + M,
    k + 2M, ...: each device splits its own shard, no data moves (a graph that draws random
    bits keeps M = 1, `soapjax.memory.random_operator`, so no keys to advance there)."""
    strategy, m = check.strategy, check.strategy.microbatches
    if m == 1:
        return jax.value_and_grad(constrained_loss(
            graph, check, mesh, allow_spatial_convolutions=allow_spatial_convolutions))
    micro = graph.at_batch_size(graph.batch_size // m)
    names = [op.name for op in graph.operators]
    if [op.name for op in micro.operators] != names:
        raise PlanError(f"graph {graph.name!r} traced at batch {micro.batch_size} has other "
                        f"operators than at {graph.batch_size}; microbatches need the same "
                        "operators at both sizes: plan with microbatches=1")
    loss_fn = constrained_loss(micro, Strategy(strategy.configs, strategy.zero_axes, 1,
                                               strategy.recompute), mesh,
                               allow_spatial_convolutions=allow_spatial_convolutions)
    grad_fn = jax.value_and_grad(loss_fn)

    def split(x, sharding):
        y = jax.numpy.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)
        spec = PartitionSpec(None, *sharding.spec)
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))

    def value_and_grad(params, batch, step=None):
        del step  # no random bits: see above
        micro_batches = jax.tree.map(split, batch, shardings.batch)

        def body(carry, mb):
            loss, grads = grad_fn(params, mb)
            return jax.tree.map(jax.numpy.add, carry, (loss, grads)), None

        first = jax.tree.map(lambda x: x[0], micro_batches)
        zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype),
                             jax.eval_shape(grad_fn, params, first))
        total, _ = jax.lax.scan(body, zeros, micro_batches)
        return jax.tree.map(lambda x: x / m, total)

    return value_and_grad


Partitioner = Literal["auto", "shardy", "gspmd"]


class PartitionedStep:
    """A jitted function that is traced, lowered, compiled and run under one SPMD partitioner.

    Attributes:
      partitioner: ``"shardy"`` or ``"gspmd"``.
      jitted: the `jax.jit` function.
    """

    def __init__(self, jitted: Callable, partitioner: Literal["shardy", "gspmd"]):
        self.jitted = jitted
        self.partitioner = partitioner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _use_shardy(self.partitioner == "shardy"):
            return self.jitted(*_with_step(args), **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """`jax.jit(...).lower`; the result's ``compile()`` uses the same partitioner."""
        with _use_shardy(self.partitioner == "shardy"):
            return _Lowered(self.jitted.lower(*_with_step(args), **kwargs), self.partitioner)

    def __repr__(self) -> str:
        return f"PartitionedStep({self.jitted!r}, partitioner={self.partitioner!r})"


def _with_step(args: tuple) -> tuple:
    """``(params, opt_state, batch)`` -> with step number 0 (the traced keys, unchanged)."""
    return (*args, np.int32(0)) if len(args) == 3 else args


class _Lowered:
    def __init__(self, lowered: Any, partitioner: str):
        self._lowered, self._partitioner = lowered, partitioner

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        with _use_shardy(self._partitioner == "shardy"):
            return self._lowered.compile(*args, **kwargs)

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


def device_put_global(tree: Any, shardings: Any) -> Any:
    """`jax.device_put` that also builds arrays spanning several processes.

    Within one process it is `jax.device_put` of a host copy (never an alias of `tree`'s
    buffers, so a step that donates its inputs leaves `tree` intact). When a sharding has
    devices of other processes, every process must hold the same global value; each builds its
    own shards with
    `jax.make_array_from_callback`. (For data that differs per process, use
    `jax.make_array_from_process_local_data`.)

    Args:
      tree: a pytree of arrays (host or device).
      shardings: a pytree like `tree` of `NamedSharding`s (or one sharding for all).
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def put(x, sharding):
        if sharding.is_fully_addressable:
            # Through host memory: device_put of a one-device array onto a replicated sharding
            # reuses its buffer (even with may_alias=False), and a donating step would delete it.
            return jax.device_put(np.asarray(x) if isinstance(x, jax.Array) else x, sharding)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.jit(lambda a: a, out_shardings=sharding)(x)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)
