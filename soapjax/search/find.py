"""The execution optimizer: Metropolis-Hastings over strategies, scored by the simulator.

As the FlexFlow paper (section 6): a proposal gives one operator, chosen uniformly at random,
a config chosen uniformly at random from its SOAP space; delta simulation scores it; it is
accepted with probability ``min(1, exp(beta * (cost(S) - cost(S*))))`` against the *current*
strategy S. Every baseline (data parallel, Megatron, FSDP, the paper's experts) and some random
strategies are initial candidates, and so are Megatron's grid's best point and, for a model
with experts or a long sequence, the best grid point with expert or context parallelism (a
chain from TP 8 seldom walks into them: `GRID_FAMILIES`); each gets an equal share of what
the budget leaves after the starts are scored, and stops early when its best has not
improved for half of its share. The chains run side by side, one process per core
(`soapjax.search._parallel`: each with its own random stream, so any number of processes
returns the same plan for a proposal count; every process has the whole time, so P of them
give the chains P times the time). The budget bounds the whole search
(`SearchSettings.budget_s`): measuring new shard programs stops at 60% of it, or earlier
where the next one would likely run past that (`soapjax.cost.operators.CostModel.measure_until`:
later ones are estimated from the roofline and the operator's measured ones), so the chains
keep a real share; scoring Megatron's grid stops at 30%, the chains 5% before its end (15%
where `find_plan` then checks the finalists' reshardings against XLA: `check_reshardings`).
The best strategy that fits in device memory over all chains is returned, so it is never
worse than the best baseline (as the search prices them).

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
is a chain's start, so a plan is never slower than the grid (where no shape of the grid fits
even at its least memory, the rest of it is not scored: `grids._grid_starts`); a start that
does not fit is made to fit (`_fitting`), its least-memory variant tried first. The
recomputation of the best plan seen and of the fastest others that recompute is then chosen
per operator within the memory (`_relaxed_starts`, `soapjax.search.recompute.relaxed`: the
attention core kept where the rest is recomputed, say), and the fastest of those is a start of
its own; a pipeline's chain starts from its start relaxed so (`soapjax.search.pipelines`).

**Pipeline stages.** With ``SearchSettings(pipelines=True)`` (`soapjax plan --pipelines`), or
by default when no plan without stages fits in memory, for each stage count S that divides
the layers and the outermost mesh axis (`stage_choices`) and each virtual-stage count v whose
S x v chunks cut the layers equally (`interleave_choices`), Megatron's grid at that pipeline
(`pipeline_grid`: TP 1, 2, 4 or 8, the expert- and context-parallel degrees of `grid_degrees`,
microbatch sizes 1, 2, 4, 8 ... and the per-replica batch, recompute none / selective / full,
with and without the distributed optimizer) is scored (`soapjax.simulate.front.open_simulation`: a
`soapjax.simulate.pipesim.PipelinedSimulation`) along its coordinates first (`_score_points`), in
two passes (`_Pipelines.grids`), right after the starts, in `PIPELINE_GRIDS_SHARE` of
the time they leave; the `CHAINED_PIPELINES` pipelines whose grids did best then each get a
chain (configs, recompute, microbatches, over one stage's devices) from their best point
under the fastest schedule that fits (`choose_schedule`: a zero-bubble schedule's deferred
weight gradients where they shorten the bubble; `_Pipelines` says why only those
pipelines), after the flat chains, the family whose best is behind getting the smaller share
of the chains' time (`_flat_chains_share`); the fastest pipelined plans, priced on folded
stages, are priced again whole (`soapjax.search.pipelines._settle_folded`), and the best
plan over all grids and chains, pipelined or not, is returned. S and v are chosen among
pipelines, not by moves within a chain. A chain's best at one virtual stage then has its
stage boundaries walked over (`balance_stages`: a stage of fewer layers where the head
weighs, each step sending the layers a stage runs but another keeps, priced), a walk on the
schedule alone, the stage's simulation unchanged. The grid holds only what apply runs (the
interleaved schedule's M a multiple of S: `soapjax.strategy.pipeline.pipeline_error`), and
the chains' microbatch moves keep to the same rule. Every pipeline is priced as apply runs it
(`soapjax.simulate.pipesim`, module doc).

**One entry point.** `find_plan` is how soapjax plans: graph + topology + settings -> `Plan`.
The command line (`soapjax plan`), the training helper (`shard_training(strategy="plan")`),
`soapjax check`, the notebook and the scripts all call it, so the defaults live in one place:
`SearchSettings()`, ``costs="auto"`` (measured where the topology's devices are attached, else
the analytic roofline), and the ideal resharding model (`DEFAULT_MODE`; `find_plan` says why).

One chain, its moves and its acceptance rule, is `soapjax.search._chain` (with `SearchSettings`,
re-exported here); this module runs the chains within the budget and plans.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from soapjax.base._dtypes import itemsize
from soapjax.base._progress import print_progress
from soapjax.base.errors import PlanError
from soapjax.cost.operators import CostModel, cost_model as make_cost_model
from soapjax.cost.reshard import DEFAULT_MODE, Resharder
from soapjax.cost.updates import freeze
from soapjax.graph.opgraph import OpGraph
from soapjax.search._chain import (
    MAX_BUDGET_S,
    MAX_PROPOSALS,
    ChainOutcome,
    Progress,
    SearchSettings,
    _Searcher,
    random_strategy,
)
from soapjax.search._clock import past, sparse_gc
from soapjax.search._parallel import ChainTask, empty_outcome, lanes, run_chains
from soapjax.search.grids import _grid_starts, _within
from soapjax.search.pipelines import _Pipelines, _settle_folded, no_fit_hint, stages_refused
from soapjax.search.recompute import RELAX_SHARE, recomputes_any, relaxed, tidied
from soapjax.simulate import SimResult
from soapjax.simulate.front import (
    Simulation,
    default_pricing,
    opt_state_factor,
    simulate,
)
from soapjax.strategy._arguments import (
    check_costs,
    check_graph,
    check_optimizer,
    check_settings,
    check_topology,
)
from soapjax.strategy.baselines import (
    baselines as make_baselines,
    with_recompute,
)
from soapjax.strategy.memory import microbatch_refusal
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import (
    RECOMPUTE_POLICIES,
    MeshShape,
    Strategy,
    data_parallel,
    tie_blocks,
)
from soapjax.topology.cluster import stage_topology

__all__ = ["FINAL_SHARE", "GRID_SHARE", "MAX_BUDGET_S", "MAX_PROPOSALS", "MEASURE_SHARE",
           "RESHARD_CHECK_DEVICES", "RESHARD_CHECK_SHARE", "RESHARD_FINALISTS", "Progress",
           "SearchResult", "SearchSettings", "check_reshardings", "checked_finalist", "find_plan",
           "make_simulation", "print_progress", "random_strategy", "search"]


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
      finalists: the fastest distinct plans among the starts' bests, fastest first, as
        (step time, strategy, start name); the first is `strategy` (`RESHARD_FINALISTS`).
    """

    strategy: Strategy
    step_time_s: float
    start: str
    baselines: tuple[tuple[str, float, bool], ...]
    proposals: int
    accepted: int
    search_time_s: float
    history: tuple[tuple[float, float], ...]
    finalists: tuple[tuple[float, Strategy, str], ...] = ()

    def baseline_times(self) -> dict[str, float]:
        return {name: t for name, t, _ in self.baselines}


# With pipelines, their grids take PIPELINE_GRIDS_SHARE of the time the starts leave (the
# chains the rest); of the chains' time, the family (flat or pipelined) whose best is behind
# the other's by more than CHAINS_BEHIND takes MINOR_CHAINS_SHARE (`_flat_chains_share`;
# docs/vs-experts.md measures it).
PIPELINE_GRIDS_SHARE = 0.5
CHAINS_BEHIND = 1.02
MINOR_CHAINS_SHARE = 0.25

# Shares of a time budget (`SearchSettings.budget_s`, counted from the search's start):
# measuring new shard programs stops at MEASURE_SHARE of it (later ones are estimated), scoring
# Megatron's grid at GRID_SHARE (the points left are skipped), and the chains end FINAL_SHARE
# before its end, left for simulating the plan found and writing it.
MEASURE_SHARE = 0.6
GRID_SHARE = 0.3
FINAL_SHARE = 0.05

# The plans `find_plan` prices again with the reshardings XLA compiles (`check_reshardings`):
# the fastest distinct ones among the starts' bests, on meshes (one stage's, for a pipelined
# plan) of at most RESHARD_CHECK_DEVICES devices (a subprocess of that many virtual CPU
# devices compiles them; docs/checks.md, "Reshardings checked against XLA", times it).
RESHARD_FINALISTS = 4
RESHARD_CHECK_DEVICES = 256
# With a time budget the chains end RESHARD_CHECK_SHARE earlier, left for that check, which
# checks the finalists after the first only while the budget lasts.
RESHARD_CHECK_SHARE = 0.1
# The best plan seen after the starts and the fastest others that recompute (RELAXED_STARTS in
# all), their recompute chosen per operator (`_relaxed_starts`) in at most RELAX_SHARE of a
# time budget.
RELAXED_STARTS = 3


class _Budget:
    """Points in time of a search's budget; all None when it counts proposals instead."""

    def __init__(self, t0: float, settings: SearchSettings):
        self.t0 = t0
        self.budget_s = None if settings.max_proposals is not None else settings.budget_s

    def at(self, fraction: float) -> float | None:
        return None if self.budget_s is None else self.t0 + fraction * self.budget_s



def search(graph: OpGraph, topology, *, cost_model=None, resharder=None,
           settings: SearchSettings = SearchSettings(), family: str | None = None,
           opt_state_factor: float = 2.0, progress: Progress | None = None,
           reserve: float = 0.0) -> SearchResult:
    """Searches for the fastest strategy of `graph` on `topology` that fits in memory.

    Args:
      graph: the operator graph (`soapjax.trace`).
      topology: the cluster (`soapjax.load_topology`).
      cost_model: operator times (default: `soapjax.cost.operators.cost_model(graph, topology)`).
      resharder: resharding collectives (default: `soapjax.cost.reshard.Resharder` in its default
        mode, `soapjax.cost.reshard.DEFAULT_MODE`).
      settings: budget, seed, space limits.
      family: "cnn", "rnn", ... to choose the paper's expert strategy (None: both).
      opt_state_factor: optimizer state bytes per parameter byte (2 for Adam).
      progress: called with a one-line status about twice a second.
      reserve: a share of the budget the chains leave at its end for the caller (`find_plan`
        checks the finalists' reshardings in `RESHARD_CHECK_SHARE` of it).

    Returns:
      The best strategy found, with the baselines' times.

    Raises:
      PlanError: no strategy at all fits in memory (not even the baselines or what the
        search visited); at once where the parameters, their gradients and the optimizer
        state alone cannot fit (`states_floor`).
    """
    floor = states_floor(graph, topology, opt_state_factor)
    if floor:  # no plan can fit: said now, not after the budget
        raise PlanError(f"no strategy for {graph.name!r} on {topology.name!r} can fit in "
                        f"{topology.device.memory_bytes / 2**30:.1f} GiB per device: {floor}; "
                        "plan for a topology with more devices or more memory per device")
    # The budget starts now: building the first simulation prices (and may measure) every
    # operator of data parallelism.
    budget = _Budget(time.perf_counter(), settings)
    costs, resharder = default_pricing(graph, topology, cost_model=cost_model,
                                       resharder=resharder)
    measured = getattr(costs, "source", "") == "measured"
    if measured:
        costs.measure_until(budget.at(MEASURE_SHARE), progress)
    try:
        with sparse_gc():  # the search allocates by the million
            sim = make_simulation(graph, topology, cost_model=costs, resharder=resharder,
                                  opt_state_factor=opt_state_factor)
            searcher = _Searcher(sim, settings, progress)
            searcher.t0 = budget.t0
            # a chain may measure (XLA's runtime) or ask the resharder's compiling
            # subprocess: then none runs in a forked process (`soapjax.search._parallel`)
            forkable = not measured and not (isinstance(resharder, Resharder)
                                             and resharder.mode != "ideal")
            return _search(graph, topology, sim, searcher, budget, settings, family,
                           opt_state_factor, progress, cost_model, reserve, forkable)
    finally:
        if measured:
            costs.measure_until(None)


def _search(graph: OpGraph, topology, sim: Simulation, searcher: _Searcher, budget: _Budget,
            settings: SearchSettings, family: str | None, opt_state_factor: float,
            progress: Progress | None, cost_model, reserve: float = 0.0,
            forkable: bool = True) -> SearchResult:
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
    starts = {name: tie_blocks(graph, s)
              for name, s in _within(graph, starts, settings.limits).items()}
    for n, (name, strategy) in enumerate(list(starts.items())):
        if progress is not None:
            how = ("operator costs measured on first use" if sim.cost_model.source == "measured"
                   else "analytic operator costs")
            progress(f"search: scoring start {n + 1}/{len(starts)} ({name}); {how}")
        sim.reset(strategy)
        scored.append((name, sim.step_time(), sim.fits_in_memory()))
        searcher.record(name)
        if not scored[-1][2] and graph.repeated_blocks():
            starts[name] = _fitting(sim, searcher, graph, name, strategy)
    if searcher.best is not None:  # the best starts' recomputation chosen per operator
        deadline = budget.at(1.0 - FINAL_SHARE - reserve)
        if deadline is not None:
            deadline = min(deadline, time.perf_counter() + RELAX_SHARE * settings.budget_s)
        starts.update(_relaxed_starts(sim, searcher, graph, deadline))
    wanted = settings.pipelines if settings.pipelines is not None else searcher.best is None
    pipelined = wanted and graph.repeated_blocks() and graph.batch_size > 1
    if pipelined and stages_refused(graph, progress):
        pipelined = False
    # With a time budget, what the starts left: with pipelines, first their grids
    # (PIPELINE_GRIDS_SHARE of it), then the chains, the flat ones and the pipelined ones in
    # turn, the family whose best is behind the other's by more than CHAINS_BEHIND (or has
    # none that fits) MINOR_CHAINS_SHARE of their time, else half each (`_flat_chains_share`); with
    # a proposal count, each chain runs its proposals.
    end = budget.at(1.0 - FINAL_SHARE - reserve)
    flat_best = searcher.best[0] if searcher.best is not None else None  # the starts' best
    pipes = None
    if pipelined:
        pipes = _Pipelines(graph, topology, cost_model or sim.cost_model, settings,
                           opt_state_factor, progress, searcher)
        now = time.perf_counter()
        for result in pipes.grids(None if end is None else
                                  now + max(end - now, 0.0) * PIPELINE_GRIDS_SHARE):
            if result is not None:
                searcher.offer(result)
    # the chains: one from each start, then one from each of the best pipelines, each with
    # its share of the time (`soapjax.search._parallel`: side by side, one process per core)
    flat_share = 1.0 if pipes is None else _flat_chains_share(flat_best, pipes.best_time())
    tasks = [(_flat_chain(searcher, name, start), flat_share / len(starts))
             for name, start in starts.items()]
    if pipes is not None:
        piped = pipes.chain_tasks()
        tasks += [(task, (1.0 - flat_share) / len(piped)) for task in piped]
    run_chains(tasks, settings.seed, lanes(settings.processes, len(tasks), forkable), end,
               lambda _, outcome: searcher.absorb(outcome), progress)
    if pipes is not None:  # the pipelined plans' folded prices checked on whole stages
        if progress is not None:
            progress("search: pricing the fastest pipelined plans again on whole stages")
        _settle_folded(searcher, graph, topology, cost_model or sim.cost_model, opt_state_factor)
    # no recomputation that buys nothing (`tidied`), in the fastest starts' bests: the
    # finalists the reshardings are checked on (a few delta simulations each)
    fastest = sorted(searcher.bests.items(), key=lambda item: item[1][0])[:RESHARD_FINALISTS]
    for name, (t, strategy, start) in fastest:
        tidy = tidied(sim, graph, strategy)
        if tidy is not None and tidy[0] <= t:
            searcher.bests[name] = (*tidy, start)
    if searcher.bests:
        searcher.best = min(searcher.bests.values(), key=lambda f: f[0])
    searcher._report("done", force=True)
    if searcher.best is None:
        raise PlanError(f"no strategy found for {graph.name!r} on {topology.name!r} fits in "
                        f"{topology.device.memory_bytes / 2**30:.1f} GiB per device; plan for "
                        f"a topology with more devices or more memory per device"
                        f"{no_fit_hint(graph, wanted)}")
    t, strategy, name = searcher.best
    return SearchResult(strategy=strategy, step_time_s=t, start=name,
                        baselines=tuple((n, st, f) for n, st, f in scored
                                        if not n.startswith("random")),
                        proposals=searcher.proposals, accepted=searcher.accepted,
                        search_time_s=time.perf_counter() - searcher.t0,
                        history=tuple(searcher.history),
                        finalists=searcher.finalists(RESHARD_FINALISTS))


def _flat_chain(searcher: _Searcher, name: str, start: Strategy) -> ChainTask:
    """The chain from start `name` (`start`) as `soapjax.search._parallel.run_chains` runs it:
    on `searcher`'s simulation (a forked lane's copy of it), with a searcher of its own
    (`_Searcher.view`)."""
    def run(deadline: float | None, rng, forked: bool) -> ChainOutcome:
        if past(deadline):  # no time (`_flat_chains_share`): not even its reset
            return empty_outcome()
        view = searcher.view(rng)
        if forked:
            view.progress = None
        view.chain(name, start, math.inf if deadline is None else deadline)
        return view.outcome()
    return run


def _relaxed_starts(sim: Simulation, searcher: _Searcher, graph: OpGraph,
                    deadline: float | None) -> dict[str, Strategy]:
    """The best fitting plan seen so far and the `RELAXED_STARTS` - 1 fastest others that
    recompute something, their recomputation chosen per operator
    (`soapjax.search.recompute.relaxed`, in that order, until `deadline`); the fastest result,
    where it beats the best plan seen, as a start named after the plan it came from
    (``...-kept``), or none (where memory is ample the relaxed plans are grid points already
    seen, and a start more would only thin the chains' time). A
    plan that recomputes is seldom the best seen where recomputing less fits: Llama 3 8B at
    128K tokens on 64 H100s, whose fastest grid point recomputes nothing and whose fastest
    relaxed one is TP2 CP4 with full recomputation (the attention kept, 2 % faster)."""
    seen = sorted(searcher.bests.values(), key=lambda f: f[0])  # no stages yet
    picks: list[tuple[float, Strategy, str]] = [searcher.best]
    to_beat = searcher.best[0]  # (the walks' ends are recorded: the best may become one)
    for found in seen:
        if len(picks) == RELAXED_STARTS:
            break
        if recomputes_any(graph, found[1]) and all(found[1] != p[1] for p in picks):
            picks.append(found)
    best = None
    for _, strategy, name in picks:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        found = relaxed(sim, graph, strategy, deadline,
                        lambda n=name: searcher.record(f"{n}-kept"))
        if found is not None and found[0] < to_beat and (best is None or found[0] < best[0]):
            best = (found[0], found[1], f"{name}-kept")
    return {} if best is None else {best[2]: best[1]}


def states_floor(graph: OpGraph, topology, opt_state_factor: float) -> str:
    """Where the parameters, their gradients and the optimizer state (`opt_state_factor` x
    the parameters' bytes) alone exceed the devices' memory even spread evenly over all of
    them, a sentence saying so and how many such devices they need at least: no plan can fit
    (every byte of them lives on some device, and the simulator keeps gradients in the
    parameters' dtype); else ''."""
    total = sum(math.prod(p.shape) * itemsize(p.dtype) for p in graph.params)
    total *= 2 + opt_state_factor
    memory, n = topology.device.memory_bytes, topology.num_devices
    if total <= memory * n:
        return ""
    return (f"the parameters, their gradients and the optimizer state alone take "
            f"{total / 2**30:,.0f} GiB, {total / n / 2**30:.1f} GiB per device spread evenly "
            f"over all {n}, so at least {math.ceil(total / memory)} such devices are needed "
            "before any activation")


def _flat_chains_share(flat_best: float | None, pipelined_best: float | None) -> float:
    """The flat chains' share of the chains' time (the pipelined ones take the rest), from
    each family's best fitting step time so far (None: none fits): none where no flat plan
    fits (nor any start made to fit, `_fitting`: the chains would walk plans over memory,
    docs/vs-experts.md) and a pipelined one does, `MINOR_CHAINS_SHARE` where the flat
    best is behind the pipelined by more than `CHAINS_BEHIND`, one minus it the other way
    round or where no pipelined plan fits, else half.

    >>> [_flat_chains_share(*x) for x in ((29.8, 14.1), (4.3, 4.9), (4.3, 4.31), (None, 1))]
    [0.25, 0.75, 0.5, 0.0]
    """
    if flat_best is None and pipelined_best is not None:
        return 0.0
    if pipelined_best is not None and flat_best > CHAINS_BEHIND * pipelined_best:
        return MINOR_CHAINS_SHARE
    if flat_best is not None and (pipelined_best is None
                                  or pipelined_best > CHAINS_BEHIND * flat_best):
        return 1.0 - MINOR_CHAINS_SHARE
    return 0.5


# How many times more microbatches a start that does not fit tries (`_fitting`): 2, 4 and 8
FITTING_MICROBATCHES = (1, 2, 4, 8)


def _fitting(sim: Simulation, searcher: _Searcher, graph: OpGraph, name: str,
             strategy: Strategy) -> Strategy:
    """A start that does not fit, made to fit as a person would try next: more microbatches
    (2, 4 and 8 times its own, where the batch divides: `FITTING_MICROBATCHES`), its layers
    recomputed (`baselines.with_recompute`: selective, full), and both; each variant scored
    and recorded, the one holding least first (where it does not fit, no other is tried);
    the fastest that fits, or the start itself. MaxText's MoE rules fit the
    fine-grained MoE on 64 H100s only with full recomputation (without it, its chain spent its
    share walking there); FSDP fits Llama 3 8B at 8K tokens on 64 H100s with 2 microbatches
    and no recomputation, the best hand configuration of scripts/bench_vs_experts.py there."""
    mesh = MeshShape.of(sim.topology)
    tries = [(m, policy) for factor in FITTING_MICROBATCHES
             for m in [strategy.microbatches * factor]
             if factor == 1 or not microbatch_refusal(graph, strategy.configs, mesh, m)
             for policy in RECOMPUTE_POLICIES[0 if factor > 1 else 1:]]
    # the one that holds least first (the most microbatches, full recomputation): where it
    # does not fit, none does, and the other variants are not scored (GPT 175B on 96 A100s,
    # where nothing without pipeline stages fits: docs/vs-experts.md)
    floor = max(tries, key=lambda t: (t[0], RECOMPUTE_POLICIES.index(t[1])))
    best = None
    for m, policy in [floor] + [t for t in tries if t != floor]:
        variant = tie_blocks(graph, with_recompute(
            graph, dataclasses.replace(strategy, microbatches=m), policy))
        sim.reset(variant)
        searcher.record(f"{name}-m{m}-{policy}")
        if sim.fits_in_memory() and (best is None or sim.step_time() < best[0]):
            best = (sim.step_time(), variant)
        elif (m, policy) == floor:
            return strategy
    return strategy if best is None else best[1]


def make_simulation(graph: OpGraph, topology, *, cost_model=None, resharder=None,
                    strategy: Strategy | None = None, opt_state_factor: float = 2.0) -> Simulation:
    """A `Simulation` of a strategy without pipeline stages (default: data parallelism),
    priced as `soapjax.simulate.front.default_pricing` says where no cost model or resharder is
    given (`soapjax.simulate.front.open_simulation` takes any strategy)."""
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

    **Resharding default: the ideal model, its finalists checked against XLA.** Pricing each
    resharding by what XLA compiles (``reshard="xla"``) is more faithful (docs/design.md;
    docs/checks.md shows where XLA differs), but the search then compiles every transition a
    proposal brings in: two orders of magnitude fewer proposals a second (docs/checks.md, "The
    resharding default"). A search that scores a few proposals per second is a search in name
    only, so the search prices with ``"ideal"`` (`soapjax.cost.reshard.DEFAULT_MODE`). Then
    (``SearchSettings.check_reshardings``, default on) its `RESHARD_FINALISTS` best distinct
    plans are priced again with the reshardings XLA compiles for them (`check_reshardings`, in
    the last `RESHARD_CHECK_SHARE` of the budget, one batch of compiles per mesh, cached on
    disk), and the fastest so priced is the plan, its prediction XLA's: a plan whose layout
    changes XLA makes by gathering a tensor whole is never priced as if it did not
    (docs/checks.md, "Reshardings checked against XLA"). Ask for ``"xla"`` to search with
    XLA's prices throughout.

    Args:
      graph: the operator graph (`soapjax.trace`).
      topology: the cluster (`soapjax.load_topology`).
      settings: budget, seed and space limits (default `SearchSettings()`: 20 s).
      costs: ``"auto"`` (measured on the local backend when it has the topology's devices,
        else the analytic roofline), ``"measured"``, ``"analytic"``, or a `CostModel`.
      reshard: ``"ideal"`` (default) or ``"xla"``, or a `Resharder` (kept open).
      optimizer: the optax optimizer of the training step: its update cost, its state's size
        and the parameters it freezes (`freeze`; default: Adam's, two moments per parameter).
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
        graph = freeze(graph, optimizer)  # priced as it trains (the fingerprint is the same)
    settings = settings if settings is not None else SearchSettings()
    t0 = time.perf_counter()
    cm = make_cost_model(graph, topology, mode=costs, optimizer=optimizer) \
        if isinstance(costs, str) else costs
    factor = 2.0 if optimizer is None else opt_state_factor(optimizer, graph.abstract_params())
    resharder = Resharder(MeshShape.of(topology), mode=reshard) if isinstance(reshard, str) \
        else reshard
    try:
        check = settings.check_reshardings and resharder.mode == "ideal"
        result = search(graph, topology, cost_model=cm, resharder=resharder, settings=settings,
                        family=family, opt_state_factor=factor, progress=progress,
                        reserve=RESHARD_CHECK_SHARE if check else 0.0)
        sim, checked = None, None
        if check:
            deadline = None if settings.max_proposals is not None else t0 + settings.budget_s
            result, sim, checked = check_reshardings(graph, topology, result, cm, factor,
                                                     progress, deadline)
        if sim is None:
            sim = simulate(graph, topology, result.strategy, cost_model=cm,
                           resharder=resharder, opt_state_factor=factor)
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
    if checked is not None:
        info["reshardings_checked"] = checked
    if cm.source == "measured" and result.strategy.stages == 1:
        info["estimated_operators"] = cm.estimated_in(result.strategy)
    return Plan.make(graph, topology, result.strategy, model_config=model_config,
                     workload=workload, predicted=sim.to_json(), cost_source=cm.source,
                     search=info, baselines=result.baseline_times(), simulated=sim)


def check_reshardings(graph: OpGraph, topology, result: SearchResult, cost_model,
                      opt_state_factor: float = 2.0, progress: Progress | None = None,
                      deadline: float | None = None
                      ) -> tuple[SearchResult, SimResult | None, dict]:
    """The search's finalists priced again with the reshardings XLA compiles for them, and the
    fastest that fits so priced.

    The search prices reshardings with the ideal model (`find_plan` says why); XLA's SPMD
    partitioner makes some layout changes by gathering the tensor whole and slicing it
    ("Involuntary full rematerialization", `Resharder.replicates_whole`), a
    collective the ideal model prices at a fraction of its bytes. Each of
    `result.finalists` on a mesh of at most `RESHARD_CHECK_DEVICES` devices is simulated
    again with a ``mode="xla"`` `Resharder` (its transitions compiled in one batch, cached on
    disk), and the fastest that fits wins. Past `deadline` (a `time.perf_counter` time)
    the finalists after the first are left unchecked; unchecked finalists do not compete, and
    where the first (the search's plan) is on too large a mesh none is checked.

    Returns:
      The result with the winner (its step time as XLA's reshardings price it), the winner's
      simulation (None where no finalist could be checked: the search's plan stands), and
      what was checked: per finalist its start, ideal and XLA-priced step times, whether it
      fits, its transitions, how many of them XLA makes by replicating whole and how many
      could not be compiled (priced by the ideal model instead: `Resharder.fallbacks`; None
      for a finalist left unchecked: on too large a mesh, or past the deadline), and the
      seconds it all took.
    """
    t0 = time.perf_counter()
    rows, best = [], None
    resharders: dict[MeshShape, Resharder] = {}  # one compiling subprocess per mesh
    try:
        for k, (t_ideal, strategy, name) in enumerate(result.finalists):
            mesh = MeshShape.of(stage_topology(topology, strategy.stages))  # the configs'
            row = {"start": name, "ideal_s": t_ideal, "xla_s": None, "fits": None,
                   "transitions": None, "replicated_whole": None, "fallbacks": None}
            rows.append(row)
            if mesh.size > RESHARD_CHECK_DEVICES and not k:
                break  # the search's own plan cannot be checked: it stands as priced
            if mesh.size > RESHARD_CHECK_DEVICES or (
                    k and deadline is not None and time.perf_counter() >= deadline):
                continue
            if progress is not None:
                progress(f"search: reshardings of plan {k + 1}/{len(result.finalists)} "
                         f"({name}) compiled by XLA on {mesh.size} CPU devices")
            if mesh not in resharders:
                resharders[mesh] = Resharder(mesh, mode="xla")
            asked = _Asked(resharders[mesh])
            sim = simulate(graph, topology, strategy, cost_model=cost_model, resharder=asked,
                           opt_state_factor=opt_state_factor)
            xla = asked.inner
            row.update(xla_s=sim.step_time_s, fits=sim.fits_in_memory,
                       transitions=len(asked.seen),
                       replicated_whole=sum(xla.replicates_whole(*t[:4], partial=t[4])
                                            for t in asked.seen),
                       fallbacks=sum(xla.lookup(*t[:4], partial=t[4]).source == "fallback"
                                     for t in asked.seen))
            if sim.fits_in_memory and (best is None or sim.step_time_s < best[0]):
                best = (sim.step_time_s, strategy, name, sim)
    finally:
        for resharder in resharders.values():
            resharder.close()
    checked = {"finalists": rows, "seconds": time.perf_counter() - t0}
    if best is None:
        return result, None, checked
    t, strategy, name, sim = best
    return dataclasses.replace(result, strategy=strategy, step_time_s=t, start=name), sim, \
        checked


def checked_finalist(info: Any) -> dict | None:
    """The row `check_reshardings` wrote for the plan itself (in a plan's search info, or its
    frozen pairs): the finalist it was found from, priced with XLA's reshardings; None where
    that one was not checked."""
    for row in dict(dict(info).get("reshardings_checked") or {}).get("finalists", ()):
        row = dict(row)
        if row["start"] == dict(info).get("best_from") and row.get("xla_s") is not None:
            return row
    return None


class _Asked:
    """A resharder that answers with `inner` and keeps what it was asked (`check_reshardings`:
    one simulation's transitions, where `inner` serves several)."""

    def __init__(self, inner: Resharder):
        self.inner, self.mesh, self.mode = inner, inner.mesh, inner.mode
        self.seen: dict[tuple, None] = {}

    def reshard(self, shape, dtype, src, dst, *, partial=()):
        self.seen[(tuple(shape), dtype, tuple(src), tuple(dst), tuple(partial))] = None
        return self.inner.reshard(shape, dtype, src, dst, partial=partial)

    def prefetch(self, transitions) -> int:
        return self.inner.prefetch(transitions)
