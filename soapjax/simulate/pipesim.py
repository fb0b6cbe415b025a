"""Simulating a pipelined strategy: one stage's SPMD step, cut into chunks, timed by a schedule.

This module stays one past 700 lines: `PipelinedSimulation` is one class whose parts (the
chunks' times, the schedule, the split backward's W and stash, the sums over the stages,
memory) read the same cut and state of the stage's simulation; what needs none of that lives
in `soapjax.simulate._pipe_cut`, `_pipe_fold` and `_simresult`.

A strategy with S pipeline stages (`Strategy.stages`, `soapjax.strategy.pipeline`) splits the
outermost mesh axis of the topology (``node``) S ways: each stage is the same group of devices (a
`scaled_topology` of ``N / S`` devices), and every operator keeps its S/A/P/R config over that
group's axes. The pipelined step is priced in three parts:

1. **One stage's work.** A `Simulation` of the whole graph on one stage's devices, with the
   strategy's configs as the stages' data groups run them (`_stage_groups.as_run`: the
   group axes on each stage operator's sample dim), ZeRO axes, recompute policies and M
   microbatches, gives every operator's forward and backward end on the compute stream.
   The layers (the graph's
   repeated blocks) are cut into ``S x v`` equal chunks of consecutive layers (or, uneven,
   into `Strategy.stage_layers` per stage: `layer_chunks`); the operators
   after the last layer (final norm, head, loss) go with the last chunk. A chunk's forward
   (backward) time for one microbatch is the span its operators take on that timeline,
   divided by M; the span includes the communication the one-stage simulation could not hide
   (tensor-parallel all-reduces, reshardings); the last chunk's also the collectives its
   loss's gathers run inside the stage (`_pipe_cut.loss_collectives`: where the vocabulary
   is split, an all-reduce of the picked log-probabilities, as Megatron-LM's loss runs it).
   The operators before the first layer (the embedding) run as `soapjax.apply.step` runs
   them: SPMD on every device, before the pipeline (their backward after it), at 1/S of
   their one-stage span.
2. **The schedule.** `soapjax.strategy.pipeline.time_schedule` runs the schedule's per-stage orders
   with those chunk times (a schedule that splits the backward, ZB-H1, runs each chunk's
   weight gradients apart: its layer operators' weight matmuls' share of their forward time,
   `_pipe_cut.weight_shares`, as apply defers them: `soapjax.apply._deferred`) and the
   stage-to-stage sends: one microbatch's boundary activations
   (the per-device shards of every value a later chunk reads from an earlier one), priced as a
   point-to-point transfer over the outermost mesh axis of the full topology (the link between
   two nodes), the same size back for the gradient.
3. **The tail.** After its last backward, a stage synchronises its parameters' gradients and
   updates them: the one-stage simulation's tail (its step end after the last backward), scaled
   by the stage's share of the parameter bytes. The step ends when the slowest stage's does.
   After the pipeline apply also sums over the stage axis the gradients of the parameters
   read outside the layers (embeddings, final norm, head), which every stage holds (seen in
   the compiled step; `PipelinedSimulation._stage_sum_bytes`): each stage runs the
   prologue's backward on its own cotangents of what the prologue handed it (the first
   stage's are the embeddings', the others' zero), so the prologue's parameters' sum
   follows that backward, beside the stages' tails, and the epilogue's (a tied embedding's
   with them) follows the tails. Megatron-LM's layout (``"chunks"``, 4) runs neither, but
   an all-reduce of a tied embedding's gradient between its first and last stage.
   Where the samples interact other than by sums (`OpGraph.sample_sums` None: dropless MoE
   routing sorts the batch's tokens), apply's stages run whole microbatches and XLA reduces
   the gradients at every backward: each chunk's backward also takes its gradient syncs
   (`Simulation.grad_sync_seconds`), M times a step (Megatron, ``"chunks"``: once).
4. **The layer layout** (``layer_layout``). `soapjax.apply.step` stores the stacked layer
   parameters ``[L, ...]`` split over the stages on the layer dim (``"model"``), ``L / S``
   layers a stage; with v > 1 in chunk order (`soapjax.apply._layer_order`: stage ``s``'s
   rows are the chunks it runs), so nothing moves (tests/test_apply_pipelined.py). Uneven
   stages (`Strategy.stage_layers`) run other layers than they keep: each step sends every
   stacked parameter's layers that a stage runs but another keeps
   (`soapjax.strategy.pipeline.stage_routes`: a point-to-point send per stacked parameter and
   shift, the gradients back the same way), and each stage holds the longest stage's run,
   padded, and adds its gradients up in it. Megatron-LM (``"chunks"``): nothing moves;
   `scripts/bench_gpu_sim.py` prices its configurations so.

**Memory** per stage: the one-stage simulation's parameters, gradients, optimizer state and
communication buffers scaled by the stage's share of the parameter bytes (its layers, plus the
parameters read outside the layers, which every stage holds as apply stores them), plus the
activations of one microbatch's chunk (their share of the one-stage activations) times the
schedule's peak in-flight (microbatch, chunk) pairs on that stage (a split backward's pairs
whose B has run and W has not at their stash's share of one: `PipelineTimeline.held`). The
plan fits when the fullest stage fits.

What is left out: the head on the last stage makes that stage slower, as it is (the search
may then cut the stages unevenly: `soapjax.search.stages.balance_stages`, one virtual stage only),
and the embedding's placement is apply's (SPMD), not a choice; compute and sends overlap as
the schedule allows, with the sends on their own links (no contention with the gradient
synchronisation); uneven stages' layer moves overlap nothing.

Delta simulation: configs and recompute policies change through the one-stage `Simulation`'s
delta simulation (exact, `soapjax.simulate.front`); the chunk times, schedule and memory are then
recomputed from its timeline, a pure function of it, so delta == full holds here too.

**Folded** (``fold=True``, what the search opens): where the layers are alike and the strategy
ties them, the one-stage simulation is a `soapjax.simulate._pipe_fold.FoldedStage`, which reads
the whole stage's timeline and memory off simulations of its first 3 and 4 layers: the same
prices to rounding (tests/test__pipe_fold.py), at a fraction of the work (docs/vs-experts.md).
It keeps no task records (`stage_result`, `step_collectives` need the stage whole).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from soapjax.base.collectives import bytes_sent
from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import OpGraph
from soapjax.simulate._flatsim import Simulation, shard_bytes
from soapjax.simulate._pipe_cut import (
    boundary_values,
    epilogue_gathers,
    epilogue_params,
    layer_chunks,
    layer_span,
    loss_collectives,
    prologue_params,
    send_pieces,
    shifted_reads,
    stash_bytes,
    tied_params,
    weight_operands,
    weight_shares,
)
from soapjax.simulate._pipe_fold import MIN_LAYERS, FoldedStage, StageCosts, layer_fold, tied
from soapjax.simulate._simresult import (
    GRAD_SYNC,
    Kept,
    MemoryBreakdown,
    PipelineResult,
    SimResult,
    as_step_result,
)
from soapjax.simulate._taskgraph import Comm
from soapjax.strategy._stage_groups import as_run, group_axes, run_config
from soapjax.strategy.pipeline import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    ChunkTimes,
    PipelineTimeline,
    StageHolds,
    check_pipeline,
    check_stage_layers,
    stage_holds,
    stage_routes,
    time_schedule,
)
from soapjax.strategy.space import Config, MeshShape, Strategy
from soapjax.topology.cluster import Topology, stage_topology

__all__ = ["LAYER_LAYOUTS", "PipelineResult", "PipelinedSimulation", "as_step_result",
           "layer_chunks"]

# Where the stacked layer parameters live between steps (module doc, 4): the model's layout, as
# soapjax.apply.step stores them, or the chunks', as Megatron-LM does.
LAYER_LAYOUTS = ("model", "chunks")


class PipelinedSimulation:
    """A pipelined strategy's step, kept up to date under config and recompute changes.

    The interface the search uses of a `Simulation` (`propose`, `propose_many`, `accept`,
    `reject`, `reset`, `step_time`, `fits_in_memory`, `choice`, `strategy`), with `topology`
    the devices of ONE stage (the configs' mesh) and `full_topology` the whole cluster.
    `fold`: simulate the stage on a few of its layers where they fold (module doc).
    """

    def __init__(self, graph: OpGraph, topology: Topology, cost_model, resharder,
                 strategy: Strategy, *, opt_state_factor: float = 2.0,
                 layer_layout: str = "model", fold: bool = False):
        if not strategy.pipelined:
            raise PlanError("PipelinedSimulation needs a strategy with pipeline stages; "
                            "use soapjax.simulate.front.Simulation for one without")
        if layer_layout not in LAYER_LAYOUTS:
            raise PlanError(f"layer_layout {layer_layout!r}: expected one of "
                            f"{', '.join(LAYER_LAYOUTS)} (module doc)")
        self.graph, self.full_topology = graph, topology
        self.topology = stage_topology(topology, strategy.stages)
        first, last = graph.memo("layer_span", lambda: layer_span(graph))
        # before the first layer (embedding): SPMD on every device, as apply runs it
        self._prologue = [i < first for i in range(len(graph.operators))]
        # Where the samples interact other than by sums (module doc, 3), apply's stages run
        # whole microbatches, and XLA reduces the gradients as every backward adds them;
        # Megatron-LM computes such statistics per rank and reduces once
        self._sync_each_microbatch = (bool(graph.sample_coupling) and graph.sample_sums is None
                                      and layer_layout == "model")
        self._outside = [i < first or i > last for i in range(len(graph.operators))]
        # what apply sums over the stage axis after the pipeline (`_stage_sum_bytes`): the
        # gradients of the parameters read outside the layers, the prologue's alone and the
        # epilogue's
        self._epilogue_params = graph.memo("epilogue_params",
                                           lambda: epilogue_params(graph, last))
        self._prologue_params = tuple(
            src for src in graph.memo("prologue_params", lambda: prologue_params(graph, first))
            if src not in self._epilogue_params)
        self._tied = graph.memo("tied_params", lambda: tied_params(graph, first, last))
        # what the last stage's loss gathers (`_loss_collectives`)
        self._gathers = graph.memo("epilogue_gathers", lambda: epilogue_gathers(graph, last))
        self._gather_memo: dict = {}
        self._sum_memo: dict[int, float] = {}
        costs = StageCosts(cost_model, MeshShape.of(self.topology))
        layers = graph.memo("layer_fold", lambda: layer_fold(graph)) if fold else None
        # the strategy as given (the search's view: `strategy`, `choice`), and as the stages'
        # data groups run it (what the stage simulation prices: `_stage_groups.as_run`)
        self._first = first
        self._user = _flat(strategy)
        self._groups_now = self._groups(self._user)
        self._run = run = self._as_run(self._user)
        self._pending: tuple[Strategy, Strategy, tuple[str, ...]] | None = None
        self._inner: Simulation | FoldedStage
        if layers is not None and layers.layers >= MIN_LAYERS and tied(graph, layers, strategy):
            self._inner = FoldedStage(graph, layers, self.topology, costs, resharder,
                                      run, opt_state_factor=opt_state_factor)
        else:
            self._inner = Simulation(graph, self.topology, costs, resharder, run,
                                     opt_state_factor=opt_state_factor, pipeline_stage=True)
        self._layer_layout = layer_layout
        self._cut(strategy.pipeline)
        self._result: PipelineResult | None = None
        # per boundary value (producer, output, layout, M): the pieces it is sent in; per
        # boundary's pieces: its send time (`_crossings`, `_send_times`)
        self._sent_memo: dict[tuple, tuple[int, int, tuple[str, ...]]] = {}
        self._send_memo: dict[tuple, float] = {}
        self._saved: PipelineResult | None = None

    def _cut(self, pipeline: tuple[int, int, str, tuple[int, ...]]) -> None:
        """What the pipeline's numbers decide, its stage layers included: each operator's
        chunk, the stages' parameter shares, what the layer layout moves."""
        graph = self.graph
        self._pipeline = pipeline
        stages, virtual, _, sizes = pipeline
        chunks = stages * virtual
        # the stages a sum over the stage axis spans: all, or Megatron's first and last
        self._sum_group = 2 if self._layer_layout == "chunks" else stages
        self._chunk = graph.memo(("layer_chunks", chunks, sizes),
                                 lambda: layer_chunks(graph, chunks, sizes))
        # each chunk's operators past the prologue, a range of indices (they are consecutive)
        self._ranges = graph.memo(("chunk_ranges", chunks, sizes), self._chunk_ranges)
        # parameters are kept L / S layers a stage in apply's layout, uneven stages too (an
        # interleaved pipeline's in chunk order: a stage keeps the chunks it runs)
        self._param_share = graph.memo(
            ("param_shares", stages, chunks, sizes if self._layer_layout == "chunks" else ()),
            self._param_shares)
        # the stacked parameters' layer slices, by stacked parameter, where a step moves them:
        # uneven stages only (apply keeps an interleaved pipeline's in chunk order)
        moves = bool(sizes)
        self._stacked = (graph.memo("stacked_layer_params", self._stacked_layer_params)
                         if self._layer_layout == "model" and moves else {})
        self._routes = stage_routes(sum(sizes), sizes) if sizes else ()
        # per chunk boundary, the values crossing it (producer, output), as `_crossings` reads
        self._boundary = graph.memo(("chunk_boundaries", chunks, sizes),
                                    lambda: boundary_values(graph, self._chunk))

    def _chunk_ranges(self) -> tuple[tuple[int, int], ...]:
        """Each chunk's operators past the prologue, ``(first, end)`` indices."""
        first = self._prologue.index(False) if False in self._prologue else len(self._chunk)
        bounds = [first] * (max(self._chunk) + 2)
        for i in range(first, len(self._chunk)):
            bounds[self._chunk[i] + 1] = i + 1
        for c in range(1, len(bounds)):  # a chunk without operators past the prologue
            bounds[c] = max(bounds[c], bounds[c - 1])
        return tuple(zip(bounds, bounds[1:]))

    def stage_layers_result(self, stage_layers: tuple[int, ...]) -> PipelineResult:
        """The step of the current configs with the layers cut into `stage_layers` per stage
        (() for equal stages), the simulation left as it was: one stage's simulation is the
        same whatever the boundaries, so this is the schedule's work only (what the search's
        balancing of the stages walks over: `soapjax.search.find`)."""
        stages, virtual, schedule, _ = self._pipeline
        check_stage_layers(tuple(stage_layers), stages, virtual)
        with self._cut_as((stages, virtual, schedule, tuple(stage_layers))):
            return self._compute()

    def schedule_result(self, schedule: str) -> PipelineResult:
        """The step of the current configs under another `schedule` of the same stages,
        virtual stages and stage layers, the simulation left as it was: the schedule's work
        only, as `stage_layers_result` (what the search's choice of a schedule reads:
        `soapjax.search.stages.choose_schedule`).

        Raises:
          PlanError: the schedule does not take this pipeline (`check_pipeline`).
        """
        stages, virtual, _, sizes = self._pipeline
        check_pipeline(schedule, stages, self.microbatches, virtual)
        with self._cut_as((stages, virtual, schedule, sizes)):
            return self._compute()

    def schedule_fits(self, schedule: str) -> bool:
        """Whether the current configs fit in memory under another `schedule`, as
        `schedule_result` would say, without timing it: what each stage holds comes from the
        schedule's orders (`stage_holds`), not its compiled dependency order (seconds at
        hundreds of thousands of actions). The simulation is left as it was.

        Raises:
          PlanError: the schedule does not take this pipeline (`check_pipeline`).
        """
        stages, virtual, _, sizes = self._pipeline
        holds = stage_holds(schedule, stages, self.microbatches, virtual)
        with self._cut_as((stages, virtual, schedule, sizes)):
            stash = self._stash() if SCHEDULES[schedule].splits_backward else None
            memory = self._stage_memory(holds, self._layout_moves(),
                                        None if stash is None else stash[0])
            return max(m.total for m in memory) <= self.topology.device.memory_bytes

    @contextlib.contextmanager
    def _cut_as(self, pipeline: tuple[int, int, str, tuple[int, ...]]) -> Iterator[None]:
        """Inside the block, the simulation cut as `pipeline` (stages, virtual stages,
        schedule, stage layers); after it, as it was, its result too (all a cut sets is
        derived from the pipeline's numbers, memoised)."""
        saved, result = self._pipeline, self._result
        try:
            self._cut(pipeline)
            yield
        finally:
            self._cut(saved)
            self._result = result

    def set_schedule(self, schedule: str) -> float:
        """Runs `schedule` from now on (`schedule_result`'s rules); the step time."""
        stages, virtual, _, sizes = self._pipeline
        check_pipeline(schedule, stages, self.microbatches, virtual)
        self._cut((stages, virtual, schedule, sizes))
        self._result = self._saved = None
        return self.step_time()

    def set_stage_layers(self, stage_layers: tuple[int, ...]) -> float:
        """Cuts the layers into `stage_layers` per stage from now on; the step time."""
        stages, virtual, schedule, _ = self._pipeline
        check_stage_layers(tuple(stage_layers), stages, virtual)
        self._cut((stages, virtual, schedule, tuple(stage_layers)))
        self._result = self._saved = None
        return self.step_time()

# --- the Simulation interface the search uses ----------------------------------------------

    @property
    def strategy(self) -> Strategy:
        return self._proposed()[0].with_pipeline(*self._pipeline)

    @property
    def microbatches(self) -> int:
        return self._inner.microbatches

    @property
    def mesh(self) -> MeshShape:
        return self._inner.mesh

    def choice(self, j: int) -> tuple[Config, str]:
        user = self._proposed()[0]
        return user.configs[j], user.recompute_of(j)

    def reset(self, strategy: Strategy) -> float:
        if strategy.pipeline != self._pipeline:
            raise PlanError("PipelinedSimulation.reset keeps the pipeline's stages, virtual "
                            "stages, schedule and stage layers; make a new PipelinedSimulation "
                            "to change them")
        self._user = _flat(strategy)
        self._groups_now = self._groups(self._user)
        self._run = self._as_run(self._user)
        self._inner.reset(self._run)
        self._pending = None
        self._result = None
        return self.step_time()

    def propose(self, i: int, config: Config, recompute: str | None = None) -> float:
        return self.propose_many([(i, config, recompute)])

    def propose_many(self, changes: Sequence[tuple[int, Config, str | None]]) -> float:
        """The changes, each operator from the first layer on run as the stages' data groups
        run it (`_stage_groups.as_run`): where a change moves the groups, the other stage
        operators whose layouts they set change with it."""
        user = self._user
        for i, config, recompute in changes:
            user = user.replace(i, config)
            if recompute is not None:
                user = user.with_recompute(i, recompute)
        ops, first = self.graph.operators, self._first
        # the groups follow the layers' configs alone
        groups = (self._groups(user) if any(ops[i].block_position for i, _, _ in changes)
                  else self._groups_now)
        if groups == self._groups_now:  # the changed operators alone move
            configs = list(self._run.configs)
            for i, config, _ in changes:
                configs[i] = config if i < first else run_config(
                    self.graph, i, config, groups, self.mesh, user.microbatches)
            run = dataclasses.replace(user, configs=tuple(configs))
        else:
            run = self._as_run(user, groups)
        changed = {i for i, _, _ in changes}
        moved = [(i, run.configs[i], r) for i, _, r in changes]
        if groups != self._groups_now:
            moved += [(j, run.configs[j], None) for j in range(first, len(run.configs))
                      if j not in changed and run.configs[j] != self._run.configs[j]]
        self._saved, self._pending = self._result, (user, run, groups)
        self._inner.propose_many(moved)
        self._result = None
        return self.step_time()

    def propose_strategy(self, strategy: Strategy) -> float:
        """`Simulation.propose_strategy` within this pipeline (its stages, virtual stages and
        schedule stay)."""
        if strategy.pipeline != self._pipeline:
            raise PlanError("PipelinedSimulation.propose_strategy keeps the pipeline's stages, "
                            "virtual stages, schedule and stage layers")
        user = _flat(strategy)
        groups = self._groups(user)
        run = self._as_run(user, groups)
        self._saved, self._pending = self._result, (user, run, groups)
        self._inner.propose_strategy(run)
        self._result = None
        return self.step_time()

    def accept(self) -> None:
        self._inner.accept()
        if self._pending is not None:
            self._user, self._run, self._groups_now = self._pending
            self._pending = None
        self._saved = None

    def reject(self) -> None:
        self._inner.reject()
        self._pending = None
        self._result, self._saved = self._saved, None

    def _proposed(self) -> tuple[Strategy, Strategy, tuple[str, ...]]:
        """The strategy as given, as run and its groups, of the state simulated now: the
        pending proposal's until `accept` or `reject`, as the stage simulation's own."""
        return self._pending or (self._user, self._run, self._groups_now)

    def _as_run(self, strategy: Strategy, groups: tuple[str, ...] | None = None) -> Strategy:
        """`strategy` (flat) as the stages' data groups (`groups`, else its own) run it
        (`_stage_groups.as_run`)."""
        return as_run(self.graph, strategy, self._groups(strategy) if groups is None else groups,
                      self._first, MeshShape.of(self.topology))

    def _groups(self, strategy: Strategy) -> tuple[str, ...]:
        """The axes the stages' data groups take under `strategy` (`_stage_groups`)."""
        return group_axes(self.graph, strategy, MeshShape.of(self.topology))

    def step_time(self) -> float:
        return self.result().step_time_s

    def peak_memory_bytes(self) -> int:
        return self.result().peak_memory_bytes

    def fits_in_memory(self) -> bool:
        return self.result().fits_in_memory

    def step_collectives(self) -> tuple[tuple[tuple[str, int, int], ...], float]:
        """The step's collectives as a device runs them, ``(kind, bytes per device, times)``,
        each stage's branches summed (as `soapjax.apply.collectives_as_run` counts the compiled
        step's), and the bytes a device sends in them all: the stage simulation's own (every
        layer's, `TaskRecord.collectives` times), but a stacked parameter's gradient
        synchronisation, update and gathers at one stage's share of the layers (a device syncs
        the layers its stage keeps: ``L / S``, the longest stage's padded run where stages are
        uneven); every chunk boundary's sends, a collective-permute of each piece per
        microbatch each way, and the receiver's all-gather of the pieces (scatter/gather); the
        layer layout's moves, each way; the two sums over the stage axis after the pipeline
        (`_stage_sum_bytes`); the last stage's collectives for what its loss gathers, each
        microbatch (`_loss_collectives`)."""
        S, _, _, sizes = self._pipeline
        stacked = self.graph.memo("stacked_layer_params", self._stacked_layer_params)
        layers = len(next(iter(stacked.values()))) if stacked else 0
        share = (max(sizes) if sizes else layers // S) / layers if layers else 1.0
        layer_params = {src for sources in stacked.values() for src in sources}
        # the gradients the pipeline reduces at every microbatch's backward (coupled samples:
        # all but the prologue's parameters'), else once
        each = (self._inner.microbatches if self._sync_each_microbatch else 1)
        prologue = {x.source for i, op in enumerate(self.graph.operators) if self._prologue[i]
                    for x in op.inputs if x.kind == "param"}
        out, sent = [], 0.0
        for t in self._inner.result().tasks:
            if t.collectives:
                scale = share if t.param in layer_params else 1.0
                runs = (each if t.kind == GRAD_SYNC and t.param not in prologue else 1)
                out.append((t.collective_kind, round(t.nbytes * scale), t.collectives * runs))
                sent += t.sent * scale * runs
        twice = 2 * self._inner.microbatches  # forward and back, each microbatch
        mesh = self._inner.mesh
        for crossing in self._crossings():
            for piece, whole, axes in crossing:
                out.append(("collective_permute", piece, twice))
                sent += piece * twice
                if axes:
                    out.append(("all_gather", whole, twice))
                    sent += bytes_sent("all_gather", whole, mesh.degree(axes)) * twice
        kind = "collective_permute" if self._routes else "all_to_all"
        for n in self._layout_moves().sends:
            out.append((kind, n, 2))
            sent += 2 * n
        for _, c in self.regathers():  # a selectively checkpointed layer's backward
            out.append(("all_gather", c.nbytes, c.runs))
            sent += c.sent
        if SCHEDULES[self._pipeline[2]].splits_backward:  # a lean stash's W gathers again
            # (a selectively recomputed layer's operands too, `Kept.moved`: the gather its
            # unsplit backward would run again, `regathers`, is W's now)
            for xs, dys in self._stash()[1]:
                for e in (*xs, *dys):
                    out.append(("all_gather", e.used, self._inner.microbatches))
                    sent += (bytes_sent("all_gather", e.used, mesh.degree(e.axes))
                             * self._inner.microbatches)
        for n in self._stage_sum_bytes():
            if n:
                out.append(("all_reduce", n, 1))
                sent += bytes_sent("all_reduce", n, self._sum_group)
        for kind, n, axes, _ in self._loss_collectives():
            out.append((kind, n, self._inner.microbatches))
            sent += bytes_sent(kind, n, self._inner.mesh.degree(axes)) * self._inner.microbatches
        return tuple(out), sent

    def _loss_collectives(self) -> tuple[tuple[str, int, tuple[str, ...], float], ...]:
        """The collectives the last stage runs each microbatch for what its loss gathers
        (`_pipe_cut.loss_collectives`; apply's `_run_in_stage`): ``(kind, bytes per device,
        one microbatch's; the axes; seconds)``."""
        inner = self._inner
        return loss_collectives(self.graph, self._gathers, lambda j: inner.choice(j)[0],
                                inner.mesh, inner.microbatches, self.topology, self._gather_memo,
                                megatron=self._layer_layout == "chunks")

    def stage_permutes(self) -> tuple[tuple[str, int], ...]:
        """The reads inside the stages (by the layers and the epilogue, which run in the
        stages' actions) whose layout change XLA may make with a collective-permute
        (`Simulation.permuting_reads`), and ``(operator, -1)`` for each operator there that
        splits a dim it slices, pads or concatenates (`_pipe_cut.shifted_reads`): apply
        refuses such a plan, whose step would hang (`soapjax.apply._pipelined
        .check_compiled`). () for a plan apply can run (docs/checks.md, "Collective-permutes
        inside a stage", for what it does not see)."""
        graph = self.graph
        first, last = graph.memo("layer_span", lambda: layer_span(graph))
        # every layer runs the first one's configs (`tie_blocks`): its reads, the next
        # layer's of it, and the epilogue's
        reads = graph.memo("stage_reads", lambda: _stage_reads(graph, first, last))
        # the batch's axes the layers split their samples over are the stages' data groups,
        # manual inside a stage, but where they do not divide a microbatch or the samples
        # interact other than by sums (`soapjax.apply._pipelined._data_groups`)
        manual = self._proposed()[2]
        out = list(self._inner.permuting_reads(reads, manual))
        # a dim the layers slice, pad or concatenate, split: apply gathers it whole for the
        # forward (`soapjax.apply._pipelined._run_in_stage`), and XLA moves the backward's
        # halos with collective-permutes (a rotary embedding's halves of a split head dim);
        # and where the value read arrives split along it (an operand apply leaves to XLA,
        # as attention's: flash attention pads its blocks)
        mesh = self.mesh

        def split(axes: Sequence[str]) -> bool:
            return any(mesh.axis_size(a) > 1 and a not in manual for a in axes)

        shifts = graph.memo("stage_shifts", lambda: tuple(
            e for e in shifted_reads(graph, first) if e[0] in reads))
        index = graph.operator_index()
        for j, v, dims, iters, picked in shifts:
            if picked:
                continue
            axes = self.choice(j)[0].axes
            held = next((self._inner.held_specs(index[x.source])[x.index]
                         for x in graph.operators[j].inputs
                         if x.value == v and x.kind == "activation" and x.source in index), ())
            if any(iters[k] is not None and iters[k] < len(axes) and split(axes[iters[k]])
                   or k < len(held) and split(held[k]) for k in dims):
                out.append((graph.operators[j].name, -1))
        return tuple(dict.fromkeys(out))

    def stage_result(self) -> SimResult:
        """One stage's simulated work for the whole batch (its M microbatches one after the
        other, no pipeline): the timeline the chunks are cut from."""
        return self._inner.result()

    # --- the pipelined step ---------------------------------------------------------------------

    def result(self) -> PipelineResult:
        """The pipelined step of the current strategy (computed once per state)."""
        if self._result is None:
            self._result = self._compute()
        return self._result

    def _compute(self) -> PipelineResult:
        S, v, schedule, _ = self._pipeline
        inner, M = self._inner, self._inner.microbatches
        chunks = S * v
        fwd_end, bwd_end = inner.compute_ends()
        # the prologue's forward end and backward end, if any; each chunk's last ends (a
        # chunk's operators are consecutive: `layer_chunks`)
        first = self._ranges[0][0]
        pro_f = max(fwd_end[:first], default=0.0)
        pro_b_end = max(bwd_end[:first], default=0.0)
        f_last = [max(fwd_end[lo:hi], default=0.0) for lo, hi in self._ranges]
        b_last = [max(bwd_end[lo:hi], default=0.0) for lo, hi in self._ranges]
        forward_done = max(fwd_end)
        forward = [(f_last[c] - (f_last[c - 1] if c else pro_f)) / M for c in range(chunks)]
        backward = [(b_last[c] - (b_last[c + 1] if c + 1 < chunks else forward_done)) / M
                    for c in range(chunks)]
        if self._sync_each_microbatch and M > 1:  # each backward reduces its gradients
            for i, (c, t) in enumerate(zip(self._chunk, inner.grad_sync_seconds())):
                if not self._prologue[i]:
                    backward[c] += t
        # the last chunk's forward runs its loss's gathers' collectives
        forward[-1] += sum(t for *_, t in self._loss_collectives())
        regathered = self._regathered()
        if regathered:  # each microbatch's backward gathers them again, beside the data
            # gradient's matmul (the forward's FLOPs again), which Megatron-LM and XLA's
            # scheduler overlap it with: what the matmul does not hide
            seconds = inner.forward_seconds()
            shares = self.graph.memo("weight_shares", lambda: weight_shares(self.graph))
            for j, comm in regathered:
                backward[self._chunk[j]] += max(0.0, comm.dur - shares[j] * seconds[j]) / M
        backward = [max(0.0, t) for t in backward]
        weight = self._weight_times(backward)
        stash = self._stash() if SCHEDULES[schedule].splits_backward else None
        if stash is not None:  # a lean stash's W gathers its operands and cotangents again
            for c, (moved, more) in enumerate(self._weight_gather_times(stash[1])):
                backward[c] += more
                weight[c] += moved + more
        times = ChunkTimes(tuple(max(0.0, t) for t in forward), tuple(backward),
                           self._send_times(), tuple(weight))
        timeline = time_schedule(schedule, S, M, v, times)
        # The prologue runs SPMD on all S stages' devices: before the pipeline, its backward
        # after it, each at 1/S of one stage's time for the whole batch.
        before = pro_f / S
        after = max(0.0, pro_b_end - b_last[0]) / S if pro_b_end else 0.0
        tail = max(0.0, inner.timeline_end() - max(bwd_end))
        tails = tuple(tail * share for share in self._param_share)
        moves = self._layout_moves()
        move = self._move_time(moves.sends)  # each way: parameters in, gradients out
        handed, shared = (self._stage_sum_time(n) for n in self._stage_sum_bytes())
        step = before + move + max(timeline.step_s + after + handed,
                                   max(end + t for end, t in zip(timeline.stage_end_s, tails))
                                   + shared)
        step += move + inner.call_overhead  # one SPMD call, as unpipelined
        memory = self._stage_memory(timeline, moves, None if stash is None else stash[0])
        cap = self.topology.device.memory_bytes
        return PipelineResult(step, timeline, times, memory, cap,
                              max(m.total for m in memory) <= cap, tails, (before, after),
                              (move, move), stage_sums_s=(handed, shared))

    def regathers(self) -> list[tuple[int, Comm]]:
        """``(chunk, collective)`` of each all-gather a layer's backward runs again: where the
        layers run under selective recomputation, apply's ``jax.checkpoint`` of a layer
        (`soapjax.apply._pipelined`) saves the matmuls' outputs and the kept values, not the
        gathered copy a weight matmul reads (a sequence-parallel norm's output gathered for
        the column-parallel matmul after it, as Megatron-LM keeps it), so the backward gathers
        it again for the weight's gradient: each forward all-gather into a weight matmul
        (`_pipe_cut.weight_shares`) that does not itself recompute, once per microbatch (the
        collective's `Comm.runs`). None under a lean stash's split backward, whose W gathers
        its operands (`_weight_gather_times`), nor without selective recomputation
        (docs/checks.md: XLA's all-gathers inside ``rematted_computation``). The chunk's
        backward pays what the data gradient's matmul (its forward's FLOPs again) does not
        hide of each: Megatron-LM overlaps the two, as XLA's scheduler may."""
        return [(self._chunk[j], c) for j, c in self._regathered()]

    def _regathered(self) -> list[tuple[int, Comm]]:
        """`regathers` by reader: ``(operator, collective)``."""
        schedule = SCHEDULES[self._pipeline[2]]
        if schedule.splits_backward and not schedule.gathered_stash:
            return []
        inner = self._inner
        blocks, readers = self.graph.memo(("regather_candidates", self._ranges),
                                          self._regather_candidates)
        policies = inner.policies(blocks)
        if "full" in policies or "selective" not in policies:
            return []
        return inner.forward_gathers([i for i in readers if not inner.recomputes(i)])

    def _regather_candidates(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The chunks' layer operators (`_ranges`, past the prologue and before the epilogue)
        that have a `block_position` (their policies make the layers'), and those that are
        weight matmuls (`_pipe_cut.weight_shares`): what `_regathered` reads, per pipeline
        shape."""
        graph = self.graph
        layer = [i for lo, hi in self._ranges for i in range(lo, hi) if not self._outside[i]]
        shares = graph.memo("weight_shares", lambda: weight_shares(graph))
        return (tuple(i for i in layer if graph.operators[i].block_position),
                tuple(i for i in layer if shares[i]))

    def _weight_gather_times(self, lean: Sequence[tuple[tuple[Kept, ...], tuple[Kept, ...]]]
                             | None = None) -> list[tuple[float, float]]:
        """Per chunk, the seconds of one microbatch's W gathering its lean stash again
        (`_pipe_cut.stash_bytes`): those the unsplit backward gathers too, which the B then
        does not (operands of selectively recomputed operators: `Kept.moved`), and those it
        does not (the outputs' cotangents, which the B gathers for its own matmul as well;
        operands the forward gathered and the backward kept, or a fully recomputed chunk's
        forward gathers again). XLA compiles as many
        (tests/test_apply_pipelined.py, docs/checks.md). `lean`: `_stash`'s second part,
        where already made."""
        memo = self._send_memo
        out = []
        for xs, dys in self._stash()[1] if lean is None else lean:
            pair = [0.0, 0.0]
            for e in (*xs, *dys):
                key = ("all_gather", e.used, e.axes)
                if key not in memo:
                    memo[key] = self.topology.collective_time("all_gather", e.used, e.axes)
                pair[not e.moved] += memo[key]
            out.append((pair[0], pair[1]))
        return out

    def _weight_times(self, backward: Sequence[float]) -> list[float]:
        """Per chunk, one microbatch's weight gradients in its layers' matmuls: what a
        schedule that splits the backward runs as the chunk's W (`_pipe_cut.weight_shares`
        of each layer operator's forward time, the same FLOPs again; at most the chunk's
        backward). Zeros for other schedules."""
        if not SCHEDULES[self._pipeline[2]].splits_backward:
            return [0.0] * len(backward)
        shares = self.graph.memo("weight_shares", lambda: weight_shares(self.graph))
        seconds, M, outside = self._inner.forward_seconds(), self._inner.microbatches, self._outside
        return [min(b, sum(shares[i] * seconds[i] for i in range(lo, hi)
                           if shares[i] and not outside[i]) / M)
                for b, (lo, hi) in zip(backward, self._ranges)]

    def _stage_sum_bytes(self) -> tuple[int, int]:
        """The bytes per device of the two sums over the stage axis that apply's step runs
        after the pipeline (`soapjax.apply._pipelined`: every stage holds the parameters read
        outside the layers, runs the prologue's backward on its own cotangents of what the
        prologue handed it, and the epilogue's, so each has its own part of their gradients,
        zero where it does not read them): the gradients of the parameters the prologue
        alone reads (embeddings, but a tied one), after the prologue's backward, and of
        those the epilogue reads (final norm, head, a tied embedding), after the stages'
        tails; their stored shards, one all-reduce each. Megatron-LM's layout
        (``layer_layout="chunks"``): its first stage alone holds the embedding, its last the
        head, and a tied embedding's gradient is all-reduced between the two
        (`_pipe_cut.tied_params`)."""
        if self._pipeline[0] < 2:
            return 0, 0
        stored = self._inner.stored_param_bytes()
        if self._layer_layout == "chunks":
            return 0, sum(stored.get(src, 0) for src in self._tied)
        return (sum(stored.get(src, 0) for src in self._prologue_params),
                sum(stored.get(src, 0) for src in self._epilogue_params))

    def _stage_sum_time(self, nbytes: int) -> float:
        """An all-reduce of `nbytes` per device over the stage groups of the outermost mesh
        axis (`_stage_sum_bytes`)."""
        if not nbytes:
            return 0.0
        t = self._sum_memo.get(nbytes)
        if t is None:
            t = self._sum_memo[nbytes] = self.full_topology.collective_time(
                "all_reduce", nbytes, (self.full_topology.axis_names[0],),
                group_size=self._sum_group)
        return t

    def _stage_of_chunk(self, c: int) -> int:
        return c % self._pipeline[0]

    def _param_shares(self) -> tuple[float, ...]:
        """Each stage's share of the parameter bytes: its layers' slices (``L / S`` layers,
        as apply keeps them between steps, uneven stages too; ``layer_layout="chunks"``:
        the layers it runs), plus every parameter read
        outside the layers (embedding, head), which every stage holds as apply stores them
        (the stage axis does not split them). Shares add up to more than 1."""
        S, v = self._pipeline[:2]
        kept = (layer_chunks(self.graph, S * v)
                if self._pipeline[3] and self._layer_layout == "model" else self._chunk)
        seen: dict[tuple[str, tuple[int, ...]], int] = {}
        stage_of: dict[tuple[str, tuple[int, ...]], int | None] = {}
        for i, (op, c) in enumerate(zip(self.graph.operators, kept)):
            for x in op.inputs:
                if x.kind == "param":
                    key = (x.leaf_path, x.layer)
                    everywhere = self._outside[i] and not x.layer
                    if key not in seen:
                        seen[key] = x.nbytes
                        stage_of[key] = None if everywhere else self._stage_of_chunk(c)
                    elif everywhere:
                        stage_of[key] = None
        total = sum(seen.values()) or 1
        shares = [0.0] * S
        for key, n in seen.items():
            for s in range(S) if stage_of[key] is None else (stage_of[key],):
                shares[s] += n / total
        return tuple(shares)

    def _stacked_layer_params(self) -> dict[str, tuple[str, ...]]:
        """Per stacked parameter (its leaf path), the sources of its layer slices: the
        parameters the layers read (module doc, 4)."""
        out: dict[str, dict[str, None]] = {}
        for i, op in enumerate(self.graph.operators):
            if self._outside[i]:
                continue
            for x in op.inputs:
                if x.kind == "param" and x.layer:
                    out.setdefault(str(x.leaf_path), {})[x.source] = None
        return {path: tuple(sources) for path, sources in out.items()}

    def layout_move_bytes(self) -> tuple[int, ...]:
        """The bytes each device puts into one of the collectives that move the stacked layer
        parameters from the model's layout to the chunks' (the same again for the gradients
        back; module doc, 4), one per collective, empty where nothing moves (one virtual
        stage of equal stages, or ``layer_layout="chunks"``). Interleaved: per stacked
        parameter, one all-to-all of the stage's shard of it (its ``L / S`` layers' stored
        shards). Uneven stages: per stacked parameter and shift of `stage_routes`, one
        point-to-point send of that many layers' shards."""
        return self._layout_moves().sends

    def _layout_moves(self) -> _LayoutMoves:
        """What the layer layout moves and holds (module doc, 4), from one read of the
        stage's stored parameter shards."""
        if not self._stacked:
            return _LayoutMoves((), 0, 0)
        stored = self._inner.stored_param_bytes()
        per_layer = [sum(stored[src] for src in sources) // len(sources)
                     for sources in self._stacked.values()]
        S, _, _, sizes = self._pipeline
        kept = len(next(iter(self._stacked.values()))) // S  # a stage keeps L / S layers
        if self._routes:
            copy = max(sizes) * sum(per_layer)  # the longest stage's run, padded
            return _LayoutMoves(tuple(n * r.rows for n in per_layer
                                      for r in self._routes if r.delta),
                                copy, copy - kept * sum(per_layer))
        sends = tuple(n * kept for n in per_layer)
        return _LayoutMoves(sends, sum(sends), 0)

    def _move_time(self, sends: Sequence[int]) -> float:
        """One way of the layer layout's collectives `sends` (module doc, 4) over the stage
        groups of the outermost mesh axis: all-to-alls (interleaved) or point-to-point sends
        (uneven)."""
        axis, S = (self.full_topology.axis_names[0],), self._pipeline[0]
        if self._routes:
            return sum(self.full_topology.collective_time("point_to_point", n, axis)
                       for n in sends)
        return sum(self.full_topology.collective_time("all_to_all", n, axis, group_size=S)
                   for n in sends)

    def send_bytes(self) -> tuple[int, ...]:
        """Per chunk boundary, the bytes each device sends for one microbatch: the shards of
        every value a later chunk reads from an earlier one, each cut into the pieces the
        scatter/gather rule sends (`_SendPlan`; the gradient goes back with the same size). A
        step sends ``M`` times each, forward and back."""
        return tuple(sum(piece for piece, _, _ in c) for c in self._crossings())

    def _send_times(self) -> tuple[float, ...]:
        """Per chunk boundary: the point-to-point transfer of the pieces over the outermost
        mesh axis of the full topology, then the receiver's all-gathers of the pieces over
        the axes they were cut along (the stage's own links)."""
        axis = (self.full_topology.axis_names[0],)
        memo = self._send_memo
        times = []
        for crossing in self._crossings():
            key = tuple(crossing)
            t = memo.get(key)
            if t is None:
                t = self.full_topology.collective_time(
                    "point_to_point", sum(piece for piece, _, _ in crossing), axis)
                for _, whole, axes in crossing:
                    if axes:
                        t += self.topology.collective_time("all_gather", whole, axes)
                memo[key] = t
            times.append(t)
        return tuple(times)

    def _crossings(self) -> list[list[tuple[int, int, tuple[str, ...]]]]:
        """Per chunk boundary, per value crossing it: ``(bytes sent, shard bytes, axes it is
        gathered over)``.

        Megatron-LM's scatter/gather (Narayanan et al. 2021, section 4.1), as
        `soapjax.apply._pipelined` sends: a value replicated over some of the stage's mesh axes (the
        residual stream under tensor parallelism) is cut along the last dim of its shard that
        the product ``r`` of those axes' sizes divides; each replica sends its ``1/r`` piece
        over its own link and the receiver all-gathers the pieces over those axes. A value
        with no such dim is sent whole by every replica."""
        ops, inner = self.graph.operators, self._inner
        mesh, M = inner.mesh, inner.microbatches
        memo = self._sent_memo
        out = []
        for values in self._boundary:
            row = []
            for p, k in values:
                key = (p, k, inner.held_specs(p)[k], M)
                sent = memo.get(key)
                if sent is None:
                    x = ops[p].outputs[k]
                    nbytes = shard_bytes(x.shape, key[2], x.dtype, mesh) // M
                    sent = memo[key] = send_pieces(x.shape, key[2], mesh, nbytes)
                row.append(sent)
            out.append(row)
        return out

    def _stage_memory(self, timeline: PipelineTimeline | StageHolds, moves: _LayoutMoves,
                      stash: Sequence[int] | None = None) -> tuple[MemoryBreakdown, ...]:
        """Per stage, its peak memory per device, holding what `timeline` says it holds;
        `stash`: per chunk, the stash's bytes under a split backward (`_stash`), where
        already made."""
        m = self._inner.memory_breakdown()
        S, v = self._pipeline[:2]
        act = self._inner.activation_bytes_by_operator()
        total_act = sum(act) or 1
        chunk_act = [sum(act[lo:hi]) for lo, hi in self._ranges]
        chunk_act[0] += sum(act[:self._ranges[0][0]])  # the prologue's, with the first chunk
        if not timeline.held_pairs:
            stash = [0] * (S * v)
        elif stash is None:
            stash = self._stash_bytes()
        out = []
        for s in range(S):
            share = self._param_share[s]
            per_pair = max(chunk_act[c] for c in range(s, S * v, S)) / total_act
            one = m.activations * per_pair  # one (microbatch, chunk)'s, recomputation kept
            # (more than one where the forward keeps less than the stash: full recomputation)
            ratio = max(stash[c] for c in range(s, S * v, S)) / one if one else 1.0
            out.append(MemoryBreakdown(
                params=int(m.params * share) + moves.copy,
                grads=int(m.grads * share) + moves.padding,
                opt_state=int(m.opt_state * share),
                activations=int(one * timeline.held(s, ratio)),
                comm_buffers=m.comm_buffers, constants=m.constants))
        return tuple(out)

    def _stash_bytes(self) -> list[int]:
        """Per chunk, what a microbatch whose B has run and W has not holds under a split
        backward (`_pipe_cut.stash_bytes`)."""
        return self._stash()[0]

    def _stash(self) -> tuple[list[int], list[tuple[tuple[Kept, ...], tuple[Kept, ...]]]]:
        """`_pipe_cut.stash_bytes` of the current strategy: per chunk, the stash's bytes,
        and its lean entries (operands, cotangents) that W gathers again (none under a
        schedule whose stash is gathered: `Schedule.gathered_stash`)."""
        operands = self.graph.memo("weight_operands", lambda: weight_operands(self.graph))
        wanted = [i for lo, hi in self._ranges for i in range(lo, hi)
                  if operands[i] and not self._outside[i]]
        if SCHEDULES[self._pipeline[2]].gathered_stash:  # every value kept as used
            used = self._inner.io_bytes_by_operator()
            io = {i: (tuple(Kept(n, n, ()) for n in used[i][0]),
                      (Kept(used[i][1], used[i][1], ()),)) for i in wanted}
        else:
            io = self._inner.stash_io_by_operator(wanted)
        return stash_bytes(self.graph, self._ranges, operands, io, self._outside)


def _stage_reads(graph: OpGraph, first: int, last: int) -> frozenset[int]:
    """The operators `PipelinedSimulation.stage_permutes` reads for: the first two layers'
    (of the `first` .. `last` span; the second's first reads the first's last) and the
    epilogue's."""
    layers = max((len(g) for g in graph.repeated_blocks()), default=1)
    per = (last - first + 1) // max(layers, 1)
    return frozenset([*range(first, min(last + 1, first + 2 * per)),
                      *range(last + 1, len(graph.operators))])


class _LayoutMoves(NamedTuple):
    """What the layer layout moves each step and holds (`PipelinedSimulation._layout_moves`):
    the bytes each device puts into each collective (one way), the chunks' copy of a stage's
    stacked parameters held through the step, and what uneven stages' gradients add in it
    over the stage's own layers (they are added up in the padded run)."""

    sends: tuple[int, ...]
    copy: int
    padding: int


def _flat(strategy: Strategy) -> Strategy:
    """The strategy without its pipeline: what one stage runs."""
    return dataclasses.replace(strategy, stages=1, virtual_stages=1, schedule=DEFAULT_SCHEDULE,
                               stage_layers=())
