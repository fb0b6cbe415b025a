"""Plans: a strategy with its provenance, saved as versioned JSON.

A `Plan` records which model and topology it was made for (names and fingerprints), one config
per operator (by operator name, as per-dim mesh axes and the output `PartitionSpec`), the
resulting parameter shardings, what the simulator predicted (step time, breakdown, memory per
device), where the costs came from (measured or analytic), and how it was searched (settings,
seed, baselines). `Plan.strategy(graph)` turns it back into a `Strategy` for that graph, and
refuses a plan made for another model or topology with a message saying which and how.

Configs bind to operators by name, never by position: a file's entries may come in any order,
and a renamed, extra or missing operator (with the nearest names), ``"topology": {"axes"}``
other than the topology's mesh, or a ``spec`` other than the one its ``axes`` give is a
`PlanError` (an edited file must not apply one operator's config to another).

Each operator's entry also records its dims' roles (``"SAP|P"``: sample, attribute and parameter
output dims, then a reduction dim against a parameter; see `soapjax.graph.opgraph`) and its output
`PartitionSpec`, so a plan file can be read, tabulated (`Plan._repr_html_` in a notebook) and
drawn (`soapjax.plot.plan_figure(plan)`) without tracing the model again. A plan of user code
(``soapjax plan --model path/file.py:make_workload``) records that text as the model's
``workload``, so `soapjax check` can load the model again.

Example file (abridged)::

    {"format": "soapjax-plan", "version": 1,
     "model": {"name": "gpt2", "config": "default", "fingerprint": "3f9c...", "num_operators": 161,
               "workload": ""},
     "topology": {"name": "dgx-h100x8", "fingerprint": "a1b2...", "axes": {"gpu": 8}},
     "operators": {"layers_0/mlp/fc1": {"axes": [["gpu"], [], [], []], "roles": "SAP|P",
                                        "spec": "P('gpu', None, None)"}},
     "zero_axes": [], "optimizer_axes": [], "microbatches": 1,
     "params": {"['params']['wte']['embedding']": [[], []]},
     "predicted": {"step_time_s": 0.0123, ...}, "cost_source": "analytic",
     "search": {"seed": 0, "budget_s": 30, ...}, "baselines": {"data-parallel": 0.0171}}
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec

from soapjax.base._paths import unwritable
from soapjax.base.errors import PlanError, TopologyError
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy.pipeline import DEFAULT_SCHEDULE, ScheduleName
from soapjax.strategy.space import (
    RECOMPUTE_POLICIES,
    Config,
    MeshShape,
    Spec,
    Strategy,
    param_specs,
    strategy_from_names,
    to_partition_spec,
)
from soapjax.topology.cluster import Topology, is_shipped, load_topology

__all__ = ["FORMAT", "VERSION", "Plan", "check_plan_path", "spec_text", "unique_keys"]

FORMAT = "soapjax-plan"
VERSION = 1


def spec_text(spec: PartitionSpec) -> str:
    """A `PartitionSpec` as short text: ``P('data', None)``."""
    return "P(" + ", ".join(repr(p) for p in spec) + ")"


def _axes_text(mesh: MeshShape) -> str:
    """``{data: 2, model: 4}``: a mesh's axes as a plan file writes them, for messages."""
    return "{" + ", ".join(f"{a}: {n}" for a, n in zip(mesh.axis_names, mesh.axis_sizes)) + "}"


def _names_text(names: list[str], n: int = 6) -> str:
    shown = ", ".join(map(repr, names[:n]))
    return shown + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def _stage_layers(data: dict) -> tuple[int, ...]:
    """The ``"pipeline"`` entry's ``"stage_layers"`` as `Plan.stage_layers`."""
    layers = data.get("stage_layers", [])
    if not isinstance(layers, list) or not all(isinstance(n, int) for n in layers):
        raise PlanError(f"pipeline.stage_layers: expected a list of layer counts per stage, "
                        f"found {layers!r}")
    return tuple(layers)


class _Reader:
    """Typed reads of a plan file's values: each mistake a PlanError that names the entry
    (``operators.fc1.axes``), what was expected and what was found."""

    def __init__(self, where: str):
        self.where = where

    def _error(self, path: str, expected: str, found: Any) -> PlanError:
        shown = repr(found)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return PlanError(f"{self.where}: {path}: expected {expected}, found {shown}")

    def get(self, data: Mapping[str, Any], key: str, path: str) -> Any:
        if key not in data:
            raise PlanError(f"{self.where}: {path} is missing; a plan file has it as "
                            "`soapjax plan` wrote it (write the plan again, or restore it)")
        return data[key]

    def obj(self, data: Mapping[str, Any], key: str, path: str | None = None, *,
            required: bool = True) -> Mapping[str, Any]:
        path = path or key
        if not required and key not in data:
            return {}
        value = self.get(data, key, path)
        if not isinstance(value, Mapping):
            raise self._error(path, "a JSON object ({...})", value)
        return value

    def text(self, data: Mapping[str, Any], key: str, path: str, *,
             default: str | None = None) -> str:
        value = data.get(key, default) if default is not None else self.get(data, key, path)
        if not isinstance(value, str):
            raise self._error(path, "a string", value)
        return value

    def integer(self, value: Any, path: str, *, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self._error(path, f"an integer >= {low}", value)
        return value

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self._error(path, "true or false", value)
        return value

    def choice(self, value: Any, path: str, choices: Sequence[str]) -> str:
        if value not in choices:
            raise self._error(path, f"one of {', '.join(map(repr, choices))}", value)
        return value

    def axis_names(self, value: Any, path: str, mesh: MeshShape) -> tuple[str, ...]:
        """A list of mesh axis names, each once."""
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise self._error(path, "a list of mesh axis names, e.g. [\"data\"]", value)
        unknown = [a for a in value if a not in mesh.axis_names]
        if unknown:
            raise PlanError(f"{self.where}: {path}: mesh axes {unknown} are not in the plan's "
                            f"mesh {_axes_text(mesh)}")
        if len(set(value)) != len(value):
            raise self._error(path, "each mesh axis at most once", value)
        return tuple(value)

    def axes(self, value: Any, path: str, mesh: MeshShape) -> tuple[tuple[str, ...], ...]:
        """Per dim, the mesh axes splitting it: a list of lists of axis names, each axis
        used at most once over all dims."""
        if not isinstance(value, list) or not all(isinstance(d, list) for d in value):
            raise self._error(path, "one list of mesh axis names per dim, e.g. "
                              "[[\"data\"], [], [\"model\"]]", value)
        dims = tuple(self.axis_names(d, f"{path}[{k}]", mesh) for k, d in enumerate(value))
        used = [a for d in dims for a in d]
        twice = sorted({a for a in used if used.count(a) > 1})
        if twice:
            raise PlanError(f"{self.where}: {path}: mesh axis {twice[0]!r} splits two dims; "
                            "each axis splits at most one dim of an operator")
        return dims

    def config(self, op: Any, path: str, mesh: MeshShape) -> Config:
        if not isinstance(op, Mapping):
            raise self._error(path, "a JSON object with \"axes\"", op)
        return Config(self.axes(self.get(op, "axes", f"{path}.axes"), f"{path}.axes", mesh))


def _freeze(x: Any) -> Any:
    """JSON-like data as hashable tuples (dicts become sorted item tuples)."""
    if isinstance(x, Mapping):
        return tuple((k, _freeze(v)) for k, v in sorted(x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


def _thaw(x: Any) -> Any:
    if isinstance(x, tuple) and all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str)
                                    for i in x) and x:
        return {k: _thaw(v) for k, v in x}
    if isinstance(x, tuple):
        return [_thaw(v) for v in x]
    return x


@dataclasses.dataclass(frozen=True)
class Plan:
    """A strategy for one model on one topology, with its provenance.

    Attributes:
      model: the model's name; `model_config`: its config name ('' when not from the zoo).
      graph_fingerprint: `OpGraph.fingerprint()` of the traced model.
      num_operators: how many operators the graph had.
      topology: the topology's name; `topology_fingerprint`: `Topology.fingerprint()`.
      mesh: the mesh axes the configs use.
      configs: (operator name, config) in graph order.
      zero_axes: ZeRO-3 axes (see `Strategy`).
      params: (parameter path, per-dim axes) in graph order.
      predicted: the simulator's figures (step_time_s, compute_s, exposed_comm_s, bytes_moved,
        peak_memory_bytes, fits_in_memory, ...), frozen.
      cost_source: "measured" or "analytic".
      search: search settings and statistics (seed, budget, proposals, ...), frozen.
      baselines: (baseline name, predicted step time) pairs.
      roles: per operator (in `configs` order), its output dims' roles, ``|``, its reduction
        dims' roles, e.g. ``"SP|P"`` for a Dense layer; () for files written without them.
      workload: for user code, the ``--model`` text that rebuilds the model
        (``path/file.py:make_workload`` or ``package.module:make_workload``); '' for the zoo.
      microbatches: gradient accumulation over that many microbatches (`Strategy`); files
        written without it have 1.
      recompute: per operator (in `configs` order), its recompute policy, or () for none
        (`Strategy`; files written without it have none).
      pipeline: (stages, virtual stages per stage, schedule) (`Strategy`,
        `soapjax.strategy.pipeline`); files written without it have no pipeline, ``(1, 1, "1f1b")``.
      batch_size: the global batch the plan was made for (samples per step), so a command
        given only the plan file traces the model at that batch; 0 in files written without
        it.
      optimizer_axes: Megatron's distributed optimizer's axes (see `Strategy`); files
        written without it have none.
      ring_attention: context parallelism's ring form (see `Strategy`); files written without
        it have the gathered form.
      stage_layers: layers per pipeline stage where the stages are uneven (see `Strategy`);
        () for equal stages, and in files written without it.
      aux_outputs: the leaves the loss returns beside it (``has_aux``); 0 in older files.
      topology_file: the file the topology was read from, where it is not one of soapjax's
        (`soapjax.topology.cluster.is_shipped`): `soapjax check` reads it there; '' for a shipped
        one.
      simulated: the `soapjax.simulate.front.SimResult` `soapjax.search.find.find_plan` simulated
        the plan's strategy to (timeline included), so a report needs no second simulation; not
        saved (None for a loaded plan) and not part of the plan's identity.
    """

    model: str
    model_config: str
    graph_fingerprint: str
    num_operators: int
    topology: str
    topology_fingerprint: str
    mesh: MeshShape
    configs: tuple[tuple[str, Config], ...]
    zero_axes: tuple[str, ...] = ()
    params: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = ()
    predicted: tuple = ()
    cost_source: str = "analytic"
    search: tuple = ()
    baselines: tuple[tuple[str, float], ...] = ()
    roles: tuple[str, ...] = ()
    workload: str = ""
    microbatches: int = 1
    recompute: tuple[str, ...] = ()
    pipeline: tuple[int, int, ScheduleName] = (1, 1, DEFAULT_SCHEDULE)
    batch_size: int = 0
    optimizer_axes: tuple[str, ...] = ()
    ring_attention: bool = False
    stage_layers: tuple[int, ...] = ()
    aux_outputs: int = 0
    topology_file: str = ""
    simulated: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        # The step-level choices are checked as a Strategy checks them.
        Strategy(tuple(c for _, c in self.configs), self.zero_axes, self.microbatches,
                 self.recompute, *self.pipeline, optimizer_axes=self.optimizer_axes,
                 ring_attention=self.ring_attention, stage_layers=self.stage_layers)
        if self.roles and len(self.roles) != len(self.configs):
            raise PlanError(f"{len(self.roles)} role strings for {len(self.configs)} operators")
        for (name, config), roles in zip(self.configs, self.roles):
            if len(roles.replace("|", "")) != len(config.axes) or roles.count("|") != 1:
                raise PlanError(f"operator {name!r}: roles {roles!r} do not match its config "
                                f"{[list(a) for a in config.axes]} (expected one role per dim, "
                                "output dims then '|' then reduction dims)")

    @classmethod
    def make(cls, graph: OpGraph, topology, strategy: Strategy, *, model_config: str = "",
             workload: str = "", predicted: Mapping[str, Any] | None = None,
             cost_source: str = "analytic",
             search: Mapping[str, Any] | None = None,
             baselines: Mapping[str, float] | None = None, simulated: Any = None) -> Plan:
        """A plan for `strategy` on `graph` and `topology` (a `Topology`)."""
        mesh = MeshShape.of(topology)
        if len(strategy.configs) != len(graph.operators):
            raise PlanError(f"the strategy has {len(strategy.configs)} configs but graph "
                            f"{graph.name!r} has {len(graph.operators)} operators")
        specs = param_specs(graph, strategy, mesh)
        return cls(
            model=graph.name, model_config=model_config, graph_fingerprint=graph.fingerprint(),
            num_operators=len(graph.operators), topology=topology.name,
            topology_fingerprint=topology.fingerprint(), mesh=mesh,
            topology_file="" if is_shipped(topology) else str(Path(topology.source_file).resolve()),
            configs=tuple((op.name, c) for op, c in zip(graph.operators, strategy.configs)),
            zero_axes=tuple(strategy.zero_axes),
            params=tuple((leaf.path, specs[leaf.path]) for leaf in graph.params),
            predicted=_freeze(dict(predicted or {})), cost_source=cost_source,
            search=_freeze(dict(search or {})),
            baselines=tuple((k, float(v)) for k, v in (baselines or {}).items()),
            roles=tuple("".join(op.roles) + "|" + "".join(r.role for r in op.reduction_dims)
                        for op in graph.operators),
            workload=workload, microbatches=strategy.microbatches,
            recompute=tuple(strategy.recompute),
            pipeline=(strategy.stages, strategy.virtual_stages, strategy.schedule),
            batch_size=graph.batch_size if graph.batch else 0,
            optimizer_axes=tuple(strategy.optimizer_axes),
            ring_attention=strategy.ring_attention, stage_layers=strategy.stage_layers,
            aux_outputs=graph.aux_outputs, simulated=simulated)

    @property
    def step_time_s(self) -> float | None:
        return dict(self.predicted).get("step_time_s")

    def dim_roles(self, k: int) -> tuple[str, str]:
        """Operator `k`'s output dims' roles and its reduction dims' roles, e.g. ("SP", "P")."""
        if not self.roles:
            raise PlanError(f"plan for {self.model!r} records no dim roles (written by an older "
                            "soapjax); make it again, or pass the traced graph alongside it")
        out, red = self.roles[k].split("|")
        return out, red

    def output_specs(self) -> dict[str, PartitionSpec]:
        """Operator name -> the `PartitionSpec` of its (primary) output."""
        return {name: to_partition_spec(c.axes[:len(self.dim_roles(k)[0])])
                for k, (name, c) in enumerate(self.configs)}

    def describe(self, k: int) -> str:
        """Operator `k`'s config as text, e.g. ``[S:data, P:model | R:-]`` (`Config.describe`)."""
        out, red = self.dim_roles(k)
        return self.configs[k][1].describe_roles(tuple(out) + ("R",) * len(red), len(out))

    def validate_for(self, graph: OpGraph, topology: Topology | None = None) -> None:
        """Raises PlanError unless this plan was made for `graph` (and `topology`).

        The configs bind to operators by name: every operator of `graph` needs one, and every
        name in the plan must be an operator of `graph` (an edited file that renames, adds or
        drops one is refused, whatever the order of its entries). With `topology`, the plan's
        mesh axes (``"topology": {"axes": ...}`` in the file) must be the topology's.
        """
        if graph.fingerprint() != self.graph_fingerprint:
            raise PlanError(
                f"this plan was made for model {self.model!r} ({self.num_operators} operators, "
                f"fingerprint {self.graph_fingerprint}), but the function traces to "
                f"{graph.name!r} ({len(graph.operators)} operators, fingerprint "
                f"{graph.fingerprint()}): {self._graph_difference(graph)}; make a new plan with "
                "`soapjax plan`")
        self._check_names(graph)
        if topology is None:
            return
        if topology.fingerprint() != self.topology_fingerprint:
            mesh = MeshShape.of(topology)
            where = f" from {topology.source_file}" if topology.source_file else ""
            what = (f"its mesh is {_axes_text(mesh)}, the plan's {_axes_text(self.mesh)}"
                    if mesh != self.mesh else "the same mesh, but other devices, links or "
                    "calibrated figures (an edited or another file of that name?)")
            raise PlanError(
                f"this plan was made for topology {self.topology!r} (fingerprint "
                f"{self.topology_fingerprint[:16]}, mesh {_axes_text(self.mesh)}), but the "
                f"topology given is {topology.name!r}{where} (fingerprint "
                f"{topology.fingerprint()[:16]}): {what}; give the topology the plan was made "
                "on, or make a new plan on this one")
        if MeshShape.of(topology) != self.mesh:
            raise PlanError(
                f"the plan's mesh axes {_axes_text(self.mesh)} differ from those of its "
                f"topology {topology.name!r}, {_axes_text(MeshShape.of(topology))} (was "
                "\"topology\": {\"axes\": ...} edited?); a plan's configs are for the mesh it "
                "was searched on: restore the axes, or make a new plan with `soapjax plan "
                "--mesh` on a topology file with the axes you want")

    def _graph_difference(self, graph: OpGraph) -> str:
        """What differs between the traced graph and the one the plan was made for, as far as
        the plan tells."""
        names = [op.name for op in graph.operators]
        mine = [n for n, _ in self.configs]
        missing = [n for n in mine if n not in set(names)]
        extra = [n for n in names if n not in set(mine)]
        if missing or extra:
            return (f"operators in the plan but not the function: {missing[:3]}; in the "
                    f"function but not the plan: {extra[:3]}")
        if graph.aux_outputs != self.aux_outputs:
            said = [f"(loss, aux) with {n} aux leaves" if n else "its loss alone"
                    for n in (self.aux_outputs, graph.aux_outputs)]
            return f"the plan's loss returned {said[0]}, this function returns {said[1]}"
        if self.batch_size and graph.batch_size != self.batch_size:
            return (f"the plan is for a batch of {self.batch_size} samples, the function's is "
                    f"{graph.batch_size} (a plan made with --batch-size {self.batch_size} needs "
                    "the model at that batch)")
        roles = ["".join(op.roles) + "|" + "".join(r.role for r in op.reduction_dims)
                 for op in graph.operators]
        if self.roles and list(self.roles) != roles:
            name = next(n for n, a, b in zip(names, self.roles, roles) if a != b)
            return f"operator {name!r} has other dims than in the plan (another model size?)"
        return ("the same operators, but other shapes or dtypes (another model size, batch or "
                "precision?)")

    def topology_used(self) -> Topology:
        """The topology the plan was made on: its file (`topology_file`), else the shipped one
        of its name.

        Raises:
          PlanError: the file is gone, or no topology of that name is shipped.
        """
        if self.topology_file:
            if not Path(self.topology_file).is_file():
                raise PlanError(f"this plan was made on topology {self.topology!r} from "
                                f"{self.topology_file}, which is not there now; give that "
                                "topology file (--mesh path/to/file.toml)")
            return load_topology(self.topology_file)
        try:
            return load_topology(self.topology)
        except TopologyError as e:
            raise PlanError(f"this plan was made on topology {self.topology!r}, which cannot be "
                            f"found ({e}); give its file (--mesh path/to/file.toml)") from None

    def _check_names(self, graph: OpGraph) -> None:
        """PlanError unless the plan's operator names are exactly `graph`'s (any order)."""
        known = [op.name for op in graph.operators]
        mine = [n for n, _ in self.configs]
        for name in mine:
            if name not in known:
                near = difflib.get_close_matches(name, [n for n in known if n not in mine], n=3)
                hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
                raise PlanError(f"the plan has a config for operator {name!r}, which model "
                                f"{graph.name!r} does not have{hint} (expected one config per "
                                f"operator, by name: {_names_text(known)})")
        missing = [n for n in known if n not in mine]
        if missing:
            raise PlanError(f"the plan has no config for {len(missing)} operator(s) of model "
                            f"{graph.name!r}: {_names_text(missing)}; expected one config per "
                            "operator, by name: restore the entries, or make a new plan")

    def strategy(self, graph: OpGraph, topology: Topology | None = None) -> Strategy:
        """The plan's strategy for `graph`, after checking the plan was made for it.

        Each config goes to the operator of its name, whatever the order of the file.
        """
        self.validate_for(graph, topology)
        names = [name for name, _ in self.configs]
        return strategy_from_names(
            graph, dict(self.configs), zero_axes=self.zero_axes, microbatches=self.microbatches,
            recompute=dict(zip(names, self.recompute)) if self.recompute else None,
            pipeline=self.pipeline, optimizer_axes=self.optimizer_axes,
            ring_attention=self.ring_attention, stage_layers=self.stage_layers)

    # --- JSON ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": {"name": self.model, "config": self.model_config,
                      "fingerprint": self.graph_fingerprint, "num_operators": self.num_operators,
                      "workload": self.workload,
                      **({"batch_size": self.batch_size} if self.batch_size else {}),
                      **({"aux_outputs": self.aux_outputs} if self.aux_outputs else {})},
            "topology": {"name": self.topology, "fingerprint": self.topology_fingerprint,
                         "axes": dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)),
                         **({"file": self.topology_file} if self.topology_file else {})},
            "operators": self._operators_json(),
            "zero_axes": list(self.zero_axes),
            "optimizer_axes": list(self.optimizer_axes),
            "ring_attention": self.ring_attention,
            "microbatches": self.microbatches,
            "pipeline": {"stages": self.pipeline[0], "virtual_stages": self.pipeline[1],
                         "schedule": self.pipeline[2],
                         **({"stage_layers": list(self.stage_layers)}
                            if self.stage_layers else {})},
            "params": {path: [list(a) for a in spec] for path, spec in self.params},
            "predicted": _thaw(self.predicted) if self.predicted else {},
            "cost_source": self.cost_source,
            "search": _thaw(self.search) if self.search else {},
            "baselines": dict(self.baselines),
        }

    def _operators_json(self) -> dict[str, Any]:
        out = {name: {"axes": [list(a) for a in c.axes]} for name, c in self.configs}
        if self.roles:
            for (name, spec), roles in zip(self.output_specs().items(), self.roles):
                out[name] |= {"roles": roles, "spec": spec_text(spec)}
        for (name, _), policy in zip(self.configs, self.recompute):
            if policy != "none":
                out[name]["recompute"] = policy
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "plan") -> Plan:
        """Reads `to_json` output; raises PlanError naming what is missing or malformed, where
        it is (``operators.fc1.axes``), and what was expected."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise PlanError(f"{where}: not a soapjax plan (expected \"format\": \"{FORMAT}\")")
        version = data.get("version")
        if version != VERSION or isinstance(version, bool):
            found = (f"the string {version!r}" if isinstance(version, str)
                     else "none" if version is None else repr(version))
            raise PlanError(f"{where}: \"version\" must be the integer {VERSION} (this soapjax "
                            f"reads plan format version {VERSION}), found {found}")
        r = _Reader(where)
        m, t = r.obj(data, "model"), r.obj(data, "topology")
        axes = r.obj(t, "axes", "topology.axes")
        for name, size in axes.items():
            r.integer(size, f"topology.axes.{name}", low=1)
        mesh = MeshShape(tuple(axes), tuple(axes.values()))
        operators = r.obj(data, "operators")
        configs = tuple((name, r.config(op, f"operators.{name}", mesh))
                        for name, op in operators.items())
        roles = tuple(r.text(op, "roles", f"operators.{name}.roles") if "roles" in op else None
                      for name, op in operators.items())
        roles = () if None in roles else roles
        recompute = tuple(r.choice(op.get("recompute", "none"), f"operators.{name}.recompute",
                                   RECOMPUTE_POLICIES) for name, op in operators.items())
        recompute = () if all(p == "none" for p in recompute) else recompute
        if roles:
            _check_specs(operators, configs, roles, where)
        batch_size = 0  # files written without it have none
        if "batch_size" in m:
            batch_size = r.integer(m["batch_size"], "model.batch_size", low=1)
        params = r.obj(data, "params", required=False)
        for path, spec in params.items():
            r.axes(spec, f"params.{path}", mesh)
        pipeline = r.obj(data, "pipeline", required=False)
        try:
            return cls(
                model=r.text(m, "name", "model.name"), model_config=m.get("config", ""),
                graph_fingerprint=r.text(m, "fingerprint", "model.fingerprint"),
                num_operators=r.integer(r.get(m, "num_operators", "model.num_operators"),
                                        "model.num_operators", low=1),
                topology=r.text(t, "name", "topology.name"),
                topology_fingerprint=r.text(t, "fingerprint", "topology.fingerprint"),
                topology_file=r.text(t, "file", "topology.file", default=""),
                mesh=mesh, configs=configs,
                zero_axes=r.axis_names(data.get("zero_axes", []), "zero_axes", mesh),
                params=tuple((p, r.axes(spec, f"params.{p}", mesh))
                             for p, spec in params.items()),
                predicted=_freeze(data.get("predicted", {})),
                cost_source=data.get("cost_source", "analytic"),
                search=_freeze(data.get("search", {})),
                baselines=tuple((k, float(v)) for k, v in
                                r.obj(data, "baselines", required=False).items()),
                roles=roles, workload=m.get("workload", ""),
                microbatches=r.integer(data.get("microbatches", 1), "microbatches", low=1),
                recompute=recompute,
                pipeline=(r.integer(pipeline.get("stages", 1), "pipeline.stages", low=1),
                          r.integer(pipeline.get("virtual_stages", 1),
                                    "pipeline.virtual_stages", low=1),
                          r.text(pipeline, "schedule", "pipeline.schedule",
                                 default=DEFAULT_SCHEDULE)),
                stage_layers=_stage_layers(pipeline), batch_size=batch_size,
                aux_outputs=r.integer(m.get("aux_outputs", 0), "model.aux_outputs", low=0),
                optimizer_axes=r.axis_names(data.get("optimizer_axes", []), "optimizer_axes",
                                            mesh),
                ring_attention=r.boolean(data.get("ring_attention", False), "ring_attention"))
        except PlanError as e:  # the reader's name the file; a Strategy's checks do not
            raise (e if str(e).startswith(f"{where}: ") else PlanError(f"{where}: {e}")) from None
        except (TypeError, ValueError) as e:
            raise PlanError(f"{where}: malformed plan: {e}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the plan atomically (a temp file, then a rename).

        Raises:
          PlanError: `path` is a directory, or cannot be written (the message names `path`,
            never the temp file).
        """
        path = Path(path)
        check_plan_path(path)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=1)
                f.write("\n")
            os.replace(tmp, path)
        except OSError as e:
            raise PlanError(f"cannot write the plan to {path}: {e.strerror or e}; expected a "
                            "file path in a directory you can write to") from None
        finally:  # an error or Ctrl-C leaves no temp file behind
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Reads a plan file (`save`).

        Raises:
          PlanError: no such file, a directory, an unreadable or non-JSON file, a key twice in
            one object, or a malformed plan (`from_json`).
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
        except FileNotFoundError:
            raise PlanError(f"no plan file at {path}; expected the JSON file `soapjax plan` "
                            "wrote (--out)") from None
        except IsADirectoryError:
            raise PlanError(f"{path} is a directory; expected a plan file (the JSON file "
                            "`soapjax plan` wrote), e.g. plans/NAME.json") from None
        except OSError as e:
            raise PlanError(f"cannot read plan file {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise PlanError(f"{path}: not a plan file (byte {e.start} is not UTF-8 text); "
                            "expected the JSON file `soapjax plan` wrote") from None
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not valid JSON ({e})") from e
        except RecursionError:
            raise PlanError(f"{path}: not valid JSON (nested too deeply to read); expected the "
                            "JSON file `soapjax plan` wrote") from None
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None
        return cls.from_json(data, where=str(path))


def check_plan_path(path: str | os.PathLike) -> None:
    """PlanError unless a plan can be written to `path` as far as can be told without writing:
    not a directory, and its nearest existing folder a writable directory (what `Plan.save`
    checks first, and the command line before it searches)."""
    why, folder = unwritable(path)
    if why == "directory":
        raise PlanError(f"cannot write the plan to {path}: it is a directory; expected a "
                        f"file path, e.g. {folder / 'plan.json'}")
    if why:
        raise PlanError(f"cannot write the plan to {path}: {folder} is {why}; expected a "
                        "file path in a directory you can write to")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json.load`` ``object_pairs_hook``: the object as a dict; PlanError for a key given
    twice (JSON would keep the last silently, and a plan's operator twice is a mistake)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise PlanError(f"key {twice!r} appears twice in one JSON object; expected each "
                        "operator (and every key) once: delete one of them")
    return out


def _spec_key(text: str) -> str:
    """A spec's text without the spelling that does not matter: spaces, quote marks."""
    return "".join(text.split()).replace('"', "'")


def _check_specs(operators: Mapping[str, Any], configs, roles, where: str) -> None:
    """PlanError for an operator whose ``spec`` is not the `PartitionSpec` its ``axes`` give
    (the spec is written for people to read; the axes are what a plan applies)."""
    for (name, config), role in zip(configs, roles):
        written = operators[name].get("spec")
        if written is None:
            continue
        n_out = len(str(role).split("|")[0])
        implied = spec_text(to_partition_spec(config.axes[:n_out]))
        if not isinstance(written, str) or _spec_key(written) != _spec_key(implied):
            raise PlanError(f"{where}: operator {name!r} has spec {written!r}, but its axes "
                            f"{[list(a) for a in config.axes]} give {implied!r}; the axes are "
                            "what the plan applies and the spec is derived from them: edit "
                            f"\"axes\" (and the spec to match), or delete \"spec\"")


def untied_layers(graph: OpGraph, strategy: Strategy) -> list[tuple[str, tuple[int, ...], Spec,
                                                                    Spec]]:
    """The layers of a scan that read their slice of a stacked parameter in another layout
    than the scan's first layer reads it at the same position, as (parameter path, layer
    index, the first layer's axes per dim, this layer's), one per parameter and layer.

    A stacked parameter is stored as its first layer's slice is read (`space.param_specs`), so XLA
    moves every such slice each step, and its gradient back (all-to-alls), which no
    operator's price holds: the simulator does not price them. The search and the baselines
    never make such plans (`space.tie_blocks`); a plan file written or edited by hand can.
    """
    first: dict[tuple[str, str], Spec] = {}
    out = []
    for op, config in zip(graph.operators, strategy.configs):
        for operand in op.inputs:
            if operand.kind != "param" or not operand.layer:
                continue
            axes = config.operand_axes(operand.dims)
            seen = first.setdefault((operand.leaf_path, op.block_position), axes)
            if axes != seen:
                out.append((operand.leaf_path, tuple(operand.layer), seen, axes))
    return out


def untied_warning(graph: OpGraph, strategy: Strategy) -> str | None:
    """`untied_layers` as one line for a report, None where every layer is tied."""
    untied = untied_layers(graph, strategy)
    if not untied:
        return None
    path, layer, first, axes = untied[0]
    more = f" and {len(untied) - 1} more" if len(untied) > 1 else ""
    axes_text, first_text = (spec_text(to_partition_spec(s)) for s in (axes, first))
    return (f"warning: layer {', '.join(map(str, layer))} of stacked parameter {path} is read "
            f"split as {axes_text} where the scan's first layer reads it {first_text}{more}: "
            "a scan stores its layers' weights in one layout, so XLA moves such slices every "
            "step, which the prediction does not price; give every layer of the scan one config "
            "(soapjax.strategy.space.tie_blocks), as every plan soapjax makes does")
