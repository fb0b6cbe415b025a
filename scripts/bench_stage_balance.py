"""Uneven pipeline stages: what `soapjax.search.stages.balance_stages` gains where the head weighs.

A pipeline's last stage runs the final norm, the head and the loss after its layers; with a
large vocabulary that is worth a layer or more (Llama 3: 128,256 tokens, the head about one
of its 8B layers at 8K tokens, two at 2K, where attention weighs less), so with equal stages
the last is the slowest and every other waits on it each microbatch. Megatron-LM lets a
person cut the stages unevenly (``--decoder-last-pipeline-num-layers``); soapjax's search
walks the boundaries (`balance_stages`) and apply runs what it finds
(`soapjax.apply._pipeline_layout.stage_router`).

For each case (the zoo's ``llama`` at Llama 3 8B's and Llama 2 7B's shapes, GPT 175B), on the
case's cluster, analytic costs (the topology's GPU kernel model) and the ideal resharding
model: Megatron's 3D configuration at each pipeline depth (`soapjax.strategy.baselines.megatron_3d`:
TP 8 with sequence parallelism, 1F1B, microbatches of one sequence, selective recomputation)
with equal stages, then the same with the boundaries `balance_stages` finds; the step, each
stage's layers, what the move costs (the layers a stage runs but another keeps, sent every
step, `PipelinedSimulation.layout_move_bytes`) and whether it fits.

Usage::

    .venv/bin/python scripts/bench_stage_balance.py [--json rows.json]
        [--out docs/stage-balance.md]

About a minute on the 2-core development machine (tracing from shapes, a few simulations).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import soapjax_zoo  # noqa: E402
from soapjax.cost.operators import cost_model  # noqa: E402
from soapjax.cost.reshard import Resharder  # noqa: E402
from soapjax.graph.opgraph import trace  # noqa: E402
from soapjax.search import balance_stages  # noqa: E402
from soapjax.simulate.front import opt_state_factor  # noqa: E402
from soapjax.simulate.pipesim import PipelinedSimulation  # noqa: E402
from soapjax.strategy.baselines import megatron_3d  # noqa: E402
from soapjax.strategy.space import MeshShape  # noqa: E402
from soapjax.topology.cluster import load_topology, scaled_topology, stage_topology  # noqa: E402
from soapjax_zoo import llama  # noqa: E402

# Llama 3 8B's shapes (the zoo's long-context size with XLA's attention, as the 8K tokens a
# sequence Llama 3 was trained at and the 2K a short-sequence step runs)
LLAMA3_8B = dataclasses.replace(llama.LONG_CONTEXT_SIZES["8b-32k"], attention="xla")
# (name, workload maker, cluster, pipeline depths)
CASES = [
    ("Llama 3 8B, 2K tokens, batch 256", lambda: llama.build_llama(
        "llama", "3-8b-2k", dataclasses.replace(LLAMA3_8B, seq_len=2048, batch_size=256),
        "linen"), ("dgx-h100x1024", 64), (2, 4, 8)),
    ("Llama 3 8B, 8K tokens, batch 64", lambda: llama.build_llama(
        "llama", "3-8b-8k", dataclasses.replace(LLAMA3_8B, seq_len=8192, batch_size=64),
        "linen"), ("dgx-h100x1024", 64), (2, 4, 8)),
    ("Llama 2 7B, 4K tokens, batch 64", lambda: soapjax_zoo.get("llama", "7b", batch_size=64),
     ("dgx-h100x1024", 64), (2, 4, 8)),
    ("GPT 175B, 2K tokens, batch 64", lambda: soapjax_zoo.get("gpt", "175b", batch_size=64),
     ("dgx-a100x3072", 64), (8,)),
]


def run(name, make, cluster, depths, lines: list[str]) -> list[dict]:
    w = make()
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    topo = scaled_topology(load_topology(cluster[0]), cluster[1])
    costs = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    rows = []
    for pp in depths:
        s = megatron_3d(g, topo, tp=8, pp=pp, microbatch_size=1, recompute="selective",
                        sequence_parallel=True)
        with Resharder(MeshShape.of(stage_topology(topo, pp)), mode="ideal") as rs:
            sim = PipelinedSimulation(g, topo, costs, rs, s, opt_state_factor=factor)
            even = sim.result()
            t0 = time.perf_counter()
            t, strategy, _ = balance_stages(sim, (even.step_time_s, sim.strategy, "megatron"))
            walk_s = time.perf_counter() - t0
            r = sim.result()
            rows.append({
                "case": name, "gpus": topo.num_devices, "pp": pp, "microbatches": s.microbatches,
                "even_s": even.step_time_s, "even_fits": even.fits_in_memory,
                "even_bubble": even.bubble_fraction,
                "stage_layers": list(strategy.stage_layers), "uneven_s": t,
                "uneven_fits": r.fits_in_memory, "uneven_bubble": r.bubble_fraction,
                "move_bytes": sum(sim.layout_move_bytes()), "move_s": r.layout_move_s[0],
                "peak_even_gb": even.peak_memory_bytes / 1e9,
                "peak_uneven_gb": r.peak_memory_bytes / 1e9, "walk_s": walk_s})
            row = rows[-1]
            lines.append(
                f"| {name} | {row['gpus']} | PP{pp} M={row['microbatches']} | "
                f"{row['even_s']:.3f} | "
                f"{'/'.join(map(str, row['stage_layers'])) or 'equal'} | {t:.3f} | "
                f"{(t / row['even_s'] - 1) * 100:+.1f} % | {row['move_bytes'] / 1e6:.0f} MB, "
                f"{row['move_s'] * 1e3:.1f} ms | {row['peak_even_gb']:.1f} / "
                f"{row['peak_uneven_gb']:.1f} | {walk_s:.2f} |")
            print(lines[-1], flush=True)
    return rows


HEADER = ("| case | GPUs | pipeline | equal stages (s) | layers per stage | uneven (s) | change "
          "| moved each way per device | peak GB equal / uneven | walk (s) |\n"
          "|---|---:|---|---:|---|---:|---:|---|---|---:|")


def render(lines: list[str]) -> str:
    doc = (__doc__ or "").split("\n\nUsage::")[0].split("\n\n", 1)
    return "\n\n".join([
        "# Uneven pipeline stages", "Generated by `scripts/bench_stage_balance.py`. "
        + " ".join(doc[1].split()), HEADER + "\n" + "\n".join(lines),
        "A stage walks one layer at a time; where the head weighs a layer or less, moving a "
        "layer off the last stage only makes another the slowest, and what the move costs "
        "(the sends and the padded copy) keeps equal stages. Search times are wall clock on the "
        "2-core development machine."]) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--out", help="write the page here (docs/stage-balance.md)")
    args = p.parse_args()
    print(HEADER)
    lines: list[str] = []
    rows = [r for case in CASES for r in run(*case, lines)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out).write_text(render(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
