"""Mixture-of-experts models on H100 clusters: the searched plan beside the hand configurations
a person would try, written to docs/moe.md (issue 32, item 5).

For each case (the zoo's ``moe``: Mixtral 8x7B on `h100x64`, Mixtral 8x22B on `dgx-h100x32`
and on 256 H100s (`dgx-h100x1024` cut to 32 nodes), the fine-grained MoE on `h100x64`;
capacity-factor dispatch, GShard's einsums), with analytic
costs (the topology's GPU kernel model, `[device.kernels]`) and the ideal resharding model:

* the hand grid: `soapjax.strategy.baselines.megatron_3d` over TP in {1, 2, 4, 8} (sequence parallel
  when TP > 1), EP in {1, 2, 4, 8} (carved out of data parallelism, as Megatron-Core does), PP
  in {1, 2, 4} where the layers and the node axis divide (1F1B, no virtual stages), microbatch
  sizes 1, 2 and 4 samples, recompute none / selective (the attention core alone, as Megatron
  runs it: `_searched_row.megatron_selective`) / full (and without stages
  Megatron-Core's ``--recompute-modules mlp layernorm``, ``mlp``), with and without Megatron's
  distributed optimizer (the optimizer state sharded over the data-parallel axes), its
  pipelined points priced as Megatron runs them (``layer_layout="chunks"``: each stage's
  layers where its chunks run them, the load-balancing statistics per rank and the gradients
  reduced once a step, where `soapjax.apply`'s exact stages reduce them at every backward:
  `soapjax.simulate.pipesim`, module doc, 3); and
  MaxText's rules
  (`baselines.maxtext_moe`: FSDP over every axis, the experts over the in-node axes, or over
  the node axis) with 1, 2 or 4 microbatches and the same recomputations. Each point is
  simulated by `soapjax.simulate.front.simulate`; the fastest that fits in 80 GB is the best hand
  configuration;
* the search: `soapjax.find_plan` with a time budget (``--budget``, default 90 s; seed 0;
  pipelined plans too with ``--pipelines``, as ``soapjax plan --pipelines``), its step time,
  memory per GPU, all-to-all bytes, search time, and which mesh axes its experts, attention and
  batch take;
* the ratio: best hand step time / searched step time.

All-to-all bytes are what each GPU sends in all-to-alls over one step (the simulator's
reshard tasks of that kind, forward and backward; a pipelined plan's fullest stage).

Batch: 256 sequences of 4096 tokens (about 1M tokens a step), as Megatron-LM's Mixtral 8x7B
example trains (examples/mixtral: TP 2, PP 4, EP 8, global batch 256, sequence 4096).

Usage::

    .venv/bin/python scripts/bench_moe.py [--cases mixtral-8x7b] [--budget 90] [--pipelines]
        [--out docs/moe.md] [--json rows.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import _searched_row
from _searched_row import attention_kept, search_into, strategy_words

import soapjax_zoo
from soapjax.base.errors import PlanError
from soapjax.cost.operators import cost_model
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.simulate.front import SimResult, opt_state_factor, simulate
from soapjax.strategy import baselines
from soapjax.strategy.memory import check_microbatches
from soapjax.strategy.space import RECOMPUTE_POLICIES, MeshShape, Strategy
from soapjax.topology.cluster import load_topology


class Case(NamedTuple):
    size: str  # the zoo's moe config
    mesh: str
    batch: int  # sequences of the config's length


CASES = {
    "mixtral-8x7b": Case("mixtral-8x7b", "h100x64", 256),
    "mixtral-8x22b": Case("mixtral-8x22b", "dgx-h100x32", 256),
    "mixtral-8x22b-256": Case("mixtral-8x22b", "dgx-h100x1024-256", 256),
    "fine-grained": Case("fine-grained", "h100x64", 256),
}
GRID = {"tp": (1, 2, 4, 8), "ep": (1, 2, 4, 8), "pp": (1, 2, 4), "mb": (1, 2, 4)}
MAXTEXT_MICROBATCHES = (1, 2, 4)


class Point(NamedTuple):
    """One simulated configuration."""

    name: str
    step_s: float
    memory: float  # peak bytes per GPU (a pipeline's fullest stage)
    fits: bool
    all_to_all: float  # bytes each GPU sends in all-to-alls per step


def all_to_all_bytes(r: SimResult) -> float:
    """Bytes each device sends in all-to-all collectives over the step."""
    return sum(t.sent for t in r.tasks if t.name.startswith("all_to_all"))


def point(name: str, g: OpGraph, topo, strategy: Strategy, costs, factor: float,
          layer_layout: str = "model") -> Point:
    """`strategy` simulated as `soapjax.apply` runs it, or with ``layer_layout="chunks"`` as
    Megatron-LM runs a pipeline (`soapjax.simulate.pipesim`)."""
    r = simulate(g, topo, strategy, cost_model=costs, resharder="ideal", opt_state_factor=factor,
                 layer_layout=layer_layout)
    return Point(name, r.step_time_s, max(r.peak_memory_bytes), r.fits_in_memory,
                 all_to_all_bytes(r))


def megatron_points(g: OpGraph, topo, grid: dict = GRID) -> dict[str, Strategy]:
    """The Megatron-LM configurations of `grid` that `megatron_3d` can build, by name (each
    with and without the distributed optimizer, ``do``)."""
    return _searched_row.megatron_points(g, topo, grid,
                                         "megatron tp{tp} ep{ep} pp{pp} mb{mb} {rec}")


def maxtext_points(g: OpGraph, topo, microbatches=MAXTEXT_MICROBATCHES) -> dict[str, Strategy]:
    """MaxText's rules (`baselines.maxtext_moe`) with the experts over the in-node axes (the
    registered 'maxtext-moe') or over the outermost axis, by microbatches and recomputation
    (``mlp``: MaxText's ``save_dot_except_mlp``, `_searched_row.attention_kept`)."""
    mesh = MeshShape.of(topo)
    intra = baselines.intra_node_axes(topo) or tuple(mesh.axis_names[-1:])
    outer = tuple(a for a in mesh.axis_names if a not in intra)
    out = {}
    for where, axes in (("in-node", intra), ("across nodes", outer)):
        try:
            base = baselines.maxtext_moe(g, mesh, baselines.expert_parallel_axes(g, mesh, axes))
        except PlanError:
            continue
        ep = mesh.degree(baselines.expert_parallel_axes(g, mesh, axes))
        for m, rec in itertools.product(microbatches, RECOMPUTE_POLICIES + ("mlp",)):
            try:
                check_microbatches(g, base.configs, mesh, m)
            except PlanError:
                continue
            micro = dataclasses.replace(base, microbatches=m)
            out[f"maxtext-moe ep{ep} {where} M={m} {rec}"] = (
                attention_kept(g, micro) if rec == "mlp" else
                baselines.with_recompute(g, micro, rec))
    return out


def describe(g: OpGraph, strategy: Strategy, topo) -> dict[str, str]:
    """Which mesh axes the first layer's experts, attention and router take, in words."""
    words = {}
    for op, c in zip(g.operators, strategy.configs):
        if "layers_0/" not in op.name:
            continue
        part = op.name.split("layers_0/", 1)[1]
        if part in ("attn/q", "attn/dot_general", "moe/experts/gate", "moe/experts/down",
                    "moe/router", "moe/dot_general_3"):
            words[part] = ", ".join(
                f"{d}:{'x'.join(a)}" for d, a in zip(_dim_names(op), c.axes) if a) or "replicated"
    words.update(strategy_words(strategy, topo, g))
    return words


def _dim_names(op) -> list[str]:
    return [f"d{k}({n})" for k, n in enumerate(op.iteration_sizes)]


def run_case(case: Case, budget: float, pipelines: bool | None, grid: dict = GRID,
             progress=None, proposals: int | None = None) -> dict:
    topo = load_topology(case.mesh)
    w = soapjax_zoo.get("moe", case.size, batch_size=case.batch)
    t0 = time.perf_counter()
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    row: dict = {"size": case.size, "mesh": case.mesh, "gpus": topo.num_devices,
                 "batch": case.batch, "description": w.description,
                 "trace_s": time.perf_counter() - t0}
    costs = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    t0 = time.perf_counter()
    megatron = megatron_points(g, topo, grid)
    points = [point(name, g, topo, s, costs, factor,
                    "chunks" if name in megatron and s.stages > 1 else "model")
              for name, s in (megatron | maxtext_points(g, topo)).items()]
    row["grid_s"] = time.perf_counter() - t0
    row["grid"] = [p._asdict() for p in points]
    return search_into(row, g, topo, w, case.size, costs, budget, pipelines,
                       lambda s: point("searched", g, topo, s, costs, factor), describe,
                       progress, proposals)


def best_hand(row: dict, prefix: str = "") -> dict | None:
    fits = [p for p in row["grid"] if p["fits"] and p["name"].startswith(prefix)]
    return min(fits, key=lambda p: p["step_s"]) if fits else None


def render(rows: list[dict], args) -> str:
    lines = [
        "# Mixture of experts: searched plans against hand configurations",
        "",
        f"Generated by `scripts/bench_moe.py --budget {args.budget:g}"
        + (" --pipelines" if args.pipelines else "")
        + (f" --proposals {args.proposals}" if getattr(args, "proposals", None) else "")
        + "` (analytic costs: the topology's GPU "
        "kernel model; ideal resharding model; seed 0). Batch: 256 sequences of 4096 tokens, as "
        "Megatron-LM's Mixtral 8x7B example (TP 2, PP 4, EP 8, global batch 256). All-to-all: "
        "the bytes each GPU sends in all-to-alls in one step. Memory: the peak per GPU (a "
        "pipeline's fullest stage), of 80 GB.",
        "",
        "| model | GPUs | best Megatron (step s, GB, all-to-all GB) | best MaxText | searched "
        "plan: step (s) | memory/GPU (GB) | all-to-all (GB) | search (s) | best hand / searched |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hand = [best_hand(r, "megatron"), best_hand(r, "maxtext")]
        cells = [f"{h['name']} ({h['step_s']:.2f}, {h['memory'] / 1e9:.0f}, "
                 f"{h['all_to_all'] / 1e9:.0f})" if h else "none fits" for h in hand]
        s = r.get("searched")
        if s is None:
            lines.append(f"| {r['size']} | {r['gpus']} | {cells[0]} | {cells[1]} | "
                         f"{r.get('error', '-')} | - | - | {r['search_s']:.0f} | - |")
            continue
        best = min((h["step_s"] for h in hand if h), default=None)
        ratio = f"{best / s['step_s']:.2f}x" if best else "-"
        lines.append(f"| {r['size']} | {r['gpus']} | {cells[0]} | {cells[1]} | "
                     f"{s['step_s']:.2f} | {s['memory'] / 1e9:.0f} | "
                     f"{s['all_to_all'] / 1e9:.0f} | {r['search_s']:.0f} | {ratio} |")
    for r in rows:
        if "searched" not in r:
            continue
        w = r["searched"]["words"]
        lines += ["", f"### {r['size']} on {r['mesh']}: the searched plan", "",
                  f"Mesh {w['mesh']}; started from `{r['searched']['best_from']}`, "
                  f"{r['searched']['proposals']} proposals; microbatches {w['microbatches']}, "
                  f"recompute {w['recompute']}, ZeRO over {w['zero']}, stages {w['stages']}. "
                  "Layer 0's operators, each iteration dim that is split (dK(size): axes):", ""]
        lines += [f"- `{k}`: {v}" for k, v in w.items() if "/" in k]
        fits = sorted((p for p in r["grid"] if p["fits"]), key=lambda p: p["step_s"])[:8]
        lines += ["", "The fastest hand configurations that fit "
                  f"({sum(p['fits'] for p in r['grid'])} of {len(r['grid'])} points; "
                  f"grid simulated in {r['grid_s']:.0f} s):", "",
                  "| configuration | step (s) | memory/GPU (GB) | all-to-all (GB) |",
                  "|---|---|---|---|"]
        lines += [f"| {p['name']} | {p['step_s']:.2f} | {p['memory'] / 1e9:.0f} | "
                  f"{p['all_to_all'] / 1e9:.0f} |" for p in fits]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="mixtral-8x7b",
                   help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--budget", type=float, default=90.0, help="search budget in seconds")
    p.add_argument("--pipelines", action="store_true", help="search pipelined plans too")
    p.add_argument("--proposals", type=int, default=None, metavar="N",
                   help="N proposals per search chain, whatever the time (the budget is then "
                        "ignored): the same plans on a busy machine")
    p.add_argument("--out", default=None, help="write the tables here (e.g. docs/moe.md)")
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    args = p.parse_args()
    rows = []
    for name in args.cases.split(","):
        t0 = time.perf_counter()
        rows.append(run_case(CASES[name], args.budget, True if args.pipelines else False,
                             proposals=args.proposals))
        r = rows[-1]
        print(f"{name}: {time.perf_counter() - t0:.0f} s; best hand "
              f"{best_hand(r)}; searched {r.get('searched', r.get('error'))}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    text = render(rows, args)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
