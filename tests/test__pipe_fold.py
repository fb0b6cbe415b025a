"""A pipeline stage simulated on a few of its layers (`soapjax.simulate._pipe_fold`): the
whole stage's step, memory and chunk times read off the folds equal the whole simulation's."""

import contextlib
import dataclasses
import random

import pytest

from soapjax.base.errors import PlanError
from soapjax.cost import operators as cost
from soapjax.graph.opgraph import trace
from soapjax.simulate import front
from soapjax.simulate._flatsim import Simulation
from soapjax.simulate._pipe_fold import (
    FOLD_LAYERS,
    FoldedStage,
    LayerFold,
    folded_graph,
    layer_fold,
)
from soapjax.strategy import space
from soapjax.strategy.baselines import megatron_3d
from soapjax.strategy.memory import microbatch_error
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology, stage_topology
from soapjax_zoo import gpt, llama, moe

TOPOLOGY = "dgx-a100x3072-32"  # 4 DGX A100s: analytic GPU costs, nothing attached


def _graph(kind: str, layers: int = 16):
    if kind == "gpt":  # Megatron's dropout: layer 0 reads the seed, the others a carried key
        w = gpt.build_gpt("gpt", "fold", dataclasses.replace(
            gpt._TINY, num_layers=layers, dropout=0.1, batch_size=16), "linen")
    elif kind == "llama":  # RoPE, grouped-query attention, SwiGLU
        w = llama.build_llama("llama", "fold", dataclasses.replace(
            llama.LLAMA_CONFIGS["tiny"], num_layers=layers, batch_size=16), "linen")
    else:
        w = moe.build_moe("moe", "fold", dataclasses.replace(
            moe._TINY, num_layers=layers, batch_size=16), "linen")
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name), w


@pytest.fixture(scope="module")
def gpt16():
    return _graph("gpt")


@pytest.fixture(scope="module")
def llama16():
    return _graph("llama")


def _summary(sim):
    r = sim.result()
    t = r.chunk_times
    return (r.step_time_s, r.peak_memory_bytes, *t.forward_s, *t.backward_s, *t.send_s,
            *r.tail_s, *r.prologue_s, *(m.total for m in r.stage_memory))


def _assert_close(whole, folded):
    assert len(whole) == len(folded)
    for a, b in zip(whole, folded):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-15)


def _walk(graph, workload, stages, virtual, tp, seed=0, proposals=25, strategies=()):
    """The whole and the folded simulation walked through the same tied proposals (some
    accepted), then reset to `strategies`; their summaries at every step."""
    topology = load_topology(TOPOLOGY)
    mesh = MeshShape.of(stage_topology(topology, stages))
    start = megatron_3d(graph, topology, tp=tp, pp=stages, microbatch_size=1,
                        interleave=virtual, recompute="selective", sequence_parallel=True)
    m = start.microbatches
    choices = [[c for c in space.configs(op, mesh) if not microbatch_error(op, c, mesh, m)]
               for op in graph.operators]
    costs = cost.cost_model(graph, topology, mode="analytic", optimizer=workload.optimizer)
    rng = random.Random(seed)
    tied = {i: block for block in graph.repeated_blocks() for i in block}
    moves = []
    for _ in range(proposals):
        i = rng.randrange(len(graph.operators))
        config = rng.choice(choices[i])
        policy = rng.choice([None, "none", "full", "selective"]) if i in tied else None
        moves.append(([(j, config, policy) for j in tied.get(i, [i])], rng.random() < 0.3))
    out = {}
    for fold in (False, True):
        with front.open_simulation(graph, topology, start, cost_model=costs, fold=fold) as sim:
            assert isinstance(sim._inner, FoldedStage if fold else Simulation)
            seen = [_summary(sim)]
            for changes, keep in moves:
                sim.propose_many(changes)
                seen.append(_summary(sim))
                sim.accept() if keep else sim.reject()
                seen.append(_summary(sim))
            for s in strategies:
                sim.reset(s(start))
                seen.append(_summary(sim))
                sim.propose_strategy(s(sim.strategy).with_microbatches(m // 2))
                seen.append(_summary(sim))
                sim.reject()
            if virtual == 1:  # uneven stages: the layers' moves read the stored shards
                cut = [16 // stages] * stages
                cut[0] -= 1
                cut[-1] += 1
                r = sim.stage_layers_result(tuple(cut))
                seen.append((r.step_time_s, r.peak_memory_bytes, *r.chunk_times.forward_s))
            out[fold] = (seen, sim.strategy)
    assert out[True][1] == out[False][1]  # the folded stage's strategy is the whole graph's
    return out[False][0], out[True][0]


def test_layer_fold_finds_the_layers_and_folds_the_graph(gpt16):
    graph, _ = gpt16
    fold = layer_fold(graph)
    assert fold is not None and fold.layers == 16
    assert graph.operators[fold.first].name == "layers_0/ln_1"
    assert graph.operators[fold.index(fold.layers, 0)].name == "ln_f"
    for keep in FOLD_LAYERS:
        g = folded_graph(graph, fold, keep)
        assert len(g.operators) == len(graph.operators) - (16 - keep) * fold.per_layer
        ln_f = g.operator("ln_f")
        # the epilogue reads the last kept layer where it read the last layer
        assert [x.source for x in ln_f.inputs if x.kind == "activation"] == [
            f"layers_{keep - 1}/mlp/fc2"]
        assert g.params == graph.params


@pytest.mark.parametrize("stages,virtual,tp", [(4, 2, 2), (4, 1, 8), (2, 2, 4)])
def test_folded_stage_prices_gpt_as_the_whole_stage(gpt16, stages, virtual, tp):
    graph, workload = gpt16
    whole, folded = _walk(graph, workload, stages, virtual, tp, seed=stages + virtual)
    _assert_close(whole, folded)


def test_folded_stage_prices_llama_with_zero_and_the_distributed_optimizer(llama16):
    graph, workload = llama16

    def zero(s):
        return dataclasses.replace(s, zero_axes=("data",))

    def distributed(s):
        return dataclasses.replace(s, optimizer_axes=("data",), recompute=())

    whole, folded = _walk(graph, workload, 2, 2, 4, strategies=(zero, distributed))
    _assert_close(whole, folded)


def test_folded_stage_needs_tied_layers(gpt16):
    graph, workload = gpt16
    topology = load_topology(TOPOLOGY)
    start = megatron_3d(graph, topology, tp=2, pp=4, microbatch_size=1, recompute="selective")
    fold = layer_fold(graph)
    one = fold.index(5, 1)  # layer 5's query projection alone, in another layout
    other = next(c for c in space.configs(graph.operators[one],
                                          MeshShape.of(stage_topology(topology, 4)))
                 if c != start.configs[one])
    untied = dataclasses.replace(start, configs=tuple(
        other if i == one else c for i, c in enumerate(start.configs)))
    costs = cost.cost_model(graph, topology, mode="analytic", optimizer=workload.optimizer)
    with contextlib.ExitStack() as stack:
        # an untied strategy is simulated whole
        sim = stack.enter_context(front.open_simulation(graph, topology, untied,
                                                        cost_model=costs, fold=True))
        assert isinstance(sim._inner, Simulation)
        sim = stack.enter_context(front.open_simulation(graph, topology, start,
                                                        cost_model=costs, fold=True))
        assert isinstance(sim._inner, FoldedStage)
        with pytest.raises(PlanError, match="every layer's operators alike"):
            sim.propose(one, untied.configs[one])
        with pytest.raises(PlanError, match="every layer's operators alike"):
            sim.reset(untied)
        with pytest.raises(PlanError, match="no whole timeline"):
            sim.stage_result()


def test_the_mixture_of_experts_layers_fold_and_price_as_whole_stages():
    # the tiny mixture of experts' grouping put layer 0's load-balancing sum (a scalar side
    # computation, sharing no value with its operator's anchor) into the last layer's expert
    # matmul, so its layers were not alike and nothing folded; it now joins the operator that
    # reads it (`soapjax.graph._grouping`), the layers are alike, and the folded stage prices
    # the pipeline as the whole stages do
    graph, workload = _graph("moe")
    assert layer_fold(graph) is not None
    topology = load_topology(TOPOLOGY)
    start = megatron_3d(graph, topology, tp=2, pp=2, microbatch_size=1, recompute="selective")
    costs = cost.cost_model(graph, topology, mode="analytic", optimizer=workload.optimizer)
    times = []
    for fold in (True, False):
        with front.open_simulation(graph, topology, start, cost_model=costs, fold=fold) as sim:
            assert isinstance(sim._inner, FoldedStage if fold else Simulation)
            times.append(sim.step_time())
    assert times[0] == pytest.approx(times[1], rel=1e-9)


def test_a_search_with_folded_stages_ends_where_whole_stages_end(gpt16, monkeypatch):
    # the search's pipelines are simulated folded; with every pipeline simulated whole, the
    # same proposal count ends on the same plan at the same price
    from soapjax.search import find, pipelines
    graph, workload = gpt16
    topology = load_topology(TOPOLOGY)
    costs = cost.cost_model(graph, topology, mode="analytic", optimizer=workload.optimizer)
    settings = find.SearchSettings(max_proposals=8, seed=0, pipelines=True, processes=1)
    folded = find.search(graph, topology, cost_model=costs, settings=settings)
    opened = pipelines.open_simulation

    def whole(*args, **kwargs):
        return opened(*args, **{**kwargs, "fold": False})

    monkeypatch.setattr(pipelines, "open_simulation", whole)
    found = find.search(graph, topology, cost_model=costs, settings=settings)
    assert folded.strategy.pipelined and found.strategy == folded.strategy
    assert folded.step_time_s == pytest.approx(found.step_time_s, rel=1e-9)
    assert folded.proposals == found.proposals


def test_folded_stage_prices_zero_bubble_as_the_whole_stage(gpt16):
    """ZB-H1's W per chunk reads each operator's forward time (its twin's, folded): the same
    prices as the whole stage's."""
    graph, workload = gpt16
    topology = load_topology(TOPOLOGY)
    start = megatron_3d(graph, topology, tp=8, pp=4, microbatch_size=1,
                        recompute="selective").with_pipeline(4, 1, "zb-h1")
    costs = cost.cost_model(graph, topology, mode="analytic", optimizer=workload.optimizer)
    seen = {}
    for fold in (False, True):
        with front.open_simulation(graph, topology, start, cost_model=costs, fold=fold) as sim:
            assert isinstance(sim._inner, FoldedStage if fold else Simulation)
            seen[fold] = (*_summary(sim), *sim.result().chunk_times.weight_s)
    assert all(w > 0 for w in seen[True][-4:])
    _assert_close(seen[False], seen[True])


class _Fold:
    """A folded graph's simulation as `FoldedStage` reads it: one operator before the
    layers, one per layer, a head and a loss after; the layers' forwards 1 s each from t = 1,
    the head ready at `ready` (its weights' gather: the same in any number of layers) and 0.5
    s long, the loss 0.25 s after it."""

    def __init__(self, layers: int, ready: float):
        ends = [1.0 + k for k in range(layers + 1)]  # the prologue's, then each layer's
        head_start = max(ends[-1], ready)
        self.starts = [0.0] + ends[:-1] + [head_start, head_start + 0.5]
        self.ends = ends + [head_start + 0.5, head_start + 0.75]

    def compute_ends(self):
        return self.ends, [0.0] * len(self.ends)

    def forward_starts(self):
        return self.starts


@pytest.mark.parametrize("ready,want,late", [(0.0, 17.75, 0.0), (6.5, 17.75, 10.5),
                                             (30.0, 30.75, 0.0)])
def test_the_epilogue_waits_for_what_it_waited_for_in_the_folds(ready, want, late):
    """The head of a 16-layer graph, ready at `ready` whatever the layers (its weights'
    gather): layer-bound in 3 and 4 layers and in 16 (0.0), bound by its gather in 3 and 4
    and by the layers in 16 (6.5: a linear extrapolation says 7.25, 10.5 s early), or by its
    gather in all (30.0). The loss ends 0.75 s after the head starts; `late`: how much later
    the forward ends than the linear extrapolation says."""
    stage = FoldedStage.__new__(FoldedStage)
    stage._fold = LayerFold(first=1, per_layer=1, layers=16)
    stage._sims = [_Fold(3, ready), _Fold(4, ready)]
    ends, later = stage._epilogue_forward(  # the 16th layer ends at 17 s
        17.0, [sim.compute_ends()[0] for sim in stage._sims])
    assert ends[-1] == want and later == late
