"""The paper's optimality checks (section 8.4): branch and bound over a small graph's whole
space (`exhaustive`), and whether any one operator's config change improves a strategy
(`improving_change`).
"""

from __future__ import annotations

import math

from soapjax.simulate.front import (
    Simulation,
)
from soapjax.strategy.memory import microbatch_error
from soapjax.strategy.space import (
    Config,
    MeshShape,
    SpaceLimits,
    Strategy,
    configs,
)

__all__ = ["exhaustive", "improving_change"]



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
    divide is not in the space (`soapjax.strategy.memory.microbatch_error`), as the search's moves
    keep.
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

