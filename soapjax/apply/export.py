"""Plans as the user's own training code speaks them: a plan's shardings for a plain `jax.jit`.

`shard_training` and `soapjax.apply` run a plan whole: a sharding for every parameter and batch
leaf, a constraint on every operator's activations, recomputation, microbatches, pipeline
stages. A user who keeps their own loop takes the part `jax.jit` alone can carry, in one of
four forms, and `jax.jit` with those shardings computes the same step (XLA's propagation places
the activations):

- `partition_specs`: a `PartitionSpec` per parameter and per batch leaf, as pytrees like the
  user's (for ``jax.jit(step, in_shardings=...)`` with `NamedSharding`s on the plan's mesh);
  an nnx model's `nnx.State` of `nnx.Param`s is such a pytree too.
- `logical_axis_rules`: Flax linen's logical-axis rules (``nn.logical_axis_rules``), for a
  model whose parameters carry logical axis names (``nn.with_logical_partitioning``): each
  logical name mapped to the mesh axes the plan splits its dims over.
- `annotate_nnx`: the same specs written into an nnx model's own metadata (each `nnx.Param`'s
  ``out_sharding``), for code that reads ``nnx.get_partition_spec``.
- `export_json`: the specs as JSON (parameter and batch paths to per-dim mesh axes), what
  ``soapjax export`` writes.

What the forms cannot express (the per-operator activation layouts, recomputation,
microbatches, stages, context parallelism's ring, equations apply runs in `jax.shard_map`, the
distributed optimizer's state layout) is said in `Exported.not_expressed`, one line each. A
pipelined plan cannot be exported: its parameters live in a stage layout only its pipelined
step runs (`soapjax.apply`).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec

from soapjax.apply._validation import validate_leaves
from soapjax.base.errors import PlanError
from soapjax.cost.updates import update_whole_dims
from soapjax.graph.opgraph import LeafInfo, OpGraph
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import (
    MeshShape,
    Spec,
    Strategy,
    batch_specs,
    fit_spec,
    param_specs,
    to_partition_spec,
)

__all__ = ["FORMATS", "Exported", "annotate_nnx", "export_json", "logical_axis_rules",
           "partition_specs"]

# `soapjax export --format`: the forms a plan is written in.
FORMATS = ("specs", "json", "logical-rules")

class Exported(NamedTuple):
    """A plan's shardings in the user's pytrees.

    Attributes:
      params: a `PartitionSpec` per parameter, in the parameters' pytree.
      batch: a `PartitionSpec` per batch leaf, in the batch's pytree.
      mesh: the plan's mesh axes (build the mesh with `soapjax.make_mesh` or `jax.make_mesh`).
      not_expressed: what of the plan the specs do not carry, one line each.
    """

    params: Any
    batch: Any
    mesh: MeshShape
    not_expressed: tuple[str, ...]


def partition_specs(graph: OpGraph, plan: Plan, *, params: Any = None,
                    batch: Any = None, optimizer: Any = None) -> Exported:
    """The plan's parameter and batch shardings as `PartitionSpec` pytrees (module doc).

    Args:
      graph: the traced model the plan is for (`soapjax.trace`).
      plan: the `Plan` (`Plan.make(graph, topology, strategy)` for a strategy of your own).
      params, batch: the parameters and an example batch (arrays or `jax.ShapeDtypeStruct`s),
        for their pytree structure; optional for nested dicts with string keys.
      optimizer: the step's optax optimizer, when known: one whose update multiplies whole
        matrices (Muon, GaLore) adds what apply does for it to `Exported.not_expressed`.

    Raises:
      PlanError: a pipelined plan (its stage layout needs its own step), a plan for another
        graph, or parameters or a batch other than the traced ones.
    """
    strategy, mesh = _strategy(graph, plan)
    pspecs = param_specs(graph, strategy, mesh)
    bspecs = batch_specs(graph, strategy)
    return Exported(_tree(graph.params, pspecs, mesh, params, "params"),
                    _tree(graph.batch, bspecs, mesh, batch, "batch"), mesh,
                    _not_expressed(graph, strategy, optimizer))


def logical_axis_rules(graph: OpGraph, plan: Plan, logical: Any, *,
                       params: Any = None) -> tuple[tuple[tuple[str, Any], ...], tuple[str, ...]]:
    """Flax linen's logical-axis rules that shard the parameters as the plan does.

    Args:
      graph, plan, params: as `partition_specs`.
      logical: the parameters' logical axis names, a pytree like the parameters of
        `PartitionSpec`s or tuples of names (``nn.get_partition_spec(variables)["params"]``);
        None for a dim without one.

    Returns:
      ``(rules, not_expressed)``: the rules, ``(logical name, mesh axis, axes or None)`` pairs
      for ``nn.logical_axis_rules``, and what they do not carry: `partition_specs`'s lines, and
      a line per logical name the plan splits differently in different parameters (the rule
      takes the split most of its dims have).
    """
    exported = partition_specs(graph, plan, params=params)
    specs = jax.tree.leaves(exported.params, is_leaf=lambda x: isinstance(x, PartitionSpec))
    names = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, (PartitionSpec, tuple)))
    if len(names) != len(specs):
        raise PlanError(f"expected a logical name tuple per parameter ({len(specs)} "
                        f"parameters), got {len(names)} leaves; pass "
                        "nn.get_partition_spec(variables)['params']")
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for spec, named in zip(specs, names):
        axes = list(spec) + [None] * (len(named) - len(spec))
        for name, split in zip(named, axes):
            if name is not None:
                seen[name][_axes(split)] += 1
    lines = list(exported.not_expressed)
    # each name takes the split most of its dims have (a tie: the fewest axes, the safe side)
    chosen = {name: min(counts, key=lambda a: (-counts[a], len(a), a))
              for name, counts in seen.items()}
    for name, counts in seen.items():
        if len(counts) > 1:
            lines.append(f"logical axis {name!r}: the plan splits it over "
                         + "; ".join(f"{_say(a)} in {k} dim(s)" for a, k in counts.most_common())
                         + f"; the rule takes {_say(chosen[name])}")
    # a parameter whose names would take one mesh axis twice is no sharding: the name with
    # the fewer dims behind it goes unsplit
    for named in names:
        while True:
            axes = [a for n in named if n is not None for a in chosen[n]]
            twice = {a for a in axes if axes.count(a) > 1}
            if not twice:
                break
            clash = [n for n in dict.fromkeys(named) if n is not None and set(chosen[n]) & twice]
            drop = min(clash, key=lambda n: sum(seen[n].values()))
            lines.append(f"logical axis {drop!r}: left unsplit, as {', '.join(clash)} would "
                         f"split one parameter over {_say(tuple(sorted(twice)))} twice")
            chosen[drop] = ()
    rules = tuple((name, None if not a else a[0] if len(a) == 1 else a)
                  for name, a in chosen.items())
    return rules, tuple(lines)


def annotate_nnx(model: Any, graph: OpGraph, plan: Plan) -> tuple[str, ...]:
    """Writes the plan's parameter shardings into an nnx model's own metadata: each
    `nnx.Param`'s ``out_sharding``, which ``nnx.get_partition_spec(nnx.state(model))`` and
    Flax's sharding helpers read. `graph` is the model traced on its `nnx.Param` state (as
    `shard_training` traces it). Returns `Exported.not_expressed`'s lines.

    Raises:
      PlanError: as `partition_specs`, or a model whose parameters are not the traced ones.
    """
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    exported = partition_specs(graph, plan, params=state)
    flat = jax.tree_util.tree_flatten_with_path(
        exported.params, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    specs = {_plain(path): spec for path, spec in flat}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            spec = specs.get(tuple(path))
            if spec is None:
                raise PlanError(f"nnx parameter {'/'.join(map(str, path))} is not one the "
                                "graph was traced with; trace the model's nnx.Param state")
            axes = tuple(spec) + (None,) * (len(node.get_value().shape) - len(spec))
            node.set_metadata("out_sharding", axes)
    return exported.not_expressed


def _plain(path: Sequence[Any]) -> tuple:
    """A jax key path as the plain keys `nnx.iter_graph` gives (``('layers', 0, 'kernel')``)."""
    out = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        out.pop()  # a Variable's value, inside the state
    return tuple(out)


def export_json(graph: OpGraph, plan: Plan, optimizer: Any = None) -> str:
    """The plan's parameter and batch specs as JSON: ``{"mesh": {axis: size}, "params":
    {path: [axes per dim]}, "batch": {...}, "not_expressed": [...]}``, paths as
    `soapjax.graph.LeafInfo.path` writes them (``['params']['dense']['kernel']``);
    `optimizer` as for `partition_specs`."""
    exported = partition_specs(graph, plan, optimizer=optimizer)  # by path: the leaves' dicts
    mesh = exported.mesh

    def axes(leaves: Sequence[LeafInfo], specs: dict[str, PartitionSpec]) -> dict[str, list]:
        return {leaf.path: [list(_axes(a)) for a in specs[leaf.path]]
                + [[]] * (len(leaf.shape) - len(specs[leaf.path])) for leaf in leaves}

    out = {"mesh": dict(zip(mesh.axis_names, mesh.axis_sizes)),
           "params": axes(graph.params, exported.params),
           "batch": axes(graph.batch, exported.batch),
           "not_expressed": list(exported.not_expressed)}
    return json.dumps(out, indent=1)


def _strategy(graph: OpGraph, plan: Plan) -> tuple[Strategy, MeshShape]:
    if not isinstance(plan, Plan):
        raise PlanError(f"expected a Plan (a Strategy alone does not say its mesh's sizes: "
                        f"Plan.make(graph, topology, strategy)), got {type(plan).__name__}")
    strategy = plan.strategy(graph)
    if strategy.pipelined:
        raise PlanError("a pipelined plan cannot be exported: its parameters live in a stage "
                        "layout only the pipelined step runs; train with "
                        "soapjax.training.shard_training or soapjax.apply.sharded_train_step, "
                        "or plan without stages (--no-pipelines)")
    return strategy, plan.mesh


def _tree(leaves: Sequence[LeafInfo], specs: dict[str, Spec], mesh: MeshShape, like: Any,
          what: str) -> Any:
    values = [to_partition_spec(fit_spec(specs[leaf.path], leaf.shape, mesh)) for leaf in leaves]
    if like is None:
        return {leaf.path: v for leaf, v in zip(leaves, values)}
    flat, treedef = jax.tree.flatten(like)
    validate_leaves(leaves, flat, what)
    return jax.tree.unflatten(treedef, values)


def _not_expressed(graph: OpGraph, strategy: Strategy, optimizer: Any = None
                   ) -> tuple[str, ...]:
    lines = ["the activations' layouts (a sharding constraint per operator) are left to "
             "XLA's sharding propagation"]
    whole = update_whole_dims(optimizer, graph.abstract_params()).whole
    if any(whole):
        lines.append(f"the optimizer's update multiplies whole matrices ({sum(map(bool, whole))} "
                     "parameters: Muon's or GaLore's): apply puts their gradients, optimizer "
                     "state and updates whole along those dims (jax.lax.with_sharding_"
                     "constraint); without that XLA splits the update's products after the "
                     "parameters' specs, slower than the plan was priced")
    if any(p != "none" for p in strategy.recompute):
        lines.append("recomputation: wrap the layers in jax.checkpoint yourself")
    if strategy.microbatches > 1:
        lines.append(f"{strategy.microbatches} microbatches: accumulate the gradients yourself")
    if strategy.ring_attention:
        lines.append("context parallelism's ring form: attention runs gathered")
    if strategy.optimizer_axes:
        lines.append("the distributed optimizer's state layout (sharded over "
                     f"{', '.join(strategy.optimizer_axes)}): the state follows the parameters")
    anchors = {op.anchor for op in graph.operators}
    if "conv_general_dilated" in anchors:
        lines.append("convolutions run by XLA's partitioner, not in jax.shard_map as apply runs "
                     "them: XLA computed some kernel gradients wrongly under some splits "
                     "(docs/xla-workarounds.md); compare your first step's gradients with "
                     "soapjax.exactness before you train")
    if "top_k" in anchors:
        lines.append("top_k run by XLA's partitioner, which gathers its operand whole, not in "
                     "jax.shard_map on each device's rows as apply runs it")
    return tuple(lines)


def _axes(split: Any) -> tuple[str, ...]:
    return () if split is None else (split,) if isinstance(split, str) else tuple(split)


def _say(axes: tuple[str, ...]) -> str:
    return "none" if not axes else " x ".join(axes)
