"""Megatron's distributed optimizer (`Strategy.optimizer_axes`, ZeRO-1): the optimizer state
sharded over the data-parallel axes, parameters and gradients in their own layout.

Applied, the step computes what the unsharded step does (float64, cpu8) and keeps the
optimizer state split; simulated, the optimizer state per device shrinks by the axes' degree
and the gradient's all-reduce becomes a reduce-scatter followed by an all-gather; the plan
file, the strategy file, `megatron_3d`, its grid and the search's move carry it.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_apply import (
    MESH_SHAPE,
    X64_ATOL,
    X64_RTOL,
    assert_matches,
    assert_sharded_as,
    case,
    megatron,
    run_sharded,
    unsharded,
)

import soapjax_zoo as zoo
from soapjax.base.errors import PlanError
from soapjax.cost.operators import cost_model
from soapjax.graph.opgraph import trace
from soapjax.search import make_simulation
from soapjax.search._chain import OPTIMIZER_MOVES, SearchSettings, _Searcher
from soapjax.simulate.front import parse_strategy, simulate
from soapjax.strategy import space
from soapjax.strategy.baselines import megatron_3d, megatron_grid
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import Strategy
from soapjax.topology.cluster import load_topology, make_mesh

CPU8 = load_topology("cpu8")


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(CPU8)


def _distributed(kind: str, graph) -> Strategy:
    if kind == "data_parallel":  # every axis is data parallel
        return dataclasses.replace(space.data_parallel(graph, MESH_SHAPE),
                                   optimizer_axes=("data", "model"))
    return dataclasses.replace(megatron(graph, MESH_SHAPE), optimizer_axes=("data",))


@pytest.mark.parametrize("name,kind", [("mlp", "data_parallel"), ("mlp", "megatron"),
                                       ("gpt2", "megatron")])
def test_step_matches_unsharded_with_optimizer_state_sharded(name, kind, mesh):
    c = case(name)
    strategy = _distributed(kind, c.graph)
    out, shardings = run_sharded(c, strategy, mesh)
    assert_matches(out, unsharded(name), rtol=X64_RTOL, atol=X64_ATOL)
    assert_sharded_as(out[0], shardings.params)
    assert_sharded_as(out[1], shardings.opt_state)
    # the moments of every parameter (here all divisible) are split over the optimizer axes,
    # the parameters as without them
    plain = space.param_specs(c.graph, dataclasses.replace(strategy, optimizer_axes=()),
                              MESH_SHAPE)
    specs = space.optimizer_specs(c.graph, strategy, MESH_SHAPE)
    assert [s.spec for s in jax.tree.leaves(shardings.params)] == [
        space.to_partition_spec(space.fit_spec(plain[leaf.path], leaf.shape, MESH_SHAPE))
        for leaf in c.graph.params]
    moments = {s.spec for s in jax.tree.leaves(shardings.opt_state)} - {P()}
    assert moments and all("data" in jax.tree.leaves(tuple(s)) for s in moments), moments
    assert set(specs) == {leaf.path for leaf in c.graph.params}


def test_megatron_fc1_moments_split_over_data(mesh):
    """The Megatron column-parallel kernel [16, 32]: parameter P(None, 'model'), its moments
    P('data', 'model') (`space.optimizer_specs`' example)."""
    c = case("mlp")
    out, shardings = run_sharded(c, _distributed("megatron", c.graph), mesh)
    assert shardings.params["params"]["fc1"]["kernel"].spec == P(None, "model")
    assert shardings.grads["params"]["fc1"]["kernel"].spec == P("data", "model")
    kernels = [(s.spec, x.shape) for x, s in zip(jax.tree.leaves(out[1]),
                                                 jax.tree.leaves(shardings.opt_state))
               if x.shape == (16, 32)]
    assert kernels and all(spec == P("data", "model") for spec, _ in kernels), kernels


def _collectives(strategy, c, mesh) -> set[str]:
    from soapjax.apply.step import sharded_train_step
    step, _ = sharded_train_step(c.graph, strategy, mesh, c.workload.optimizer,
                                 params=c.params, batch=c.batch)
    text = step.lower(c.params, c.opt_state, c.batch).compile().as_text()
    return set(re.findall(r"(all-reduce|reduce-scatter|all-gather|dynamic-slice)\(", text))


def test_the_update_is_on_shards_and_all_gathered(mesh):
    """The gradient is constrained to the optimizer state's layout and the updated parameters
    all-gathered, the collectives ZeRO-3 compiles to. (XLA:CPU reduces the gradient by an
    all-reduce and slices it, under ZeRO too; XLA:GPU's reduce-scatter creator makes the pair
    one reduce-scatter.)"""
    c = case("mlp", x64=False)
    plain = space.data_parallel(c.graph, MESH_SHAPE)
    do = _collectives(_distributed("data_parallel", c.graph), c, mesh)
    zero = _collectives(dataclasses.replace(plain, zero_axes=("data", "model")), c, mesh)
    assert "all-gather" not in _collectives(plain, c, mesh)
    assert do == zero and {"all-gather", "dynamic-slice"} <= do, (do, zero)


# --- simulated ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt():
    w = zoo.get("gpt", "tiny", batch_size=16)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    return g, cost_model(g, CPU8, mode="analytic", optimizer=w.optimizer)


def test_simulated_optimizer_state_shrinks_by_the_data_parallel_degree(gpt):
    g, cm = gpt
    plain = megatron_3d(g, CPU8, tp=2)
    do = megatron_3d(g, CPU8, tp=2, distributed_optimizer=True)
    assert do.optimizer_axes == ("model",) and plain.optimizer_axes == ()  # tp=2 is 'data'
    a, b = simulate(g, CPU8, plain, cost_model=cm), simulate(g, CPU8, do, cost_model=cm)
    assert (b.memory.params, b.memory.grads, b.memory.activations) == (
        a.memory.params, a.memory.grads, a.memory.activations)
    assert b.memory.opt_state * 4 == a.memory.opt_state  # model=4 replicas
    # the gradients' all-reduce over 'model' is a reduce-scatter, the update an all-gather
    before, after = [t.name for t in a.tasks], [t.name for t in b.tasks]
    kernel = "['params']['layers']['mlp']['fc1']['kernel'][0]"
    assert f"all_reduce grad {kernel} over model" in before
    assert f"reduce_scatter grad {kernel} over model" in after
    assert f"all_gather {kernel} over model" in after
    assert not any(n.startswith("all_reduce grad") and n.endswith("over model") for n in after)
    # the updates run on a quarter of the bytes (each also pays cpu8's fixed kernel overhead)
    def update(r):
        return sum(t.end_s - t.start_s for t in r.tasks if t.kind == "update")

    assert update(b) < update(a)


# --- carried by plans, strategy files, Megatron's grid and the search ---------------------------


def test_plan_and_strategy_file_carry_the_optimizer_axes(gpt, tmp_path):
    g, _ = gpt
    s = megatron_3d(g, CPU8, tp=2, distributed_optimizer=True)
    plan = Plan.make(g, CPU8, s)
    assert plan.to_json()["optimizer_axes"] == ["model"]
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path).strategy(g, CPU8) == s
    assert parse_strategy(g, CPU8, str(path)) == s
    hand = parse_strategy(g, CPU8, {"configs": {}, "optimizer_axes": ["data", "model"]})
    assert hand.optimizer_axes == ("data", "model")
    with pytest.raises(PlanError, match="optimizer_axes \\['gpu'\\]: expected a list of mesh"):
        parse_strategy(g, CPU8, {"configs": {}, "optimizer_axes": ["gpu"]})
    with pytest.raises(PlanError, match="Strategy.optimizer_axes must be a sequence of mesh"):
        Strategy(s.configs, optimizer_axes="data")


def test_megatron_grid_tries_the_distributed_optimizer(gpt):
    g, _ = gpt
    grid = megatron_grid(g, CPU8, tp=(2, 8))
    assert grid["megatron-tp2-do-mb1-full"] == megatron_3d(
        g, CPU8, tp=2, microbatch_size=1, sequence_parallel=True, distributed_optimizer=True)
    assert grid["megatron-tp2-mb1-full"].optimizer_axes == ()
    # tp=8 on cpu8 leaves no replicas: no -do twin
    assert "megatron-tp8-mb16-full" in grid and "megatron-tp8-do-mb16-full" not in grid
    assert len(megatron_grid(g, CPU8, tp=(2,), distributed_optimizer=(False,))) * 2 == len(
        megatron_grid(g, CPU8, tp=(2,)))


def test_the_search_toggles_the_distributed_optimizer(gpt):
    g, cm = gpt
    sim = make_simulation(g, CPU8, cost_model=cm)
    searcher = _Searcher(sim, SearchSettings(seed=0), None)
    searcher.rng = np.random.default_rng(0)
    draws = [searcher._draw(1, lambda: sim.strategy) for _ in range(2000)]
    toggles = [d for d in draws if d is not None and isinstance(d[3], tuple)]
    assert toggles and all(d[3] == ("data", "model") for d in toggles)
    assert len(toggles) == pytest.approx(2000 * OPTIMIZER_MOVES, rel=0.5)
    before = sim.step_time()
    sim.propose_strategy(dataclasses.replace(sim.strategy, optimizer_axes=("data", "model")))
    assert sim.strategy.optimizer_axes == ("data", "model")
    dp = simulate(g, CPU8, space.data_parallel(g, MESH_SHAPE), cost_model=cm).memory
    assert sim.memory_breakdown().opt_state * 8 == dp.opt_state
    sim.reject()
    assert sim.strategy.optimizer_axes == () and sim.step_time() == before


def test_gpt_175b_on_512_a100s_sheds_seven_eighths_of_the_optimizer_state():
    """GPT 175B, TP 8, PP 8, DP 8 on 512 80 GB A100s (selective recomputation, SP, microbatch
    1): the distributed optimizer keeps 1/8 of Adam's moments per device, 22.99 GB -> 2.87 GB,
    and the peak falls by the 20.1 GB difference, 58.61 GB -> 38.49 GB. (On 64 A100s TP 8 x
    PP 8 leaves no data parallelism: nothing to shard over, the same strategy.)"""
    from soapjax.topology.cluster import scaled_topology
    topo = scaled_topology(load_topology("dgx-a100x3072"), 512)
    w = zoo.get("gpt", "175b", batch_size=64)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    costs = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    memory, peak = {}, {}
    for do in (False, True):
        s = megatron_3d(g, topo, tp=8, pp=8, microbatch_size=1, recompute="selective",
                        sequence_parallel=True, distributed_optimizer=do)
        assert s.optimizer_axes == (("node",) if do else ())
        r = simulate(g, topo, s, cost_model=costs)
        memory[do], peak[do] = r.memory, max(r.peak_memory_bytes) / 1e9
    assert memory[True].opt_state == pytest.approx(memory[False].opt_state / 8, rel=1e-3)
    assert memory[False].opt_state / 1e9 == pytest.approx(22.99, abs=0.01)
    assert peak[False] == pytest.approx(58.61, abs=0.05)
    assert peak[False] - peak[True] == pytest.approx(
        (memory[False].opt_state - memory[True].opt_state) / 1e9, abs=0.01)
    assert memory[True].params == memory[False].params
