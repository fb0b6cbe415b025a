"""Pipelined plans through soapjax.apply.step and soapjax.training: the unsharded step's numbers,
the planned shardings in the model's layout, and the stage-to-stage bytes the simulator prices.

Every case runs on ``tests/meshes/cpu8-nodes.toml`` (the 8 test devices as node=2 x data=2 x
model=2): Megatron's 3D strategy with tp=2 and pp=2 cuts ``node`` into two stages, so the step
runs on stage=2 x data=2 x model=2, M = 4 microbatches of 2 samples per replica (batch 16), in
float64 with an "optimizer" that returns the gradients as its state. Compiled steps are shared
between the tests (`compiled`), so each is compiled once.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import float64_model
from jax.sharding import AxisType, Mesh, PartitionSpec as P
from test_corpus import relative_error as corpus_relative_error

import soapjax_zoo
from soapjax import training
from soapjax.apply import _pipelined
from soapjax.apply._pipeline_layout import kept_positions, layer_recompute
from soapjax.apply._pipelined import pipelined_value_and_grad, ticks
from soapjax.apply.step import (
    collectives_as_run,
    constrained_loss,
    device_put_global,
    model_layout,
    sharded_train_step,
)
from soapjax.base.errors import PlanError
from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import Resharder
from soapjax.exactness import compare_gradients
from soapjax.graph.opgraph import trace
from soapjax.measure.hlo import collectives
from soapjax.simulate.pipesim import PipelinedSimulation
from soapjax.strategy.baselines import megatron_3d
from soapjax.strategy.memory import recomputes
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import Config, MeshShape, batch_axes
from soapjax.topology.cluster import load_topology, make_mesh, stage_topology

TOPOLOGY = load_topology(str(pathlib.Path(__file__).parent / "meshes" / "cpu8-nodes.toml"))
STAGES, BATCH = 2, 16
FAST = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True}


def keep_gradients() -> optax.GradientTransformation:
    """An "optimizer" that stores the gradients in its state and leaves the parameters."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def model_case(name: str, layers: int):
    """`float64_model` (tests/conftest.py) at this file's batch."""
    return float64_model(name, layers, BATCH)


def strategy_of(name: str, virtual: int, recompute: str = "full",
                sequence_parallel: bool = False):
    graph = model_case(name, STAGES * virtual)[3]
    return megatron_3d(graph, TOPOLOGY, tp=2, pp=STAGES, interleave=virtual, microbatch_size=2,
                       recompute=recompute, sequence_parallel=sequence_parallel)


def run_step(graph, strategy, params, batch):
    """`strategy`'s sharded step of `graph` compiled (float64, `FAST`) and run once on
    `params` and `batch`: loss, gradients (in the stored layout), executable, shardings."""
    opt = keep_gradients()
    with jax.enable_x64(True):
        step, shardings = sharded_train_step(graph, strategy, make_mesh(TOPOLOGY), opt,
                                             params=params, batch=batch, compiler_options=FAST)
        placed = device_put_global((params, opt.init(params), batch),
                                   (shardings.params, shardings.opt_state, shardings.batch))
        exe = step.lower(*placed).compile()
        _, grads, loss = exe(*placed, np.int32(0))
    return loss, grads, exe, shardings


@functools.cache
def compiled(name: str, virtual: int, recompute: str = "full",
             sequence_parallel: bool = False):
    """The compiled sharded step of the tiny model (2 layers per virtual stage) under
    megatron_3d(tp=2, pp=2, interleave=virtual): loss, gradients, executable, shardings."""
    _, params, batch, graph, _ = model_case(name, STAGES * virtual)
    strategy = strategy_of(name, virtual, recompute, sequence_parallel)
    loss, grads, exe, shardings = run_step(graph, strategy, params, batch)
    return loss, model_layout(grads), exe, shardings


def relative_error(got, want) -> float:
    """Each gradient leaf against its own scale (`test_corpus.relative_error`)."""
    return corpus_relative_error(got, want)


CASES = [("gpt", 1), ("gpt", 2), ("llama", 1), ("llama", 2)]
IDS = ["gpt-1f1b", "gpt-interleaved", "llama-1f1b", "llama-interleaved"]


@pytest.mark.parametrize("name,virtual", CASES, ids=IDS)
def test_a_pipelined_plan_computes_the_unsharded_step(name, virtual):
    """megatron_3d(tp=2, pp=2, recompute="full") through `sharded_train_step`: loss and every
    gradient equal ``jax.value_and_grad(loss_fn)`` on one device to 1e-12, with 1F1B (2 layers,
    one per stage) and the interleaved schedule (4 layers, 2 virtual stages)."""
    assert strategy_of(name, virtual).schedule == ("interleaved" if virtual > 1 else "1f1b")
    want_loss, want = model_case(name, STAGES * virtual)[4]
    loss, grads, _, _ = compiled(name, virtual)
    assert relative_error(grads, want) < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12


@pytest.mark.parametrize("name,virtual", [("gpt", 1), ("llama", 2)],
                         ids=["gpt-1f1b", "llama-interleaved"])
def test_sequence_parallel_stages_compute_the_unsharded_step_and_send_their_shards(name,
                                                                                    virtual):
    """megatron_3d(tp=2, pp=2, sequence_parallel=True): the stages hold the residual stream
    split along the sequence over ``model``, as the plan does (`StageLayouts`), so each device
    sends its own half of it and nothing is gathered on arrival: every collective-permute
    2,048 bytes (a microbatch's 2 x 8 x 32 float64 stream, halved), no all-gather in the
    sends, the simulator's send bytes the same; inside the layers, the reduce-scatters of
    sequence parallelism. Loss and every gradient equal the unsharded step's to 1e-12."""
    want_loss, want = model_case(name, STAGES * virtual)[4]
    loss, grads, exe, shardings = compiled(name, virtual, "none", True)
    assert relative_error(grads, want) < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12
    found = collectives(exe.as_text(), shardings.loss.mesh)
    sends = [c for c in found if "pipeline_" in c.op_name]
    assert {(c.kind, c.nbytes) for c in sends} == {("collective-permute", 2048)}
    scattered = [c for c in collectives(exe.as_text(), shardings.loss.mesh,
                                        reduce_scatter_from_slices=True)
                 if c.kind == "reduce-scatter" and c.axes == ("model",)]
    assert len(scattered) >= 2 * virtual  # the attention's and the MLP's, each layer a stage
    # runs (XLA:CPU all-reduces and slices; without sequence parallelism there are none)
    graph = model_case(name, STAGES * virtual)[3]
    sim = PipelinedSimulation(graph, TOPOLOGY, cost_model(graph, TOPOLOGY, mode="analytic"),
                              Resharder(MeshShape.of(stage_topology(TOPOLOGY, STAGES)),
                                        mode="ideal"),
                              strategy_of(name, virtual, "none", True))
    assert set(sim.send_bytes()) == {2048}


def test_shardings_keep_the_model_layout_with_layers_split_over_stages():
    """`TrainShardings` of a pipelined plan are in the model's layout on stage x (one stage's
    mesh): each stacked layer parameter ``[L, ...]`` split over ``stage`` on its layer dim and
    as Megatron splits it over ``model`` on the rest; the head (LLaMA's is not tied) as the
    plan says, replicated over ``stage``; the batch over ``data``; the optimizer state as the
    parameters it mirrors."""
    shardings = compiled("llama", 1)[3]
    mesh = shardings.loss.mesh
    assert dict(mesh.shape) == {"stage": 2, "data": 2, "model": 2}
    assert mesh.devices.tolist() == make_mesh(TOPOLOGY).devices.reshape(2, 2, 2).tolist()
    p = jax.tree.map(lambda s: s.spec, shardings.params)["params"]
    assert p["layers"]["mlp"]["up"]["kernel"] == P("stage", None, "model")  # column-parallel
    assert p["layers"]["mlp"]["down"]["kernel"] == P("stage", "model", None)  # row-parallel
    assert p["layers"]["attn_norm"]["scale"] == P("stage", None)
    assert p["lm_head"]["kernel"] == P(None, "model")
    assert p["embed"]["embedding"] == P(None, None)
    assert {s.spec for s in jax.tree.leaves(shardings.batch)} == {P("data", None)}
    assert jax.tree.leaves(shardings.opt_state) == jax.tree.leaves(shardings.params)


def test_selective_recomputation_keeps_the_numbers_and_sits_between_in_memory():
    """The layers' recompute policy decides what a stage keeps between a microbatch's forward
    and backward: every residual ("none"), matmul outputs only ("selective": each layer in a
    ``jax.checkpoint`` with ``dots_saveable``), the chunk's input only ("full"). Same numbers;
    the compiled step's temporaries fall in that order (measured 903,176 > 481,384 > 239,984
    bytes)."""
    want = model_case("gpt", STAGES)[4][1]
    temp = {}
    for policy in ("none", "selective", "full"):
        _, grads, exe, _ = compiled("gpt", 1, policy)
        assert relative_error(grads, want) < 1e-12, policy
        temp[policy] = exe.memory_analysis().temp_size_in_bytes
    assert temp["none"] > temp["selective"] > temp["full"]


def test_selective_recomputation_keeps_the_attention_core_operators_a_plan_keeps():
    """A selective plan whose attention-core operators (the scores and the probabilities'
    product with the values, which selective recomputation runs again) have policy "none"
    (`soapjax.search.recompute.relaxed` makes such plans): `kept_positions` names them, each
    layer's checkpoint saves their outputs too (`_chunk_fn`'s ``kept``), so the compiled
    step keeps more than plain selective recomputation and less than none. Loss and every
    gradient leaf equal the unsharded step's to 1e-12 (float64, stage 2 x data 2 x model 2,
    1F1B, 4 microbatches), and the collectives are selective recomputation's."""
    _, params, batch, graph, (want_loss, want) = model_case("gpt", STAGES)
    base = strategy_of("gpt", 1, "selective")
    strategy = dataclasses.replace(base, recompute=tuple(
        "none" if op.block_position and recomputes(op, "selective") else base.recompute_of(j)
        for j, op in enumerate(graph.operators)))
    positions = kept_positions(graph, strategy)
    assert len(positions) >= 2 and all("attn" in p for p in positions)
    assert layer_recompute(graph, strategy) == "selective"
    assert kept_positions(graph, base) == ()
    loss, grads, exe, shardings = run_step(graph, strategy, params, batch)
    assert relative_error(model_layout(grads), want) < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12
    temp = exe.memory_analysis().temp_size_in_bytes
    selective = compiled("gpt", 1, "selective")[2]
    assert (selective.memory_analysis().temp_size_in_bytes < temp
            < compiled("gpt", 1, "none")[2].memory_analysis().temp_size_in_bytes)
    # keeping a value moves no bytes: the collectives are selective recomputation's, as the
    # simulator prices them (recomputing the attention core runs none: its heads are split)
    mesh = shardings.loss.mesh

    def kinds(e):
        return sorted((c.kind, c.nbytes) for c in collectives(e.as_text(), mesh))

    assert kinds(exe) == kinds(selective)


def test_kept_operators_need_selective_recomputation():
    """`pipelined_value_and_grad` refuses kept positions under another policy, and a position
    no layer operator has, saying so."""
    graph = model_case("gpt", STAGES)[3]
    mesh = make_mesh(TOPOLOGY).devices.reshape(2, 2, 2)
    mesh = Mesh(mesh, ("stage", "data", "model"), axis_types=(AxisType.Auto,) * 3)
    with pytest.raises(PlanError, match="only under recompute='selective', not 'full'"):
        pipelined_value_and_grad(graph, mesh, stages=STAGES, microbatches=4, recompute="full",
                                 kept=("layers_*/attn/scores",))
    with pytest.raises(PlanError, match="no operator of graph .* first layer is at them"):
        pipelined_value_and_grad(graph, mesh, stages=STAGES, microbatches=4,
                                 recompute="selective", kept=("layers_*/nowhere",))


def test_shard_training_runs_a_pipelined_plan():
    """`training.shard_training` with a pipelined `Plan` on the topology: the plan's mesh is
    the whole topology's, its configs one stage's; the first step's gradients are the
    unsharded ones."""
    w, params, batch, graph, (want_loss, want) = model_case("llama", STAGES)
    plan = Plan.make(graph, TOPOLOGY, strategy_of("llama", 1))
    assert plan.mesh == MeshShape.of(TOPOLOGY) and plan.pipeline == (2, 1, "1f1b")
    with jax.enable_x64(True):
        run = training.shard_training(w.loss_fn, params, batch, keep_gradients(),
                                      mesh=TOPOLOGY, strategy=plan, name="llama",
                                      compiler_options=FAST)
        _, grads, loss = run.step(run.params, run.opt_state, run.shard_batch(batch))
    assert run.strategy.pipelined and run.plan is plan
    assert relative_error(grads, want) < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12


def sending_sets(rows, kind: str, step: int, keep) -> list[tuple[tuple[int, int], ...]]:
    """Per tick of the tick table, the (source, target) stages that send a `kind` result."""
    return [tuple(sorted((s, (s + step) % STAGES) for s, a in enumerate(row)
                         if a is not None and a.kind == kind and keep(a.chunk))) for row in rows]


@pytest.mark.parametrize("virtual", [1, 2], ids=["1f1b", "interleaved"])
def test_stage_to_stage_bytes_are_what_the_simulator_prices(virtual):
    """The compiled step's collective-permutes against `PipelinedSimulation.send_bytes`.

    The tick loop holds one collective-permute per direction and set of stages sending at
    one tick (`soapjax.apply._pipelined`); how often each runs is read from the tick table, as in
    tests/test__pipelined.py. Summed over the step, the bytes each device position (one
    device of every stage's data x model grid) sends are 2 M sum(send_bytes): each chunk
    boundary's activation forward and its gradient back, per microbatch. Measured: 2048 bytes
    per permute (a microbatch's residual stream, 2 samples x 8 tokens x 32 x 8 bytes = 4096,
    replicated over ``model``, sent as Megatron's scatter/gather sends it: each of the 2
    replicas its half, all-gathered over ``model`` on arrival), 1F1B 4 + 4 sends = 16,384
    bytes, interleaved 12 + 12 = 49,152; simulated the same (send_bytes 2048 per boundary).
    Interleaved parameters also move, as all-to-alls, not permutes: the model layout's stage
    split is not the chunks'. Inside a stage, Megatron's split holds (the stages constrain
    their values to the plan's layouts, `soapjax.apply._pipelined.StageLayouts`): over
    ``model``, all-reduces of activations and of the vocabulary-parallel loss's statistics
    and picked log-probabilities (128 bytes a microbatch, forward and its recomputation: the
    loss's ``take_along_axis`` runs as a masked sum, `_run_in_stage`; it ran as an all-gather
    of the log-probabilities, 8,192 bytes, as XLA aborts on a gather of a split dim inside the
    stages' shard_map), the sends' all-gathers, and one more all-gather: the tied embedding's
    gradient where the prologue's backward adds the head's share to it (16,384 bytes; the
    prologue runs where XLA places it).
    """
    _, _, exe, shardings = compiled("gpt", virtual)
    mesh = shardings.loss.mesh
    graph, strategy = model_case("gpt", STAGES * virtual)[3], strategy_of("gpt", virtual)
    M, C = strategy.microbatches, STAGES * virtual
    per_stage = mesh.devices.size // STAGES  # HLO ids are positions in mesh.devices.flat
    nbytes = {}
    for c in collectives(exe.as_text(), mesh):
        if c.axes == ("model",) and "pipeline_" in c.op_name:
            assert c.kind == "all-gather" and c.nbytes == 4096, c
        elif c.axes == ("model",) and c.kind == "all-gather":
            assert c.nbytes == 16384, c
        elif c.axes == ("model",):
            assert c.kind == "all-reduce" and c.nbytes in (128, 256, 4096, 3 * 4096), c
        if c.kind != "collective-permute":
            continue
        scope = next(s for s in ("pipeline_activations", "pipeline_gradients") if s in c.op_name)
        assert c.axes == ("stage",), c
        pairs = tuple(sorted({(a // per_stage, b // per_stage) for a, b in c.source_target_pairs}))
        assert len(c.source_target_pairs) == per_stage * len(pairs)
        nbytes[scope, pairs] = c.nbytes
    rows = ticks(strategy.schedule, STAGES, M, virtual)
    measured = sum(nbytes[scope, pairs] * len(pairs)
                   for scope, kind, step, keep in (
                       ("pipeline_activations", "F", 1, lambda c: c < C - 1),
                       ("pipeline_gradients", "B", -1, lambda c: c > 0))
                   for pairs in sending_sets(rows, kind, step, keep) if pairs)
    sim = PipelinedSimulation(graph, TOPOLOGY, cost_model(graph, TOPOLOGY, mode="analytic"),
                              Resharder(MeshShape.of(stage_topology(TOPOLOGY, STAGES)),
                                        mode="ideal"), strategy)
    simulated = 2 * M * sum(sim.send_bytes())
    assert measured == {1: 16384, 2: 49152}[virtual]
    assert abs(measured / simulated - 1) <= 0.1


@pytest.mark.parametrize("virtual", [1, 2], ids=["1f1b", "interleaved"])
def test_the_layer_layout_moves_nothing_between_stages(virtual):
    """The interleaved schedule runs chunks ``s, s + S`` on stage ``s``; apply keeps the stacked
    layer parameters in that order between steps (`soapjax.apply._layer_order`), so the step
    moves nothing between stages to run them: no all-to-all (in the model's order it ran 32,
    103,168 bytes per device each way, on the tiny GPT), and the simulator prices none
    (`PipelinedSimulation.layout_move_bytes`). With one virtual stage the layouts agree."""
    _, _, exe, shardings = compiled("gpt", virtual)
    graph, strategy = model_case("gpt", STAGES * virtual)[3], strategy_of("gpt", virtual)
    measured = sorted(c.nbytes for c in collectives(exe.as_text(), shardings.loss.mesh)
                      if c.kind == "all-to-all")
    assert all(c.axes == ("stage",) for c in collectives(exe.as_text(), shardings.loss.mesh)
               if c.kind == "all-to-all")
    sim = PipelinedSimulation(graph, TOPOLOGY, cost_model(graph, TOPOLOGY, mode="analytic"),
                              Resharder(MeshShape.of(stage_topology(TOPOLOGY, STAGES)),
                                        mode="ideal"), strategy)
    assert measured == sorted(2 * sim.layout_move_bytes()) == []


@pytest.mark.parametrize("virtual", [1, 2], ids=["1f1b", "interleaved"])
def test_the_gradients_are_synchronised_over_data_once_per_step(virtual):
    """megatron_3d splits the batch over ``data`` (`batch_axes`), so each data group runs its
    samples of every microbatch and the gradients are all-reduced over ``data`` once, after
    the tick loop, as the simulator prices the synchronisation: 70,536 bytes per device with
    1F1B (one layer per stage under Megatron's split, 51,584 bytes, then the embeddings', the
    final norm's and the loss, 18,952: the tied embedding's gradient on its vocabulary shard,
    as the plan splits it, its prologue part too, as each stage runs the prologue's backward
    on its own cotangents; 8,192 bytes more when the stages' cotangents were summed first,
    8,192 more again before the stages held the plan's layouts), 122,120 interleaved (two
    layers per stage, 51,584 more). Before the data groups, XLA
    all-reduced each backward's gradients inside the loop
    (GPT tiny 1F1B: 68,480 bytes per backward on stage 0, 51,584 on stage 1, M = 4 times)."""
    _, _, exe, shardings = compiled("gpt", virtual)
    graph = model_case("gpt", STAGES * virtual)[3]
    assert batch_axes(graph, strategy_of("gpt", virtual)) == ("data",)
    over_data = [c for c in collectives(exe.as_text(), shardings.loss.mesh)
                 if "data" in (c.axes or ())]
    assert [(c.kind, c.executions) for c in over_data] == [("all-reduce", 1)] * len(over_data)
    assert sum(c.nbytes for c in over_data) == {1: 70_536, 2: 122_120}[virtual]


# --- uneven stages ------------------------------------------------------------------------------


@functools.cache
def compiled_uneven(name: str, stage_layers: tuple[int, ...], recompute: str):
    """The compiled step of the tiny model's 4 layers cut into `stage_layers` under
    megatron_3d(tp=2, pp=2): loss, gradients, executable, shardings, strategy."""
    _, params, batch, graph, _ = model_case(name, sum(stage_layers))
    strategy = megatron_3d(graph, TOPOLOGY, tp=2, pp=STAGES, microbatch_size=2,
                           recompute=recompute).with_pipeline(STAGES, 1, "1f1b", stage_layers)
    return (*run_step(graph, strategy, params, batch), strategy)


UNEVEN = [("gpt", (1, 3), "full"), ("llama", (3, 1), "selective"), ("gpt", (3, 1), "none")]


@pytest.mark.parametrize("name,stage_layers,recompute", UNEVEN,
                         ids=["gpt-1-3-full", "llama-3-1-selective", "gpt-3-1-none"])
def test_uneven_stages_compute_the_unsharded_step(name, stage_layers, recompute):
    """Stages of 1 and 3 layers (and 3 and 1): each stage runs its own layers, its scan over
    the longest stage's padded run skipping the padding (`_pipelined._chunk_fn`), the layers
    moved there from the model's layout and the gradients back (`stage_router`). Loss and
    every gradient equal ``jax.value_and_grad(loss_fn)`` on one device to 1e-12, float64."""
    want_loss, want = model_case(name, sum(stage_layers))[4]
    loss, grads, _, _, strategy = compiled_uneven(name, stage_layers, recompute)
    assert strategy.stage_layers == stage_layers
    assert relative_error(grads, want) < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12


def test_uneven_stages_send_the_layers_the_simulator_prices():
    """Stage 0 keeps layers 0-1 and runs layer 0; stage 1 keeps 2-3 and runs 1-3: each
    stacked parameter's layer 1 goes from stage 0 to stage 1 (one collective-permute over
    ``stage`` each, 16 of them, 51,584 bytes per device: one layer under Megatron's split)
    and its gradient back (16 more),
    what `PipelinedSimulation.layout_move_bytes` prices, byte for byte; no all-to-all."""
    _, _, exe, shardings, strategy = compiled_uneven("gpt", (1, 3), "full")
    graph = model_case("gpt", 4)[3]
    moves = [c for c in collectives(exe.as_text(), shardings.loss.mesh)
             if c.kind in ("collective-permute", "all-to-all") and "pipeline_" not in c.op_name]
    assert {(c.kind, c.axes, c.executions) for c in moves} == {
        ("collective-permute", ("stage",), 1)}
    forward = sorted(c.nbytes for c in moves if "transpose" not in c.op_name)
    back = sorted(c.nbytes for c in moves if "transpose" in c.op_name)
    sim = PipelinedSimulation(graph, TOPOLOGY, cost_model(graph, TOPOLOGY, mode="analytic"),
                              Resharder(MeshShape.of(stage_topology(TOPOLOGY, STAGES)),
                                        mode="ideal"), strategy)
    assert forward == back == sorted(sim.layout_move_bytes())
    assert sum(forward) == 51_584


# --- what would hang: refused at compile, and never searched ---------------------------------


def test_a_layout_change_xla_makes_by_permuting_tiles_is_refused_and_never_searched():
    """The search once split the attention's output projection's tokens over ``data`` and its
    output over ``model`` inside GPT 175B's stages, where Megatron's layout splits the
    heads it reads over both: XLA moves the attention's output there with a
    collective-permute, which only the stage's own devices would run (its step would hang).
    Apply refuses the plan at compile (`_pipelined.check_compiled`); the simulator names
    the same reads (`PipelinedSimulation.stage_permutes`, the search's guard:
    `soapjax.search._chain._hangs`), and none of Megatron's layout."""
    _, params, batch, graph, _ = model_case("gpt", STAGES)
    base = megatron_3d(graph, TOPOLOGY, tp=4, pp=STAGES, microbatch_size=2, recompute="none",
                       sequence_parallel=True)
    moved = dataclasses.replace(base, configs=tuple(
        Config(((), ("data",), ("model",), (), ())) if op.name.endswith("attn/out") else c
        for op, c in zip(graph.operators, base.configs)))
    stage = MeshShape.of(stage_topology(TOPOLOGY, STAGES))

    def flagged(strategy):
        sim = PipelinedSimulation(graph, TOPOLOGY, cost_model(graph, TOPOLOGY, mode="analytic"),
                                  Resharder(stage, mode="ideal"), strategy)
        return {name for name, _ in sim.stage_permutes()}

    assert flagged(base) == set()
    assert flagged(moved) == {"layers_0/attn/out", "layers_1/attn/out"}
    with pytest.raises(PlanError, match="collective-permute inside the stage's own action"):
        run_step(graph, moved, params, batch)


def test_a_plan_whose_layers_keep_a_batch_axis_off_one_operators_samples_runs_in_groups():
    """Megatron's layout with each layer's second norm splitting its tokens over ``model``
    and its samples over nothing. The stages' data groups once took only the axes every
    layer operator splits its samples over: none here, so XLA partitioned over ``data``
    inside the stages, where the norm's read gathered ``data`` and sliced ``model`` at once
    (a collective-permute: apply refused the plan, and the guard named the norms). The groups
    take every axis some layer operator splits its samples over and none splits another dim
    over (`soapjax.strategy.space.batch_axes`): ``data``, so the norm runs on its group's
    samples, nothing moves across the group, the guard names nothing, and loss and every
    gradient leaf equal the unsharded step's to 1e-12."""
    _, params, batch, graph, (want_loss, want) = model_case("gpt", STAGES)
    base = megatron_3d(graph, TOPOLOGY, tp=2, pp=STAGES, microbatch_size=2, recompute="none")
    moved = dataclasses.replace(base, configs=tuple(
        Config(((), ("model",), ())) if op.name.endswith("ln_2") else c
        for op, c in zip(graph.operators, base.configs)))
    assert batch_axes(graph, base) == ("data",) and batch_axes(graph, moved) == ("data",)
    stage = MeshShape.of(stage_topology(TOPOLOGY, STAGES))
    sim = PipelinedSimulation(graph, TOPOLOGY, cost_model(graph, TOPOLOGY, mode="analytic"),
                              Resharder(stage, mode="ideal"), moved)
    assert sim.stage_permutes() == ()
    loss, grads, _, _ = run_step(graph, moved, params, batch)
    assert relative_error(model_layout(grads), want) < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12


# --- what cannot run: refused before anything compiles ------------------------------------------


def refused(graph, strategy, match: str, mesh: Mesh | None = None) -> None:
    with pytest.raises(PlanError, match=match):
        sharded_train_step(graph, strategy, mesh or make_mesh(TOPOLOGY), optax.sgd(0.1))


def test_a_model_without_a_layer_scan_is_refused():
    w = soapjax_zoo.get("mlp", "tiny")
    graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="mlp")
    refused(graph, megatron_3d(graph, TOPOLOGY, tp=2, pp=2, microbatch_size=2),
            r"pipelining needs the model's layers as one scan .* graph 'mlp' has no layer scan")


def test_a_model_that_draws_dropout_masks_is_refused():
    import corpus

    loss_fn, params, batch = corpus.get("linen_scan_transformer")
    graph = trace(loss_fn, params, batch, name="scan_transformer")
    refused(graph, megatron_3d(graph, TOPOLOGY, tp=2, pp=2),
            r"draws random bits \(dropout\); pipelined microbatches would draw other masks")


def test_a_layer_scan_that_stacks_integers_is_refused():
    """The pipeline carries the per-layer outputs a layer scan stacks, and their cotangents,
    from stage to stage (`_ys_stacks`): a stack of integers (each layer's count of positive
    activations, which the loss reads) has no cotangent to carry, so it is refused, saying
    why."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = jnp.tanh(nn.Dense(16)(x))
            return x + h, (h > 0).sum().astype(jnp.int32)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, counts = nn.scan(Block, variable_axes={"params": 0},
                                split_rngs={"params": True}, length=4)()(x, None)
            return x, counts

    net, x = Net(), jnp.ones((BATCH, 16))

    def loss_fn(p, b):
        y, counts = net.apply(p, b["x"])
        return jnp.mean(y ** 2) + 1e-6 * counts.sum().astype(jnp.float32)

    params = net.init(jax.random.PRNGKey(0), x)
    graph = trace(loss_fn, params, {"x": x})
    refused(graph, megatron_3d(graph, TOPOLOGY, tp=1, pp=STAGES, microbatch_size=4),
            "stacks a per-layer output that the rest does not read as one stack of floats")


def test_uneven_stages_apply_cannot_run_are_refused():
    """Uneven stages keep L / S layers a stage between steps: 4 layers on 2 stages cut 1 / 3
    run; the same model's 3 layers cut 1 / 2 do not (the stages do not divide them)."""
    graph = model_case("gpt", 3)[3]
    strategy = megatron_3d(graph, TOPOLOGY, tp=2, pp=STAGES, microbatch_size=2,
                           recompute="full").with_pipeline(STAGES, 1, "1f1b", (1, 2))
    refused(graph, strategy, "3 layers are kept 3 / 2 per stage between steps, which needs "
            "the stages to divide them")
    graph = model_case("gpt", 4)[3]
    strategy = megatron_3d(graph, TOPOLOGY, tp=2, pp=STAGES, microbatch_size=2,
                           recompute="full").with_pipeline(STAGES, 1, "1f1b", (1, 2))
    refused(graph, strategy, r"stage layers \(1, 2\) add up to 3, but the model has 4 layers")


def test_layers_that_do_not_divide_into_the_chunks_are_refused():
    graph = model_case("gpt", 2)[3]
    strategy = megatron_3d(graph, TOPOLOGY, tp=2, pp=2, interleave=2, microbatch_size=2)
    refused(graph, strategy, r"cuts its 2 layers into stages x virtual = 2 x 2 = 4 chunks")


def test_configs_over_the_whole_mesh_are_refused():
    """A pipelined strategy's configs are over one stage's mesh (data=2 x model=2 here):
    configs that split over ``node`` were planned for the whole mesh."""
    graph = model_case("gpt", 2)[3]
    flat = megatron_3d(graph, TOPOLOGY, tp=2, microbatch_size=2)  # over node x data x model
    uses_node = next(c for c in flat.configs if "node" in c.used_axes)
    assert uses_node is not None
    refused(graph, flat.with_pipeline(2),
            r"uses mesh axis 'node', but the mesh has axes \('data', 'model'\) \(with 2 pipeline "
            r"stages .* the configs are over one stage's mesh \(data=2, model=2\): mesh "
            r"\(node=2, data=2, model=2\) with its outermost axis cut 2 ways\)")


def test_a_mesh_that_has_a_stage_axis_or_too_few_outer_devices_is_refused():
    graph = model_case("gpt", 2)[3]
    strategy = strategy_of("gpt", 1)
    devices = np.asarray(jax.devices()[:8])
    staged = Mesh(devices.reshape(2, 2, 2), ("stage", "data", "model"),
                  axis_types=(AxisType.Auto,) * 3)
    with pytest.raises(PlanError, match="add the mesh axis 'stage', but mesh"):
        sharded_train_step(graph, strategy, staged, optax.sgd(0.1),
                           mesh_shape=MeshShape.of(staged))
    flat = Mesh(devices.reshape(1, 4, 2), ("node", "data", "model"),
                axis_types=(AxisType.Auto,) * 3)
    with pytest.raises(PlanError, match=r"2 pipeline stages cut the outermost mesh axis 'node' "
                                        r"\(size 1\)"):
        sharded_train_step(graph, strategy, flat, optax.sgd(0.1), mesh_shape=MeshShape.of(flat))


def test_constrained_loss_refuses_a_pipelined_strategy():
    graph = model_case("gpt", 2)[3]
    with pytest.raises(PlanError, match="has 2 pipeline stages, and constrained_loss is one "
                                        "SPMD loss without stages; run a pipelined strategy "
                                        "with sharded_train_step"):
        constrained_loss(graph, strategy_of("gpt", 1), make_mesh(TOPOLOGY))


@functools.cache
def moe_case(layers: int):
    """The zoo's tiny MoE (GShard dispatch and combine, a load-balancing loss per layer that
    the layer scan stacks) in float64 with `layers` layers, batch 8: its loss function, graph,
    parameters and batch."""
    from test_corpus import float64_workload

    from soapjax_zoo import moe

    cfg = dataclasses.replace(moe.MOE_CONFIGS["tiny"], param_dtype="float64", num_layers=layers)
    w = moe.build_moe("moe", f"tiny-x64-{layers}", cfg, "linen")
    return (w.loss_fn, *float64_workload(w, "moe")[:3])


@pytest.mark.parametrize("layers,virtual,recompute", [(2, 1, "selective"), (4, 2, "none")],
                         ids=["1f1b-selective-moe-kept", "interleaved-none"])
def test_an_moe_pipeline_carries_the_stacked_losses_and_computes_the_microbatched_step(
        layers, virtual, recompute):
    """The MoE's layer scan stacks each layer's load-balancing loss, which the epilogue sums
    into the loss: the pipeline carries that ``[L]`` stack from chunk to chunk beside the
    residual stream (each chunk adds its layers' rows) and hands the last chunk the whole of
    it. Its samples interact (the loss is a statistic over the microbatch, which the zoo's
    MoE accepts per microbatch) through sums over them (`OpGraph.sample_sums`: the means of
    the routes and the router's probabilities), so each data group runs its share of every
    microbatch and adds those sums across the groups (`_Groups.sums`): the step is the mean
    over the 4 microbatches (samples k, k + 4, ...) of the loss, as unpipelined. Megatron's
    TP2 PP2 (SP), 1F1B with selective recomputation as Megatron runs it on an MoE layer (its
    einsums kept: `kept_positions`) and interleaved with 2 virtual stages: loss and every
    gradient leaf to 1e-12 (float64, stage 2 x data 2 x model 2). (Without the sums added,
    each group's statistics its own: loss half, gradients 65 % off.)"""
    loss_fn, graph, params, batch = moe_case(layers)
    strategy = megatron_3d(graph, TOPOLOGY, tp=2, pp=STAGES, interleave=virtual,
                           microbatch_size=1, recompute=recompute, sequence_parallel=True)
    strategy = dataclasses.replace(strategy, recompute=tuple(
        "none" if "/moe/" in op.name else strategy.recompute_of(j)
        for j, op in enumerate(graph.operators)))
    M = strategy.microbatches
    assert M == 4 and graph.program.layer_scans[0].ys  # the stacked losses
    assert bool(kept_positions(graph, strategy)) == (recompute == "selective")
    outer = _pipelined._cut(graph.at_batch_size(graph.batch_size // M))
    _, groups = _pipelined._data_groups(graph, outer, make_mesh(TOPOLOGY), M, ("data",),
                                        "node")
    assert groups.axes == ("data",) and len(groups.sums) == 2 * layers + 1  # + the loss's
    assert groups.literals  # the means' divisors, at the microbatch's size

    def microbatched(p, b):
        return sum(loss_fn(p, jax.tree.map(lambda x: x[k::M], b)) for k in range(M)) / M

    with jax.enable_x64(True):
        want_loss, want = jax.jit(jax.value_and_grad(microbatched),
                                  compiler_options=FAST)(params, batch)
    loss, grads, _, _ = run_step(graph, strategy, params, batch)
    assert relative_error(model_layout(grads), want) < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12


def test_a_batch_norm_inside_pipelined_layers_computes_the_whole_batch_statistics():
    """Layers that normalise by the batch's mean and variance (a batch norm in training mode,
    written out: statistics over the samples that then meet each sample), scanned, pipelined
    over 2 stages with the batch split over ``data`` x ``model`` (4 data groups of 4 samples,
    one microbatch: the graph keeps the user's step): each group adds its sums over the
    samples across the groups (`_Groups.sums`: every layer's mean and variance and the loss's
    mean) and divides by the whole batch's count (`_Groups.literals`), so loss and every
    gradient leaf equal ``jax.value_and_grad`` of the unsharded loss to 1e-12 (float64)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.Dense(16, param_dtype=jnp.float64)(x)
            mean = h.mean(axis=0)
            var = ((h - mean) ** 2).mean(axis=0)
            return x + jnp.tanh((h - mean) / jnp.sqrt(var + 1e-5)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, param_dtype=jnp.float64)(x)
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=4)()(x, None)
            return nn.Dense(1, param_dtype=jnp.float64)(x)

    net = Net()

    def loss_fn(p, b):
        return jnp.mean((net.apply(p, b["x"]) - b["y"]) ** 2)

    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        batch = {"x": jax.random.normal(keys[0], (BATCH, 8), jnp.float64),
                 "y": jax.random.normal(keys[1], (BATCH, 1), jnp.float64)}
        params = net.init(keys[2], batch["x"])
        graph = trace(loss_fn, params, batch)
        want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
        _, groups = _pipelined._data_groups(graph, _pipelined._cut(graph), make_mesh(TOPOLOGY),
                                            1, ("data", "model"), "node")
    assert graph.sample_coupling and not graph.microbatch_statistics
    assert groups.count == 4 and len(groups.sums) == 2 * 4 + 1
    assert sorted({float(x) for x in groups.literals.values()}) == [BATCH]  # not 4
    strategy = megatron_3d(graph, TOPOLOGY, tp=1, pp=STAGES, microbatch_size=4,
                           recompute="full")
    assert strategy.microbatches == 1
    loss, grads, _, _ = run_step(graph, strategy, params, batch)
    assert relative_error(model_layout(grads), want) < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12


def test_a_zero_bubble_plan_that_keeps_attention_core_operators_computes_the_unsharded_step():
    """The plan above (selective recomputation keeping the attention core's operators) under
    ZB-H1: each layer's checkpoint saves the kept values and the deferred weight matmuls'
    outputs (`_chunk_fn`'s names), and every gradient leaf equals the unsharded step's to
    1e-12 (as the search's Mixtral 8x22B plan runs: docs/vs-experts.md)."""
    _, params, batch, graph, (want_loss, want) = model_case("gpt", STAGES)
    base = strategy_of("gpt", 1, "selective")
    strategy = dataclasses.replace(base, recompute=tuple(
        "none" if op.block_position and recomputes(op, "selective") else base.recompute_of(j)
        for j, op in enumerate(graph.operators))).with_pipeline(STAGES, 1, "zb-h1")
    assert len(kept_positions(graph, strategy)) >= 2
    loss, grads, _, _ = run_step(graph, strategy, params, batch)
    assert relative_error(model_layout(grads), want) < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_a_zero_bubble_plan_under_sequence_parallelism_keeps_its_stash_lean_and_exact(
        recompute):
    """ZB-H1 at TP2 with sequence parallelism, and its gathered form (the stash kept as the
    matmuls use it, W gathering nothing: 1F1B's collectives). ZB-H1's stash keeps what the
    stage holds split along the sequence as it holds it (the norms' outputs q/k/v and fc1
    read, the cotangents out's and fc2's reduce-scatters hand back) and each W all-gathers it
    again (`_Pipeline._stash_specs`). Every gradient leaf within 1e-12 of its own scale, and
    the compiled step all-gathers, over 1F1B's step, exactly the bytes the simulator adds for
    the W's gathers (`PipelinedSimulation.step_collectives`: the cotangents', and the
    operands' but under selective recomputation, where they replace the backward's own
    gathers; a fully recomputed chunk gathers them for its forward again), as each runs."""
    _, params, batch, graph, (want_loss, want) = model_case("gpt", STAGES)
    gathered = {}
    for schedule in ("zb-h1", "zb-h1-gathered", "1f1b"):
        strategy = strategy_of("gpt", 1, recompute, True).with_pipeline(STAGES, 1, schedule)
        loss, grads, exe, shardings = run_step(graph, strategy, params, batch)
        comparison = compare_gradients(loss, model_layout(grads), want_loss, want,
                                       tolerance=1e-12)
        assert comparison.passed, comparison.describe()
        run = collectives_as_run(collectives(exe.as_text(), shardings.loss.mesh), strategy)
        gathered[schedule] = sum(c.nbytes * c.executions for c in run if c.kind == "all-gather")
        sim = PipelinedSimulation(graph, TOPOLOGY, cost_model(graph, TOPOLOGY, mode="analytic"),
                                  Resharder(MeshShape.of(stage_topology(TOPOLOGY, STAGES)),
                                            mode="ideal"), strategy)
        if schedule == "zb-h1":
            lean = sim._stash()[1]
            again = sum(e.used for xs, dys in lean for e in (*xs, *dys)
                        if not e.moved) * strategy.microbatches
            assert all(len(xs) == len(dys) == 2 for xs, dys in lean)  # a layer a chunk
            # a selectively recomputed layer's backward gathers q/k/v's and fc1's operand
            # again for their weights' gradients: W's replaces that one
            assert all(e.moved == (recompute == "selective") for xs, _ in lean for e in xs)
    assert again > 0 and gathered["zb-h1"] - gathered["1f1b"] == again
    assert gathered["zb-h1-gathered"] == gathered["1f1b"]  # the stash kept as used
