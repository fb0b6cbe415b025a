"""Per-device FLOPs of the compiled sharded step against the simulator's count, per plan.

For zoo models (tiny configs) on the 8 virtual CPU devices of ``cpu8`` (data=2 x model=4),
compiles the sharded training step of the plans docs/checks.md checks (data parallelism,
Megatron, FSDP, the paper's expert CNN and RNN strategies, the searched plan: analytic costs,
``--proposals`` per chain, seed 0) and of data parallelism with every operator but the loss
recomputed, from shapes (nothing runs), and compares the FLOPs one device computes:

* **XLA**: ``cost_analysis()`` recounted from the compiled HLO by XLA's own rules
  (`soapjax.check.compiled_flops`, which checks the recount equals ``cost_analysis()``), with
  every while-loop trip counted (XLA counts a loop body once), the all-reduces' one FLOP per
  element left out (communication) and fused work on elements no fusion output reads left
  out; of that, what fusions recompute (*fusion duplicates*) is shown apart.
* **predicted**: `soapjax.cost.flops.FlopCounter` (forward, backward, recomputation, the
  optimizer's update of the stored parameter shards).

A second table breaks both down: by phase (forward, backward, update, from JAX's ``jvp`` and
``transpose(jvp)`` in the HLO op names; instructions XLA made without a name apart) and, for
XLA, by kind (matmul, elementwise, reduce, inside loops, all-reduce, sliced away). The
predicted forward includes the residuals the backward reads. ``cost_analysis`` does not
depend on machine load: the numbers are deterministic. The goal (issue "Simulator fidelity")
is within 5%.

    python scripts/bench_flops.py                      # docs/checks.md's models (~8 min)
    python scripts/bench_flops.py --models mlp gpt2 rnnlm --plans data-parallel megatron fsdp
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import soapjax_zoo as zoo
from soapjax.check import compiled_flops
from soapjax.cost.flops import FlopCounter
from soapjax.graph.opgraph import trace
from soapjax.search import SearchSettings, find_plan
from soapjax.strategy import baselines
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology, make_mesh

PLANS = ("data-parallel", "megatron", "fsdp", "expert-cnn", "expert-rnn", "searched",
         "recompute", "megatron-sp", "fsdp-recompute")
DEFAULT_PLANS = PLANS[:7]  # docs/checks.md's, and data parallel recomputing every operator
DEFAULT_MODELS = ("alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "lenet",
                  "mlp", "gpt2")  # docs/checks.md's


def strategies(graph, topo, w, wanted, proposals):
    found = baselines.baselines(graph, topo)
    out = {k: v for k, v in found.items() if k in wanted}
    if "recompute" in wanted:  # every operator but the loss runs its forward again
        last = len(graph.operators) - 1
        out["recompute"] = dataclasses.replace(found["data-parallel"], recompute=tuple(
            "full" if i < last else "none" for i in range(len(graph.operators))))
    if "searched" in wanted:
        plan = find_plan(graph, topo, costs="analytic", optimizer=w.optimizer,
                         settings=SearchSettings(max_proposals=proposals, seed=0))
        out["searched"] = plan.strategy(graph, topo)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS))
    ap.add_argument("--plans", nargs="*", default=list(DEFAULT_PLANS), choices=PLANS)
    ap.add_argument("--mesh", default="cpu8")
    ap.add_argument("--proposals", type=int, default=300)
    ap.add_argument("--opt-level", type=int, default=None,
                    help="xla_backend_optimization_level (the HLO, so the count, is the same)")
    args = ap.parse_args(argv)
    topo = load_topology(args.mesh)
    mesh, mesh_shape = make_mesh(topo), MeshShape.of(topo)
    options = None if args.opt_level is None else {"xla_backend_optimization_level":
                                                   args.opt_level}
    rows = []
    t0 = time.perf_counter()
    for name in args.models:
        w = zoo.get(name, "tiny")
        graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)
        counter = FlopCounter(graph, optimizer=w.optimizer, params=w.abstract_params())
        for kind, strategy in strategies(graph, topo, w, args.plans, args.proposals).items():
            xla = compiled_flops(graph, strategy, mesh, w, mesh_shape=mesh_shape,
                                 compiler_options=options)
            reported = xla.flops  # cost_analysis()["flops"]: compiled_flops checks it
            pred = counter.step(strategy, mesh_shape)
            phase = {p: sum(f for ph, k, f in xla.parts if ph == p and k != "all-reduce")
                     for p in ("forward", "backward", "update", "unnamed")}
            kinds = {k: sum(f for _, kk, f in xla.parts if kk == k)
                     for k in ("matmul", "elementwise", "reduce", "loop", "all-reduce")}
            kinds["sliced away"] = xla.sliced_away
            compute = reported + xla.loop_extra - xla.all_reduce - xla.sliced_away
            rows.append((name, kind, compute, pred.total, compute / pred.total, reported,
                         phase, pred, kinds, xla.duplicated))
            print(f"[{time.perf_counter() - t0:5.0f}s] {name:<13}{kind:<15} XLA {compute:>13,.0f}"
                  f"  predicted {pred.total:>13,.0f}  ratio {compute / pred.total:.3f}"
                  f"  (cost_analysis {reported:,.0f})", file=sys.stderr, flush=True)
    print("| model | plan | XLA FLOPs | of which fusion duplicates | predicted | XLA / "
          "predicted | without duplicates | cost_analysis() / predicted |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, kind, compute, total, ratio, reported, _, _, _, dup in rows:
        flags = ["" if abs(r - 1) <= 0.05 else " **" for r in (ratio, (compute - dup) / total)]
        print(f"| {name} | {kind} | {compute:,.0f} | {dup:,.0f} | {total:,.0f} | {ratio:.3f}"
              f"{flags[0]} | {(compute - dup) / total:.3f}{flags[1]} | {reported / total:.3f} |")
    inside = sum(abs(r[4] - 1) <= 0.05 for r in rows)
    no_dup = sum(abs((r[2] - r[9]) / r[3] - 1) <= 0.05 for r in rows)
    print(f"\nwithin 5%: {inside} of {len(rows)} plans; without fusion duplicates {no_dup}")
    print("\n| model | plan | XLA fwd / bwd / update / unnamed | predicted fwd / bwd / recompute "
          "/ update | XLA matmul / elementwise / reduce / in loops / all-reduce / sliced away |")
    print("|---|---|---:|---:|---:|")
    for name, kind, _, _, _, _, phase, pred, kinds, _ in rows:
        print(f"| {name} | {kind} | {' / '.join(f'{phase[p]:,.0f}' for p in phase)} "
              f"| {pred.forward:,.0f} / {pred.backward:,.0f} / {pred.recompute:,.0f} / "
              f"{pred.update:,.0f} | {' / '.join(f'{kinds[k]:,.0f}' for k in kinds)} |")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
