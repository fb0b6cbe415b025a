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
output dims, then a reduction dim against a parameter; see `soapjax.graph`) and its output
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec

from soapjax.errors import PlanError
from soapjax.graph import OpGraph
from soapjax.space import (
    Config,
    MeshShape,
    Strategy,
    param_specs,
    strategy_from_names,
    to_partition_spec,
)
from soapjax.topology import Topology

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


def _pipeline(data: dict) -> tuple[int, int, str]:
    """The ``"pipeline"`` entry of a plan file as `Plan.pipeline`."""
    return (int(data.get("stages", 1)), int(data.get("virtual_stages", 1)),
            str(data.get("schedule", "1f1b")))


def _stage_layers(data: dict) -> tuple[int, ...]:
    """The ``"pipeline"`` entry's ``"stage_layers"`` as `Plan.stage_layers`."""
    layers = data.get("stage_layers", [])
    if not isinstance(layers, list) or not all(isinstance(n, int) for n in layers):
        raise PlanError(f"pipeline.stage_layers: expected a list of layer counts per stage, "
                        f"found {layers!r}")
    return tuple(layers)


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
      pipeline: (stages, virtual stages per stage, schedule) (`Strategy`, `soapjax.pipeline`);
        files written without it have no pipeline, ``(1, 1, "1f1b")``.
      batch_size: the global batch the plan was made for (samples per step), so a command
        given only the plan file traces the model at that batch; 0 in files written without
        it.
      optimizer_axes: Megatron's distributed optimizer's axes (see `Strategy`); files
        written without it have none.
      ring_attention: context parallelism's ring form (see `Strategy`); files written without
        it have the gathered form.
      stage_layers: layers per pipeline stage where the stages are uneven (see `Strategy`);
        () for equal stages, and in files written without it.
      simulated: the `soapjax.simulate.SimResult` `soapjax.search.find_plan` simulated the
        plan's strategy to (timeline included), so a report needs no second simulation; not
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
    pipeline: tuple[int, int, str] = (1, 1, "1f1b")
    batch_size: int = 0
    optimizer_axes: tuple[str, ...] = ()
    ring_attention: bool = False
    stage_layers: tuple[int, ...] = ()
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
            simulated=simulated)

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
            names = [op.name for op in graph.operators]
            mine = [n for n, _ in self.configs]
            missing = [n for n in mine if n not in set(names)]
            extra = [n for n in names if n not in set(mine)]
            detail = ""
            if missing or extra:
                detail = (f"; operators in the plan but not the function: {missing[:3]}"
                          f"; in the function but not the plan: {extra[:3]}")
            raise PlanError(
                f"this plan was made for model {self.model!r} ({self.num_operators} operators, "
                f"fingerprint {self.graph_fingerprint}), but the function traces to "
                f"{graph.name!r} ({len(graph.operators)} operators, fingerprint "
                f"{graph.fingerprint()}){detail}; make a new plan with `soapjax plan`")
        self._check_names(graph)
        if topology is None:
            return
        if topology.fingerprint() != self.topology_fingerprint:
            raise PlanError(
                f"this plan was made for topology {self.topology!r} (fingerprint "
                f"{self.topology_fingerprint}, mesh {_axes_text(self.mesh)}), not "
                f"{topology.name!r} (fingerprint {topology.fingerprint()}, mesh "
                f"{_axes_text(MeshShape.of(topology))})")
        if MeshShape.of(topology) != self.mesh:
            raise PlanError(
                f"the plan's mesh axes {_axes_text(self.mesh)} differ from those of its "
                f"topology {topology.name!r}, {_axes_text(MeshShape.of(topology))} (was "
                "\"topology\": {\"axes\": ...} edited?); a plan's configs are for the mesh it "
                "was searched on: restore the axes, or make a new plan with `soapjax plan "
                "--mesh` on a topology file with the axes you want")

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
                      "workload": self.workload, "batch_size": self.batch_size},
            "topology": {"name": self.topology, "fingerprint": self.topology_fingerprint,
                         "axes": dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))},
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
        """Reads `to_json` output; raises PlanError naming what is missing or malformed."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise PlanError(f"{where}: not a soapjax plan (expected \"format\": \"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise PlanError(f"{where}: plan format version {data.get('version')!r} is not "
                            f"supported; this soapjax reads version {VERSION}")
        try:
            m, t = data["model"], data["topology"]
            mesh = MeshShape(tuple(t["axes"]), tuple(int(v) for v in t["axes"].values()))
            configs = tuple((name, Config(tuple(tuple(a) for a in op["axes"])))
                            for name, op in data["operators"].items())
            roles = tuple(op.get("roles") for op in data["operators"].values())
            roles = () if None in roles else roles
            recompute = tuple(op.get("recompute", "none") for op in data["operators"].values())
            recompute = () if all(p == "none" for p in recompute) else recompute
            for name, c in configs:
                bad = c.used_axes - set(mesh.axis_names)
                if bad:
                    raise PlanError(f"{where}: operator {name!r} uses mesh axes {sorted(bad)} "
                                    f"not in the plan's mesh {list(mesh.axis_names)}")
            if roles:
                _check_specs(data["operators"], configs, roles, where)
            return cls(
                model=m["name"], model_config=m.get("config", ""),
                graph_fingerprint=m["fingerprint"], num_operators=int(m["num_operators"]),
                topology=t["name"], topology_fingerprint=t["fingerprint"], mesh=mesh,
                configs=configs, zero_axes=tuple(data.get("zero_axes", ())),
                params=tuple((p, tuple(tuple(a) for a in s))
                             for p, s in data.get("params", {}).items()),
                predicted=_freeze(data.get("predicted", {})),
                cost_source=data.get("cost_source", "analytic"),
                search=_freeze(data.get("search", {})),
                baselines=tuple((k, float(v)) for k, v in data.get("baselines", {}).items()),
                roles=roles, workload=m.get("workload", ""),
                microbatches=int(data.get("microbatches", 1)), recompute=recompute,
                pipeline=_pipeline(data.get("pipeline", {})),
                stage_layers=_stage_layers(data.get("pipeline", {})),
                batch_size=int(m.get("batch_size", 0)),
                optimizer_axes=tuple(data.get("optimizer_axes", ())),
                ring_attention=data.get("ring_attention", False))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"{where}: malformed plan: {type(e).__name__}: {e}") from e

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
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None
        return cls.from_json(data, where=str(path))


def check_plan_path(path: str | os.PathLike) -> None:
    """PlanError unless a plan can be written to `path` as far as can be told without writing:
    not a directory, and its nearest existing folder a writable directory (what `Plan.save`
    checks first, and the command line before it searches)."""
    path = Path(path)
    if path.is_dir():
        raise PlanError(f"cannot write the plan to {path}: it is a directory; expected a "
                        f"file path, e.g. {path / 'plan.json'}")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        what = "not a directory" if not folder.is_dir() else "not writable"
        raise PlanError(f"cannot write the plan to {path}: {folder} is {what}; expected a "
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
