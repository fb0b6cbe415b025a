"""GPT at the sizes that need pipeline stages: searched plans against Megatron's 3D grid,
written to docs/pipelines.md (issue "Large models II").

For each case (GPT 175B on 64 A100s at batch 64, 530B on 280 at batch 280, 1T on 512 at batch
512, after Megatron-LM's Table 1 cluster sizes, one sequence per GPU), on `dgx-a100x3072` cut
to N GPUs, analytic costs: the topology's GPU kernel model (its ``[device.kernels]`` table,
`soapjax.cost.kernels`; for the A100 fitted to Megatron-LM's Table 1, docs/accuracy.md) and NCCL at
the links' achieved bandwidth (`cost_words` says which, in the doc):

* the searched plan (`soapjax.find_plan` with ``SearchSettings(pipelines=True)``, fixed
  proposals per chain, seed 0): TP / PP / virtual stages / DP / M / recompute, step time,
  model TFLOP/s per GPU, memory of the fullest stage, the pipeline bubble;
* the best point of Megatron's 3D grid that fits (`baselines.megatron_grid` with PP in
  `search.stage_choices`, every interleave the layers allow (`search.interleave_choices`), TP
  1 to 8 (`search.PIPELINE_GRID`), microbatches of 1, 2, 4, 8 ... samples and the whole
  per-replica batch (`baselines.microbatch_sizes`), recompute none / selective / full: the
  points of `search.pipeline_grid`), simulated by
  the same `PipelinedSimulation`: the search scores the same grid and starts from its best, so
  it is never slower;
* the search time.

Usage: ``python scripts/bench_pipeline.py [--proposals 30] [--out docs/pipelines.md]``;
``--speed --proposals 20`` times the search for GPT 175B on 1024 A100s and a full simulation
of its plan instead (issue "Large models II"'s speed goals).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
from _decoder_metrics import matmul_degrees, model_flops  # noqa: E402

import soapjax_zoo  # noqa: E402
from soapjax.base.errors import PlanError  # noqa: E402
from soapjax.cost.operators import cost_model  # noqa: E402
from soapjax.cost.reshard import Resharder  # noqa: E402
from soapjax.graph.opgraph import trace  # noqa: E402
from soapjax.search import (  # noqa: E402
    SearchSettings,
    find_plan,
    pipeline_grid,
    stage_choices,
)
from soapjax.simulate.front import opt_state_factor  # noqa: E402
from soapjax.simulate.pipesim import PipelinedSimulation  # noqa: E402
from soapjax.strategy.space import MeshShape  # noqa: E402
from soapjax.topology.cluster import load_topology, scaled_topology, stage_topology  # noqa: E402

CASES = [("175b", 64, 64), ("530b", 280, 280), ("1t", 512, 512)]


def describe(graph, strategy, mesh: MeshShape, n: int) -> str:
    """TP / PP / v / DP / M / recompute of a strategy, in words. Without stages, DP is read from
    the matmuls' sample splits (a batch that does not divide the GPUs leaves some replicated)."""
    t, dp, note = matmul_degrees(graph, strategy, mesh)
    pp, v = strategy.stages, strategy.virtual_stages
    rec = sorted({p for p in strategy.recompute if p != "none"}) or ["none"]
    if pp > 1:  # the stages' data axes split the batch
        dp = n // (t * pp)
    words = [f"TP{t}", f"PP{pp}"] + ([f"v{v}"] if v > 1 else []) + [
        f"DP{dp}", note, f"M={strategy.microbatches}", strategy.schedule if pp > 1 else "",
        "recompute " + "+".join(rec)]
    if strategy.zero_axes:
        words.append(f"FSDP{mesh.degree(strategy.zero_axes)}")
    optimizer_axes = getattr(strategy, "optimizer_axes", ())  # Megatron's distributed optimizer
    if optimizer_axes:
        words.append(f"DistOpt{mesh.degree(optimizer_axes)}")
    return " ".join(w for w in words if w)


def cost_words(mesh: str = "dgx-a100x3072") -> str:
    """How the analytic costs on topology `mesh` price a step, in words for the docs' headers:
    the GPU kernel model where the topology file has a ``[device.kernels]`` table, else the
    roofline at 100 % of the datasheet's peaks (a lower bound on time)."""
    topo = load_topology(mesh)
    k = topo.device.kernels
    if k is None:
        return (f"analytic roofline costs at 100 % of `{mesh}`'s datasheet peaks (no kernel "
                "table: times are lower bounds, TFLOP/s upper bounds); ideal resharding model")
    contention = (f", compute beside a running collective at 1 / {1 + k.overlap_slowdown:g} of "
                  "its rate" if k.overlap_slowdown else "")
    return (f"analytic costs from `soapjax/topology/meshes/{mesh}.toml`'s GPU kernel model "
            "(`soapjax.cost.kernels`: "
            f"each matmul a GEMM of {k.tile[0]} x {k.tile[1]} tiles in waves of {k.sms} SMs at "
            f"{k.gemm_efficiency:g} of peak, the rest fused into memory-bound kernels at "
            f"{k.memory_efficiency:g} of the HBM bandwidth, {k.launch * 1e6:g} us a kernel"
            f"{contention}; {k.source}; docs/accuracy.md), collectives at the links' NCCL "
            "bandwidth (0.8 of line rate); ideal resharding model")


def grid_best(graph, topo, costs, factor):
    """(strategy, result) of the fastest fitting point of Megatron's 3D grid."""
    best = None
    grid = {point.name: s for S in stage_choices(graph, topo)
            for points in pipeline_grid(graph, topo, S).values() for point, s in points.items()}
    for name, s in grid.items():
        with Resharder(MeshShape.of(stage_topology(topo, s.stages)), mode="ideal") as rs:
            r = PipelinedSimulation(graph, topo, costs, rs, s, opt_state_factor=factor).result()
        if r.fits_in_memory and (best is None or r.step_time_s < best[1].step_time_s):
            best = (s, r, name)
    return best, len(grid)


def run_case(size: str, n: int, batch: int, proposals: int, model: str = "gpt",
             mesh: str = "dgx-a100x3072") -> dict:
    """A zoo decoder (`model` "gpt" or "llama", at `size`) on the first `n` devices of `mesh`:
    the best point of Megatron's 3D grid and the plan the search finds with stages."""
    topo = scaled_topology(load_topology(mesh), n)
    w = soapjax_zoo.get(model, size, batch_size=batch)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(w.abstract_params()))
    flops, _ = model_flops(model, size, batch, params)
    costs = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    row = {"model": f"{model} {size}", "gpus": n, "batch": batch, "params": params}
    t0 = time.perf_counter()
    best, points = grid_best(g, topo, costs, factor)
    row["grid_s"], row["grid_points"] = time.perf_counter() - t0, points
    mesh = MeshShape.of(topo)
    if best:
        row["megatron"] = {"config": describe(g, best[0], mesh, n), "name": best[2],
                           "step_s": best[1].step_time_s,
                           "model_tflops": flops / best[1].step_time_s / n / 1e12}
    t0 = time.perf_counter()
    try:
        plan = find_plan(g, topo, settings=SearchSettings(max_proposals=proposals, seed=0,
                                                          pipelines=True),
                         costs=costs, optimizer=w.optimizer, family=w.family, model_config=size)
    except PlanError as e:
        row["search_s"], row["error"] = time.perf_counter() - t0, str(e)[:200]
        return row
    row["search_s"] = time.perf_counter() - t0
    s = plan.strategy(g, topo)
    p = dict(plan.predicted)
    row["plan"] = {"words": describe(g, s, mesh, n), "step_s": plan.step_time_s,
                   "memory": max(p["peak_memory_bytes"]), "fits": p["fits_in_memory"],
                   "bubble": dict(p.get("pipeline", ())).get("bubble_fraction", 0.0),
                   "model_tflops": flops / plan.step_time_s / n / 1e12,
                   "from": dict(plan.search)["best_from"]}
    return row


def speed(proposals: int, repeats: int) -> dict:
    """Issue "Large models II"'s speed goals: the search for GPT 175B on 1024 A100s (batch
    1536) and a full simulation of its plan, in this process's CPU time (one core: the search
    and the simulator run on one thread; CPU time is what other jobs on a busy machine disturb
    least). A full simulation builds its `PipelinedSimulation` from scratch (task graph,
    timing, schedule, memory), the way the search scores a new start; the graph's
    config-independent structure (`OpGraph.memo`) and the pricing caches are warm, as in a
    search. Reported: the median and best of `repeats`."""
    n, batch = 1024, 1536
    topo = scaled_topology(load_topology("dgx-a100x3072"), n)
    w = soapjax_zoo.get("gpt", "175b", batch_size=batch)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    costs = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    t0 = time.process_time()
    plan = find_plan(g, topo, settings=SearchSettings(max_proposals=proposals, seed=0,
                                                      pipelines=True),
                     costs=costs, optimizer=w.optimizer, family=w.family, model_config="175b")
    search_s = time.process_time() - t0
    s = plan.strategy(g, topo)
    times = []
    with Resharder(MeshShape.of(stage_topology(topo, s.stages)), mode="ideal") as rs:
        for _ in range(repeats + 1):  # the first warms the pricing caches
            t0 = time.process_time()
            r = PipelinedSimulation(g, topo, costs, rs, s, opt_state_factor=factor).result()
            times.append(time.process_time() - t0)
    times = sorted(times[1:])
    return {"case": f"gpt 175b x{n} batch {batch}", "operators": len(g.operators),
            "proposals_per_chain": proposals, "search_cpu_s": search_s,
            "plan": describe(g, s, MeshShape.of(topo), n), "step_s": r.step_time_s,
            "full_simulation_ms_median": 1e3 * times[len(times) // 2],
            "full_simulation_ms_best": 1e3 * times[0]}


def render(rows: list[dict], proposals: int) -> str:
    lines = [
        "# Pipelines: GPT 175B, 530B and 1T on A100 clusters",
        "",
        f"Generated by `scripts/bench_pipeline.py --proposals {proposals}` ({cost_words()}). "
        "One 2048-token sequence per GPU, GPT with Megatron's dropout (0.1). The pipelined step is "
        "simulated by `soapjax.simulate.pipesim`: one stage's SPMD timeline cut into chunks, "
        "timed by the schedule (`soapjax.strategy.pipeline.time_schedule`), with the "
        "stage-to-stage sends and each stage's gradient synchronisation.",
        "",
        "Megatron 3D grid: PP over the stage counts that divide the layers and the node count, "
        "every interleave whose chunks cut the layers equally, TP 1 to 8 inside a node "
        "(sequence parallel), DP over the rest, microbatches of 1, 2, 4, 8 ... or all "
        "per-replica samples, recompute none / selective (Megatron's: the attention core, "
        "scores to attention over values, recomputed) / full. "
        "The search scores the same grid and chains from its best point, so it is never "
        "slower; where it is equal, its chains found nothing faster within the proposals.",
        "",
        "| model | GPUs | batch | searched plan | step (s) | model TFLOP/s/GPU | bubble | "
        "memory/GPU (GB) | best Megatron 3D | Megatron step (s) | grid points | search (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.get("megatron")
        mega = (m["config"], f"{m['step_s']:.3f}") if m else ("none fits", "-")
        if "plan" not in r:
            lines.append(f"| {r['model']} | {r['gpus']} | {r['batch']} | no plan fits: "
                         f"{r.get('error', '')} | - | - | - | - | {mega[0]} | {mega[1]} | "
                         f"{r['grid_points']} | {r['search_s']:.0f} |")
            continue
        p = r["plan"]
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['batch']} | {p['words']} | {p['step_s']:.3f} | "
            f"{p['model_tflops']:.0f} | {p['bubble']:.3f} | {p['memory'] / 1e9:.1f} | "
            f"{mega[0]} | {mega[1]} | {r['grid_points']} | {r['search_s']:.0f} |")
    lines += [
        "",
        "Search times are wall clock on the machine that made the table (the 2-core development "
        "machine, usually shared with another job). What the pipelined simulation leaves out "
        "is in `soapjax/simulate/pipesim.py`'s module docstring: stage boundaries are searched "
        "at one virtual stage only (`search.balance_stages`), the embedding SPMD "
        "over every device as apply runs it (not a choice), sends on their own links. Under "
        "the interleaved schedule each step moves the stacked layer parameters from the "
        "model's layout apply keeps them in to the chunks' and their gradients back "
        "(all-to-alls over the stages), and holds the chunks' copy: both priced.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--proposals", type=int, default=30, help="proposals per search chain")
    p.add_argument("--out", default=str(ROOT / "docs" / "pipelines.md"))
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    p.add_argument("--only", default=None, help="one size (175b, 530b or 1t)")
    p.add_argument("--speed", action="store_true",
                   help="instead of the table: search time for GPT 175B on 1024 A100s and the "
                   "time of a full simulation of its plan (JSON on stdout)")
    p.add_argument("--repeats", type=int, default=20, help="full simulations timed (--speed)")
    args = p.parse_args()
    if args.speed:
        print(json.dumps(speed(args.proposals, args.repeats), indent=1), flush=True)
        return 0
    rows = []
    for size, n, batch in CASES:
        if args.only and size != args.only:
            continue
        t0 = time.perf_counter()
        rows.append(run_case(size, n, batch, args.proposals))
        print(f"gpt {size} x{n}: {time.perf_counter() - t0:.0f} s "
              f"{json.dumps(rows[-1].get('plan'), default=str)}", flush=True)
        Path(args.out).write_text(render(rows, args.proposals))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
