"""Strategies written by hand: what ``soapjax simulate --strategy`` takes.

A baseline's name, a plan file, or a JSON object that overrides data parallelism operator by
operator, each read into a `Strategy` and checked against the graph and the mesh, with errors
that name the operator and the nearest valid names. `soapjax.simulate.front` re-exports
`parse_strategy`.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any

from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy import baselines, plan as plan_mod
from soapjax.strategy.space import (
    Config,
    MeshShape,
    Strategy,
    data_parallel,
    strategy_from_names,
    validate_config,
)
from soapjax.topology.cluster import Topology, stage_topology


def parse_strategy(graph: OpGraph, topology: Topology, spec: str | Mapping[str, Any], *,
                   family: str | None = None) -> Strategy:
    """A strategy from a baseline's name, a plan file, or a hand-written override of data
    parallelism (what ``soapjax simulate --strategy`` takes).

    * A baseline's name, one of `soapjax.strategy.baselines.NAMES` (``"data-parallel"``,
      ``"megatron"``, ``"fsdp"``, ``"expert-cnn"``, ``"expert-rnn"``).
    * The path of a plan file (`soapjax.strategy.plan.Plan.save`, ``soapjax plan --out``): its
      strategy, after checking that it was made for this graph and topology.
    * A JSON object (or the path of a file holding one) that names configs by operator, one
      list of mesh axes per iteration dim (output dims, then reduction dims); operators it
      does not name keep their data-parallel config::

        {"configs": {"layers_0/mlp/fc1": [["data"], ["model"], []]}, "zero_axes": ["data"]}

      ``"optimizer_axes"`` (Megatron's distributed optimizer, `Strategy.optimizer_axes`) is
      optional as ``"zero_axes"`` is.

    Anything else is refused: a JSON file that is neither a plan nor such an object is never
    read as data parallelism.

    Raises:
      PlanError: an unknown name; an unreadable file; a plan for another model or topology; an
        unknown operator, a config with the wrong number of dims, an unknown axis or a split
        that does not divide.
    """
    mesh = MeshShape.of(topology)
    if isinstance(spec, str):
        if spec in baselines.NAMES:
            note = baselines.batch_split_note(graph, mesh)
            if spec == "data-parallel" and note:
                raise PlanError(f"--strategy data-parallel: {note}; give such a batch "
                                "(--batch-size), or another strategy")
            by_name = baselines.baselines(graph, topology, family)
            return by_name[spec] if spec in by_name else baselines.baselines(graph, topology)[spec]
        path, spec = spec, _read_strategy_file(spec)
        if spec.get("format") == plan_mod.FORMAT:
            strategy = plan_mod.Plan.from_json(spec, where=path).strategy(graph, topology)
            # an edited file may not fit; a pipelined plan's configs name one stage's devices
            stage = MeshShape.of(stage_topology(topology, strategy.stages))
            for i, config in enumerate(strategy.configs):
                validate_config(graph, i, config, stage)
            _check_zero_axes(list(strategy.zero_axes), mesh)
            _check_zero_axes(list(strategy.optimizer_axes), mesh, "optimizer_axes")
            return strategy
    if not isinstance(spec, Mapping) or "configs" not in spec \
            or not set(spec) <= {"configs", "zero_axes", "optimizer_axes"} \
            or not isinstance(spec["configs"], Mapping):
        found = sorted(spec) if isinstance(spec, Mapping) else type(spec).__name__
        raise PlanError(f'expected a soapjax plan file ("format": "{plan_mod.FORMAT}", written by '
                        '`soapjax plan`) or a JSON object {"configs": {operator: [[axes], ...]}, '
                        f'"zero_axes": [...], "optimizer_axes": [...]}}; found {found}')
    names = {op.name: i for i, op in enumerate(graph.operators)}
    configs = {}
    for name, axes in spec["configs"].items():
        if name not in names:
            _unknown(graph, name)
        configs[name] = _parse_config(graph, names[name], name, axes, mesh)
    zero = spec.get("zero_axes", [])
    _check_zero_axes(zero, mesh)
    optimizer = spec.get("optimizer_axes", [])
    _check_zero_axes(optimizer, mesh, "optimizer_axes")
    return strategy_from_names(graph, configs, zero_axes=zero, optimizer_axes=optimizer,
                               default=data_parallel(graph, mesh))


def _check_zero_axes(zero: Any, mesh: MeshShape, field: str = "zero_axes") -> None:
    if not isinstance(zero, list) or any(a not in mesh.axis_names for a in zero):
        raise PlanError(f"{field} {zero!r}: expected a list of mesh axes among "
                        f"{list(mesh.axis_names)}")


def _read_strategy_file(path: str) -> dict[str, Any]:
    """The JSON object in file `path`; PlanError naming the baselines when there is no file."""
    try:
        with open(path) as f:
            data = json.load(f, object_pairs_hook=plan_mod.unique_keys)
    except OSError as e:
        near = difflib.get_close_matches(path, baselines.NAMES, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise PlanError(f"strategy {path!r}: expected a baseline ({', '.join(baselines.NAMES)}) "
                        f"or a JSON plan file ({e.strerror}){hint}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise PlanError(f"plan {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PlanError(f"plan {path!r}: expected a JSON object, found {type(data).__name__}")
    return data


def _unknown(graph: OpGraph, name: str) -> None:
    near = difflib.get_close_matches(str(name), [op.name for op in graph.operators], n=3)
    hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
    raise PlanError(f"plan names operator {name!r}, which graph {graph.name!r} does not have{hint}")


def _parse_config(graph: OpGraph, i: int, name: str, axes: Any, mesh: MeshShape) -> Config:
    if not isinstance(axes, list) or not all(
            isinstance(d, list) and all(isinstance(a, str) for a in d) for d in axes):
        raise PlanError(f"operator {name!r}: expected one list of mesh axis names per "
                        f"iteration dim, found {axes!r}")
    try:
        config = Config(tuple(tuple(d) for d in axes))
    except ValueError as e:
        raise PlanError(f"operator {name!r}: {e}") from None
    validate_config(graph, i, config, mesh)
    return config
