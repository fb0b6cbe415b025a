"""The experiments: each section's runner takes the shared `Workbench` and returns its results
as JSON-ready data (what `soapjax_eval.sections` writes about and `soapjax_eval.figures`
draws).

1. ``throughput`` (paper Figure 7), 2. ``comm`` (Figure 8), 3. ``search`` (Table 4, Figure 12),
4. ``quality`` (section 8.4), 5. ``accuracy`` (Figure 11); see `soapjax_eval`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

import soapjax_zoo

# Every soapjax module the run uses is imported now, not half an hour later: a run must use one
# version of the code even when the checkout changes under it.
from soapjax.check import compare_on_devices
from soapjax.cost import (
    operators as cost,
    reshard,  # noqa: F401
)
from soapjax.cost.operators import CACHE_ENV, cache_root
from soapjax.graph.opgraph import trace
from soapjax.measure import devices
from soapjax.search import (
    SearchSettings,
    exhaustive,
    find_plan,
    improving_change,
    make_simulation,
    random_strategy,
)
from soapjax.simulate.front import open_simulation, opt_state_factor
from soapjax.simulate.pipesim import PipelineResult
from soapjax.strategy.baselines import baselines
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import MeshShape, Strategy, configs, data_parallel
from soapjax.topology.cluster import load_topology, scaled_topology
from soapjax_eval.modes import Mode
from soapjax_eval.tables import expert_name


class Progress:
    """One status line on stderr: rewritten in place on a terminal, a line per step in a log."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, section: str, what: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {section}: {what}"
        if self.tty:
            sys.stderr.write("\r" + line[:150].ljust(150))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


class Workbench:
    """Traced graphs, cost models and searches, memoised so sections share them."""

    def __init__(self, mode: Mode, progress: Progress) -> None:
        self.mode = mode
        self.progress = progress
        self._graphs: dict = {}
        self._searches: dict = {}

    def per_device_batch(self, name: str, config: str | None = None) -> int:
        return soapjax_zoo.get(name, config or self.mode.config).batch_size

    def workload(self, name: str, devices: int = 1, config: str | None = None):
        """The workload with the config's batch per device times `devices` (weak scaling)."""
        config = config or self.mode.config
        batch = self.per_device_batch(name, config) * devices
        return soapjax_zoo.get(name, config, batch_size=batch)

    def graph(self, name: str, devices: int = 1, config: str | None = None):
        w = self.workload(name, devices, config)
        key = (name, w.config, w.batch_size)
        if key not in self._graphs:
            g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)
            self._graphs[key] = (w, g, opt_state_factor(w.optimizer, w.abstract_params()))
        return self._graphs[key]

    def search(self, name: str, topo_spec: str, *, section: str, label: str = "") -> dict:
        """soapjax's search on `topo_spec` (its device count scales the batch), with every
        baseline's simulated step; memoised."""
        key = (name, topo_spec)
        if key in self._searches:
            return self._searches[key]
        topo = load_topology(topo_spec)
        n = topo.num_devices
        w, g, factor = self.graph(name, n)
        cm = cost.cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
        settings = SearchSettings(max_proposals=self.mode.proposals, seed=0)
        self.progress(section, f"{label}search {name} on {topo.name} ({n} devices, batch "
                               f"{w.batch_size})")
        sim = make_simulation(g, topo, cost_model=cm, opt_state_factor=factor)
        base = baselines(g, topo, w.family)
        cluster = "h100" if "h100" in topo_spec else topo_spec.rpartition("-")[0] or topo_spec
        out: dict[str, Any] = {"model": name, "topology": topo.name, "cluster": cluster,
                               "devices": n,
                               "batch": w.batch_size, "family": w.family, "baselines": {}}
        for bname, strategy in base.items():
            sim.reset(strategy)
            out["baselines"][bname] = _sim_summary(sim)
        c0 = time.process_time()
        try:
            plan = find_plan(g, topo, costs=cm, optimizer=w.optimizer, family=w.family,
                             settings=settings)
        except ValueError as e:  # PlanError: nothing fits in memory
            out["error"] = str(e)
            self._searches[key] = out
            return out
        info, strategy = dict(plan.search), plan.strategy(g, topo)
        # a pipelined plan is priced by a PipelinedSimulation (one stage's mesh), not `sim`
        with open_simulation(g, topo, strategy, cost_model=cm,
                             opt_state_factor=factor) as searched:
            out["soapjax"] = _sim_summary(searched)
        out["search"] = {"proposals": info["proposals"], "cpu_s": time.process_time() - c0,
                         "wall_s": info["search_time_s"], "start": info["best_from"],
                         "max_proposals": settings.max_proposals, "seed": settings.seed}
        out["_live"] = (g, topo, cm, factor, strategy)  # for the local-optimality check
        self._searches[key] = out
        return out


def _sim_summary(sim) -> dict:
    r = sim.result()
    if isinstance(r, PipelineResult):  # a pipelined plan: no per-device byte count of its own
        return {"step_time_s": r.step_time_s, "fits": r.fits_in_memory,
                "bytes_per_device": None, "by_link_class": {}, "compute_s": None,
                "peak_memory_bytes": r.peak_memory_bytes, "stages": len(r.stage_memory)}
    return {"step_time_s": r.step_time_s, "fits": r.fits_in_memory,
            "bytes_per_device": r.bytes_moved, "by_link_class": dict(r.bytes_by_link_class),
            "compute_s": r.compute_s, "peak_memory_bytes": r.peak_memory_bytes[0]}


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def run_throughput(bench: Workbench) -> dict:
    mode = bench.mode
    cases = [(m, f"p100x16-{n}") for m in mode.paper_models for n in mode.p100]
    cases += [(m, f"k80x64-{n}") for m in mode.paper_models for n in mode.k80]
    cases += [("gpt2", f"{t}-{n}") for t, n in mode.h100]
    rows = []
    for k, (name, spec) in enumerate(cases):
        rows.append(_public(bench.search(name, spec, section="throughput",
                                         label=f"{k + 1}/{len(cases)} ")))
    return {"rows": rows, "cost_source": "analytic", "proposals": mode.proposals}


def run_comm(bench: Workbench) -> dict:
    n = max(bench.mode.k80)
    row = bench.search("nmt", f"k80x64-{n}", section="comm")
    _, g, _ = bench.graph("nmt", n)
    leaves = [(p.path, list(p.shape), math.prod(p.shape) * np.dtype(p.dtype).itemsize)
              for p in g.params]
    out = {"devices": n, "topology": row["topology"], "batch": row["batch"],
           "param_bytes": sum(b for _, _, b in leaves),
           "largest_params": sorted(leaves, key=lambda x: -x[2])[:4],
           "strategies": {"data-parallel": row["baselines"]["data-parallel"],
                          "expert": row["baselines"]["expert-rnn"]}}
    if "soapjax" in row:
        out["strategies"]["soapjax"] = row["soapjax"]
    return out


def _timed_search(g, topo, cm, w, settings, resharder) -> tuple[Plan, float]:
    c0 = time.process_time()
    plan = find_plan(g, topo, costs=cm, reshard=resharder, optimizer=w.optimizer,
                     family=w.family, settings=settings)
    return plan, time.process_time() - c0


def _full_vs_delta(bench: Workbench, name: str, spec: str, proposals: int) -> dict:
    topo = load_topology(spec)
    w, g, _ = bench.graph(name, topo.num_devices)
    cm = cost.cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    resharder = reshard.Resharder(MeshShape.of(topo))  # the default (ideal) model
    out: dict[str, Any] = {"model": name, "topology": topo.name, "devices": topo.num_devices,
                           "operators": len(g.operators), "max_proposals": proposals}
    runs = {}
    try:
        for sim_mode in ("warm-up", "full", "delta"):  # warm-up: fills the shared memos
            settings = SearchSettings(max_proposals=proposals, seed=0,
                                      simulation="delta" if sim_mode == "warm-up" else sim_mode)
            runs[sim_mode] = _timed_search(g, topo, cm, w, settings, resharder)
    except ValueError as e:
        out["error"] = str(e)
        return out
    for sim_mode in ("full", "delta"):
        plan, cpu = runs[sim_mode]
        info = dict(plan.search)
        out[sim_mode] = {"cpu_s": cpu, "wall_s": info["search_time_s"],
                         "proposals": info["proposals"], "step_time_s": plan.step_time_s,
                         "history": [list(h) for h in info["history"]]}
    full, delta = runs["full"][0], runs["delta"][0]
    out["same_plan"] = (full.configs, full.zero_axes) == (delta.configs, delta.zero_axes)
    return out


def run_search_cost(bench: Workbench) -> dict:
    mode = bench.mode
    table = []
    cases = [(m, n) for m in mode.paper_models for n in mode.table4_devices]
    for k, (name, n) in enumerate(cases):
        bench.progress("search", f"Table 4 {k + 1}/{len(cases)}: {name} on {n} K80s, full and "
                                 f"delta")
        table.append(_full_vs_delta(bench, name, f"k80x64-{n}", mode.table4_proposals))
    n12 = 16 if 16 in mode.p100 else max(mode.p100)
    bench.progress("search", f"Figure 12: NMT on {n12} P100s, full and delta")
    fig12 = _full_vs_delta(bench, "nmt", f"p100x16-{n12}", mode.fig12_proposals)
    return {"table4": table, "fig12": fig12, "cost_source": "analytic"}


def run_quality(bench: Workbench) -> dict:
    mode = bench.mode
    optimum = []
    for k, (name, config, spec) in enumerate(mode.optimum_cases):
        bench.progress("quality", f"global optimum {k + 1}/{len(mode.optimum_cases)}: {name} "
                                  f"({config}) on {spec}")
        optimum.append(_global_optimum(name, config, spec, mode.optimum_proposals))
    cases = [(m, n) for m in mode.local_models for n in mode.local_devices]
    local = [_local_optimality(bench, name, n, f"{k + 1}/{len(cases)} ")
             for k, (name, n) in enumerate(cases)]
    budget = []
    for k, (name, spec) in enumerate(mode.budget_cases):
        row = _longer_search(bench, name, spec, f"{k + 1}/{len(mode.budget_cases)} ")
        if row is not None:
            budget.append(row)
    return {"optimum": optimum, "local": local, "budget": budget, "proposals": mode.proposals,
            "cost_source": "analytic"}


def _local_optimality(bench: Workbench, name: str, n: int, label: str) -> dict:
    """Whether the searched plan of `name` on `n` P100s is a local optimum: no single-operator
    change is faster (and fits)."""
    entry = bench.search(name, f"p100x16-{n}", section="quality", label=label)
    if "error" in entry:
        return {"model": name, "devices": n, "error": entry["error"]}
    g, topo, cm, factor, strategy = entry["_live"]
    # a pipelined plan's neighbours are its operators' configs over one stage's mesh
    with open_simulation(g, topo, strategy, cost_model=cm, opt_state_factor=factor) as sim:
        mesh = MeshShape.of(sim.topology)
        c0 = time.process_time()
        change = improving_change(sim)
        return {"model": name, "devices": n, "operators": len(g.operators),
                "neighbours": sum(len(configs(op, mesh)) - 1 for op in g.operators),
                "stages": strategy.stages,
                "step_time_s": sim.step_time(), "local_optimum": change is None,
                "better_neighbour_s": None if change is None else change[2],
                "operator": None if change is None else g.operators[change[0]].name,
                "check_cpu_s": time.process_time() - c0}


def _longer_search(bench: Workbench, name: str, spec: str, label: str) -> dict | None:
    """The search of `name` on `spec` again with 10x the proposals per chain (None where no
    plan fits)."""
    mode = bench.mode
    entry = bench.search(name, spec, section="quality", label=label)
    if "error" in entry:
        return None
    g, topo, cm, _, _ = entry["_live"]
    bench.progress("quality", f"{label}search {name} on {topo.name} with "
                              f"{10 * mode.proposals} proposals per chain")
    w = bench.workload(name, topo.num_devices)
    c0 = time.process_time()
    long = find_plan(g, topo, costs=cm, optimizer=w.optimizer, family=w.family,
                     settings=SearchSettings(max_proposals=10 * mode.proposals, seed=0))
    return {"model": name, "topology": topo.name, "devices": topo.num_devices,
            "dp_s": entry["baselines"]["data-parallel"]["step_time_s"],
            "short_s": entry["soapjax"]["step_time_s"],
            "short_proposals": entry["search"]["proposals"],
            "long_s": long.step_time_s, "long_proposals": dict(long.search)["proposals"],
            "long_cpu_s": time.process_time() - c0}


def _global_optimum(name: str, config: str, spec: str, proposals: int) -> dict:
    topo = load_topology(spec)
    w = soapjax_zoo.get(name, config)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    cm = cost.cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    mesh = MeshShape.of(topo)
    sim = make_simulation(g, topo, cost_model=cm, opt_state_factor=factor)
    per_zero = math.prod(len(configs(op, mesh)) for op in g.operators)
    zeros = [z for k in range(len(mesh.axis_names) + 1)
             for z in itertools.combinations(mesh.axis_names, k)]
    best_t, best_zero = math.inf, None
    c0 = time.process_time()
    for zero in zeros:  # exhaustive() keeps the parameter storage fixed: try every ZeRO choice
        sim.reset(Strategy(data_parallel(g, mesh).configs, zero_axes=zero))
        try:
            _, t = exhaustive(sim, max_leaves=10**9)
        except ValueError:  # nothing fits with this storage
            continue
        if t < best_t:
            best_t, best_zero = t, zero
    exhaustive_s = time.process_time() - c0
    c0 = time.process_time()
    found = find_plan(g, topo, costs=cm, optimizer=w.optimizer, family=w.family,
                      settings=SearchSettings(max_proposals=proposals, seed=0))
    return {"model": name, "config": config, "topology": topo.name,
            "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes)), "operators": len(g.operators),
            "strategies": per_zero * len(zeros), "optimum_s": best_t,
            "optimum_zero_axes": list(best_zero or ()), "exhaustive_cpu_s": exhaustive_s,
            "found_s": found.step_time_s, "search_cpu_s": time.process_time() - c0,
            "proposals": dict(found.search)["proposals"], "max_proposals": proposals,
            "found_optimum": found.step_time_s <= best_t * (1 + 1e-9)}


def run_accuracy(bench: Workbench) -> dict:
    mode = bench.mode
    dev = jax.devices()[0]
    out: dict[str, Any] = {"backend": f"{dev.platform} ({dev.device_kind})",
                           "devices": len(jax.devices()), "single": [], "multi": [],
                           "config": "tiny", "repeats": mode.repeats}
    with _fresh_operator_costs() as tmp:
        for k, name in enumerate(mode.accuracy_models):
            bench.progress("accuracy", f"one device {k + 1}/{len(mode.accuracy_models)}: {name}")
            out["single"].append(_one_device(name, tmp))
        if dev.platform == "cpu" and len(jax.devices()) >= 8:
            for k, name in enumerate(mode.accuracy_multi_models):
                out["multi"] += _eight_devices(bench, name, tmp, k)
            out["multi_left_out"] = [m for m in mode.accuracy_models
                                     if m not in mode.accuracy_multi_models]
        else:
            out["multi_skipped"] = (f"the local backend is {dev.platform} with "
                                    f"{len(jax.devices())} devices, not 8 CPU devices")
    return out


@contextlib.contextmanager
def _fresh_operator_costs() -> Iterator[str]:
    """A temporary cache root for the run (its path), with the resharding cache shared.

    Operator times are measured afresh in this process (they drift between processes); XLA's
    resharding collectives are deterministic, so their cache is the usual one.
    """
    reshard_cache = cache_root() / "reshard"
    saved = os.environ.get(CACHE_ENV)
    with tempfile.TemporaryDirectory(prefix="soapjax-eval-") as tmp:
        reshard_cache.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / "reshard").symlink_to(reshard_cache, target_is_directory=True)
        os.environ[CACHE_ENV] = tmp
        try:
            yield tmp
        finally:
            if saved is None:
                os.environ.pop(CACHE_ENV, None)
            else:
                os.environ[CACHE_ENV] = saved


def _one_device(name: str, cache_dir: str) -> dict:
    """The measured unsharded step against the simulated one-device step (measured costs)."""
    w = soapjax_zoo.get(name, "tiny")
    local = devices.local_topology()
    one = scaled_topology(local, 1)
    cal = cost.calibrate(w, topology=local, cache_dir=cache_dir)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)
    cm = cost.cost_model(g, one, mode="measured", cache_dir=cache_dir, optimizer=w.optimizer)
    mesh = MeshShape.of(one)
    strategy = Strategy(tuple(configs(op, mesh)[0] for op in g.operators))  # replicated
    sim = make_simulation(g, one, cost_model=cm, strategy=strategy,
                          opt_state_factor=opt_state_factor(w.optimizer, w.abstract_params()))
    t = sim.step_time()
    return {"model": name, "operators": len(g.operators), "measured_s": cal.step_s,
            "spread": cal.step_spread, "simulated_s": t, "error": t / cal.step_s - 1.0}


def _eight_devices(bench: Workbench, name: str, cache_dir: str, k: int) -> list[dict]:
    """Several plans of `name` applied on the 8 CPU devices, measured and simulated."""
    mode = bench.mode
    topo = load_topology("cpu8")
    w = soapjax_zoo.get(name, "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)
    mesh = MeshShape.of(topo)
    base = baselines(g, topo, w.family)
    wanted = ["data-parallel", "megatron", "fsdp", expert_name({"family": w.family})]
    plans = {b: base[b] for b in wanted if b in base and b in mode.accuracy_baselines}
    rng = np.random.default_rng(0)
    for r in range(mode.accuracy_plans):
        plans[f"random-{r}"] = random_strategy(g, mesh, rng)
    bench.progress("accuracy", f"8 devices {k + 1}/{len(mode.accuracy_multi_models)}: {name}: "
                               "search")
    # Analytic costs (the `cpu8` file's rough figures) choose the plan: measuring every shard
    # program a search visits costs minutes per model on a 2-core host. `check` then
    # predicts every plan's step with measured costs.
    found = find_plan(g, topo, costs="analytic", optimizer=w.optimizer, family=w.family,
                      settings=SearchSettings(max_proposals=mode.accuracy_proposals, seed=0))
    plans["soapjax"] = found.strategy(g, topo)
    rows = []
    for j, (pname, strategy) in enumerate(plans.items()):
        bench.progress("accuracy", f"8 devices {k + 1}/{len(mode.accuracy_multi_models)}: {name}: "
                                   f"plan {j + 1}/{len(plans)} {pname}")
        row: dict[str, Any] = {"model": name, "plan": pname}
        try:
            c = compare_on_devices(Plan.make(g, topo, strategy, model_config="tiny"),
                                   soapjax_zoo.get(name, "tiny"), repeats=mode.repeats,
                                   costs="measured", reshard="xla")
        except Exception as e:  # noqa: BLE001  one plan failing must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            continue
        row |= {"measured_s": c.measured_step_s, "simulated_s": c.predicted_step_s,
                "error_rel": c.predicted_step_s / c.measured_step_s - 1.0,
                "hlo_bytes": c.hlo_collective_bytes,
                "predicted_bytes": c.predicted_collective_bytes,
                "max_abs_diff": c.max_abs_diff}
        rows.append(row)
    return rows


RUNNERS = {"throughput": run_throughput, "comm": run_comm, "search": run_search_cost,
           "quality": run_quality, "accuracy": run_accuracy}
