"""The pipelined part of the search: which pipelines (stages S, virtual stages v, schedule) it
tries, Megatron's grid at each (`pipeline_grid`), and the chains of the best
(`_Pipelines`, which says why grids for all and chains for a few).
"""

from __future__ import annotations

import contextlib
import math
import time

from soapjax.base.errors import PlanError
from soapjax.cost.reshard import DEFAULT_MODE
from soapjax.graph.opgraph import OpGraph
from soapjax.search._chain import (
    ChainOutcome,
    Progress,
    SearchSettings,
    _Searcher,
)
from soapjax.search._clock import past, share
from soapjax.search._parallel import ChainTask, empty_outcome, lanes, run_chains
from soapjax.search.grids import _likely_first, _score_points, _within, grid_degrees
from soapjax.search.recompute import RELAX_SHARE, relaxed
from soapjax.search.stages import _num_layers, balance_stages, choose_schedule
from soapjax.simulate.front import (
    folds,
    open_simulation,
)
from soapjax.simulate.pipesim import layer_chunks
from soapjax.strategy.baselines import (
    GridPoint,
    megatron_grid_points,
)
from soapjax.strategy.memory import random_operator
from soapjax.strategy.pipeline import pipeline_error
from soapjax.strategy.space import (
    SpaceLimits,
    Strategy,
)

__all__ = ["CHAINED_PIPELINES", "PIPELINE_GRID", "PIPELINE_GRID_EXPERTS", "interleave_choices",
           "no_fit_hint", "pipeline_grid", "pipeline_refusal", "stage_choices",
           "stages_refused"]



# Megatron's grid at each pipeline depth, as the search scores it: every TP a Megatron-LM user
# can set (its large runs keep TP at the node's 8, or 4, but a small model on few GPUs is
# faster at TP 1 or 2 with stages: tiny GPT on 2 nodes of 4 CPUs, TP 1 PP 2 is 1.25 times
# faster than the best TP 4 point; the grid's descent, `_score_points`, walks TP as one
# coordinate, so the extra points cost a few scores); virtual stages are `interleave_choices`.
PIPELINE_GRID = {"tp": (1, 2, 4, 8)}
# ... and for a model with experts, where expert parallelism takes TP's place inside the node
# (Megatron-LM's Mixtral 8x7B: TP 2, EP 8, PP 4): every TP too.
PIPELINE_GRID_EXPERTS = {"tp": (1, 2, 4, 8)}
# How many pipelines (S, v, schedule), the fastest by their grid's best point, get a chain.
CHAINED_PIPELINES = 3


def stage_choices(graph: OpGraph, topology) -> tuple[int, ...]:
    """Pipeline stage counts S > 1 worth trying: dividing the outermost mesh axis (whole
    groups of nodes per stage) and the number of repeated layers; none for a graph apply
    cannot pipeline (`pipeline_refusal`)."""
    if pipeline_refusal(graph):
        return ()
    layers = _num_layers(graph)
    outer = topology.axis_sizes[0] if len(topology.axis_sizes) > 1 else 1
    return tuple(S for S in range(2, outer + 1) if outer % S == 0 and layers % S == 0)


def pipeline_refusal(graph: OpGraph) -> str:
    """Why apply cannot run `graph` as a pipeline (`soapjax.apply._pipeline_layout
    .check_pipelinable`'s refusals that hold at any stage count), or "": it returns values
    beside its loss (`OpGraph.has_aux`: a pipeline does not hand them back), its layers are
    not one scan over stacked parameters in order (identical unrolled layers the simulator
    can cut, apply cannot), or an operator draws random bits. The search offers such a graph
    no stages: a plan it returned with them, `soapjax check` and the training helper refused."""
    if graph.has_aux:
        return "it returns values beside its loss (has_aux)"
    scans = graph.program.layer_scans
    if len(scans) != 1 or scans[0].steps != tuple(range(len(scans[0].steps))):
        return ("its layers are not one scan over stacked parameters (nn.scan, nnx.scan)"
                if not scans else "its layers are not one scan in order")
    if (random := random_operator(graph)) is not None:
        return f"operator {random!r} draws random bits (dropout)"
    return ""


def stages_refused(graph: OpGraph, progress: Progress | None) -> bool:
    """Whether `graph` gets no stages (`pipeline_refusal`), said to `progress` where so."""
    why = pipeline_refusal(graph)
    if why and progress is not None:
        progress(f"search: no pipeline stages for {graph.name!r}: {why}, which apply cannot "
                 "pipeline; plans without stages only")
    return bool(why)


def no_fit_hint(graph: OpGraph, wanted: bool) -> str:
    """What the search's "no strategy fits" error adds about pipelines: why `graph` got none
    (`pipeline_refusal`), or that they were not `wanted`; "" where they were tried."""
    why = pipeline_refusal(graph) if graph.repeated_blocks() else ""
    if graph.has_aux:
        return ("; its loss returns values beside it (has_aux), so plans keep one microbatch "
                "and no pipeline stages: the loss alone would let the search use both")
    if why:
        return (f"; its layers get no pipeline stages ({why}): scanned layers (nn.scan, "
                "nnx.scan) without dropout would let the search use them")
    if wanted or not graph.repeated_blocks():
        return ""
    return (" or allow pipeline stages (SearchSettings(pipelines=None or True), "
            "`soapjax plan --pipelines`)")


def interleave_choices(graph: OpGraph, stages: int) -> tuple[int, ...]:
    """Virtual stages per device v worth trying at `stages` S: every v whose S x v chunks cut
    the layers equally (`soapjax.simulate.pipesim.layer_chunks`, and apply's stacked stage weights):
    GPT 530B's 105 layers on 35 stages take v in (1, 3) (Megatron-LM ran v = 3), on 5 stages
    v in (1, 3, 7, 21)."""
    layers = _num_layers(graph)
    if stages < 2 or layers % stages:
        return (1,)
    return tuple(v for v in range(1, layers // stages + 1) if layers % (stages * v) == 0)


def pipeline_grid(graph: OpGraph, topology, stages: int, limits: SpaceLimits = SpaceLimits()
                  ) -> dict[tuple[int, str], dict[GridPoint, Strategy]]:
    """Megatron's grid at `stages` pipeline stages, as the search scores it, by (virtual
    stages, schedule): TP in `PIPELINE_GRID` (`PIPELINE_GRID_EXPERTS` with experts), every
    `interleave_choices` v, the expert- and context-parallel degrees of `grid_degrees`, the
    microbatch sizes and recomputations of `baselines.megatron_grid`; points outside `limits`,
    or whose layers do not cut into S x v chunks, left out; each pipeline's points in the order
    `_likely_first` gives. Every point is one apply runs (`megatron_3d` builds only
    strategies `soapjax.strategy.pipeline.pipeline_error` accepts)."""
    degrees = grid_degrees(graph, topology)
    tp = (PIPELINE_GRID_EXPERTS if len(degrees["ep"]) > 1 else PIPELINE_GRID)["tp"]
    grid = megatron_grid_points(graph, topology, pp=(stages,),
                         interleave=interleave_choices(graph, stages), tp=tp, **degrees)
    by_pipe: dict[tuple[int, str], dict[GridPoint, Strategy]] = {}
    for point, st in _within(graph, grid, limits).items():
        by_pipe.setdefault((st.virtual_stages, st.schedule), {})[point] = st
    for v, schedule in list(by_pipe):
        try:
            layer_chunks(graph, stages * v)
        except PlanError:
            del by_pipe[v, schedule]
            continue
        by_pipe[v, schedule] = dict(sorted(by_pipe[v, schedule].items(), key=_likely_first))
    return by_pipe


class _Pipelines:
    """Every pipeline (S from `stage_choices`, v from `interleave_choices`) with Megatron's grid
    at it (`pipeline_grid`): `grids` scores the grids, `chain_tasks` then walks from the best points
    of the `CHAINED_PIPELINES` pipelines whose grids did best. `grids` yields each pipeline's
    best point found, as (time, strategy, start name) or None; a chain's outcome (its best,
    its proposals and acceptances) is added to the search's (`_Searcher.absorb`).

    **Why grids for all, chains for a few.** Interleaving over every v the layers allow makes
    many pipelines (GPT 530B on 280 A100s: S in {5, 7, 35}, 10 (S, v) pairs); an equal share
    of the budget for each would leave every chain too short to matter. A grid point is one
    simulation, and the grid's best already ranks the pipelines (Megatron's own choice, TP8
    PP35 v3, is a grid point), so the chains go where the best grids are. The grids' time
    (`grids`' deadline) is two passes. The first ranks the pipelines by one point each (with
    a deadline; without one, a proposal count's search, by their whole grids), the one
    Megatron-LM users run first (`_likely_first`), made to fit where it does not
    (`_score_points`' ``fit_first``: the distributed optimizer, smaller microbatches, more
    recomputation), more only while no point of any pipeline fits: the same ranking on any
    machine, where an equal share of time each ranked them by however many points a share
    reached (Llama 3 70B at 8K tokens on 64 H100s: 31.600, 31.109 and 31.600 s a step at 30,
    60 and 120 s budgets; ranked by one point made to fit, 31.571, 31.109, 31.109). The
    second goes on with the grids of the `CHAINED_PIPELINES` best pipelines of distinct stage
    counts, each from its first pass's best (`_score_points`: along its coordinates first),
    until the deadline (Mixtral 8x22B on 32 H100s: a first pass that stopped TP8 PP4's 123
    points at microbatches of 2, 63.3 s, then the second reached microbatches of 4, 55.9 s,
    the grid's best). Pipelines with the most stages come first (the least per device: a plan
    that fits comes early), and once one fits, the pipelines left when half the grids' time
    is spent are not opened (opening one builds a simulation of the whole model: seconds for
    GPT 530B, whose 10 pipelines took the search 74 s past a 60 s budget; now 57 s).

    Both passes run side by side as the chains do (`soapjax.search._parallel`): the first
    pass's pipelines dealt to the lanes in turn, each lane judging "a point fits" by its own
    pipelines, and each descent of the second in a lane of its own with the whole time
    until the deadline (GPT 175B on 96 A100s at 30 s: 21 of the 33 pipelines scored in two
    processes where one scored 13; docs/vs-experts.md)."""

    def __init__(self, graph: OpGraph, topology, cost_model, settings: SearchSettings,
                 opt_state_factor: float, progress: Progress | None, flat: _Searcher):
        self._args = (graph, topology, cost_model, settings, opt_state_factor, progress, flat)
        self._progress, self._flat, self._settings = progress, flat, settings
        self._measured = getattr(cost_model, "source", "") == "measured"
        # The most stages first: they hold the least per device, so a plan that fits comes
        # early
        self.pipes = [(S, v, schedule, points)
                      for S in sorted(stage_choices(graph, topology), reverse=True)
                      for (v, schedule), points in pipeline_grid(graph, topology, S,
                                                                 settings.limits).items()]
        # per pipeline scored: (its best's key, the pipeline, its best's name and strategy)
        self.ranked: list[tuple] = []
        self._scored: dict[int, set] = {}  # pipeline -> the names of its grid's points scored

    def best_time(self) -> float | None:
        """The fastest fitting grid point scored so far (None: none fits yet)."""
        fitting = [key[1] for key, *_ in self.ranked if not key[0]]
        return min(fitting) if fitting else None

    def _searcher(self, k: int, first: Strategy):
        S, v, schedule, _ = self.pipes[k]
        return _pipeline_searcher(*self._args, S, v, schedule, first)

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)

    def grids(self, end: float | None):
        """Scores the grids until `end` (a `time.perf_counter` time; None: every point), in
        the two passes of the class doc; yields each pipeline's best."""
        pipes, ranked = self.pipes, self.ranked
        probe_end = share(end, 2)
        # side by side, as the chains (`soapjax.search._parallel`): the pipelines dealt to
        # the lanes in turn, each lane knowing whether a point of its own pipelines fits
        settings = self._settings
        count = lanes(settings.processes, len(pipes), not self._measured)
        if count > 1:
            self._say(f"search: scoring Megatron's grids at {len(pipes)} pipelines in {count} "
                      "processes")
        probed: list = [None] * len(pipes)
        lane_fits = [False]  # one list: each lane's process has its own copy of it
        run_chains([(self._probe(k, probe_end, end is None, lane_fits), 1.0)
                    for k in range(len(pipes))],
                   settings.seed, count, end, lambda k, result: probed.__setitem__(k, result))
        left = sum(result is None for result in probed)
        if left:
            self._say(f"search: {left} of {len(pipes)} pipelines left unscored (time budget)")
        for k, result in enumerate(probed):
            if result is not None:
                key, name, start, seen, best = result
                ranked.append((key, k, name, start))
                self._scored[k] = seen
                yield best
        # the second pass: the best pipeline of each stage count, the best CHAINED_PIPELINES
        # of those (the first ranks a stage count's grids by a few points: LLaMA 70B at 32K on
        # 64 H100s, whose best is at 2 stages, had its 3 best at 8)
        per_stages: dict[int, tuple] = {}
        for r in sorted(ranked):
            per_stages.setdefault(pipes[r[1]][0], r)
        best_pipes = sorted(per_stages.values())[:CHAINED_PIPELINES]
        descents = []
        for key, k, name, start in best_pipes:
            S, v, schedule, points = pipes[k]
            rest = {n: st for n, st in points.items() if n not in self._scored[k]}
            if rest:  # the descent goes on from the first pass's best
                descents.append((k, key, {name: start, **rest}))
        if not descents or past(end):
            return
        self._say(f"search: the rest of Megatron's grids at {len(descents)} pipelines ("
                  + ", ".join(f"{pipes[k][0]} stages, {pipes[k][1]} virtual: {len(rest)}"
                              for k, _, rest in descents) + " configurations)")
        # side by side, as the chains (`soapjax.search._parallel`): each descent its own
        # pipeline's simulation, the whole time until `end` in a lane of its own
        found: list = [None] * len(descents)
        settings = self._settings
        run_chains([(self._descent(k, next(iter(rest.values())), rest), 1.0)
                    for k, _, rest in descents],
                   settings.seed, lanes(settings.processes, len(descents), not self._measured),
                   end, lambda j, result: found.__setitem__(j, result))
        for (k, key, _), result in zip(descents, found):
            if result is None:
                continue
            better, best = result
            if better[0] < key:
                ranked[next(i for i, r in enumerate(ranked) if r[1] == k)] = (
                    better[0], k, better[1], better[2])
            yield best

    def _probe(self, k: int, probe_end: float | None, whole: bool, lane_fits: list[bool]):
        """Pipeline `k`'s first pass (`grids`), as `soapjax.search._parallel.run_chains` runs
        it: one point of its grid (`_likely_first`'s first, made to fit where it does not;
        more only while no point of the lane's pipelines fits; `whole`: a proposal count's
        search, every point); None, unscored, once one fits and `probe_end` is past (opening
        a pipeline's simulation costs seconds at scale). `lane_fits` is what the pipelines
        run before it in its process found: whether one fits. Returns what `_score_points`
        returns and the best plan found."""
        def run(deadline: float | None, rng, forked: bool):
            if lane_fits[0] and past(probe_end):
                return None
            S, v, schedule, points = self.pipes[k]
            if not forked:
                self._say(f"search: scoring Megatron's grid at {S} pipeline stages, {v} "
                          f"virtual ({len(points)} configurations; pipeline {k + 1} of "
                          f"{len(self.pipes)})")
            with self._searcher(k, next(iter(points.values()))) as searcher:
                if forked:
                    searcher.progress = None
                # with a deadline, one point a pipeline: the same ranking on any machine
                key, name, start, seen = _score_points(
                    searcher, points, None if whole else 0.0, until_fit=not lane_fits[0],
                    fit_first=True)
                lane_fits[0] = lane_fits[0] or not key[0]
                return key, name, start, seen, searcher.best
        return run

    def _descent(self, k: int, start: Strategy, rest: dict):
        """Pipeline `k`'s grid points `rest` scored from `start` (`_score_points`, until the
        deadline it is run with), as `soapjax.search._parallel.run_chains` runs it: returns
        what `_score_points` returns and the best plan found, or None past its deadline."""
        def run(deadline: float | None, rng, forked: bool):
            if past(deadline):
                return None
            with self._searcher(k, start) as searcher:
                if forked:
                    searcher.progress = None
                return _score_points(searcher, rest, deadline), searcher.best
        return run

    def chain_tasks(self) -> list[ChainTask]:
        """A chain from the best point of each of the `CHAINED_PIPELINES` pipelines whose
        grids did best, as `soapjax.search._parallel.run_chains` runs them: each opens its
        pipeline's simulation, picks its start's schedule (`choose_schedule`), walks its
        stage boundaries (`balance_stages`) and recomputation (`_relaxed`), then chains; its
        outcome is its best."""
        return [self._chain_task(k, name, start)
                for _, k, name, start in sorted(self.ranked)[:CHAINED_PIPELINES]]

    def _chain_task(self, k: int, name, start: Strategy) -> ChainTask:
        settings = self._settings

        def run(deadline: float | None, rng, forked: bool) -> ChainOutcome:
            if past(deadline):  # opening a pipeline's simulation costs seconds at scale
                return empty_outcome()
            with self._searcher(k, start) as searcher:
                searcher.rng = rng
                searcher._shown = self._flat.proposals
                if forked:
                    searcher.progress = None
                # the chain walks the configs under the schedule and at the stage
                # boundaries its start is best at
                _, begin, _ = balance_stages(searcher.sim, choose_schedule(
                    searcher.sim, (searcher.sim.step_time(), start, name.name)), deadline)
                begin, label = self._relaxed(searcher, begin, name.name, deadline)
                searcher.chain(label, begin, deadline if deadline is not None
                               else time.perf_counter() + settings.budget_s / 4)
                return searcher.outcome(best_only=True)
        return run

    def _relaxed(self, searcher: _Searcher, start: Strategy, name: str,
                 deadline: float | None) -> tuple[Strategy, str]:
        """`start` with its layers' attention core kept where that is faster and fits
        (`soapjax.search.recompute.relaxed`, in `RELAX_SHARE` of the chain's time: a
        selectively recomputed pipeline only), and the chain's start name (``...-kept``
        then); else `start` and `name` (docs/vs-experts.md: Mixtral 8x22B's combine einsum
        kept)."""
        if deadline is not None:
            deadline = time.perf_counter() + RELAX_SHARE * max(0.0, deadline
                                                                - time.perf_counter())
        found = relaxed(searcher.sim, self._args[0], start, deadline,
                        lambda: searcher.record(f"{name}-kept"))
        return (start, name) if found is None else (found[1], f"{name}-kept")


# How many of a search's fastest pipelined plans `_settle_folded` prices again, at most.
SETTLED_PLANS = 3


def _settle_folded(searcher: _Searcher, graph: OpGraph, topology, cost_model,
                   opt_state_factor: float) -> int:
    """The search's pipelined plans were priced on folded stages (`_pipeline_searcher`),
    which extrapolate the stage's timeline from a few layers: exact while its terms stay
    linear in the layers, and not always where one crosses another beyond the folds
    (docs/vs-experts.md). Here the fastest of them (the starts' bests and every plan a
    chain brought, `_Searcher.absorbed`: a chain's best may have displaced its start's grid
    point with a price too low) are priced again on their whole stage, fastest first (at
    most `SETTLED_PLANS`), until a plan priced exactly (one without stages, or one priced
    whole) is as fast as the next one's folded price; the whole prices replace the folded
    ones among the starts' bests, and the best follows. Returns how many were priced
    again."""
    claims: dict[Strategy, tuple[float, Strategy, str]] = {}
    for found in (*searcher.absorbed, *searcher.bests.values()):
        if found[1] not in claims or found[0] < claims[found[1]][0]:
            claims[found[1]] = found
    folded = [s for s in claims if folds(graph, s)]
    whole: dict[Strategy, float] = {}
    for _ in range(SETTLED_PLANS):
        exact = min([f[0] for s, f in claims.items() if s not in folded]
                    + list(whole.values()), default=math.inf)
        pending = sorted((s for s in folded if s not in whole), key=lambda s: claims[s][0])
        if not pending or claims[pending[0]][0] >= exact:
            break
        with open_simulation(graph, topology, pending[0], cost_model=cost_model,
                             resharder=DEFAULT_MODE, opt_state_factor=opt_state_factor) as sim:
            whole[pending[0]] = sim.step_time() if sim.fits_in_memory() else math.inf
    if not whole:
        return 0
    bests: dict[str, tuple[float, Strategy, str]] = {}
    for s, (t, _, name) in claims.items():  # per start, its fastest, priced whole where it was
        found = (whole.get(s, t), s, name)
        if name not in bests or found[0] < bests[name][0]:
            bests[name] = found
    searcher.bests = {name: f for name, f in bests.items() if f[0] < math.inf}
    searcher.best = min(searcher.bests.values(), key=lambda f: f[0], default=None)
    return len(whole)


@contextlib.contextmanager
def _pipeline_searcher(graph: OpGraph, topology, cost_model, settings: SearchSettings,
                       opt_state_factor: float, progress: Progress | None, flat: _Searcher,
                       S: int, v: int, schedule: str, first: Strategy):
    """A `_Searcher` over a `PipelinedSimulation` opened at `first`, its clock `flat`'s, its
    microbatch moves those the schedule takes at S stages (`pipeline_error`). The stage is
    simulated on a few of its layers where they fold (`soapjax.simulate._pipe_fold`: the
    whole stage's prices to rounding at a fraction of the work, docs/vs-experts.md; the chains
    keep the layers tied, as folding needs)."""
    with open_simulation(graph, topology, first, cost_model=cost_model,
                         resharder=DEFAULT_MODE, opt_state_factor=opt_state_factor,
                         fold=True) as sim:
        searcher = _Searcher(sim, settings, progress)
        searcher.t0 = flat.t0
        searcher.microbatches = tuple(
            m for m in searcher.microbatches if pipeline_error(schedule, S, m, v) is None)
        yield searcher


