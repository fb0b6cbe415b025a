"""Benchmark: the searched plan's predicted step time against every baseline, per model and cluster.

For each zoo model (default configs) on the paper's clusters and the H100 topologies, runs the
MCMC search (analytic costs: none of these clusters is attached) and prints the plan's
simulated step time, each baseline's, the speed-up over data parallel and over the best
baseline, and the search time. Goal (issue 6): at least 1.3x over data parallel on the RNN/NMT
models and on GPT-2 at 16+ devices; equal to data parallel where data parallel is right.

    python scripts/bench_search.py                      # everything, 8 s per case
    python scripts/bench_search.py --models nmt gpt2 --meshes p100x16 --budget 20
"""

from __future__ import annotations

import argparse
import sys
import time

import soapjax_zoo as zoo
from soapjax.cost.reshard import DEFAULT_MODE
from soapjax.graph.opgraph import trace
from soapjax.search import SearchSettings, find_plan
from soapjax.topology.cluster import load_topology

MESHES = ("p100x16", "k80x64", "dgx-h100x8", "dgx-h100x32", "h100x64")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(zoo.names()))
    ap.add_argument("--meshes", nargs="*", default=list(MESHES))
    ap.add_argument("--config", default="default")
    ap.add_argument("--budget", type=float, default=8.0, help="search seconds per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reshard", default=DEFAULT_MODE, choices=("ideal", "xla"))
    args = ap.parse_args(argv)

    print(f"# bench_search: {args.config} configs, analytic costs, resharding {args.reshard}, "
          f"budget {args.budget:g} s per case, seed {args.seed}")
    print("| model | topology | devices | plan ms | data-parallel ms | best baseline | "
          "vs DP | vs best | search s | proposals |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        w = zoo.get(name, args.config)
        g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)
        for mesh in args.meshes:
            topo = load_topology(mesh)
            t0 = time.perf_counter()
            try:
                plan = find_plan(g, topo, costs="analytic", reshard=args.reshard,
                                 optimizer=w.optimizer, family=w.family,
                                 settings=SearchSettings(budget_s=args.budget, seed=args.seed))
            except ValueError as e:  # PlanError: nothing fits
                print(f"| {name} | {mesh} | {topo.num_devices} | - | - | - | - | - | - | {e} |")
                continue
            fits, t = dict(plan.search)["baselines_fit"], plan.step_time_s
            base = {n: bt for n, bt in plan.baselines if dict(fits)[n]}
            dp = dict(plan.baselines)["data-parallel"]
            best_name = min(base, key=base.get) if base else "-"
            best = base.get(best_name, float("nan"))
            print(f"| {name} | {mesh} | {topo.num_devices} | {t * 1e3:.2f} | "
                  f"{dp * 1e3:.2f}{'' if 'data-parallel' in base else ' (OOM)'} | "
                  f"{best_name} {best * 1e3:.2f} | {dp / t:.2f}x | "
                  f"{best / t:.2f}x | {time.perf_counter() - t0:.1f} | "
                  f"{dict(plan.search)['proposals']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
