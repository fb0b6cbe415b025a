"""What each collective of a plan's compiled step costs inside the step, against its price.

For a tiny zoo model on ``cpu8`` (8 virtual CPU devices), builds the plans `bench_accuracy`
measures, runs each plan's sharded training step under `jax.profiler` and reads the trace back
(`jax.profiler.ProfileData`): the time each HLO instruction takes per device per step, inside
the step, where a collective also waits for the devices that reach it last. Each collective is
printed beside what the topology file's measured model (`soapjax calibrate --links`: the same
collective timed back to back in a loop) prices one buffer of its bytes at, and the step's
totals beside the simulator's (collective tasks, compute tasks). This is how issue 15's GPT-2
gap was measured (docs/accuracy.md): inside the step, a collective costs 2-4x what the same
collective costs back to back in calibrate's loop (the searched plan's, over all 8 devices,
3-4x), and a tuple all-reduce of K operands (XLA combines gradients into one) about K times
one buffer's price.

    python scripts/profile_plan.py --model gpt2 --plans megatron searched    # ~15 s
    python scripts/profile_plan.py --model rnnlm --top 10

The profiler adds its own cost, up to 2x (GPT-2's Megatron plan: 9.6 ms of collectives per
device per step under it, 5.0 ms for the whole step timed in a loop without it); compare
collectives with each other and with the prices, not the totals with `bench_accuracy`'s
measured steps.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
from bench_accuracy import compiled_step, plans_of, simulation

import soapjax_zoo as zoo
from soapjax.graph.opgraph import trace
from soapjax.measure import hlo
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology

COMPUTE_TASKS = ("forward", "backward", "update")


def in_step_times(step, args, steps: int, num_devices: int) -> dict[str, float]:
    """Seconds per device per step of each event the profiler records on the host's XLA
    threads (HLO instructions by name, and the runtime's own events), over `steps` calls."""
    for _ in range(3):
        jax.block_until_ready(step(*args))
    with tempfile.TemporaryDirectory(prefix="soapjax-profile-") as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                jax.block_until_ready(step(*args))
        path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
    total: collections.Counter = collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            for ev in line.events:
                total[ev.name] += ev.duration_ns * 1e-9
    return {k: v / (steps * num_devices) for k, v in total.items()}


def profile(model: str, plan_names, steps: int, top: int) -> None:
    topo = load_topology("cpu8")
    w = zoo.get(model, "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=model)
    plans = plans_of(g, topo, w, randoms=2)
    unknown = [p for p in plan_names if p not in plans]
    if unknown:
        raise SystemExit(f"unknown plan(s) {unknown}: expected some of {sorted(plans)}")
    for name in plan_names:
        sim = simulation(g, topo, plans[name], w)
        sim_comp = sum(t.end_s - t.start_s for t in sim.tasks if t.kind in COMPUTE_TASKS)
        sim_coll = [t for t in sim.tasks if t.kind not in COMPUTE_TASKS]
        step, args = compiled_step(g, topo, plans[name], w)
        text = step.lower(*args).compile().as_text()
        colls = {c.name: c for c in hlo.collectives(text, MeshShape.of(topo))}
        times = in_step_times(step, args, steps, topo.num_devices)
        runtime = ("ThunkExecutor", "Rendezvous", "Wait", "InvokeRendezvous", "Common", "Handle",
                   "Allocate", "end:", "[")
        kernels = sum(t for k, t in times.items() if k not in colls and not k.startswith(runtime))
        in_coll = sum(times.get(n, 0.0) for n in colls)
        print(f"\n== {model} {name}: simulated step {sim.step_time_s * 1e3:.2f} ms")
        print(f"   collectives: {len(colls)} in the HLO, {in_coll * 1e3:.2f} ms per device per "
              f"step inside it; the simulator: {len(sim_coll)} tasks, "
              f"{sum(t.end_s - t.start_s for t in sim_coll) * 1e3:.2f} ms")
        print(f"   kernels: {kernels * 1e3:.2f} ms per device per step; the simulator's compute "
              f"tasks: {sim_comp * 1e3:.2f} ms")
        rows = []
        for c in colls.values():
            axes = c.axes or ()
            price = (topo.collective_time(c.kind.replace("-", "_"), c.nbytes, axes,
                                          group_size=c.group_size) if axes else float("nan"))
            rows.append((times.get(c.name, 0.0), c, price))
        rows.sort(key=lambda r: -r[0])
        print(f"   {'in step':>9} {'priced':>9} {'ratio':>6}  collective (operands, bytes, axes)")
        for t, c, price in rows[:top]:
            print(f"   {t * 1e6:7.0f}us {price * 1e6:7.0f}us {t / price:6.1f}  {c.name} "
                  f"({len(c.shapes)} operand{'s' * (len(c.shapes) > 1)}, {c.nbytes:.0f} B, "
                  f"{'+'.join(c.axes or ('?',))})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2", help="zoo model, tiny size (default: %(default)s)")
    ap.add_argument("--plans", nargs="*", default=["data-parallel", "megatron", "searched"],
                    help="plans of bench_accuracy (data-parallel, megatron, fsdp, expert-*, "
                    "searched, random-0, random-1; default: %(default)s)")
    ap.add_argument("--steps", type=int, default=5, help="steps profiled (default: %(default)s)")
    ap.add_argument("--top", type=int, default=15,
                    help="collectives listed per plan, costliest first (default: %(default)s)")
    args = ap.parse_args(argv)
    profile(args.model, args.plans, args.steps, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
