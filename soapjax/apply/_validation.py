"""Validation before apply: a strategy or plan against a traced graph and a `jax.sharding.Mesh`.

Everything `soapjax.apply.step` builds goes through `validate_strategy` first, so a mistake raises a
`PlanError` that names the operator, the mesh axis or the leaf, before anything is compiled: a
plan for another graph, a mesh other than the planned one or with Explicit axes, configs that
do not fit the operators (a pipelined strategy's: one stage's mesh), leaves other than the
traced ones, a pipelined strategy for a graph that cannot be pipelined. Strategies that split a
convolution spatially are refused here too (`refuse_spatial_convolutions`): XLA computes them
wrongly (see `soapjax.apply.step.constrained_loss`). `soapjax.apply.step` re-exports the public
names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from soapjax.apply._pipeline_layout import STAGE_AXIS, check_pipelinable, stage_mesh_shape
from soapjax.base.errors import PlanError, TraceError
from soapjax.graph.opgraph import LeafInfo, OpGraph
from soapjax.strategy.memory import check_microbatches
from soapjax.strategy.space import MeshShape, Strategy, spatial_convolution


class Checked(NamedTuple):
    """A strategy checked against a graph and a mesh where it entered the apply stage
    (`check_strategy`): what the apply functions hand each other, so a strategy is checked
    once however many of them build on it.

    Attributes:
      strategy: the strategy.
      graph: the graph it was checked against.
      mesh: the `jax.sharding.Mesh` it was checked against.
      spatial: ``(operator, why)`` of a convolution it splits or feeds spatially (XLA
        computes those wrongly: `refuse_spatial_convolutions`), or None.
    """

    strategy: Strategy
    graph: OpGraph
    mesh: Mesh
    spatial: tuple[str, str] | None

    def holds(self, graph: OpGraph, mesh: Mesh) -> bool:
        """Whether this check was made for `graph` on `mesh`."""
        return self.graph is graph and self.mesh is mesh


def check_strategy(graph: OpGraph, strategy: Any, mesh: Mesh, *,
                   mesh_shape: MeshShape | None = None) -> Checked:
    """`validate_strategy`, once: a `Checked` for `graph` and `mesh` comes back as it is."""
    if isinstance(strategy, Checked) and strategy.holds(graph, mesh):
        return strategy
    if isinstance(strategy, Checked):
        strategy = strategy.strategy
    validate_trainable(graph)
    checked = validate_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)
    return Checked(checked, graph, mesh, spatial_convolution(graph, checked))


def validate_strategy(graph: OpGraph, strategy: Any, mesh: Mesh, *,
                   mesh_shape: MeshShape | None = None) -> Strategy:
    """Checks that `strategy` fits `graph` and `mesh`; returns it as a `Strategy`.

    A pipelined strategy (`Strategy.pipelined`) is planned for the whole mesh, its configs
    for one stage's (`soapjax.apply._pipeline_layout.stage_mesh_shape`: the outermost axis cut
    ``strategy.stages`` ways), and the graph must be one `soapjax.apply._pipelined` can run.

    Args:
      graph: the traced operator graph.
      strategy: a `Strategy`, or a plan: an object whose ``strategy`` is a `Strategy` or a
        method ``strategy(graph)`` (`soapjax.strategy.plan.Plan`), and whose ``mesh`` or
        ``mesh_shape``, if a `MeshShape`, is the mesh it was planned for.
      mesh: the `jax.sharding.Mesh` to apply it on; its axes must be `AxisType.Auto`.
      mesh_shape: the mesh the strategy was planned for, when known (a plan carries it).

    Returns:
      The strategy.

    Raises:
      PlanError: the plan was made for another graph; the mesh differs from the planned one
        (axis names, sizes, device count) or has Explicit axes; or the strategy's configs do
        not match the graph's operators (count, rank, unknown mesh axes, degrees that do not
        divide a dim); microbatches that do not divide an operator's per-device batch; for a
        pipelined strategy, stages that do not divide the outermost axis or a graph that
        cannot be pipelined (`soapjax.apply._pipeline_layout.check_pipelinable`).
    """
    strategy, planned = _unwrap(strategy, graph)
    actual = _validate_mesh(mesh, mesh_shape or planned)
    if strategy.pipelined:
        actual = _validate_pipeline(graph, strategy, actual)
    else:
        _validate_configs(graph, strategy, actual)
    if strategy.recompute and len(strategy.recompute) != len(graph.operators):
        raise PlanError(f"the strategy has {len(strategy.recompute)} recompute policies but "
                        f"graph {graph.name!r} has {len(graph.operators)} operators")
    check_microbatches(graph, strategy.configs, actual, strategy.microbatches)
    return strategy


def _validate_mesh(mesh: Mesh, planned: MeshShape | None) -> MeshShape:
    if not isinstance(mesh, Mesh):
        raise PlanError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}; build one "
                        "with soapjax.topology.cluster.make_mesh(load_topology(...))")
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
                        "names), soapjax.topology.cluster.make_mesh, or jax.make_mesh(..., "
                        "axis_types=(AxisType.Auto,) * n)")
    return actual


def _validate_pipeline(graph: OpGraph, strategy: Strategy, mesh: MeshShape) -> MeshShape:
    """One stage's mesh, after checking that the pipeline fits the mesh and the graph, and the
    configs one stage's mesh."""
    where = (f"{strategy.stages} pipeline stages (schedule {strategy.schedule!r}, "
             f"{strategy.virtual_stages} virtual)")
    if STAGE_AXIS in mesh.axis_names:
        raise PlanError(f"{where} add the mesh axis {STAGE_AXIS!r}, but mesh {_fmt_mesh(mesh)} "
                        "has one already; pass the topology's mesh (make_mesh(topology)), "
                        "whose outermost axis the stages cut")
    stage = stage_mesh_shape(mesh, strategy.stages)
    check_pipelinable(graph, stages=strategy.stages, microbatches=strategy.microbatches,
                      virtual=strategy.virtual_stages, schedule=strategy.schedule,
                      stage_layers=strategy.stage_layers)
    try:
        _validate_configs(graph, strategy, stage)
    except PlanError as e:
        raise PlanError(f"{e} (with {where}, the configs are over one stage's mesh "
                        f"{_fmt_mesh(stage)}: mesh {_fmt_mesh(mesh)} with its outermost axis "
                        f"cut {strategy.stages} ways)") from None
    return stage


def _validate_configs(graph: OpGraph, strategy: Strategy, mesh: MeshShape) -> None:
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
    for field in ("zero_axes", "optimizer_axes"):
        axes = getattr(strategy, field, ())
        unknown = [a for a in axes if a not in names]
        if unknown:
            raise PlanError(f"{field} {axes} name {unknown[0]!r}, but the mesh has "
                            f"axes {mesh.axis_names}")


def refuse_spatial_convolutions(checked: Checked) -> None:
    """PlanError if the checked strategy splits or feeds a convolution spatially."""
    found = checked.spatial
    if found is not None:
        name, why = found
        raise PlanError(
            f"convolution operator {name!r}: {why}; XLA's SPMD partitioner (jax "
            f"{jax.__version__}) computes spatially split convolutions wrongly, so soapjax "
            "refuses them (a split at the edges of windows that do not overlap, a patch "
            "embedding's, is exact and allowed). Plan convolutions without splits of their "
            "spatial dims (soapjax's search returns none; SpaceLimits(allow_attribute=False) "
            "keeps a space off them), or pass allow_spatial_convolutions=True to run it anyway")


# --- helpers ------------------------------------------------------------------------------------


def _unwrap(obj: Any, graph: OpGraph) -> tuple[Strategy, MeshShape | None]:
    """(strategy, the mesh it was planned for) of a Strategy or a plan (the Plan seam).

    A plan is any object with a ``strategy``: a `Strategy`, or a method ``strategy(graph)``
    that checks the plan was made for `graph` (`soapjax.strategy.plan.Plan`); its ``mesh`` or
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


def validate_trainable(graph: OpGraph) -> None:
    """Every parameter leaf is one ``jax.grad`` differentiates: floating-point (or complex).

    Raises:
      TraceError: an integer, boolean or key leaf among the parameters, named, with what to do
        (where the step would fail inside ``jax.jit`` with jax's own message).
    """
    for leaf in graph.params:
        try:
            inexact = bool(jnp.issubdtype(jnp.dtype(leaf.dtype), jnp.inexact))  # bfloat16 too
        except TypeError:  # a PRNG key's dtype
            inexact = False
        if not inexact:
            raise TraceError(
                f"parameter leaf {leaf.path} of graph {graph.name!r} is {leaf.dtype}"
                f"{list(leaf.shape)}: the step differentiates floating-point parameters only "
                f"(jax.grad refuses {leaf.dtype}); keep integer, boolean or key state out of the "
                "parameters (close over it, or pass it as a constant argument) and trace again")


def validate_program_inputs(graph: OpGraph) -> None:
    want = [leaf.value for leaf in (*graph.params, *graph.batch)]
    if list(graph.program.inputs) != want:
        raise PlanError(f"graph {graph.name!r} was traced with arguments other than "
                        "(params, batch); apply needs trace(loss_fn, params, batch)")


def validate_leaves(expected: Sequence[LeafInfo], leaves: Sequence[Any], what: str) -> None:
    if len(leaves) != len(expected):
        raise PlanError(f"{what} has {len(leaves)} leaves, but the graph was traced with "
                        f"{len(expected)}")
    for info, leaf in zip(expected, leaves):
        if tuple(np.shape(leaf)) != info.shape:
            raise PlanError(f"{what} leaf {info.path} has shape {tuple(np.shape(leaf))}, but the "
                            f"graph was traced with {info.shape}")
