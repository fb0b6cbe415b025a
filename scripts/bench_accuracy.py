"""Simulator accuracy on the attached devices: simulated against measured step times, per plan.

For tiny zoo models on ``cpu8`` (8 virtual CPU devices, data=2 x model=4), applies data
parallelism, Megatron, FSDP, the paper's expert strategy, a searched plan (analytic costs on the
calibrated ``cpu8``) and two random strategies per model, and runs
`soapjax.check.compare_on_devices` on each: the measured step (median of warm repeated steps)
against the simulated one (measured operator costs, XLA's resharding collectives, and the
topology's measured collectives and shared compute, `soapjax calibrate --links`). The same plans
are simulated on the hand-written topology the calibrated one replaced (``--before``, the
``cpu8.toml`` of git revision ``7929f7d``), so one run gives the before/after table. Also XLA's
FLOPs per device (``cost_analysis``) against the simulator's.

    python scripts/bench_accuracy.py                       # 4 models x 7 plans (~10 min, 2 cores)
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

import numpy as np  # noqa: E402

import soapjax_zoo as zoo  # noqa: E402
from soapjax.baselines import baselines  # noqa: E402
from soapjax.check import compare_on_devices  # noqa: E402
from soapjax.cost import cost_model  # noqa: E402
from soapjax.graph import trace  # noqa: E402
from soapjax.plan import Plan  # noqa: E402
from soapjax.reshard import Resharder  # noqa: E402
from soapjax.search import SearchSettings, find_plan, random_strategy  # noqa: E402
from soapjax.simulate import opt_state_factor, simulate  # noqa: E402
from soapjax.space import MeshShape  # noqa: E402
from soapjax.topology import load_topology  # noqa: E402
from soapjax_eval.tables import expert_name, spearman  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("mlp", "lenet", "rnnlm", "gpt2")
BEFORE_REV = "7929f7d"


def before_topology(rev: str):
    text = subprocess.run(["git", "show", f"{rev}:meshes/cpu8.toml"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="soapjax-before-")) / "cpu8.toml"
    path.write_text(text)
    return load_topology(path)


def plans_of(g, topo, w, randoms: int):
    base = baselines(g, topo, w.family)
    wanted = ["data-parallel", "megatron", "fsdp", expert_name({"family": w.family})]
    out = {b: base[b] for b in wanted if b in base}
    found = find_plan(g, topo, costs="analytic", optimizer=w.optimizer, family=w.family,
                      settings=SearchSettings(max_proposals=200, seed=0))
    out["searched"] = found.strategy(g, topo)
    rng = np.random.default_rng(0)
    for r in range(randoms):
        out[f"random-{r}"] = random_strategy(g, MeshShape.of(topo), rng)
    return out


def simulated(g, topo, strategy, w) -> float:
    cm = cost_model(g, topo, mode="measured", optimizer=w.optimizer)
    with Resharder(MeshShape.of(topo), mode="xla") as rs:
        return simulate(g, topo, strategy, cost_model=cm, resharder=rs,
                        opt_state_factor=opt_state_factor(w.optimizer, w.abstract_params())
                        ).step_time_s


def run(models, repeats: int, randoms: int, log) -> dict:
    topo, before = load_topology("cpu8"), before_topology(BEFORE_REV)
    rows = []
    for name in models:
        w = zoo.get(name, "tiny")
        g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)
        for pname, strategy in plans_of(g, topo, w, randoms).items():
            t = time.perf_counter()
            try:
                c = compare_on_devices(Plan.make(g, topo, strategy, model_config="tiny"),
                                       zoo.get(name, "tiny"), repeats=repeats, costs="measured",
                                       reshard="xla")
            except Exception as e:  # noqa: BLE001  one plan failing must not hide the others
                log(f"{name} {pname}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            row = {"model": name, "strategy": pname, "simulated_s": c.predicted_step_s,
                   "measured_s": c.measured_step_s,
                   "error": c.predicted_step_s / c.measured_step_s - 1.0,
                   "before_simulated_s": simulated(g, before, strategy, w),
                   "hlo_flops": c.hlo_flops, "predicted_flops": c.predicted_flops,
                   "flops_ratio": c.flops_ratio}
            row["before_error"] = row["before_simulated_s"] / row["measured_s"] - 1.0
            rows.append(row)
            log(f"{name:<8}{pname:<15}measured {row['measured_s'] * 1e3:8.2f} ms  simulated "
                f"{row['simulated_s'] * 1e3:8.2f} ({row['error']:+.0%})  before "
                f"{row['before_simulated_s'] * 1e3:7.2f} ({row['before_error']:+.0%})  FLOPs "
                f"XLA/sim {row['flops_ratio']:.2f}  [{time.perf_counter() - t:.0f} s]")
    return {"plans": rows, "summary": summarise(rows)}


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
    lines += ["", "| model | plan | measured ms | simulated ms | error | before ms | before error "
              "| FLOPs XLA / sim |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["plans"]:
        lines.append(f"| {r['model']} | {r['strategy']} | {r['measured_s'] * 1e3:.2f} | "
                     f"{r['simulated_s'] * 1e3:.2f} | {r['error']:+.0%} | "
                     f"{r['before_simulated_s'] * 1e3:.2f} | {r['before_error']:+.0%} | "
                     f"{r['flops_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--randoms", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    result = run(args.models, args.repeats, args.randoms, log)
    result["seconds"] = time.perf_counter() - t0
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
