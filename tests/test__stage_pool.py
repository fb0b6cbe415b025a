"""Stage simulations shared by a search's pipelines (`soapjax.simulate._stage_pool`): pipelines
sharing one read exactly what simulations of their own read, whatever the others did to it."""

import contextlib
import dataclasses
import random

import pytest

from soapjax.cost import operators as cost
from soapjax.graph.opgraph import trace
from soapjax.simulate import front
from soapjax.simulate._stage_pool import StagePool
from soapjax.strategy import space
from soapjax.strategy.baselines import megatron_3d
from soapjax.strategy.memory import microbatch_error
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology, stage_topology
from soapjax_zoo import gpt

TOPOLOGY = "dgx-a100x3072-32"  # 4 DGX A100s: analytic GPU costs, nothing attached
# (stages, virtual stages, schedule): two pipelines at 4 stages share a stage simulation
PIPELINES = ((4, 2, "interleaved"), (4, 1, "zb-h1"), (2, 1, "1f1b"))


@pytest.fixture(scope="module")
def gpt16():
    w = gpt.build_gpt("gpt", "pool", dataclasses.replace(
        gpt._TINY, num_layers=16, batch_size=16), "linen")
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name), w


def _summary(sim):
    r = sim.result()
    t = r.chunk_times
    return (r.step_time_s, r.peak_memory_bytes, *t.forward_s, *t.backward_s, *t.send_s,
            *r.tail_s, *(m.total for m in r.stage_memory))


def _starts(graph, topology):
    out = []
    for stages, virtual, schedule in PIPELINES:
        s = megatron_3d(graph, topology, tp=2, pp=stages, microbatch_size=1, interleave=virtual,
                        recompute="selective", sequence_parallel=True)
        out.append(s.with_pipeline(s.stages, s.virtual_stages, schedule, s.stage_layers))
    return out


def _moves(graph, topology, starts, seed, count=30):
    """Random tied proposals, each for one of the pipelines (kept or not), and a reset of one
    pipeline to another grid point now and then."""
    rng = random.Random(seed)
    tied = {i: block for block in graph.repeated_blocks() for i in block}
    moves = []
    for _ in range(count):
        k = rng.randrange(len(starts))
        if rng.random() < 0.15:
            moves.append((k, "reset", None))
            continue
        mesh = MeshShape.of(stage_topology(topology, starts[k].stages))
        m = starts[k].microbatches
        i = rng.randrange(len(graph.operators))
        choices = [c for c in space.configs(graph.operators[i], mesh)
                   if not microbatch_error(graph.operators[i], c, mesh, m)]
        config = rng.choice(choices)
        policy = rng.choice([None, "none", "full", "selective"]) if i in tied else None
        moves.append((k, [(j, config, policy) for j in tied.get(i, [i])], rng.random() < 0.4))
    return moves


def _walk(graph, workload, pool, seed):
    """The pipelines opened (with `pool`, or each its own stage simulation) and walked through
    the same moves; every pipeline's summary after each move."""
    topology = load_topology(TOPOLOGY)
    costs = cost.cost_model(graph, topology, mode="analytic", optimizer=workload.optimizer)
    starts = _starts(graph, topology)
    seen = []
    with contextlib.ExitStack() as stack:
        sims = [stack.enter_context(front.open_simulation(
            graph, topology, s, cost_model=costs, fold=True, stage_pool=pool)) for s in starts]
        for k, changes, keep in _moves(graph, topology, starts, seed):
            sim = sims[k]
            if changes == "reset":  # its start, every layer recomputed
                layers = {i for block in graph.repeated_blocks() for i in block}
                recompute = tuple("full" if i in layers else p for i, p in
                                  enumerate(starts[k].recompute or ("none",) * len(layers)))
                sim.reset(dataclasses.replace(starts[k], recompute=recompute))
            else:
                sim.propose_many(changes)
                seen.append(_summary(sim))
                sim.accept() if keep else sim.reject()
            seen.append(tuple(_summary(s) for s in sims))
        return seen, [s.strategy for s in sims], sims


@pytest.mark.parametrize("seed", [0, 1])
def test_pipelines_sharing_a_stage_read_what_their_own_would(gpt16, seed):
    graph, workload = gpt16
    alone, alone_strategies, _ = _walk(graph, workload, None, seed)
    with StagePool() as pool:
        shared, shared_strategies, sims = _walk(graph, workload, pool, seed)
        # the two pipelines at 4 stages share one stage simulation, the one at 2 its own
        assert sims[0]._shared is sims[1]._shared
        assert sims[2]._shared is not sims[0]._shared
    assert shared == alone  # bit for bit: full simulation is a pure function of the strategy
    assert shared_strategies == alone_strategies


def test_a_pending_proposal_keeps_the_stage_until_accepted(gpt16):
    graph, workload = gpt16
    topology = load_topology(TOPOLOGY)
    costs = cost.cost_model(graph, topology, mode="analytic", optimizer=workload.optimizer)
    first, second, _ = _starts(graph, topology)
    with StagePool() as pool, \
            front.open_simulation(graph, topology, first, cost_model=costs, fold=True,
                                  stage_pool=pool) as a, \
            front.open_simulation(graph, topology, second, cost_model=costs, fold=True,
                                  stage_pool=pool) as b:
        before = b.step_time()
        a.propose_many([(j, a.choice(j)[0], "full") for j in graph.repeated_blocks()[0]])
        with pytest.raises(RuntimeError, match="pending proposal"):
            b.reset(second.with_microbatches(second.microbatches * 2))
        a.reject()
        assert b.reset(second) == before


def test_the_pool_makes_one_resharder_a_stage_mesh_and_closes_it():
    mesh = MeshShape(("data", "model"), (2, 4))
    with StagePool() as pool:
        r = pool.resharder(mesh, "ideal")
        assert pool.resharder(mesh, "ideal") is r
        assert pool.resharder(MeshShape(("data",), (8,)), "ideal") is not r
