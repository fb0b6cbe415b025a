"""Stage 7, the execution optimizer: Metropolis-Hastings chains over strategies, scored by the
simulator, and the plan entry point.

- `find`: the entry (`find_plan`, `search`): the starts, the chains within the budget, the plan.
- `_chain`: one chain, its moves and its acceptance rule (`SearchSettings`).
- `grids`: Megatron's grid as the search scores it (`soapjax.strategy.baselines.GridPoint`s).
- `pipelines`: the pipelines tried, their grids and the chains of the best.
- `stages`: stage balancing, uneven stages where the step is faster.
- `recompute`: recomputation chosen per operator within the memory (`relaxed`).
- `optimality`: the paper's optimality checks (section 8.4).
- `_clock`: deadlines of the time budget; `sparse_gc`, the garbage collector as a search
  sets it.
"""

from soapjax.search._chain import random_strategy as random_strategy
from soapjax.search._clock import sparse_gc as sparse_gc
from soapjax.search.find import (
    MAX_BUDGET_S as MAX_BUDGET_S,
    MAX_PROPOSALS as MAX_PROPOSALS,
    RESHARD_FINALISTS as RESHARD_FINALISTS,
    Progress as Progress,
    SearchResult as SearchResult,
    SearchSettings as SearchSettings,
    check_reshardings as check_reshardings,
    checked_finalist as checked_finalist,
    find_plan as find_plan,
    make_simulation as make_simulation,
    print_progress as print_progress,
    search as search,
)
from soapjax.search.grids import (
    CONTEXT_PARALLEL_MIN_TOKENS as CONTEXT_PARALLEL_MIN_TOKENS,
    grid_degrees as grid_degrees,
)
from soapjax.search.optimality import (
    exhaustive as exhaustive,
    improving_change as improving_change,
)
from soapjax.search.pipelines import (
    PIPELINE_GRID as PIPELINE_GRID,
    interleave_choices as interleave_choices,
    pipeline_grid as pipeline_grid,
    stage_choices as stage_choices,
)
from soapjax.search.stages import (
    balance_stages as balance_stages,
    choose_schedule as choose_schedule,
)

__all__ = [
    "CONTEXT_PARALLEL_MIN_TOKENS",
    "MAX_BUDGET_S",
    "MAX_PROPOSALS",
    "PIPELINE_GRID",
    "Progress",
    "RESHARD_FINALISTS",
    "SearchResult",
    "SearchSettings",
    "balance_stages",
    "choose_schedule",
    "check_reshardings",
    "checked_finalist",
    "exhaustive",
    "find_plan",
    "grid_degrees",
    "improving_change",
    "interleave_choices",
    "make_simulation",
    "pipeline_grid",
    "print_progress",
    "random_strategy",
    "search",
    "sparse_gc",
    "stage_choices",
]
