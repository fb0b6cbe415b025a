"""Long-context training on H100 clusters: the searched plan beside the hand configurations a
person would try, written to docs/long-context.md (issue 32, item 5).

For each case (the zoo's ``llama`` at Llama 3's shapes: 8B at 128K tokens on `dgx-h100x8` and
on `h100x64`, 70B at 32K on `h100x64`, and 8B at 32K on `dgx-h100x8`; 1M tokens a step: 8
sequences of 128K or 32 of 32K), with analytic costs (the topology's GPU kernel model,
`[device.kernels]`; attention is `soapjax.base.attention.flash_attention`, one operator priced as a
flash kernel that keeps nothing ``s x s``) and the ideal resharding model:

* the hand grid: `soapjax.strategy.baselines.megatron_3d` over TP in {1, 2, 4, 8} (sequence parallel
  when TP > 1), CP in {1, 2, 4, 8} (queries local, keys and values all-gathered: where the
  sequence divides and mesh axes outside TP make it), PP in {1, 2, 4, 8} where the layers and
  the outermost mesh axis divide (1F1B), microbatch sizes 1 and 2 sequences, recompute none
  / selective / full (and without stages Megatron-Core's ``--recompute-modules mlp
  layernorm``, ``mlp``: `_searched_row.attention_kept`), with and without Megatron's
  distributed optimizer. Each point is
  simulated by `soapjax.simulate.front.simulate`; the fastest that fits in 80 GB is the best hand
  configuration;
* the search: `soapjax.find_plan` with a time budget (``--budget``, default 100 s; seed 0),
  pipelined plans included as the hand grid has them (``SearchSettings(pipelines=True)``;
  ``--no-pipelines``: without stages only);
* the table: step time, memory per GPU, context-parallel traffic (the bytes each GPU sends in
  the all-gathers of the keys and values into attention and in their cotangents'
  reduce-scatters: the simulator's reshard tasks ``attn/k -> .../attn`` and
  ``attn/v -> .../attn``, forward and backward), search time, best hand / searched.

Where nothing fits, the case reports the point of least memory and what its peak is made of
(`SimResult.memory`), with the bytes of one layer's ``s x s`` probabilities on one GPU where
the attention keeps them (XLA's attention, ``attention="xla"``; none with flash attention).

Usage::

    .venv/bin/python scripts/bench_long_context.py [--cases 8b-128k-8,8b-32k-8] [--budget 100]
        [--no-pipelines] [--json rows.json] [--render-only] [--out docs/long-context.md]

``--json`` keeps the rows of earlier runs (a case run again replaces its row), so the cases can
run one at a time and ``--render-only --json rows.json --out docs/long-context.md`` writes the
page from all of them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import _searched_row
from _searched_row import search_into, strategy_words

import soapjax_zoo
from soapjax.cost.operators import cost_model
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.simulate.front import SimResult, opt_state_factor, simulate
from soapjax.strategy.space import MeshShape, Strategy
from soapjax.topology.cluster import load_topology, stage_topology


class Case(NamedTuple):
    size: str  # the zoo's llama config
    mesh: str
    batch: int | None = None  # sequences per step; None: the config's


CASES = {
    "8b-128k-8": Case("8b-128k", "dgx-h100x8"),
    "8b-128k-64": Case("8b-128k", "h100x64"),
    "70b-32k-64": Case("70b-32k", "h100x64"),
    "8b-32k-8": Case("8b-32k", "dgx-h100x8"),
}
GRID = {"tp": (1, 2, 4, 8), "cp": (1, 2, 4, 8), "pp": (1, 2, 4, 8), "mb": (1, 2)}
SCORES = "layers_0/attn/dot_general"  # XLA's attention: q k^T, mask and softmax, [B, N, T, S]


class Point(NamedTuple):
    """One simulated configuration."""

    name: str
    step_s: float
    memory: float  # peak bytes per GPU (a pipeline's fullest stage)
    fits: bool
    kv_bytes: float  # bytes each GPU sends gathering keys and values (and their cotangents)
    breakdown: dict  # `SimResult.memory`, bytes
    scores: float  # bytes of one layer's s x s probabilities on one GPU (one microbatch)


def kv_gather_bytes(r: SimResult) -> float:
    """Bytes each device sends moving the keys and values into attention (flash attention's
    operator ``.../attn``, or XLA's two matmuls ``.../attn/dot_general*``), and their
    cotangents back, over the step: context parallelism's all-gathers."""
    return sum(t.sent for t in r.tasks if t.kind in ("reshard", "reshard_backward")
               and ("/attn/k -> " in t.name or "/attn/v -> " in t.name)
               and ("/attn/dot_general" in t.name or t.name.rstrip(")").split(" -> ")[1]
                    .split(" ")[0].endswith("/attn")))


def scores_bytes(g: OpGraph, topo, strategy: Strategy) -> float:
    """Bytes of the first layer's attention probabilities ``[B, N, T, S]`` on one device: its
    shard under the strategy's split, at microbatch size (0: flash attention keeps none)."""
    mesh = MeshShape.of(stage_topology(topo, strategy.stages) if strategy.stages > 1 else topo)
    j = next((i for i, op in enumerate(g.operators) if op.name == SCORES), None)
    if j is None:
        return 0.0
    op, c = g.operators[j], strategy.configs[j]
    shard = [n / mesh.degree(a) for n, a in zip(op.shape, c.axes)]
    return math.prod(shard) / strategy.microbatches * jnp.dtype(op.dtype).itemsize


def point(name: str, g: OpGraph, topo, strategy: Strategy, costs, factor: float) -> Point:
    r = simulate(g, topo, strategy, cost_model=costs, resharder="ideal", opt_state_factor=factor)
    return Point(name, r.step_time_s, max(r.peak_memory_bytes), r.fits_in_memory,
                 kv_gather_bytes(r), r.memory._asdict(), scores_bytes(g, topo, strategy))


def megatron_points(g: OpGraph, topo, grid: dict = GRID) -> dict[str, Strategy]:
    """The Megatron-LM configurations of `grid` that `megatron_3d` can build, by name (each
    with and without the distributed optimizer, ``do``)."""
    return _searched_row.megatron_points(g, topo, grid, "tp{tp} cp{cp} pp{pp} mb{mb} {rec}")


def describe(g: OpGraph, strategy: Strategy, topo) -> dict[str, str]:
    """Which mesh axes the first layer's attention and MLP dims take, in words."""
    words = {}
    for op, c in zip(g.operators, strategy.configs):
        part = op.name.split("layers_0/", 1)[1] if op.name.startswith("layers_0/") else ""
        if part in ("attn/q", "attn/k", "attn", "attn/dot_general", "attn/dot_general_1",
                    "mlp/gate"):
            words[part] = ", ".join(f"d{k}({n}):{'x'.join(a)}" for k, (n, a) in
                                    enumerate(zip(op.iteration_sizes, c.axes)) if a) \
                or "replicated"
    words.update(strategy_words(strategy, topo, g))
    return words


def run_case(key: str, case: Case, budget: float, pipelines: bool | None, grid: dict = GRID,
             progress=None, proposals: int | None = None) -> dict:
    topo = load_topology(case.mesh)
    w = soapjax_zoo.get("llama", case.size, batch_size=case.batch)
    t0 = time.perf_counter()
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    tokens = next(leaf for leaf in g.batch if leaf.path == "['inputs']").shape
    row: dict = {"case": key, "size": case.size, "mesh": case.mesh, "gpus": topo.num_devices,
                 "batch": tokens[0], "seq_len": tokens[1], "description": w.description,
                 "trace_s": time.perf_counter() - t0,
                 "memory_capacity": topo.device.memory_bytes}
    costs = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    t0 = time.perf_counter()
    row["grid"] = [point(name, g, topo, s, costs, factor)._asdict()
                   for name, s in megatron_points(g, topo, grid).items()]
    row["grid_s"] = time.perf_counter() - t0
    return search_into(row, g, topo, w, case.size, costs, budget, pipelines,
                       lambda s: point("searched", g, topo, s, costs, factor), describe,
                       progress, proposals)


def best_hand(row: dict) -> dict | None:
    """The fastest grid point that fits, or None."""
    fits = [p for p in row["grid"] if p["fits"]]
    return min(fits, key=lambda p: p["step_s"]) if fits else None


def least_memory(row: dict) -> dict:
    """The grid point of least memory per GPU (the fastest of those)."""
    return min(row["grid"], key=lambda p: (p["memory"], p["step_s"]))


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _breakdown(p: dict) -> str:
    m = p["breakdown"]
    scores = (f" (of which one layer's s x s probabilities: {_gb(p['scores'])})"
              if p["scores"] else "")
    return (f"parameters {_gb(m['params'])}, gradients {_gb(m['grads'])}, optimizer state "
            f"{_gb(m['opt_state'])}, activations {_gb(m['activations'])}{scores}, "
            f"communication buffers {_gb(m['comm_buffers'])} GB")


def render(rows: list[dict], args) -> str:
    lines = [
        "# Long context: searched plans against hand configurations",
        "",
        f"Generated by `scripts/bench_long_context.py --budget {args.budget:g}"
        + ("" if args.pipelines else " --no-pipelines")
        + (f" --proposals {args.proposals}" if getattr(args, "proposals", None) else "")
        + "` (analytic costs: the topology's GPU "
        "kernel model, attention one flash kernel (`soapjax.base.attention.flash_attention`: "
        "nothing s x s in memory) at `attention_efficiency` "
        f"{load_topology('dgx-h100x8').device.kernels.attention_efficiency:g} of peak (what "
        "soapjax's own flash attention reached on an H100, docs/accuracy.md); ideal resharding "
        "model; seed 0). Llama 3 shapes (`soapjax_zoo.llama`: "
        "vocabulary 128256, 8 key/value heads, bf16 compute over float32 parameters, AdamW), "
        "1M tokens a step: 8 sequences of 128K or 32 of 32K. Hand grid: Megatron-LM "
        "(`baselines.megatron_3d`) over TP 1/2/4/8 (sequence parallel when > 1), CP 1/2/4/8, "
        "PP 1/2/4/8, microbatch sizes 1/2, recompute none/selective/full (and without stages "
        "Megatron-Core's `--recompute-modules mlp layernorm`, \"mlp\": the attention block "
        "kept, the rest of each layer recomputed), with and without "
        "the distributed optimizer, where the mesh, the sequence and the layers allow. "
        "CP traffic: the bytes each GPU sends gathering the keys and values into attention "
        "(and reduce-scattering their cotangents) in one step. Memory: the peak per GPU (a "
        "pipeline's fullest stage), of 80 GB.",
        "",
        "| model | GPUs | best hand (step s, GB, CP GB) | searched plan: step (s) | "
        "memory/GPU (GB) | CP traffic (GB) | search (s) | best hand / searched |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h = best_hand(r)
        cell = (f"{h['name']} ({h['step_s']:.1f}, {_gb(h['memory'])}, {_gb(h['kv_bytes'])})"
                if h else f"none of {len(r['grid'])} fits")
        s = r.get("searched")
        label = f"{r['size']} ({r['batch']} x {r['seq_len']})"
        if s is None:
            lines.append(f"| {label} | {r['gpus']} | {cell} | {r.get('error', '-')} | - | - "
                         f"| {r['search_s']:.0f} | - |")
            continue
        ratio = f"{h['step_s'] / s['step_s']:.2f}x" if h and s["fits"] else "-"
        lines.append(f"| {label} | {r['gpus']} | {cell} | {s['step_s']:.1f}"
                     + ("" if s["fits"] else " (does not fit)")
                     + f" | {_gb(s['memory'])} | {_gb(s['kv_bytes'])} | {r['search_s']:.0f} | "
                     f"{ratio} |")
    for r in rows:
        lines += ["", f"### {r['size']} on {r['mesh']} ({r['gpus']} GPUs)", ""]
        if best_hand(r) is None:
            p = least_memory(r)
            lines += [f"Nothing of the hand grid fits ({len(r['grid'])} points, simulated in "
                      f"{r['grid_s']:.0f} s). The point of least memory, `{p['name']}`, needs "
                      f"{_gb(p['memory'])} GB per GPU of {_gb(r['memory_capacity'])}: "
                      f"{_breakdown(p)}.", ""]
        if "searched" in r:
            s, w = r["searched"], r["searched"]["words"]
            lines += [f"Searched plan ({s['proposals']} proposals, from `{s['best_from']}`): "
                      f"{s['step_s']:.1f} s, {_gb(s['memory'])} GB per GPU: {_breakdown(s)}. "
                      f"Mesh {w['mesh']}; microbatches {w['microbatches']}, recompute "
                      f"{w['recompute']}, ZeRO over {w['zero']}, optimizer state over "
                      f"{w['optimizer']}, stages {w['stages']}. Layer 0's operators, each "
                      "iteration dim that is split (dK(size): axes):", ""]
            lines += [f"- `{k}`: {v}" for k, v in w.items() if k.startswith(("attn", "mlp"))]
        else:
            lines += [f"The search found no plan in {r['search_s']:.0f} s: {r.get('error')}"]
        fits = sorted((p for p in r["grid"] if p["fits"]), key=lambda p: p["step_s"])[:8]
        if fits:
            lines += ["", f"The fastest hand configurations that fit ({len(fits)} shown of "
                      f"{sum(p['fits'] for p in r['grid'])} that fit, of {len(r['grid'])} "
                      f"points; grid simulated in {r['grid_s']:.0f} s):", "",
                      "| configuration | step (s) | memory/GPU (GB) | activations (GB) | "
                      "CP traffic (GB) |", "|---|---|---|---|---|"]
            lines += [f"| {p['name']} | {p['step_s']:.1f} | {_gb(p['memory'])} | "
                      f"{_gb(p['breakdown']['activations'])} | {_gb(p['kv_bytes'])} |"
                      for p in fits]
    return "\n".join(lines) + "\n"


def _load(path: str | None) -> list[dict]:
    return json.loads(Path(path).read_text()) if path and Path(path).exists() else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--budget", type=float, default=100.0, help="search budget in seconds")
    p.add_argument("--no-pipelines", dest="pipelines", action="store_false",
                   help="search plans without pipeline stages only (the hand grid has them, "
                   "so by default the search does too)")
    p.add_argument("--proposals", type=int, default=None, metavar="N",
                   help="N proposals per search chain, whatever the time (the budget is then "
                        "ignored): the same plans on a busy machine")
    p.add_argument("--out", default=None, help="write the tables here (docs/long-context.md)")
    p.add_argument("--json", default=None,
                   help="keep the rows here, with those of earlier runs")
    p.add_argument("--render-only", action="store_true", help="render the --json rows only")
    args = p.parse_args()
    rows = _load(args.json)
    if not args.render_only:
        for key in args.cases.split(","):
            t0 = time.perf_counter()
            row = run_case(key, CASES[key], args.budget, args.pipelines,
                           proposals=args.proposals)
            rows = [r for r in rows if r["case"] != key] + [row]
            h = best_hand(row)
            print(f"{key}: {time.perf_counter() - t0:.0f} s (grid {row['grid_s']:.0f} s, search "
                  f"{row['search_s']:.0f} s); best hand {h and (h['name'], h['step_s'])}; "
                  f"searched {row.get('searched', {}).get('step_s', row.get('error'))}",
                  flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    order = list(CASES)
    rows.sort(key=lambda r: order.index(r["case"]) if r["case"] in order else len(order))
    text = render(rows, args)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
