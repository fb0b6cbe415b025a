"""Recomputation chosen per operator within the device's memory (issue 46, point 2).

Megatron-LM's recomputation is one of three policies for every layer: none, selective (the
attention core recomputed) or full (the layer recomputed from its input). Where memory forces
full recomputation, recomputing *everything* is seldom what is best: at long sequences the
attention core is most of a layer's time and little of its memory (a flash kernel keeps its
queries, keys, values, output and a row statistic, nothing ``s x s``), while the MLP and the
projections are cheap to run again and hold most of the bytes. The SOAP space already has the
plan that keeps some operators' outputs and recomputes the rest (`Strategy.recompute` is per
operator; `soapjax.strategy.memory` prices it, `soapjax.apply._flatstep.recompute_segments`
runs it), but a chain seldom walks to it: from a plan that fits with little room, keeping the
attention's outputs alone overflows the memory, and the chain must first take more microbatches
(a move 3 % of proposals make) and then that recompute move before leaving them again.

`relaxed` walks there directly. From a fitting strategy, at its own microbatch count and at
each larger one the batch allows (up to `MICROBATCH_STEPS` of them, each holding less per
microbatch), it stops recomputing one operator position at a time (every layer's operator at
that position at once, as a chain moves them: `soapjax.graph.opgraph.OpGraph.repeated_blocks`),
each round the change that saves the most time per byte of memory it adds among those that
still fit (a change that adds no memory first), until no change is faster and fits; the
fastest plan of those walks is returned. Each change is delta-simulated and rejected, the one
taken simulated again and accepted (`Simulation.propose_many`), so the plan's price is the
full simulation's.

A pipelined strategy is walked where its layers recompute selectively (the attention core
run again, nothing in full) and at its own microbatch count (its schedule's): apply runs a
pipeline's layers under one policy, the strongest any layer operator has
(`soapjax.apply._pipeline_layout.layer_recompute`), and keeps, beyond what selective
recomputation keeps, the outputs of the attention-core operators whose policy is none
(`soapjax.apply._pipeline_layout.kept_positions`), so the walk changes those alone; a chunk
recomputed in full keeps its input only, so a pipeline recomputing in full is not walked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from soapjax.graph.opgraph import OpGraph
from soapjax.simulate.front import Simulation
from soapjax.strategy.memory import microbatch_choices, microbatch_refusal, recomputes
from soapjax.strategy.space import MeshShape, Strategy

__all__ = ["MICROBATCH_STEPS", "RELAX_SHARE", "recomputes_any", "relaxed", "tidied"]

# The microbatch counts tried beyond the strategy's own: the next MICROBATCH_STEPS larger ones
# the batch and every operator's sample split allow.
MICROBATCH_STEPS = 3

# The share of a search's time budget (flat plans: `soapjax.search.find`'s starts) or of a
# pipeline chain's (`soapjax.search.pipelines`) that these walks may take.
RELAX_SHARE = 0.1


def recomputes_any(graph: OpGraph, strategy: Strategy) -> bool:
    """Whether some operator of `graph` runs its forward again under `strategy`
    (`soapjax.strategy.memory.recomputes`: selective recomputation of a layer whose attention
    is one flash operator recomputes nothing)."""
    return any(recomputes(op, strategy.recompute_of(j)) for j, op in enumerate(graph.operators))


def _positions(graph: OpGraph, layers_only: bool = False) -> list[list[int]]:
    """The operators a recompute change moves together: every layer's operator at one
    position of a repeated block, or one operator outside the blocks (graph order); with
    `layers_only`, the layers' positions alone."""
    tied = {i: g for g in graph.repeated_blocks() for i in g}
    return [tied.get(i, [i]) for i in range(len(graph.operators)) if tied.get(i, [i])[0] == i
            and (not layers_only or graph.operators[i].block_position)]


def _walkable(graph: OpGraph, strategy: Strategy) -> bool:
    """Whether `relaxed` walks `strategy`: it recomputes something, and if it has pipeline
    stages, no layer operator in full (module doc)."""
    if not recomputes_any(graph, strategy):
        return False
    return strategy.stages == 1 or not any(
        strategy.recompute_of(j) == "full" for j, op in enumerate(graph.operators)
        if op.block_position)


def _counts(graph: OpGraph, strategy: Strategy, mesh: MeshShape) -> list[int]:
    """The strategy's microbatch count, then (without pipeline stages) up to
    `MICROBATCH_STEPS` larger ones its configs take
    (`soapjax.strategy.memory.microbatch_refusal`)."""
    if strategy.stages > 1:
        return [strategy.microbatches]
    larger = [m for m in microbatch_choices(graph) if m > strategy.microbatches
              and not microbatch_refusal(graph, strategy.configs, mesh, m)]
    return [strategy.microbatches] + larger[:MICROBATCH_STEPS]


def _walk(sim: Simulation, graph: OpGraph, positions: list[list[int]],
          deadline: float | None) -> None:
    """From the simulation's (fitting) strategy, stops recomputing one position at a time,
    the best change per byte first, while one is faster and fits; the changes taken stay
    accepted on `sim`."""
    cap = sim.topology.device.memory_bytes
    while deadline is None or time.perf_counter() < deadline:
        t0, m0 = sim.step_time(), sim.peak_memory_bytes()
        best = None  # (seconds saved per byte added, members)
        for members in positions:
            if not recomputes(graph.operators[members[0]], sim.choice(members[0])[1]):
                continue
            sim.propose_many([(j, sim.choice(j)[0], "none") for j in members])
            t, m = sim.step_time(), sim.peak_memory_bytes()
            sim.reject()
            if t < t0 and m <= cap:
                score = (t0 - t) / max(m - m0, 1)
                if best is None or score > best[0]:
                    best = (score, members)
            if deadline is not None and time.perf_counter() >= deadline:
                break
        if best is None:
            return
        sim.propose_many([(j, sim.choice(j)[0], "none") for j in best[1]])
        sim.accept()


def relaxed(sim: Simulation, graph: OpGraph, strategy: Strategy, deadline: float | None = None,
            record: Callable[[], None] | None = None) -> tuple[float, Strategy] | None:
    """The fastest fitting plan `strategy`'s recomputation relaxes to (module doc): ``(step
    time, strategy)``, or None where none is faster than `strategy` or it recomputes nothing,
    has pipeline stages whose layers recompute in full, or does not fit.

    Args:
      sim: a simulation of `strategy`'s kind (`soapjax.simulate.front.open_simulation`: flat,
        or of its pipeline), reset here.
      graph: its graph.
      strategy: where the walks start; tied over the repeated blocks (as chains keep them).
      deadline: a `time.perf_counter` time after which no change is tried (None: none).
      record: called with each walk's end on `sim` (the search's `_Searcher.record`).
    """
    if not _walkable(graph, strategy):
        return None
    sim.reset(strategy)
    if not sim.fits_in_memory():
        return None
    start = sim.step_time()
    best: tuple[float, Strategy] | None = None
    positions = _positions(graph, layers_only=strategy.stages > 1)
    for m in _counts(graph, strategy, MeshShape.of(sim.topology)):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        sim.reset(strategy.with_microbatches(m))
        if not sim.fits_in_memory():
            continue
        _walk(sim, graph, positions, deadline)
        if record is not None:
            record()
        t = sim.step_time()
        if t < start and (best is None or t < best[0]):
            best = (t, sim.strategy)
    return best


def tidied(sim: Simulation, graph: OpGraph, strategy: Strategy) -> tuple[float, Strategy] | None:
    """`strategy` (flat, fitting) without the recomputation that buys nothing: each operator
    position that recomputes (every layer's at once) stops where the step is no slower and
    still fits, in graph order, one pass. A chain keeps a recomputation that costs no time
    (its forward run again where the device waits for a collective anyway) as readily as one
    that saves memory, and apply then runs it, with whatever XLA does again in it (a
    recomputed output gathered again in the backward, a collective the simulator does not
    price: docs/checks.md). Returns ``(step time, strategy)``, or None where nothing changed
    (or `strategy` has stages, recomputes nothing or does not fit)."""
    if strategy.stages > 1 or not recomputes_any(graph, strategy):
        return None
    sim.reset(strategy)
    if not sim.fits_in_memory():
        return None
    cap, changed = sim.topology.device.memory_bytes, False
    for members in _positions(graph):
        if not recomputes(graph.operators[members[0]], sim.choice(members[0])[1]):
            continue
        t0 = sim.step_time()
        sim.propose_many([(j, sim.choice(j)[0], "none") for j in members])
        if sim.step_time() <= t0 and sim.peak_memory_bytes() <= cap:
            sim.accept()
            changed = True
        else:
            sim.reject()
    return (sim.step_time(), sim.strategy) if changed else None
