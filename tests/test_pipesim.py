"""Simulating pipelined strategies (soapjax.simulate.pipesim): chunks from one stage's timeline, the
schedule, memory per stage, delta == full, and the search and plan files with stages."""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import pytest

from soapjax.base.errors import PlanError
from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import Resharder
from soapjax.graph.opgraph import trace
from soapjax.search import (
    SearchSettings,
    _chain,
    balance_stages,
    choose_schedule,
    find_plan,
    improving_change,
    interleave_choices,
    make_simulation,
    pipeline_grid,
    pipelines,
    stage_choices,
)
from soapjax.search._chain import _Searcher
from soapjax.search.stages import _uneven_boundaries
from soapjax.simulate._pipe_cut import weight_operands, weight_shares
from soapjax.simulate.front import Simulation, folds, open_simulation
from soapjax.simulate.pipesim import PipelinedSimulation, layer_chunks
from soapjax.strategy.baselines import GridPoint, megatron_3d
from soapjax.strategy.pipeline import pipeline_error
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import Config, MeshShape, configs
from soapjax.topology.cluster import load_topology, stage_topology

A100 = load_topology("dgx-a100x3072-32")  # 4 DGX nodes: mesh node=4 x data=2 x model=4


@functools.cache
def gpt(layers: int = 4, heads: int = 4):
    from soapjax_zoo.gpt import GPTConfig, build_gpt
    cfg = GPTConfig(batch_size=16, seq_len=64, vocab_size=256, num_layers=layers,
                    num_heads=heads, d_model=64, dtype="bfloat16")
    w = build_gpt("gpt", "test", cfg, "linen")
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")


def pipelined(strategy, graph=None, layer_layout="model"):
    graph = graph or gpt()
    stage = stage_topology(A100, strategy.stages)
    rs = Resharder(MeshShape.of(stage), mode="ideal")
    return PipelinedSimulation(graph, A100, cost_model(graph, A100, mode="analytic"), rs,
                               strategy, layer_layout=layer_layout)


def test_the_search_offers_no_stages_to_layers_apply_cannot_pipeline():
    """Four identical layers made in a Python loop (unrolled, not scanned): the simulator can cut
    them into stages, apply cannot (it pipelines one scan over stacked parameters). `soapjax
    plan --pipelines` returned a 2-stage plan for such a model (the Qwen3 of the corpus on
    `cpu8-nodes`), which `soapjax check` then refused; the search now offers it no stages,
    and says why."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from soapjax.search import SearchSettings, find_plan
    from soapjax.search.pipelines import no_fit_hint, pipeline_refusal

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))

    class Unrolled(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(32, name="embed")(x)
            for k in range(4):
                x = Block(name=f"layers_{k}")(x)
            return nn.Dense(8, name="head")(x)

    model = Unrolled()
    x = jnp.zeros((16, 32))
    params = jax.eval_shape(model.init, jax.random.key(0), x)

    def loss(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(
            model.apply(p, b["x"]), b["y"]).mean()

    g = trace(loss, params, {"x": x, "y": jnp.zeros((16,), jnp.int32)}, name="unrolled")
    assert len(g.repeated_blocks()[0]) == 4 and layer_chunks(g, 2)
    assert "not one scan" in pipeline_refusal(g)
    assert stage_choices(g, A100) == ()
    said = []
    plan = find_plan(g, A100, costs="analytic", progress=said.append,
                     settings=SearchSettings(max_proposals=10, seed=0, pipelines=True,
                                             processes=1))
    assert not plan.strategy(g, A100).pipelined
    assert any("no pipeline stages for 'unrolled'" in line for line in said), said
    # where nothing fits, the error says why no stages were tried
    assert "its layers get no pipeline stages (its layers are not one scan" in no_fit_hint(g,
                                                                                          True)
    assert pipeline_refusal(gpt()) == "" and no_fit_hint(gpt(), True) == ""


def test_layers_cut_into_chunks_with_embedding_first_and_head_last():
    g = gpt()
    chunk = layer_chunks(g, 2)
    names = [op.name for op in g.operators]
    assert chunk[names.index("wte")] == 0 and chunk[-1] == 1
    assert {chunk[i] for i, n in enumerate(names) if n.startswith("layers_1/")} == {0}
    assert {chunk[i] for i, n in enumerate(names) if n.startswith("layers_2/")} == {1}
    with pytest.raises(PlanError, match="4 layers do not cut into 3 equal pipeline chunks"):
        layer_chunks(g, 3)
    assert stage_choices(g, A100) == (2, 4)


def test_chunk_times_partition_one_stages_step():
    """The chunks' forward and backward spans (per microbatch, times M) and the prologue's
    (SPMD over the S stages' devices, so 1/S of its one-stage span) add up to the one-stage
    simulation's compute span, but for the all-reduce apply's last stage runs adding up the
    picked log-probabilities for the loss (`_loss_collectives`: TP4 splits the vocabulary;
    Megatron-LM's loss runs the same): the cut loses and invents nothing else."""
    s = megatron_3d(gpt(), A100, tp=4, pp=2, microbatch_size=2, recompute="none")
    sim = pipelined(s)
    r = sim.result()
    fwd, bwd = sim._inner.compute_ends()
    M, S = s.microbatches, s.stages
    before, after = r.prologue_s
    assert before > 0 and after > 0
    picks = [(kind, n, axes) for kind, n, axes, _ in sim._loss_collectives()]
    # a replica's microbatch of 2 sequences' picked log-probabilities, 64 tokens, float32
    assert picks == [("all_reduce", 2 * 64 * 4, ("model",))]
    forward = sum(r.chunk_times.forward_s) - sum(t for *_, t in sim._loss_collectives())
    assert forward * M + before * S == pytest.approx(max(fwd), rel=1e-12)
    assert (forward + sum(r.chunk_times.backward_s)) * M \
        + (before + after) * S == pytest.approx(max(bwd), rel=1e-12)
    assert pipelined(s, layer_layout="chunks")._loss_collectives() == sim._loss_collectives()
    assert r.step_time_s >= before + r.timeline.step_s + after
    # two stages: every chunk boundary sends one microbatch's residual stream, bf16, TP4 over
    # the stage's model axis does not split it (sequence-parallel regions aside)
    assert len(r.chunk_times.send_s) == 1 and r.chunk_times.send_s[0] > 0
    assert r.step_time_s >= max(r.timeline.stage_end_s)
    assert len(r.stage_memory) == 2 and r.timeline.in_flight == (2, 1)


def test_one_microbatch_is_priced_at_the_stages_degrees():
    """A stage's configs name one stage's devices: with one microbatch (M = 1) each operator
    was priced at the axes' sizes on the whole cluster (node 4 where a stage has 2), where an
    operator splitting its batch over ``node`` then took half its time, or fell back to the
    roofline where the cluster's degree did not divide it."""
    g = gpt()
    s = megatron_3d(g, A100, tp=4, pp=2, microbatch_size=4, recompute="none")
    assert s.microbatches == 1
    costs = cost_model(g, A100, mode="analytic")
    sim = pipelined(s)
    stage = MeshShape.of(stage_topology(A100, 2))
    tasks = {t.name: t for t in sim._inner.result().tasks if t.kind == "forward"}
    split = 0
    for j, (op, c) in enumerate(zip(g.operators, s.configs)):
        want = costs.shard_time(j, c.degrees(stage)).forward_s
        got = tasks[f"forward {op.name}"]
        assert got.end_s - got.start_s == pytest.approx(want, rel=1e-12), op.name
        split += c.degrees(stage) != c.degrees(MeshShape.of(A100))
    assert split > 0  # operators whose degrees differ between a stage and the cluster


def test_more_stages_hold_fewer_parameters_per_device():
    flat = Simulation(gpt(), A100, cost_model(gpt(), A100, mode="analytic"),
                      Resharder(MeshShape.of(A100), mode="ideal"),
                      megatron_3d(gpt(), A100, tp=4, microbatch_size=2, recompute="none"))
    two = pipelined(megatron_3d(gpt(), A100, tp=4, pp=2, microbatch_size=2, recompute="none"))
    four = pipelined(megatron_3d(gpt(), A100, tp=4, pp=4, microbatch_size=2, recompute="none"))
    p = [flat.memory_breakdown().params] + [max(m.params for m in x.result().stage_memory)
                                            for x in (two, four)]
    assert p[0] > p[1] > p[2]


def test_the_interleaved_schedule_moves_no_layers_as_apply_keeps_them_in_chunk_order():
    """v = 2 on 2 stages: apply keeps the stacked layer parameters in the order the chunks run
    them (`soapjax.apply._layer_order`), so nothing moves between steps, as in Megatron's
    layout (``"chunks"``); apply's layout still sums the gradients of the parameters read
    outside the layers over the stages after the pipeline (module doc, 3), where Megatron
    all-reduces the tied embedding's gradient between its first and last stage, and nothing
    else differs: the same parameter memory per stage."""
    s = megatron_3d(gpt(8), A100, tp=4, pp=2, interleave=2, microbatch_size=2,
                    recompute="none")
    model, chunks = (pipelined(s, gpt(8), lay).result() for lay in ("model", "chunks"))
    assert pipelined(s, gpt(8)).layout_move_bytes() == ()
    assert model.layout_move_s == chunks.layout_move_s == (0.0, 0.0)
    # Megatron's: only the tied embedding's gradient, all-reduced between the first and the
    # last stage; apply's: every parameter read outside the layers, over all the stages
    megatron, ours = pipelined(s, gpt(8), "chunks"), pipelined(s, gpt(8))
    (tied,) = megatron._tied
    stored = megatron._inner.stored_param_bytes()
    assert "wte" in tied and megatron._stage_sum_bytes() == (0, stored[tied])
    assert chunks.stage_sums_s == (0.0, A100.collective_time("all_reduce", stored[tied],
                                                              ("node",), group_size=2))
    # the prologue's alone: the position embedding; the epilogue's: the tied embedding and
    # the final norm
    assert [src.split("'")[-4] for src in ours._prologue_params] == ["wpe"]
    assert sorted(src.split("'")[-4] for src in ours._epilogue_params) == ["ln_f", "ln_f",
                                                                           "wte"]
    assert ours._stage_sum_bytes() == tuple(sum(stored[src] for src in sources) for sources
                                            in (ours._prologue_params, ours._epilogue_params))
    assert min(model.stage_sums_s) > 0 and model.stage_sums_s[1] > chunks.stage_sums_s[1]
    assert chunks.step_time_s < model.step_time_s <= \
        chunks.step_time_s + sum(model.stage_sums_s) * (1 + 1e-12)
    assert [m.params for m in model.stage_memory] == [c.params for c in chunks.stage_memory]
    flat = megatron_3d(gpt(8), A100, tp=4, pp=2, microbatch_size=2, recompute="none")
    assert pipelined(flat, gpt(8)).layout_move_bytes() == ()
    with pytest.raises(PlanError, match="layer_layout 'stage': expected one of model, chunks"):
        pipelined(s, gpt(8), "stage")


@functools.cache
def heavy_head():
    """8 layers under a 32K-token vocabulary: the head on the last stage weighs as much as
    several of its layers."""
    from soapjax_zoo.gpt import GPTConfig, build_gpt
    cfg = GPTConfig(batch_size=16, seq_len=64, vocab_size=32768, num_layers=8, num_heads=4,
                    d_model=64, dtype="bfloat16")
    w = build_gpt("gpt", "test", cfg, "linen")
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")


def test_uneven_stages_cut_the_layers_and_move_what_apply_moves():
    g = gpt(8)
    chunk = layer_chunks(g, 2, (3, 5))
    names = [op.name for op in g.operators]
    assert {chunk[i] for i, n in enumerate(names) if n.startswith("layers_2/")} == {0}
    assert {chunk[i] for i, n in enumerate(names) if n.startswith("layers_3/")} == {1}
    with pytest.raises(PlanError, match=r"stage layers \(3, 4\) do not cut 8 layers"):
        layer_chunks(g, 2, (3, 4))
    s = megatron_3d(g, A100, tp=4, pp=2, microbatch_size=2, recompute="none")
    even, uneven = pipelined(s, g), pipelined(s.with_pipeline(2, 1, "1f1b", (3, 5)), g)
    # stage 1 runs layer 3, kept on stage 0: one layer of every stacked parameter each way
    layer = {}
    for op in g.operators:
        for x in op.inputs:
            if x.kind == "param" and x.layer == (3,):
                layer[str(x.leaf_path)] = x
    moved = uneven.layout_move_bytes()
    assert even.layout_move_bytes() == () and len(moved) == len(layer) == 16
    assert sum(moved) <= sum(x.nbytes for x in layer.values())
    r = uneven.result()
    one_way = sum(A100.collective_time("point_to_point", n, ("node",)) for n in moved)
    assert r.layout_move_s == (one_way, one_way)
    # both stages keep 4 layers and hold a copy of the 5 the longer one runs, padded
    assert r.stage_memory[0].params == r.stage_memory[1].params > even.result().stage_memory[
        0].params
    # the boundaries change the schedule's work only: the same as a fresh simulation
    assert even.stage_layers_result((3, 5)).step_time_s == r.step_time_s
    assert even.strategy.stage_layers == () and even.result() == pipelined(s, g).result()


def test_the_search_lightens_the_stage_that_carries_a_heavy_head():
    """GPT with a 32K vocabulary on 4 stages: the descent over the boundaries moves layers
    off the last stage (the head's) and gets a faster step that fits; a light head (the
    256-token vocabulary) keeps equal stages."""
    g = heavy_head()
    s = megatron_3d(g, A100, tp=4, pp=4, microbatch_size=1, recompute="none")
    sim = pipelined(s, g)
    t0 = sim.step_time()
    t, strategy, name = balance_stages(sim, (t0, sim.strategy, "megatron"))
    assert name == "megatron" and t < 0.95 * t0
    assert sum(strategy.stage_layers) == 8 and strategy.stage_layers[-1] < 2
    assert t == pipelined(strategy, g).step_time() and sim.fits_in_memory()
    light = pipelined(megatron_3d(gpt(8), A100, tp=4, pp=4, microbatch_size=1,
                                  recompute="none"), gpt(8))
    best = (light.step_time(), light.strategy, "megatron")
    assert balance_stages(light, best) == best


def test_the_stage_walk_moves_layers_only_between_stages_that_differ():
    """The walk prices a move at a boundary only where the stages on either side differ:
    on 4 equal stages of the heavy-headed GPT the first (the embedding's) and the last (the
    head's) differ from their neighbours, the middle two are equal (to rounding), and a layer
    moved between those either way is not faster, so it is not priced."""
    sim = pipelined(megatron_3d(heavy_head(), A100, tp=4, pp=4, microbatch_size=1,
                                recompute="none"), heavy_head())
    assert _uneven_boundaries(sim.result(), [2, 2, 2, 2]) == [0, 2]
    for cut in ((2, 3, 1, 2), (2, 1, 3, 2)):
        assert sim.stage_layers_result(cut).step_time_s >= sim.step_time()


def test_a_plan_file_keeps_the_stage_layers(tmp_path):
    g = gpt(8)
    s = megatron_3d(g, A100, tp=4, pp=2, microbatch_size=2,
                    recompute="none").with_pipeline(2, 1, "1f1b", (3, 5))
    plan = Plan.make(g, A100, s)
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again.stage_layers == (3, 5) and again.strategy(g, A100) == s
    assert Plan.make(g, A100, s.with_pipeline(2)).to_json()["pipeline"] == {
        "stages": 2, "virtual_stages": 1, "schedule": "1f1b"}
    with pytest.raises(PlanError, match="uneven stages are for one virtual stage"):
        s.with_pipeline(2, 2, "interleaved", (3, 5))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "uneven", "zb-h1"])
def test_delta_equals_full_for_pipelined_strategies(schedule):
    """Random config and recompute moves through the pipelined simulation (delta, with
    rejections): after each, the step time and per-stage memory equal a fresh simulation's."""
    v = 2 if schedule == "interleaved" else 1
    start = megatron_3d(gpt(), A100, tp=4, pp=2, interleave=v, microbatch_size=2,
                        recompute="selective")
    if schedule == "uneven":
        start = start.with_pipeline(2, 1, "1f1b", (3, 1))
    if schedule == "zb-h1":
        start = start.with_pipeline(2, 1, "zb-h1")
    sim = pipelined(start)
    rng = random.Random(0)
    mesh = sim.mesh
    spaces = [configs(op, mesh) for op in gpt().operators]
    for step in range(12):
        i = rng.randrange(len(spaces))
        sim.propose(i, rng.choice(spaces[i]), rng.choice(("none", "selective", "full", None)))
        if step % 3 == 2:
            sim.reject()
        else:
            sim.accept()
        fresh = pipelined(sim.strategy).result()
        got = sim.result()
        assert got.step_time_s == fresh.step_time_s
        assert got.stage_memory == fresh.stage_memory


def test_search_finds_stages_and_the_plan_file_keeps_them(tmp_path):
    """GPT with 4 layers on 4 DGX nodes, batch 16: the search scores Megatron's grid at 2 and 4
    stages too; whatever it picks, the plan file round-trips the pipeline and the step time."""
    g = gpt()
    plan = find_plan(g, A100, settings=SearchSettings(max_proposals=10, seed=0, pipelines=True),
                     costs="analytic")
    again = Plan.from_json(plan.to_json())
    assert again.pipeline == plan.pipeline and again.step_time_s == plan.step_time_s
    s = megatron_3d(g, A100, tp=4, pp=2, microbatch_size=2)
    made = Plan.make(g, A100, s, predicted={"step_time_s": 1.0})
    assert Plan.from_json(made.to_json()).strategy(g, A100) == s
    assert made.to_json()["pipeline"] == {"stages": 2, "virtual_stages": 1, "schedule": "1f1b"}


def test_the_pipelines_grids_are_scored_before_the_flat_chains():
    """With pipelines, their grids are scored right after the starts, before any chain walks:
    the chains' time is then shared by how the two families' bests compare
    (`soapjax.search.find._flat_chains_share`, with a time budget; GPT 175B on 96 A100s gave
    its flat chains 19 of 60 s where no flat plan came within 2x of the pipelined grids).
    One process: each chain says its progress (in lanes, the search says how many are done)."""
    said = []
    plan = find_plan(gpt(), A100, settings=SearchSettings(max_proposals=5, seed=0,
                                                          pipelines=True, processes=1,
                                                          check_reshardings=False),
                     costs="analytic", progress=said.append)
    grid = next(k for k, m in enumerate(said) if "pipeline stages" in m)
    chains = [k for k, m in enumerate(said) if "  chain " in m]
    assert chains and grid < chains[0]
    assert plan.step_time_s > 0


def test_the_search_turns_to_stages_when_nothing_else_fits():
    """Devices of 600 KB: the flat search finds no plan without stages that fits the 4-layer
    GPT, says so and points at pipelines (at 700 KB its chains reach FSDP with recomputation
    and 2 microbatches, 649 KB; at 1 MB the distributed optimizer makes a flat plan fit); by
    default the search then tries stages and returns one that fits."""

    small = dataclasses.replace(A100, device=dataclasses.replace(A100.device,
                                                                 memory_bytes=600_000))
    settings = SearchSettings(max_proposals=10, seed=0)
    with pytest.raises(PlanError, match="or allow pipeline stages"):
        find_plan(gpt(), small, settings=dataclasses.replace(settings, pipelines=False),
                  costs="analytic")
    plan = find_plan(gpt(), small, settings=settings, costs="analytic")
    assert plan.pipeline[0] > 1
    assert max(dict(plan.predicted)["peak_memory_bytes"]) <= 600_000


def test_one_entry_point_simulates_a_pipelined_strategy_as_a_step():
    """`soapjax.simulate.front.simulate` takes any strategy: a pipelined one's `SimResult` has the
    pipeline's step time, fit and fullest stage's memory, and the `PipelineResult` itself;
    `open_simulation` gives the pipelined simulation the search walks."""
    from soapjax.simulate.front import open_simulation, simulate

    g = gpt()
    s = megatron_3d(g, A100, tp=4, pp=2, microbatch_size=2, recompute="none")
    want = pipelined(s).result()
    costs = cost_model(g, A100, mode="analytic")
    got = simulate(g, A100, s, cost_model=costs)
    # with the step's collectives as a device runs them (what `soapjax check` compares)
    assert (got.pipeline.collectives, got.pipeline.sent_bytes) == pipelined(s).step_collectives()
    assert got.pipeline.collectives != () and got.pipeline.sent_bytes > 0
    assert dataclasses.replace(got.pipeline, collectives=(), sent_bytes=0.0) == want
    assert got.step_time_s == want.step_time_s
    assert got.fits_in_memory == want.fits_in_memory
    assert got.peak_memory_bytes == (want.peak_memory_bytes,) * A100.num_devices
    assert got.to_json() == want.to_json()  # what a plan file records
    with open_simulation(g, A100, s, cost_model=costs) as sim:
        assert isinstance(sim, PipelinedSimulation) and sim.step_time() == want.step_time_s
    flat = megatron_3d(g, A100, tp=4, pp=1, microbatch_size=2, recompute="none")
    assert simulate(g, A100, flat, cost_model=costs).pipeline is None


def test_the_pipelined_grid_offers_every_interleave_the_layers_allow():
    """GPT 530B's depth (105 layers, a tiny width) on 280 A100s (35 nodes): stages 5, 7 or
    35, and at 35 stages Megatron-LM's own 3 virtual stages, with microbatches of 1 (M = 280,
    a multiple of 35 as the interleaved schedule needs); every point is one apply runs, and
    the likeliest (microbatches of 1, TP8, selective recompute) is scored first."""
    from soapjax_zoo.gpt import GPTConfig, build_gpt
    cfg = GPTConfig(batch_size=280, seq_len=8, vocab_size=64, num_layers=105, num_heads=4,
                    d_model=64, dtype="bfloat16")
    w = build_gpt("gpt", "test", cfg, "linen")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")
    topo = load_topology("dgx-a100x3072-280")
    assert stage_choices(g, topo) == (5, 7, 35)
    assert [interleave_choices(g, S) for S in (5, 7, 35)] == [(1, 3, 7, 21), (1, 3, 5, 15),
                                                             (1, 3)]
    grid = pipeline_grid(g, topo, 35)
    assert set(grid) == {(1, "1f1b"), (3, "interleaved")}
    v3 = {p.name: st for p, st in grid[3, "interleaved"].items()}  # a point names itself
    assert list(v3)[:3] == [f"megatron-tp8-pp35-v3-mb1-{r}" for r in ("selective", "full",
                                                                    "none")]
    assert v3["megatron-tp8-pp35-v3-mb1-full"] == megatron_3d(
        g, topo, tp=8, pp=35, interleave=3, microbatch_size=1, sequence_parallel=True)
    # TP8: DP1, 280 per replica: microbatches of 1, 2, 4, 8 (M = 280 .. 35); all of it (M = 1)
    # only without interleaving
    assert {n for n in v3 if n.startswith("megatron-tp8-") and n.endswith("-full")} == {
        f"megatron-tp8-pp35-v3-mb{mb}-full" for mb in (1, 2, 4, 8)}
    assert GridPoint(tp=8, pp=35, mb=280, recompute="full") in grid[1, "1f1b"]
    assert all(pipeline_error(st.schedule, 35, st.microbatches, st.virtual_stages) is None
               for points in grid.values() for st in points.values())


def test_a_spent_budget_does_not_hide_the_grid_point_that_fits():
    """With a budget far too short to score the pipelines' grids, the search still scores
    them past their deadlines until one point fits (then keeps the deadlines): a plan that
    fits is never lost to the clock (GPT 70B at 32K tokens on 64 H100s raised "no strategy
    fits" with fitting grid points left unscored)."""
    import dataclasses

    small = dataclasses.replace(A100, device=dataclasses.replace(A100.device,
                                                                 memory_bytes=520_000))
    plan = find_plan(gpt(), small, settings=SearchSettings(budget_s=0.05, seed=0),
                     costs="analytic")
    assert plan.pipeline[0] > 1
    assert max(dict(plan.predicted)["peak_memory_bytes"]) <= 520_000


def test_a_pipelined_plans_neighbours_are_walked_over_one_stages_mesh():
    """What scripts/evaluate.py's quality section does with a searched plan that has stages:
    a flat simulation refuses it (the section crashed on LLaMA's 2-stage plan on 16 P100s), the
    pipelined one `open_simulation` opens walks its single-operator changes, leaving out the
    configs whose per-device batch its microbatches do not divide (they are not in the space:
    the section then crashed on that PlanError)."""
    g = gpt()
    strategy = megatron_3d(g, A100, tp=4, pp=2, microbatch_size=1, recompute="none")
    with pytest.raises(PlanError, match="2 pipeline stages"):
        make_simulation(g, A100, strategy=strategy)
    costs = cost_model(g, A100, mode="analytic")
    with open_simulation(g, A100, strategy, cost_model=costs) as sim:
        assert isinstance(sim, PipelinedSimulation) and sim.topology.num_devices == 16
        before = sim.step_time()
        change = improving_change(sim)
        assert sim.strategy == strategy and sim.step_time() == before  # every proposal rejected
        if change is not None:
            assert change[2] < before
        from soapjax_eval.experiments import _sim_summary
        summary = _sim_summary(sim)
        assert summary["stages"] == 2 and summary["step_time_s"] == before
        assert summary["bytes_per_device"] is None and summary["peak_memory_bytes"] > 0


def test_sequence_parallel_stages_send_their_shards_and_gather_nothing():
    """Megatron-LM's scatter/gather sends a residual stream replicated over the tensor-parallel
    axes in pieces, one per replica, all-gathered on arrival. Under sequence parallelism the
    stream is already split along the sequence over those axes: the layer's last operator
    reduce-scatters its partial sums into that split (`held_specs`), so each device sends its
    own shard and nothing is gathered, as `soapjax.apply._pipelined` runs it
    (tests/test_apply_pipelined.py). The bytes each device sends are the same either way."""
    g = gpt()
    gathers = {}
    for sp in (False, True):
        sim = pipelined(megatron_3d(g, A100, tp=4, pp=2, microbatch_size=2, recompute="none",
                                    sequence_parallel=sp), g)
        twice = 2 * sim.microbatches
        collectives, _ = sim.step_collectives()
        gathers[sp] = [c for c in collectives if c[0] == "all_gather" and c[2] == twice]
        permutes = [c for c in collectives if c[0] == "collective_permute"]
        assert sum(n for _, n, _ in permutes) == sum(sim.send_bytes())
    assert gathers[True] == [] and len(gathers[False]) == 1


@functools.cache
def moe(layers: int = 4, routing: str = "capacity"):
    from soapjax_zoo.moe import MOE_CONFIGS, build_moe
    cfg = dataclasses.replace(MOE_CONFIGS["tiny"], batch_size=16, num_layers=layers,
                              routing=routing)
    w = build_moe("moe", "test", cfg, "linen")
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="moe")


@pytest.mark.parametrize("routing", ["capacity", "dropless"])
def test_coupled_samples_reduce_the_gradients_at_every_backward_unless_they_meet_by_sums(
        routing):
    """An MoE's load-balancing loss couples the samples of a microbatch. Where they meet
    through sums only (GShard's capacity routing: `OpGraph.sample_sums`), apply's data groups
    add those sums across each other and reduce the gradients once, as Megatron-LM's layout
    (``"chunks"``) does: the chunks' backwards cost the same. Where not (dropless routing
    sorts the batch's tokens), apply's stages run whole microbatches and XLA reduces each
    gradient as every backward adds it: each chunk's backward takes its parameters' gradient
    synchronisations (`grad_sync_seconds`) again, M times a step, and the step's collectives
    count them M times. Delta equals full there too."""
    g = moe(routing=routing)
    assert g.sample_coupling and (g.sample_sums is None) == (routing == "dropless")
    start = megatron_3d(g, A100, tp=4, pp=2, microbatch_size=2, recompute="selective")
    M = start.microbatches
    assert M > 1
    applied, megatron = pipelined(start, g), pipelined(start, g, layer_layout="chunks")
    synced = applied._inner.grad_sync_seconds()
    assert sum(synced) > 0
    per_chunk = [0.0, 0.0]
    for i, c in enumerate(layer_chunks(g, 2)):
        if not applied._prologue[i]:
            per_chunk[c] += synced[i]
    got, want = applied.result().chunk_times.backward_s, megatron.result().chunk_times.backward_s

    def grad_syncs(sim):
        return sum(n * runs for kind, n, runs in sim.step_collectives()[0] if kind == "all_reduce")

    if routing == "capacity":
        assert got == pytest.approx(want, rel=1e-12)
    else:
        assert got == pytest.approx([w + s for w, s in zip(want, per_chunk)], rel=1e-12)
        assert applied.step_time() > megatron.step_time()
        assert grad_syncs(applied) > grad_syncs(megatron)
    rng, mesh = random.Random(0), applied.mesh
    spaces = [configs(op, mesh) for op in g.operators]
    for step in range(6):
        i = rng.randrange(len(spaces))
        applied.propose(i, rng.choice(spaces[i]), rng.choice(("none", "selective", None)))
        applied.accept() if step % 2 else applied.reject()
        assert applied.result().step_time_s == pipelined(applied.strategy, g).step_time()


def test_zero_bubble_prices_the_layers_weight_matmuls_as_w_and_is_faster_at_depth():
    """ZB-H1 at 4 stages of 2 layers (TP4 PP4, 16 microbatches): each layer chunk's W is its
    weight matmuls' share of its forward time (`_pipe_cut.weight_shares`: the projections
    and the MLP, not the attention core), at most its backward; 1F1B's schedule ignores it;
    the step is shorter by (S - 1) of 2 W's less what the sends and the tail change, and
    every stage holds up to S microbatches (1F1B: S - s)."""
    graph = gpt(8)
    shares = weight_shares(graph)
    by_name = dict(zip((op.name for op in graph.operators), shares))
    assert by_name["layers_0/attn/query"] > 0.9 and by_name["layers_0/mlp/fc1"] > 0.9
    assert by_name["layers_0/attn/dot_general"] == 0 and by_name["layers_0/ln_1"] == 0
    start = megatron_3d(graph, A100, tp=4, pp=4, microbatch_size=1, recompute="selective")
    one = pipelined(start, graph).result()
    zb = pipelined(start.with_pipeline(4, 1, "zb-h1"), graph).result()
    assert one.chunk_times.forward_s == zb.chunk_times.forward_s
    assert one.chunk_times.backward_s == zb.chunk_times.backward_s
    assert all(0 < w < b for w, b in zip(zb.chunk_times.weight_s, zb.chunk_times.backward_s))
    assert zb.step_time_s < one.step_time_s
    assert zb.timeline.in_flight == (4, 4, 4, 4) and one.timeline.in_flight == (4, 3, 2, 1)
    sim = pipelined(start, graph)
    assert sim.schedule_result("zb-h1").step_time_s == zb.step_time_s
    assert sim.step_time() == one.step_time_s  # left as it was
    with pytest.raises(PlanError, match="needs 2 or more virtual stages"):
        sim.schedule_result("interleaved")


def test_the_search_picks_the_schedule_that_fits_and_is_fastest():
    """`choose_schedule`: from 1F1B to ZB-H1 where that is faster and fits; kept where ZB-H1's
    memory does not fit (its later stages hold S microbatches, each waiting for its W with
    its stash)."""
    graph = gpt(8)
    start = megatron_3d(graph, A100, tp=4, pp=4, microbatch_size=1, recompute="selective")
    sim = pipelined(start, graph)
    t, s, name = choose_schedule(sim, (sim.step_time(), start, "start"))
    assert s.schedule == "zb-h1" and name == "start" and t < pipelined(start, graph).step_time()
    assert sim.strategy == s and t == pipelined(s, graph).step_time()
    # recomputed in full, a layer keeps its input alone, and a microbatch waiting for its W
    # its weight matmuls' operands and cotangents: ZB-H1's later stages hold more than 1F1B's
    start = megatron_3d(graph, A100, tp=4, pp=4, microbatch_size=1, recompute="full")
    one_f_one_b = pipelined(start, graph).result().peak_memory_bytes
    zb = pipelined(start.with_pipeline(4, 1, "zb-h1"), graph).result().peak_memory_bytes
    assert zb > one_f_one_b
    # a device with room for 1F1B's fullest stage and not for ZB-H1's
    device = dataclasses.replace(A100.device, memory_bytes=(one_f_one_b + zb) // 2)
    small = dataclasses.replace(A100, device=device)
    tight = PipelinedSimulation(graph, small, cost_model(graph, small, mode="analytic"),
                                Resharder(MeshShape.of(stage_topology(small, 4)), mode="ideal"),
                                start)
    assert tight.fits_in_memory() and not tight.schedule_result("zb-h1").fits_in_memory
    assert not tight.schedule_fits("zb-h1") and tight.schedule_fits("1f1b")
    timed = []  # what the choice times: not a schedule that does not fit
    tight.schedule_result = lambda other, f=tight.schedule_result: timed.append(other) or f(other)
    kept = choose_schedule(tight, (tight.step_time(), start, "start"))
    assert kept[1].schedule == "1f1b" and kept[0] == tight.step_time()
    assert "zb-h1" not in timed and "zb-h1-gathered" not in timed


def test_a_schedule_fits_as_its_timed_result_says():
    """`PipelinedSimulation.schedule_fits` (what `choose_schedule` asks before it times a
    schedule) against `schedule_result(...).fits_in_memory`, for every schedule each pipeline
    takes, plain and interleaved, selective and full recomputation, on devices from
    roomy to tight; the simulation left as it was."""
    from soapjax.strategy.pipeline import SCHEDULES

    graph = gpt(8)
    agreed = {True: 0, False: 0}
    for v, recompute in ((1, "selective"), (1, "full"), (2, "none"), (2, "full")):
        start = megatron_3d(graph, A100, tp=4, pp=4, microbatch_size=1, recompute=recompute,
                            interleave=v)
        peaks = {o: pipelined(start.with_pipeline(4, v, o), graph).result().peak_memory_bytes
                 for o, rules in SCHEDULES.items() if rules.virtual == (v > 1)}
        for cap in sorted(peaks.values()):
            device = dataclasses.replace(A100.device, memory_bytes=cap)
            topo = dataclasses.replace(A100, device=device)
            sim = PipelinedSimulation(graph, topo, cost_model(graph, topo, mode="analytic"),
                                      Resharder(MeshShape.of(stage_topology(topo, 4)),
                                                mode="ideal"), start)
            before = sim.step_time()
            for other in peaks:
                fits = sim.schedule_fits(other)
                assert fits == sim.schedule_result(other).fits_in_memory, (v, recompute, other)
                agreed[fits] += 1
            assert sim.step_time() == before and sim.strategy == start
    assert agreed[True] and agreed[False]


def test_the_search_prices_its_fastest_folded_plans_again_whole(monkeypatch):
    """`_settle_folded`: a pipelined plan whose folded price was too low (here made so) is
    priced again on its whole stage, and the best follows."""
    graph = gpt(12)  # folded from 12 layers on (`_pipe_fold.MIN_LAYERS`)
    piped = megatron_3d(graph, A100, tp=4, pp=4, microbatch_size=1, recompute="selective")
    flat = megatron_3d(graph, A100, tp=4, pp=1, microbatch_size=1)
    assert folds(graph, piped) and not folds(graph, flat)
    whole_piped = pipelined(piped, graph).step_time()
    with open_simulation(graph, A100, flat, cost_model=cost_model(graph, A100, mode="analytic"),
                         resharder="ideal") as sim:
        t_flat = sim.step_time()
        searcher = _Searcher(sim, SearchSettings(), None)
    searcher.bests = {"piped": (0.5 * t_flat, piped, "piped"), "flat": (t_flat, flat, "flat")}
    searcher.best = searcher.bests["piped"]
    priced = pipelines._settle_folded(searcher, graph, A100,
                                     cost_model(graph, A100, mode="analytic"), 2.0)
    assert priced == 1
    assert searcher.bests["piped"][0] == pytest.approx(whole_piped)
    assert searcher.best == min(searcher.bests.values(), key=lambda f: f[0])


def test_a_start_displaced_by_a_chains_mispriced_plan_comes_back():
    """A chain's best that claimed less than its start's grid point (a folded price too low)
    displaces the point among the starts' bests; priced again whole it is slower, and the
    grid point, which the search still holds among what the chains brought
    (`_Searcher.absorbed`), is the start's best again."""
    graph = gpt(12)
    costs = cost_model(graph, A100, mode="analytic")
    slow = megatron_3d(graph, A100, tp=4, pp=4, microbatch_size=1, recompute="full")
    fast = megatron_3d(graph, A100, tp=4, pp=4, microbatch_size=1, recompute="selective")
    t_slow, t_fast = (pipelined(s, graph).step_time() for s in (slow, fast))
    assert t_fast < t_slow
    with open_simulation(graph, A100, fast, cost_model=costs, resharder="ideal") as sim:
        searcher = _Searcher(sim, SearchSettings(), None)
    searcher.absorbed = [(t_fast, fast, "grid"), (0.5 * t_fast, slow, "grid")]
    searcher.bests = {"grid": (0.5 * t_fast, slow, "grid")}
    searcher.best = searcher.bests["grid"]
    assert pipelines._settle_folded(searcher, graph, A100, costs, 2.0) == 2
    assert searcher.best[1] == fast and searcher.best[0] == pytest.approx(t_fast)


def test_a_split_backwards_stash_counts_each_operand_once():
    """`_pipe_cut.stash_bytes`: per chunk, the weight matmuls' outputs and the operands they
    multiply (`weight_operands`), attention's q, k and v reading one value counted once, as
    apply stashes them; without sequence parallelism each as the matmul uses it (nothing
    for W to gather again)."""
    graph = gpt(8)
    start = megatron_3d(graph, A100, tp=4, pp=4, microbatch_size=1,
                        recompute="selective").with_pipeline(4, 1, "zb-h1")
    sim = pipelined(start, graph)
    shares = weight_shares(graph)
    io = sim._inner.io_bytes_by_operator()
    lo, hi = sim._ranges[1]
    weights = [i for i in range(lo, hi) if shares[i]]
    names = [graph.operators[i].name.split("/", 1)[1] for i in weights]
    assert names == ["attn/query", "attn/key", "attn/value", "attn/out", "mlp/fc1",
                     "mlp/fc2"] * 2
    # q, k, v read x (their third operand) once; out, fc1 the same place; fc2 its GELU'd
    # input (made inside it from its first operand), not the residual stream it adds
    assert [weight_operands(graph)[i] for i in weights[:6]] == [
        ((2, True),)] * 5 + [((0, False),)]
    x_once = [i for k, i in enumerate(weights) if k % 6 not in (1, 2)]
    want = (sum(io[i][1] for i in weights) + sum(io[i][0][2] for i in x_once if i not in
                                                  weights[5::6])
            + sum(io[i][0][0] for i in weights[5::6]))
    assert sim._stash_bytes()[1] == want
    assert sim._stash()[1][1] == ((), ())


def test_a_lean_stash_keeps_what_sequence_parallelism_splits_and_w_gathers_it_again():
    """Under sequence parallelism the stash keeps q/k/v's and fc1's operand (the norm's
    output) split along the sequence as the stage holds it, and out's and fc2's cotangents
    as their reduce-scatter hands them back: 1/4 of the gathered bytes at TP4; each W
    all-gathers those again over the model axes (apply's `_Pipeline._stash_specs`), which
    the chunk's W is priced with, and its backward and collectives where they are more
    than the unsplit backward's (`Kept.moved`), M times."""
    graph = gpt(8)
    start = megatron_3d(graph, A100, tp=4, pp=4, microbatch_size=1, recompute="selective",
                        sequence_parallel=True).with_pipeline(4, 1, "zb-h1")
    sim = pipelined(start, graph)
    lo, hi = sim._ranges[1]
    io = sim._inner.stash_io_by_operator(range(len(graph.operators)))
    used = sim._inner.io_bytes_by_operator()
    by_name = {graph.operators[i].name.split("/", 1)[1]: i
               for i in range(lo, lo + (hi - lo) // 2)}
    q, out, fc1, fc2 = (by_name[n] for n in ("attn/query", "attn/out", "mlp/fc1", "mlp/fc2"))
    for i, kept in ((q, io[q][0][2]), (fc1, io[fc1][0][2]), (out, io[out][1][0]),
                    (fc2, io[fc2][1][0])):
        assert kept.axes and kept.used == 4 * kept.kept
    assert io[q][0][2].used == used[q][0][2] and io[out][1][0].used == used[out][1]
    assert not io[fc2][0][0].axes or weight_operands(graph)[fc2] == ((0, False),)
    xs, dys = sim._stash()[1][1]
    assert len(xs) == 2 * 2 and len(dys) == 2 * 2  # two layers a chunk: (q, fc1), (out, fc2)
    lean = sum(e.used - e.kept for e in (*xs, *dys))
    weights = [i for i in range(lo, hi) if weight_shares(graph)[i]]
    x_once = [i for k, i in enumerate(weights) if k % 6 not in (1, 2, 5)]
    as_used = (sum(used[i][1] for i in weights) + sum(used[i][0][2] for i in x_once)
               + sum(used[i][0][0] for i in weights[5::6]))
    assert lean > 0 and sim._stash_bytes()[1] == as_used - lean
    # selectively recomputed, the unsplit backward gathers the operands again (W's moved
    # from it); the cotangents are gathered once more
    assert all(e.moved for e in xs) and not any(e.moved for e in dys)
    moved, more = sim._weight_gather_times()[1]
    assert moved > 0 and more > 0
    r = sim.result()
    assert r.chunk_times.weight_s[1] > moved + more
    collectives, _ = sim.step_collectives()
    M = sim._inner.microbatches
    assert sum(1 for k, n, t in collectives if k == "all_gather" and t == M
               and n in {e.used for e in dys}) >= 2 * len(sim._ranges)


def test_the_search_keeps_no_pipelined_plan_whose_stages_would_hang():
    """A layout change inside the layers that XLA makes by permuting tiles between a stage's
    devices (the attention's output, heads split over data and model under Megatron's
    layout, read with its tokens over data and the output over model: tests/
    test_apply_pipelined.py shows apply refusing such a plan) costs a chain infinity and is
    never recorded; Megatron's own layout is, at its price. (The changed operator keeps
    the batch split over node, the stages' data groups' axis.)"""
    g = gpt(4, 8)
    base = megatron_3d(g, A100, tp=8, pp=2, microbatch_size=2, recompute="none",
                       sequence_parallel=True)
    moved = dataclasses.replace(base, configs=tuple(
        Config((("node",), ("data",), ("model",), (), ())) if op.name.endswith("attn/out")
        else c for op, c in zip(g.operators, base.configs)))
    sim = pipelined(moved, g)
    assert {name for name, _ in sim.stage_permutes()} == {
        f"layers_{k}/attn/out" for k in range(2)}  # the first two layers stand for all
    searcher = _Searcher(sim, SearchSettings(max_proposals=10), None)
    assert _chain._cost(sim) == math.inf
    searcher.record("moved")
    assert searcher.best is None
    sim.reset(base)
    assert sim.stage_permutes() == ()
    searcher.record("megatron")
    assert searcher.best is not None and searcher.best[0] == _chain._cost(sim) == \
        sim.step_time()


def test_a_selectively_recomputed_layer_gathers_its_weight_matmuls_operands_again():
    """Megatron's layout with sequence parallelism: each layer gathers its norms' outputs
    (split along the sequence) for the column-parallel matmuls after them. Under selective
    recomputation apply's checkpoint of a layer keeps those outputs split and gathers them
    again in the backward for the weights' gradients (XLA's all-gathers inside
    ``rematted_computation``: `scripts/bench_check.py`'s "pp2 1f1b tp4 M=1 selective" row;
    docs/checks.md). The simulator prices
    each such gather once more per microbatch, in the step's collectives and the chunk's
    backward; not without recomputation, nor under ZB-H1's lean stash, whose W gathers
    them (`_weight_gather_times`)."""
    g = gpt()
    base = dict(tp=4, pp=2, microbatch_size=2, sequence_parallel=True)
    none = pipelined(megatron_3d(g, A100, recompute="none", **base))
    selective = megatron_3d(g, A100, recompute="selective", **base)
    sim = pipelined(selective)
    again = sim.regathers()
    assert none.regathers() == []
    # per layer: the first norm's output for the query, key and value matmuls (one gather,
    # shared), the second norm's for the MLP's first matmul; two layers a chunk
    layers = [i for i, op in enumerate(g.operators) if op.block_position]
    readers = {g.operators[j].name.split("/", 1)[1]
               for j, _ in sim._inner.forward_gathers(layers)}
    assert readers == {"attn/query", "mlp/fc1"}
    M = sim.microbatches
    assert all(c.kind == "all_gather" and c.runs == M for _, c in again)
    assert sorted(c for c, _ in again) == [0, 0, 0, 0, 1, 1, 1, 1]
    # in the step's collectives once more each, and in the chunks' backward

    def gathers(s):
        return sum(t for k, _, t in s.step_collectives()[0] if k == "all_gather")
    assert gathers(sim) - gathers(none) == len(again) * M
    assert sim.step_collectives()[1] - none.step_collectives()[1] == pytest.approx(
        sum(c.sent for _, c in again))
    assert all(s > n for s, n in zip(sim.result().chunk_times.backward_s,
                                     none.result().chunk_times.backward_s))
    assert pipelined(selective.with_pipeline(2, 1, "zb-h1")).regathers() == []


def test_proposals_that_move_the_stages_data_groups_delta_simulate_as_full():
    """`PipelinedSimulation` prices its stage with the strategy as the stages' data groups
    run it (`soapjax.strategy._stage_groups.as_run`). A proposal that moves a layer
    operator's sample split moves the groups, and with them every stage operator's config
    as run: after each of 40 random moves of a tiny GPT's whole block positions (two stages
    on ``node x data x model``, the embedding over ``data`` alone), accepted or rejected at
    random, the step time and the collectives equal a fresh simulation's, and some of the
    moves moved the groups."""
    from pathlib import Path

    import soapjax_zoo as zoo

    w = zoo.get("gpt", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")
    topo = load_topology(str(Path(__file__).parent / "meshes" / "cpu8-nodes.toml"))
    current = megatron_3d(g, topo, tp=1, pp=2, recompute="none", microbatch_size=2)
    current = current.replace(g.index("wte"), Config((("data",), (), ())))
    stage = MeshShape.of(stage_topology(topo, 2))
    cm, rng = cost_model(g, topo, mode="analytic"), random.Random(3)
    choices = [configs(op, stage) for op in g.operators]
    moved_groups = 0
    with Resharder(stage, mode="ideal") as resharder:
        sim = PipelinedSimulation(g, topo, cm, resharder, current)
        for _ in range(40):
            i = rng.randrange(len(choices))
            config = rng.choice(choices[i])
            block = g.operators[i].block_position
            twins = [j for j, op in enumerate(g.operators)
                     if block and op.block_position == block] or [i]
            candidate = current
            for j in twins:
                candidate = candidate.replace(j, config)
            groups = sim._groups_now
            step = sim.propose_many([(j, config, None) for j in twins])
            assert sim.strategy == candidate  # (the pending proposal's, as the search reads it)
            full = PipelinedSimulation(g, topo, cm, resharder, candidate)
            assert step == full.step_time()
            assert sim.result().collectives == full.result().collectives
            moved_groups += full._groups_now != groups
            if rng.random() < 0.5:
                sim.accept()
                current = candidate
            else:
                sim.reject()
            assert sim.strategy == current
    assert moved_groups >= 2
