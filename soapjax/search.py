"""The execution optimizer: Metropolis-Hastings over strategies, scored by the simulator.

As the FlexFlow paper (section 6): a proposal gives one operator, chosen uniformly at random,
a config chosen uniformly at random from its SOAP space; delta simulation scores it; it is
accepted with probability ``min(1, exp(beta * (cost(S) - cost(S*))))`` against the *current*
strategy S. Every baseline (data parallel, Megatron, FSDP, the paper's experts) and some random
strategies are initial candidates, and so are Megatron's grid's best point and, for a model
with experts or a long sequence, the best grid point with expert or context parallelism (a
chain from TP 8 seldom walks into them: `GRID_FAMILIES`); each gets an equal share of what
the budget leaves after the starts are scored, and stops early when its best has not
improved for half of its share. The budget bounds the whole search
(`SearchSettings.budget_s`): measuring new shard programs stops at 80% of it
(`soapjax.cost.CostModel.measure_until`: later ones are estimated from the roofline and the
operator's measured ones), scoring Megatron's grid at 30%, the chains 5% before its end. The
best strategy that fits in device memory
over all chains is returned, so it is never worse than the best baseline.

**beta.** Costs are step times, whose scale varies by orders of magnitude between models and
clusters, so beta is set relative to the chain's starting cost c0: ``beta = ln 2 / (t * c0)``
with temperature ``t = 0.02``: a proposal 2% slower than the current strategy is accepted half
the time, one 10% slower about 3% of the time.

**Memory.** A strategy that does not fit costs its step time times ``2 + 10 * overflow`` (its
excess as a fraction of device memory), so chains can walk through it but prefer fitting
strategies; only fitting strategies are ever recorded as the best.

**Reproducibility.** With `SearchSettings.max_proposals` set, chains stop on proposal counts
only (and on no improvement for half of them), so a seed gives the same plan on any machine;
with a time budget alone the number of proposals depends on the machine's speed.

**Full or delta simulation.** Proposals are scored by delta simulation (the paper's Algorithm
2: `Simulation.propose`, then `accept` or `reject`). ``SearchSettings(simulation="full")``
scores every proposal by simulating the candidate strategy from scratch instead (Algorithm 1,
`Simulation.reset`), as the paper's baseline in Table 4 and Figure 12 does. Both give exactly
the same step times, so with the same seed and `max_proposals` both walk the same chain and
return the same strategy; only the search time differs.

**Repeated blocks and memory dimensions.** Operators at the same position of every layer
(`OpGraph.repeated_blocks`: a scan over layers, or identical unrolled layers) move together:
one proposal changes that position in every layer (`Simulation.propose_many`, one retiming
pass), so a 96-layer model costs the search what one layer costs. Some proposals change a
recompute policy (of one operator or one layer position) or the number of microbatches
instead of a config. Megatron's grid (`baselines.megatron_grid`) is scored and its best point
is a chain's start, so a plan is never slower than the grid.

**Pipeline stages.** With ``SearchSettings(pipelines=True)`` (`soapjax plan --pipelines`), or
by default when no plan without stages fits in memory, for each stage count S that divides
the layers and the outermost mesh axis (`stage_choices`) and each virtual-stage count v whose
S x v chunks cut the layers equally (`interleave_choices`), Megatron's grid at that pipeline
(`pipeline_grid`: TP 4 or 8, the expert- and context-parallel degrees of `grid_degrees`,
microbatch sizes 1, 2, 4, 8 ... and the per-replica batch, recompute none / selective / full,
with and without the distributed optimizer) is scored (`soapjax.simulate.open_simulation`: a
`soapjax.pipesim.PipelinedSimulation`) along its coordinates first (`_score_points`), in two
passes (`_pipelined_chains`); the `CHAINED_PIPELINES` pipelines whose grids did best
then each get a chain (configs, recompute, microbatches, over one stage's devices) from their
best point (`_pipelined_chains` says why only those); the best plan over all grids and
chains, pipelined or not, is returned. S and v are chosen among pipelines, not by moves
within a chain. A chain's best at one virtual stage then has its stage boundaries walked
over (`balance_stages`: a stage of fewer layers where the head weighs, each step sending the
layers a stage runs but another keeps, priced), a walk on the schedule alone, the stage's
simulation unchanged. The grid holds only what apply runs (the interleaved schedule's M a
multiple of S: `soapjax.pipeline.pipeline_error`), and the chains' microbatch moves keep to
the same rule.
Every pipeline is priced as apply runs it: with v > 1 each step also moves the stacked layer
parameters between the model's layout and the chunks' (`soapjax.pipesim`, module doc, 4), so
a smaller bubble is weighed against those all-to-alls and the copy they hold.

**One entry point.** `find_plan` is how soapjax plans: graph + topology + settings -> `Plan`.
The command line (`soapjax plan`), the training helper (`shard_training(strategy="plan")`),
`soapjax check`, the notebook and the scripts all call it, so the defaults live in one place:
`SearchSettings()`, ``costs="auto"`` (measured where the topology's devices are attached,
else the analytic roofline), and the ideal resharding model (`soapjax.reshard.DEFAULT_MODE`;
`find_plan` says why).

One chain, its moves and its acceptance rule, is `soapjax._chain` (with `SearchSettings`,
re-exported here); this module runs the chains within the budget and plans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import sys
import time
from typing import Any

import jax

from soapjax._arguments import (
    check_costs,
    check_graph,
    check_optimizer,
    check_settings,
    check_topology,
)
from soapjax._chain import (
    MAX_BUDGET_S,
    MAX_PROPOSALS,
    Progress,
    SearchSettings,
    _cost,
    _Searcher,
    _tie_blocks,
    random_strategy,
)
from soapjax.baselines import (
    baselines as make_baselines,
    expert_dim,
    megatron_grid,
    sequence_dims,
    with_recompute,
)
from soapjax.cost import CostModel, cost_model as make_cost_model
from soapjax.errors import PlanError
from soapjax.graph import OpGraph
from soapjax.memory import microbatch_error
from soapjax.pipeline import pipeline_error
from soapjax.pipesim import PipelinedSimulation, layer_chunks
from soapjax.plan import Plan
from soapjax.reshard import DEFAULT_MODE, Resharder
from soapjax.simulate import (
    Simulation,
    default_pricing,
    open_simulation,
    opt_state_factor,
    simulate,
)
from soapjax.space import (
    RECOMPUTE_POLICIES,
    Config,
    MeshShape,
    SpaceLimits,
    Strategy,
    configs,
    data_parallel,
    within_limits,
)

__all__ = ["CONTEXT_PARALLEL_MIN_TOKENS", "MAX_BUDGET_S", "MAX_PROPOSALS", "PIPELINE_GRID",
           "Progress", "SearchResult",
           "SearchSettings", "balance_stages", "exhaustive", "find_plan", "grid_degrees",
           "improving_change", "interleave_choices", "make_simulation", "pipeline_grid",
           "print_progress", "random_strategy", "search", "stage_choices"]


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The outcome of a search.

    Attributes:
      strategy: the best strategy found that fits in memory.
      step_time_s: its simulated step time.
      start: the initial candidate whose chain found it.
      baselines: (name, simulated step time, fits in memory) of every baseline.
      proposals: proposals simulated, all chains.
      accepted: proposals accepted.
      search_time_s: wall-clock time of the search.
      history: (seconds since the start, best step time so far) at each improvement.
    """

    strategy: Strategy
    step_time_s: float
    start: str
    baselines: tuple[tuple[str, float, bool], ...]
    proposals: int
    accepted: int
    search_time_s: float
    history: tuple[tuple[float, float], ...]

    def baseline_times(self) -> dict[str, float]:
        return {name: t for name, t, _ in self.baselines}


# Shares of a time budget (`SearchSettings.budget_s`, counted from the search's start):
# measuring new shard programs stops at MEASURE_SHARE of it (later ones are estimated), scoring
# Megatron's grid at GRID_SHARE (the points left are skipped), and the chains end FINAL_SHARE
# before its end, left for simulating the plan found and writing it.
MEASURE_SHARE = 0.8
GRID_SHARE = 0.3
FINAL_SHARE = 0.05


class _Budget:
    """Points in time of a search's budget; all None when it counts proposals instead."""

    def __init__(self, t0: float, settings: SearchSettings):
        self.t0 = t0
        self.budget_s = None if settings.max_proposals is not None else settings.budget_s

    def at(self, fraction: float) -> float | None:
        return None if self.budget_s is None else self.t0 + fraction * self.budget_s


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


def search(graph: OpGraph, topology, *, cost_model=None, resharder=None,
           settings: SearchSettings = SearchSettings(), family: str | None = None,
           opt_state_factor: float = 2.0, progress: Progress | None = None) -> SearchResult:
    """Searches for the fastest strategy of `graph` on `topology` that fits in memory.

    Args:
      graph: the operator graph (`soapjax.trace`).
      topology: the cluster (`soapjax.load_topology`).
      cost_model: operator times (default: `soapjax.cost.cost_model(graph, topology)`).
      resharder: resharding collectives (default: `soapjax.reshard.Resharder` in its default
        mode, `soapjax.reshard.DEFAULT_MODE`).
      settings: budget, seed, space limits.
      family: "cnn", "rnn", ... to choose the paper's expert strategy (None: both).
      opt_state_factor: optimizer state bytes per parameter byte (2 for Adam).
      progress: called with a one-line status about twice a second.

    Returns:
      The best strategy found, with the baselines' times.

    Raises:
      PlanError: no strategy at all fits in memory (not even the baselines or what the
        search visited).
    """
    # The budget starts now: building the first simulation prices (and may measure) every
    # operator of data parallelism.
    budget = _Budget(time.perf_counter(), settings)
    costs, resharder = default_pricing(graph, topology, cost_model=cost_model,
                                       resharder=resharder)
    measured = getattr(costs, "source", "") == "measured"
    if measured:
        costs.measure_until(budget.at(MEASURE_SHARE), progress)
    try:
        sim = make_simulation(graph, topology, cost_model=costs, resharder=resharder,
                              opt_state_factor=opt_state_factor)
        searcher = _Searcher(sim, settings, progress)
        searcher.t0 = budget.t0
        return _search(graph, topology, sim, searcher, budget, settings, family,
                       opt_state_factor, progress, cost_model)
    finally:
        if measured:
            costs.measure_until(None)


def _search(graph: OpGraph, topology, sim: Simulation, searcher: _Searcher, budget: _Budget,
            settings: SearchSettings, family: str | None, opt_state_factor: float,
            progress: Progress | None, cost_model) -> SearchResult:
    starts = dict(make_baselines(graph, topology, family))
    mesh = MeshShape.of(topology)
    for k in range(settings.num_random):
        starts[f"random-{k}"] = random_strategy(graph, mesh, searcher.rng, settings.limits)
    scored = []
    if family in (None, "transformer") and graph.repeated_blocks():
        starts.update(_grid_starts(sim, searcher, graph, topology, progress, settings.limits,
                                   budget.at(GRID_SHARE)))
    # Baselines outside the space the caller asked for (sequence parallelism splits a CNN's
    # norms spatially, where convolutions are kept whole) are not starts.
    starts = {name: _tie_blocks(graph, s) for name, s in starts.items()
              if _within(graph, s, settings.limits)}
    for n, (name, strategy) in enumerate(list(starts.items())):
        if progress is not None:
            how = ("operator costs measured on first use" if sim.cost_model.source == "measured"
                   else "analytic operator costs")
            progress(f"search: scoring start {n + 1}/{len(starts)} ({name}); {how}")
        sim.reset(strategy)
        scored.append((name, sim.step_time(), sim.fits_in_memory()))
        searcher.record(name)
        if not scored[-1][2] and graph.repeated_blocks():
            starts[name] = _recomputing(sim, searcher, graph, name, strategy)
    wanted = settings.pipelines if settings.pipelines is not None else searcher.best is None
    pipelined = wanted and graph.repeated_blocks() and graph.batch_size > 1
    # With a time budget, the chains share what the starts left, half of it for the pipelined
    # chains when there are some; with a proposal count, each chain runs its proposals.
    t_chains = time.perf_counter()
    end = budget.at(1.0 - FINAL_SHARE)
    if end is None:  # proposal counts: the chains' deadlines are never consulted
        share = settings.budget_s / len(starts)
    else:
        flat_end = t_chains + (end - t_chains) / 2 if pipelined else end
        share = max(flat_end - t_chains, 0.0) / len(starts)
    for k, name in enumerate(starts):
        searcher.chain(name, starts[name], t_chains + share * (k + 1))
    if pipelined:
        for result in _pipelined_chains(graph, topology, cost_model or sim.cost_model,
                                        settings, opt_state_factor, progress, searcher, end):
            if result is not None and (searcher.best is None or result[0] < searcher.best[0]):
                searcher.best = result
                searcher.history.append((time.perf_counter() - searcher.t0, result[0]))
    searcher._report("done", force=True)
    if searcher.best is None:
        hint = ("" if wanted or not graph.repeated_blocks() else
                " or allow pipeline stages (SearchSettings(pipelines=None or True), "
                "`soapjax plan --pipelines`)")
        raise PlanError(f"no strategy found for {graph.name!r} on {topology.name!r} fits in "
                        f"{topology.device.memory_bytes / 2**30:.1f} GiB per device; plan for "
                        f"a topology with more devices or more memory per device{hint}")
    t, strategy, name = searcher.best
    return SearchResult(strategy=strategy, step_time_s=t, start=name,
                        baselines=tuple((n, st, f) for n, st, f in scored
                                        if not n.startswith("random")),
                        proposals=searcher.proposals, accepted=searcher.accepted,
                        search_time_s=time.perf_counter() - searcher.t0,
                        history=tuple(searcher.history))


# Megatron's grid at each pipeline depth, as the search scores it (TP 1 and 2 are left out: with
# stages, Megatron-LM keeps TP at the node's 8, or 4); virtual stages are `interleave_choices`.
PIPELINE_GRID = {"tp": (4, 8)}
# ... and for a model with experts, where expert parallelism takes TP's place inside the node
# (Megatron-LM's Mixtral 8x7B: TP 2, EP 8, PP 4): every TP.
PIPELINE_GRID_EXPERTS = {"tp": (1, 2, 4, 8)}
# How many pipelines (S, v, schedule), the fastest by their grid's best point, get a chain.
CHAINED_PIPELINES = 3


def stage_choices(graph: OpGraph, topology) -> tuple[int, ...]:
    """Pipeline stage counts S > 1 worth trying: dividing the outermost mesh axis (whole
    groups of nodes per stage) and the number of repeated layers."""
    layers = _num_layers(graph)
    outer = topology.axis_sizes[0] if len(topology.axis_sizes) > 1 else 1
    return tuple(S for S in range(2, outer + 1) if outer % S == 0 and layers % S == 0)


def interleave_choices(graph: OpGraph, stages: int) -> tuple[int, ...]:
    """Virtual stages per device v worth trying at `stages` S: every v whose S x v chunks cut
    the layers equally (`soapjax.pipesim.layer_chunks`, and apply's stacked stage weights):
    GPT 530B's 105 layers on 35 stages take v in (1, 3) (Megatron-LM ran v = 3), on 5 stages
    v in (1, 3, 7, 21)."""
    layers = _num_layers(graph)
    if stages < 2 or layers % stages:
        return (1,)
    return tuple(v for v in range(1, layers // stages + 1) if layers % (stages * v) == 0)


def _num_layers(graph: OpGraph) -> int:
    """The layers a pipeline cuts (the longest family of repeated blocks)."""
    return max((len(g) for g in graph.repeated_blocks()), default=0)


def pipeline_grid(graph: OpGraph, topology, stages: int, limits: SpaceLimits = SpaceLimits()
                  ) -> dict[tuple[int, str], dict[str, Strategy]]:
    """Megatron's grid at `stages` pipeline stages, as the search scores it, by (virtual
    stages, schedule): TP in `PIPELINE_GRID` (`PIPELINE_GRID_EXPERTS` with experts), every
    `interleave_choices` v, the expert- and context-parallel degrees of `grid_degrees`, the
    microbatch sizes and recomputations of `baselines.megatron_grid`; points outside `limits`,
    or whose layers do not cut into S x v chunks, left out; each pipeline's points in the order
    `_likely_first` gives. Every point is one apply runs (`megatron_3d` builds only
    strategies `soapjax.pipeline.pipeline_error` accepts)."""
    degrees = grid_degrees(graph, topology)
    tp = (PIPELINE_GRID_EXPERTS if len(degrees["ep"]) > 1 else PIPELINE_GRID)["tp"]
    grid = megatron_grid(graph, topology, pp=(stages,),
                         interleave=interleave_choices(graph, stages), tp=tp, **degrees)
    by_pipe: dict[tuple[int, str], dict[str, Strategy]] = {}
    for name, st in grid.items():
        if _within(graph, st, limits):
            by_pipe.setdefault((st.virtual_stages, st.schedule), {})[name] = st
    for v, schedule in list(by_pipe):
        try:
            layer_chunks(graph, stages * v)
        except PlanError:
            del by_pipe[v, schedule]
            continue
        by_pipe[v, schedule] = dict(sorted(by_pipe[v, schedule].items(), key=_likely_first))
    return by_pipe


def _recomputing(sim: Simulation, searcher: _Searcher, graph: OpGraph, name: str,
                 strategy: Strategy) -> Strategy:
    """A start that does not fit, recomputing its layers as a person would try next
    (`baselines.with_recompute`: selective, then full), each variant scored and recorded; the
    fastest that fits, or the start itself (MaxText's MoE rules fit the fine-grained MoE on 64
    H100s only with full recomputation: without it, its chain spent its share walking there)."""
    best = None
    for policy in RECOMPUTE_POLICIES[1:]:
        variant = _tie_blocks(graph, with_recompute(graph, strategy, policy))
        sim.reset(variant)
        searcher.record(f"{name}-{policy}")
        if sim.fits_in_memory() and (best is None or sim.step_time() < best[0]):
            best = (sim.step_time(), variant)
    return strategy if best is None else best[1]


def _likely_first(point: tuple[str, Strategy]) -> tuple[int, int, int, int]:
    """What Megatron-LM users run first: microbatches of 1, the most model parallelism (TP8;
    TP x EP 8 with experts, the most experts apart first), then recompute selective, full,
    none (`RECOMPUTE_POLICIES` from its second). Under a tight budget a pipeline's grid may be
    cut after a few points, and those must include the fast ones that fit."""
    parts = {"ep": "1", **dict(re.findall(r"-(tp|mb|ep)(\d+)", point[0]))}
    policy = RECOMPUTE_POLICIES.index(point[0].rsplit("-", 1)[1])
    tp, ep = int(parts["tp"]), int(parts["ep"])
    return (int(parts["mb"]), -tp * ep, -ep, (policy - 1) % len(RECOMPUTE_POLICIES))


def _pipelined_chains(graph: OpGraph, topology, cost_model, settings: SearchSettings,
                      opt_state_factor: float, progress: Progress | None, flat: _Searcher,
                      end: float | None = None):
    """Every pipeline (S from `stage_choices`, v from `interleave_choices`) has Megatron's
    grid at it scored (`pipeline_grid`); the `CHAINED_PIPELINES` whose grids did best each get
    a chain from their best point. Yields each pipeline's best grid point, then each chain's
    best, as (time, strategy, start name) or None. Proposals and acceptances add to `flat`'s
    counts.

    **Why grids for all, chains for a few.** Interleaving over every v the layers allow makes
    many pipelines (GPT 530B on 280 A100s: S in {5, 7, 35}, 10 (S, v) pairs); an equal share
    of the budget for each would leave every chain too short to matter. A grid point is one
    simulation, and the grid's best already ranks the pipelines (Megatron's own choice, TP8
    PP35 v3, is a grid point), so the chains go where the best grids are. With a deadline
    `end`, the grids take the first half of the time left, the chains the second. The grids'
    half is two passes: the first ranks the pipelines, each scoring its grid (`_score_points`:
    along its coordinates first) for an equal share of the first quarter (a pipeline's grid
    stops where its share does, after one point at least); the second goes on with the grids
    of the `CHAINED_PIPELINES` best pipelines of distinct stage counts, each from its first
    pass's best, in the second quarter (Mixtral 8x22B on 32 H100s: the first pass stops TP8
    PP4's 123 points at microbatches of 2, 63.3 s; the second reaches microbatches of 4,
    55.9 s, the grid's best). Pipelines
    with the most stages come first (the least per device: a plan that fits comes early), and
    once one fits, the pipelines left when the grids' half is spent are not opened (opening one
    builds a simulation of the whole model: seconds for GPT 530B, whose 10 pipelines took the
    search 74 s past a 60 s budget; now 57 s)."""
    # The most stages first: they hold the least per device, so a plan that fits comes early
    pipes = [(S, v, schedule, points) for S in sorted(stage_choices(graph, topology), reverse=True)
             for (v, schedule), points in pipeline_grid(graph, topology, S,
                                                        settings.limits).items()]
    t_grid = time.perf_counter()
    grid_end = None if end is None else t_grid + max(end - t_grid, 0.0) / 2
    # the grids' time: a first pass over every pipeline ranks them, a second scores the rest of
    # the best ones' grids
    probe_end = None if grid_end is None else t_grid + (grid_end - t_grid) / 2
    ranked = []
    scored: dict[int, set[str]] = {}  # pipeline -> the names of its grid's points scored
    for k, (S, v, schedule, points) in enumerate(pipes):
        fits = any(not key[0] for key, *_ in ranked)
        if fits and _past(probe_end):  # opening a pipeline's simulation costs seconds at scale;
            # past the deadline, only while nothing fits yet
            if progress is not None:
                progress(f"search: {len(pipes) - k} of {len(pipes)} pipelines left unscored "
                         "(time budget)")
            break
        deadline = _share(probe_end, len(pipes) - k)
        if progress is not None:
            progress(f"search: scoring Megatron's grid at {S} pipeline stages, {v} virtual "
                     f"({len(points)} configurations; pipeline {k + 1} of {len(pipes)})")
        with _pipeline_searcher(graph, topology, cost_model, settings, opt_state_factor,
                                progress, flat, S, v, schedule, next(iter(points.values()))) \
                as searcher:
            key, name, start, seen = _score_points(searcher, points, deadline,
                                                   until_fit=not fits)
            ranked.append((key, k, name, start))
            scored[k] = seen
            yield searcher.best
    # the second pass: the best pipeline of each stage count, the best CHAINED_PIPELINES of
    # those (a first pass cut short ranks a stage count's grid by the few points it reached:
    # LLaMA 70B at 32K on 64 H100s, whose best is at 2 stages, had its 3 best at 8)
    per_stages: dict[int, tuple] = {}
    for r in sorted(ranked):
        per_stages.setdefault(pipes[r[1]][0], r)
    best_pipes = sorted(per_stages.values())[:CHAINED_PIPELINES]
    for j, (key, k, name, start) in enumerate(best_pipes):
        S, v, schedule, points = pipes[k]
        rest = {n: st for n, st in points.items() if n not in scored[k]}
        if not rest or _past(grid_end):
            continue
        rest = {name: start, **rest}  # the descent goes on from the first pass's best
        if progress is not None:
            progress(f"search: the rest of Megatron's grid at {S} pipeline stages, {v} virtual "
                     f"({len(rest)} configurations)")
        with _pipeline_searcher(graph, topology, cost_model, settings, opt_state_factor,
                                progress, flat, S, v, schedule, start) as searcher:
            better = _score_points(searcher, rest, _share(grid_end, len(best_pipes) - j))
            if better[0] < key:
                ranked[next(i for i, r in enumerate(ranked) if r[1] == k)] = (
                    better[0], k, better[1], better[2])
            yield searcher.best
    for j, (_, k, name, start) in enumerate(sorted(ranked)[:CHAINED_PIPELINES]):
        if _past(end):
            break
        S, v, schedule, _ = pipes[k]
        deadline = _share(end, min(len(ranked), CHAINED_PIPELINES) - j)
        with _pipeline_searcher(graph, topology, cost_model, settings, opt_state_factor,
                                progress, flat, S, v, schedule, start) as searcher:
            # the chain walks the configs at the stage boundaries its start is best at
            _, start, _ = balance_stages(searcher.sim, (searcher.sim.step_time(), start, name),
                                         deadline)
            searcher.chain(name, start, deadline if deadline is not None
                           else time.perf_counter() + settings.budget_s / 4)
            flat.proposals += searcher.proposals
            flat.accepted += searcher.accepted
            yield searcher.best


def balance_stages(sim: PipelinedSimulation, best: tuple[float, Strategy, str],
                   end: float | None = None, *, rounds: int = 64
                   ) -> tuple[float, Strategy, str]:
    """`best` (a chain's best: time, strategy, start name) with its stage boundaries moved
    where that makes the step faster: uneven stages (`Strategy.stage_layers`), the last one
    lighter where the head weighs, as Megatron-LM's ``--decoder-last-pipeline-num-layers``.

    A descent on one stage's simulation (`PipelinedSimulation.stage_layers_result`: the
    boundaries change only the schedule's work, not the stage's simulation): from equal
    stages, each round tries every boundary moved by one layer either way and keeps the
    fastest that fits, until none is faster (or `rounds`, or `end`). Only where apply runs
    it: one virtual stage, the layers dividing by the stages (`check_stage_layers`). The
    search balances each chain's start (`_pipelined_chains`), where `sim` is at it already;
    `sim` ends at the result."""
    t, strategy, name = best
    S, v, _, layers = strategy.pipeline
    num_layers = _num_layers(sim.graph)
    if v != 1 or S < 2 or layers or num_layers % S or num_layers < 2 * S or _past(end):
        return best
    if sim.strategy != strategy:
        sim.propose_strategy(strategy)
        sim.accept()
    even = [num_layers // S] * S
    sizes = even
    for _ in range(rounds):
        if _past(end):
            break
        tried = []
        for b in range(S - 1):
            for d in (1, -1):
                cut = list(sizes)
                cut[b] += d
                cut[b + 1] -= d
                if min(cut) < 1:
                    continue
                r = sim.stage_layers_result(tuple(cut))
                if r.fits_in_memory:
                    tried.append((r.step_time_s, cut))
        if not tried or min(tried)[0] >= t:
            break
        t, sizes = min(tried)
    if sizes == even:
        return best
    sim.set_stage_layers(tuple(sizes))
    return sim.step_time(), sim.strategy, name


def _score_points(searcher: _Searcher, points: dict[str, Strategy], deadline: float | None,
                  *, until_fit: bool = False
                  ) -> tuple[tuple[bool, float], str, Strategy, set[str]]:
    """Scores `points` until `deadline` (one at least; with `until_fit`, past it until one
    fits: while no pipeline's grid has a plan that fits, a deadline must not hide one, as it hid
    GPT 70B at 32K tokens' on 64 H100s), each recorded as seen; returns the best's key (does
    not fit, its cost: the step time, penalised as the chains penalise a point that does not
    fit), name and strategy, and the names scored.

    The order is a descent over the grid's coordinates (`_coordinates`) before the rest in
    their order: from the first point, every point on the line through the best so far along
    one coordinate (recomputation, distributed optimizer, microbatch size, TP, EP, CP:
    `_DESCENT`), the best moving to the line's best, one coordinate after another, until a
    round moves it no more; then every point that differs from the best in recomputation and
    one other coordinate at once (a point may fit without recomputation only at a higher CP or
    TP degree, where with recomputation it is slower than the best so far), and the lines again
    if that moved it; then the others. A grid cut by its deadline has then walked
    towards its best along each coordinate (Mixtral 8x22B on 256 H100s at 4 stages, 162
    points: in 1.2 s `_likely_first`'s order reached 17.0 s a step, 15.4 s in 2 s; the descent
    reaches the grid's best, 11.9 s, in 1.2 s, at the microbatch size that order puts last)."""
    names = list(points)
    coords = {n: _coordinates(n) for n in names}
    scored: dict[str, tuple[bool, float]] = {}
    best: str | None = None

    def stop() -> bool:
        return best is not None and _past(deadline) and not (until_fit and scored[best][0])

    def score(name: str) -> None:
        nonlocal best
        searcher.sim.reset(points[name])
        searcher.record(name)
        # a point that does not fit is ranked as the chains rank it: its step time times a
        # penalty growing with its excess memory (`_chain._cost`), so the descent heads for
        # points that fit rather than for the fastest of those that do not
        scored[name] = (not searcher.sim.fits_in_memory(), _cost(searcher.sim))
        if best is None or scored[name] < scored[best]:
            best = name

    score(names[0])
    moved = True
    while moved and not stop():
        moved = False
        # one coordinate at a time; where that settles, recomputation with one other at once
        # (a point that fits only with recomputation may be faster with more CP or TP and none)
        lines = [(axis,) for axis in _DESCENT]
        for pairs in (False, True):
            for axes in ([(_DESCENT[0], a) for a in _DESCENT[1:]] if pairs else lines):
                here = best
                for name in names:
                    if name in scored or not _apart(coords[name], coords[here], axes):
                        continue
                    if stop():
                        break
                    score(name)
                moved = moved or best != here
            if moved:
                break
    for name in names:
        if stop():
            break
        if name not in scored:
            score(name)
    return scored[best], best, points[best], set(scored)


_COORDINATE = re.compile(r"-(tp|cp|ep|pp|v|mb)(\d+)")


def _coordinates(name: str) -> dict[str, str]:
    """A grid point's coordinates from its `baselines.megatron_grid` name:
    ``"megatron-tp8-ep2-pp4-do-mb4-full"`` -> tp 8, ep 2, pp 4, do, mb 4, full (absent
    degrees are 1)."""
    out = {"tp": "1", "cp": "1", "ep": "1", "pp": "1", "v": "1"}
    out.update(_COORDINATE.findall(name))
    out["do"] = str("-do-" in name)
    out["rec"] = name.rsplit("-", 1)[1]
    return out


# the coordinates `_score_points` walks, one line at a time: what decides whether a point fits
# first (recomputation, the optimizer state sharded), then what the step time depends on most
_DESCENT = ("rec", "do", "mb", "tp", "ep", "cp")


def _apart(a: dict[str, str], b: dict[str, str], axes: tuple[str, ...]) -> bool:
    """Whether grid points `a` and `b` differ in every coordinate of `axes` and in no other."""
    return all(a[k] != b[k] for k in axes) and all(a[k] == b[k] for k in a if k not in axes)


def _share(end: float | None, parts: int) -> float | None:
    """The deadline of the first of `parts` equal shares of the time left before `end`."""
    if end is None:
        return None
    now = time.perf_counter()
    return now + max(end - now, 0.0) / parts


@contextlib.contextmanager
def _pipeline_searcher(graph: OpGraph, topology, cost_model, settings: SearchSettings,
                       opt_state_factor: float, progress: Progress | None, flat: _Searcher,
                       S: int, v: int, schedule: str, first: Strategy):
    """A `_Searcher` over a `PipelinedSimulation` opened at `first`, its clock `flat`'s, its
    microbatch moves those the schedule takes at S stages (`pipeline_error`)."""
    with open_simulation(graph, topology, first, cost_model=cost_model,
                         resharder=DEFAULT_MODE, opt_state_factor=opt_state_factor) as sim:
        searcher = _Searcher(sim, settings, progress)
        searcher.t0 = flat.t0
        searcher.microbatches = tuple(
            m for m in searcher.microbatches if pipeline_error(schedule, S, m, v) is None)
        yield searcher


# Context parallelism is for long sequences: Megatron-Core's grid of the search tries cp > 1
# only from this many tokens a sequence, so the 2K-4K-token decoders' grids stay as they were.
CONTEXT_PARALLEL_MIN_TOKENS = 8192


def grid_degrees(graph: OpGraph, topology) -> dict[str, tuple[int, ...]]:
    """The expert- and context-parallel degrees of Megatron's grid as the search scores it,
    as `baselines.megatron_grid`'s ``ep`` and ``cp``: every power of two up to the devices
    that divides every expert operator's experts (`baselines.expert_dim`), where the graph has
    experts; every power of two up to the devices that divides its sequence
    (`baselines.sequence_dims`), where that has `CONTEXT_PARALLEL_MIN_TOKENS` tokens or more;
    (1,) otherwise. Degrees no axes make are left out by `megatron_grid` itself.

    E.g. Mixtral 8x7B (8 experts, 4096 tokens) on 64 GPUs: ``ep=(1, 2, 4, 8), cp=(1,)``."""
    n = topology.num_devices
    powers = [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]
    experts = {op.split_sizes[d] for op in graph.operators if (d := expert_dim(op)) is not None}
    ep = tuple(p for p in powers if all(e % p == 0 for e in experts)) if experts else (1,)
    lengths = {op.iteration_sizes[d] for op, d in zip(graph.operators, sequence_dims(graph))
               if d is not None}
    cp = tuple(p for p in powers if all(t % p == 0 for t in lengths)) \
        if lengths and min(lengths) >= CONTEXT_PARALLEL_MIN_TOKENS else (1,)
    return {"ep": ep, "cp": cp}


def _within(graph: OpGraph, strategy: Strategy, limits: SpaceLimits) -> bool:
    return all(within_limits(op, c, limits) for op, c in zip(graph.operators, strategy.configs))


# The kinds of parallelism whose best grid point gets a chain of its own beside the grid's best:
# a chain from TP 8 rarely walks into expert or context parallelism (every expert operator and
# the all-to-alls must move together), so the search starts in those basins too.
GRID_FAMILIES = {"expert": "-ep", "context": "-cp"}


def _grid_starts(sim: Simulation, searcher: _Searcher, graph: OpGraph, topology,
                 progress: Progress | None, limits: SpaceLimits,
                 deadline: float | None = None) -> dict[str, Strategy]:
    """Scores Megatron's grid (`baselines.megatron_grid`, with the expert- and
    context-parallel degrees of `grid_degrees`); returns the chains' starts from it: the
    fastest point that fits (or the fastest), and for each family of `GRID_FAMILIES` the grid
    has (points with ``ep`` or ``cp`` above 1), that family's fastest, where it is another
    point. Every point is recorded as seen. Points after `deadline` are skipped (one is always
    scored)."""
    # In the order Megatron-LM users try them (`_likely_first`): a deadline that cuts the
    # grid (Mixtral 8x7B's 306 points with ep) cuts the unlikely points, not TP 4 and 8
    grid = dict(sorted(((name, s) for name, s in megatron_grid(
        graph, topology, **grid_degrees(graph, topology)).items()
        if _within(graph, s, limits)), key=_likely_first))
    best: dict[str, tuple[tuple[bool, float], str, Strategy]] = {}
    for n, (name, strategy) in enumerate(grid.items()):
        if best and _past(deadline):
            if progress is not None:
                progress(f"search: {len(grid) - n} of Megatron's {len(grid)} grid points left "
                         "unscored (time budget)")
            break
        if progress is not None:
            progress(f"search: scoring Megatron's grid, {n + 1} of {len(grid)}")
        sim.reset(strategy)
        searcher.record(name)
        key = (not sim.fits_in_memory(), sim.step_time())
        families = ["grid"] + [f for f, tag in GRID_FAMILIES.items() if tag in name]
        for family in families:
            if family not in best or key < best[family][0]:
                best[family] = (key, name, strategy)
    return {name: strategy for _, name, strategy in best.values()}


def make_simulation(graph: OpGraph, topology, *, cost_model=None, resharder=None,
                    strategy: Strategy | None = None, opt_state_factor: float = 2.0) -> Simulation:
    """A `Simulation` of a strategy without pipeline stages (default: data parallelism),
    priced as `soapjax.simulate.default_pricing` says where no cost model or resharder is
    given (`soapjax.simulate.open_simulation` takes any strategy)."""
    cost_model, resharder = default_pricing(graph, topology, cost_model=cost_model,
                                            resharder=resharder)
    strategy = strategy if strategy is not None else data_parallel(graph, MeshShape.of(topology))
    return Simulation(graph, topology, cost_model, resharder, strategy,
                      opt_state_factor=opt_state_factor)


# --- the one planning entry point -------------------------------------------------------------


def find_plan(graph: OpGraph, topology, *, settings: SearchSettings | None = None,
              costs: str | CostModel = "auto", reshard: str | Resharder = DEFAULT_MODE,
              optimizer: Any = None, family: str | None = None, model_config: str = "",
              workload: str = "", progress: Progress | None = None) -> Plan:
    """Plans `graph` on `topology`: searches, simulates the best strategy, returns the `Plan`.

    Every caller plans through this function (the CLI, `shard_training`, the notebook, the
    scripts), so its defaults are soapjax's defaults.

    **Resharding default: the ideal model.** Pricing each resharding by what XLA compiles
    (``reshard="xla"``) is more faithful (DESIGN.md; docs/checks.md shows where XLA differs),
    but the search then compiles every transition a proposal brings in. Measured on a 2-core
    CPU, analytic costs, jax 0.10.2: GPT-2 small on ``dgx-h100x8`` with a 20 s budget scores
    49,916 proposals with the ideal model (2,818/s) against 166 with XLA on an empty cache
    (10/s) and 457 with a warm one (23/s: a chain keeps meeting new transitions); GPT-2 tiny
    on ``cpu8``, 300 proposals per chain: 0.42 s against 39 s cold, 0.50 s warm. A search that
    scores a few proposals per second is a search in name only, so the default is ``"ideal"``
    everywhere (`soapjax.reshard.DEFAULT_MODE`); ask for ``"xla"`` to price XLA's choices.

    Args:
      graph: the operator graph (`soapjax.trace`).
      topology: the cluster (`soapjax.load_topology`).
      settings: budget, seed and space limits (default `SearchSettings()`: 20 s).
      costs: ``"auto"`` (measured on the local backend when it has the topology's devices,
        else the analytic roofline), ``"measured"``, ``"analytic"``, or a `CostModel`.
      reshard: ``"ideal"`` (default) or ``"xla"``, or a `Resharder` (kept open).
      optimizer: the optax optimizer of the training step: its update cost and the size of
        its state (default: Adam's, two moments per parameter).
      family: ``"cnn"``, ``"rnn"``, ... to choose the paper's expert baseline (None: both).
      model_config: the zoo config name, recorded in the plan.
      workload: the ``--model`` text that rebuilds the model (user code,
        ``path/file.py:make_workload``), recorded in the plan so `soapjax check` can load it.
      progress: called with a one-line status about twice a second (`print_progress`).

    Returns:
      The plan: the strategy, what the simulator predicts for it, the baselines' step times,
      and how it was searched (``plan.search``: settings, proposals, search time, the start
      that found it, which baselines fit in memory, the resharding model, and the best step
      time after each improvement as ``history``, (seconds, step time) pairs).

    Raises:
      PlanError: no strategy fits in device memory.
      CostError: ``costs="measured"`` where the topology's devices are not attached.
    """
    check_graph(graph, "find_plan")
    check_topology(topology, "find_plan")
    check_settings(settings, SearchSettings, "find_plan")
    check_costs(costs, "find_plan")
    if optimizer is not None:
        check_optimizer(optimizer, "find_plan")
    settings = settings if settings is not None else SearchSettings()
    cm = make_cost_model(graph, topology, mode=costs, optimizer=optimizer) \
        if isinstance(costs, str) else costs
    factor = 2.0 if optimizer is None else opt_state_factor(optimizer, _abstract_params(graph))
    resharder = Resharder(MeshShape.of(topology), mode=reshard) if isinstance(reshard, str) \
        else reshard
    try:
        result = search(graph, topology, cost_model=cm, resharder=resharder, settings=settings,
                        family=family, opt_state_factor=factor, progress=progress)
        sim = simulate(graph, topology, result.strategy, cost_model=cm, resharder=resharder,
                       opt_state_factor=factor)
    finally:
        if isinstance(reshard, str):
            resharder.close()
    info = settings.to_json() | {
        "proposals": result.proposals, "accepted": result.accepted,
        "search_time_s": result.search_time_s, "best_from": result.start,
        "reshard": resharder.mode, "opt_state_factor": factor,
        "baselines_fit": {name: fits for name, _, fits in result.baselines},
        "history": [list(h) for h in result.history],
        "cost_stats": cm.stats._asdict()}
    return Plan.make(graph, topology, result.strategy, model_config=model_config,
                     workload=workload, predicted=sim.to_json(), cost_source=cm.source,
                     search=info, baselines=result.baseline_times(), simulated=sim)


def _abstract_params(graph: OpGraph) -> list[jax.ShapeDtypeStruct]:
    """The parameter leaves as a flat list (optimizer states are per leaf: same sizes)."""
    return [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in graph.params]


# --- optimality checks (paper section 8.4) ----------------------------------------------------


def exhaustive(sim: Simulation, limits: SpaceLimits = SpaceLimits(), *,
               max_leaves: int = 2_000_000) -> tuple[Strategy, float]:
    """The global optimum by branch and bound over every strategy.

    Operators are assigned in order, each trying its configs from the least compute up. The
    bound is valid because all compute tasks share one stream: a strategy's step time is at
    least the forward and backward compute of every operator, so a partial assignment whose
    compute plus the least compute of the unassigned operators reaches the best step time found
    cannot lead to a better one. Leaves are scored by delta simulation from the previous leaf.

    Raises:
      ValueError: the space has more than `max_leaves` strategies.
    """
    mesh = MeshShape.of(sim.topology)
    spaces = [configs(op, mesh, limits) for op in sim.graph.operators]
    size = math.prod(len(s) for s in spaces)
    if size > max_leaves:
        raise ValueError(f"the space has {size:,} strategies, over max_leaves={max_leaves:,}; "
                         "exhaustive search is for small models and meshes")
    cm = sim.cost_model
    compute = [[(lambda t: t.forward_s + t.backward_s)(cm.op_time(i, c)) for c in s]
               for i, s in enumerate(spaces)]
    order = [sorted(range(len(s)), key=lambda k, i=i: compute[i][k]) for i, s in enumerate(spaces)]
    floor = [min(c) for c in compute]
    rest = [sum(floor[i:]) for i in range(len(spaces) + 1)]
    best: list = [math.inf, None]

    def visit(i: int, spent: float) -> None:
        if spent + rest[i] >= best[0]:
            return
        if i == len(spaces):
            if sim.fits_in_memory() and sim.step_time() < best[0]:
                best[0], best[1] = sim.step_time(), sim.strategy
            return
        before = sim.strategy[i]
        for k in order[i]:
            if spent + compute[i][k] + rest[i + 1] >= best[0]:
                break  # configs are sorted by compute: the rest bound no better
            sim.propose(i, spaces[i][k])
            sim.accept()
            visit(i + 1, spent + compute[i][k])
        sim.propose(i, before)
        sim.accept()

    visit(0, 0.0)
    if best[1] is None:
        raise ValueError("no strategy fits in memory")
    return best[1], best[0]


def improving_change(sim: Simulation, limits: SpaceLimits = SpaceLimits(), *,
                     rtol: float = 1e-9) -> tuple[int, Config, float] | None:
    """A single-operator change that makes the current strategy faster (and fits), or None.

    None means the strategy is a local optimum of the SOAP space (paper section 8.4). With
    microbatches (a pipelined simulation's), a config whose per-device batch they do not
    divide is not in the space (`soapjax.memory.microbatch_error`), as the search's moves keep.
    """
    mesh = MeshShape.of(sim.topology)
    base = sim.step_time()
    m = getattr(sim, "microbatches", 1)
    for i, op in enumerate(sim.graph.operators):
        current = sim.strategy[i]
        for c in configs(op, mesh, limits):
            if c == current or (m > 1 and microbatch_error(op, c, mesh, m)):
                continue
            t = sim.propose(i, c)
            fits = sim.fits_in_memory()
            sim.reject()
            if fits and t < base * (1 - rtol):
                return i, c, t
    return None


def print_progress(line: str) -> None:
    """A progress callback that rewrites one line on stderr."""
    sys.stderr.write("\r" + line[:120].ljust(120))
    sys.stderr.flush()
