"""Apply: a strategy becomes `NamedSharding`s and sharding constraints under `jax.jit`.

The traced forward pass is re-evaluated equation by equation inside `jax.jit`
(`OpGraph.evaluate`), and every operator output gets
``jax.lax.with_sharding_constraint(value, NamedSharding(mesh, config.output_spec(op, k)))``;
an operator whose equations run together (`OpGraph.replaceable`: most of them) is computed by
its own program (`soapjax._local.operator_fn`) with its operands constrained to the specs its
config gives them too. No model code changes; autodiff carries the constraints to the backward pass, and XLA's SPMD
partitioner inserts the collectives. Parameters, optimizer state and the batch enter and leave
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

Every function takes a `Strategy` or a plan (`soapjax.plan.Plan`: its ``strategy(graph)``
checks the plan was made for the graph, and its ``mesh`` is checked against the mesh).
Everything is validated before anything is compiled; mistakes raise `PlanError`. Strategies
that split convolutions spatially are refused too: XLA computes them wrongly (see
`constrained_loss`).
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
import optax
from jax._src import config as _jax_config  # the scoped partitioner switch has no public home
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from soapjax import space
from soapjax._local import draws_random_bits, has_custom_rules, operator_fn
from soapjax.errors import PlanError
from soapjax.graph import LeafInfo, OpGraph
from soapjax.space import Config, MeshShape, Strategy

__all__ = [
    "PartitionedStep",
    "Partitioner",
    "TrainShardings",
    "batch_shardings",
    "check_strategy",
    "constrained_loss",
    "device_put_global",
    "opt_state_shardings",
    "param_shardings",
    "sharded_train_step",
    "strategy_from_names",
    "train_shardings",
]


class TrainShardings(NamedTuple):
    """The shardings a sharded train step takes and returns.

    Attributes:
      params: a pytree like the parameters, of `NamedSharding`s.
      opt_state: a pytree like the optimizer state, of `NamedSharding`s.
      batch: a pytree like the batch, of `NamedSharding`s.
      loss: the loss's sharding (replicated).
    """

    params: Any
    opt_state: Any
    batch: Any
    loss: NamedSharding


# --- validation ---------------------------------------------------------------------------------


def check_strategy(graph: OpGraph, strategy: Any, mesh: Mesh, *,
                   mesh_shape: MeshShape | None = None) -> Strategy:
    """Checks that `strategy` fits `graph` and `mesh`; returns it as a `Strategy`.

    Args:
      graph: the traced operator graph.
      strategy: a `Strategy`, or a plan: an object whose ``strategy`` is a `Strategy` or a
        method ``strategy(graph)`` (`soapjax.plan.Plan`), and whose ``mesh`` or ``mesh_shape``,
        if a `MeshShape`, is the mesh it was planned for.
      mesh: the `jax.sharding.Mesh` to apply it on; its axes must be `AxisType.Auto`.
      mesh_shape: the mesh the strategy was planned for, when known (a plan carries it).

    Returns:
      The strategy.

    Raises:
      PlanError: the plan was made for another graph; the mesh differs from the planned one
        (axis names, sizes, device count) or has Explicit axes; or the strategy's configs do
        not match the graph's operators (count, rank, unknown mesh axes, degrees that do not
        divide a dim).
    """
    strategy, planned = _unwrap(strategy, graph)
    actual = _check_mesh(mesh, mesh_shape or planned)
    _check_configs(graph, strategy, actual)
    return strategy


def _check_mesh(mesh: Mesh, planned: MeshShape | None) -> MeshShape:
    if not isinstance(mesh, Mesh):
        raise PlanError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}; build one "
                        "with soapjax.topology.make_mesh(load_topology(...))")
    actual = MeshShape.of(mesh)
    if planned is not None and actual != planned:
        raise PlanError(f"the strategy was planned for mesh {_fmt_mesh(planned)} "
                        f"({planned.num_devices} devices), but the mesh is "
                        f"{_fmt_mesh(actual)} ({actual.num_devices} devices); build the mesh "
                        "from the topology the strategy was planned for")
    explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Auto]
    if explicit:
        raise PlanError(f"mesh axes {explicit} are not AxisType.Auto, so sharding constraints "
                        "would act as asserts; build the mesh with jax.sharding.Mesh(devices, "
                        "names), soapjax.topology.make_mesh, or jax.make_mesh(..., "
                        "axis_types=(AxisType.Auto,) * n)")
    return actual


def _check_configs(graph: OpGraph, strategy: Strategy, mesh: MeshShape) -> None:
    n_ops, n_cfg = len(graph.operators), len(strategy.configs)
    if n_cfg != n_ops:
        raise PlanError(f"the strategy has {n_cfg} configs, but graph {graph.name!r} has {n_ops} "
                        "operators; a strategy needs one config per operator, in graph order "
                        "(was it planned for another model or config?)")
    names = set(mesh.axis_names)
    for op, cfg in zip(graph.operators, strategy.configs):
        sizes = op.iteration_sizes
        if len(cfg.axes) != len(sizes):
            raise PlanError(f"operator {op.name!r}: the config has {len(cfg.axes)} dims "
                            f"{cfg.axes}, but the operator has {len(sizes)} iteration dims "
                            f"{sizes} (roles {''.join(op.iteration_roles)})")
        unknown = sorted(cfg.used_axes - names)
        if unknown:
            raise PlanError(f"operator {op.name!r}: config {cfg.describe(op)} uses mesh axis "
                            f"{unknown[0]!r}, but the mesh has axes {mesh.axis_names}")
        for d, (axes, size) in enumerate(zip(cfg.axes, sizes)):
            degree = mesh.degree(axes)
            if size % degree:
                raise PlanError(f"operator {op.name!r}: iteration dim {d} (size {size}) is split "
                                f"over {axes} of degree {degree}, which does not divide it, on "
                                f"mesh {_fmt_mesh(mesh)}; was the strategy planned for "
                                "another mesh?")
    unknown = [a for a in strategy.zero_axes if a not in names]
    if unknown:
        raise PlanError(f"zero_axes {strategy.zero_axes} name {unknown[0]!r}, but the mesh has "
                        f"axes {mesh.axis_names}")


def _refuse_spatial_convolutions(graph: OpGraph, strategy: Strategy) -> None:
    found = _spatial_convolution(graph, strategy)
    if found is not None:
        name, why = found
        raise PlanError(
            f"convolution operator {name!r}: {why}; XLA's SPMD partitioner (jax "
            f"{jax.__version__}) computes spatially split convolutions wrongly, so soapjax "
            "refuses them. Plan convolutions without attribute splits (SpaceLimits("
            "allow_attribute=False)), or pass allow_spatial_convolutions=True to run it anyway")


def _spatial_convolution(graph: OpGraph, strategy: Strategy) -> tuple[str, str] | None:
    """(name, why) of the first convolution that splits, or receives split, a spatial dim."""
    position = {op.name: i for i, op in enumerate(graph.operators)}
    for op, cfg in zip(graph.operators, strategy.configs):
        if "conv" not in op.anchor:
            continue
        roles = op.iteration_roles
        if any(cfg.axes[d] and roles[d] == "A" for d in range(len(op.shape))):
            return op.name, f"its config {cfg.describe(op)} splits a spatial (A) dim"
        for operand in op.inputs:
            if operand.kind != "activation":
                continue
            i = position[operand.source]
            produced = graph.operators[i].outputs[operand.index].dims
            for j, (it, src) in enumerate(zip(operand.dims, produced)):
                axes = strategy.configs[i].axes[src] if src is not None else ()
                if axes and (it is None or roles[it] == "A"):
                    return op.name, (f"its input from {operand.source!r} arrives split over "
                                     f"{axes} along spatial dim {j}")
    return None


def strategy_from_names(graph: OpGraph, configs: Mapping[str, Config], *,
                        zero_axes: Sequence[str] = (), default: Strategy | None = None
                        ) -> Strategy:
    """A `Strategy` from configs keyed by operator name (as plan files store them).

    Args:
      graph: the traced operator graph.
      configs: operator name -> config.
      zero_axes: see `Strategy.zero_axes`.
      default: configs for operators `configs` leaves out; without it every operator must be
        named.

    Raises:
      PlanError: a name that is not an operator of `graph` (with close matches), or operators
        left out and no `default`.
    """
    known = [op.name for op in graph.operators]
    for name in configs:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise PlanError(f"the strategy names operator {name!r}, which graph {graph.name!r} "
                            f"does not have ({len(known)} operators: {_abbrev(known)}){hint}")
    missing = [n for n in known if n not in configs]
    if missing and default is None:
        raise PlanError(f"the strategy has no config for {len(missing)} operator(s) of graph "
                        f"{graph.name!r}: {_abbrev(missing)}; give every operator a config, or "
                        "pass default=")
    cfgs = tuple(configs[n] if n in configs else default.configs[i] for i, n in enumerate(known))
    return Strategy(cfgs, tuple(zero_axes))


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
      strategy: a `Strategy` or plan (see `check_strategy`).
      mesh: the mesh, with Auto axes.
      mesh_shape: the mesh the strategy was planned for, when known.
      allow_spatial_convolutions: apply a strategy that splits convolutions spatially anyway
        (to check whether a newer XLA computes it correctly).
      constrain_operands: constrain the operands of every operator that can be computed at
        once (`OpGraph.replaceable`) to the specs its config gives them too (the layouts the
        simulator reshards them to). Without these XLA chooses how
        to move an operator's operands itself: for a convolution that splits its input
        channels it often gathers the kernel instead of reducing partial sums, and the
        collectives then differ from what was planned (AlexNet tiny's searched plan: 89 KB
        where the plan says 50 KB).

    Returns:
      ``loss(params, batch) -> scalar``; params and batch must have the traced leaves.

    Raises:
      PlanError: see `check_strategy`; a convolution split spatially; and, when called, leaves
        that differ from the traced ones.
    """
    strategy = check_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)
    if not allow_spatial_convolutions:
        _refuse_spatial_convolutions(graph, strategy)
    _check_program_inputs(graph)
    out_shardings = {
        op.name: [NamedSharding(mesh, cfg.output_spec(op, k)) for k in range(len(op.outputs))]
        for op, cfg in zip(graph.operators, strategy.configs)
    }

    def constrain(op, k, value):
        return jax.lax.with_sharding_constraint(value, out_shardings[op.name][k])

    grouped = {}
    for op, cfg in zip(graph.operators, strategy.configs):
        if not graph.replaceable(op.name):
            continue
        fn = _grouped_loop(graph, op, cfg, mesh) or operator_fn(graph, op.name)[0]
        if constrain_operands:
            fn = _with_operand_constraints(
                fn, [NamedSharding(mesh, cfg.operand_spec(o.dims)) for o in op.inputs])
        grouped[op.name] = fn

    def loss(params: Any, batch: Any) -> jax.Array:
        flat_params, flat_batch = jax.tree.leaves(params), jax.tree.leaves(batch)
        _check_leaves(graph.params, flat_params, "params")
        _check_leaves(graph.batch, flat_batch, "batch")
        return graph.evaluate(*flat_params, *flat_batch, on_output=constrain, replace=grouped)

    return loss


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


# --- shardings of parameters, optimizer state and batch ---------------------------------------


def param_shardings(graph: OpGraph, strategy: Any, mesh: Mesh, *, params: Any = None,
                    mesh_shape: MeshShape | None = None) -> Any:
    """The `NamedSharding` of every parameter, as a pytree like the parameters.

    The specs are `soapjax.space.param_specs`, as the simulator prices them: the operand spec of
    the first operator that reads the parameter, then split over each of `strategy.zero_axes`
    it does not use yet, on its largest dim that stays divisible. Parameters no operator reads
    are replicated (and ZeRO-split). Axes whose degree does not divide a dim are dropped
    (`space.fit_spec`: jit's in and out shardings need even shards).

    Args:
      graph: the traced graph.
      strategy: a `Strategy` or plan.
      mesh: the mesh, with Auto axes.
      params: the parameters or their `jax.ShapeDtypeStruct`s, for the pytree structure;
        optional when the parameters are nested dicts with string keys (linen's layout).
      mesh_shape: the mesh the strategy was planned for, when known.

    Raises:
      PlanError: see `check_strategy`; parameters that differ from the traced ones, or none
        given for a pytree that is not nested dicts.
    """
    strategy = check_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)
    shape = MeshShape.of(mesh)
    specs = space.param_specs(graph, strategy, shape)  # what the simulator prices
    shardings = [NamedSharding(mesh, space.to_partition_spec(
                     space.fit_spec(specs[leaf.path], leaf.shape, shape)))
                 for leaf in graph.params]
    return _unflatten(graph.params, shardings, params, "params")


def batch_shardings(graph: OpGraph, strategy: Any, mesh: Mesh, *, batch: Any = None,
                    mesh_shape: MeshShape | None = None) -> Any:
    """The `NamedSharding` of every batch leaf (the operand spec of its first consumer).

    Args:
      graph: the traced graph.
      strategy: a `Strategy` or plan.
      mesh: the mesh, with Auto axes.
      batch: the batch or its `jax.ShapeDtypeStruct`s, for the pytree structure; optional for
        nested dicts with string keys.
      mesh_shape: the mesh the strategy was planned for, when known.
    """
    strategy = check_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)
    shape = MeshShape.of(mesh)
    specs = space.batch_specs(graph, strategy)
    shardings = [NamedSharding(mesh, space.to_partition_spec(
                     space.fit_spec(specs[leaf.path], leaf.shape, shape)))
                 for leaf in graph.batch]
    return _unflatten(graph.batch, shardings, batch, "batch")


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Any,
                        param_shardings: Any) -> Any:
    """The `NamedSharding` of every optimizer state leaf, as a pytree like the state.

    State that mirrors the parameters (Adam's moments, momentum) takes the parameters'
    shardings; the rest (step counts, scalars) is replicated. The mapping is
    `optax.tree_map_params`; for optimizers whose ``init`` cannot run on its placeholder (it
    inspects shapes), each state leaf whose pytree path ends with a parameter's path and has
    its shape takes that parameter's sharding. A leaf whose shape the sharding does not fit is
    replicated.

    Args:
      optimizer: the optax transformation.
      params: the parameters or their `jax.ShapeDtypeStruct`s.
      param_shardings: from `param_shardings`.

    Returns:
      A pytree like ``optimizer.init(params)``.
    """
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_params = jax.tree.map(_abstract, params)
    state = jax.eval_shape(optimizer.init, abstract_params)
    try:
        mapped = optax.tree_map_params(optimizer, lambda _, s: s, state, param_shardings,
                                       transform_non_params=lambda _: replicated)
        ok = jax.tree.structure(mapped) == jax.tree.structure(state)
    except Exception:  # noqa: BLE001  (any init that inspects its params: match by path)
        ok = False
    if not ok:
        mapped = _map_by_path(state, abstract_params, param_shardings, replicated)
    return jax.tree.map(lambda leaf, s: s if _fits(s.spec, leaf.shape, MeshShape.of(mesh))
                        else replicated, state, mapped)


def train_shardings(graph: OpGraph, strategy: Any, mesh: Mesh,
                    optimizer: optax.GradientTransformation, *, params: Any = None,
                    batch: Any = None, mesh_shape: MeshShape | None = None) -> TrainShardings:
    """The shardings of parameters, optimizer state, batch and loss (see the functions above)."""
    strategy = check_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)
    ps = param_shardings(graph, strategy, mesh, params=params)
    bs = batch_shardings(graph, strategy, mesh, batch=batch)
    abstract = params if params is not None else jax.tree.unflatten(
        jax.tree.structure(ps), [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in graph.params])
    os = opt_state_shardings(optimizer, abstract, ps)
    return TrainShardings(ps, os, bs, NamedSharding(mesh, PartitionSpec()))


# --- the sharded train step ---------------------------------------------------------------------


def sharded_train_step(graph: OpGraph, strategy: Any, mesh: Mesh,
                       optimizer: optax.GradientTransformation, *, params: Any = None,
                       batch: Any = None, mesh_shape: MeshShape | None = None,
                       donate: bool = True, compiler_options: Mapping[str, Any] | None = None,
                       allow_spatial_convolutions: bool = False,
                       partitioner: Partitioner = "auto") -> tuple[PartitionedStep, TrainShardings]:
    """A jitted ``step(params, opt_state, batch) -> (params, opt_state, loss)`` for the strategy.

    The step is ``jax.value_and_grad`` of `constrained_loss`, gradients constrained to the
    parameters' shardings (with ZeRO axes this is a reduce-scatter), ``optimizer.update`` and
    ``optax.apply_updates``, jitted with `TrainShardings` as in/out shardings.

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
      PlanError: see `check_strategy`; raised before anything is compiled.
    """
    strategy = check_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)
    loss_fn = constrained_loss(graph, strategy, mesh,
                               allow_spatial_convolutions=allow_spatial_convolutions)
    chosen = _choose_partitioner(graph, strategy, partitioner)
    shardings = train_shardings(graph, strategy, mesh, optimizer, params=params, batch=batch)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = jax.lax.with_sharding_constraint(grads, shardings.params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, in_shardings=(shardings.params, shardings.opt_state, shardings.batch),
                     out_shardings=(shardings.params, shardings.opt_state, shardings.loss),
                     donate_argnums=(0, 1) if donate else (),
                     compiler_options=dict(compiler_options) if compiler_options else None)
    return PartitionedStep(jitted, chosen), shardings


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
            return self.jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """`jax.jit(...).lower`; the result's ``compile()`` uses the same partitioner."""
        with _use_shardy(self.partitioner == "shardy"):
            return _Lowered(self.jitted.lower(*args, **kwargs), self.partitioner)

    def __repr__(self) -> str:
        return f"PartitionedStep({self.jitted!r}, partitioner={self.partitioner!r})"


class _Lowered:
    def __init__(self, lowered: Any, partitioner: str):
        self._lowered, self._partitioner = lowered, partitioner

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        with _use_shardy(self._partitioner == "shardy"):
            return self._lowered.compile(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)


def _choose_partitioner(graph: OpGraph, strategy: Strategy, partitioner: str
                        ) -> Literal["shardy", "gspmd"]:
    if partitioner in ("shardy", "gspmd"):
        return partitioner
    if partitioner != "auto":
        raise PlanError(f"unknown partitioner {partitioner!r}; expected 'auto', 'shardy' or "
                        "'gspmd'")
    return "gspmd" if _spatial_convolution(graph, strategy) is not None else "shardy"


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


# --- helpers ------------------------------------------------------------------------------------


def _unwrap(obj: Any, graph: OpGraph) -> tuple[Strategy, MeshShape | None]:
    """(strategy, the mesh it was planned for) of a Strategy or a plan (the Plan seam).

    A plan is any object with a ``strategy``: a `Strategy`, or a method ``strategy(graph)``
    that checks the plan was made for `graph` (`soapjax.plan.Plan`); its ``mesh`` or
    ``mesh_shape``, when a `MeshShape`, is the mesh it was planned for.
    """
    if isinstance(obj, Strategy):
        return obj, None
    inner = getattr(obj, "strategy", None)
    if callable(inner) and not isinstance(inner, Strategy):
        inner = inner(graph)
    if not isinstance(inner, Strategy):
        raise PlanError(f"expected a soapjax Strategy or a plan carrying one, got "
                        f"{type(obj).__name__}")
    planned = [m for m in (getattr(obj, "mesh_shape", None), getattr(obj, "mesh", None))
               if isinstance(m, MeshShape)]
    return inner, planned[0] if planned else None


def _fmt_mesh(m: MeshShape) -> str:
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(m.axis_names, m.axis_sizes)) + ")"


def _abbrev(names: Sequence[str], n: int = 6) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def _check_program_inputs(graph: OpGraph) -> None:
    want = [l.value for l in graph.params] + [l.value for l in graph.batch]
    if list(graph.program.inputs) != want:
        raise PlanError(f"graph {graph.name!r} was traced with arguments other than "
                        "(params, batch); apply needs trace(loss_fn, params, batch)")


def _check_leaves(expected: Sequence[LeafInfo], leaves: Sequence[Any], what: str) -> None:
    if len(leaves) != len(expected):
        raise PlanError(f"{what} has {len(leaves)} leaves, but the graph was traced with "
                        f"{len(expected)}")
    for info, leaf in zip(expected, leaves):
        if tuple(np.shape(leaf)) != info.shape:
            raise PlanError(f"{what} leaf {info.path} has shape {tuple(np.shape(leaf))}, but the "
                            f"graph was traced with {info.shape}")


def _spec_axes(spec: PartitionSpec) -> list[tuple[str, ...]]:
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def _fits(spec: PartitionSpec, shape: tuple[int, ...], mesh: MeshShape) -> bool:
    axes = _spec_axes(spec)
    return len(axes) <= len(shape) and all(size % mesh.degree(a) == 0
                                           for a, size in zip(axes, shape))


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


_DICT_PATH = re.compile(r"(?:\['[^'\\]*'\])+")


def _unflatten(infos: Sequence[LeafInfo], values: list[Any], like: Any, what: str) -> Any:
    """`values` in the pytree structure of `like`, or of the leaf paths when they are dict keys."""
    if like is not None:
        leaves, treedef = jax.tree.flatten(like)
        _check_leaves(infos, leaves, what)
        return jax.tree.unflatten(treedef, values)
    tree: dict[str, Any] = {}
    for info, value in zip(infos, values):
        if not _DICT_PATH.fullmatch(info.path):
            raise PlanError(f"cannot rebuild the {what} pytree from leaf path {info.path!r} "
                            f"(not nested dicts); pass {what}= (the {what} or their "
                            "jax.ShapeDtypeStructs)")
        keys = re.findall(r"\['([^']*)'\]", info.path)
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    paths = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    if paths != [i.path for i in infos]:
        raise PlanError(f"cannot rebuild the {what} pytree from its leaf paths; pass {what}=")
    return tree


def _map_by_path(state: Any, params: Any, shardings: Any, default: NamedSharding) -> Any:
    """Each state leaf whose path ends with a parameter's path (same shape) -> its sharding."""
    by_path = [(jax.tree_util.keystr(kp), leaf.shape, s) for (kp, leaf), s in
               zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shardings))]
    by_path.sort(key=lambda t: -len(t[0]))  # longest (most specific) path first

    def pick(kp, leaf):
        path = jax.tree_util.keystr(kp)
        for p, shape, s in by_path:
            if path.endswith(p) and tuple(leaf.shape) == tuple(shape):
                return s
        return default

    return jax.tree_util.tree_map_with_path(pick, state)
