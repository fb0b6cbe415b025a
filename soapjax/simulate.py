"""The execution simulator: a training step's task graph, its timeline, memory, and trace export.

FlexFlow (section 5) predicts a strategy's step time by building a task graph (compute tasks on
devices, communication tasks on links) and timing it; soapjax does the same for one SPMD program.

**Symmetric SPMD.** Under one SPMD program every device runs the same sequence of per-device
programs on equal-size shards, so one compute timeline stands for every device exactly. (The
paper needed per-device tasks only to place operators on subsets of devices, its O dimension,
which one SPMD program does not have.) The resources are one compute stream and one FIFO
resource per topology channel (`Topology.channels_used`); a collective is ONE task on all its
channels, since `Topology.collective_time` already prices the sharing inside it. Channels that
every collective uses alike (the InfiniBand NICs of the 16 nodes of ``k80x64``) see the same
tasks in the same order, so they are simulated once and drawn once per channel in the trace.

**Program order.** Tasks are issued in the compiled program's fixed order and each resource runs
its tasks in that order (A3); a task starts at the latest end among its dependencies and the
previous task on each of its resources (A4). The timeline is thus a pure function of the task
graph, and the delta simulation (Algorithm 2), which recomputes only the tasks whose inputs
changed, gives exactly, bit for bit, the timeline of the full simulation (Algorithm 1).

The task graph of one training iteration, operators in program order (`soapjax._taskgraph`):

* forward, per operator: the resharding of parameters stored in another layout (a ZeRO-3
  all-gather), of each input from its producer's output spec to the spec the config needs (the
  collectives `Resharder.reshard` says XLA emits; operators that read one value in the same
  layout share one resharding, as XLA computes it once), the forward task (`CostModel.op_time`), and,
  when the config splits a reduction dim, the all-reduce of the partial sums of its (primary)
  output;
* backward, in reverse order: the backward task, after the backward of every consumer of its
  outputs and their cotangents' communication; per input, the cotangent's way back: it is laid
  out as the operator's operand and is a partial sum over the mesh axes the config uses that do
  not split that operand (a column-parallel matmul's replicated input), so it goes back by
  ``reshard(operand spec -> producer spec, partial=those axes)``. That is the transpose of the
  forward resharding (all-gather -> reduce-scatter, all-to-all -> all-to-all, ...) wherever the
  cotangent is a partial sum over the gathered axes, and a free slice where it is replicated
  over them, as XLA's partitioner does; the forward all-reduce of partial sums has none.
  Parameters go back the same way to their stored layout: the gradient synchronisation
  (all-reduce over the batch axes under data parallelism, reduce-scatter under ZeRO), issued
  right after the backward task that completes the gradient, so it overlaps with the rest of
  the backward pass as XLA schedules it;
* the optimizer update of every parameter shard (`CostModel.update_time`) after its gradient,
  in the order gradients complete.

Parameters (and batch inputs) are stored in the layout of the first operator that reads them,
split further over `Strategy.zero_axes` where divisible; other readers reshard them before their
forward task. Each reader's gradient contribution is synchronised on its own and the results
summed, as XLA does (a tied embedding's gradient is all-reduced twice under data parallelism).
An operator replicated over a mesh axis costs compute on every device of it: its shard is
bigger.

**Memory** per device (the same on every device): parameters, gradients and optimizer state
(``opt_state_factor`` x parameter bytes: 2 for Adam; see `opt_state_factor`) at their shard
sizes; every forward output's shard, kept for the backward pass (the peak is where the forward
ends and the backward begins, when all of them are alive), with the batch and the parameters
gathered for another layout; and the largest communication buffer.

Example::

    sim = Simulation(graph, topology, cost_model, resharder, data_parallel(graph, mesh))
    t = sim.propose(3, config)          # delta-simulate one operator's new config
    sim.accept() if t < best else sim.reject()
    sim.result().to_chrome_trace()      # {"traceEvents": [...]} for Perfetto / chrome://tracing
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import jax


from soapjax import baselines
from soapjax import plan as plan_mod
from soapjax._dtypes import itemsize
from soapjax._taskgraph import EDGE, LEAF, Comm, Layout, Pricing, TaskGraph
from soapjax.cost import OpTime
from soapjax.cost import cost_model as make_cost_model
from soapjax.errors import PlanError
from soapjax.graph import OpGraph
from soapjax.reshard import Resharder, ReshardModel
from soapjax.space import (
    Config,
    MeshShape,
    Strategy,
    data_parallel,
    storage_spec,
    validate_config,
)
from soapjax.topology import Topology

# Task kinds (`TaskRecord.kind`).
FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
RESHARD, RESHARD_BWD, PARTIAL_SUM, PARAM_GATHER, GRAD_SYNC = (
    "reshard", "reshard_backward", "partial_sum", "param_gather", "grad_sync")


class TaskRecord(NamedTuple):
    """One task of the simulated timeline.

    Attributes:
      name: e.g. ``"forward layers_0/mlp/fc1"``, ``"all_gather layers_0/ln_1 -> layers_0/attn/query
        over model"`` (a resharding; ``d(...)`` for its backward) or ``"all_reduce grad
        ['params']['fc1']['kernel'] over data"``.
      kind: forward, backward, update, reshard, reshard_backward, partial_sum, param_gather or
        grad_sync.
      resources: ``("compute",)`` or the topology channel ids it occupies.
      start_s, end_s: seconds from the start of the step.
      nbytes: a collective's per-device buffer (`Topology.collective_time`'s ``nbytes``); 0 for
        compute.
      sent: the bytes each device sends in it (`collectives.bytes_sent`); 0 for compute.
    """

    name: str
    kind: str
    resources: tuple[str, ...]
    start_s: float
    end_s: float
    nbytes: int
    sent: float = 0.0


class MemoryBreakdown(NamedTuple):
    """Bytes per device at the peak (the same on every device under SPMD)."""

    params: int
    grads: int
    opt_state: int
    activations: int
    comm_buffers: int

    @property
    def total(self) -> int:
        return sum(self)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """The simulated training step of one strategy.

    Attributes:
      step_time_s: predicted iteration time.
      compute_s: busy time of the compute stream (forward, backward and update tasks).
      exposed_comm_s: ``step_time_s - compute_s``: communication not hidden behind compute.
      bytes_moved: bytes each device sends over the whole step.
      bytes_by_link_class: the same, by the link class that limits each collective.
      peak_memory_bytes: peak bytes per device, one entry per device; all equal under SPMD
        symmetry (every device holds same-size shards).
      memory: what the peak is made of.
      memory_capacity_bytes: each device's memory (`Topology.device.memory_bytes`).
      fits_in_memory: whether the peak fits in it.
      cost_source: where compute times came from (``measured``, ``analytic``, ...).
      num_devices: devices in the mesh.
      tasks: every task, in issue order.
      channels: the topology channels, in trace order.
    """

    step_time_s: float
    compute_s: float
    exposed_comm_s: float
    bytes_moved: float
    bytes_by_link_class: dict[str, float]
    peak_memory_bytes: tuple[int, ...]
    memory: MemoryBreakdown
    memory_capacity_bytes: int
    fits_in_memory: bool
    cost_source: str
    num_devices: int
    tasks: tuple[TaskRecord, ...] = dataclasses.field(repr=False)
    channels: tuple[str, ...] = dataclasses.field(repr=False, default=())

    def to_json(self, *, tasks: bool = False) -> dict[str, Any]:
        """The result as JSON-ready data; with ``tasks=True`` the whole timeline too."""
        out = {
            "step_time_s": self.step_time_s, "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s, "bytes_moved": self.bytes_moved,
            "bytes_by_link_class": dict(self.bytes_by_link_class),
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "memory": self.memory._asdict(), "memory_capacity_bytes": self.memory_capacity_bytes,
            "fits_in_memory": self.fits_in_memory, "cost_source": self.cost_source,
            "num_devices": self.num_devices, "num_tasks": len(self.tasks),
        }
        if tasks:
            out["tasks"] = [t._asdict() | {"resources": list(t.resources)} for t in self.tasks]
        return out

    def to_chrome_trace(self, *, max_device_tracks: int = 64) -> dict[str, Any]:
        """The timeline in Chrome trace format (Perfetto, chrome://tracing).

        Process 1 has one track per device with the compute tasks (identical on every device
        under SPMD; at most `max_device_tracks` of them, the rest are the same); process 2 has
        one track per topology channel with the collectives on it. Times are microseconds.
        """
        shown = min(self.num_devices, max_device_tracks)
        ev: list[dict[str, Any]] = [
            _meta("process_name", 1, None, f"devices (SPMD: all {self.num_devices} identical)"),
            _meta("process_name", 2, None, "links (topology channels)"),
        ]
        for d in range(shown):
            ev.append(_meta("thread_name", 1, d, f"device:{d} compute"))
        tid = {c: i for i, c in enumerate(self.channels)}
        for c, i in tid.items():
            ev.append(_meta("thread_name", 2, i, c))
        for t in self.tasks:
            base = {"name": t.name, "cat": t.kind, "ph": "X", "ts": t.start_s * 1e6,
                    "dur": (t.end_s - t.start_s) * 1e6}
            if t.resources == ("compute",):
                ev.extend(base | {"pid": 1, "tid": d} for d in range(shown))
            else:
                args = {"nbytes": t.nbytes}
                ev.extend(base | {"pid": 2, "tid": tid[c], "args": args} for c in t.resources)
        other = {"step_time_s": self.step_time_s, "device_tracks": shown}
        if shown < self.num_devices:
            other["note"] = (f"{self.num_devices} devices run identical timelines; "
                             f"{shown} device tracks shown")
        return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": other}


def _meta(what: str, pid: int, tid: int | None, name: str) -> dict[str, Any]:
    ev = {"name": what, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        ev["tid"] = tid
    return ev


class _View(NamedTuple):
    """One operator under one config: times, tensor specs, partial sums, activation bytes."""

    config: Config
    fwd: float
    bwd: float
    out_specs: tuple[tuple[tuple[str, ...], ...], ...]
    operand_specs: tuple[tuple[tuple[str, ...], ...], ...]
    partials: tuple[tuple[str, ...], ...]  # per operand: axes its cotangent is a partial sum on
    red_axes: tuple[str, ...]
    act_bytes: int


def shard_bytes(shape: Sequence[int], spec: Sequence[Sequence[str]], dtype: str,
                mesh: MeshShape) -> int:
    """Bytes of one device's shard of a tensor laid out as `spec` (per-dim mesh axes)."""
    n = itemsize(dtype)
    for size, axes in zip(shape, spec):
        d = mesh.degree(axes)
        n *= size // d if size % d == 0 else size
    for size in shape[len(spec):]:
        n *= size
    return n


# --- the simulation ---------------------------------------------------------------------------


class OpCosts(Protocol):
    """What the simulator asks of a cost model (`soapjax.cost.CostModel` is one).

    Attributes:
      source: how the times were obtained (``"measured"``, ``"analytic"``), for the result.
    """

    source: str

    def op_time(self, op_index: int, config: Config) -> OpTime:
        """Forward and backward seconds of operator `op_index` under `config`."""
        ...

    def update_time(self, param_shard_bytes: float) -> float:
        """Seconds of the optimizer update of a parameter shard of that many bytes."""
        ...


class Simulation:
    """A strategy's simulated step, kept up to date under single-operator changes.

    The search owns one: `propose` delta-simulates a new config for one operator and returns the
    new step time; `accept` keeps it, `reject` rolls it back (cheaply: the old tasks are kept
    until then). The state always equals a full simulation of the current strategy.

    Args:
      graph: the operator graph.
      topology: the cluster; its mesh axes are the mesh.
      cost_model: gives `op_time(i, config)` and `update_time(bytes)` (see `soapjax.cost`).
      resharder: gives the collectives of a resharding (see `soapjax.reshard`).
      strategy: the initial strategy.
      opt_state_factor: optimizer state bytes per parameter byte (2 for Adam).
    """

    def __init__(self, graph: OpGraph, topology: Topology, cost_model: OpCosts,
                 resharder: ReshardModel,
                 strategy: Strategy, *, opt_state_factor: float = 2.0) -> None:
        self.graph = graph
        self.topology = topology
        self.cost_model = cost_model
        self.mesh = MeshShape.of(topology)
        self.opt_state_factor = float(opt_state_factor)
        self._layout = Layout(graph)
        self._pricing = Pricing(topology, resharder)
        self._views_memo: dict[tuple[int, Config], _View] = {}
        self._pending: _Undo | None = None
        self._prefetch(strategy, ())  # compile the first strategy's reshardings in one batch
        self.reset(strategy)

    # --- public -------------------------------------------------------------------------------

    @property
    def strategy(self) -> Strategy:
        """The current strategy (with a pending proposal applied)."""
        return Strategy(tuple(v.config for v in self._views), self._zero)

    def step_time(self) -> float:
        """The simulated step time of the current strategy."""
        return self._tg.step_time()

    def peak_memory_bytes(self) -> int:
        """Peak bytes per device of the current strategy."""
        return self._memory().total

    def fits_in_memory(self) -> bool:
        return self.peak_memory_bytes() <= self.topology.device.memory_bytes

    def reset(self, strategy: Strategy) -> float:
        """Full simulation (Algorithm 1): rebuilds the task graph and timeline from scratch."""
        if self._pending is not None:
            raise RuntimeError("accept() or reject() the pending proposal before reset()")
        self._build(strategy)
        self._tg.full_pass()
        return self._tg.step_time()

    def prefetch(self, changes: Iterable[tuple[int, Config]] = ()) -> int:
        """Has the resharder work out at once (`Resharder.prefetch`: one batch of compilations)
        every resharding that the current strategy and the given single-operator changes need.

        Returns:
          How many reshardings were compiled (0 for those already known).
        """
        return self._prefetch(self.strategy, changes)

    def _prefetch(self, strategy: Strategy, changes: Iterable[tuple[int, Config]]) -> int:
        prefetch = getattr(self._pricing.resharder, "prefetch", None)
        if prefetch is None:
            return 0
        seen: list = []
        shadow = copy.copy(self)  # `_build` gives it its own task graph and unit lists
        shadow._pricing, shadow._pending = self._pricing.recording(seen), None
        shadow.reset(strategy)
        for i, config in changes:
            shadow.propose(i, config)
            shadow.reject()
        return prefetch(seen)

    def _build(self, strategy: Strategy) -> None:
        """Builds the task graph of `strategy` (untimed)."""
        st = self._layout
        if len(strategy.configs) != st.n:
            raise PlanError(f"strategy has {len(strategy.configs)} configs, graph "
                            f"{self.graph.name!r} has {st.n} operators")
        unknown = [a for a in strategy.zero_axes if a not in self.mesh.axis_names]
        if unknown:
            raise PlanError(f"zero_axes {unknown} are not mesh axes {list(self.mesh.axis_names)}")
        self._zero = tuple(strategy.zero_axes)
        self._views = [self._view(j, c) for j, c in enumerate(strategy.configs)]
        self._tg = tg = TaskGraph(len(self._pricing.resource_channels))
        self._buffers: dict[int, int] = {}
        self._fwd = [tg.new(st.fwd_key(j, st.slots - 2), v.fwd, (0,), [], (FORWARD, j))
                     for j, v in enumerate(self._views)]
        self._bwd = [tg.new(st.bwd_key(j, 0), v.bwd, (0,), [], (BACKWARD, j))
                     for j, v in enumerate(self._views)]
        self._red = [self._build_red(j) for j in range(st.n)]
        self._efwd, self._ebwd = [], []
        for e in range(len(st.edges)):
            f, b = self._build_edge(e)
            self._efwd.append(f)
            self._ebwd.append(b)
        n_leaves = len(st.leaf_source)
        self._leaf_tasks: list[list[int]] = [[]] * n_leaves
        self._gtail: list[list[int]] = [[]] * n_leaves
        self._leaf_mem: list[tuple[int, int]] = [(0, 0)] * n_leaves  # (stored, activations)
        for leaf in range(n_leaves):
            self._set_leaf(leaf, self._build_leaf(leaf))
        for j in range(st.n):
            tg.deps[self._fwd[j]] = self._fwd_deps(j)
            tg.deps[self._bwd[j]] = self._bwd_deps(j)
        self._act = sum(v.act_bytes for v in self._views)
        self._stored = sum(m[0] for m in self._leaf_mem)
        self._leaf_act = sum(m[1] for m in self._leaf_mem)
        tg.build()
        self._count_buffers([t for t in tg.order if tg.info[t][0] not in (FORWARD, BACKWARD)],
                            +1)

    def propose(self, i: int, config: Config) -> float:
        """Delta-simulates operator `i` taking `config` (Algorithm 2); returns the step time.

        Rebuilds the tasks whose collectives the change touches (operator `i`'s partial-sum
        all-reduce, the reshardings of its input and output edges, the gathers, gradient
        synchronisations and updates of the parameters it reads), retimes its forward and
        backward tasks, and retimes the timeline from the first changed task on, as far as the
        change reaches. The change stays pending until `accept` or `reject`.

        Raises:
          PlanError: `config` does not fit operator `i` or the mesh.
          RuntimeError: a proposal is already pending.
        """
        if self._pending is not None:
            raise RuntimeError("accept() or reject() the pending proposal before proposing again")
        view, old = self._view(i, config), self._views[i]
        undo = self._pending = _Undo(i, old)
        if view.config == old.config:
            return self._tg.step_time()
        st, tg = self._layout, self._tg
        undo.start, undo.end = list(tg.start), list(tg.end)
        undo.act, undo.stored, undo.leaf_act = self._act, self._stored, self._leaf_act
        self._views[i] = view
        self._act += view.act_bytes - old.act_bytes
        # The units whose collectives change (the rest keep their tasks).
        red = (view.out_specs[0:1], view.red_axes) != (old.out_specs[0:1], old.red_axes)
        changed = [e for e in st.in_edges[i] + st.out_edges[i]
                   if self._edge_sig(e, i, view) != self._edge_sig(e, i, old)
                   or (red and st.edges[e][0] == i and st.edges[e][1] == 0)]
        # ... and the edges that share a value with them (which one reshards it may change)
        edges = sorted({s for e in changed for s in st.siblings[e]})
        leaves = [leaf for leaf in st.op_leaves[i]
                  if any((view.operand_specs[o], view.partials[o])
                         != (old.operand_specs[o], old.partials[o])
                         for j, o in st.readers[leaf] if j == i)]
        # Take their old tasks off the graph (kept for reject), then build the new ones.
        undo.red = self._red[i] if red else None
        undo.edges = [(e, self._efwd[e], self._ebwd[e]) for e in edges]
        undo.leaves = [(leaf, self._leaf_tasks[leaf], self._gtail[leaf], self._leaf_mem[leaf])
                       for leaf in leaves]
        old_tasks = undo.old_tasks = list(self._red[i]) if red else []
        old_tasks += [t for _, f, b in undo.edges for t in f + b]
        old_tasks += [t for _, tasks, _, _ in undo.leaves for t in tasks]
        for t in old_tasks:
            tg.detach(t)
        self._count_buffers(old_tasks, -1)
        new = undo.new_tasks
        if red:
            self._red[i] = self._build_red(i)
            new += self._red[i]
        for e in edges:
            f, b = self._efwd[e], self._ebwd[e] = self._build_edge(e)
            new += f + b
        for leaf in leaves:
            self._stored -= self._leaf_mem[leaf][0]
            self._leaf_act -= self._leaf_mem[leaf][1]
            self._set_leaf(leaf, self._build_leaf(leaf))
            self._stored += self._leaf_mem[leaf][0]
            self._leaf_act += self._leaf_mem[leaf][1]
            new += self._leaf_tasks[leaf]
        for t in new:
            tg.attach(t)
        self._count_buffers(new, +1)
        # Retime the operator and rewire the compute tasks that read the rebuilt units.
        tg.set_dur(self._fwd[i], view.fwd)
        tg.set_dur(self._bwd[i], view.bwd)
        fwd_of = {i} | {st.edges[e][2] for e in edges}
        fwd_of |= {j for leaf in leaves for j, _ in st.readers[leaf]}
        bwd_of = {i} | {st.edges[e][0] for e in edges}
        for j in fwd_of:
            undo.deps.append((self._fwd[j], tg.set_deps(self._fwd[j], self._fwd_deps(j))))
        for j in bwd_of:
            undo.deps.append((self._bwd[j], tg.set_deps(self._bwd[j], self._bwd_deps(j))))
        tg.sweep()
        return tg.step_time()

    def _edge_sig(self, e: int, i: int, view: _View) -> tuple:
        """What edge `e`'s collectives depend on, with operator `i` under `view`."""
        p, k, j, o = self._layout.edges[e]
        src = (view if p == i else self._views[p]).out_specs[k]
        cons = view if j == i else self._views[j]
        return src, cons.operand_specs[o], cons.partials[o]

    def accept(self) -> None:
        """Keeps the pending proposal."""
        undo = self._take_pending()
        self._tg.release(undo.old_tasks)

    def reject(self) -> None:
        """Rolls the pending proposal back: the old tasks return, with their old times."""
        undo = self._take_pending()
        tg, i = self._tg, undo.i
        if undo.view.config == self._views[i].config:
            return
        for t, deps in reversed(undo.deps):
            tg.set_deps(t, deps)
        for t in reversed(undo.new_tasks):
            tg.detach(t)
        self._count_buffers(undo.new_tasks, -1)
        tg.release(undo.new_tasks)
        for t in undo.old_tasks:
            tg.attach(t)
        self._count_buffers(undo.old_tasks, +1)
        tg.dur[self._fwd[i]] = undo.view.fwd
        tg.dur[self._bwd[i]] = undo.view.bwd
        self._views[i] = undo.view
        if undo.red is not None:
            self._red[i] = undo.red
        for e, f, b in undo.edges:
            self._efwd[e], self._ebwd[e] = f, b
        for leaf, tasks, gtail, mem in undo.leaves:
            self._leaf_tasks[leaf], self._gtail[leaf], self._leaf_mem[leaf] = tasks, gtail, mem
        self._act, self._stored, self._leaf_act = undo.act, undo.stored, undo.leaf_act
        n = len(undo.start)
        tg.start[:n] = undo.start
        tg.end[:n] = undo.end
        tg.discard_marks()

    def result(self) -> SimResult:
        """A frozen summary of the current state (a pending proposal included)."""
        tg, pricing = self._tg, self._pricing
        records, compute, sent = [], 0.0, 0.0
        by_class: dict[str, float] = {}
        for t in tg.order:
            kind, ref = tg.info[t][0], tg.info[t][1]
            if kind in (FORWARD, BACKWARD, UPDATE):
                compute += tg.dur[t]
                records.append(TaskRecord(self._task_name(t), kind, ("compute",), tg.start[t],
                                          tg.end[t], 0))
                continue
            sent += ref.sent
            by_class[ref.link_class] = by_class.get(ref.link_class, 0.0) + ref.sent
            chans = tuple(c for r in tg.res[t] for c in pricing.resource_channels[r])
            records.append(TaskRecord(self._task_name(t), kind, chans, tg.start[t], tg.end[t],
                                      ref.nbytes, ref.sent))
        step = tg.step_time()
        mem = self._memory()
        cap = self.topology.device.memory_bytes
        return SimResult(
            step_time_s=step, compute_s=compute, exposed_comm_s=step - compute, bytes_moved=sent,
            bytes_by_link_class=by_class, peak_memory_bytes=(mem.total,) * self.mesh.num_devices,
            memory=mem, memory_capacity_bytes=cap, fits_in_memory=mem.total <= cap,
            cost_source=str(getattr(self.cost_model, "source", "unknown")),
            num_devices=self.mesh.num_devices, tasks=tuple(records), channels=pricing.channels)

    def timeline(self) -> list[tuple[str, float, float]]:
        """``(task name, start, end)`` of every task in issue order (for exact comparisons)."""
        tg = self._tg
        return [(self._task_name(t), tg.start[t], tg.end[t]) for t in tg.order]

    # --- building units -----------------------------------------------------------------------

    def _view(self, j: int, config: Config) -> _View:
        key = (j, config)
        v = self._views_memo.get(key)
        if v is None:
            validate_config(self.graph, j, config, self.mesh)
            op = self.graph.operators[j]
            t = self.cost_model.op_time(j, config)
            outs = tuple(config.operand_axes(x.dims) for x in op.outputs)
            specs = tuple(config.operand_axes(x.dims) for x in op.inputs)
            used = config.used_axes
            partials = tuple(tuple(a for a in self.mesh.axis_names if a in used
                                   and not any(a in d for d in spec)) for spec in specs)
            act = sum(shard_bytes(x.shape, s, x.dtype, self.mesh)
                      for x, s in zip(op.outputs, outs))
            v = self._views_memo[key] = _View(config, float(t.forward_s), float(t.backward_s),
                                              outs, specs, partials,
                                              tuple(config.reduction_axes(op)), act)
        return v

    def _chain_tasks(self, chain: tuple[Comm, ...], key: int, head: list[int], kind: str,
                     subject: Any) -> list[int]:
        tg, out = self._tg, []
        for pos, c in enumerate(chain):
            out.append(tg.new(key + pos, c.dur, c.res, [out[-1]] if out else list(head),
                              (kind, c, subject)))
        return out

    def _build_red(self, j: int) -> list[int]:
        v = self._views[j]
        if not v.red_axes:
            return []
        x = self.graph.operators[j].outputs[0]
        chain = self._pricing.chain(x.shape, x.dtype, v.out_specs[0], v.out_specs[0], v.red_axes)
        key = self._layout.fwd_key(j, self._layout.slots - 1)
        return self._chain_tasks(chain, key, [self._fwd[j]], PARTIAL_SUM, j)

    def _owner(self, e: int) -> int:
        """The first edge carrying edge `e`'s value to the same layout: its forward resharding
        serves both (XLA computes the collective once; the backward ones stay separate)."""
        st, views = self._layout, self._views
        _, _, j, o = st.edges[e]
        dst = views[j].operand_specs[o]
        for s in st.siblings[e]:
            if s == e or views[st.edges[s][2]].operand_specs[st.edges[s][3]] == dst:
                return s
        return e

    def _build_edge(self, e: int) -> tuple[list[int], list[int]]:
        st = self._layout
        p, k, j, o = st.edges[e]
        x = self.graph.operators[j].inputs[o]
        src, dst = self._views[p].out_specs[k], self._views[j].operand_specs[o]
        red = self._red[p] if k == 0 else []
        head = [red[-1] if red else self._fwd[p]]
        fwd = [] if self._owner(e) != e else self._chain_tasks(
            self._pricing.chain(x.shape, x.dtype, src, dst), st.fwd_key(j, o), head, RESHARD, e)
        back = self._pricing.chain(x.shape, x.dtype, dst, src, self._views[j].partials[o])
        bwd = self._chain_tasks(back, st.bwd_key(j, 1 + o), [self._bwd[j]], RESHARD_BWD, e)
        return fwd, bwd

    def _storage(self, leaf: int) -> tuple[tuple[str, ...], ...]:
        """A leaf's layout: `space.storage_spec` of its first reader's operand spec."""
        st = self._layout
        j, o = st.readers[leaf][0]
        zero = self._zero if st.leaf_is_param[leaf] else ()
        return storage_spec(self._views[j].operand_specs[o], st.leaf_shape[leaf], zero, self.mesh)

    def _build_leaf(self, leaf: int) -> tuple[list[int], list[int], tuple[int, int]]:
        """A parameter's or batch leaf's tasks: gathers, gradient syncs, update; and its bytes."""
        st, pricing = self._layout, self._pricing
        shape, dtype, readers = st.leaf_shape[leaf], st.leaf_dtype[leaf], st.readers[leaf]
        store = self._storage(leaf)
        tasks, gtail = [], []
        act = 0 if st.leaf_is_param[leaf] else shard_bytes(shape, store, dtype, self.mesh)
        for j, o in readers:
            spec = self._views[j].operand_specs[o]
            if spec != store:
                act += shard_bytes(shape, spec, dtype, self.mesh)
            g = self._chain_tasks(pricing.chain(shape, dtype, store, spec), st.fwd_key(j, o), [],
                                  PARAM_GATHER, leaf)
            tasks += g
            gtail.append(g[-1] if g else -1)
        if not st.leaf_is_param[leaf]:
            return tasks, gtail, (0, act)
        # Each reader's gradient contribution is synchronised on its own, right after that
        # reader's backward, and the synced contributions are summed: XLA's partitioner puts
        # the all-reduce (or reduce-scatter) at the operation that makes the partial sum, before
        # the add, so a tied embedding's gradient is all-reduced twice (seen in compiled HLO).
        ready: list[int] = []
        for j, o in reversed(readers):
            v = self._views[j]
            chain = pricing.chain(shape, dtype, v.operand_specs[o], store, v.partials[o])
            sync = self._chain_tasks(chain, st.bwd_key(j, 1 + o), [self._bwd[j]], GRAD_SYNC,
                                     leaf)
            tasks += sync
            ready += sync[-1:] if sync else [self._bwd[j]]
        stored = shard_bytes(shape, store, dtype, self.mesh)
        upd = self._tg.new(st.key(st.update_seg[leaf], 0), self.cost_model.update_time(stored),
                           (0,), ready, (UPDATE, leaf))
        tasks.append(upd)
        return tasks, gtail, (stored, act)

    def _set_leaf(self, leaf: int, built: tuple[list[int], list[int], tuple[int, int]]) -> None:
        self._leaf_tasks[leaf], self._gtail[leaf], self._leaf_mem[leaf] = built

    def _fwd_deps(self, j: int) -> list[int]:
        st, out = self._layout, []
        for code, ref, r in st.operands[j]:
            if code == EDGE:
                chain = self._efwd[self._owner(ref)]
                if chain:
                    out.append(chain[-1])
                else:
                    p, k = st.edges[ref][0], st.edges[ref][1]
                    red = self._red[p] if k == 0 else []
                    out.append(red[-1] if red else self._fwd[p])
            elif code == LEAF:
                t = self._gtail[ref][r]
                if t >= 0:
                    out.append(t)
        return out

    def _bwd_deps(self, j: int) -> list[int]:
        st, out = self._layout, []
        for e in st.out_edges[j]:
            chain = self._ebwd[e]
            out.append(chain[-1] if chain else self._bwd[st.edges[e][2]])
        return out

    # --- accounting ---------------------------------------------------------------------------

    def _count_buffers(self, tasks: list[int], sign: int) -> None:
        info, buf = self._tg.info, self._buffers
        for t in tasks:
            if info[t][0] != UPDATE:
                n = info[t][1].nbytes
                c = buf.get(n, 0) + sign
                if c:
                    buf[n] = c
                else:
                    del buf[n]

    def _memory(self) -> MemoryBreakdown:
        p = self._stored
        return MemoryBreakdown(params=p, grads=p, opt_state=round(p * self.opt_state_factor),
                               activations=self._act + self._leaf_act,
                               comm_buffers=max(self._buffers, default=0))

    def _task_name(self, t: int) -> str:
        kind, ref, *subject = self._tg.info[t]
        ops, st = self.graph.operators, self._layout
        if kind in (FORWARD, BACKWARD):
            return f"{kind} {ops[ref].name}"
        if kind == UPDATE:
            return f"update {st.leaf_source[ref]}"
        x = subject[0]
        what = (st.edge_name[x] if kind == RESHARD else f"d({st.edge_name[x]})"
                if kind == RESHARD_BWD else f"{ops[x].name} (partial sums)"
                if kind == PARTIAL_SUM else st.leaf_source[x]
                if kind == PARAM_GATHER else f"grad {st.leaf_source[x]}")
        return f"{ref.kind} {what} over {'+'.join(ref.axes)}"

    def _take_pending(self) -> _Undo:
        if self._pending is None:
            raise RuntimeError("no pending proposal: call propose() first")
        undo, self._pending = self._pending, None
        return undo


class _Undo:
    """What `reject` needs to restore the state before a proposal."""

    __slots__ = ("act", "deps", "edges", "end", "i", "leaf_act", "leaves", "new_tasks",
                 "old_tasks", "red", "start", "stored", "view")

    def __init__(self, i: int, view: _View) -> None:
        self.i, self.view = i, view
        self.start: list[float] = []
        self.end: list[float] = []
        self.act = self.stored = self.leaf_act = 0
        self.red: list[int] | None = None
        self.edges: list[tuple[int, list[int], list[int]]] = []
        self.leaves: list[tuple] = []
        self.old_tasks: list[int] = []
        self.new_tasks: list[int] = []
        self.deps: list[tuple[int, list[int]]] = []


# --- entry points -----------------------------------------------------------------------------


def simulate(graph: OpGraph, topology: Topology, strategy: Strategy, *,
             cost_model: OpCosts | None = None, resharder: ReshardModel | None = None,
             opt_state_factor: float = 2.0) -> SimResult:
    """Full simulation of one training step of `strategy` (Algorithm 1).

    Args:
      graph: the operator graph (`soapjax.graph.trace`).
      topology: the cluster (`soapjax.topology.load_topology`).
      strategy: a config per operator.
      cost_model: defaults to ``soapjax.cost.cost_model(graph, topology)``.
      resharder: defaults to a `soapjax.reshard.Resharder` on the topology's mesh in the
        default mode (`soapjax.reshard.DEFAULT_MODE`, as `soapjax.search.find_plan`).
      opt_state_factor: optimizer state bytes per parameter byte (2 for Adam; `opt_state_factor`).

    Returns:
      The step time, its breakdown, memory per device and the timeline.
    """
    cost_model = cost_model if cost_model is not None else make_cost_model(graph, topology)
    resharder = resharder if resharder is not None else Resharder(MeshShape.of(topology))
    return Simulation(graph, topology, cost_model, resharder, strategy,
                      opt_state_factor=opt_state_factor).result()


def compare(graph: OpGraph, topology: Topology, strategies: Mapping[str, Strategy], *,
            cost_model: OpCosts | None = None, resharder: ReshardModel | None = None,
            opt_state_factor: float = 2.0) -> dict[str, SimResult]:
    """Simulates several strategies with the same costs, like for like (`simulate` each).

    Example::

        results = compare(graph, topology, {"plan": plan.strategy(graph),
                                            **baselines.baselines(graph, topology)})
        soapjax.plot.comparison_figure(results)

    Returns:
      Strategy name -> its `SimResult`, in the order given.
    """
    cost_model = cost_model if cost_model is not None else make_cost_model(graph, topology)
    resharder = resharder if resharder is not None else Resharder(MeshShape.of(topology))
    return {name: simulate(graph, topology, s, cost_model=cost_model, resharder=resharder,
                           opt_state_factor=opt_state_factor) for name, s in strategies.items()}


def opt_state_factor(optimizer: Any, params: Any) -> float:
    """Optimizer state bytes per parameter byte, from `jax.eval_shape` (nothing allocated).

    Example: ``opt_state_factor(optax.adam(1e-3), params)`` is 2.0 (plus a step counter).
    """
    def nbytes(tree: Any) -> int:
        return sum(math.prod(x.shape) * itemsize(x.dtype)
                   for x in jax.tree.leaves(tree) if hasattr(x, "shape"))

    state = jax.eval_shape(optimizer.init, params)
    return nbytes(state) / max(nbytes(params), 1)


def parse_strategy(graph: OpGraph, topology: Topology, spec: str | Mapping[str, Any], *,
                   family: str | None = None) -> Strategy:
    """A strategy from a baseline's name, a plan file, or a hand-written override of data
    parallelism (what ``soapjax simulate --strategy`` takes).

    * A baseline's name, one of `soapjax.baselines.NAMES` (``"data-parallel"``,
      ``"megatron"``, ``"fsdp"``, ``"expert-cnn"``, ``"expert-rnn"``).
    * The path of a plan file (`soapjax.plan.Plan.save`, ``soapjax plan --out``): its strategy,
      after checking that it was made for this graph and topology.
    * A JSON object (or the path of a file holding one) that names configs by operator, one
      list of mesh axes per iteration dim (output dims, then reduction dims); operators it
      does not name keep their data-parallel config::

        {"configs": {"layers_0/mlp/fc1": [["data"], ["model"], []]}, "zero_axes": ["data"]}

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
            return baselines.baselines(graph, topology, family)[spec]
        path, spec = spec, _read_strategy_file(spec)
        if spec.get("format") == plan_mod.FORMAT:
            strategy = plan_mod.Plan.from_json(spec, where=path).strategy(graph, topology)
            for i, config in enumerate(strategy.configs):  # an edited file may not fit
                validate_config(graph, i, config, mesh)
            _check_zero_axes(list(strategy.zero_axes), mesh)
            return strategy
    if not isinstance(spec, Mapping) or "configs" not in spec \
            or not set(spec) <= {"configs", "zero_axes"} \
            or not isinstance(spec["configs"], Mapping):
        found = sorted(spec) if isinstance(spec, Mapping) else type(spec).__name__
        raise PlanError(f'expected a soapjax plan file ("format": "{plan_mod.FORMAT}", written by '
                        '`soapjax plan`) or a JSON object {"configs": {operator: [[axes], ...]}, '
                        f'"zero_axes": [...]}}; found {found}')
    configs = list(data_parallel(graph, mesh).configs)
    names = {op.name: i for i, op in enumerate(graph.operators)}
    for name, axes in spec["configs"].items():
        if name not in names:
            _unknown(graph, name)
        configs[names[name]] = _parse_config(graph, names[name], name, axes, mesh)
    zero = spec.get("zero_axes", [])
    _check_zero_axes(zero, mesh)
    return Strategy(tuple(configs), tuple(zero))


def _check_zero_axes(zero: Any, mesh: MeshShape) -> None:
    if not isinstance(zero, list) or any(a not in mesh.axis_names for a in zero):
        raise PlanError(f"zero_axes {zero!r}: expected a list of mesh axes among "
                        f"{list(mesh.axis_names)}")


def _read_strategy_file(path: str) -> dict[str, Any]:
    """The JSON object in file `path`; PlanError naming the baselines when there is no file."""
    try:
        with open(path) as f:
            data = json.load(f)
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
