"""A pipeline stage's data groups, and the configs its operators run with inside them.

Apply runs a stage's operators (the layers, and the epilogue in the last stage) inside a
`jax.shard_map` manual over the stage axis and the stage's *data groups*: the mesh axes the
layers split their samples over (`soapjax.strategy.space.batch_axes`), where they divide a
microbatch and the samples interact only through sums (`soapjax.apply._pipelined
._data_groups`). Each group runs every one of those operators on its own share of the
samples, whatever the operator's config says: a loss whose config splits the batch over
``data`` alone runs on the group's share over ``data`` and ``model``, with no gather of the
logits; a final norm whose config splits the sequence over ``data`` runs on the group's
samples whole along the sequence. `as_run` is the strategy so: each stage operator with a
sample dim has the group axes on that dim and on no other. `PipelinedSimulation` prices the
stage with it, so what the simulator prices is what the step runs (docs/checks.md, "A
pipeline's data groups"), and apply stores the parameters so (`stage_strategy`: a parameter
stored split over a group axis was gathered whole into the stages at every step;
docs/checks.md, "The hand-off in permute-free steps; parameters stored as the groups read
them").
"""

from __future__ import annotations

import dataclasses
import math

from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy.space import Config, MeshShape, Strategy, batch_axes, sample_dim

__all__ = ["as_run", "group_axes", "layer_span", "run_config", "stage_strategy"]


def layer_span(graph: OpGraph) -> tuple[int, int]:
    """The first and last operator index of the longest family of repeated layers."""
    groups = graph.repeated_blocks()
    longest = max((len(g) for g in groups), default=0)
    members = [i for g in groups if len(g) == longest for i in g]
    if not members:
        raise PlanError(f"graph {graph.name!r} has no repeated layers (a scan over layers or "
                        "identical unrolled layers) to cut into pipeline stages")
    return min(members), max(members)


def stage_strategy(graph: OpGraph, strategy: Strategy, mesh: MeshShape) -> Strategy:
    """A pipelined `strategy` (over one stage's `mesh`) as its stages run it: `as_run` with
    the data groups `group_axes` names, from the first layer on."""
    first, _ = graph.memo("layer_span", lambda: layer_span(graph))
    return as_run(graph, strategy, group_axes(graph, strategy, mesh), first, mesh)


def group_axes(graph: OpGraph, strategy: Strategy, mesh: MeshShape) -> tuple[str, ...]:
    """The axes a stage's data groups take under `strategy` on the stage's `mesh` (module
    doc): `batch_axes`, but none where the samples interact other than by sums, or the groups
    do not divide a microbatch (apply then runs each stage on whole microbatches)."""
    manual = batch_axes(graph, strategy)
    micro = graph.batch_size // strategy.microbatches
    if (graph.sample_coupling and graph.sample_sums is None
            or micro % math.prod(mesh.axis_size(a) for a in manual)):
        return ()
    return manual


def as_run(graph: OpGraph, strategy: Strategy, groups: tuple[str, ...], first: int,
           mesh: MeshShape) -> Strategy:
    """`strategy` (one stage's, flat) with each operator from `first` on (the first layer's:
    the layers and the epilogue) run as the `groups` run it (`run_config`). The same strategy
    where `groups` is empty or nothing changes."""
    if not groups:
        return strategy
    configs = list(strategy.configs)
    for j in range(first, len(configs)):
        configs[j] = run_config(graph, j, configs[j], groups, mesh, strategy.microbatches)
    if configs == list(strategy.configs):
        return strategy
    return dataclasses.replace(strategy, configs=tuple(configs))


def run_config(graph: OpGraph, j: int, config: Config, groups: tuple[str, ...],
               mesh: MeshShape, microbatches: int) -> Config:
    """Operator `j`'s `config` as the stages' data `groups` run it, for an operator of a stage
    (module doc): the group axes on its sample dim (after the axes already there, kept) and
    on no other dim. Unchanged for an operator without a sample dim, or one whose samples per
    device would not divide into `microbatches` so."""
    op = graph.operators[j]
    d = sample_dim(op)
    if d is None or not groups:
        return config
    wanted, axes = set(groups), config.axes
    if wanted <= set(axes[d]) and not any(wanted & set(split)
                                          for k, split in enumerate(axes) if k != d):
        return config
    run = [tuple(a for a in split if a not in wanted) for split in axes]
    run[d] = tuple(a for a in axes[d] if a not in wanted) + groups
    if op.iteration_sizes[d] % (mesh.degree(run[d]) * microbatches):
        return config
    return Config(tuple(run))
