"""Benchmark: does `soapjax plan` keep its `--budget`? Budget against wall time, per case.

`SearchSettings.budget_s` bounds the wall time of the whole `find_plan` call, measuring
included: with measured costs, new shard programs are measured until 80% of the budget and
estimated after it (`CostModel.measure_until`), Megatron's grid is scored until 30% of it,
and the chains (flat, then pipelined) share what is left. The goal (issue 29): every case
finishes its search within ``budget * 1.1 + 5 s``, on a 2-core machine with a cold cost cache.

Each case runs the command line in a fresh process with an empty cost cache
(``SOAPJAX_CACHE_DIR`` in a temporary folder), as a new user's first run would, and reads
the plan file it writes for the search time that `find_plan` recorded. "command" is the whole
process: Python and jax start-up, tracing the model, the search, simulating and writing the
plan.

    python scripts/bench_budget.py                  # the four cases below
    python scripts/bench_budget.py --cases mlp gpt2-tiny --budget 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_model() -> str:
    """The README's own-model example (the ``python`` block after "For example
    `my_model.py`"), written where the command runs: the bench plans what the README shows."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index("For example `my_model.py`"):]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


# name -> (plan arguments, costs, what it is)
CASES = {
    "make-plan": (["--model", "gpt2", "--mesh", "dgx-h100x8"], "analytic",
                  "`make plan`: GPT-2 small on one DGX H100"),
    "mlp": (["--model", "my_model.py:make_workload", "--mesh", "cpu8"], "measured",
            "the README's own-model example on cpu8"),
    "gpt2-tiny": (["--model", "gpt2", "--size", "tiny", "--mesh", "cpu8"], "measured",
                  "GPT-2 tiny on cpu8"),
    "gpt-175b": (["--model", "gpt", "--size", "175b", "--mesh", "dgx-a100x3072-1024",
                  "--pipelines"], "analytic", "GPT 175B on 1024 A100s, pipelines"),
}


def run_case(name: str, budget: float, workdir: Path) -> dict:
    args, costs, _ = CASES[name]
    out = workdir / f"{name}.json"
    env = dict(os.environ, SOAPJAX_CACHE_DIR=str(workdir / f"cache-{name}"),
               XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "soapjax.cli", "plan", *args, "--budget", f"{budget:g}",
           "--costs", costs, "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"case": name, "error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall}
    search = json.loads(out.read_text())["search"]
    stats = search.get("cost_stats", {})
    return {"case": name, "wall_s": wall, "search_s": search["search_time_s"],
            "proposals": search["proposals"], "measured": stats.get("measured"),
            "estimated": stats.get("estimated")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--budget", type=float, default=20.0, help="--budget of each case (s)")
    ap.add_argument("--budget-175b", type=float, default=60.0,
                    help="--budget of the gpt-175b case (s)")
    args = ap.parse_args(argv)
    print(f"# bench_budget: cold cost cache per case, {os.cpu_count()} cores")
    print("| case | costs | budget s | search s | command s | limit s | within | proposals "
          "| measured | estimated |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "my_model.py").write_text(readme_model())
        for name in args.cases:
            budget = args.budget_175b if name == "gpt-175b" else args.budget
            r = run_case(name, budget, workdir)
            limit = budget * 1.1 + 5
            if "error" in r:
                print(f"| {name} | {CASES[name][1]} | {budget:g} | - | {r['wall_s']:.1f} | "
                      f"{limit:.0f} | failed: {r['error']} | | | |")
                ok = False
                continue
            within = r["search_s"] <= limit
            ok &= within
            print(f"| {name} | {CASES[name][1]} | {budget:g} | {r['search_s']:.1f} | "
                  f"{r['wall_s']:.1f} | {limit:.0f} | {'yes' if within else 'NO'} | "
                  f"{r['proposals']:,} | {r['measured'] if r['measured'] is not None else '-'} | "
                  f"{r['estimated'] if r['estimated'] is not None else '-'} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
