"""Compute beside a running collective runs slower (`soapjax.simulate._taskgraph`, contention).

A GPU's ``[device.kernels].overlap_slowdown`` (sigma): a compute task that starts while a
collective issued before it still runs computes at ``1 / (1 + sigma)`` of its rate until the
collective ends. Checked here:

* the rule on a hand-built task graph: work done at the slow rate, then at the full one;
* the delta pass equals the full pass when a collective's time changes far from the compute it
  slows (the pass must go past its marks to the compute that read the old end);
* a GPT-2 step under data parallelism on 8 H100s: the backward tasks beside the gradient
  all-reduces are the ones slowed, each by at most sigma, and the step lies between the
  uncontended step and that step plus sigma times the compute;
* the topology file: the shipped A100 and H100 files carry the published 0.189; a bad value is
  refused with what was expected.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest

import soapjax_zoo
from soapjax import cli
from soapjax.base.errors import TopologyError
from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import Resharder
from soapjax.graph.opgraph import trace
from soapjax.simulate._taskgraph import NONE, TaskGraph
from soapjax.simulate.front import Simulation
from soapjax.strategy.space import MeshShape, data_parallel
from soapjax.topology.cluster import MESHES_DIR, load_topology

MESHES = MESHES_DIR


def chain(sigma: float) -> tuple[TaskGraph, dict[str, int]]:
    """Compute tasks of 4 s and collectives on channel 1: "early" (key 0), a collective of
    10 s (key 1), "a" and "b" (keys 2, 3), a collective of 6 s after "a" (key 4), "c"."""
    g = TaskGraph(2, contention=sigma)
    tasks = {
        "early": g.new(0, 4.0, (0,), [], "early"),
        "comm": g.new(1, 10.0, (1,), [], "comm"),
        "a": g.new(2, 4.0, (0,), [], "a"),
        "b": g.new(3, 4.0, (0,), [], "b"),
    }
    tasks["comm2"] = g.new(4, 6.0, (1,), [tasks["a"]], "comm2")
    tasks["c"] = g.new(5, 4.0, (0,), [], "c")
    g.build()
    g.full_pass()
    return g, tasks


def times(g: TaskGraph) -> list[tuple[float, float]]:
    return [(g.start[t], g.end[t]) for t in g.order]


def test_compute_beside_a_collective_runs_at_one_over_one_plus_sigma():
    g, t = chain(1.0)
    # issued before the collective: the pass does not see it (module doc), full speed
    assert (g.start[t["early"]], g.end[t["early"]]) == (0.0, 4.0)
    # from 4 s to 10 s the collective runs: 6 s at half rate do 3 s of "a"'s work, 1 s after
    assert (g.start[t["a"]], g.end[t["a"]]) == (4.0, 11.0)
    # comm2 (issued after "b", 11-17 s) overlaps "b" but does not slow it: the pass knows only
    # the collectives issued before a task; the first one ended at 10 s
    assert (g.start[t["comm2"]], g.end[t["comm2"]]) == (11.0, 17.0)
    assert (g.start[t["b"]], g.end[t["b"]]) == (11.0, 15.0)
    # "c" (issued after comm2) starts at 15 s beside it: 2 s at half rate, then 3 s
    assert (g.start[t["c"]], g.end[t["c"]]) == (15.0, 20.0)
    # part of a task beside the collective: 1 s at half rate (0.5 s of work), 3.5 s after
    g2 = TaskGraph(2, contention=1.0)
    comm = g2.new(0, 2.0, (1,), [], "comm")
    first = g2.new(1, 1.0, (0,), [], "first")
    second = g2.new(2, 4.0, (0,), [first], "second")
    g2.build()
    g2.full_pass()
    assert g2.end[first] == 2.0 and g2.end[second] == pytest.approx(6.0)
    assert g2.end[comm] == 2.0
    g0, t0 = chain(0.0)
    assert g0.end[t0["a"]] == 8.0 and g0.end[t0["c"]] == 16.0


def test_delta_pass_equals_full_pass_past_its_marks():
    for sigma in (0.189, 1.0):
        g, t = chain(sigma)
        for dur in (2.0, 30.0, 5.0, 10.0):
            g.set_dur(t["comm"], dur)  # marks only the collective (key 1)
            g.sweep()
            fresh = copy.deepcopy(g)
            fresh.full_pass()
            assert times(g) == times(fresh), (sigma, dur)
            assert g.busy == fresh.busy
        assert g.lo is None and NONE not in g.order


def test_contention_slows_the_backward_beside_the_gradient_all_reduces():
    w = soapjax_zoo.get("gpt2", "tiny")
    graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt2")
    base = load_topology("dgx-h100x8")
    sigma = base.device.kernels.overlap_slowdown
    assert sigma == pytest.approx(0.189)
    off = dataclasses.replace(base, device=dataclasses.replace(
        base.device, kernels=dataclasses.replace(base.device.kernels, overlap_slowdown=0.0)))
    steps = {}
    for name, topo in (("on", base), ("off", off)):
        costs = cost_model(graph, topo, mode="analytic")
        sim = Simulation(graph, topo, costs, Resharder(topo),
                         data_parallel(graph, MeshShape.of(topo)))
        steps[name] = sim.result()
    on, off_r = steps["on"], steps["off"]
    slowed = [(a, b) for a, b in zip(on.tasks, off_r.tasks)
              if a.kind in ("forward", "backward", "update")
              and (a.end_s - a.start_s) > (b.end_s - b.start_s) * (1 + 1e-12)]
    assert slowed, "no compute task ran beside a gradient all-reduce"
    assert {a.kind for a, _ in slowed} <= {"backward", "update"}
    for a, b in slowed:
        assert a.end_s - a.start_s <= (b.end_s - b.start_s) * (1 + sigma) * (1 + 1e-12)
    extra = on.compute_s - off_r.compute_s
    assert extra > 0
    assert on.contention_s == pytest.approx(extra, rel=1e-9) and off_r.contention_s == 0.0
    assert on.to_json()["contention_s"] == on.contention_s
    assert off_r.step_time_s < on.step_time_s <= off_r.step_time_s + sigma * off_r.compute_s
    # the gradient all-reduces are what ran beside them: the same bytes either way
    assert on.bytes_moved == off_r.bytes_moved


def test_overlap_slowdown_is_read_from_the_file_and_checked(tmp_path):
    for name in ("dgx-a100x3072", "dgx-h100x8", "dgx-h100x32", "h100x64", "dgx-h100x1024"):
        assert load_topology(name).device.kernels.overlap_slowdown == pytest.approx(0.189)
    assert load_topology("cpu8").device.kernels is None  # no contention on the CPU files
    base = (MESHES / "dgx-h100x8.toml").read_text()
    f = tmp_path / "bad.toml"
    f.write_text(re.sub(r"overlap_slowdown = [0-9.]+", "overlap_slowdown = -0.1", base))
    with pytest.raises(TopologyError, match=r"\[device.kernels\].overlap_slowdown: expected a "
                       r"number from 0 to 4 .* found -0.1"):
        load_topology(str(f))
    f.write_text(re.sub(r"overlap_slowdown = [0-9.]+", 'overlap_slowdown = "high"', base))
    with pytest.raises(TopologyError, match="overlap_slowdown: expected a number"):
        load_topology(str(f))
    with pytest.raises(ValueError, match="contention: expected a slowdown >= 0"):
        TaskGraph(1, contention=-1.0)


def test_simulate_says_how_much_compute_contention_cost(capsys):
    argv = ["simulate", "--model", "gpt2", "--config", "tiny", "--mesh", "dgx-h100x8",
            "--costs", "analytic", "--strategy", "data-parallel"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("contention"))
    assert "ms of the compute" in line and "overlap_slowdown" in line
    assert cli.main(argv[:6] + ["cpu8"] + argv[7:]) == 0  # no kernel table: no such line
    assert "contention" not in capsys.readouterr().out
