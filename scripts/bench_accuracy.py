"""Simulator accuracy on the attached devices: simulated against measured step times, per plan.

For tiny zoo models on ``cpu8`` (8 virtual CPU devices, data=2 x model=4), applies data
parallelism, Megatron, FSDP, the paper's expert strategy, a searched plan (analytic costs on the
calibrated ``cpu8``) and two random strategies per model, and runs
`soapjax.check.compare_on_devices` on each (the numbers against the unsharded step, the
prediction, XLA's FLOPs; also the kernels its compiled program launches and the arrays it
returns, which `soapjax calibrate --links` prices per call). The measured step is the median
of one-call timings taken in rounds that call every plan of a model once, for 30 s per model
(a drift of the machine shifts all plans alike, and its slow spells stay a minority), against
the simulated one (measured operator costs, XLA's resharding collectives, and the
topology's measured collectives and shared compute, `soapjax calibrate --links`). The same plans
are simulated on the hand-written topology the calibrated one replaced (``--before``, the
``cpu8.toml`` of git revision ``7929f7d``), so one run gives the before/after table. Also XLA's
FLOPs per device (``cost_analysis``) against the simulator's.

    python scripts/bench_accuracy.py                       # 4 models x 7 plans (~4-6 min, 2 cores)
    python scripts/bench_accuracy.py --models mlp --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import soapjax_zoo as zoo  # noqa: E402
from soapjax.apply import step as apply  # noqa: E402
from soapjax.check import compare_on_devices  # noqa: E402
from soapjax.cost.operators import cost_model  # noqa: E402
from soapjax.cost.reshard import Resharder  # noqa: E402
from soapjax.graph.opgraph import trace  # noqa: E402
from soapjax.measure import quiet_gc  # noqa: E402
from soapjax.measure.hlo import launched_kernels  # noqa: E402
from soapjax.search import SearchSettings, find_plan, random_strategy  # noqa: E402
from soapjax.simulate.front import opt_state_factor, simulate  # noqa: E402
from soapjax.strategy.baselines import baselines  # noqa: E402
from soapjax.strategy.plan import Plan  # noqa: E402
from soapjax.strategy.space import MeshShape  # noqa: E402
from soapjax.topology.cluster import load_topology, make_mesh  # noqa: E402
from soapjax_eval.tables import expert_name, spearman  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("mlp", "lenet", "rnnlm", "gpt2")
BEFORE_REV = "7929f7d"


def before_topology(rev: str):
    """`cpu8` as revision `rev` shipped it: in the package (02dfcae on) or, before, meshes/."""
    for where in ("soapjax/topology/meshes/cpu8.toml", "meshes/cpu8.toml"):
        shown = subprocess.run(["git", "show", f"{rev}:{where}"], cwd=ROOT,
                               capture_output=True, text=True)
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"--before {rev}: no cpu8.toml in that revision (looked for "
                         f"soapjax/topology/meshes/cpu8.toml and meshes/cpu8.toml): "
                         f"{shown.stderr.strip()}")
    text = shown.stdout
    path = Path(tempfile.mkdtemp(prefix="soapjax-before-")) / "cpu8.toml"
    path.write_text(text)
    return load_topology(path)


def plans_of(g, topo, w, randoms: int):
    base = baselines(g, topo, w.family)
    wanted = ["data-parallel", "megatron", "fsdp", expert_name({"family": w.family})]
    out = {b: base[b] for b in wanted if b in base}
    found = find_plan(g, topo, costs="analytic", optimizer=w.optimizer, family=w.family,
                      settings=SearchSettings(max_proposals=200, seed=0))
    searched = found.strategy(g, topo)
    same = [name for name, s in out.items() if s == searched]
    if same:  # the search kept a baseline: timed once, under the baseline's name
        print(f"{g.name}: the searched plan is {same[0]}", file=sys.stderr)
    else:
        out["searched"] = searched
    rng = np.random.default_rng(0)
    for r in range(randoms):
        out[f"random-{r}"] = random_strategy(g, MeshShape.of(topo), rng)
    return out


def simulation(g, topo, strategy, w):
    """The simulated step (measured operator costs, XLA's resharding), with its tasks."""
    cm = cost_model(g, topo, mode="measured", optimizer=w.optimizer)
    with Resharder(MeshShape.of(topo), mode="xla") as rs:
        return simulate(g, topo, strategy, cost_model=cm, resharder=rs,
                        opt_state_factor=opt_state_factor(w.optimizer, w.abstract_params()))


def simulated(g, topo, strategy, w) -> float:
    return simulation(g, topo, strategy, w).step_time_s


def compiled_step(g, topo, strategy, w):
    """The plan's sharded training step and its arguments on the attached devices, as
    `compare_on_devices` builds them (donating nothing, so it can be called again)."""
    mesh = make_mesh(topo)
    params = w.init_params(jax.random.key(0))
    batch = w.make_batch(jax.random.key(1))
    opt_state = w.optimizer.init(params)
    step, sh = apply.sharded_train_step(g, strategy, mesh, w.optimizer, params=params,
                                        batch=batch, donate=False)
    args = (apply.device_put_global(params, sh.params),
            apply.device_put_global(opt_state, sh.opt_state),
            apply.device_put_global(batch, sh.batch))
    jax.block_until_ready(step(*args))  # compiled and warm
    return step, args


def interleaved_medians(steps: dict, rounds: int, seconds: float = 0.0) -> dict:
    """Median seconds of one call of each step, timed in rounds that call every step once (at
    least `rounds` of them, and more until `seconds` have passed): a slow drift of the machine
    (another tenant, the clock) shifts every plan of a model alike instead of reordering them,
    as timing one plan after another would. This host has spells of 1-10 s in which every step
    is 1.3-1.4x slower (a LeNet step's 200-call median, taken every 0.6 s for 200 s: 2.5-2.7 ms,
    and 3.3-3.7 ms in the spells); rounds spread over tens of seconds keep the median out of
    them, where a model's 15 rounds (1-3 s) could fall wholly inside one."""
    times = {name: [] for name in steps}
    start = time.perf_counter()
    with quiet_gc():  # this process holds ~200,000 Python objects: see `quiet_gc`
        while (len(next(iter(times.values()), [])) < rounds
               or time.perf_counter() - start < seconds):
            for name, (step, args) in steps.items():
                t0 = time.perf_counter()
                jax.block_until_ready(step(*args))
                times[name].append(time.perf_counter() - t0)
            if not steps:
                break
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(models, repeats: int, randoms: int, log, before_rev: str = BEFORE_REV,
        seconds: float = 0.0) -> dict:
    topo, before = load_topology("cpu8"), before_topology(before_rev)
    rows = []
    for name in models:
        w = zoo.get(name, "tiny")
        g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)
        checked, steps, shape = {}, {}, {}
        for pname, strategy in plans_of(g, topo, w, randoms).items():
            try:  # the prediction, XLA's FLOPs and a correctness check; the timing is below
                checked[pname] = (strategy, compare_on_devices(
                    Plan.make(g, topo, strategy, model_config="tiny"), zoo.get(name, "tiny"),
                    repeats=1, costs="measured", reshard="xla"))
                steps[pname] = compiled_step(g, topo, strategy, w)
                step, args = steps[pname]
                shape[pname] = (launched_kernels(step.lower(*args).compile().as_text()),
                                len(jax.tree.leaves(jax.eval_shape(step, *args))))
            except Exception as e:  # noqa: BLE001  one plan failing must not hide the others
                log(f"{name} {pname}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                checked.pop(pname, None)
        measured = interleaved_medians(steps, repeats, seconds)
        for pname, (strategy, c) in checked.items():
            row = {"model": name, "strategy": pname, "simulated_s": c.predicted_step_s,
                   "measured_s": measured[pname],
                   "error": c.predicted_step_s / measured[pname] - 1.0,
                   "before_simulated_s": simulated(g, before, strategy, w),
                   "hlo_flops": c.hlo_flops, "predicted_flops": c.predicted_flops,
                   "flops_ratio": c.flops_ratio,
                   "kernels": shape[pname][0], "arrays_returned": shape[pname][1]}
            row["before_error"] = row["before_simulated_s"] / row["measured_s"] - 1.0
            rows.append(row)
            log(f"{name:<8}{pname:<15}measured {row['measured_s'] * 1e3:8.2f} ms  simulated "
                f"{row['simulated_s'] * 1e3:8.2f} ({row['error']:+.0%})  before "
                f"{row['before_simulated_s'] * 1e3:7.2f} ({row['before_error']:+.0%})  FLOPs "
                f"XLA/sim {row['flops_ratio']:.2f}")
        steps.clear()
    return {"plans": rows, "summary": summarise(rows), "before_rev": before_rev}


def summarise(rows) -> dict:
    def stats(key_sim, key_err, group):
        rho = spearman([r[key_sim] for r in group], [r["measured_s"] for r in group])
        return {"plans": len(group), "spearman": rho,
                "mean_abs_error": statistics.mean(abs(r[key_err]) for r in group)}

    out = {"pooled": {"after": stats("simulated_s", "error", rows),
                      "before": stats("before_simulated_s", "before_error", rows)}}
    for m in dict.fromkeys(r["model"] for r in rows):
        group = [r for r in rows if r["model"] == m]
        out[m] = {"after": stats("simulated_s", "error", group),
                  "before": stats("before_simulated_s", "before_error", group)}
    return out


def markdown(result) -> str:
    lines = ["| model | plans | rho before | rho after | mean abs error before | after |",
             "|---|---:|---:|---:|---:|---:|"]
    for m, s in result["summary"].items():
        b, a = s["before"], s["after"]
        lines.append(f"| {m} | {a['plans']} | {b['spearman']:.2f} | {a['spearman']:.2f} | "
                     f"{b['mean_abs_error']:.0%} | {a['mean_abs_error']:.0%} |")
    lines += ["", ("| model | plan | measured ms | simulated ms | error | before ms | before error "
                   "| FLOPs XLA / sim | kernels / arrays |"),
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["plans"]:
        lines.append(f"| {r['model']} | {r['strategy']} | {r['measured_s'] * 1e3:.2f} | "
                     f"{r['simulated_s'] * 1e3:.2f} | {r['error']:+.0%} | "
                     f"{r['before_simulated_s'] * 1e3:.2f} | {r['before_error']:+.0%} | "
                     f"{r['flops_ratio']:.2f} | {r['kernels']} / {r['arrays_returned']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--seconds", type=float, default=30.0,
                    help="keep timing rounds until this long has passed per model "
                    "(default: %(default)s; this host has spells of 1-10 s in which every step is "
                    "1.3-1.4x slower)")
    ap.add_argument("--repeats", type=int, default=15,
                    help="at least this many rounds of timing, each calling every plan of a model "
                    "once; the median per plan is its measured step (default: %(default)s)")
    ap.add_argument("--randoms", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--before", default=BEFORE_REV, metavar="REV",
                    help="the git revision whose meshes/cpu8.toml gives the 'before' column "
                    "(default %(default)s: the hand-written file; an earlier calibrated one "
                    "compares two calibrations on the same measured steps)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def log(s):
        print(s, file=sys.stderr, flush=True)

    result = run(args.models, args.repeats, args.randoms, log, before_rev=args.before,
                 seconds=args.seconds)
    result["seconds"] = time.perf_counter() - t0
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
