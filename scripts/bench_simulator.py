"""Simulator speed: full vs delta simulations per second, for the zoo on 4 to 64 devices.

The shape of the FlexFlow paper's Table 4 (section 8.3.2): for each model and device count, a
Metropolis-style walk proposes single-operator config changes, starting from data parallelism,
and simulates them both ways:

* delta: `Simulation.propose(i, config)`, then `accept()` or `reject()` (Algorithm 2), for every
  proposal of the walk;
* full: `Simulation.reset(candidate)`, the task graph built from scratch and timed
  (Algorithm 1), for every `--full-every`-th proposal's candidate strategy.

Operator and reshard lookups are warmed first (a search memoises them too), so the numbers are
the simulator's own; times are this process's CPU time, which other jobs on a busy machine
disturb less than wall time, the best of `--repeats` runs. Costs are analytic (the roofline of
the topology's devices) and reshardings use the ideal model (`Resharder(mode="ideal")`: XLA's
answers change which collectives are priced, not the simulator's speed once they are cached).
Devices: the paper's K80 cluster (`soapjax/topology/meshes/k80x64.toml`) cut to 1, 2, 4, 8 and 16
nodes of 4 GPUs by `soapjax.topology.cluster.scaled_topology`, mesh ``node x gpu``. Under symmetric
SPMD the task graph does not grow with the device count (one compute stream; channels that
collectives use alike are one resource), unlike the paper's per-device tasks. Every row also checks
that the walk's final delta state equals a full simulation of its strategy, task by task.

Usage::

    python scripts/bench_simulator.py                       # the whole zoo, 4..64 devices
    python scripts/bench_simulator.py --models gpt2 --devices 64 --proposals 2000
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import soapjax_zoo as zoo
from soapjax.cost import operators as cost
from soapjax.cost.reshard import Resharder
from soapjax.graph import opgraph as graph
from soapjax.simulate.front import Simulation
from soapjax.strategy import space
from soapjax.topology.cluster import load_topology, scaled_topology


def bench(g, topo, *, proposals: int, full_every: int, seed: int, repeats: int) -> dict:
    mesh = space.MeshShape.of(topo)
    costs = cost.cost_model(g, topo, mode="analytic")
    resharder = Resharder(mesh, mode="ideal")
    start = space.data_parallel(g, mesh)
    sim = Simulation(g, topo, costs, resharder, start)
    rng = random.Random(seed)
    choices = [space.configs(op, mesh) for op in g.operators]
    walk = [(i, rng.choice(choices[i]), rng.random())
            for i in (rng.randrange(len(choices)) for _ in range(proposals))]

    def run(candidates: list | None = None) -> None:
        current = sim.step_time()
        for k, (i, config, u) in enumerate(walk):
            if candidates is not None and k % full_every == 0:
                candidates.append(sim.strategy.replace(i, config))
            t = sim.propose(i, config)
            if t <= current or u < math.exp(-20 * (t - current) / current):
                sim.accept()
                current = t
            else:
                sim.reject()

    candidates: list[space.Strategy] = []
    run(candidates)  # warms the memoised operator, reshard and collective lookups
    delta_s = full_s = math.inf
    for _ in range(repeats):
        sim.reset(start)
        t0 = time.process_time()
        run()
        delta_s = min(delta_s, (time.process_time() - t0) / proposals)
    step_time = sim.step_time()
    check = Simulation(g, topo, costs, resharder, sim.strategy)
    assert check.timeline() == sim.timeline(), "delta and full simulation differ"
    for _ in range(repeats):
        t0 = time.process_time()
        for s in candidates:
            sim.reset(s)
        full_s = min(full_s, (time.process_time() - t0) / len(candidates))
    return {"tasks": len(check.timeline()), "full_per_s": 1 / full_s, "delta_per_s": 1 / delta_s,
            "speedup": full_s / delta_s, "step_time_s": step_time}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=list(zoo.names()))
    p.add_argument("--devices", nargs="*", type=int, default=[4, 8, 16, 32, 64])
    p.add_argument("--proposals", type=int, default=300, help="delta proposals per row")
    p.add_argument("--full-every", type=int, default=10,
                   help="fully simulate every k-th proposal's candidate")
    p.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = []
    print(f"{'model':<14}{'ops':>5}{'devices':>8}{'tasks':>7}{'full/s':>10}{'delta/s':>10}"
          f"{'speedup':>9}{'delta/min':>11}", file=sys.stderr if args.json else sys.stdout)
    k80 = load_topology("k80x64")
    topologies = {n: scaled_topology(k80, n) for n in args.devices}
    for name in args.models:
        w = zoo.get(name)
        g = graph.trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
        for n in args.devices:
            r = bench(g, topologies[n], proposals=args.proposals,
                      full_every=args.full_every, seed=args.seed, repeats=args.repeats)
            rows.append({"model": name, "operators": len(g.operators), "devices": n, **r})
            print(f"{name:<14}{len(g.operators):>5}{n:>8}{r['tasks']:>7}"
                  f"{r['full_per_s']:>10.1f}{r['delta_per_s']:>10.1f}{r['speedup']:>8.1f}x"
                  f"{r['delta_per_s'] * 60:>11.0f}", flush=True,
                  file=sys.stderr if args.json else sys.stdout)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
