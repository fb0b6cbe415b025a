"""What a pipeline's chain walks that leaves its stage's simulation as it is: the schedule
(`choose_schedule`: a zero-bubble schedule where its deferred weight gradients fill the
bubble and its memory fits) and the stage boundaries (`balance_stages`: uneven stages, as
Megatron-LM's ``--decoder-last-pipeline-num-layers``).
"""

from __future__ import annotations

import math

from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import OpGraph
from soapjax.search._clock import past
from soapjax.simulate.pipesim import PipelinedSimulation, PipelineResult
from soapjax.strategy.pipeline import SCHEDULES
from soapjax.strategy.space import (
    Strategy,
)

__all__ = ["balance_stages", "choose_schedule"]


def _num_layers(graph: OpGraph) -> int:
    """The layers a pipeline cuts (the longest family of repeated blocks)."""
    return max((len(g) for g in graph.repeated_blocks()), default=0)



def balance_stages(sim: PipelinedSimulation, best: tuple[float, Strategy, str],
                   end: float | None = None, *, rounds: int = 64
                   ) -> tuple[float, Strategy, str]:
    """`best` (a chain's best: time, strategy, start name) with its stage boundaries moved
    where that makes the step faster: uneven stages (`Strategy.stage_layers`), the last one
    lighter where the head weighs, as Megatron-LM's ``--decoder-last-pipeline-num-layers``.

    A descent on one stage's simulation (`PipelinedSimulation.stage_layers_result`: the
    boundaries change only the schedule's work, not the stage's simulation): from equal
    stages, each round tries every boundary between two stages that differ
    (`_uneven_boundaries`) moved by one layer either way and keeps the fastest that fits,
    until none is faster (or `rounds`, or `end`). Only where apply runs it: one virtual
    stage, the layers dividing by the stages (`check_stage_layers`). The search balances
    each chain's start (`_Pipelines.chain_tasks`), where `sim` is at it already; `sim` ends
    at the result."""
    t, strategy, name = best
    S, v, _, layers = strategy.pipeline
    num_layers = _num_layers(sim.graph)
    if v != 1 or S < 2 or layers or num_layers % S or num_layers < 2 * S or past(end):
        return best
    if sim.strategy != strategy:
        sim.propose_strategy(strategy)
        sim.accept()
    even = [num_layers // S] * S
    sizes, current = even, sim.result()
    for _ in range(rounds):
        if past(end):
            break
        tried = []
        for b in _uneven_boundaries(current, sizes):
            for d in (1, -1):
                cut = list(sizes)
                cut[b] += d
                cut[b + 1] -= d
                if min(cut) < 1:
                    continue
                r = sim.stage_layers_result(tuple(cut))
                if r.fits_in_memory:
                    tried.append((r.step_time_s, cut, r))
        if not tried or min(tried, key=_time_then_cut)[0] >= t:
            break
        t, sizes, current = min(tried, key=_time_then_cut)
    if sizes == even:
        return best
    sim.set_stage_layers(tuple(sizes))
    return sim.step_time(), sim.strategy, name


def _time_then_cut(tried: tuple) -> tuple:
    return tried[:2]


def _uneven_boundaries(result: PipelineResult, sizes: list[int]) -> list[int]:
    """The boundaries `balance_stages` moves a layer across: those between two stages that differ
    (in layers, or in what one microbatch costs them forward, backward and in its weight
    gradients, or in their tails, beyond rounding). Moving a layer between two equal stages
    makes one heavier by as much as the other gets lighter: the schedule's steady period is
    set by its heaviest stage and its fill and drain by their sum, so it is not faster."""
    times = result.chunk_times
    stage = [(sizes[s], times.forward_s[s], times.backward_s[s], times.weight_s[s],
              result.tail_s[s]) for s in range(len(sizes))]
    return [b for b in range(len(sizes) - 1)
            if not all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(stage[b], stage[b + 1]))]


def choose_schedule(sim: PipelinedSimulation, best: tuple[float, Strategy, str]
                    ) -> tuple[float, Strategy, str]:
    """`best` (time, strategy, start name) under the fastest schedule that fits among those
    for its number of virtual stages (`SCHEDULES`: 1F1B, GPipe and ZB-H1 for one; the
    interleaved schedule and its zero-bubble form for more; the zero-bubble ones with their
    stash lean or gathered), each priced on `sim`'s stage as it is
    (`PipelinedSimulation.schedule_result`); `sim` ends at the result. The zero-bubble
    schedules hold more microbatches on the later stages (ZB-H1: up to S on each), and
    their gathered forms a larger stash, so where memory is tight the choice stays."""
    t, strategy, name = best
    S, v, schedule, _ = strategy.pipeline
    if S < 2:
        return best
    if sim.strategy != strategy:
        sim.propose_strategy(strategy)
        sim.accept()
    found = t, schedule
    for other, rules in SCHEDULES.items():
        if other == schedule or rules.virtual != (v > 1):
            continue
        try:  # one that does not fit is not timed (`schedule_fits`: no compiled order)
            if not sim.schedule_fits(other):
                continue
            r = sim.schedule_result(other)
        except PlanError:  # not at these microbatches
            continue
        if r.fits_in_memory and r.step_time_s < found[0]:
            found = r.step_time_s, other
    if found[1] == schedule:
        return best
    sim.set_schedule(found[1])
    return sim.step_time(), sim.strategy, name
