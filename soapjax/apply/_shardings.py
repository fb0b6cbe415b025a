"""The shardings of a sharded train step's inputs and outputs: parameters, optimizer state, batch.

A parameter takes `soapjax.strategy.space.param_specs` (the specs the simulator prices: its first
reader's operand spec, split further over `Strategy.zero_axes`), a batch leaf its first
consumer's operand spec, an optimizer state leaf the sharding of the parameter it mirrors
(`optax.tree_map_params`), split further over `Strategy.optimizer_axes` (Megatron's
distributed optimizer: `soapjax.strategy.space.optimizer_specs`), everything else is replicated;
axes whose degree does not divide a dim are dropped, since jit's in and out shardings need even
shards. The pytrees come back in
the structure of the given parameters and batch, or of their leaf paths when those are nested
dict keys. `soapjax.apply.step` re-exports the public names.

What differs between a strategy with pipeline stages and one without is its `StepProgram`,
chosen here once per checked strategy (`step_program`): the mesh the step runs on, the mesh its
configs are over, what its layout adds to the parameters' shardings, and how it computes loss
and gradients. A pipelined strategy (`soapjax.apply._pipelined.PipelinedStep`) runs on the mesh
`soapjax.apply._pipeline_layout.pipelined_mesh` makes of the given one (the outermost axis cut into
``stage`` and what is left of it): its shardings are over that mesh, in the model's layout, the
specs those of one stage's mesh, and every stacked layer parameter ``[L, ...]`` is split over
``stage`` on its layer dim, so stage ``s`` holds layers ``s L / S`` to ``(s + 1) L / S - 1``
(with virtual stages its chunks are others, so their layer dim is kept in chunk order:
`soapjax.apply._layer_order`). Example, the tiny GPT's stacked ``fc1`` kernel ``[2, 32,
128]`` under Megatron with tp=2, pp=2 on ``node=2, data=2, model=2``: ``P('stage', None,
'model')`` on ``stage=2, data=2, model=2``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from soapjax.apply._flatstep import FlatStep
from soapjax.apply._layer_order import step_layout, unwrapped
from soapjax.apply._pipelined import PipelinedStep
from soapjax.apply._validation import Checked, check_strategy, validate_leaves
from soapjax.base.errors import ArgumentError, PlanError
from soapjax.cost.updates import update_whole_dims, whole_update_spec
from soapjax.graph.opgraph import LeafInfo, OpGraph
from soapjax.strategy import space
from soapjax.strategy.space import MeshShape


def checked(graph: OpGraph, strategy: Any, mesh: Mesh,
            mesh_shape: MeshShape | None = None) -> Checked:
    """`strategy` checked for `graph` on `mesh`: as it comes when the apply stage checked it
    already (`soapjax.apply._validation.check_strategy` is called where a strategy enters)."""
    if isinstance(strategy, Checked) and strategy.holds(graph, mesh):
        return strategy
    return check_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)


class StepProgram(Protocol):
    """How the training step of a checked strategy runs: the one interface of the step without
    pipeline stages (`soapjax.apply._flatstep.FlatStep`) and the pipelined one
    (`soapjax.apply._pipelined.PipelinedStep`). `step_program` picks one; the shardings here and
    `soapjax.apply.step.sharded_train_step` read what differs from it, so another kind of step (a
    new dimension of parallelism) is another implementation, not another branch.

    Attributes:
      mesh: the mesh the step runs on; the shardings of its inputs and outputs are on it.
      config_mesh: the mesh the strategy's configs are over, the parameters' and the batch's
        specs with them (`soapjax.strategy.space.param_specs`,
        `soapjax.strategy.space.batch_specs`).
    """

    mesh: Mesh
    config_mesh: MeshShape

    def stored(self, strategy: Any) -> Any:
        """The strategy the parameters' specs are read from (`soapjax.strategy.space
        .param_specs`), as the simulator prices their storage: the plan's; a pipeline's with
        its stage operators as its data groups run them, whole over the group axes."""
        ...

    def param_layout(self, shardings: list[NamedSharding]) -> list[NamedSharding]:
        """The parameters' shardings (``graph.params`` order, on `mesh`) from those of their
        specs: what the step's own layout adds (a pipeline: the stacked layer parameters split
        over its stage axis on their layer dim)."""
        ...

    def value_and_grad(self, param_shardings: Any, batch_shardings: Any, *,
                       allow_spatial_convolutions: bool = False
                       ) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
        """``(params, batch, step) -> (loss, grads)``, to call inside ``jax.jit``: parameters
        and gradients in the model's layout, placed by `param_shardings` (pytrees like the
        parameters and the batch); ``step``, the training step's number, advances the PRNG
        keys drawn from constants (`soapjax.apply._flatstep.step_keys`)."""
        ...


def step_program(check: Checked) -> StepProgram:
    """The step program of a checked strategy: pipelined (`Strategy.pipelined`) or not."""
    return PipelinedStep(check) if check.strategy.pipelined else FlatStep(check)


class TrainShardings(NamedTuple):
    """The shardings a sharded train step takes and returns.

    An interleaved pipeline's stacked layer parameters are kept in chunk order between steps
    (`soapjax.apply._layer_order`): their shardings, and those of the gradients and optimizer
    state that mirror them, come wrapped in `ChunkOrdered` nodes, and the step takes and
    returns such leaves wrapped alike (`device_put_global` puts a tree in the model's layout
    into that order; `model_layout` takes it back).

    Attributes:
      params: a pytree like the parameters, of `NamedSharding`s.
      opt_state: a pytree like the optimizer state, of `NamedSharding`s.
      batch: a pytree like the batch, of `NamedSharding`s.
      loss: the loss's sharding (replicated).
      grads: a pytree like the parameters: where the step puts the gradients before the
        update, the layout of the optimizer state that mirrors them (the parameters' shardings
        split over `Strategy.optimizer_axes`: a reduce-scatter over them, not an all-reduce),
        whole along the dims an update contracts (Muon's matrices:
        `soapjax.cost.updates.update_whole_dims`; gathered there, the update then needs no
        collective, and its result is sliced back to the parameter's own sharding), split
        over the ZeRO and distributed optimizer axes on the other dims
        (`soapjax.cost.updates.whole_update_spec`).
      whole_updates: some parameter's update contracts its dims: the step constrains the
        updates to `grads` too, so the update is computed there.
      update_params: where the update reads the parameters, when one whose update contracts
        its dims also reads the parameter (Muon's weight decay): whole along those dims (an
        all-gather), the others as stored; None: as stored.
    """

    params: Any
    opt_state: Any
    batch: Any
    loss: NamedSharding
    grads: Any = None
    whole_updates: bool = False
    update_params: Any = None


def param_shardings(graph: OpGraph, strategy: Any, mesh: Mesh, *, params: Any = None,
                    mesh_shape: MeshShape | None = None) -> Any:
    """The `NamedSharding` of every parameter, as a pytree like the parameters.

    The specs are `soapjax.strategy.space.param_specs`, as the simulator prices them: the operand
    spec of the first operator that reads the parameter, then split over each of
    `strategy.zero_axes` it does not use yet, on its largest dim that stays divisible. Parameters no
    operator reads are replicated (and ZeRO-split). Axes whose degree does not divide a dim are
    dropped (`space.fit_spec`: jit's in and out shardings need even shards).

    Args:
      graph: the traced graph.
      strategy: a `Strategy` or plan.
      mesh: the mesh, with Auto axes.
      params: the parameters or their `jax.ShapeDtypeStruct`s, for the pytree structure;
        optional when the parameters are nested dicts with string keys (linen's layout).
      mesh_shape: the mesh the strategy was planned for, when known.

    Raises:
      PlanError: see `validate_strategy`; parameters that differ from the traced ones, or none
        given for a pytree that is not nested dicts.
    """
    check = checked(graph, strategy, mesh, mesh_shape)
    return _param_shardings(step_program(check), check, params)


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
    check = checked(graph, strategy, mesh, mesh_shape)
    return _batch_shardings(step_program(check), check, batch)


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
    # the parameters in their own tree, which an optimizer's labels and masks follow
    tree = graph.abstract_params() if graph.params_tree is not None else params
    dims = update_whole_dims(optimizer, tree if tree is not None else graph.abstract_params())
    if dims.problem and tree is not None:  # (a flat placeholder: no labels to follow)
        raise ArgumentError(f"optimizer: {dims.problem}. The step calls init(params) and "
                            "update(grads, opt_state, params) as a plain optax loop does")
    check = checked(graph, strategy, mesh, mesh_shape)
    program = step_program(check)
    ps = _param_shardings(program, check, params)
    gs = _param_shardings(program, check, params, space.optimizer_specs) \
        if check.strategy.optimizer_axes else ps
    whole, ups = dims.whole, None
    if any(whole):
        # an update that contracts a parameter's dims (Muon) reads its gradient whole along
        # them and keeps its state so, split over the ZeRO and distributed optimizer axes on
        # its other dims (`soapjax.cost.updates.whole_update_spec`)
        leaves = {leaf.path: (leaf.shape, w) for leaf, w in zip(graph.params, whole) if w}
        axes = space.optimizer_state_axes(check.strategy)

        def whole_where(specs_of: Callable, paths: Any) -> Callable:
            def specs(g, s, m):
                stored = space.param_specs(g, s, m)
                return {path: whole_update_spec(stored[path], *leaves[path], axes, m)
                        if path in paths else spec for path, spec in specs_of(g, s, m).items()}
            return specs
        gs = _param_shardings(program, check, params, whole_where(
            space.optimizer_specs if check.strategy.optimizer_axes else space.param_specs,
            leaves))
        reads = {leaf.path for leaf, w, r in zip(graph.params, whole, dims.reads_params)
                 if w and r}
        if reads:  # its update reads the parameter too (weight decay): there as well
            ups = _param_shardings(program, check, params, whole_where(space.param_specs, reads))
    bs = _batch_shardings(program, check, batch)
    abstract = (step_layout(jax.tree.map(_abstract, params), ps) if params is not None
                else jax.tree.unflatten(jax.tree.structure(ps),
                                        [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                                         for leaf in graph.params]))
    os = opt_state_shardings(optimizer, abstract, gs)
    return TrainShardings(ps, os, bs, NamedSharding(program.mesh, PartitionSpec()), gs,
                          any(whole), ups)


# --- helpers ------------------------------------------------------------------------------------


def _param_shardings(program: StepProgram, check: Checked, params: Any,
                     specs_of: Callable = space.param_specs) -> Any:
    graph = check.graph
    specs = specs_of(graph, program.stored(check.strategy), program.config_mesh)  # the simulator's
    out = program.param_layout(_fitted(graph.params, specs, program.mesh))
    return _unflatten(graph.params, out, params, "params")


def _batch_shardings(program: StepProgram, check: Checked, batch: Any) -> Any:
    graph = check.graph
    specs = space.batch_specs(graph, check.strategy)
    return _unflatten(graph.batch, _fitted(graph.batch, specs, program.mesh), batch, "batch")


_DICT_PATH = re.compile(r"(?:\['[^'\\]*'\])+")


def _fitted(leaves: Sequence[LeafInfo], specs: Mapping[str, space.Spec],
            mesh: Mesh) -> list[NamedSharding]:
    """Each leaf's sharding: its spec (by path) with the axes that do not divide its dims
    dropped (`space.fit_spec`)."""
    shape = MeshShape.of(mesh)
    return [NamedSharding(mesh, space.to_partition_spec(
                space.fit_spec(specs[leaf.path], leaf.shape, shape))) for leaf in leaves]


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


def _unflatten(infos: Sequence[LeafInfo], values: list[Any], like: Any, what: str) -> Any:
    """`values` in the pytree structure of `like`, or of the leaf paths when they are dict keys."""
    if like is not None:  # (a tree in a step's layout: its structure without the wrappers)
        leaves, treedef = jax.tree.flatten(unwrapped(like))
        validate_leaves(infos, leaves, what)
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
