"""scripts/bench_vs_experts.py on a tiny GPT and the 8 CPU devices as 2 nodes: the hand grid
is Megatron's with its pipelined points and the MaxText-style rules, each scored; the row's
best hand configuration is the fastest that fits; the search's plan is priced as apply runs it
and never slower than the grid's best as apply runs it (it starts from it); the table says the
ratio."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys

import pytest

from soapjax.strategy import baselines

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_vs_experts as bench  # noqa: E402

MESH = str(ROOT / "tests" / "meshes" / "cpu8-nodes.toml")


def test_a_case_scores_the_experts_grid_and_searches():
    case = bench.Case("tiny", "gpt", "tiny", MESH, 16, note="a test")
    messages = []
    # a fixed proposal count, not a time budget: no deadline cuts the grid on a loaded
    # machine (a clean-clone `make test` beside a bench once ended 3.7x off the grid's best)
    row = bench.run_case(case, budget=2.0, progress=messages.append, proposals=20)
    names = [row["hand"]["name"], row["megatron"]["name"], row["maxtext"]["name"]]
    assert names[1].startswith("megatron") and names[2].startswith("fsdp")
    assert row["hand"]["step_s"] == min(row["megatron"]["step_s"], row["maxtext"]["step_s"])
    assert row["grid_points"] > 50 and any("pipeline shape" in m for m in messages)
    found = row["searched"]
    assert found["fits"] and found["proposals"] > 0
    # it starts from the grid's best, priced as apply runs it
    assert found["step_s"] <= row["hand"]["applied_s"] * 1.0001
    r = bench.ratio(row)
    assert r is not None and r > 0.5
    text = bench.render([row], 2.0)
    assert f"| {r:.3f} |" in text and "Geometric mean ratio over 1 cases" in text
    assert "- tiny: a test" in text


def test_the_searched_step_says_what_recomputation_adds_to_its_compute():
    """The recompute term: the plan's compute less the same plan's with every operator
    keeping its outputs (zero where nothing is recomputed), flat and pipelined alike."""
    case = bench.Case("tiny", "gpt", "tiny", MESH, 16)
    topo, _, g, costs, factor = bench._setup(case)
    flat = baselines.megatron_3d(g, topo, tp=4, pp=1, recompute="full")
    piped = baselines.megatron_3d(g, topo, tp=4, pp=2, recompute="full")
    for full in (flat, piped):
        none = bench.searched(g, topo, dataclasses.replace(full, recompute=()), costs, factor)
        got = bench.searched(g, topo, full, costs, factor)
        assert none.recompute_s == 0.0
        assert got.recompute_s > 0.0
        assert got.compute_s - got.recompute_s == pytest.approx(none.compute_s, rel=1e-12)


def test_the_table_reports_the_geometric_mean_and_the_cases_that_fit_nothing():
    def row(case, hand, found):
        return {"case": case, "gpus": 8, "batch": 16, "note": "",
                "hand": {"name": "h", "step_s": hand, "applied_s": hand, "memory": 1e9,
                         "fits": True}
                if hand else None,
                "least_memory": {"name": "least", "step_s": 1.0, "memory": 9e10, "fits": False},
                "searched": {"step_s": found, "memory": 1e9, "fits": True, "compute_s": 1.0,
                             "exposed_comm_s": 0.1, "bubble": 0.0, "proposals": 10,
                             "best_from": "x", "words": {
                                 "stages": "1", "mesh": "data=8", "microbatches": "1",
                                 "recompute": "none", "zero": "none", "optimizer": "none"}},
                "search_s": 1.0}

    rows = [row("a", 2.0, 1.0), row("b", 1.0, 1.0), row("c", None, 1.0)]
    text = bench.render(rows, 60)
    assert f"Geometric mean ratio over 2 cases: {math.sqrt(2):.3f}" in text
    assert "cases at 1.25x or more: 1; below 1.00: 0" in text
    assert "- c: nothing in the hand grid fits; least memory least at 90.0 GB" in text


def test_a_fixed_proposal_count_gives_the_same_plan_whatever_the_machine():
    """``--proposals N --search-only``: the search alone, its chains counting proposals instead
    of seconds, so two runs give the same plan (a machine twice as fast or slow too)."""
    case = bench.Case("tiny", "gpt", "tiny", MESH, 16)
    rows = [bench.run_case(case, 60.0, lambda _: None, proposals=10, grid=False)
            for _ in range(2)]
    assert "hand" not in rows[0] and rows[0]["searched"]["fits"]
    assert rows[0]["searched"]["step_s"] == rows[1]["searched"]["step_s"]
    assert rows[0]["searched"]["words"] == rows[1]["searched"]["words"]


def test_a_search_only_run_keeps_the_hand_grids_columns_of_its_json():
    """``--search-only --json rows.json``: a case's searched plan replaced, its hand grid (and
    every other case) kept; without --search-only the whole row replaced."""
    old = {"case": "a", "hand": {"step_s": 2.0}, "grid_s": 9.0, "search_s": 5.0,
           "searched": {"step_s": 2.5}}
    other = {"case": "b", "hand": None, "search_s": 1.0, "error": "none fits"}
    new = {"case": "a", "gpus": 8, "search_s": 6.0, "searched": {"step_s": 1.9}}
    rows = bench.updated([old, other], new, search_only=True)
    assert rows == [other, {"case": "a", "hand": {"step_s": 2.0}, "grid_s": 9.0, "gpus": 8,
                            "search_s": 6.0, "searched": {"step_s": 1.9}}]
    assert bench.ratio({**rows[1], "searched": {"step_s": 1.6, "fits": True}}) == 1.25
    failed = {"case": "b", "search_s": 2.0, "error": "still none"}
    assert bench.updated(rows, failed, search_only=True)[-1] == {"case": "b", "hand": None,
                                                                 **failed}
    assert bench.updated(rows, new, search_only=False) == [other, new]


def test_hand_extra_scores_only_the_points_added_and_keeps_the_faster():
    """`run_extra` (``--hand-extra``): only the "mlp" points (Megatron-Core's MLP-only
    recomputation, MaxText's save_dot_except_mlp), without stages, scored and taken where
    faster than the row's; the row's other columns untouched."""
    case = bench.Case("tiny", "gpt", "tiny", MESH, 16)
    slow = {"name": "earlier", "step_s": 1e9, "memory": 0.0, "fits": True, "applied_s": 1e9}
    row = {"case": "tiny", "grid_points": 10, "hand": dict(slow), "megatron": dict(slow),
           "maxtext": None, "searched": {"step_s": 1.0}}
    messages = []
    out = bench.run_extra(case, row, messages.append)
    assert out["searched"] == row["searched"] and row["hand"] == slow  # a new row
    assert out["megatron"]["name"].endswith("-mlp") and out["maxtext"]["name"].endswith(" mlp")
    assert out["hand"]["step_s"] == min(out["megatron"]["step_s"], out["maxtext"]["step_s"])
    assert out["hand"]["applied_s"] == out["hand"]["step_s"]
    added = int(messages[0].split(": ")[1].split()[0])
    assert out["grid_points"] == 10 + added and added > 0
    topo, _, g, _, _ = bench._setup(case)
    extra = bench.megatron_points(g, topo, extra_only=True)
    assert extra and all(name.endswith("-mlp") and s.stages == 1 for name, s in extra.items())
