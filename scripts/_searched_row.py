"""The search half of the plan-against-hand-grid benches (scripts/bench_moe.py,
scripts/bench_long_context.py): one `find_plan` at a budget, timed, and its plan recorded as
the bench records a grid point."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from soapjax.errors import PlanError
from soapjax.graph import OpGraph
from soapjax.search import SearchSettings, find_plan


def search_into(row: dict, g: OpGraph, topo, w: Any, model_config: str, costs, budget: float,
                pipelines: bool | None, point: Callable[..., Any],
                describe: Callable[..., dict], progress=None) -> dict:
    """Searches `g` on `topo` (seed 0, `budget` seconds) and fills `row`: ``search_s`` and
    either ``error`` (the PlanError's first line) or ``searched`` (``point("searched", ...)``
    as a dict, with the plan's `describe` words, the grid point it started from and its
    proposals). Returns `row`."""
    t0 = time.perf_counter()
    try:
        plan = find_plan(g, topo, settings=SearchSettings(budget_s=budget, seed=0,
                                                          pipelines=pipelines),
                         costs=costs, optimizer=w.optimizer, family=w.family,
                         model_config=model_config, progress=progress)
    except PlanError as e:
        row["search_s"], row["error"] = time.perf_counter() - t0, str(e).splitlines()[0]
        return row
    row["search_s"] = time.perf_counter() - t0
    s = plan.strategy(g, topo)
    info = plan.to_json()["search"]
    row["searched"] = point(s)._asdict() | {
        "words": describe(g, s, topo), "best_from": info.get("best_from"),
        "proposals": info.get("proposals")}
    return row
