"""Megatron's grid as the search scores it: its degrees, its order, its walk, its starts.

A grid point is a `soapjax.strategy.baselines.GridPoint` (TP, CP, EP, PP, virtual stages,
distributed optimizer, microbatch size, recomputation), named by itself; the search scores
points in the order Megatron-LM users try them (`_likely_first`), walks a pipeline's grid
along its coordinates (`_score_points`), and starts chains from the grid's best point and its
best with expert or context parallelism (`_grid_starts`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from soapjax.graph.opgraph import OpGraph
from soapjax.search._chain import (
    Progress,
    _cost,
    _Searcher,
)
from soapjax.search._clock import past
from soapjax.simulate.front import (
    Simulation,
)
from soapjax.strategy.baselines import (
    GridPoint,
    expert_dim,
    megatron_grid_points,
    sequence_dims,
)
from soapjax.strategy.space import (
    RECOMPUTE_POLICIES,
    SpaceLimits,
    Strategy,
    within_limits,
)

__all__ = ["CONTEXT_PARALLEL_MIN_TOKENS", "GRID_FAMILIES", "grid_degrees"]


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


def _within(graph: OpGraph, strategies: Mapping[Any, Strategy], limits: SpaceLimits
            ) -> dict[Any, Strategy]:
    """`strategies` (name or grid point -> strategy) without those outside `limits`, in
    order. Grid points of one layout share their configs (one tuple): each tuple is checked
    once."""
    seen: dict[int, bool] = {}  # by id: the tuples stay alive in `strategies` meanwhile
    out = {}
    for key, strategy in strategies.items():
        configs = strategy.configs
        if id(configs) not in seen:
            seen[id(configs)] = all(within_limits(op, c, limits)
                                    for op, c in zip(graph.operators, configs))
        if seen[id(configs)]:
            out[key] = strategy
    return out


# The kinds of parallelism whose best grid point gets a chain of its own beside the grid's best:
# a chain from TP 8 rarely walks into expert or context parallelism (every expert operator and
# the all-to-alls must move together), so the search starts in those basins too.
GRID_FAMILIES = {"expert": "ep", "context": "cp"}  # family -> its `GridPoint` degree


def _grid_starts(sim: Simulation, searcher: _Searcher, graph: OpGraph, topology,
                 progress: Progress | None, limits: SpaceLimits,
                 deadline: float | None = None) -> dict[str, Strategy]:
    """Scores Megatron's grid (`baselines.megatron_grid`, with the expert- and
    context-parallel degrees of `grid_degrees`); returns the chains' starts from it: the
    fastest point that fits (or the fastest), and for each family of `GRID_FAMILIES` the grid
    has (points with ``ep`` or ``cp`` above 1), that family's fastest, where it is another
    point. Every point is recorded as seen.

    First each model-parallel shape's least-memory point (`_memory_floor`, the most model
    parallelism first) until one fits: where none does, no point of the grid can, and the rest
    is left unscored (GPT 175B on 96 A100s, where nothing fits without pipeline stages: the
    time goes to the pipelines' grids, docs/vs-experts.md); where one does, that is one point
    more than the rest alone. Then the rest until `deadline` (None: all)."""
    # In the order Megatron-LM users try them (`_likely_first`): a deadline that cuts the
    # grid (Mixtral 8x7B's 306 points with ep) cuts the unlikely points, not TP 4 and 8
    grid = dict(sorted(_within(graph, megatron_grid_points(
        graph, topology, **grid_degrees(graph, topology)), limits).items(), key=_likely_first))
    best: dict[str, tuple[tuple[bool, float], str, Strategy]] = {}
    seen: list[GridPoint] = []

    def score(point: GridPoint) -> bool:
        """Scores `point`, recorded as seen and kept where it is its family's fastest;
        whether it fits."""
        if progress is not None:
            progress(f"search: scoring Megatron's grid, {len(seen) + 1} of {len(grid)}")
        seen.append(point)
        sim.reset(grid[point])
        searcher.record(point.name)
        key = (not sim.fits_in_memory(), sim.step_time())
        families = ["grid"] + [f for f, degree in GRID_FAMILIES.items()
                               if getattr(point, degree) > 1]
        for family in families:
            if family not in best or key < best[family][0]:
                best[family] = (key, point.name, grid[point])
        return not key[0]

    if not any(score(point) for point in _memory_floor(list(grid))):
        if progress is not None:
            progress(f"search: none of the {len(seen)} shapes of Megatron's grid without "
                     "pipeline stages fits, even with full recomputation, the distributed "
                     f"optimizer and microbatches of 1; its other {len(grid) - len(seen)} "
                     "points left unscored")
    else:
        done = set(seen)
        rest = [p for p in grid if p not in done]
        for n, point in enumerate(rest):
            if past(deadline):
                if progress is not None:
                    progress(f"search: {len(rest) - n} of Megatron's {len(grid)} grid points "
                             "left unscored (time budget)")
                break
            score(point)
    return {name: strategy for _, name, strategy in best.values()}


def _likely_first(point: tuple[GridPoint, Strategy]) -> tuple[int, int, int, int]:
    """What Megatron-LM users run first: microbatches of 1, the most model parallelism (TP8;
    TP x EP 8 with experts, the most experts apart first), then recompute selective, full,
    none (`RECOMPUTE_POLICIES` from its second). Under a tight budget a pipeline's grid may be
    cut after a few points, and those must include the fast ones that fit."""
    p = point[0]
    policy = RECOMPUTE_POLICIES.index(p.recompute)
    return (p.mb, -p.tp * p.ep, -p.ep, (policy - 1) % len(RECOMPUTE_POLICIES))


def _score_points(searcher: _Searcher, points: dict[GridPoint, Strategy],
                  deadline: float | None, *, until_fit: bool = False, fit_first: bool = False
                  ) -> tuple[tuple[bool, float], GridPoint, Strategy, set[GridPoint]]:
    """Scores `points` until `deadline` (one at least; with `fit_first`, where the first
    does not fit, it is made to fit as the descent below makes a point fit, whatever the
    deadline: a pipeline ranked by one point is ranked by one that fits; with `until_fit`,
    past it until one fits, among each model-parallel shape's least-memory point,
    `_memory_floor`: while no pipeline's grid has a plan that fits, a deadline must not hide
    one, as it hid GPT 70B at 32K tokens' on 64 H100s), each recorded as seen; returns the
    best's key (does not fit, its cost: the step time, penalised as the chains penalise a
    point that does not fit), name and strategy, and the names scored.

    The order is a descent over the grid's coordinates (`GridPoint.coordinates`) before the rest
    in their order: from the first point, every point on the line through the best so far along
    one coordinate (recomputation, distributed optimizer, microbatch size, TP, EP, CP:
    `_DESCENT`), the best moving to the line's best, one coordinate after another, until a round
    moves it no more; then a point the lines found faster than the best but over memory is made
    to fit (`_fit_variants`: the distributed optimizer, smaller microbatches, more
    recomputation; its shape's floor first), which no single line reaches, and the lines again
    if that moved it (GPT 18.4B on 256 A100s at 4 x 5 stages: TP 1 fits only with the
    distributed optimizer and microbatches of 1); where that settles too, every point that
    differs from the best in recomputation and one other coordinate at once (a point may fit
    without recomputation only at a higher CP or TP degree, where with recomputation it is
    slower than the best so far), and the lines again if that moved it. Only then the others.
    A grid cut by its deadline has then walked towards its best along each coordinate
    (Mixtral 8x22B on 256 H100s at 4 stages, 162 points: in 1.2 s `_likely_first`'s order
    reached 17.0 s a step, 15.4 s in 2 s; the descent reaches the grid's best, 11.9 s, in
    1.2 s, at the microbatch size that order puts last)."""
    names = list(points)
    coords = {n: n.coordinates() for n in names}
    scored: dict[GridPoint, tuple[bool, float]] = {}
    step: dict[GridPoint, float] = {}  # each scored point's step time, fitting or not
    tried: set[GridPoint] = set()  # the points `made_to_fit` has tried to make fit
    best: GridPoint | None = None

    def stop() -> bool:
        return best is not None and past(deadline)

    def score(name: GridPoint) -> None:
        nonlocal best
        searcher.sim.reset(points[name])
        searcher.record(name.name)
        # a point that does not fit is ranked as the chains rank it: its step time times a
        # penalty growing with its excess memory (`_chain._cost`), so the descent heads for
        # points that fit rather than for the fastest of those that do not
        scored[name] = (not searcher.sim.fits_in_memory(), _cost(searcher.sim))
        step[name] = searcher.sim.step_time()
        if best is None or scored[name] < scored[best]:
            best = name

    def made_to_fit() -> None:
        """Every scored point faster than the best but over memory, made to fit
        (`make_fit`)."""
        for name in [n for n in scored if scored[n][0] and n not in tried
                     and not scored[best][0] and step[n] < scored[best][1]]:
            if not make_fit(name, stop):
                return

    def make_fit(name: GridPoint, stop: Callable[[], bool]) -> bool:
        """`name` made to fit (`_fit_variants`): its shape's floor first (where that does not
        fit, nothing does), then its variants until one fits, each scored (once a point:
        `tried`); False where `stop` said to stop first."""
        tried.add(name)
        *faster, floor = _fit_variants(name, names) or [name]
        if stop():
            return False
        if not fits(floor):
            return True
        for variant in faster:
            if stop():
                return False
            if fits(variant):
                break
        return True

    def fits(name: GridPoint) -> bool:
        """Whether `name` fits, scored first where it is not yet."""
        if name not in scored:
            score(name)
        return not scored[name][0]

    score(names[0])
    if fit_first and scored[names[0]][0]:
        make_fit(names[0], lambda: False)

    def along(axes_list: list[tuple[str, ...]]) -> bool:
        """Every unscored point apart from the best in exactly each `axes` in turn (the best
        moving as it goes); whether the best moved."""
        moved = False
        for axes in axes_list:
            here = best
            for name in names:
                if name in scored or not _apart(coords[name], coords[here], axes):
                    continue
                if stop():
                    break
                score(name)
            moved = moved or best != here
        return moved

    def fitted() -> bool:
        """`made_to_fit`; whether the best moved."""
        here = best
        made_to_fit()
        return best != here

    # one coordinate at a time; where that settles, a faster point over memory made to fit
    # (its shape's floor, then its variants: GPT 175B on 96 A100s at 12 x 8 stages, the
    # grid's best, TP4 with the distributed optimizer, selective recomputation and
    # microbatches of 1, is TP4 mb2's variant), then recomputation with one other at once (a
    # point that fits only with recomputation may be faster with more CP or TP and none)
    moved = True
    while moved and not stop():
        moved = (along([(axis,) for axis in _DESCENT]) or fitted()
                 or along([(_DESCENT[0], a) for a in _DESCENT[1:]]))
    for name in names:
        if stop():
            break
        if name not in scored:
            score(name)
    if until_fit and scored[best][0]:  # nothing fits yet: past the deadline, the floor only
        for name in _memory_floor(names):
            if name not in scored:
                score(name)
                if not scored[best][0]:
                    break
    return scored[best], best, points[best], set(scored)


def _fit_variants(point: GridPoint, names: list[GridPoint]) -> list[GridPoint]:
    """The grid's points that hold less than `point` in its model-parallel shape (TP, CP, EP,
    stages, virtual stages) by the memory-saving coordinates alone: the distributed optimizer,
    a smaller microbatch, more recomputation; in the order they likely cost time (no more
    recomputation first, the largest microbatch first, the optimizer's shards before a smaller
    microbatch), so the last holds the least (the shape's floor, `_memory_floor`'s). GPT 18.4B
    on 256 A100s at 4 stages x 5 virtual: TP 1 with microbatches of 4 is the fastest point but
    needs 243 GB; with the distributed optimizer and microbatches of 1 it fits, the grid's
    best, which no single coordinate's line reaches."""
    rec = RECOMPUTE_POLICIES.index
    return sorted((n for n in names
                   if _shape(n) == _shape(point) and n != point and n.do >= point.do
                   and n.mb <= point.mb and rec(n.recompute) >= rec(point.recompute)),
                  key=lambda n: (rec(n.recompute), -n.mb, n.do))


def _shape(point: GridPoint) -> tuple[int, ...]:
    """A grid point's model-parallel shape: TP, CP, EP, stages, virtual stages."""
    return (point.tp, point.cp, point.ep, point.pp, point.v)


def _memory_floor(names: list[GridPoint]) -> list[GridPoint]:
    """Per model-parallel shape (TP, CP, EP, stages, virtual stages) the grid's point that
    holds the least: full recomputation, the distributed optimizer where the grid has it, the
    smallest microbatch. If a shape fits at all, it fits there, so a grid scored past its
    deadline while nothing fits (`_score_points`' ``until_fit``) scores these alone, the most
    model parallelism first, and stops at the first that fits: a pipeline whose grid holds
    nothing that fits costs a few points past the deadline, not its whole grid (Llama 3 70B
    at 8K tokens on 64 H100s overran a 60 s budget by 48 s so)."""
    least: dict[tuple, tuple[tuple, GridPoint]] = {}
    for n in names:
        shape = _shape(n)
        key = (-RECOMPUTE_POLICIES.index(n.recompute), not n.do, n.mb)
        if shape not in least or key < least[shape][0]:
            least[shape] = (key, n)
    return [n for _, n in sorted(least.values(), key=lambda kn: -kn[1].tp * kn[1].cp * kn[1].ep)]


# the coordinates `_score_points` walks, one line at a time: what decides whether a point fits
# first (recomputation, the optimizer state sharded), then what the step time depends on most
_DESCENT = ("rec", "do", "mb", "tp", "ep", "cp")


def _apart(a: dict[str, object], b: dict[str, object], axes: tuple[str, ...]) -> bool:
    """Whether grid points `a` and `b` differ in every coordinate of `axes` and in no other."""
    return all(a[k] != b[k] for k in axes) and all(a[k] == b[k] for k in a if k not in axes)
