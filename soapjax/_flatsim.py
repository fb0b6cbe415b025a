"""The flat step's simulator: a training step's task graph, its timeline and its memory.

`soapjax.simulate` is the simulator's entry point for any strategy; this module is the engine
of a step without pipeline stages (`Simulation`), which `soapjax.pipesim` runs for one stage of
a pipelined one.

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
  layout share one resharding, as XLA computes it once), the forward task (`CostModel.op_time`),
  where the config splits a dim the operator reduces a statistic over (a layer norm's hidden
  dim, a softmax's keys, a cross-entropy's vocabulary: `soapjax._inner`) the all-reduce of
  those statistics, and, when the config splits a reduction dim, the all-reduce of the partial
  sums of its (primary) output;
* backward, in reverse order: the backward task, after the backward of every consumer of its
  outputs and their cotangents' communication, then the all-reduce of its statistics'
  backward (a layer norm's two sums over the split hidden dim); per input, the cotangent's way
  back: it is laid
  out as the operator's operand and is a partial sum over the mesh axes the config uses that do
  not split that operand (a column-parallel matmul's replicated input), except those splitting
  only reduction dims its value does not flow into (a bias added after a row-parallel matmul:
  `Config.cotangent_partials`, `Operand.outside`), so it goes back by
  ``reshard(operand spec -> producer spec, partial=those axes)``. That is the transpose of the
  forward resharding (all-gather -> reduce-scatter, all-to-all -> all-to-all, ...) wherever the
  cotangent is a partial sum over the gathered axes, and a free slice where it is replicated
  over them, as XLA's partitioner does; the forward all-reduce of partial sums has none.
  Operators that read one value in the same layout and give back whole cotangents (no partial
  axes) share one way back: XLA adds the cotangents in that layout and reshards the sum once
  (a mixture of experts' gate and up read the dispatched tokens: one all-to-all back, after
  both backward tasks), where partial sums are each reduced where they are made.
  Parameters go back the same way to their stored layout: the gradient synchronisation
  (all-reduce over the batch axes under data parallelism, reduce-scatter under ZeRO; one
  per split dim where axes split several, as the batch and the sequence under context
  parallelism: `Simulation._partial_chain`), issued right after the backward task that
  completes the gradient, so it overlaps with the rest of the backward pass as XLA
  schedules it;
* the optimizer update of every parameter shard (`CostModel.update_time`) after its gradient,
  in the order gradients complete; where the optimizer reduces each parameter to scalars (a
  global gradient-norm clip: `OpCosts.update_reductions`) and the parameter is stored split,
  after the all-reduce of those scalars over the axes that split it (XLA's partitioner makes
  each a partial sum; tiny, but on XLA:CPU a rendezvous per parameter: 20 of them cost GPT-2
  tiny's Megatron step 1.9 ms of 13).
  Under Megatron's distributed optimizer (`Strategy.optimizer_axes`) the gradient goes back
  to the optimizer state's layout instead (`space.optimizer_specs`: the stored layout split
  further over those axes, so the all-reduce over them becomes a reduce-scatter), the update
  runs on that shard, and an all-gather back to the stored layout follows it.

Parameters (and batch inputs) are stored in the layout of the first operator that reads them,
split further over `Strategy.zero_axes` where divisible; other readers reshard them before their
forward task. Each reader's gradient contribution is synchronised on its own and the results
summed, as XLA does (a tied embedding's gradient is all-reduced twice under data parallelism).
An operator replicated over a mesh axis costs compute on every device of it: its shard is
bigger.

**Memory** per device (the same on every device): parameters, gradients and optimizer state
(``opt_state_factor`` x parameter bytes: 2 for Adam; see `opt_state_factor`) at their shard
sizes (the optimizer state at its own under the distributed optimizer); every forward output's
shard, kept for the backward pass (the peak is where the forward ends and the backward begins,
when all of them are alive), with the batch and the parameters gathered for another layout; and
the largest communication buffer.

Example::

    sim = Simulation(graph, topology, cost_model, resharder, data_parallel(graph, mesh))
    t = sim.propose(3, config)          # delta-simulate one operator's new config
    sim.accept() if t < best else sim.reject()
    sim.result().to_chrome_trace()      # {"traceEvents": [...]} for Perfetto / chrome://tracing

The module is the `Simulation`; its parts live beside it: the task graph's engine in
`soapjax._taskgraph`, the result records and trace export in `soapjax._simresult`. The module
stays one past ~600 lines because `Simulation` is one class: its units, their
undo record and the delta rules that keep it equal to a full simulation are one invariant, read
together.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from soapjax._dtypes import itemsize
from soapjax._inner import (
    attention_call_of,
    attention_unit,
    inner_reductions,
    matmul_operands,
    query_dims,
)
from soapjax._simresult import (
    BACKWARD,
    FORWARD,
    GRAD_SYNC,
    INNER_REDUCE,
    INNER_REDUCE_BWD,
    PARAM_GATHER,
    PARTIAL_SUM,
    RESHARD,
    RESHARD_BWD,
    UPDATE,
    UPDATE_REDUCE,
    MemoryBreakdown,
    SimResult,
    TaskRecord,
)
from soapjax._taskgraph import CHAIN, EDGE, LEAF, Comm, Layout, Pricing, TaskGraph
from soapjax._timing import quiet_gc
from soapjax.attention import ring_work, zigzag_sends
from soapjax.cost import OpTime
from soapjax.errors import PlanError
from soapjax.graph import OpGraph
from soapjax.kernels import causal_tiles
from soapjax.memory import (
    Segments,
    microbatch_degrees,
    microbatch_error,
    microbatch_shape,
    recomputes,
)
from soapjax.reshard import ReshardModel
from soapjax.space import Config, MeshShape, Strategy, sample_dim, storage_spec, validate_config
from soapjax.topology import Topology

__all__ = ["OpCosts", "Simulation", "scatter_target", "scattered_operand_axes", "shard_bytes"]


class _Ring(NamedTuple):
    """An attention operator run as ring attention (`Simulation._ring_of`)."""

    keys: int  # the iteration dim of the keys' sequence
    seq: tuple[str, ...]  # the axes of the ring
    cp: int
    work: float  # its compute against the gathered form's

    def specs(self, op: Any, specs: tuple, partials: tuple) -> tuple[tuple, tuple]:
        """The operands' layouts and cotangent partial axes under the ring: the keys' and
        values' sequence split over the ring's axes (nothing gathered), their cotangents whole
        (the ring carries them home)."""
        new_specs, new_partials = [], []
        for x, spec, partial in zip(op.inputs, specs, partials):
            if self.keys in x.dims:
                spec = tuple(self.seq if d == self.keys else a for d, a in zip(x.dims, spec))
                partial = tuple(a for a in partial if a not in self.seq)
            new_specs.append(spec)
            new_partials.append(partial)
        return tuple(new_specs), tuple(new_partials)


class _View(NamedTuple):
    """One operator under one config: times, tensor specs, partial sums, activation bytes."""

    config: Config
    forward_s: float
    backward_s: float
    out_specs: tuple[tuple[tuple[str, ...], ...], ...]
    operand_specs: tuple[tuple[tuple[str, ...], ...], ...]
    partials: tuple[tuple[str, ...], ...]  # per operand: axes its cotangent is a partial sum on
    reduction_axes: tuple[str, ...]  # the axes splitting its reduction dims (partial sums)
    inner_forward: tuple[Comm, ...]  # all-reduces of statistics it reduces over split dims
    inner_backward: tuple[Comm, ...]  # ... and their backward (`soapjax._inner`)
    output_bytes: tuple[int, ...]  # per output, its shard (one microbatch's)
    operand_bytes: tuple[int, ...]  # per operand, its shard at its layout here (0: not activation)
    internal_bytes: int  # the values inside it its backward reads (`memory.residuals`)
    policy: str  # its recompute policy (`soapjax.memory`)
    recomputes: bool  # whether it drops its outputs and runs its forward again
    # per operand, `partials` grouped by the iteration dim they split (`_by_dim`)
    partial_groups: tuple[tuple[tuple[str, ...], ...], ...] = ()
    # per operand with a partial cotangent that the operator computes on before its matmul:
    # the shard of what the matmul reads in its place, where XLA reduces it (else 0) ...
    matmul_bytes: tuple[int, ...] = ()
    # ... and that value's layout here (else None)
    matmul_specs: tuple[tuple[tuple[str, ...], ...] | None, ...] = ()


def scatter_target(op: Any, config: Config, consumer_axes: Sequence[tuple],
                   mesh: MeshShape) -> tuple | None:
    """The layout a row-parallel operator's partial sums are reduce-scattered into, or None.

    Where `config` splits reduction dims of `op` (its output is a partial sum over those
    axes) and every consumer of its one output reads it in one layout that is the config's
    output layout with some dims split further over all of those same axes (Megatron's
    sequence parallelism: attn/out's and fc2's outputs go into norms split along the
    sequence over the tensor-parallel axes), the partial sums are reduce-scattered straight
    into that layout, and what the operator does after its matmul (the bias, a residual add)
    runs on the slice. Apply constrains the matmul's result to it (`soapjax._flatstep`); the
    simulator prices the reduce-scatter in place of the all-reduce. Not where the readers
    split over only some of the axes: a sum over ``node`` and ``model`` constrained to the
    batch over ``data`` and ``model`` (a reduce-scatter over one axis, an all-reduce over the
    other) made XLA's partitioners (jax 0.10.2, both) compute wrong values (ViT, found by
    `scripts/fuzz_exactness.py`; `tests/test_exactness.py` keeps XLA's canary).

    Args:
      op: the operator.
      config: its config.
      consumer_axes: the operand axes (`Config.operand_axes`) of each reader of its output,
        under the readers' own configs.
      mesh: the mesh.
    """
    red = config.reduction_axes(op)
    if not red or len(op.outputs) != 1 or not consumer_axes:
        return None
    dst = tuple(tuple(a) for a in consumer_axes[0])
    if any(tuple(tuple(a) for a in c) != dst for c in consumer_axes[1:]):
        return None
    x = op.outputs[0]
    out = config.operand_axes(x.dims)
    if len(dst) != len(out) or dst == out:
        return None
    added = set()
    for o, d, size in zip(out, dst, x.shape):
        if d[:len(o)] != o or not set(d[len(o):]) <= set(red) or size % mesh.degree(d):
            return None
        added |= set(d[len(o):])
    if added != set(red):
        return None  # part scattered, part all-reduced: XLA computes it wrongly (module doc)
    return dst


def scattered_operand_axes(op: Any, config: Config, o: int, target: tuple | None,
                           mesh: MeshShape) -> tuple:
    """Operand `o`'s layout where `op`'s partial sums are reduce-scattered into `target`
    (`scatter_target`): an activation added after the matmul (its value flows into none of
    the split reduction dims: `Operand.outside`, a residual) is read split as the output is,
    so the add runs on the slice; any other operand (and every one where `target` is None)
    keeps its config's layout."""
    x = op.inputs[o]
    axes = config.operand_axes(x.dims)
    if target is None or x.kind != "activation":
        return axes
    split = {d for d in range(len(op.shape), len(config.axes)) if config.axes[d]}
    if not split <= set(x.outside):
        return axes
    out = config.operand_axes(op.outputs[0].dims)
    extra = {d: t[len(a):] for d, a, t in zip(op.outputs[0].dims, out, target) if d is not None}
    new = tuple(a + extra.get(d, ()) if d is not None else a for a, d in zip(axes, x.dims))
    if any(size % mesh.degree(a) for size, a in zip(x.shape, new)):
        return axes
    return new


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
      update_reductions: scalars the optimizer's update reduces each parameter to (a global
        gradient norm: 1; `soapjax.cost.update_reductions`); a parameter stored split over mesh
        axes all-reduces them over those axes before its update. Optional (0 when absent).
    """

    source: str

    def op_time(self, op_index: int, config: Config) -> OpTime:
        """Forward and backward seconds of operator `op_index` under `config`."""
        ...

    def shard_time(self, op_index: int, degrees: tuple[int, ...]) -> OpTime:
        """`op_time` by degrees per iteration dim (asked only for microbatches > 1)."""
        ...

    def update_time(self, param_shard_bytes: float) -> float:
        """Seconds of the optimizer update of a parameter shard of that many bytes."""
        ...


def _settled(method: Callable) -> Callable:
    """Rebuilds a rejected full proposal's previous strategy first (`Simulation.reject`
    leaves it stale: a search in full simulation proposes the next strategy whole, which
    needs no rebuild)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._stale is not None:
            before, self._stale = self._stale, None
            self.reset(before)
        return method(self, *args, **kwargs)

    return run


class Simulation:
    """A strategy's simulated step, kept up to date under single-operator changes.

    The search owns one: `propose` delta-simulates a new config for one operator and returns the
    new step time; `accept` keeps it, `reject` rolls it back (cheaply: the old tasks are kept
    until then). The state always equals a full simulation of the current strategy.
    `propose_strategy` is the same proposal by full simulation (Algorithm 1) of a whole
    strategy: delta and full simulation are this object's two ways to propose, and `accept`
    and `reject` end either.

    The task graph is held as *units*, each rebuilt whole when a change touches it: per operator
    its forward and backward tasks (retimed, never rebuilt) and its own collectives (`_OpComm`:
    the all-reduces of its statistics, forward and backward, and of its partial sums; when they
    change, the edges in and out of it are rebuilt too, as they start after them); per
    activation edge its forward resharding and its cotangent's way back
    (`_EdgeTasks`); per parameter or batch input its gathers, gradient synchronisations and
    update (`_LeafTasks`).

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
                 strategy: Strategy, *, opt_state_factor: float = 2.0,
                 pipeline_stage: bool = False) -> None:
        self.graph = graph
        # one pipeline stage (`soapjax.pipesim`): XLA's partitioner runs a sequence-split
        # attention operator there, every tile computed, nothing sent to balance it
        # (`soapjax._pipelined`'s whole_query_attention)
        self._whole_queries = pipeline_stage
        self.topology = topology
        self.cost_model = cost_model
        self.mesh = MeshShape.of(topology)
        self.opt_state_factor = float(opt_state_factor)
        self._reductions = int(getattr(cost_model, "update_reductions", 0))
        sharing = topology.compute  # devices sharing the host's cores (`[compute]`)
        self._stretch = sharing.stretch(topology.num_devices) if sharing else 1.0
        self._kernel_overhead = sharing.kernel_overhead if sharing else 0.0
        # Calling the step: it returns the parameters, the optimizer state (about
        # opt_state_factor arrays per parameter: Adam's two moments) and the loss.
        outputs = round(len(graph.params) * (1 + self.opt_state_factor)) + 1
        self._call = sharing.call_time(outputs) if sharing else 0.0
        self._layout = graph.memo("layout", lambda: Layout(graph))
        self._pricing = Pricing(topology, resharder)
        self._views_memo: dict[tuple[int, Config, str, int], _View] = {}
        # a layer's operator -> layer 0's twin
        self._canon = graph.memo("canonical", lambda: _canonical_operators(graph))
        self._segments = graph.memo("segments", lambda: Segments(graph))
        self._sample = graph.memo("sample_dims", lambda: [sample_dim(op) for op in graph.operators])
        self._micro = max(1, int(strategy.microbatches))
        self._scaled: dict[tuple, tuple[Comm, ...]] = {}  # (chain, M) -> chain run M times
        self._memo: dict[tuple, Any] = {}  # stored layouts, shard bytes, activation chains
        self._act: int | None = None  # activation bytes, computed when asked (`_memory`)
        self._pending: _Batch | None = None
        self._before: Strategy | None = None  # a full proposal's previous strategy
        self._stale: Strategy | None = None  # a rejected full proposal's, not yet rebuilt
        self._prefetch(strategy, ())  # compile the first strategy's reshardings in one batch
        self.reset(strategy)

    # --- public -------------------------------------------------------------------------------

    @property
    def strategy(self) -> Strategy:
        """The current strategy (with a pending proposal applied)."""
        if self._stale is not None:
            return self._stale
        return Strategy(tuple(v.config for v in self._views), self._zero, self._micro,
                        tuple(v.policy for v in self._views), optimizer_axes=self._optimizer,
                        ring_attention=self._ring)

    @property
    def microbatches(self) -> int:
        """The current strategy's number of microbatches."""
        return self._stale.microbatches if self._stale is not None else self._micro

    @_settled
    def compute_ends(self) -> tuple[list[float], list[float]]:
        """When each operator's forward and backward compute tasks end (graph order): the
        pipeline simulation (`soapjax.pipesim`) cuts the step into model chunks with them."""
        end = self._task_graph.end
        return ([end[t] for t in self._forward_task], [end[t] for t in self._backward_task])

    @_settled
    def activation_bytes_by_operator(self) -> list[int]:
        """The bytes each operator keeps for the backward pass per device, one microbatch,
        before recompute (`soapjax.memory.Segments.kept_bytes` with no operator recomputing)."""
        views = self._views
        return self._segments.kept_bytes([False] * len(views), [v.output_bytes for v in views],
                                         [v.operand_bytes for v in views],
                                         [v.internal_bytes for v in views])[0]

    @_settled
    def output_specs(self, i: int) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """Operator `i`'s outputs' layouts (per-dim mesh axes) under its current config."""
        return self._views[i].out_specs

    @_settled
    def stored_param_bytes(self) -> dict[str, int]:
        """Each parameter's stored shard per device, by its source (``Operand.source``: one
        layer's slice of a stacked parameter is a parameter of its own)."""
        layout = self._layout
        return {source: unit.stored_bytes
                for source, is_param, unit in zip(layout.leaf_source, layout.leaf_is_param,
                                                  self._leaf_tasks) if is_param}

    @_settled
    def memory_breakdown(self) -> MemoryBreakdown:
        """What the current strategy's peak memory per device is made of."""
        return self._memory()

    @_settled
    def choice(self, j: int) -> tuple[Config, str]:
        """Operator `j`'s config and recompute policy (cheaper than ``strategy[j]``)."""
        v = self._views[j]
        return v.config, v.policy

    @_settled
    def step_time(self) -> float:
        """The simulated step time of the current strategy: the timeline's end, plus what
        calling the step costs where the topology measured it (`call_overhead`)."""
        return self._task_graph.step_time() + self._call

    @_settled
    def timeline_end(self) -> float:
        """When the current strategy's last task ends (the step time less `call_overhead`)."""
        return self._task_graph.step_time()

    @property
    def call_overhead(self) -> float:
        """Seconds one call of the step costs beyond its tasks (`ComputeSharing.call_time`
        for the parameters, optimizer state and loss it returns; 0 unless the topology's
        ``[compute]`` table measured it)."""
        return self._call

    @_settled
    def peak_memory_bytes(self) -> int:
        """Peak bytes per device of the current strategy."""
        return self._memory().total

    @_settled
    def fits_in_memory(self) -> bool:
        return self.peak_memory_bytes() <= self.topology.device.memory_bytes

    def reset(self, strategy: Strategy) -> float:
        """Full simulation (Algorithm 1): rebuilds the task graph and timeline from scratch."""
        if self._pending is not None or self._before is not None:
            raise RuntimeError("accept() or reject() the pending proposal before reset()")
        self._stale = None
        # The build allocates tens of thousands of small objects, none of them in a cycle.
        # Python's collector, run by that count, scans the whole heap, traced graph included:
        # for GPT 175B that made a full simulation 4x slower (190 ms, 45 ms without). It
        # stays off for the build; reference counting frees all of it the same.
        with quiet_gc(collect=False):
            self._build(strategy)
            self._task_graph.full_pass()
        return self.step_time()

    @_settled
    def prefetch(self, changes: Iterable[tuple[int, Config]] = ()) -> int:
        """Has the resharder work out at once (`Resharder.prefetch`: one batch of compilations)
        every resharding that the current strategy and the given single-operator changes need.

        Returns:
          How many reshardings were compiled (0 for those already known).
        """
        return self._prefetch(self.strategy, changes)

    @_settled
    def propose(self, i: int, config: Config, recompute: str | None = None) -> float:
        """Delta-simulates operator `i` taking `config` (Algorithm 2); returns the step time.

        With `recompute` (a policy, `soapjax.memory`) the operator takes that recompute policy
        too (None: it keeps its own). A change of microbatches is a `reset` (every task
        changes).

        Rebuilds the tasks whose collectives the change touches (operator `i`'s own all-reduces
        of statistics and partial sums, the reshardings of its input and output edges, the
        gathers, gradient synchronisations and updates of the parameters it reads), retimes its
        forward and backward tasks, and retimes the timeline from the first changed task on, as
        far as the change reaches. The change stays pending until `accept` or `reject`.

        Raises:
          PlanError: `config` does not fit operator `i` or the mesh.
          RuntimeError: a proposal is already pending.
        """
        return self.propose_many([(i, config, recompute)])

    @_settled
    def propose_many(self, changes: Sequence[tuple[int, Config, str | None]]) -> float:
        """Delta-simulates several operators' changes as one proposal: ``(operator, config,
        recompute policy or None)`` each, applied in order, then one retiming pass from the
        first changed task (a repeated block's position moves in every layer at once: one
        pass instead of one per layer). `accept` keeps them all, `reject` rolls them all back.
        The timeline is the one the changes made one by one give (delta == full)."""
        if self._pending is not None:
            raise RuntimeError("accept() or reject() the pending proposal before proposing again")
        task_graph = self._task_graph
        batch = self._pending = _Batch()
        for i, config, recompute in changes:
            old = self._views[i]
            try:
                view = self._view(i, config, old.policy if recompute is None else recompute)
            except Exception:
                self.reject()  # the changes before it
                raise
            if view is old:
                continue
            if not batch.undos:
                batch.start, batch.end = list(task_graph.start), list(task_graph.end)
                batch.busy = list(task_graph.busy)
            undo = _Undo(i, old)
            batch.undos.append(undo)
            undo.activation_bytes = self._act
            undo.stored_bytes, undo.leaf_activation_bytes = self._stored_bytes, self._leaf_bytes
            self._views[i] = view
            self._act = None
            scattered = self._rescatter(undo, i)
            op_comm, edges, leaves = self._changed_units(i, view, old)
            layout = self._layout
            edges = sorted(set(edges) | {s for q in scattered
                                         for e in layout.in_edges[q] + layout.out_edges[q]
                                         for s in layout.siblings[e]})
            rebuilt = sorted(set(scattered) | ({i} if op_comm else set()))
            self._replace_units(undo, rebuilt, edges, leaves)
            self._retime_and_rewire(undo, i, edges, leaves)
        task_graph.sweep()
        return self.step_time()

    def propose_strategy(self, strategy: Strategy) -> float:
        """Full simulation (Algorithm 1) of `strategy` as a proposal; returns the step time.

        The counterpart of `propose_many` by full simulation: `accept` keeps it, `reject`
        returns to the strategy before (rebuilt when next needed, so a search that proposes
        whole strategies one after another rebuilds each once).
        """
        if self._pending is not None or self._before is not None:
            raise RuntimeError("accept() or reject() the pending proposal first")
        before = self.strategy
        self.reset(strategy)
        self._before = before
        return self.step_time()

    def accept(self) -> None:
        """Keeps the pending proposal."""
        if self._before is not None:
            self._before = None
            return
        for undo in self._take_pending().undos:
            self._task_graph.release(undo.old_tasks)

    def reject(self) -> None:
        """Rolls the pending proposal back: the old tasks return, with their old times."""
        if self._before is not None:
            self._stale, self._before = self._before, None
            return
        batch = self._take_pending()
        task_graph = self._task_graph
        for undo in reversed(batch.undos):
            i = undo.op
            for t, deps in reversed(undo.deps):
                task_graph.set_deps(t, deps)
            for t in reversed(undo.new_tasks):
                task_graph.detach(t)
            self._count_buffers(undo.new_tasks, -1)
            task_graph.release(undo.new_tasks)
            for t in undo.old_tasks:
                task_graph.attach(t)
            self._count_buffers(undo.old_tasks, +1)
            task_graph.dur[self._forward_task[i]] = undo.view.forward_s
            task_graph.dur[self._backward_task[i]] = undo.view.backward_s
            self._views[i] = undo.view
            for q, unit in undo.op_comm:
                self._op_comm[q] = unit
            for q, target in undo.scatter:
                self._scatter[q] = target
            for e, unit in undo.edges:
                self._edge_tasks[e] = unit
            for leaf, unit in undo.leaves:
                self._leaf_tasks[leaf] = unit
            self._act = undo.activation_bytes
            self._stored_bytes, self._leaf_bytes = undo.stored_bytes, undo.leaf_activation_bytes
        if batch.undos:
            n = len(batch.start)
            task_graph.start[:n] = batch.start
            task_graph.end[:n] = batch.end
            task_graph.busy[:n] = batch.busy
        task_graph.discard_marks()

    @_settled
    def result(self) -> SimResult:
        """A frozen summary of the current state (a pending proposal included)."""
        task_graph, pricing = self._task_graph, self._pricing
        records, compute, sent, slowed = [], 0.0, 0.0, 0.0
        by_class: dict[str, float] = {}
        for t in task_graph.order:
            kind, ref = task_graph.info[t][0], task_graph.info[t][1]
            name, start, end = self._task_name(t), task_graph.start[t], task_graph.end[t]
            if kind in (FORWARD, BACKWARD, UPDATE):
                # its duration, slowed where it ran beside a collective (contention); without
                # contention the duration itself (end - start may differ from it by rounding)
                ran = end - start if task_graph.contention else task_graph.dur[t]
                compute += ran
                slowed += ran - task_graph.dur[t]
                records.append(TaskRecord(name, kind, ("compute",), start, end, 0))
                continue
            sent += ref.sent
            by_class[ref.link_class] = by_class.get(ref.link_class, 0.0) + ref.sent
            channels = tuple(c for r in task_graph.res[t] if r  # 0: compute (`serial_comm`)
                             for c in pricing.resource_channels[r])
            records.append(TaskRecord(name, kind, channels, start, end, ref.nbytes, ref.sent))
        step = self.step_time()
        compute += self._call  # host work, not communication
        mem = self._memory()
        cap = self.topology.device.memory_bytes
        return SimResult(
            step_time_s=step, compute_s=compute, exposed_comm_s=step - compute, bytes_moved=sent,
            bytes_by_link_class=by_class, peak_memory_bytes=(mem.total,) * self.mesh.num_devices,
            memory=mem, memory_capacity_bytes=cap, fits_in_memory=mem.total <= cap,
            cost_source=str(getattr(self.cost_model, "source", "unknown")),
            num_devices=self.mesh.num_devices, tasks=tuple(records), channels=pricing.channels,
            contention_s=slowed)

    @_settled
    def timeline(self) -> list[tuple[str, float, float]]:
        """``(task name, start, end)`` of every task in issue order (for exact comparisons)."""
        task_graph = self._task_graph
        return [(self._task_name(t), task_graph.start[t], task_graph.end[t])
                for t in task_graph.order]

    # --- full simulation ----------------------------------------------------------------------

    def _prefetch(self, strategy: Strategy, changes: Iterable[tuple[int, Config]]) -> int:
        prefetch = getattr(self._pricing.resharder, "prefetch", None)
        if prefetch is None or getattr(self._pricing.resharder, "mode", None) == "ideal":
            return 0  # nothing to compile: the ideal model prices transitions by formula
        seen: list = []
        shadow = copy.copy(self)  # `_build` gives it its own task graph and unit lists
        shadow._pricing, shadow._pending = self._pricing.recording(seen), None
        shadow._memo = {}  # its chains are the recorder's empty ones
        shadow.reset(strategy)
        for i, config in changes:
            shadow.propose(i, config)
            shadow.reject()
        return prefetch(seen)

    def _validate(self, strategy: Strategy) -> None:
        if len(strategy.configs) != self._layout.n:
            raise PlanError(f"strategy has {len(strategy.configs)} configs, graph "
                            f"{self.graph.name!r} has {self._layout.n} operators")
        for field in ("zero_axes", "optimizer_axes"):
            unknown = [a for a in getattr(strategy, field) if a not in self.mesh.axis_names]
            if unknown:
                raise PlanError(f"{field} {unknown} are not mesh axes "
                                f"{list(self.mesh.axis_names)}")

    def _build(self, strategy: Strategy) -> None:
        """Builds the task graph of `strategy` (untimed)."""
        if strategy.pipelined:
            raise PlanError(f"a strategy with {strategy.stages} pipeline stages is simulated by "
                            "soapjax.simulate.simulate (or open_simulation), which runs this "
                            "Simulation on one stage's devices")
        self._validate(strategy)
        layout = self._layout
        self._zero = tuple(strategy.zero_axes)
        self._optimizer = tuple(a for a in strategy.optimizer_axes if a not in self._zero)
        self._micro = strategy.microbatches
        self._ring = strategy.ring_attention
        self._views = [self._view(j, c, strategy.recompute_of(j))
                       for j, c in enumerate(strategy.configs)]
        self._scatter = [self._scatter_of(j) for j in range(layout.n)]
        kernels = self.topology.device.kernels
        self._task_graph = task_graph = TaskGraph(
            len(self._pricing.resource_channels),
            contention=kernels.overlap_slowdown if kernels is not None else 0.0)
        self._buffer_counts: dict[int, int] = {}  # communication buffer bytes -> tasks
        self._forward_task = [
            task_graph.new(layout.fwd_key(j, layout.slots - 2), v.forward_s, (0,), [],
                           (FORWARD, j)) for j, v in enumerate(self._views)]
        self._backward_task = [
            task_graph.new(layout.bwd_key(j, 0), v.backward_s, (0,), [], (BACKWARD, j))
            for j, v in enumerate(self._views)]
        self._op_comm = [self._build_op_comm(j) for j in range(layout.n)]
        self._edge_tasks = [self._build_edge(e) for e in range(len(layout.edges))]
        self._leaf_tasks = [self._build_leaf(leaf) for leaf in range(len(layout.leaf_source))]
        for j in range(layout.n):
            task_graph.deps[self._forward_task[j]] = self._forward_deps(j)
            task_graph.deps[self._backward_task[j]] = self._backward_deps(j)
        self._act = None
        self._stored_bytes = sum(unit.stored_bytes for unit in self._leaf_tasks)
        self._leaf_bytes = sum(unit.activation_bytes for unit in self._leaf_tasks)
        task_graph.build()
        self._count_buffers([t for t in task_graph.order
                             if task_graph.info[t][0] not in (FORWARD, BACKWARD)], +1)

    # --- delta simulation ---------------------------------------------------------------------

    def _changed_units(self, i: int, view: _View,
                       old: _View) -> tuple[bool, list[int], list[int]]:
        """The units whose collectives change when operator `i` goes from `old` to `view`:
        whether its own collectives do (`_build_op_comm`), the edges and the leaves (the rest
        keep their tasks)."""
        layout = self._layout
        op_comm = ((view.out_specs[0:1], view.reduction_axes, view.inner_forward,
                    view.inner_backward)
                   != (old.out_specs[0:1], old.reduction_axes, old.inner_forward,
                       old.inner_backward))
        # an edge starts after its producer's collectives and its way back after its consumer's
        changed = [e for e in layout.in_edges[i] + layout.out_edges[i]
                   if self._edge_signature(e, i, view) != self._edge_signature(e, i, old)
                   or (op_comm and i in (layout.edges[e][0], layout.edges[e][2]))]
        # ... and the edges that share a value with them (which one reshards it may change)
        edges = sorted({s for e in changed for s in layout.siblings[e]})
        leaves = [leaf for leaf in layout.op_leaves[i]
                  if any((view.operand_specs[o], view.partial_groups[o])
                         != (old.operand_specs[o], old.partial_groups[o])
                         for j, o in layout.readers[leaf] if j == i)]
        return op_comm, edges, leaves

    def _rescatter(self, undo: _Undo, i: int) -> list[int]:
        """Recomputes `scatter_target` of operator `i` and of its producers (the readers of
        their outputs include `i`) after `i`'s view changed; returns those whose target or
        operand layouts changed (their own collectives and edges are rebuilt), old values
        kept in `undo`."""
        layout, out = self._layout, []
        for q in sorted({i} | {layout.edges[e][0] for e in layout.in_edges[i]}):
            new = self._scatter_of(q)
            if new != self._scatter[q]:
                undo.scatter.append((q, self._scatter[q]))
                self._scatter[q] = new
                out.append(q)
        return out

    def _scatter_of(self, j: int) -> tuple[tuple | None, tuple]:
        """Operator `j`'s `scatter_target` under the current views (None where its partial
        sums are all-reduced) and its operands' layouts (`scattered_operand_axes`)."""
        layout, views, v = self._layout, self._views, self._views[j]
        if not v.reduction_axes:
            return None, v.operand_specs
        op = self.graph.operators[j]
        readers = [views[layout.edges[e][2]].operand_specs[layout.edges[e][3]]
                   for e in layout.out_edges[j]]
        target = scatter_target(op, v.config, readers, self.mesh)
        if target is None:
            return None, v.operand_specs
        return target, tuple(scattered_operand_axes(op, v.config, o, target, self.mesh)
                             for o in range(len(op.inputs)))

    def _dst(self, j: int, o: int) -> tuple:
        """The layout operator `j` reads operand `o` in (`_scatter_of`)."""
        return self._scatter[j][1][o]

    def _edge_signature(self, e: int, i: int, view: _View) -> tuple:
        """What edge `e`'s collectives depend on, with operator `i` under `view`."""
        p, k, j, o = self._layout.edges[e]
        src = (view if p == i else self._views[p]).out_specs[k]
        consumer = view if j == i else self._views[j]
        return (src, consumer.operand_specs[o], consumer.partials[o],
                consumer.matmul_specs[o])
        # (a change of `scatter_target` is caught apart: `_rescatter`)

    def _replace_units(self, undo: _Undo, op_comm_of: list[int], edges: list[int],
                       leaves: list[int]) -> None:
        """Takes the old tasks of the changed units off the graph (kept in `undo` for `reject`)
        and builds new ones: the own collectives of the operators `op_comm_of`,
        the `edges` and the `leaves`."""
        task_graph = self._task_graph
        undo.op_comm = [(q, self._op_comm[q]) for q in op_comm_of]
        undo.edges = [(e, self._edge_tasks[e]) for e in edges]
        undo.leaves = [(leaf, self._leaf_tasks[leaf]) for leaf in leaves]
        old = undo.old_tasks = [t for _, unit in undo.op_comm
                                for t in unit.forward + unit.backward]
        old += [t for _, unit in undo.edges for t in unit.forward + unit.backward]
        old += [t for _, unit in undo.leaves for t in unit.tasks]
        for t in old:
            task_graph.detach(t)
        self._count_buffers(old, -1)
        new = undo.new_tasks
        for q in op_comm_of:
            unit = self._op_comm[q] = self._build_op_comm(q)
            new += unit.forward + unit.backward
        for e in edges:
            unit = self._edge_tasks[e] = self._build_edge(e)
            new += unit.forward + unit.backward
        for leaf in leaves:
            before, unit = self._leaf_tasks[leaf], self._build_leaf(leaf)
            self._leaf_tasks[leaf] = unit
            self._stored_bytes += unit.stored_bytes - before.stored_bytes
            self._leaf_bytes += unit.activation_bytes - before.activation_bytes
            new += unit.tasks
        for t in new:
            task_graph.attach(t)
        self._count_buffers(new, +1)

    def _retime_and_rewire(self, undo: _Undo, i: int, edges: list[int],
                           leaves: list[int]) -> None:
        """Gives operator `i`'s compute tasks their new durations and points the compute tasks
        that wait on the rebuilt `edges` and `leaves` at their new tasks (old ones in `undo`)."""
        layout, task_graph, view = self._layout, self._task_graph, self._views[i]
        task_graph.set_dur(self._forward_task[i], view.forward_s)
        task_graph.set_dur(self._backward_task[i], view.backward_s)
        readers = {i} | {layout.edges[e][2] for e in edges}
        readers |= {j for leaf in leaves for j, _ in layout.readers[leaf]}
        producers = {i} | {layout.edges[e][0] for e in edges}
        for j in readers:
            t = self._forward_task[j]
            undo.deps.append((t, task_graph.set_deps(t, self._forward_deps(j))))
        for j in producers:
            t = self._backward_task[j]
            undo.deps.append((t, task_graph.set_deps(t, self._backward_deps(j))))

    def _take_pending(self) -> _Batch:
        if self._pending is None:
            raise RuntimeError("no pending proposal: call propose() first")
        undo, self._pending = self._pending, None
        return undo

    # --- building units -----------------------------------------------------------------------

    def _compute_time(self, seconds: float) -> float:
        """A compute task's time in the step: its time alone, stretched where the devices
        share the host's cores, plus the per-task dispatch (`Topology.compute`)."""
        if seconds <= 0:
            return 0.0
        return seconds * self._stretch + self._kernel_overhead

    def _view(self, j: int, config: Config, policy: str = "none") -> _View:
        m = self._micro
        key = (self._canon[j], config, policy, m, self._ring)
        v = self._views_memo.get(key)
        if v is None:
            validate_config(self.graph, j, config, self.mesh)
            op = self.graph.operators[j]
            why = microbatch_error(op, config, self.mesh, m)
            if why:
                raise PlanError(f"{why}; choose microbatches dividing every operator's "
                                "per-device batch")
            if m == 1:
                t = self.cost_model.op_time(j, config)
            else:  # one microbatch's shard, M times (`soapjax.memory`)
                t = self.cost_model.shard_time(
                    j, microbatch_degrees(op, config.degrees(self.mesh), m))
            recompute = recomputes(op, policy)
            forward = m * self._compute_time(float(t.forward_s))
            backward = m * self._compute_time(float(t.backward_s))
            if recompute:
                backward += forward
            outs = tuple(config.operand_axes(x.dims) for x in op.outputs)
            specs = tuple(config.operand_axes(x.dims) for x in op.inputs)
            partials = tuple(config.cotangent_partials(x, self.mesh.axis_names)
                             for x in op.inputs)
            ring = self._ring_of(j, config)
            if ring is not None:  # the keys and values stay split; the ring moves them
                forward, backward = forward * ring.work, backward * ring.work
                specs, partials = ring.specs(op, specs, partials)
            whole = self._whole_tiles(j, config)
            forward, backward = forward * whole, backward * whole
            sample = self._sample[j]
            def nbytes(shape, dims, dtype, spec):
                return shard_bytes(microbatch_shape(shape, dims, sample, m), spec, dtype,
                                   self.mesh)

            output_bytes = tuple(nbytes(x.shape, x.dims, x.dtype, s)
                                 for x, s in zip(op.outputs, outs))
            operand_bytes = tuple(nbytes(x.shape, x.dims, x.dtype, s)
                                  if x.kind == "activation" else 0
                                  for x, s in zip(op.inputs, specs))
            internal = sum(nbytes(shape, dims, dtype, config.operand_axes(dims))
                           for shape, dtype, dims in self._segments.internal[j])
            inner_forward, inner_backward = self._inner_chains(j, config)
            if ring is not None:
                inner_forward += self._ring_chain(j, ring, specs, backward=False)
                inner_backward += self._ring_chain(j, ring, specs, backward=True)
            elif not self._whole_queries:
                zigzag = self._zigzag_chain(j, config)
                inner_forward, inner_backward = inner_forward + zigzag, inner_backward + zigzag
            if recompute:  # the forward it runs again all-reduces its statistics again
                inner_backward = inner_forward + inner_backward
            v = self._views_memo[key] = _View(
                config, forward, backward, outs, specs, partials,
                tuple(config.reduction_axes(op)), inner_forward, inner_backward, output_bytes,
                operand_bytes, internal, policy, recompute,
                tuple(_by_dim(config.axes, p) for p in partials),
                tuple(nbytes(m.shape, m.dims, m.dtype, config.operand_axes(m.dims))
                      if m is not None and p else 0
                      for m, p in zip(matmul_operands(self.graph, j), partials)),
                tuple(config.operand_axes(m.dims) if m is not None and p else None
                      for m, p in zip(matmul_operands(self.graph, j), partials)))
        return v

    def _ring_of(self, j: int, config: Config) -> _Ring | None:
        """How operator `j` runs as ring attention under `config` (`Strategy.ring_attention`),
        or None: not a ring strategy, not an attention operator, its queries not split."""
        if not self._ring:
            return None
        dims = query_dims(self.graph, j)
        if dims is None or not config.axes[dims.sequence]:
            return None
        seq = tuple(config.axes[dims.sequence])
        cp = self.mesh.degree(seq)
        causal = attention_call_of(self.graph, j).causal
        # the synchronous ring over contiguous blocks against a balanced causal split
        work = ring_work(cp) / 0.5 if causal else 1.0
        return _Ring(dims.keys, seq, cp, work)

    def _ring_chain(self, j: int, ring: _Ring, specs: tuple, *, backward: bool
                    ) -> tuple[Comm, ...]:
        """The ring's sends, each microbatch (`soapjax.attention.ring_sends`): forward, the key
        block, the value block and the key positions, backward the keys' and values'
        cotangents; one task per tensor for its cp - 1 steps (its time and bytes sent cp - 1
        times one send's, its buffer one block). Priced one after another, after the
        operator's own task: what the ring overlaps with its blocks' computation is not
        credited."""
        op = self.graph.operators[j]
        kv = [(x, spec) for x, spec in zip(op.inputs, specs) if ring.keys in x.dims]
        sends = []
        for x, spec in kv:
            shape = microbatch_shape(x.shape, x.dims, self._sample[j], self._micro)
            sends.append(shard_bytes(shape, spec, x.dtype, self.mesh))
        if not backward and kv:
            length = kv[0][0].shape[kv[0][0].dims.index(ring.keys)]
            sends.append(4 * length // ring.cp)
        out = []
        for nbytes in sends:
            c = self._pricing.comm("collective_permute", nbytes, ring.seq)
            if c is not None:
                steps = ring.cp - 1
                out.append(c._replace(dur=c.dur * steps, sent=c.sent * steps))
        return self._per_microbatch(tuple(out))

    def _split_causal_attention(self, j: int, config: Config):
        """Operator `j`'s `soapjax._inner.QueryDims` where it is a causal attention whose
        query sequence `config` splits; else None."""
        dims = query_dims(self.graph, j)
        if dims is None or not config.axes[dims.sequence] or \
                not attention_call_of(self.graph, j).causal:
            return None
        return dims

    def _whole_tiles(self, j: int, config: Config) -> float:
        """Operator `j`'s compute against its priced kernel where every tile of a causal
        attention is computed (a pipeline stage's sequence-split attention): 1 /
        `soapjax.kernels.causal_tiles` of its keys; else 1."""
        if not self._whole_queries or self._split_causal_attention(j, config) is None:
            return 1.0
        unit = self.graph.program.units[attention_unit(self.graph, j)]
        return 1.0 / causal_tiles(self.graph.program.shapes[unit.ins[1]][1])

    def _zigzag_chain(self, j: int, config: Config) -> tuple[Comm, ...]:
        """The sends that balance causal attention under the gathered form of context
        parallelism (`soapjax._context_parallel`: `soapjax.attention.zigzag_sends`), each
        microbatch: each half of the query block to the device that computes it, each half of
        the output back; backward, the same of their cotangents. Its compute is priced
        balanced (the kernel's causal tiles over the whole sequence, `soapjax.kernels`)."""
        dims = self._split_causal_attention(j, config)
        if dims is None:
            return ()
        seq = tuple(config.axes[dims.sequence])
        sends = zigzag_sends(self.mesh.degree(seq))
        prog = self.graph.program
        unit = prog.units[attention_unit(self.graph, j)]
        iteration = (dims.batch, dims.sequence, dims.heads, None)
        spec = tuple(tuple(config.axes[d]) if d is not None else () for d in iteration)
        out = []
        for value in (unit.ins[0], unit.outs[0]):  # the queries, the output
            shape = microbatch_shape(prog.shapes[value], iteration, self._sample[j], self._micro)
            if shape[1] % (2 * self.mesh.degree(seq)):
                return ()  # apply keeps the contiguous blocks (`_context_parallel`)
            half = shard_bytes(shape, spec, prog.dtypes[value], self.mesh) / 2
            for pairs in (sends.even, sends.odd):
                c = self._pricing.comm("collective_permute", half, seq) if pairs else None
                if c is not None:
                    out.append(c)
        return self._per_microbatch(tuple(out))

    def _inner_chains(self, j: int, config: Config) -> tuple[tuple[Comm, ...], tuple[Comm, ...]]:
        """The all-reduces of the statistics operator `j` reduces over dims `config` splits
        (`soapjax._inner`), forward and backward: per set of mesh axes one collective of all
        of them (XLA combines them), priced as one all-reduce per statistic, each microbatch."""
        groups: dict[tuple[str, ...], list[tuple[Comm, bool]]] = {}
        for r in inner_reductions(self.graph, j):
            axes = tuple(a for a in self.mesh.axis_names
                         if any(a in config.axes[d] for d in r.reduced))
            if not axes:
                continue
            spec = tuple(config.axes[d] if d is not None else () for d in r.dims)
            shape = microbatch_shape(r.shape, r.dims, self._sample[j], self._micro)
            c = self._pricing.comm("all_reduce", shard_bytes(shape, spec, r.dtype, self.mesh),
                                   axes)
            if c is not None:
                groups.setdefault(axes, []).append((c, r.backward))

        def combined(comms: list[Comm]) -> tuple[Comm, ...]:
            if not comms:
                return ()
            return (comms[0]._replace(nbytes=sum(c.nbytes for c in comms),
                                      dur=sum(c.dur for c in comms),
                                      sent=sum(c.sent for c in comms)),)

        forward = tuple(c for cs in groups.values() for c in combined([c for c, _ in cs]))
        backward = tuple(c for cs in groups.values() for c in combined([c for c, b in cs if b]))
        return self._per_microbatch(forward), self._per_microbatch(backward)

    def _per_microbatch(self, chain: tuple[Comm, ...]) -> tuple[Comm, ...]:
        """`chain` run once per microbatch: M times its time and bytes sent."""
        m = self._micro
        if m == 1 or not chain:
            return chain
        key = (chain, m)
        out = self._scaled.get(key)
        if out is None:
            out = self._scaled[key] = tuple(c._replace(dur=c.dur * m, sent=c.sent * m)
                                            for c in chain)
        return out

    def _activation_chain(self, x: Any, sample: int | None, src: tuple, dst: tuple,
                          partial: tuple[str, ...] = ()) -> tuple[Comm, ...]:
        """The resharding of activation `x` (an operand or output, `dims` of an operator whose
        sample dim is `sample`) for each microbatch, at microbatch size."""
        key = ("activation", x.shape, x.dims, x.dtype, sample, src, dst, partial, self._micro)
        out = self._memo.get(key)
        if out is None:
            shape = microbatch_shape(x.shape, x.dims, sample, self._micro)
            out = self._memo[key] = self._per_microbatch(
                self._pricing.chain(shape, x.dtype, src, dst, partial))
        return out

    def _chain_tasks(self, chain: tuple[Comm, ...], key: int, head: list[int], kind: str,
                     subject: Any) -> list[int]:
        """One task per collective of `chain`, each after the previous, the first after
        `head`; keys from `key` on."""
        task_graph, out = self._task_graph, []
        if len(chain) >= CHAIN:  # keys would run into the next slot's
            raise RuntimeError(f"{len(chain)} collectives in one chain of {kind} tasks; the "
                               f"task graph's keys leave room for {CHAIN - 1}")
        for pos, c in enumerate(chain):
            out.append(task_graph.new(key + pos, c.dur, c.res, [out[-1]] if out else list(head),
                                      (kind, c, subject)))
        return out

    def _build_op_comm(self, j: int) -> _OpComm:
        """Operator `j`'s own collectives: after its forward task the all-reduces of the
        statistics it reduces over split dims (`_inner_chains`), then of its partial sums (none
        unless it splits a reduction); after its backward task the statistics' backward."""
        v, layout = self._views[j], self._layout
        key = layout.fwd_key(j, layout.slots - 1)
        forward = self._chain_tasks(v.inner_forward, key, [self._forward_task[j]],
                                    INNER_REDUCE, j)
        if v.reduction_axes:
            x = self.graph.operators[j].outputs[0]
            target = self._scatter[j][0] or v.out_specs[0]  # reduce-scattered, else all-reduced
            chain = self._activation_chain(x, self._sample[j], v.out_specs[0], target,
                                           v.reduction_axes)
            forward += self._chain_tasks(chain, key + len(forward),
                                         forward[-1:] or [self._forward_task[j]], PARTIAL_SUM, j)
        # slot 0 holds the backward task at position 0; the statistics follow it
        backward = self._chain_tasks(v.inner_backward, layout.bwd_key(j, 0, 1),
                                     [self._backward_task[j]], INNER_REDUCE_BWD, j)
        return _OpComm(forward, len(v.inner_forward), backward)

    def _output_ready(self, p: int, k: int) -> int:
        """The task after which operator `p`'s output `k` is complete: the all-reduce of its
        partial sums (output 0 only), else of its statistics, else its forward task."""
        comm = self._op_comm[p]
        tasks = comm.forward if k == 0 else comm.forward[:comm.inner]
        return tasks[-1] if tasks else self._forward_task[p]

    def _backward_done(self, j: int) -> int:
        """The task after which operator `j`'s operands' cotangents are complete: the
        all-reduce of its statistics' backward, else its backward task."""
        backward = self._op_comm[j].backward
        return backward[-1] if backward else self._backward_task[j]

    def _same_layout(self, e: int, *, backward: bool = False) -> list[int]:
        """The edges carrying edge `e`'s value to the same layout, in edge order (consumers in
        program order): the first one's forward resharding serves them all (XLA computes the
        collective once). Backward, the same where the cotangents come back whole (no partial
        axes): XLA adds them in the consumers' layout and moves the sum once (a MoE's gate and
        up read the dispatched tokens: one all-to-all back, not two). Partial sums are each
        reduced where they are made, as the gradient syncs are: `e` alone."""
        layout, views = self._layout, self._views
        _, _, j, o = layout.edges[e]
        dst = self._dst(j, o)
        if backward and views[j].partials[o]:
            return [e]
        out = []
        for s in layout.siblings[e]:
            js, os = layout.edges[s][2:]
            if s == e or (self._dst(js, os) == dst and not (backward and views[js].partials[os])):
                out.append(s)
        return out

    def _resharded_by(self, e: int, *, backward: bool = False) -> int:
        """The edge whose resharding serves edge `e` (`_same_layout`'s first)."""
        return self._same_layout(e, backward=backward)[0]

    def _build_edge(self, e: int) -> _EdgeTasks:
        layout = self._layout
        p, k, j, o = layout.edges[e]
        x = self.graph.operators[j].inputs[o]
        # a reduce-scattered output is made in its readers' layout; its cotangent goes back to
        # the config's (the reduce-scatter's transpose: an all-gather)
        src, dst = self._views[p].out_specs[k], self._dst(j, o)
        sample = self._sample[j]
        forward = [] if self._resharded_by(e) != e else self._chain_tasks(
            self._activation_chain(x, sample, self._scatter[p][0] or src, dst),
            layout.fwd_key(j, o), [self._output_ready(p, k)], RESHARD, e)
        partial = self._views[j].partials[o]
        # apply reduces a partial cotangent straight into its producer's layout where the two
        # differ (`soapjax._flatstep`: Q, K and V's into the sequence split, a reduce-scatter
        # each); only where they are the same are several summed after their all-reduces
        summed = self._summed_partials(e) if partial and dst == src else [e]
        if len(summed) > 1:  # each reduced in this layout, then their sum moved once
            return _EdgeTasks(forward, [] if e != summed[0] else self._summed_tasks(summed))
        shared = self._same_layout(e, backward=True)
        back = (self._reduced(j, o, dst, src) if partial else
                self._activation_chain(x, sample, dst, src))
        backward = [] if shared[0] != e else self._chain_tasks(
            back, layout.bwd_key(j, 1 + o),
            [self._backward_done(layout.edges[s][2]) for s in shared], RESHARD_BWD, e)
        return _EdgeTasks(forward, backward)

    def _reduced_in_place(self, j: int, o: int) -> tuple[Comm, ...]:
        """The all-reduce of operand `o`'s partial cotangent in operator `j`'s layout, where it
        is made (`_reduced` into that same layout)."""
        here = self._views[j].operand_specs[o]
        return self._reduced(j, o, here, here)

    def _reduced(self, j: int, o: int, dst: tuple, to: tuple) -> tuple[Comm, ...]:
        """The way back of operand `o`'s partial cotangent from operator `j`'s layout `dst`
        into layout `to` (its producer's, or `dst` itself), as XLA compiles it for apply's
        constraint of the cotangent to `to` (`soapjax._flatstep`).

        Where the matmul reads the operand itself: ``reshard(dst -> to, partial)``, a
        reduce-scatter over the partial axes `to` splits a dim by, an all-reduce over the rest.
        Where the operator computes on the operand before its matmul (a rotary embedding,
        GQA's repeat: `soapjax._inner.matmul_operands`), the partial sums are what the matmul's
        transpose makes, and XLA reduces them there, before that computation's backward: at
        the shard of what the matmul reads, reduce-scattered over the partial axes that `to`
        splits a dim of the operand by which that value has too (divisibly; its backward then
        runs on the slice), all-reduced over the rest (whole, then sliced); then the operand
        moves from that layout to `to`, reducing the partial axes that split the matmul's
        value but not the operand (a repeat's backward sums their slices into partial sums)."""
        v, sample = self._views[j], self._sample[j]
        x, partial = self.graph.operators[j].inputs[o], v.partials[o]
        m_dst = v.matmul_specs[o]
        if m_dst is None:
            return self._activation_chain(x, sample, dst, to, partial)
        m = matmul_operands(self.graph, j)[o]
        key = ("reduced", m, m_dst, x.shape, x.dims, x.dtype, sample, dst, to, partial,
               self._micro)
        out = self._memo.get(key)
        if out is not None:
            return out
        shape = microbatch_shape(m.shape, m.dims, sample, self._micro)
        # axes that split the matmul's operand (GQA's repeated heads, where the operand's own
        # heads are whole) make their partial sums in the repeat's backward: reduced there
        at_matmul = tuple(a for a in partial if not any(a in axes for axes in m_dst))
        m_to, x_to = list(m_dst), list(dst)
        for d, it in enumerate(x.dims):
            axes = tuple(a for a in to[d] if a in at_matmul) if d < len(to) else ()
            if not axes or it is None or it not in m.dims:
                continue
            k = m.dims.index(it)
            if shape[k] % self.mesh.degree(m_to[k] + axes):
                continue
            m_to[k] += axes
            x_to[d] += axes
        reduce = self._per_microbatch(
            self._pricing.chain(shape, m.dtype, m_dst, tuple(m_to), at_matmul))
        rest = tuple(a for a in partial if a not in at_matmul)
        out = self._memo[key] = reduce + self._activation_chain(x, sample, tuple(x_to), to, rest)
        return out

    def _summed_tasks(self, summed: list[int]) -> list[int]:
        """The way back of partial cotangents `summed` (`_summed_partials`), all in the first
        edge's unit: their all-reduces in backward order (the last consumer's first), each after
        its consumer's backward and the one before, then the move of their sum to the
        producer's layout; its last task is after all of them."""
        layout, tasks = self._layout, []
        for s in reversed(summed):
            _, _, j, o = layout.edges[s]
            chain = self._reduced_in_place(j, o)
            tasks += self._chain_tasks(chain, layout.bwd_key(j, 1 + o),
                                       [self._backward_done(j)] + tasks[-1:], RESHARD_BWD, s)
        p, k, j, o = layout.edges[summed[0]]
        x = self.graph.operators[j].inputs[o]
        move = self._activation_chain(x, self._sample[j], self._views[j].operand_specs[o],
                                      self._views[p].out_specs[k])
        first = len(self._reduced_in_place(j, o))
        return tasks + self._chain_tasks(move, layout.bwd_key(j, 1 + o) + first, tasks[-1:],
                                         RESHARD_BWD, summed[0])

    def _summed_partials(self, e: int) -> list[int]:
        """The edges carrying edge `e`'s value to the same layout whose cotangents are partial
        sums over the same axes, in edge order, where that layout is the producer's (plain
        Megatron's Q, K and V read the replicated norm): each is all-reduced where it is made,
        their sum needs no move. Where the layouts differ, apply has each reduced straight
        into the producer's layout (`_build_edge`)."""
        layout, views = self._layout, self._views
        _, _, j, o = layout.edges[e]
        key = (self._dst(j, o), views[j].partials[o])
        return [s for s in layout.siblings[e]
                if (self._dst(*layout.edges[s][2:]),
                    views[layout.edges[s][2]].partials[layout.edges[s][3]]) == key]

    def _stored_spec(self, leaf: int) -> tuple[tuple[str, ...], ...]:
        """A leaf's layout: `space.storage_spec` of its first reader's operand spec."""
        layout = self._layout
        j, o = layout.readers[leaf][0]
        zero = self._zero if layout.leaf_is_param[leaf] else ()
        key = ("stored", self._views[j].operand_specs[o], layout.leaf_shape[leaf], zero)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = storage_spec(key[1], key[2], zero, self.mesh)
        return out

    def _shard_bytes(self, shape: tuple[int, ...], spec: tuple, dtype: str) -> int:
        key = ("bytes", shape, spec, dtype)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = shard_bytes(shape, spec, dtype, self.mesh)
        return out

    def _build_leaf(self, leaf: int) -> _LeafTasks:
        """A parameter's or batch input's tasks (gathers, gradient syncs, update) and bytes."""
        layout = self._layout
        shape, dtype = layout.leaf_shape[leaf], layout.leaf_dtype[leaf]
        store = self._stored_spec(leaf)
        stored = self._shard_bytes(shape, store, dtype)
        gathers, gather_ends, gathered = self._build_gathers(leaf, store)
        if not layout.leaf_is_param[leaf]:
            return _LeafTasks(gathers, gather_ends, 0, stored + gathered)
        opt = self._optimizer_spec(leaf, store)
        owned = stored if opt == store else self._shard_bytes(shape, opt, dtype)
        syncs, ready = self._build_grad_syncs(leaf, opt)
        seg = layout.update_seg[leaf]
        reduce = self._build_update_reduce(leaf, opt, seg, ready)
        update = self._task_graph.new(layout.key(seg, 0, 1),
                                      self._compute_time(self.cost_model.update_time(owned)),
                                      (0,), reduce or ready,
                                      (UPDATE, leaf))
        # the distributed optimizer's all-gather of the updated shards
        regather = self._chain_tasks(self._pricing.chain(shape, dtype, opt, store),
                                     layout.key(seg, 1), [update], PARAM_GATHER, leaf)
        return _LeafTasks(gathers + syncs + reduce + [update] + regather, gather_ends, stored,
                          gathered, owned)

    def _optimizer_spec(self, leaf: int, store: tuple) -> tuple[tuple[str, ...], ...]:
        """Parameter `leaf`'s optimizer state layout: its stored layout `store` split further
        over the distributed optimizer's axes (`space.optimizer_specs`)."""
        if not self._optimizer:
            return store
        key = ("optimizer", store, self._layout.leaf_shape[leaf], self._optimizer)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = storage_spec(store, key[2], self._optimizer, self.mesh)
        return out

    def _build_update_reduce(self, leaf: int, store: tuple, seg: int, ready: list[int]
                             ) -> list[int]:
        """The all-reduce of the scalars the optimizer reduces parameter `leaf` to (its share of
        a global gradient norm), over the mesh axes its stored layout `store` splits it over;
        none when the optimizer reduces nothing or the parameter is whole on every device.
        Once per step, after the gradient's synchronisation: the update waits for it.

        XLA's all-reduce combiner makes the scalars of every parameter one all-reduce. A GPU
        runs that as one collective: each parameter's is priced at its share, the time of one
        scalar all-reduce over the parameter count (about one all-reduce's latency in all
        when every parameter is split). XLA:CPU runs a combined all-reduce as one rendezvous
        per operand: each is priced whole there (GPT-2 tiny's 20 under Megatron: 1.9 ms).

        (Under a global norm every update waits for every parameter's reduction; each waits
        for its own here, which keeps a parameter's tasks one unit for the delta simulation.
        On a device that runs its collectives and kernels one after the other, as XLA:CPU
        does, that is the same time.)
        """
        axes = tuple(a for dim in store for a in dim)
        if not self._reductions or not axes:
            return []
        key = ("norm", axes)
        comm = self._memo.get(key, False)
        if comm is False:
            comm = self._pricing.comm("all_reduce", 4 * self._reductions, axes)
            if comm is not None and self.topology.platform != "cpu":
                comm = comm._replace(dur=comm.dur / max(1, len(self.graph.params)))
            self._memo[key] = comm
        if comm is None:
            return []
        return self._chain_tasks((comm,), self._layout.key(seg, 0, 0), ready, UPDATE_REDUCE, leaf)

    def _build_gathers(self, leaf: int, store: tuple) -> tuple[list[int], list[int], int]:
        """Each reader's resharding of `leaf` from its stored layout `store` (under ZeRO-3 an
        all-gather): the tasks, the last one per reader (-1 for none), and the bytes of the
        copies in other layouts, kept for the backward pass."""
        layout = self._layout
        shape, dtype = layout.leaf_shape[leaf], layout.leaf_dtype[leaf]
        tasks, ends, gathered = [], [], 0
        for j, o in layout.readers[leaf]:
            spec = self._views[j].operand_specs[o]
            if spec != store:
                gathered += self._shard_bytes(shape, spec, dtype)
            chain = self._chain_tasks(self._per_microbatch(
                self._pricing.chain(shape, dtype, store, spec)), layout.fwd_key(j, o), [],
                PARAM_GATHER, leaf)
            tasks += chain
            ends.append(chain[-1] if chain else -1)
        return tasks, ends, gathered

    def _build_grad_syncs(self, leaf: int, store: tuple) -> tuple[list[int], list[int]]:
        """The gradient synchronisation of each reader's contribution to parameter `leaf`,
        back to its stored layout `store`: the tasks, and those its update waits for.

        Each reader's contribution is synchronised on its own, right after that reader's
        backward, and the synced contributions are summed: XLA's partitioner puts the
        all-reduce (or reduce-scatter) at the operation that makes the partial sum, before the
        add, so a tied embedding's gradient is all-reduced twice (seen in compiled HLO).
        """
        layout = self._layout
        shape, dtype = layout.leaf_shape[leaf], layout.leaf_dtype[leaf]
        tasks, ready = [], []
        for j, o in reversed(layout.readers[leaf]):
            v = self._views[j]
            chain = self._partial_chain(shape, dtype, v.operand_specs[o], store,
                                        v.partial_groups[o])
            sync = self._chain_tasks(chain, layout.bwd_key(j, 1 + o), [self._backward_task[j]],
                                     GRAD_SYNC, leaf)
            tasks += sync
            ready += sync[-1:] if sync else [self._backward_task[j]]
        return tasks, ready

    def _partial_chain(self, shape: tuple[int, ...], dtype: str, src: tuple, dst: tuple,
                       groups: tuple[tuple[str, ...], ...]) -> tuple[Comm, ...]:
        """The resharding `src` -> `dst` of a sum partial over the axes of `groups` (one group
        per iteration dim they split): one collective per dim, as XLA's partitioner reduces
        the partial sums of each split contracting dim on its own. A weight's gradient under
        context parallelism (the batch over ``data``, the sequence over ``model``) is two
        all-reduces of the whole gradient, over ``model`` and over ``data``, not one over both
        (jax 0.10: a dot or a sum over two dims split so, on cpu8). The groups `dst` does not
        split are all-reduced in place first, the rest reduced into `dst` last."""
        split = {a for axes in dst for a in axes}
        early = [g for g in groups if not split & set(g)][: len(groups) - 1]
        last = tuple(a for g in groups if g not in early for a in g)
        chain = tuple(c for g in early for c in self._pricing.chain(shape, dtype, src, src, g))
        return chain + self._pricing.chain(shape, dtype, src, dst,
                                           tuple(a for a in self.mesh.axis_names if a in last))

    def _forward_deps(self, j: int) -> list[int]:
        """What operator `j`'s forward task waits for: its inputs' reshardings (or, with none,
        their producers) and its parameters' gathers."""
        layout, out = self._layout, []
        for code, ref, reader in layout.operands[j]:
            if code == EDGE:
                chain = self._edge_tasks[self._resharded_by(ref)].forward
                out.append(chain[-1] if chain else self._output_ready(*layout.edges[ref][:2]))
            elif code == LEAF:
                t = self._leaf_tasks[ref].gather_ends[reader]
                if t >= 0:
                    out.append(t)
        return out

    def _backward_deps(self, j: int) -> list[int]:
        """What operator `j`'s backward task waits for: its outputs' cotangents, back from each
        consumer (after their resharding, where there is one)."""
        layout, out = self._layout, []
        for e in layout.out_edges[j]:
            chain = self._edge_tasks[e].backward
            out.append(chain[-1] if chain else self._backward_done(layout.edges[e][2]))
        return out

    # --- accounting ---------------------------------------------------------------------------

    def _count_buffers(self, tasks: list[int], sign: int) -> None:
        info, counts = self._task_graph.info, self._buffer_counts
        for t in tasks:
            if info[t][0] != UPDATE:
                n = info[t][1].nbytes
                c = counts.get(n, 0) + sign
                if c:
                    counts[n] = c
                else:
                    del counts[n]

    def _memory(self) -> MemoryBreakdown:
        p = self._stored_bytes
        if self._act is None:  # exact whatever the order of changes: a pure function of views
            views = self._views
            self._act = self._segments.activation_bytes(
                [v.recomputes for v in views], [v.output_bytes for v in views],
                [v.operand_bytes for v in views], [v.internal_bytes for v in views])
        owned = (sum(unit.optimizer_bytes for unit in self._leaf_tasks) if self._optimizer
                 else p)  # the distributed optimizer's shards (`Strategy.optimizer_axes`)
        return MemoryBreakdown(params=p, grads=p, opt_state=round(owned * self.opt_state_factor),
                               activations=self._act + self._leaf_bytes,
                               comm_buffers=max(self._buffer_counts, default=0))

    def _task_name(self, t: int) -> str:
        kind, ref, *subject = self._task_graph.info[t]
        ops, layout = self.graph.operators, self._layout
        if kind in (FORWARD, BACKWARD):
            return f"{kind} {ops[ref].name}"
        if kind == UPDATE:
            return f"update {layout.leaf_source[ref]}"
        x = subject[0]
        inner = "ring" if ref.kind == "collective_permute" else "statistics"  # `_ring_chain`
        what = (layout.edge_name[x] if kind == RESHARD else f"d({layout.edge_name[x]})"
                if kind == RESHARD_BWD else f"{ops[x].name} (partial sums)"
                if kind == PARTIAL_SUM else f"{ops[x].name} ({inner})"
                if kind == INNER_REDUCE else f"d({ops[x].name} {inner})"
                if kind == INNER_REDUCE_BWD else layout.leaf_source[x]
                if kind == PARAM_GATHER else f"norm {layout.leaf_source[x]}"
                if kind == UPDATE_REDUCE else f"grad {layout.leaf_source[x]}")
        return f"{ref.kind} {what} over {'+'.join(ref.axes)}"


class _OpComm(NamedTuple):
    """An operator's own collectives (`Simulation._build_op_comm`)."""

    forward: list[int]  # its statistics' all-reduces, then its partial sums'
    inner: int  # how many of `forward` are statistics
    backward: list[int]  # its statistics' all-reduces in the backward pass


class _EdgeTasks(NamedTuple):
    """An activation edge's communication tasks."""

    forward: list[int]  # its resharding (empty when a sibling edge's serves it: `_resharded_by`)
    backward: list[int]  # its cotangent's way back (empty when a sibling's serves it)


class _LeafTasks(NamedTuple):
    """A parameter's or batch input's tasks and bytes per device."""

    tasks: list[int]  # gathers, gradient synchronisations, update
    gather_ends: list[int]  # per reader: the last task of its gather, -1 for none
    stored_bytes: int  # its stored shard (parameters; 0 for batch inputs)
    activation_bytes: int  # the batch shard and copies in other layouts, kept for the backward
    optimizer_bytes: int = 0  # the parameter's shard its optimizer state mirrors (parameters)


def _by_dim(dims: Sequence[tuple[str, ...]], axes: tuple[str, ...]
            ) -> tuple[tuple[str, ...], ...]:
    """`axes` (in mesh order) grouped by the dim of `dims` (a config's axes per iteration dim)
    that each splits, in dim order: ``(("data",), (), ("model",))`` groups ``("data",
    "model")`` as ``(("data",), ("model",))``."""
    return tuple(g for d in dims if (g := tuple(a for a in axes if a in d)))


def _canonical_operators(graph: OpGraph) -> list[int]:
    """Per operator, the first operator of its repeated block (`OpGraph.repeated_blocks`) that
    is the same computation (`Operator.computation`, the key the cost model shares a layer's
    price under), else itself: their views under one config are equal, so they are worked out
    once (a 96-layer model prices one layer's operators, not 96). A looser key than the cost
    model's would make a view depend on which twin was priced first, and delta != full."""
    canon = list(range(len(graph.operators)))
    for group in graph.repeated_blocks():
        first = graph.operators[group[0]].computation
        for j in group[1:]:
            if graph.operators[j].computation == first:
                canon[j] = group[0]
    return canon


class _Batch:
    """A pending proposal: one `_Undo` per changed operator, and the timeline before it."""

    __slots__ = ("busy", "end", "start", "undos")

    def __init__(self) -> None:
        self.undos: list[_Undo] = []
        self.start: list[float] = []
        self.end: list[float] = []
        self.busy: list[float] = []


class _Undo:
    """What `reject` needs to restore the state before one operator's change."""

    __slots__ = ("activation_bytes", "deps", "edges", "leaf_activation_bytes", "leaves",
                 "new_tasks", "old_tasks", "op", "op_comm", "scatter", "stored_bytes", "view")

    def __init__(self, op: int, view: _View) -> None:
        self.op, self.view = op, view  # the operator and its view before the proposal
        self.activation_bytes = self.stored_bytes = self.leaf_activation_bytes = 0
        self.op_comm: list[tuple[int, _OpComm]] = []
        self.scatter: list[tuple[int, tuple]] = []  # (operator, its `_scatter_of` before)
        self.edges: list[tuple[int, _EdgeTasks]] = []
        self.leaves: list[tuple[int, _LeafTasks]] = []
        self.old_tasks: list[int] = []
        self.new_tasks: list[int] = []
        self.deps: list[tuple[int, list[int]]] = []  # (task, its dependencies before)
