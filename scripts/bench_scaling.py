"""GPT and LLaMA at cluster scale: searched plans against Megatron's grid, written to
docs/scaling.md.

For each GPT size (Megatron's shapes, 1.3B .. 1T) on 8 .. 3072 A100s of `dgx-a100x3072`, and
LLaMA 7B / 70B on `h100x64`, with analytic costs (the topologies' GPU kernel model,
`soapjax.cost.kernels`, and NCCL at the links' achieved bandwidth; `bench_pipeline.cost_words`):

* the searched plan (`soapjax.find_plan`, fixed proposals per chain, seed 0) in words: its
  tensor-parallel axes, data-parallel axes, microbatches M, recomputation, FSDP axes;
* its predicted step time, model TFLOP/s per GPU (6 x params x tokens + attention 12 x layers
  x batch x seq^2 x d_model, no recomputation) and hardware TFLOP/s (with the forwards full
  recomputation runs again), and its memory per device;
* the best Megatron configuration of a small grid (`baselines.megatron_3d`: TP in {1, 2, 4, 8},
  microbatch sizes: the powers of two dividing the per-replica batch, and all of it; recompute
  none / selective (Megatron's: the attention core) / full, sequence parallel) that fits, and
  its time;
* the search time.

Rows where no plan without pipeline stages fits in memory say so; those rows are also searched
with stages beside Megatron's 3D grid (bench_pipeline.run_case), in a second table. The whole
table takes a few hours on 2 cores (``--limit-s``, ``--only`` and ``--resume`` split it over
several runs); ``--quick`` a subset in about 2 minutes.

    .venv/bin/python scripts/bench_scaling.py [--quick] [--proposals N] [--out docs/scaling.md]
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

import jax
from _decoder_metrics import matmul_degrees, model_flops
from bench_pipeline import cost_words, run_case as pipelined_run_case

import soapjax_zoo
from soapjax.base.errors import SoapjaxError
from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import Resharder
from soapjax.graph.opgraph import trace
from soapjax.search import SearchSettings, find_plan
from soapjax.simulate.front import Simulation, opt_state_factor
from soapjax.strategy import baselines
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology, scaled_topology
from soapjax_zoo.gpt import GPT_SIZES
from soapjax_zoo.llama import LLAMA_SIZES

A100 = "dgx-a100x3072"
GPUS = (8, 64, 280, 512, 1024, 3072)
# Global batches (sequences of 2048 tokens), after Megatron-LM (Narayanan et al., SC 2021,
# Table 1: 512 up to 18B, growing to 3072 for 1T), rounded to what 8 .. 3072 GPUs divide.
GPT_BATCH = {"1.3b": 512, "2.7b": 512, "6.7b": 512, "13b": 512, "22b": 1024, "175b": 1536,
             "530b": 3072, "1t": 3072}
LLAMA_BATCH = {"7b": 512, "70b": 512}
QUICK = [("gpt", "1.3b", A100, 8), ("gpt", "1.3b", A100, 512), ("gpt", "13b", A100, 64),
         ("gpt", "175b", A100, 1024), ("llama", "7b", "h100x64", 64)]


def cases(quick: bool) -> list[tuple[str, str, str, int]]:
    if quick:
        return QUICK
    out = [("gpt", s, A100, n) for s in GPT_BATCH for n in GPUS]  # not every zoo size
    return out + [("llama", s, "h100x64", 64) for s in LLAMA_SIZES]


def describe(graph, strategy, mesh: MeshShape) -> str:
    """TP / DP / M / recompute / FSDP of a strategy, in words (from its matmuls)."""
    tp, dp, note = matmul_degrees(graph, strategy, mesh)
    rec = sorted({p for p in strategy.recompute if p != "none"}) or ["none"]
    words = [f"TP{tp}", f"DP{dp}", note, f"M={strategy.microbatches}",
             "recompute " + "+".join(rec)]
    if strategy.zero_axes:
        words.append(f"FSDP{mesh.degree(strategy.zero_axes)}")
    optimizer_axes = getattr(strategy, "optimizer_axes", ())  # Megatron's distributed optimizer
    if optimizer_axes:
        words.append(f"DistOpt{mesh.degree(optimizer_axes)}")
    return " ".join(w for w in words if w)


def recompute_share(graph, strategy) -> float:
    """Share of the layers' forward FLOPs that run again (operators under "full")."""
    layer = [op for op in graph.operators if op.block_position]
    if not strategy.recompute or not layer:
        return 0.0
    policy = dict(zip([op.name for op in graph.operators], strategy.recompute))
    return sum(policy[op.name] == "full" for op in layer) / len(layer)


def megatron_grid(graph, topo, costs, resharder, factor):
    """(description, step seconds, memory bytes, strategy) of the fastest fitting point of
    `baselines.megatron_grid` (the grid the search also scores)."""
    best = None
    for name, s in baselines.megatron_grid(graph, topo).items():
        r = Simulation(graph, topo, costs, resharder, s, opt_state_factor=factor).result()
        if r.fits_in_memory and (best is None or r.step_time_s < best[1]):
            # e.g. "megatron-tp8-mb1-selective-do" (-do: the distributed optimizer)
            parts = name.removeprefix("megatron-tp").split("-")
            tp, rec = int(parts[0]), next(p for p in parts if p in ("none", "selective", "full"))
            do = " DistOpt" if parts[-1] == "do" else ""
            best = (f"TP{tp} DP{topo.num_devices // tp} M={s.microbatches} {rec}{do}",
                    r.step_time_s, max(r.peak_memory_bytes), s)
    return best


def state_bytes(model: str, size: str) -> float:
    """The zoo decoder's parameters, gradients and optimizer state in bytes (f32, Adam's two
    moments): a bound no plan gets under, whatever it shards."""
    w = soapjax_zoo.get(model, size, batch_size=1)
    params = w.abstract_params()
    nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    return nbytes * (2 + opt_state_factor(w.optimizer, params))


def needs_stages(row: dict) -> bool:
    """Whether neither the search nor Megatron's grid fits without pipeline stages."""
    return "plan" not in row or not row["plan"]["fits"]


def run_case(model, size, mesh, n, proposals) -> dict:
    batch = (GPT_BATCH if model == "gpt" else LLAMA_BATCH)[size]
    topo = scaled_topology(load_topology(mesh), n)
    row = {"model": f"{model} {size}", "gpus": n, "mesh": topo.name, "batch": batch}
    w = soapjax_zoo.get(model, size, batch_size=batch)
    t0 = time.perf_counter()
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    row["trace_s"] = time.perf_counter() - t0
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(w.abstract_params()))
    flops, layer_forward = model_flops(model, size, batch, params)
    row["params"] = params
    costs = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    mesh_shape = MeshShape.of(topo)
    with Resharder(mesh_shape, mode="ideal") as resharder:
        t0 = time.perf_counter()
        best = megatron_grid(g, topo, costs, resharder, factor)
        row["grid_s"] = time.perf_counter() - t0
        if best:
            row["megatron"] = {"config": best[0], "step_s": best[1], "memory": best[2]}
        t0 = time.perf_counter()
        try:
            plan = find_plan(g, topo, settings=SearchSettings(max_proposals=proposals, seed=0,
                                                           pipelines=False),
                             costs=costs, reshard=resharder, optimizer=w.optimizer,
                             family=w.family, model_config=size)
        except SoapjaxError as e:  # nothing fits without pipeline stages
            row["search_s"] = time.perf_counter() - t0
            row["needs_pipeline"] = str(e).splitlines()[0][:200]
            return row
        row["search_s"] = time.perf_counter() - t0
        s = plan.strategy(g, topo)
        r = Simulation(g, topo, costs, resharder, s, opt_state_factor=factor).result()
    hw = flops + layer_forward * recompute_share(g, s)
    row["plan"] = {"words": describe(g, s, mesh_shape), "step_s": r.step_time_s,
                   "memory": max(r.peak_memory_bytes), "fits": r.fits_in_memory,
                   "model_tflops": flops / r.step_time_s / n / 1e12,
                   "hw_tflops": hw / r.step_time_s / n / 1e12}
    if best:
        row["megatron"]["model_tflops"] = flops / best[1] / n / 1e12
    return row


def render(rows: list[dict], args) -> str:
    lines = [
        "# Scaling: GPT and LLaMA on thousands of GPUs",
        "",
        "Generated by `scripts/bench_scaling.py" + (" --quick" if args.quick else "") +
        f"` (proposals per chain: {args.proposals}). Clusters: `dgx-a100x3072` cut to "
        "N GPUs (`scaled_topology`; 280 = 35 DGX nodes), LLaMA on `h100x64`. "
        "A" + cost_words(A100).removeprefix("a") + "; on `h100x64`, "
        f"{cost_words('h100x64').removeprefix('analytic ')}.",
        "",
        "GPT is the zoo's, with Megatron's dropout (0.1 on the embeddings, attention "
        "probabilities and both residual branches).",
        "",
        "Global batch (sequences): " + ", ".join(f"{k} {v}" for k, v in GPT_BATCH.items()) +
        " (GPT, after Megatron-LM's Table 1); LLaMA 512. Model TFLOP/s per GPU: (6 x params x "
        "tokens + 12 x layers x batch x seq^2 x d_model) / step / GPUs, without recomputation; "
        "hardware TFLOP/s adds the forwards that full recomputation runs again (not the "
        "attention cores that selective recomputation runs again).",
        "",
        ("Plans here have no pipeline stages (the search runs with `pipelines=False`, Megatron's "
         "grid with pp = 1): the table shows how far a plan without stages goes. A row where "
         "neither fits in 80 GB says *needs pipeline stages*; `soapjax plan` then searches "
         "pipelined plans, and the section after the table gives them (more in "
         "[pipelines.md](pipelines.md)). "
         "Megatron grid: TP in {1,2,4,8} inside a node (sequence parallel), DP across, "
         "microbatch size in {1,2,4,...,per-replica batch}, recompute none/selective/full "
         "(selective is Megatron's: the attention core, scores to attention over values, "
         "recomputed)."),
        "",
        ("Where the global batch is no multiple of the GPU count (512 sequences on 280 or 3072 "
         "GPUs), no plan can give every GPU its own samples: the plans there replicate work over "
         "the node axis and Megatron's grid (DP x TP = GPUs) has no point at all. Those rows "
         "show what such a batch costs, not how soapjax scales."),
        "",
        ("| model | GPUs | searched plan | step (s) | model TFLOP/s/GPU | hw TFLOP/s/GPU | "
         "memory/GPU (GB) | best Megatron | Megatron step (s) | search (s) |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.get("megatron")
        mega = (m["config"], f"{m['step_s']:.3f}") if m else ("none fits", "-")
        if "plan" not in r:
            lines.append(f"| {r['model']} | {r['gpus']} | needs pipeline stages | - | - | - | "
                         f"- | {mega[0]} | {mega[1]} | {r['search_s']:.0f} |")
            continue
        p = r["plan"]
        fit = "" if p["fits"] else " (does not fit: needs pipeline stages)"
        lines.append(
            f"| {r['model']} | {r['gpus']} | {p['words']}{fit} | {p['step_s']:.3f} | "
            f"{p['model_tflops']:.0f} | {p['hw_tflops']:.0f} | {p['memory'] / 1e9:.1f} | "
            f"{mega[0]} | {mega[1]} | {r['search_s']:.0f} |")
    staged = [r for r in rows if "pipelined" in r]
    if staged:
        lines += [
            "", "## Rows that need pipeline stages", "",
            f"Searched with pipeline stages (`SearchSettings(pipelines=True)`, "
            f"{args.pipeline_proposals} proposals per chain) beside the fastest fitting point "
            "of Megatron's 3D grid (PP over the stage counts that divide the layers and the "
            "nodes, every interleave the layers allow, TP 1 to 8, microbatch sizes and "
            "recompute as above), "
            "both simulated by `soapjax.simulate.pipesim`, as in [pipelines.md](pipelines.md). "
            "Memory is the fullest stage's.",
            "",
            "| model | GPUs | batch | searched plan | step (s) | model TFLOP/s/GPU | bubble | "
            "memory/GPU (GB) | best Megatron 3D | Megatron step (s) | search (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in staged:
            q = r["pipelined"]
            m = q.get("megatron")
            mega = (m["config"], f"{m['step_s']:.3f}") if m else ("none fits", "-")
            if "plan" not in q:
                why = q.get("error", "").splitlines()[0] if q.get("error") else ""
                if why.startswith("no strategy"):
                    why += stage_counts_note(r)
                lines.append(f"| {r['model']} | {r['gpus']} | {q['batch']} | no plan fits "
                             f"({why}) | - | - | - | - | {mega[0]} | {mega[1]} | "
                             f"{q['search_s']:.0f} |")
                continue
            p = q["plan"]
            fit = "" if p["fits"] else " (does not fit)"
            lines.append(
                f"| {r['model']} | {r['gpus']} | {q['batch']} | {p['words']}{fit} | "
                f"{p['step_s']:.3f} | {p['model_tflops']:.0f} | {p['bubble']:.3f} | "
                f"{p['memory'] / 1e9:.1f} | {mega[0]} | {mega[1]} | {q['search_s']:.0f} |")
        missed = [r for r in staged if "plan" in r["pipelined"]
                  and " PP1 " in r["pipelined"]["plan"]["words"]]
        if missed:
            lines += ["", "A *PP1* plan above has no stages: the pipelined search also runs the "
                      "chains without them, and there one found a plan that fits, which the "
                      f"search of the first table ({args.proposals} proposals per chain, "
                      "`pipelines=False`) missed: " + ", ".join(
                          f"{r['model']} on {r['gpus']}" for r in missed) + ". A search-quality "
                      "miss of the flat chains on batches that do not divide the GPUs, not a "
                      "simulator difference: the flat `Simulation` of that plan gives the same "
                      "step."]
    if args.missing:
        lines += ["", "Not run (time): " + ", ".join(args.missing) + "."]
    return "\n".join(lines) + "\n"


def stage_counts_note(row: dict) -> str:
    """Why a GPT row's pipelined search had little to try: the stage counts (> 1) that divide
    both its nodes (8 GPUs each) and its layers (`soapjax.search.pipelines.stage_choices`)."""
    model, size = row["model"].split()
    if row["gpus"] % 8:
        return ""
    nodes = row["gpus"] // 8
    layers = (GPT_SIZES if model == "gpt" else LLAMA_SIZES)[size].num_layers
    counts = [S for S in range(2, nodes + 1) if nodes % S == 0 and layers % S == 0]
    if not counts:
        return f"; no stage count divides both its {nodes} nodes and {layers} layers"
    return f"; stage counts tried: {', '.join(map(str, counts))}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a subset (about 2 minutes)")
    p.add_argument("--proposals", type=int, default=200, help="proposals per search chain")
    p.add_argument("--out", default=str(ROOT / "docs" / "scaling.md"))
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    p.add_argument("--limit-s", type=float, default=float("inf"),
                   help="stop starting new rows after this many seconds (default: no limit)")
    p.add_argument("--only", default=None, help="comma-separated rows to run, e.g. 'gpt 1t,"
                   "llama 7b' (every GPU count) or 'gpt 22b x64'")
    p.add_argument("--pipeline-proposals", type=int, default=20, metavar="N",
                   help="for rows that need pipeline stages, also search pipelined plans "
                   "(N proposals per chain) and Megatron's 3D grid, as bench_pipeline.py does; "
                   "0 leaves them out")
    p.add_argument("--resume", default=None, metavar="ROWS.json",
                   help="rows of an earlier run (its --json file): kept, and not run again")
    args = p.parse_args()
    rows, start, args.missing = [], time.perf_counter(), []
    done = {}
    if args.resume:
        rows = json.loads(Path(args.resume).read_text())
        done = {(r["model"], r["gpus"]): r for r in rows}
    wanted = [w.strip() for w in args.only.split(",")] if args.only else None
    for model, size, mesh, n in cases(args.quick):
        if wanted and f"{model} {size}" not in wanted and f"{model} {size} x{n}" not in wanted:
            continue
        row = done.get((f"{model} {size}", n))
        if row is not None and not (args.pipeline_proposals and needs_stages(row)
                                    and "pipelined" not in row):
            continue
        if time.perf_counter() - start > args.limit_s:
            args.missing.append(f"{model} {size} on {n}")
            continue
        t0 = time.perf_counter()
        if row is None:
            try:
                row = run_case(model, size, mesh, n, args.proposals)
            except SoapjaxError as e:
                row = {"model": f"{model} {size}", "gpus": n, "search_s": 0.0,
                       "needs_pipeline": str(e)[:200]}
            rows.append(row)
        if args.pipeline_proposals and needs_stages(row):
            state = state_bytes(model, size)
            device = load_topology(mesh).device.memory_bytes
            batch = row.get("batch", (GPT_BATCH if model == "gpt" else LLAMA_BATCH)[size])
            if state / n > device:  # no plan of any kind fits: do not search
                row["pipelined"] = {
                    "batch": batch, "search_s": 0.0,
                    "error": f"parameters, gradients and Adam state alone are "
                             f"{state / n / 1e9:.0f} GB per GPU"}
            else:
                row["pipelined"] = pipelined_run_case(size, n, batch, args.pipeline_proposals,
                                                      model=model, mesh=mesh)
        print(f"{model} {size} x{n}: {time.perf_counter() - t0:.1f} s "
              f"{json.dumps(row.get('plan', row.get('needs_pipeline')), default=str)}"
              + (f" pipelined: {json.dumps(row['pipelined'].get('plan'), default=str)}"
                 if "pipelined" in row else ""), flush=True)
        Path(args.out).write_text(render(rows, args))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    order = {(f"{m} {z}", n): k for k, (m, z, _, n) in enumerate(cases(False))}
    rows.sort(key=lambda r: order.get((r["model"], r["gpus"]), len(order)))
    Path(args.out).write_text(render(rows, args))  # with the rows the time limit left out
    return 0


if __name__ == "__main__":
    sys.exit(main())
