"""The randomized exactness suite's long run: thousands of seeded random strategies, each
applied on 8 virtual CPU devices and held to ``jax.grad`` of the user's loss in float64.

    python scripts/fuzz_exactness.py --strategies 2000 --out fuzz.json   # about an hour
    python scripts/fuzz_exactness.py --only corpus:convnext --strategies 50
    python scripts/fuzz_exactness.py --strategies 40 --schedules zb-h1 zb-interleaved \
        --only zoo:gpt:tiny zoo:llama:tiny zoo:moe:tiny    # pipelined, those schedules alone

Subjects and strategies are `tests/fuzzing.py`'s (every corpus model and the zoo's tiny models
with a layer scan, experts and flash attention; configs from the SOAP space with up to two
mesh axes on a dim, recomputation, microbatches, ZeRO-3 and distributed-optimizer axes, ring
attention, pipeline stages with every schedule and interleave the model allows), drawn round
robin over the subjects and over two topologies: ``cpu8`` (data=2 x model=4) and
``cpu8-nodes`` (node=2 x data=2 x model=2, where stages cut the node axis). Each is compared
leaf by leaf (`soapjax.exactness`): the loss and every gradient leaf within 1e-9 of its own
scale (float32's bar for a model that rounds to float32 whatever its parameters' type:
``jax.nn.dot_product_attention`` takes its softmax in float32). A strategy apply refuses (a
`PlanError`) is counted apart, not as a failure. A failure is shrunk (`fuzzing.shrink`) to the
fewest choices that still fail and printed with its seed; keep it as a test. Progress goes to
stderr; the JSON at ``--out`` has every count, per subject. Exit status 1 when anything
failed.

Each strategy runs in a worker process (`--worker`, which keeps the subjects it built) with a
deadline (``--deadline-s``): a step that hangs or aborts the process (XLA:CPU ends a
collective no device pair completes after 40 s) is a failure of its own kind, and the next
strategy runs in a fresh worker.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import fuzzing  # noqa: E402
import numpy as np  # noqa: E402

from soapjax.cost.operators import cost_model  # noqa: E402
from soapjax.simulate.front import open_simulation  # noqa: E402
from soapjax.strategy.pipeline import SCHEDULES  # noqa: E402
from soapjax.topology.cluster import load_topology  # noqa: E402

# apply's refusal of a step that would hang (`soapjax.apply._pipelined.check_compiled`)
HANG = "collective-permute inside the stage's own action"


def _worker() -> int:
    """Reads ``{"name", "topology", "seed", "shrink", "schedules"}`` lines on stdin and
    writes one JSON line of what `fuzzing.check` found for each (the subjects built once)."""
    topologies = _topologies()
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.time()
        try:
            s = fuzzing.subject(job["name"])
        except Exception as e:  # noqa: BLE001  a subject that cannot be built: say why
            print(json.dumps({"refused": "", "failed": True, "error": None,
                              "bar": fuzzing.TOLERANCE,
                              "pipelined": False, "strategy": "", "guarded": None,
                              "describe": f"CRASH building the subject: {fuzzing.error_line(e)}",
                              "seconds": time.time() - t0}), flush=True)
            continue
        topology = topologies[job["topology"]]
        strategy = fuzzing.draw(s, topology, np.random.default_rng(job["seed"]),
                                job.get("schedules"))
        out = fuzzing.check(s, strategy, topology)
        record = {"refused": out.refused, "failed": out.failed, "describe": out.describe(),
                  "error": out.comparison.max_error if out.comparison else None,
                  "bar": s.tolerance, "pipelined": strategy.pipelined,
                  "strategy": fuzzing.describe(strategy, s.graph),
                  "guarded": _guarded(s.graph, strategy, topology)}
        if out.failed and job["shrink"]:
            # the failure first: a shrink that runs past the deadline must not hide it
            print(json.dumps({**record, "seconds": time.time() - t0, "shrinking": True}),
                  flush=True)
            small = fuzzing.shrink(s, strategy, topology)
            record["shrunk"] = fuzzing.describe(small, s.graph)
            record["split"] = {op.name: [list(a) for a in cfg.axes]
                               for op, cfg in zip(s.graph.operators, small.configs)
                               if cfg.used_axes}
        record["seconds"] = time.time() - t0
        print(json.dumps(record), flush=True)
    return 0


def _guarded(graph, strategy, topology) -> bool | None:
    """Whether the search's guard names a layout change inside a pipelined plan's stages that
    XLA may make with a collective-permute (`PipelinedSimulation.stage_permutes`: the
    search keeps no such plan); None for a plan without stages."""
    if not strategy.pipelined:
        return None
    with open_simulation(graph, topology, strategy, resharder="ideal",
                         cost_model=cost_model(graph, topology, mode="analytic")) as sim:
        return bool(sim.stage_permutes())


def _topologies() -> dict:
    return {"cpu8": load_topology("cpu8"),
            "cpu8-nodes": load_topology(str(ROOT / "tests" / "meshes" / "cpu8-nodes.toml"))}


class _Worker:
    """A `--worker` process, restarted after it hangs or dies."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def run(self, job: dict, deadline_s: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, __file__, "--worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], deadline_s)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            first = json.loads(line)
            if not first.pop("shrinking", False):
                return first
            # a failure, now shrinking: given five deadlines more, else reported unshrunk
            ready, _, _ = select.select([self.proc.stdout], [], [], 5 * deadline_s)
            line = self.proc.stdout.readline() if ready else ""
            if line:
                return json.loads(line)
            self.close()
            first["describe"] += f" (not shrunk: shrinking ran past {5 * deadline_s:.0f} s)"
            return first
        code = self.proc.poll()
        self.close()
        what = (f"HANG: no result in {deadline_s:.0f} s" if code is None
                else f"ABORT: the worker ended with status {code}")
        return {"refused": "", "failed": True, "describe": what, "error": None,
                "pipelined": False, "strategy": "(see the seed)", "seconds": deadline_s}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:] == ["--worker"]:
        return _worker()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", type=int, default=2000, help="strategies compared in all "
                   "(refused ones not counted; default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the first strategy's seed")
    p.add_argument("--only", nargs="*", default=None, metavar="SUBJECT",
                   help=f"subjects to fuzz (default: all {len(fuzzing.names())}; e.g. "
                   "corpus:convnext zoo:gpt:tiny)")
    p.add_argument("--out", default=None, help="write the counts as JSON here")
    p.add_argument("--deadline-s", type=float, default=240.0, help="longest one strategy may "
                   "take, compiling included, before it counts as a hang (default %(default)s)")
    p.add_argument("--no-shrink", dest="shrink", action="store_false",
                   help="report failures as drawn, without shrinking them")
    p.add_argument("--schedules", nargs="+", default=None, metavar="SCHEDULE",
                   choices=sorted(SCHEDULES),
                   help="pipelined strategies alone, of these schedules (the subjects that "
                   "take stages: the zoo's layered models), e.g. --schedules zb-h1 "
                   "zb-interleaved --only zoo:gpt:tiny zoo:llama:tiny zoo:moe:tiny")
    args = p.parse_args(argv)
    names = args.only or fuzzing.names()
    unknown = [n for n in names if n not in fuzzing.names()]
    if unknown:
        p.error(f"unknown subjects {unknown}; expected some of {fuzzing.names()}")
    topologies = list(_topologies())
    counts = {n: {"compared": 0, "refused": 0, "failed": 0, "worst": 0.0, "pipelined": 0,
                  "seconds": 0.0, "bar": fuzzing.TOLERANCE} for n in names}
    failures: list[dict] = []
    refusals: dict[str, int] = {}
    guard = {(a, b): 0 for a in ("named", "clean") for b in ("refused", "ran")}
    worker = _Worker()
    start, compared, draws = time.time(), 0, 0
    try:
        while compared < args.strategies:
            name = names[draws % len(names)]
            topology = topologies[(draws // len(names)) % len(topologies)]
            seed = args.seed + draws
            draws += 1
            r = worker.run({"name": name, "topology": topology, "seed": seed,
                            "shrink": args.shrink, "schedules": args.schedules},
                           args.deadline_s)
            c = counts[name]
            c["seconds"] += r["seconds"]
            c["bar"] = r.get("bar", c["bar"])
            if r.get("guarded") is not None:  # a pipelined plan: the search's guard against
                hangs = HANG in r["refused"]     # what apply refuses, side by side
                guard[("named" if r["guarded"] else "clean", "refused" if hangs else "ran")] += 1
            if r["refused"]:
                c["refused"] += 1
                reason = r["refused"].split(";")[0][:120]
                refusals[reason] = refusals.get(reason, 0) + 1
                continue
            compared += 1
            c["compared"] += 1
            c["pipelined"] += int(r["pipelined"])
            c["worst"] = max(c["worst"], r["error"] if r["error"] is not None else math.inf)
            if r["failed"]:
                c["failed"] += 1
                failures.append({"subject": name, "topology": topology, "seed": seed,
                                 "strategy": r["strategy"], "shrunk": r.get("shrunk", ""),
                                 "split": r.get("split", {}), "comparison": r["describe"]})
                print(f"\nFAIL {name} on {topology} seed {seed}: {r.get('shrunk', '')}; "
                      f"{r['describe']}", file=sys.stderr)
            if compared % 10 == 0 or compared == args.strategies:
                sys.stderr.write(f"\r{compared}/{args.strategies} strategies compared "
                                 f"({sum(x['refused'] for x in counts.values())} refused, "
                                 f"{len(failures)} failed) in {time.time() - start:.0f} s")
                sys.stderr.flush()
    except KeyboardInterrupt:  # Ctrl-C ends the run early; what it compared is still reported
        sys.stderr.write("\ninterrupted: the counts so far")
    finally:
        worker.close()
    sys.stderr.write("\n")
    total = {"strategies": compared, "draws": draws,
             "refused": sum(c["refused"] for c in counts.values()),
             "failed": len(failures), "subjects": len(names),
             "pipelined": sum(c["pipelined"] for c in counts.values()),
             "worst": max(c["worst"] for c in counts.values()),
             "seconds": round(time.time() - start, 1)}
    print(f"{'subject':<40}{'compared':>9}{'refused':>9}{'failed':>8}{'worst error':>13}"
          f"{'bar':>8}")
    for n, c in counts.items():
        print(f"{n:<40}{c['compared']:>9}{c['refused']:>9}{c['failed']:>8}{c['worst']:>13.2e}"
              f"{c['bar']:>8.0e}")
    print(f"{compared} strategies over {len(names)} subjects ({total['pipelined']} pipelined, "
          f"{total['refused']} more refused by apply) in {total['seconds']:.0f} s: "
          f"{len(failures)} failed; worst error {total['worst']:.2e} (bar {fuzzing.TOLERANCE:g}, "
          f"or float32's where a model rounds to float32 whatever its parameters' type)")
    for reason, n in sorted(refusals.items(), key=lambda kv: -kv[1])[:8]:
        print(f"refused {n:>5} x  {reason}")
    hung = guard["named", "refused"] + guard["clean", "refused"]
    ran = guard["named", "ran"] + guard["clean", "ran"]
    print(f"pipelined plans apply refused for a collective-permute inside a stage: {hung}, "
          f"the search's guard (PipelinedSimulation.stage_permutes) named "
          f"{guard['named', 'refused']} of them; of the {ran} it did not refuse so, the guard "
          f"named {guard['named', 'ran']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"total": total, "subjects": counts,
                                              "failures": failures, "refusals": refusals,
                                              "guard": {f"{a} {b}": n
                                                        for (a, b), n in guard.items()}},
                                             indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
