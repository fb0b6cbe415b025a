"""A pipelined strategy's layout: the layer scan its stages cut, the mesh it runs on, and where
its parameters live; everything about a pipeline that is decided before its step runs.

A model whose layers are one scan over stacked parameters (``nn.scan``: the zoo's GPT and
LLaMA) can be pipelined (`check_pipelinable`): its L layers are cut into ``C = S * v`` chunks
of ``L / C`` layers, S stages of v virtual stages each. A pipelined strategy runs on
`pipelined_mesh`: the user's mesh with its outermost axis cut into ``stage`` (S) and what is
left of it, its configs over one stage's mesh (`stage_mesh_shape`). Its parameters are kept in
the model's layout, every stacked parameter ``[L, ...]`` split over ``stage`` on its layer
dim, and reshaped inside the step to the *pipelined layout* ``[v, S, L / C, ...]`` (chunk
``c = j S + s`` at ``[j, s]``: `to_pipelined`, `from_pipelined`), sharded over ``stage`` on
its second dim (`pipelined_layout_shardings`), so a stage holds its own chunks
(`soapjax.strategy.pipeline.chunks_of`). With v = 1 both layouts give stage s the same layers, so
the reshape moves nothing; with v > 1 `soapjax.apply.step` keeps them in chunk order
(`soapjax.apply._layer_order`, `chunk_ordered`), and the reshape (``chunk_ordered=True``) moves
nothing either.

`soapjax.apply._validation` checks a pipelined strategy with these, `soapjax.apply._shardings`
places its parameters, and `soapjax.apply._pipelined` runs it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from soapjax.base.errors import PlanError
from soapjax.graph._program import LayerScan
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy.memory import coupled_samples, random_operator, recomputes
from soapjax.strategy.pipeline import (
    DEFAULT_SCHEDULE,
    ScheduleName,
    check_pipeline,
    check_stage_layers,
    stage_routes,
)
from soapjax.strategy.space import (
    RECOMPUTE_POLICIES,
    MeshShape,
    RecomputePolicy,
    Strategy,
)

__all__ = ["STAGE_AXIS", "check_chunks", "check_pipelinable", "check_stage_axis",
           "chunk_ordered", "from_pipelined", "kept_positions", "layer_recompute", "layer_scan",
           "pipelined_layout_shardings", "pipelined_mesh", "stacked_params", "stage_mesh_shape",
           "stage_router", "to_pipelined"]

# The mesh axis of the pipeline stages in the mesh `soapjax.apply.step` runs a pipelined strategy
# on.
STAGE_AXIS = "stage"


# --------------------------------------------------------------------------------------------
# The layer scan the stages cut


def layer_scan(graph: OpGraph) -> tuple[LayerScan, tuple[int, ...]]:
    """The graph's one layer scan and the positions of its stacked parameters in
    ``graph.params``; PlanError where there is none, or it cannot be pipelined."""
    prog = graph.program
    if not prog.layer_scans:
        raise PlanError(f"pipelining needs the model's layers as one scan over stacked "
                        f"parameters (nn.scan, nnx.scan), but graph {graph.name!r} has no "
                        f"layer scan; trace a model whose layers are scanned")
    if len(prog.layer_scans) > 1:
        raise PlanError(f"pipelining needs one layer scan, but graph {graph.name!r} has "
                        f"{len(prog.layer_scans)} (several scans or nested ones)")
    scan = prog.layer_scans[0]
    if scan.steps != tuple(range(len(scan.steps))):
        raise PlanError(f"graph {graph.name!r}: its layer scan runs in reverse; pipelining "
                        "needs the layers in order")
    position = {info.value: k for k, info in enumerate(graph.params)}
    stacked = []
    for sid in scan.slices[0]:
        root = prog.slice_of.get(sid, (None,))[0]
        if root not in position:
            raise PlanError(f"graph {graph.name!r}: its layer scan slices a value that is "
                            "not a parameter; pipelining needs a scan over parameters only")
        stacked.append(position[root])
    return scan, tuple(stacked)


def stacked_params(graph: OpGraph) -> tuple[int, ...]:
    """Positions in ``graph.params`` of the layer scan's stacked parameters ``[L, ...]``.

    Raises:
      PlanError: the graph has no layer scan, or one that cannot be pipelined.
    """
    return layer_scan(graph)[1]


def check_pipelinable(graph: OpGraph, *, stages: int, microbatches: int, virtual: int = 1,
                      schedule: ScheduleName = DEFAULT_SCHEDULE,
                      stage_layers: tuple[int, ...] = ()) -> None:
    """PlanError unless `soapjax.apply._pipelined.pipelined_value_and_grad` can run `graph` with
    these numbers: one layer scan (module doc), its layers dividing into ``S v`` chunks (or into
    `stage_layers`), the batch into M microbatches, no random bits drawn, and a schedule the
    numbers make a pipeline of."""
    check_pipeline(schedule, stages, microbatches, virtual)
    if graph.has_aux:
        raise PlanError(f"graph {graph.name!r} returns values beside its loss (has_aux), "
                        "which a pipeline does not hand back; plan it without stages")
    if microbatches > 1 and (why := coupled_samples(graph)):
        raise PlanError(f"graph {graph.name!r}: its samples interact ({why}); a pipeline's "
                        f"{microbatches} microbatches would compute that per microbatch; "
                        "pipeline it with one microbatch, or trace with "
                        "microbatch_statistics=True")
    if (random := random_operator(graph)) is not None:
        raise PlanError(f"graph {graph.name!r}: operator {random!r} draws random bits "
                        f"(dropout); pipelined microbatches would draw other masks than the "
                        f"whole batch does; pipeline a model without dropout")
    scan, _ = layer_scan(graph)
    check_chunks(graph, len(scan.steps), stages, virtual, stage_layers)
    if graph.batch_size % microbatches:
        raise PlanError(f"graph {graph.name!r}: its batch of {graph.batch_size} does not "
                        f"divide into {microbatches} microbatches")


def check_chunks(graph: OpGraph, num_layers: int, stages: int, virtual: int,
                 stage_layers: tuple[int, ...] = ()) -> int:
    """``L / (S v)``, the layers of one chunk (uneven `stage_layers`: the most a stage runs);
    PlanError where the `num_layers` L do not divide into ``S v`` chunks (or `stage_layers`
    do not cut them: `soapjax.strategy.pipeline.check_stage_layers`)."""
    if stage_layers:
        try:
            check_stage_layers(stage_layers, stages, virtual, num_layers)
        except PlanError as e:
            raise PlanError(f"graph {graph.name!r}: {e}") from None
        return max(stage_layers)
    chunks = stages * virtual
    if num_layers % chunks:
        raise PlanError(f"graph {graph.name!r}: pipelining cuts its {num_layers} layers into "
                        f"stages x virtual = {stages} x {virtual} = {chunks} chunks of equal "
                        f"size, but {num_layers} is not divisible by {chunks}; choose stages "
                        f"and virtual stages whose product divides {num_layers}")
    return num_layers // chunks


# --------------------------------------------------------------------------------------------
# The mesh a pipelined strategy runs on


def stage_mesh_shape(mesh: MeshShape, stages: int) -> MeshShape:
    """One pipeline stage's mesh: the outermost axis cut `stages` ways, dropped where that
    leaves 1 (unless it is the only axis), as `soapjax.topology.cluster.stage_topology` cuts a
    topology. A pipelined strategy's configs are over it.

    >>> stage_mesh_shape(MeshShape(("node", "data", "model"), (4, 2, 2)), 2).shape
    {'node': 2, 'data': 2, 'model': 2}
    >>> stage_mesh_shape(MeshShape(("node", "data", "model"), (2, 2, 2)), 2).shape
    {'data': 2, 'model': 2}

    Raises:
      PlanError: the outermost axis does not divide into `stages`.
    """
    name, size = mesh.axis_names[0], mesh.axis_sizes[0]
    if stages < 1 or size % stages:
        raise PlanError(f"{stages} pipeline stages cut the outermost mesh axis {name!r} (size "
                        f"{size}) of mesh {mesh.shape}; expected a stage count dividing {size}")
    axes = list(zip(mesh.axis_names, mesh.axis_sizes))[1:]
    if size // stages > 1 or not axes:
        axes.insert(0, (name, size // stages))
    return MeshShape(tuple(a for a, _ in axes), tuple(n for _, n in axes))


def pipelined_mesh(mesh: Mesh, stages: int, stage_axis: str = STAGE_AXIS) -> Mesh:
    """The mesh a pipelined strategy runs on: `mesh`'s devices with the outermost axis (size
    n) split into (`stage_axis` S, that axis n / S), the latter dropped where n / S is 1
    (`stage_mesh_shape`), every axis Auto. Stage s holds outer positions ``s n / S`` to
    ``(s + 1) n / S - 1``: whole nodes, and with one process per node whole processes.

    Example: ``node=2, data=2, model=2`` over 2 stages is ``stage=2, data=2, model=2``.

    Raises:
      PlanError: the mesh already has an axis `stage_axis`, or its outermost axis does not
        divide into `stages`.
    """
    if stage_axis in mesh.axis_names:
        raise PlanError(f"a pipelined strategy adds the mesh axis {stage_axis!r}, but mesh "
                        f"{dict(mesh.shape)} has one already; pass the topology's mesh "
                        "(soapjax.topology.cluster.make_mesh), whose outermost axis the stages cut")
    shape = stage_mesh_shape(MeshShape.of(mesh), stages)
    devices = np.asarray(mesh.devices).reshape((stages, *shape.axis_sizes))
    names = (stage_axis, *shape.axis_names)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def check_stage_axis(mesh: Mesh, stages: int, stage_axis: str) -> None:
    """PlanError unless `mesh` has an axis `stage_axis` of size `stages`."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if sizes.get(stage_axis) != stages:
        raise PlanError(f"pipelining over {stages} stages needs a mesh axis {stage_axis!r} of "
                        f"size {stages}, but the mesh has axes {sizes}")


# --------------------------------------------------------------------------------------------
# The pipelined layout


def to_pipelined(graph: OpGraph, params: Any, *, stages: int, virtual: int = 1,
                 chunk_ordered: bool = False) -> Any:
    """`params` (the model's pytree) with every stacked layer parameter ``[L, ...]`` reshaped
    to ``[v, S, L / (S v), ...]``: chunk ``c = j S + s`` at ``[j, s]``, so sharding the second dim
    over ``stage`` gives stage ``s`` its chunks `soapjax.strategy.pipeline.chunks_of` ``(s, S, v)``.
    Others are unchanged. A reshape (jit-able); `from_pipelined` undoes it. With
    `chunk_ordered` the stacked parameters come in chunk order
    (`soapjax.apply._layer_order`, unwrapped): stage ``s``'s rows are ``[s, j]`` of ``[S, v,
    L / (S v), ...]``, and the two first dims swap (no row changes stage)."""
    scan, stacked = layer_scan(graph)
    per = check_chunks(graph, len(scan.steps), stages, virtual)
    leaves, tree = jax.tree.flatten(params)
    for k in stacked:
        rest = leaves[k].shape[1:]
        leaves[k] = (jnp.swapaxes(jnp.reshape(leaves[k], (stages, virtual, per, *rest)), 0, 1)
                     if chunk_ordered else
                     jnp.reshape(leaves[k], (virtual, stages, per, *rest)))
    return jax.tree.unflatten(tree, leaves)


def from_pipelined(graph: OpGraph, params: Any, *, stages: int, virtual: int = 1,
                   chunk_ordered: bool = False) -> Any:
    """The model's layout of parameters (or gradients) in the pipelined layout (with
    `chunk_ordered`, the stacked ones in chunk order: see `to_pipelined`)."""
    scan, stacked = layer_scan(graph)
    leaves, tree = jax.tree.flatten(params)
    for k in stacked:
        x = jnp.swapaxes(leaves[k], 0, 1) if chunk_ordered else leaves[k]
        leaves[k] = jnp.reshape(x, (len(scan.steps), *leaves[k].shape[3:]))
    return jax.tree.unflatten(tree, leaves)


def chunk_ordered(strategy: Strategy) -> bool:
    """Whether `soapjax.apply.step` keeps a strategy's stacked layer parameters in chunk order
    between steps (`soapjax.apply._layer_order`): an interleaved pipeline (v > 1) of equal
    stages, where the chunks a stage runs are not its run of the model's layers. (Uneven
    stages keep ``L / S`` layers a stage and move the difference: `stage_router`.)"""
    return strategy.stages > 1 and strategy.virtual_stages > 1 and not strategy.stage_layers


def stage_router(graph: OpGraph, mesh: Mesh, stage_layers: tuple[int, ...],
                 stage_axis: str = STAGE_AXIS) -> Any:
    """Uneven stages' layout: ``params -> params`` with every stacked layer parameter ``[L,
    ...]`` (kept ``L / S`` layers a stage, split over `stage_axis` on its layer dim) moved to
    ``[1, S, max(stage_layers), ...]``, stage ``s`` holding the ``stage_layers[s]`` layers it
    runs, padded with zeros (which its layer scan skips). Linear: `jax.linear_transpose` of it
    takes the gradients back to the model's layout.

    Per stacked parameter, inside a ``shard_map`` manual over `stage_axis` (the other axes keep
    their split): for each shift of `soapjax.strategy.pipeline.stage_routes`, every stage takes the
    rows the shift sends and, for a shift across stages, ``ppermute``s them (one point-to-point
    send, what `soapjax.simulate.pipesim` prices), then puts them at their rows."""
    scan, stacked = layer_scan(graph)
    routes = stage_routes(len(scan.steps), stage_layers)
    longest, stages = max(stage_layers), len(stage_layers)

    spare = max(r.rows for r in routes)
    # Each stage's rows, as inputs split over the stages (no axis_index: its PartitionId has no
    # meaning to the partitioner once the step's transpose hoists the tables out); padding
    # goes to rows of its own past `longest` (unique rows, so the scatter transposes).
    tables = [(np.array(r.send, np.int32),
               np.array([[p if p < longest else longest + i for i, p in enumerate(row)]
                         for row in r.receive], np.int32)) for r in routes]

    def local(x: Any, rows: list) -> Any:
        out = jnp.zeros((longest + spare, *x.shape[1:]), x.dtype)
        for route, (send, receive) in zip(routes, rows):
            piece = jnp.take(x, send[0], axis=0)
            if route.delta:
                piece = jax.lax.ppermute(piece, stage_axis, [
                    (s, s - route.delta) for s in range(stages) if 0 <= s - route.delta < stages])
            out = out.at[receive[0]].set(piece, unique_indices=True)
        return out[None, None, :longest]

    along = PartitionSpec(stage_axis)
    move = jax.shard_map(local, mesh=mesh, axis_names={stage_axis},
                         in_specs=(along, [(along, along)] * len(tables)),
                         out_specs=PartitionSpec(None, stage_axis), check_vma=False)

    def route(params: Any) -> Any:
        leaves, tree = jax.tree.flatten(params)
        for k in stacked:
            leaves[k] = move(leaves[k], tables)
        return jax.tree.unflatten(tree, leaves)

    return route


def pipelined_layout_shardings(graph: OpGraph, mesh: Mesh, specs: Any, *, stages: int,
                               virtual: int = 1, stage_axis: str = STAGE_AXIS) -> Any:
    """The `NamedSharding`s of the parameters in the pipelined layout (`to_pipelined`).

    Args:
      graph: the traced loss.
      mesh: the mesh, with a `stage_axis` of size `stages`.
      specs: the parameters' `PartitionSpec`s (or `NamedSharding`s) in the model's layout, a
        pytree like the parameters (``jax.tree.map(lambda _: P(), params)``: replicated; or a
        plan's, `soapjax.apply.step.train_shardings`). A stacked parameter's must leave its layer
        dim unsplit, or split it over `stage_axis` alone (as `soapjax.apply.step` stores it in the
        model's layout); ``stage`` takes the stage dim of the pipelined layout and the other
        dims keep their axes. Other parameters keep theirs (replicated over ``stage``).
      stages, virtual: as in `soapjax.apply._pipelined.pipelined_value_and_grad`.
      stage_axis: the mesh axis of the stages.

    Example: a stacked kernel ``[4, 32, 128]`` with spec ``P(None, None, 'model')``, 2 stages,
    2 virtual: pipelined ``[2, 2, 1, 32, 128]`` with ``P(None, 'stage', None, None, 'model')``.
    """
    check_stage_axis(mesh, stages, stage_axis)
    scan, stacked = layer_scan(graph)
    check_chunks(graph, len(scan.steps), stages, virtual)
    flat, tree = jax.tree.flatten(
        specs, is_leaf=lambda x: isinstance(x, (PartitionSpec, NamedSharding)))
    if len(flat) != len(graph.params):
        raise PlanError(f"pipelined_layout_shardings: specs has {len(flat)} leaves, graph "
                        f"{graph.name!r} has {len(graph.params)} parameters")
    out = []
    for k, spec in enumerate(flat):
        spec = spec.spec if isinstance(spec, NamedSharding) else spec
        if k in stacked:
            if len(spec) and spec[0] not in (None, stage_axis):
                raise PlanError(f"parameter {graph.params[k].path} of graph {graph.name!r}: "
                                f"its spec {spec} splits the layer dim, which pipelining "
                                f"splits over {stage_axis!r}; leave dim 0 unsplit")
            spec = PartitionSpec(None, stage_axis, None, *spec[1:])
        out.append(NamedSharding(mesh, spec))
    return jax.tree.unflatten(tree, out)


# --------------------------------------------------------------------------------------------
# What the layers run under (soapjax.apply.step)


def layer_recompute(graph: OpGraph, strategy: Strategy) -> RecomputePolicy:
    """The recompute policy the pipelined layers run under: ``"full"`` if a layer operator's
    policy (`Strategy.recompute`, operators with a `block_position`) is ``"full"``, else
    ``"selective"`` if one is, else ``"none"``. One policy for every layer, since a chunk is
    recomputed or kept as a whole (under ``"selective"``, `kept_positions` says which
    attention-core operators keep their outputs as well); operators outside the layers
    (embedding, head, loss) run as under ``"none"``, but for the head in the last chunk, which
    follows the layers' policy."""
    found = {strategy.recompute_of(j) for j, op in enumerate(graph.operators)
             if op.block_position}
    return next((p for p in reversed(RECOMPUTE_POLICIES) if p in found), "none")


def kept_positions(graph: OpGraph, strategy: Strategy) -> tuple[str, ...]:
    """The layer positions (`Operator.block_position`) whose outputs the pipelined layers keep
    although their policy (`layer_recompute`) is ``"selective"``: operators selective
    recomputation runs again (`soapjax.strategy.memory.recomputes`: an attention core's
    matmuls) whose own policy is ``"none"`` (`soapjax.search.recompute.relaxed` makes such
    plans). Each layer's ``jax.checkpoint`` then saves their outputs too
    (`soapjax.apply._pipelined._chunk_fn`'s ``kept``). Empty under any other layer policy: a
    chunk recomputed in full keeps its input alone, and one not recomputed keeps everything.
    """
    if layer_recompute(graph, strategy) != "selective":
        return ()
    out: dict[str, None] = {}
    for j, op in enumerate(graph.operators):
        if (op.block_position and strategy.recompute_of(j) == "none"
                and recomputes(op, "selective")):
            out[op.block_position] = None
    return tuple(out)
