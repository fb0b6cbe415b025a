"""Recomputation chosen per operator within the memory (`soapjax.search.recompute`): priced
on real graphs, found by the search. Its plans computing the unsharded step's gradients:
tests/test_flash_attention.py."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import soapjax_zoo as zoo
from soapjax.apply._pipeline_layout import kept_positions
from soapjax.cost.operators import cost_model
from soapjax.graph.opgraph import trace
from soapjax.search import SearchSettings, make_simulation, search
from soapjax.search.recompute import relaxed
from soapjax.simulate.front import open_simulation, opt_state_factor, simulate
from soapjax.strategy.baselines import megatron_3d, with_recompute
from soapjax.strategy.space import tie_blocks
from soapjax.topology.cluster import load_topology


def _kept(graph, strategy) -> set[str]:
    """The first layer's operators that keep their outputs, by their name in the layer."""
    return {op.name.split("/", 1)[1] for j, op in enumerate(graph.operators)
            if op.name.startswith("layers_0/") and strategy.recompute_of(j) == "none"}


@functools.cache
def llama_128k():
    """Llama 3 8B at 128K tokens on one DGX H100 (docs/long-context.md's first case), analytic
    costs, and the best of Megatron-LM's three recompute policies there: TP2 CP4,
    microbatches of 2, full recomputation, the distributed optimizer."""
    w = zoo.get("llama", "8b-128k")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="llama")
    topo = load_topology("dgx-h100x8")
    cm = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    hand = tie_blocks(g, megatron_3d(g, topo, tp=2, cp=4, microbatch_size=2, recompute="full",
                                      sequence_parallel=True, distributed_optimizer=True))
    return g, topo, cm, factor, hand


def test_long_context_keeps_the_attention_core_at_more_microbatches():
    """At 128K tokens attention is most of a layer's time: recomputing the rest and keeping
    the attention core's and its output projection's outputs is 22 % faster (393.9 s against
    502.8 s), but fits only at microbatches of one sequence (77.8 GB; 102.8 GB at two), which
    the walk finds by trying more microbatches; the price is the full simulation's."""
    g, topo, cm, factor, hand = llama_128k()
    sim = make_simulation(g, topo, cost_model=cm, resharder="ideal", opt_state_factor=factor)
    sim.reset(hand)
    start = sim.step_time()
    assert hand.microbatches == 4 and sim.fits_in_memory()
    t, found = relaxed(sim, g, hand)
    assert t < 0.8 * start
    assert found.microbatches == 8 and _kept(g, found) == {"attn", "attn/o"}
    assert found.configs == hand.configs and found.optimizer_axes == hand.optimizer_axes
    r = simulate(g, topo, found, cost_model=cm, resharder="ideal", opt_state_factor=factor)
    assert r.step_time_s == pytest.approx(t, rel=1e-12) and r.fits_in_memory
    # the same change at the hand configuration's own microbatches does not fit
    same = dataclasses.replace(found, microbatches=hand.microbatches)
    assert not simulate(g, topo, same, cost_model=cm, resharder="ideal",
                        opt_state_factor=factor).fits_in_memory


def test_the_search_starts_a_chain_from_the_relaxed_best_start():
    """`search` relaxes its best start's recomputation and chains from it: a few proposals
    suffice to end 22 % below the best hand configuration, the attention core kept (from the
    relaxed start, ``...-kept``, or the full start's best tidied at the end: 393.71 s against
    the relaxed start's 393.88, `soapjax.search.recompute.tidied`)."""
    g, topo, cm, factor, hand = llama_128k()
    r = search(g, topo, cost_model=cm, resharder="ideal", opt_state_factor=factor,
               settings=SearchSettings(max_proposals=5, seed=0, pipelines=False))
    assert r.start.startswith("megatron-tp2-cp4-do-")
    best_hand = simulate(g, topo, hand, cost_model=cm, resharder="ideal",
                         opt_state_factor=factor).step_time_s
    assert r.step_time_s < 0.8 * best_hand
    assert "attn" in _kept(g, r.strategy)


def test_the_search_relaxes_a_recomputing_plan_where_the_best_recomputes_nothing():
    """On 64 H100s the fastest grid point of Llama 3 8B at 128K recomputes nothing (TP4 CP8,
    50.44 s); relaxing the fastest ones that recompute (`find._relaxed_starts`; its start then
    named ``...-kept``, or the full start's best tidied to the same plan at the end,
    `soapjax.search.recompute.tidied`) finds TP2 CP4 with every layer operator recomputed but
    the attention block, 2 % faster."""
    g, _, _, factor, _ = llama_128k()
    topo = load_topology("h100x64")
    cm = cost_model(g, topo, mode="analytic", optimizer=zoo.get("llama", "8b-128k").optimizer)
    r = search(g, topo, cost_model=cm, resharder="ideal", opt_state_factor=factor,
               settings=SearchSettings(max_proposals=5, seed=0, pipelines=False))
    grid_best = megatron_3d(g, topo, tp=4, cp=8, microbatch_size=1, recompute="selective",
                            sequence_parallel=True)
    t = simulate(g, topo, grid_best, cost_model=cm, resharder="ideal",
                 opt_state_factor=factor).step_time_s
    assert r.start.startswith("megatron-tp2-cp4") and r.step_time_s < 0.985 * t
    assert "attn" in _kept(g, r.strategy) and "mlp/up" not in _kept(g, r.strategy)


@functools.cache
def tiny_flash():
    w = zoo.get("llama", "tiny-flash", batch_size=8)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="llama")
    topo = load_topology("cpu8")
    full = tie_blocks(g, with_recompute(g, megatron_3d(g, topo, tp=4, cp=2), "full"))
    return g, topo, cost_model(g, topo, mode="analytic"), full


def _capped(topo, memory_bytes: int):
    return dataclasses.replace(topo, device=dataclasses.replace(topo.device,
                                                                memory_bytes=memory_bytes))


def test_the_walk_keeps_what_the_memory_holds():
    """The tiny flash llama on cpu8 (TP4 CP2, every layer operator recomputed): with room for
    everything the walk ends where nothing recomputes, as fast as that plan; with the memory
    cut to just above the full plan's peak (928,260 bytes simulated) it keeps the attention
    core's outputs (899,588 bytes: its segments are smaller) but not the output projection's
    as well (965,124)."""
    g, topo, cm, full = tiny_flash()
    sim = make_simulation(g, topo, cost_model=cm)
    t, found = relaxed(sim, g, full)
    none = dataclasses.replace(full, recompute=())
    assert found.microbatches == 1 and all(p == "none" for p in found.recompute)
    assert t == pytest.approx(simulate(g, topo, none, cost_model=cm).step_time_s, rel=1e-12)
    capped = _capped(topo, 930_000)
    sim = make_simulation(g, capped, cost_model=cm)
    sim.reset(full)
    start = sim.step_time()
    t, found = relaxed(sim, g, full)
    assert t < start and found.microbatches == 1
    assert "attn" in _kept(g, found) and "attn/o" not in _kept(g, found)
    assert simulate(g, capped, found, cost_model=cm).fits_in_memory


@functools.cache
def mixtral_8x22b():
    """Mixtral 8x22B on 256 H100s at 256 x 4096 tokens (docs/vs-experts.md's case), analytic
    costs, and its best hand configuration (as Megatron-LM runs it) with selective
    recomputation: TP4 EP2 PP8 with 7 virtual stages, microbatches of one sequence."""
    w = zoo.get("moe", "mixtral-8x22b", batch_size=256)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    topo = load_topology("dgx-h100x1024-256")
    cm = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    hand = megatron_3d(g, topo, tp=4, ep=2, pp=8, interleave=7, microbatch_size=1,
                       recompute="selective", sequence_parallel=True)
    return g, topo, cm, factor, hand


def test_a_selective_pipeline_keeps_the_expert_outputs_combined():
    """A pipelined plan recomputing selectively is walked at its own microbatches, its layer
    operators alone: Mixtral 8x22B's best hand configuration (TP4 EP2 PP8 v7; 4.761 s as apply
    runs it (4.800 s while the routing's dispatch and combine masks, made from the top-k
    choices, had a backward and sent cotangents; 4.802 s while layer 0's load-balancing sum sat
    in the last layer's expert matmul's operator), whose data groups add the load-balancing
    statistics' sums across each other and reduce the gradients once a step: 15.842 s when the
    stages ran whole microbatches and reduced them at every backward; its layers' backward
    gathers the sequence-parallel inputs again beside the data gradients' matmuls, 4.743 s
    before that was priced, and its recomputed operators' inputs again, 4.744 s before that)
    keeps the combine einsum's output (the experts' outputs summed back per token, which
    selective recomputation runs again: a matmul of two activations), 0.092 s faster and still
    fitting; `kept_positions` says so to apply, and the price is the full simulation's."""
    g, topo, cm, factor, hand = mixtral_8x22b()
    with open_simulation(g, topo, hand, cost_model=cm, resharder="ideal",
                         opt_state_factor=factor) as sim:
        start = sim.step_time()
        t, found = relaxed(sim, g, hand)
    assert start == pytest.approx(4.761, abs=5e-4) and t < start - 0.05
    assert found.pipeline == hand.pipeline and found.microbatches == hand.microbatches
    assert found.configs == hand.configs
    assert _kept(g, found) - _kept(g, hand) == {"moe/dot_general_4"}
    assert kept_positions(g, found) == ("layers_*/moe/dot_general_4",)
    r = simulate(g, topo, found, cost_model=cm, resharder="ideal", opt_state_factor=factor)
    assert r.step_time_s == pytest.approx(t, rel=1e-12) and r.fits_in_memory


def test_nothing_to_relax():
    """None where the plan recomputes nothing, has pipeline stages whose layers recompute in
    full (a chunk recomputed in full keeps its input alone) or does not fit."""
    g, topo, cm, full = tiny_flash()
    sim = make_simulation(g, topo, cost_model=cm)
    assert relaxed(sim, g, dataclasses.replace(full, recompute=())) is None
    assert relaxed(sim, g, full.with_pipeline(2)) is None
    small = make_simulation(g, _capped(topo, 100_000), cost_model=cm)
    assert relaxed(small, g, full) is None


def test_a_recomputation_that_buys_nothing_is_dropped():
    """`tidied`: the tiny flash llama on cpu8 with every layer operator recomputed, on a
    device with room for everything: each position stops recomputing where the step is no
    slower and still fits, so nothing recomputes and the step is the plain plan's; on a
    device just big enough for the recomputing plan, it drops what still fits (faster: 35.8
    against 37.9 ms) and some layer operator still recomputes."""
    from soapjax.search.recompute import recomputes_any, tidied

    g, topo, cm, full = tiny_flash()
    none = dataclasses.replace(full, recompute=())
    plain = simulate(g, topo, none, cost_model=cm).step_time_s
    t, found = tidied(make_simulation(g, topo, cost_model=cm), g, full)
    assert not recomputes_any(g, found) and t == pytest.approx(plain, rel=1e-12)
    whole = simulate(g, topo, full, cost_model=cm)
    tight = _capped(topo, whole.memory.total)
    sim = make_simulation(g, tight, cost_model=cm)
    t, found = tidied(sim, g, full)
    assert t < whole.step_time_s and sim.fits_in_memory() and recomputes_any(g, found)
