"""The zoo table of `soapjax check`: XLA's collective bytes against the simulator's, per plan.

For every zoo model (tiny configs) on the 8 virtual CPU devices of ``cpu8`` (data=2 x model=4),
applies data parallelism, each baseline (Megatron, FSDP, the paper's expert CNN and RNN strategies)
and the searched plan (analytic costs, 300 proposals per chain, seed 0), and runs
`soapjax.check.compare_on_devices` on each: the largest difference from the unsharded step, the
bytes per device of the collectives in the compiled step (a collective inside a loop counted once
per iteration) and the bytes of the simulator's communication tasks (reshardings priced by XLA,
``reshard="xla"``), and the bytes each device sends over the step both ways. Prints a markdown table
with the ratios predicted / XLA; the goal (issue 7) is within 10%.

    python scripts/bench_check.py                    # the whole zoo (~20 min on 2 cores)
    python scripts/bench_check.py --models mlp gpt2 --plans data-parallel searched
    python scripts/bench_check.py --models gpt llama moe --plans pipelined   # issue 47's pipelines
    python scripts/bench_check.py --models gpt llama moe --plans searched-pipelined

``pipelined`` is the zoo's layered models (GPT, LLaMA and the MoE, tiny, with 4 layers where
the interleaved schedule needs them; the MoE's data groups add its load-balancing statistics'
sums across each other) on 2 pipeline stages under Megatron's configuration
(`soapjax.strategy.baselines.megatron_3d`): GPipe, 1F1B, interleaved and ZB-H1, one and several
microbatches, tensor parallelism (with sequence parallelism) inside the stages or data
parallelism (`PIPELINED`).

``searched-pipelined`` is what a user gets from ``soapjax plan --pipelines``: the layered
models searched with stages on ``tests/meshes/cpu8-nodes.toml`` (node=2 x data=2 x model=2,
the stages cutting ``node``), 300 proposals per chain, seeds 0 to 2 (`SEARCH_SEEDS`), each
plan checked on that mesh (a seed whose best plan has no stages is reported as such).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402

import soapjax_zoo as zoo  # noqa: E402
from soapjax.check import compare_on_devices  # noqa: E402
from soapjax.graph.opgraph import trace  # noqa: E402
from soapjax.search import SearchSettings, find_plan  # noqa: E402
from soapjax.strategy import baselines  # noqa: E402
from soapjax.strategy.plan import Plan  # noqa: E402
from soapjax.topology.cluster import load_topology  # noqa: E402
from soapjax_zoo.gpt import GPT_CONFIGS, build_gpt  # noqa: E402
from soapjax_zoo.llama import LLAMA_CONFIGS, build_llama  # noqa: E402
from soapjax_zoo.moe import MOE_CONFIGS, build_moe  # noqa: E402

PLANS = ("data-parallel", "megatron", "fsdp", "expert-cnn", "expert-rnn", "searched",
         "pipelined", "searched-pipelined")
NODES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "meshes",
                     "cpu8-nodes.toml")
SEARCH_SEEDS = (0, 1, 2)

# name -> (layers, megatron_3d's arguments, schedule) of the pipelined plans: 2 stages of
# cpu8's data=2 axis, each stage the model=4 axis; the tiny batch is 8 samples; no
# recomputation unless the arguments say
PIPELINED = {
    "pp2 gpipe tp4 M=1": (2, dict(tp=4, sequence_parallel=True), "gpipe"),
    "pp2 1f1b tp4 M=1": (2, dict(tp=4, sequence_parallel=True), "1f1b"),
    "pp2 1f1b tp4 M=4": (2, dict(tp=4, sequence_parallel=True, microbatch_size=2), "1f1b"),
    "pp2 1f1b dp4 M=1": (2, dict(tp=1, microbatch_size=2), "1f1b"),
    "pp2 gpipe dp4 M=2": (2, dict(tp=1, microbatch_size=1), "gpipe"),
    "pp2 1f1b dp4 M=1 do": (2, dict(tp=1, microbatch_size=2, distributed_optimizer=True),
                            "1f1b"),
    "pp2 interleaved v2 tp4 M=2": (4, dict(tp=4, sequence_parallel=True, microbatch_size=4,
                                           interleave=2), "interleaved"),
    "pp2 zb-h1 tp4 M=4": (2, dict(tp=4, sequence_parallel=True, microbatch_size=2), "zb-h1"),
    "pp2 zb-h1 dp4 M=4": (2, dict(tp=1, microbatch_size=1), "zb-h1"),
    # Megatron's selective recomputation inside the stages (docs/checks.md: the backward
    # gathers the layers' sequence-parallel inputs again, `PipelinedSimulation.regathers`)
    "pp2 1f1b tp4 M=1 selective": (2, dict(tp=4, sequence_parallel=True,
                                           recompute="selective"), "1f1b"),
    # and under a split backward with a lean stash, whose W gathers the operands again
    "pp2 zb-h1 tp4 M=4 selective": (2, dict(tp=4, sequence_parallel=True, microbatch_size=2,
                                            recompute="selective"), "zb-h1"),
}
LAYERED = {"gpt": (GPT_CONFIGS, build_gpt), "llama": (LLAMA_CONFIGS, build_llama),
           "moe": (MOE_CONFIGS, build_moe)}


def pipelined(name, layers):
    """The tiny layered model `name` with `layers` layers: its workload and graph."""
    configs, build = LAYERED[name]
    w = build(name, "tiny", dataclasses.replace(configs["tiny"], num_layers=layers), "linen")
    return w, trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)


def strategies(graph, topo, w, wanted):
    out = {k: v for k, v in baselines.baselines(graph, topo).items() if k in wanted}
    if "searched" in wanted:
        plan = find_plan(graph, topo, costs="analytic", optimizer=w.optimizer,
                         settings=SearchSettings(max_proposals=300, seed=0))
        out["searched"] = plan.strategy(graph, topo)
    return out


def searched_pipelines(graph, w) -> list[tuple]:
    """The plans ``soapjax plan --pipelines`` finds for `graph` on ``cpu8-nodes``, one per seed
    of `SEARCH_SEEDS`, as `main`'s cases."""
    topo = load_topology(NODES)
    out = []
    for seed in SEARCH_SEEDS:
        plan = find_plan(graph, topo, costs="analytic", optimizer=w.optimizer,
                         settings=SearchSettings(max_proposals=300, seed=seed, pipelines=True,
                                                 processes=1))
        s = plan.strategy(graph, topo)
        what = (f"S={s.stages} {s.schedule} M={s.microbatches}" if s.pipelined
                else "no stages")
        out.append((f"searched seed {seed} ({what})", s, w, graph, topo))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(zoo.names()))
    ap.add_argument("--plans", nargs="*", default=list(PLANS), choices=PLANS)
    ap.add_argument("--mesh", default="cpu8")
    ap.add_argument("--rows", nargs="*", default=list(PIPELINED), choices=list(PIPELINED),
                    metavar="ROW", help="the pipelined plans to run (default: all of them: "
                    + ", ".join(repr(k) for k in PIPELINED) + ")")
    args = ap.parse_args(argv)
    topo = load_topology(args.mesh)
    rows = []
    t0 = time.perf_counter()
    for name in args.models:
        w = zoo.get(name, "tiny")
        graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)
        cases = [(kind, s, w, graph, topo) for kind, s in
                 strategies(graph, topo, w, args.plans).items()]
        if "pipelined" in args.plans and name in LAYERED:
            for kind, (layers, settings, schedule) in PIPELINED.items():
                if kind not in args.rows:
                    continue
                wl, gl = pipelined(name, layers) if layers != 2 else (w, graph)
                s = baselines.megatron_3d(gl, topo, pp=2, **{"recompute": "none", **settings})
                cases.append((kind, s.with_pipeline(2, s.virtual_stages, schedule), wl, gl,
                              topo))
        if "searched-pipelined" in args.plans and name in LAYERED:
            cases += searched_pipelines(graph, w)
        for kind, strategy, wk, gk, tk in cases:
            plan = Plan.make(gk, tk, strategy, model_config="tiny")
            r = compare_on_devices(plan, wk, repeats=1, costs="analytic", reshard="xla")
            xla, pred = r.hlo_collective_bytes, r.predicted_collective_bytes
            ratio = 1.0 if xla == pred else pred / max(xla, 1.0)  # 0/0: both move nothing
            hs, ps = r.hlo_sent_bytes, r.predicted_sent_bytes
            sent = 1.0 if hs == ps else ps / max(hs, 1.0)
            rows.append((name, kind, r.max_abs_diff, xla, pred, ratio, hs, ps, sent))
            print(f"[{time.perf_counter() - t0:6.0f}s] {name:<13}{kind:<14} diff "
                  f"{r.max_abs_diff:8.2g}  XLA {r.hlo_collective_bytes:>11,.0f} B  predicted "
                  f"{r.predicted_collective_bytes:>11,.0f} B  ratio {ratio:.3f}  sent ratio "
                  f"{sent:.3f}",
                  file=sys.stderr, flush=True)
    print("| model | plan | max abs diff | XLA collective bytes | predicted | ratio "
          "| XLA bytes sent | predicted | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, kind, diff, xla, pred, ratio, hs, ps, sent in rows:
        flag = ["" if abs(x - 1) <= 0.10 else " **" for x in (ratio, sent)]
        print(f"| {name} | {kind} | {diff:.2g} | {xla:,.0f} | {pred:,.0f} | {ratio:.3f}{flag[0]} "
              f"| {hs:,.0f} | {ps:,.0f} | {sent:.3f}{flag[1]} |")
    for what, k in (("collective bytes", 5), ("bytes sent", 8)):
        inside = sum(abs(r[k] - 1) <= 0.10 for r in rows)
        print(f"\n{what}: {inside} of {len(rows)} plans within 10%", end="")
    print(f"\n\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
