"""The searched plan against the best hand configuration of each case's expert grid, in one
table (issue 46, "A search that finds what experts miss").

For each case (`CASES`: Llama 2 70B on 64 H100s at batch 128 x 4096 beside MaxText's FSDP
recipe; GPT 18.4B, 145.6B, 529.6B and 1T on the GPU counts and batches of Narayanan et al.'s
Table 1; GPT 175B on 64 A100s at batch 64, and on 48, 96 and 32 A100s; Llama 3 8B and 70B
on 64 H100s at 8K tokens; Mixtral 8x7B on 64 H100s and 8x22B on 256; Llama 3 8B at 128K on
8 H100s), analytic costs (the topology's GPU kernel model and NCCL at the links' achieved
bandwidth) and the ideal resharding model:

* **the hand grid**: Megatron-LM's configurations with every option it has
  (`baselines.megatron_grid`: TP 1-8 with sequence parallelism, PP over the stage counts
  `search.stage_choices` gives and every interleave whose chunks cut the layers equally, the
  expert- and context-parallel degrees of `search.grid_degrees`, microbatches of 1 to 8
  samples (`MAX_MICROBATCH`),
  recompute none / selective (as Megatron runs it on a mixture-of-experts layer: the
  attention core alone, `_searched_row.megatron_selective`) / full, and without pipeline
  stages Megatron-Core's
  ``--recompute-modules mlp layernorm``, ``mlp``: `_searched_row.attention_kept`; with and
  without the distributed optimizer), priced with
  their stacked layers where Megatron keeps them (``layer_layout="chunks"``: the chunks' own
  layout, no moves; and again as `soapjax.apply` runs the same configuration: "as applied");
  MaxText-style rules (`baselines.fsdp`, and `baselines.maxtext_moe` for
  mixtures of experts) with 1, 2, 4 or 8 microbatches and each recomputation (``mlp``:
  MaxText's ``save_dot_except_mlp``). The best hand
  configuration is the fastest that fits in the GPU's memory;
* **the search**: `soapjax.find_plan` (seed 0, ``--budget`` seconds, default 60; pipelined
  plans included), its plan priced as `soapjax.apply` runs it;
* **the ratio**: best hand step time / searched step time (above 1: the search wins), and
  the searched step's terms: a device's compute (with recomputation; a pipelined plan's
  stage: its whole-batch work over the stages), the part of it recomputation adds (the same
  plan's compute with every operator keeping its outputs, subtracted), the pipeline bubble
  (of the schedule's time), a device's exposed communication.

Usage::

    .venv/bin/python scripts/bench_vs_experts.py [--cases gpt-175b-64,llama2-70b-64]
        [--budget 60] [--json rows.json] [--out docs/vs-experts.md]

``--json`` keeps the rows of earlier runs (a case run again replaces its row; with
``--search-only``, only its searched plan), so the cases can run one at a time, and a change to
the search alone is measured without scoring the hand grids again (minutes a case); rescore
them when the simulator's prices change. ``--hand-extra --json rows.json`` scores only the
hand points added to the grids since those rows were made (Megatron-Core's MLP-only
recomputation, ``mlp``) and keeps the faster hand configuration. ``--render-only --json
rows.json`` prints (and with ``--out`` writes) the table from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _searched_row import (  # noqa: E402
    attention_kept,
    megatron_selective,
    search_into,
    strategy_words,
)

import soapjax_zoo  # noqa: E402
from soapjax.base.errors import PlanError  # noqa: E402
from soapjax.cost.operators import cost_model  # noqa: E402
from soapjax.graph.opgraph import OpGraph, trace  # noqa: E402
from soapjax.search import stage_choices  # noqa: E402
from soapjax.search.grids import grid_degrees  # noqa: E402
from soapjax.search.pipelines import interleave_choices  # noqa: E402
from soapjax.simulate.front import open_simulation, opt_state_factor  # noqa: E402
from soapjax.strategy import baselines  # noqa: E402
from soapjax.strategy.memory import check_microbatches  # noqa: E402
from soapjax.strategy.space import RECOMPUTE_POLICIES, MeshShape, Strategy  # noqa: E402
from soapjax.topology.cluster import load_topology, scaled_topology  # noqa: E402

A100 = "dgx-a100x3072"


class Case(NamedTuple):
    """One row: a zoo model (`model`, `size`) at `batch` sequences on `mesh`, cut to its
    first `gpus` devices (None: all of it)."""

    key: str
    model: str
    size: str
    mesh: str
    batch: int
    gpus: int | None = None
    note: str = ""


CASES = (
    Case("llama2-70b-64", "llama", "70b", "h100x64", 128,
         note="MaxText's recipe: FSDP 8 x 8, 2 sequences per GPU, full remat"),
    Case("gpt-18.4b-256", "gpt", "18.4b", A100, 1024, 256, "Table 1: TP8, DP32"),
    Case("gpt-145.6b-1536", "gpt", "145.6b", A100, 2304, 1536, "Table 1: TP8 PP8 v2"),
    Case("gpt-530b-2520", "gpt", "530b", A100, 2520, 2520, "Table 1: TP8 PP35 v3"),
    Case("gpt-1t-3072", "gpt", "1t", A100, 3072, 3072, "Table 1: TP8 PP64"),
    Case("gpt-175b-64", "gpt", "175b", A100, 64, 64),
    Case("llama3-8b-8k-64", "llama", "8b-8k", "h100x64", 128),
    Case("llama3-70b-8k-64", "llama", "70b-8k", "h100x64", 128),
    Case("mixtral-8x7b-64", "moe", "mixtral-8x7b", "h100x64", 256),
    Case("mixtral-8x22b-256", "moe", "mixtral-8x22b", "dgx-h100x1024-256", 256),
    Case("llama3-8b-128k-8", "llama", "8b-128k", "dgx-h100x8", 8),
    Case("gpt-175b-48", "gpt", "175b", A100, 96, 48, "a count Megatron's grid divides badly"),
    Case("gpt-175b-96", "gpt", "175b", A100, 96, 96, "a count Megatron's grid divides badly"),
    Case("gpt-175b-32", "gpt", "175b", A100, 32, 32, "memory-tight"),
)
MICROBATCHES = (1, 2, 4, 8)  # MaxText-style rules: gradient accumulation steps
# Megatron's microbatch sizes at most this many samples (its published runs of these models
# use 1 to 8; larger ones only add points: a full simulation each, about 0.25 s for GPT 175B)
MAX_MICROBATCH = 8


class Point(NamedTuple):
    """One simulated configuration."""

    name: str
    step_s: float
    memory: float  # peak bytes per GPU (a pipeline's fullest stage)
    fits: bool


def megatron_points(g: OpGraph, topo, max_microbatch: int = MAX_MICROBATCH,
                    extra_only: bool = False) -> dict[str, Strategy]:
    """Megatron-LM's grid with every option (module doc), microbatches of at most
    `max_microbatch` samples, by name; each point without stages recomputed in full also as
    Megatron-Core's MLP and norms recomputed (`attention_kept`, ``...-mlp``; with pipeline
    stages apply runs one policy for a chunk, so those are not priced). `extra_only`: those
    alone."""
    degrees = grid_degrees(g, topo)
    grids = [baselines.megatron_grid_points(g, topo, **degrees)]
    for S in stage_choices(g, topo):
        grids.append(baselines.megatron_grid_points(
            g, topo, pp=(S,), interleave=interleave_choices(g, S), **degrees))
    points = {p.name: megatron_selective(g, s) if p.recompute == "selective" else s
              for grid in grids for p, s in grid.items() if p.mb <= max_microbatch}
    extra = {name[:-len("full")] + "mlp": attention_kept(g, s) for name, s in points.items()
             if not s.pipelined and name.endswith("-full")}
    return extra if extra_only else points | extra


def maxtext_points(g: OpGraph, topo, extra_only: bool = False) -> dict[str, Strategy]:
    """MaxText-style rules: FSDP over every axis (dense), or `baselines.maxtext_moe` with the
    experts over the in-node axes or over the rest, with `MICROBATCHES` and each
    recomputation (and ``save_dot_except_mlp``, `attention_kept`: ``mlp``), by name.
    `extra_only`: the ``mlp`` points alone."""
    mesh = MeshShape.of(topo)
    bases = {"fsdp": baselines.fsdp(g, mesh)}
    if grid_degrees(g, topo)["ep"] != (1,):
        intra = baselines.intra_node_axes(topo) or tuple(mesh.axis_names[-1:])
        outer = tuple(a for a in mesh.axis_names if a not in intra)
        for where, axes in (("in-node", intra), ("across nodes", outer)):
            try:
                bases[f"maxtext-moe {where}"] = baselines.maxtext_moe(
                    g, mesh, baselines.expert_parallel_axes(g, mesh, axes))
            except PlanError:
                continue
    out = {}
    for (name, base), m, rec in itertools.product(bases.items(), MICROBATCHES,
                                                  RECOMPUTE_POLICIES + ("mlp",)):
        if extra_only and rec != "mlp":
            continue
        try:
            check_microbatches(g, base.configs, mesh, m)
        except PlanError:
            continue
        micro = dataclasses.replace(base, microbatches=m)
        out[f"{name} M={m} {rec}"] = (attention_kept(g, micro) if rec == "mlp" else
                                      baselines.with_recompute(g, micro, rec))
    return out


def score(g: OpGraph, topo, points: Mapping[str, Strategy], costs, factor: float,
          layer_layout: str, progress: Callable[[str], None] = lambda _: None) -> list[Point]:
    """Each strategy of `points` simulated, one simulation per pipeline shape (its strategies
    proposed in turn and rejected, as the search scores its grid)."""
    by_pipeline: dict[tuple, list[tuple[str, Strategy]]] = {}
    for name, s in points.items():
        by_pipeline.setdefault(s.pipeline, []).append((name, s))
    out = []
    for k, group in enumerate(by_pipeline.values()):
        progress(f"  scoring pipeline shape {k + 1}/{len(by_pipeline)} ({len(group)} points)")
        with open_simulation(g, topo, group[0][1], cost_model=costs, resharder="ideal",
                             opt_state_factor=factor, layer_layout=layer_layout) as sim:
            for name, s in group:
                step = sim.propose_strategy(s)
                out.append(Point(name, step, float(sim.peak_memory_bytes()),
                                 sim.fits_in_memory()))
                sim.reject()
    return out


def best(points: list[Point], prefix: str = "") -> Point | None:
    fits = [p for p in points if p.fits and p.name.startswith(prefix)]
    return min(fits, key=lambda p: p.step_s) if fits else None


def _setup(case: Case):
    """The case's topology, workload, graph, analytic costs and optimizer-state factor."""
    topo = load_topology(case.mesh)
    if case.gpus is not None and case.gpus != topo.num_devices:
        topo = scaled_topology(topo, case.gpus)
    w = soapjax_zoo.get(case.model, case.size, batch_size=case.batch)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    costs = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    return topo, w, g, costs, opt_state_factor(w.optimizer, w.abstract_params())


def run_extra(case: Case, row: dict, progress: Callable[[str], None]) -> dict:
    """`row`, the case's row of an earlier run, with the hand points added to the grid since
    (`megatron_points` and `maxtext_points` with ``extra_only``: the attention kept where the
    rest is recomputed) scored, and each best (hand, Megatron, MaxText-style) replaced where
    one of them is faster and fits; the search's columns as they were."""
    topo, w, g, costs, factor = _setup(case)
    megatron = megatron_points(g, topo, extra_only=True)
    points = megatron | maxtext_points(g, topo, extra_only=True)
    progress(f"{case.key}: {len(points)} points added to the hand grid")
    grid = score(g, topo, points, costs, factor, "model", progress)
    row = dict(row, grid_points=row.get("grid_points", 0) + len(grid))
    for key, prefix in (("hand", ""), ("megatron", "megatron"), ("maxtext", "")):
        pick = best([p for p in grid if key != "maxtext" or p.name not in megatron], prefix)
        if pick is not None and (row.get(key) is None or pick.step_s < row[key]["step_s"]):
            row[key] = pick._asdict()
            if key == "hand":  # without stages, as soapjax.apply runs it: the same price
                row[key]["applied_s"], row[key]["applied_fits"] = pick.step_s, pick.fits
    return row


def run_case(case: Case, budget: float, progress: Callable[[str], None],
             proposals: int | None = None, grid: bool = True, processes: int | None = 1
             ) -> dict:
    """One row (module doc). `proposals`: a fixed count per chain instead of the time budget
    (the same plan on a faster or slower machine); without `grid`, the search alone;
    `processes`: the search's chains in that many (None: one per core)."""
    topo, w, g, costs, factor = _setup(case)
    row: dict = {"case": case.key, "model": f"{case.model} {case.size}",
                 "gpus": topo.num_devices, "batch": case.batch, "note": case.note}
    if not grid:
        return _search_into(row, case, g, topo, w, costs, factor, budget, proposals, progress,
                            processes)
    t0 = time.perf_counter()
    megatron = megatron_points(g, topo)
    maxtext = maxtext_points(g, topo)
    progress(f"{case.key}: {len(megatron)} Megatron points, {len(maxtext)} MaxText-style")
    grid = (score(g, topo, {k: s for k, s in megatron.items() if s.pipelined}, costs, factor,
                  "chunks", progress)
            + score(g, topo, {k: s for k, s in megatron.items() if not s.pipelined}
                    | maxtext, costs, factor, "model", progress))
    row["grid_s"], row["grid_points"] = time.perf_counter() - t0, len(grid)
    for key, prefix in (("hand", ""), ("megatron", "megatron"), ("maxtext", "")):
        pick = best([p for p in grid if key != "maxtext" or p.name not in megatron], prefix)
        row[key] = pick._asdict() if pick else None
    if row["hand"] is not None:  # the same configuration as soapjax.apply runs it
        applied = score(g, topo, {"hand": (megatron | maxtext)[row["hand"]["name"]]}, costs,
                        factor, "model")[0]
        row["hand"]["applied_s"], row["hand"]["applied_fits"] = applied.step_s, applied.fits
    least = min(grid, key=lambda p: p.memory) if grid else None
    row["least_memory"] = least._asdict() if least else None
    progress(f"{case.key}: best hand {row['hand'] and row['hand']['name']}")
    return _search_into(row, case, g, topo, w, costs, factor, budget, proposals, progress,
                        processes)


class Searched(NamedTuple):
    """The searched plan as apply runs it, and its step's terms (module doc)."""

    step_s: float
    memory: float
    fits: bool
    compute_s: float
    exposed_comm_s: float
    bubble: float
    recompute_s: float


def searched(g: OpGraph, topo, s: Strategy, costs, factor: float) -> Searched:
    def stage_compute(strategy: Strategy) -> tuple[float, float, float, bool, object, object]:
        with open_simulation(g, topo, strategy, cost_model=costs, resharder="ideal",
                             opt_state_factor=factor) as sim:
            r = sim.result()
            stage = sim.stage_result() if strategy.pipelined else r
            return (sim.step_time(), float(sim.peak_memory_bytes()), stage.compute_s,
                    sim.fits_in_memory(), stage, r)

    step, memory, compute, fits, stage, r = stage_compute(s)
    # what recomputation adds: the same plan's compute with every operator keeping its outputs
    kept = stage_compute(dataclasses.replace(s, recompute=()))[2] if s.recompute else compute
    # one stage's whole-batch work, over its stages: what a device computes per step
    per_device = s.stages if s.pipelined else 1
    return Searched(step, memory, fits, compute / per_device, stage.exposed_comm_s / per_device,
                    r.bubble_fraction if s.pipelined else 0.0, (compute - kept) / per_device)


def _search_into(row: dict, case: Case, g: OpGraph, topo, w, costs, factor: float,
                 budget: float, proposals: int | None, progress: Callable[[str], None],
                 processes: int | None = 1) -> dict:
    progress(f"{case.key}: searching ({budget:g} s)" if proposals is None else
             f"{case.key}: searching ({proposals} proposals a chain)")
    return search_into(row, g, topo, w, case.size, costs, budget, True,
                       lambda s: searched(g, topo, s, costs, factor),
                       lambda g, s, t: strategy_words(s, t, g), proposals=proposals,
                       processes=processes)


def updated(rows: list[dict], row: dict, search_only: bool) -> list[dict]:
    """`rows` with `row` in place of its case's row; with `search_only`, the earlier row's
    hand-grid columns kept (a search-only row has none)."""
    before = next((x for x in rows if x["case"] == row["case"]), None)
    if search_only and before is not None:
        row = {k: v for k, v in before.items() if k not in ("search_s", "searched", "error")} | row
    return [x for x in rows if x["case"] != row["case"]] + [row]


def ratio(row: dict) -> float | None:
    if row.get("hand") and row.get("searched") and row["searched"]["fits"]:
        return row["hand"]["step_s"] / row["searched"]["step_s"]
    return None


def _s(p: dict | None) -> str:
    return f"{p['step_s']:.3f}" if p else "none fits"


def _applied(hand: dict | None) -> str:
    if not hand or "applied_s" not in hand:
        return "-"
    return f"{hand['applied_s']:.3f}" + ("" if hand.get("applied_fits", True) else " (over)")


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def render(rows: list[dict], budget: float) -> str:
    lines = [
        "# Searched plans against the experts' grids (issue 46)",
        "",
        "`python scripts/bench_vs_experts.py` (analytic costs, ideal resharding; the search "
        f"seed 0 with a {budget:g} s budget, pipelines included). Hand grid: Megatron-LM with "
        "every option it has, its pipelined points priced with the layers where Megatron keeps "
        "them (a tied embedding's gradient all-reduced between the first and last stage), "
        "its selective recomputation the attention core alone (on a mixture-of-experts layer "
        "too, whose dispatch and combine einsums Megatron's token permutation does not have), "
        "and without stages Megatron-Core's `--recompute-modules mlp layernorm` too "
        "(\"mlp\": the attention block kept, the rest of each layer recomputed); "
        "MaxText-style rules (FSDP; FSDP + experts; `save_dot_except_mlp` as \"mlp\"). "
        "As applied: the same configuration as soapjax.apply runs it (every stage holds "
        "the parameters read outside the layers, their gradients summed over the stages; "
        "\"(over)\": it does not fit then). Both pick the labels' "
        "log-probabilities by an all-reduce over the vocabulary split. "
        "Ratio: best hand / searched step time (above 1: the search wins).",
        "",
        "| case | GPUs | batch | best hand configuration | step (s) | as applied (s) | mem (GB) "
        "| searched plan | step (s) | mem (GB) | ratio | compute / of it recompute / bubble / "
        "exposed comm | "
        "search (s) | proposals |",
        "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    ratios = []
    for row in rows:
        hand, found = row.get("hand"), row.get("searched")
        r = ratio(row)
        if r is not None:
            ratios.append(r)
        if found:
            wd = found["words"]
            plan = (f"stages {wd['stages']}, mesh {wd['mesh']}, M={wd['microbatches']}, "
                    f"recompute {wd['recompute']}, zero {wd['zero']} (from {found['best_from']})")
            recompute = (f"{found['recompute_s']:.2f}" if "recompute_s" in found else "-")
            terms = (f"{found['compute_s']:.2f} / {recompute} / {found['bubble']:.1%} / "
                     f"{found['exposed_comm_s']:.2f}")
            found_cols = [plan, f"{found['step_s']:.3f}", _gb(found["memory"]),
                          f"{r:.3f}" if r is not None else "-", terms,
                          f"{row['search_s']:.0f}", str(found["proposals"])]
        else:
            found_cols = [f"error: {row.get('error', '?')}", "-", "-", "-", "-",
                          f"{row.get('search_s', 0):.0f}", "-"]
        lines.append("| " + " | ".join([
            row["case"], str(row["gpus"]), str(row["batch"]),
            hand["name"] if hand else "none fits", _s(hand),
            _applied(hand),
            _gb(hand["memory"]) if hand else "-", *found_cols]) + " |")
    if ratios:
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        lines += ["", f"Geometric mean ratio over {len(ratios)} cases: {geo:.3f}; "
                  f"cases at 1.25x or more: {sum(x >= 1.25 for x in ratios)}; below 1.00: "
                  f"{sum(x < 1.0 for x in ratios)} ({sum(x < 0.995 for x in ratios)} below "
                  "0.995)."]
    notes = [f"- {row['case']}: {row['note']}" for row in rows if row.get("note")]
    nofit = [f"- {row['case']}: nothing in the hand grid fits; least memory "
             f"{row['least_memory']['name']} at {_gb(row['least_memory']['memory'])} GB"
             for row in rows if not row.get("hand") and row.get("least_memory")]
    return "\n".join(lines + ([""] + notes if notes else []) + ([""] + nofit if nofit else [])
                     ) + "\n"


def _load(path: str | None) -> list[dict]:
    if path and Path(path).exists():
        return json.loads(Path(path).read_text())
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(c.key for c in CASES),
                    help="comma-separated case keys (default: all): "
                    + ", ".join(c.key for c in CASES))
    ap.add_argument("--budget", type=float, default=60.0, help="search seconds per case")
    ap.add_argument("--proposals", type=int,
                    help="a fixed proposal count per chain instead of the budget (the same plan "
                    "on any machine: run N and N/2 to see how much the result depends on it)")
    ap.add_argument("--processes", type=int, default=1,
                    help="processes for each search's chains (default: 1, the issue's one core; "
                    "0: one per core)")
    ap.add_argument("--search-only", action="store_true",
                    help="skip the hand grid (with --proposals: the robustness check); a "
                    "case's hand-grid columns already in --json are kept (score the grid "
                    "again when the simulator's prices changed)")
    ap.add_argument("--hand-extra", action="store_true",
                    help="score only the hand points added since the rows in --json were made "
                    "(Megatron-Core's and MaxText's MLP-only recomputation) and keep the "
                    "faster hand configuration; the search's columns as they were")
    ap.add_argument("--json", help="rows file: read, updated with the cases run, written")
    ap.add_argument("--out", help="also write the table here (markdown)")
    ap.add_argument("--render-only", action="store_true", help="print the table of --json")
    args = ap.parse_args()
    by_key = {c.key: c for c in CASES}
    wanted = [k for k in args.cases.split(",") if k]
    unknown = [k for k in wanted if k not in by_key]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; expected some of {list(by_key)}")
    rows = _load(args.json)
    if not args.render_only:
        def say(msg: str) -> None:
            print(f"[{time.perf_counter() - start:7.0f}s] {msg}", file=sys.stderr, flush=True)

        start = time.perf_counter()
        for key in wanted:
            if args.hand_extra:
                before = next((x for x in rows if x["case"] == key), None)
                if before is None or "grid_points" not in before:
                    ap.error(f"--hand-extra: no hand grid of {key!r} in --json to add to")
                rows = updated(rows, run_extra(by_key[key], before, say), False)
            else:
                rows = updated(rows, run_case(by_key[key], args.budget, say, args.proposals,
                                              not args.search_only, args.processes or None),
                               args.search_only)
            row = rows[-1]
            r = ratio(row)
            say(f"{key}: hand {_s(row.get('hand'))} s, searched "
                f"{_s(row.get('searched'))} s, ratio {r if r is None else round(r, 3)}")
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    order = {c.key: i for i, c in enumerate(CASES)}
    rows.sort(key=lambda x: order.get(x["case"], len(order)))
    text = render(rows, args.budget)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
