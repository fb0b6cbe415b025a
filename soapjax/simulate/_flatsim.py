"""The flat step's simulator: a training step's task graph, its timeline and its memory.

`soapjax.simulate.front` is the simulator's entry point for any strategy; this module is the engine
of a step without pipeline stages (`Simulation`), which `soapjax.simulate.pipesim` runs for one
stage of a pipelined one.

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

The task graph of one training iteration, operators in program order
(`soapjax.simulate._taskgraph`):

* forward, per operator: the resharding of parameters stored in another layout (a ZeRO-3
  all-gather), of each input from its producer's output spec to the spec the config needs (the
  collectives `Resharder.reshard` says XLA emits; operators that read one value in the same
  layout share one resharding, as XLA computes it once), the forward task (`CostModel.op_time`),
  where the config splits a dim the operator reduces a statistic over (a layer norm's hidden
  dim, a softmax's keys, a cross-entropy's vocabulary: `soapjax.graph._inner`) the all-reduce of
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

This module is the `Simulation`'s front: what the search and `soapjax.simulate.front` call
(the step time, memory, results, `reset`) and the state they share. Its parts are modules of
their own, each a class `Simulation` is composed of: task building (`_flat_tasks`: an
operator's view under a config, and the units built from views; `_flat_leaves`: a parameter's
gathers, gradient synchronisation and update), attention pricing
(`_flat_attention`: ring and zigzag attention), memory accounting (`_flat_memory`), and the
proposals with their undo record (`_flat_proposals`). They share the object's state (the
units, the views, the pricing), and the delta rules in `_flat_proposals` keep it equal, bit for
bit, to a full simulation (`tests/test_simulate.py`). The task graph's engine is
`soapjax.simulate._taskgraph`; the result records and trace export `soapjax.simulate._simresult`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from soapjax.cost.operators import OpTime
from soapjax.cost.reshard import ReshardModel, permute_free
from soapjax.graph._cotangents import differentiated_operands, has_backward
from soapjax.graph.opgraph import OpGraph
from soapjax.measure._timing import quiet_gc
from soapjax.simulate._flat_attention import _AttentionPricing
from soapjax.simulate._flat_leaves import _LeafBuilding
from soapjax.simulate._flat_memory import _MemoryAccounting, shard_bytes
from soapjax.simulate._flat_proposals import _Batch, _Proposals, _settled
from soapjax.simulate._flat_tasks import (
    _TaskBuilding,
    _View,
    scatter_target,
    scattered_operand_axes,
)
from soapjax.simulate._simresult import (
    BACKWARD,
    FORWARD,
    GRAD_SYNC,
    PARAM_GATHER,
    UPDATE,
    UPDATE_REDUCE,
    Kept,
    MemoryBreakdown,
    SimResult,
    TaskRecord,
)
from soapjax.simulate._taskgraph import CHAIN, EDGE, Comm, Layout, Pricing
from soapjax.strategy.memory import (
    Segments,
    microbatch_shape,
)
from soapjax.strategy.space import (
    Config,
    MeshShape,
    Strategy,
    sample_dim,
)
from soapjax.topology.cluster import Topology

__all__ = ["OpCosts", "Simulation", "scatter_target", "scattered_operand_axes", "shard_bytes"]


class OpCosts(Protocol):
    """What the simulator asks of a cost model (`soapjax.cost.operators.CostModel` is one).

    Attributes:
      source: how the times were obtained (``"measured"``, ``"analytic"``), for the result.
      update_reductions: scalars the optimizer's update reduces each parameter to (a global
        gradient norm: 1; `soapjax.cost.operators.update_reductions`); a parameter stored split over
        mesh axes all-reduces them over those axes before its update. Optional (0 when absent).
      update_whole: parameter path -> the dims its update contracts (Muon's matrices;
        `soapjax.cost.updates.update_whole_dims`): its gradient is synchronised whole along
        them, its optimizer state kept so, and ``update_matmul_time(path)`` adds the update's
        matrix products; where the path is in ``update_reads`` (weight decay) the parameter is
        gathered so for the update as well. Optional (none when absent).
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


class _WholeUpdate(NamedTuple):
    """A parameter operand whose update contracts some of its dims (`_update_whole`)."""

    dims: tuple[int, ...]  # those dims of the operand (a scanned layer's slice: of the slice)
    path: str  # its leaf's path
    share: float  # the slice's share of the leaf (1 for a leaf read whole)
    reads: bool  # the update reads the parameter too (`OpCosts.update_reads`)
    layers: int  # the leaf's layer dims the slice drops
    leaf_dims: tuple[int, ...]  # the contracted dims of the leaf
    leaf_shape: tuple[int, ...]


def _update_whole(graph: OpGraph, whole: Mapping[str, tuple[int, ...]] | None,
                  reads: Iterable[str] = ()) -> dict[str, _WholeUpdate]:
    """Per parameter operand source whose update contracts some of its dims
    (`OpCosts.update_whole`, by leaf path)."""
    reads = set(reads)
    out: dict[str, _WholeUpdate] = {}
    shapes = {leaf.path: tuple(leaf.shape) for leaf in graph.params}
    for op in graph.operators if whole else ():
        for x in op.inputs:
            if x.kind == "param" and x.leaf_path in whole:
                k, path = len(x.layer), x.leaf_path
                out[x.source] = _WholeUpdate(
                    tuple(d - k for d in whole[path] if d >= k), path,
                    math.prod(x.shape) / math.prod(shapes[path]), path in reads, k,
                    tuple(whole[path]), shapes[path])
    return out


class Simulation(_Proposals, _TaskBuilding, _LeafBuilding, _AttentionPricing,
                 _MemoryAccounting):
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
      cost_model: gives `op_time(i, config)` and `update_time(bytes)` (see
      `soapjax.cost.operators`). resharder: gives the collectives of a resharding (see
      `soapjax.cost.reshard`). strategy: the initial strategy.
      opt_state_factor: optimizer state bytes per parameter byte (2 for Adam).
    """

    def __init__(self, graph: OpGraph, topology: Topology, cost_model: OpCosts,
                 resharder: ReshardModel,
                 strategy: Strategy, *, opt_state_factor: float = 2.0,
                 pipeline_stage: bool = False) -> None:
        self.graph = graph
        # one pipeline stage (`soapjax.simulate.pipesim`): XLA's partitioner runs a sequence-split
        # attention operator there, every tile computed, nothing sent to balance it
        # (`soapjax.apply._pipelined`'s whole_query_attention)
        self._whole_queries = pipeline_stage
        # a recomputing reader gathers its parameters again before its backward (flat apply:
        # `soapjax.apply._flatstep.stored_inputs`); a pipeline's layers are run by
        # `soapjax.apply._pipelined`, which keeps them as gathered
        self._regathers = not pipeline_stage
        # flat apply accumulates M microbatches' gradients in a loop, and XLA reduces each
        # one's partial gradients as it adds them (docs/checks.md: M times the bytes), but for
        # the all-reduces XLA:GPU moves out of the loop; a pipeline's stages sum their data
        # groups once (`soapjax.simulate.pipesim` prices it)
        self._sync_each_microbatch = not pipeline_stage
        self._sinks_all_reduces = topology.capabilities.sinks_loop_all_reduces
        self.topology = topology
        self.cost_model = cost_model
        self.mesh = MeshShape.of(topology)
        self.opt_state_factor = float(opt_state_factor)
        self._reductions = int(getattr(cost_model, "update_reductions", 0))
        self._update_whole = _update_whole(graph, getattr(cost_model, "update_whole", None),
                                           getattr(cost_model, "update_reads", ()))
        # the parameter operands (slices included) the step does not train (`OpGraph.frozen`)
        frozen = set(graph.frozen)
        self._frozen = frozenset(x.source for op in graph.operators for x in op.inputs
                                 if x.kind == "param" and x.leaf_path in frozen)
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
        pipeline simulation (`soapjax.simulate.pipesim`) cuts the step into model chunks with
        them."""
        end = self._task_graph.end
        return ([end[t] for t in self._forward_task], [end[t] for t in self._backward_task])

    @_settled
    def forward_starts(self) -> list[float]:
        """When each operator's forward compute task starts (graph order; `compute_ends`)."""
        start = self._task_graph.start
        return [start[t] for t in self._forward_task]

    @_settled
    def grad_sync_seconds(self) -> list[float]:
        """Per operator (graph order), the seconds of the gradient synchronisations of the
        parameters it reads, run after its backward (`_LeafBuilding._build_grad_syncs`): what
        a step that reduces the gradients at every microbatch's backward pays again each
        microbatch (`soapjax.simulate.pipesim`, a pipeline of coupled samples)."""
        task_graph, layout = self._task_graph, self._layout
        per_segment = layout.slots * CHAIN
        out = [0.0] * layout.n
        for t in task_graph.order:
            if task_graph.info[t][0] == GRAD_SYNC:  # its key is its reader's backward's
                out[2 * layout.n - 1 - task_graph.key[t] // per_segment] += task_graph.dur[t]
        return out

    @_settled
    def forward_seconds(self) -> list[float]:
        """Per operator (graph order), its forward's compute seconds in the step (every
        microbatch): what the pipeline simulation prices a split backward's W from
        (`soapjax.simulate.pipesim`)."""
        return [v.forward_s for v in self._views]

    @_settled
    def io_bytes_by_operator(self) -> list[tuple[tuple[int, ...], int]]:
        """Per operator (graph order), the bytes per device of each of its operands (0 but
        for activations) and of its outputs for one microbatch, at their layouts here: what a
        split backward stashes for a weight matmul's W (`soapjax.simulate.pipesim`)."""
        return [(tuple(v.operand_bytes), sum(v.output_bytes)) for v in self._views]

    @_settled
    def stash_io_by_operator(self, indices: Sequence[int]
                             ) -> dict[int, tuple[tuple[Kept, ...], tuple[Kept, ...]]]:
        """Per operator of `indices`, per operand and per output, what a split backward's
        lean stash keeps of it for one microbatch (`soapjax.apply._pipelined`'s rule): the
        value in the layout its maker holds it in (an operand: its maker's `held_specs`; an
        output: its own, a row-parallel matmul's reduce-scattered under sequence
        parallelism) where that is smaller per device than the layout this operator uses it
        in, then gathered again for W (`Kept`; moved where the operator is selectively
        recomputed: apply's checkpoint of such a layer gathers the operand again in the
        backward for the weight's gradient alone, which W now does, where a fully recomputed
        chunk gathers it for its forward anyway); else as used. Non-activations: zeros."""
        ops, index = self.graph.operators, self.graph.operator_index()
        out = {}
        for j in indices:
            op, v = ops[j], self._views[j]

            def kept(x: Any, used_spec: Any, used: int, held_spec: Any,
                     moved: bool = False) -> Kept:
                if held_spec is None:
                    return Kept(used, used, ())
                held = shard_bytes(microbatch_shape(x.shape, x.dims, self._sample[j],
                                                    self._micro), held_spec, x.dtype, self.mesh)
                if held >= used:
                    return Kept(used, used, ())
                had = {a for entry in used_spec for a in entry}
                return Kept(held, used, tuple(a for entry in held_spec for a in entry
                                              if a not in had), moved)

            def maker(x: Any) -> int | None:
                return index.get(x.source) if x.kind == "activation" else None
            operands = tuple(
                kept(x, s, n, None if maker(x) is None
                     else x.read_of(self.held_specs(maker(x))[x.index]),
                     v.policy == "selective")
                if n else Kept(0, 0, ())
                for x, s, n in zip(op.inputs, v.operand_specs, v.operand_bytes))
            held = self.held_specs(j)
            outputs = tuple(kept(x, s, n, h)
                            for x, s, n, h in zip(op.outputs, v.out_specs, v.output_bytes, held))
            out[j] = (operands, outputs)
        return out

    @_settled
    def policies(self, indices: Iterable[int]) -> set[str]:
        """The recompute policies of the operators `indices` (one call for many `choice`s)."""
        views = self._views
        return {views[i].policy for i in indices}

    def recomputes(self, j: int) -> bool:
        """Whether operator `j` runs its forward again in the backward under its policy
        (cheaper than asking `soapjax.strategy.memory.recomputes`, as `choice`)."""
        return self._views[j].recomputes

    @_settled
    def forward_gathers(self, indices: Sequence[int]) -> list[tuple[int, Comm]]:
        """The all-gathers of the forward reshardings the operators `indices` read their
        activations through, ``(reader, collective)``, each resharding once (by the edge that
        makes it, `_resharded_by`); the collective is every microbatch's (`Comm.runs`). What
        a checkpointed layer gathers again in its backward
        (`soapjax.simulate.pipesim.PipelinedSimulation.regathers`)."""
        key = ("reader edges", tuple(indices))  # the graph's structure: for every strategy
        edges = self._memo.get(key)
        if edges is None:
            operands = self._layout.operands
            edges = self._memo[key] = tuple((j, e) for j in key[1]
                                            for code, e, _ in operands[j] if code == EDGE)
        info, tasks, out = self._task_graph.info, self._edge_tasks, []
        for j, e in edges:
            for t in tasks[e].forward:
                if (c := info[t][1]).kind == "all_gather":
                    out.append((j, c))
        return out

    def permuting_reads(self, indices: Sequence[int], manual: Sequence[str] = ()
                        ) -> tuple[tuple[str, int], ...]:
        """``(operator, operand)`` of each read by the operators `indices` whose layout change
        XLA may make with a collective-permute (`soapjax.cost.reshard.permute_free` false):
        from the layout the value is held in (its maker's `held_specs`; a parameter's or
        batch input's stored layout) to the one the operator reads it in. A pipeline stage
        makes these changes inside its own action, where a collective-permute would hang
        (`soapjax.apply._pipelined.check_compiled`): the search keeps no pipelined plan
        with one (`soapjax.search._chain`). The `manual` axes (a pipeline's data groups, which
        the stage's program runs apart) are left out of both layouts: XLA does not
        partition over them there."""
        layout, ops, index = self._layout, self.graph.operators, self.graph.operator_index()

        def auto(spec: Any) -> tuple:
            return tuple(tuple(a for a in entry if a not in manual) for entry in spec)

        wanted = frozenset(indices)
        key = ("leaf reads", wanted)  # the graph's structure: the same for every strategy
        stored = self._memo.get(key)
        if stored is None:
            stored = self._memo[key] = {(j, o): leaf for leaf, readers
                                        in enumerate(layout.readers)
                                        for j, o in readers if j in wanted}
        out = []
        for j in sorted(wanted):
            for o, x in enumerate(ops[j].inputs):
                if (j, o) in stored:
                    src = self._stored_spec(stored[j, o])
                elif x.kind == "activation" and x.source in index:
                    src = x.read_of(self.held_specs(index[x.source])[x.index])
                else:
                    continue
                if not permute_free(auto(src), auto(self._dst(j, o)), self.mesh):
                    out.append((ops[j].name, o))
        return tuple(out)

    @_settled
    def activation_bytes_by_operator(self) -> list[int]:
        """The bytes each operator keeps for the backward pass per device, one microbatch,
        before recompute (`soapjax.strategy.memory.Segments.kept_bytes` with no operator
        recomputing)."""
        views = self._views
        return self._segments.kept_bytes([False] * len(views), [v.output_bytes for v in views],
                                         [v.operand_bytes for v in views],
                                         [v.internal_bytes for v in views])[0]

    @_settled
    def output_specs(self, i: int) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """Operator `i`'s outputs' layouts (per-dim mesh axes) under its current config."""
        return self._views[i].out_specs

    @_settled
    def held_specs(self, i: int) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """Operator `i`'s outputs' layouts as the step holds them: `output_specs`, but for an
        operator whose partial sums are reduce-scattered (`scatter_target`: a row-parallel
        matmul under sequence parallelism), whose first output is made in its readers' layout.
        What a pipeline sends between stages (`soapjax.simulate.pipesim`) and apply holds there."""
        target = self._scatter[i][0]
        specs = self._views[i].out_specs
        return specs if target is None else (tuple(target), *specs[1:])

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
        if self._stale is None and hasattr(self, "_views") and strategy == self.strategy:
            # built already (a search opens a simulation at the point it then scores first):
            # its full simulation is this one, a pure function of the strategy
            return self.step_time()
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
    def result(self) -> SimResult:
        """A frozen summary of the current state (a pending proposal included)."""
        task_graph, pricing = self._task_graph, self._pricing
        task_graph.settle()
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
                records.append(TaskRecord(name, kind, ("compute",), start, end, 0, 0.0, 0))
                continue
            sent += ref.sent
            by_class[ref.link_class] = by_class.get(ref.link_class, 0.0) + ref.sent
            channels = tuple(c for r in task_graph.res[t] if r  # 0: compute (`serial_comm`)
                             for c in pricing.resource_channels[r])
            param = (self._layout.leaf_source[task_graph.info[t][2]]
                     if kind in (PARAM_GATHER, GRAD_SYNC, UPDATE_REDUCE) else None)
            records.append(TaskRecord(name, kind, channels, start, end, ref.nbytes, ref.sent,
                                      ref.runs, param))
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
        task_graph.settle()
        return [(self._task_name(t), task_graph.start[t], task_graph.end[t])
                for t in task_graph.order]

    # --- building units -----------------------------------------------------------------------

    def _compute_time(self, seconds: float) -> float:
        """A compute task's time in the step: its time alone, stretched where the devices
        share the host's cores, plus the per-task dispatch (`Topology.compute`)."""
        if seconds <= 0:
            return 0.0
        return seconds * self._stretch + self._kernel_overhead


def _canonical_operators(graph: OpGraph) -> list[int]:
    """Per operator, the first operator of its repeated block (`OpGraph.repeated_blocks`) that
    is the same computation (`Operator.computation`, the key the cost model shares a layer's
    price under), else itself: their views under one config are equal, so they are worked out
    once (a 96-layer model prices one layer's operators, not 96). A looser key than the cost
    model's would make a view depend on which twin was priced first, and delta != full; so
    is what the backward differentiates of it (`soapjax.graph._cotangents`: BYOL's target
    network is its online network's computation, under ``stop_gradient``)."""
    canon = list(range(len(graph.operators)))
    for group in graph.repeated_blocks():
        first: dict[tuple, int] = {}
        for j in group:
            key = (graph.operators[j].computation, differentiated_operands(graph, j),
                   has_backward(graph, j))
            canon[j] = first.setdefault(key, j)
    return canon
