"""Flash attention as one operator of the graph (`soapjax.base.attention.flash_attention`, issue
32): traced, priced and applied, in both forms of context parallelism.

* The tiny llama with ``attention="flash"`` (`soapjax_zoo.llama`, 128 tokens in blocks of 32
  keys, grouped-query heads: 8 query heads on 4 key/value heads) has one attention operator
  per layer, which splits its batch, its query sequence and its heads, nothing else.
* Its float64 gradients on cpu8 equal the unsharded ``jax.grad`` (1e-12) data parallel, under
  context parallelism (the sequence over ``model``: the attention equation in `jax.shard_map`,
  `soapjax.apply._context_parallel`) gathered and as a ring (`Strategy.ring_attention`), each with
  tensor parallelism too, under a searched plan, and pipelined (TP x CP x PP).
* The compiled gathered step gathers each layer's keys and values once and reduce-scatters
  their cotangents once, and sends the halves of its query and output blocks to balance
  causal attention; the ring step sends their blocks around; both as the simulator prices
  them, kind by kind, counts and bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_delta_equals_full
from jax.sharding import Mesh
from test_corpus import (
    FAST_COMPILE,
    X64_TOL,
    float64_workload,
    relative_error,
    sharded_grads,
    sharded_grads_and_hlo,
    worst_leaf,
)

import soapjax_zoo
from soapjax.apply.step import (
    device_put_global,
    sharded_train_step,
)
from soapjax.base.attention import ring_work
from soapjax.base.errors import PlanError
from soapjax.cost.kernels import FlashKernel, flash_time, shard_kernels
from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import Resharder
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.measure import hlo
from soapjax.search import SearchSettings, find_plan
from soapjax.simulate.front import simulate
from soapjax.strategy import space
from soapjax.strategy.baselines import megatron_3d
from soapjax.strategy.memory import attention_core, recomputes, residuals
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import Config, MeshShape, Strategy
from soapjax.topology.cluster import load_topology, make_mesh
from soapjax_zoo import llama

TOPOLOGY = load_topology("cpu8")
MESH = MeshShape.of(TOPOLOGY)
CONFIG = dataclasses.replace(llama.LLAMA_CONFIGS["tiny-flash"], param_dtype="float64")
SEQ_LEN = CONFIG.seq_len
_COLLECTIVE_TASKS = ("reshard", "reshard_backward", "partial_sum", "inner_reduce",
                     "inner_reduce_backward", "grad_sync", "param_gather")


@functools.cache
def case():
    """The tiny flash llama in float64: graph, params (init + N(0, 0.05)), batch, and the
    unsharded ``jax.grad`` of the loss."""
    w = llama.build_llama("llama", "tiny-flash-x64", CONFIG, "linen")
    return float64_workload(w, "llama")


def attention_ops(graph: OpGraph):
    return [op for op in graph.operators if op.anchor == "attention"]


def test_one_attention_operator_per_layer_splits_batch_sequence_and_heads():
    graph = case()[0]
    ops = attention_ops(graph)
    assert [op.name for op in ops] == ["layers_0/attn", "layers_1/attn"]
    op = ops[0]
    assert op.shape == (2, SEQ_LEN, 8, 4) and op.roles[:2] == ("S", "A")
    assert op.divisible_dims == (0, 1, 2)  # not the head dim, not the keys' sequence
    # its operands: the queries and the grouped keys and values (4 heads: no repeat), whose
    # heads follow the query heads (so a split of the heads must divide 4)
    acts = [x for x in op.inputs if x.kind == "activation"]
    assert [x.shape for x in acts] == [(2, SEQ_LEN, 8, 4), (2, SEQ_LEN, 4, 4), (2, SEQ_LEN, 4, 4)]
    assert [x.dims for x in acts] == [(0, 1, 2, 4), (0, 5, 2, 4), (0, 5, 2, 3)]
    assert op.split_sizes[:3] == (2, SEQ_LEN, 4)
    assert not any(o.anchor == "dot_general" and not o.params for o in graph.operators)


def context_parallel(graph: OpGraph, axis: str, heads: str | None = None) -> Strategy:
    """Every operator's first iteration dim of extent `SEQ_LEN` over `axis`, its sample dim over
    the other axes (or, with `heads`, attention's heads and every projection's heads over
    `heads`, tensor parallel)."""
    rest = tuple(a for a in MESH.axis_names if a not in (axis, heads))
    configs = {}
    for op in graph.operators:
        axes: list[tuple[str, ...]] = [()] * len(op.iteration_sizes)
        if (d := space.sample_dim(op)) is not None and rest:
            axes[d] = rest
        if SEQ_LEN in op.iteration_sizes:
            axes[op.iteration_sizes.index(SEQ_LEN)] = (axis,)
        if heads and len(op.shape) == 4 and op.iteration_sizes[2] in (4, 8):
            axes[2] = (heads,)
        configs[op.name] = Config(tuple(axes))
    return space.strategy_from_names(graph, configs)


def ring(strategy: Strategy) -> Strategy:
    return dataclasses.replace(strategy, ring_attention=True)


STRATEGIES = {
    "dp": lambda g: space.data_parallel(g, MESH),
    "cp_model": lambda g: context_parallel(g, "model"),
    "cp_data_tp_model": lambda g: context_parallel(g, "data", heads="model"),
    "ring_model": lambda g: ring(context_parallel(g, "model")),
    "ring_data_tp_model": lambda g: ring(context_parallel(g, "data", heads="model")),
}


@functools.cache
def applied(kind: str, workload=None):
    """The float64 gradient of strategy `kind` applied on cpu8 to `workload()` (default: the
    tiny flash llama, `case`), and the compiled step's HLO."""
    graph, params, batch, _ = (workload or case)()
    strategy, mesh = STRATEGIES[kind](graph), make_mesh(TOPOLOGY)
    return sharded_grads_and_hlo(graph, strategy, mesh, params, batch)


@pytest.mark.parametrize("kind", STRATEGIES)
def test_gradients_are_exact(kind):
    want = case()[3]
    got = applied(kind)[0]
    err = relative_error(got, want)
    assert err <= X64_TOL, f"{kind}: {err:.3g}; worst leaf {worst_leaf(got, want)}"


def kept_attention(graph: OpGraph, strategy: Strategy, microbatches: int) -> Strategy:
    """`strategy` as `soapjax.search.recompute` leaves long-context plans: every layer operator
    recomputed but the attention core and its output projection, which keep their outputs;
    `microbatches` microbatches."""
    policies = tuple("none" if not op.block_position
                     or op.name.split("/", 1)[1] in ("attn", "attn/o") else "full"
                     for op in graph.operators)
    return dataclasses.replace(strategy, recompute=policies, microbatches=microbatches)


@pytest.mark.parametrize("where", ["one device", "cpu8"])
def test_the_attention_kept_where_the_rest_recomputes_is_exact(where):
    """The plan the search's recompute walk makes at long sequences (the attention core kept,
    the rest of each layer recomputed, two microbatches) under context parallelism over
    ``data`` and tensor parallelism over ``model``, and on one device: the float64 step's
    gradients equal the unsharded ``jax.grad``, each leaf against its own scale."""
    graph, params, batch, want = case()
    strategy = kept_attention(graph, context_parallel(graph, "data", heads="model"), 2)
    assert {strategy.recompute_of(j) for j, op in enumerate(graph.operators)
            if op.block_position} == {"none", "full"}
    mesh = (Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
            if where == "one device" else make_mesh(TOPOLOGY))
    keep = optax.GradientTransformation(  # the state is the gradient; parameters unchanged
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))
    with jax.enable_x64(True):
        step, sh = sharded_train_step(graph, strategy, mesh, keep, params=params, batch=batch,
                                      compiler_options=FAST_COMPILE)
        placed = device_put_global((params, keep.init(params), batch),
                                   (sh.params, sh.opt_state, sh.batch))
        _, got, _ = step(*placed)
    err = relative_error(got, want)
    assert err <= X64_TOL, f"{where}: {err:.3g}; worst leaf {worst_leaf(got, want)}"


def compiled(kind: str) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for c in hlo.collectives(applied(kind)[1], MESH, reduce_scatter_from_slices=True):
        k = c.kind.replace("-", "_")
        n, b = out.get(k, (0, 0.0))
        out[k] = (n + len(c.shapes) * c.executions, b + c.nbytes * c.executions)
    return out


@functools.cache
def simulation(kind: str):
    graph = case()[0]
    cm = cost_model(graph, TOPOLOGY, mode="analytic")
    with Resharder(MESH, mode="ideal") as resharder:
        return simulate(graph, TOPOLOGY, STRATEGIES[kind](graph), cost_model=cm,
                        resharder=resharder)


def simulated(kind: str) -> dict[str, tuple[int, float]]:
    """Per collective kind, (collectives, bytes per device) of the simulator's tasks; a ring
    task stands for its cp - 1 sends (`Simulation._ring_chain`): it counts that many, of its
    bytes sent."""
    out: dict[str, tuple[int, float]] = {}
    for t in simulation(kind).tasks:
        if t.kind in _COLLECTIVE_TASKS:
            k = t.name.split(" ", 1)[0]
            n, b = out.get(k, (0, 0.0))
            steps = round(t.sent / t.nbytes) if k == "collective_permute" else 1
            out[k] = (n + steps, b + (t.sent if k == "collective_permute" else t.nbytes))
    return out


def test_context_parallel_collectives_are_priced_as_compiled():
    xla, sim = compiled("cp_model"), simulated("cp_model")
    # per layer the keys and the values gathered whole along the sequence inside attention's
    # shard_map: [1 sequence, 128 tokens, 4 kv heads, 4] float64, 16 KiB each; their
    # cotangents reduce-scattered back (transposed gathers), as many bytes
    gathered = (2 * 2, 2 * 2 * 1 * SEQ_LEN * 4 * 4 * 8)
    assert xla["all_gather"] == gathered, (xla, sim)
    assert xla["reduce_scatter"] == gathered, (xla, sim)
    for kind in ("all_gather", "reduce_scatter"):
        n, b = sim[kind]
        assert n == gathered[0], (kind, xla, sim)
        assert b == pytest.approx(gathered[1], rel=0.10), (kind, xla, sim)
    # causal attention balanced (`soapjax.base.attention.zigzag_sends`): per layer each half of the
    # query block to the device that computes it and each half of the output back, and their
    # cotangents the other way ([1, 16 tokens, 8 heads, 4] float64, 4 KiB each)
    balanced = (2 * 8, 2 * 8 * 1 * (SEQ_LEN // 4 // 2) * 8 * 4 * 8)
    assert xla["collective_permute"] == sim["collective_permute"] == balanced, (xla, sim)
    assert set(xla) == set(sim) == {"all_gather", "all_reduce", "reduce_scatter",
                                    "collective_permute"}, (xla, sim)


def test_ring_attention_sends_are_priced_as_compiled():
    """The ring form (`Strategy.ring_attention`): nothing gathered, nothing reduce-scattered;
    per layer, cp - 1 = 3 steps of the key and the value blocks forward and of their
    cotangents backward ([1, 32, 4, 4] float64, 4 KiB each), and of the key positions
    forward, which XLA sends once for both layers (the same values: common subexpressions),
    where the simulator counts them per layer (128 bytes each)."""
    xla, sim = compiled("ring_model"), simulated("ring_model")
    assert set(xla) == set(sim) == {"collective_permute", "all_reduce"}, (xla, sim)
    blocks = 2 * 4 * 3  # layers x (k, v forward; their cotangents backward) x steps
    kv_bytes = 1 * (SEQ_LEN // 4) * 4 * 4 * 8
    found = [c for c in hlo.collectives(applied("ring_model")[1], MESH)
             if c.kind == "collective-permute"]
    floats = [c for c in found if c.shapes[0].startswith("f64")]
    assert sum(c.executions for c in floats) == blocks
    assert {c.nbytes for c in floats} == {kv_bytes}
    tasks = [t for t in simulation("ring_model").tasks if t.name.startswith("collective_permute")]
    kv = [t for t in tasks if t.nbytes == kv_bytes]  # one task per tensor: its 3 steps
    assert len(kv) == blocks // 3 and {t.sent for t in kv} == {3 * kv_bytes}
    assert len(tasks) == len(kv) + 2  # and the positions, per layer
    assert sim["collective_permute"][1] == pytest.approx(xla["collective_permute"][1], rel=0.10)
    # the same weights' gradients as the gathered form
    assert xla["all_reduce"] == compiled("cp_model")["all_reduce"]


def test_the_ring_costs_more_compute_than_the_gathered_form():
    """Over contiguous blocks the synchronous ring does the work of a whole block row
    (`soapjax.base.attention.ring_work`), the gathered form a balanced causal half."""
    graph = case()[0]
    j = graph.index("layers_0/attn")
    gathered, ringed = simulation("cp_model"), simulation("ring_model")

    def forward(r):
        return next(t.end_s - t.start_s for t in r.tasks if t.kind == "forward" and t.name.endswith(
            "layers_0/attn"))

    assert forward(ringed) == pytest.approx(forward(gathered) * ring_work(4) / 0.5, rel=1e-9)
    assert graph.operators[j].anchor == "attention"


def test_a_ring_strategy_goes_through_a_plan_file_and_refuses_stages():
    graph = case()[0]
    strategy = STRATEGIES["ring_model"](graph)
    r = simulation("ring_model")
    plan = Plan.make(graph, TOPOLOGY, strategy, predicted={"step_time_s": r.step_time_s})
    again = Plan.from_json(plan.to_json())
    assert again.ring_attention and again.strategy(graph, TOPOLOGY) == strategy
    assert not Plan.make(graph, TOPOLOGY, STRATEGIES["cp_model"](graph)).to_json()[
        "ring_attention"]
    with pytest.raises(PlanError, match="ring_attention is not supported with pipeline stages"):
        dataclasses.replace(strategy, stages=2, microbatches=2)
    with pytest.raises(PlanError, match="must be True or False"):
        dataclasses.replace(strategy, ring_attention="yes")


def test_the_searched_plan_trains_exactly():
    """The default search (analytic costs, a fixed number of proposals) on the tiny flash
    llama: its plan's float64 gradients equal the unsharded ones."""
    graph, params, batch, want = case()
    plan = find_plan(graph, TOPOLOGY, settings=SearchSettings(max_proposals=150, seed=0),
                     costs="analytic")
    strategy, mesh = plan.strategy(graph, TOPOLOGY), make_mesh(TOPOLOGY)
    got = sharded_grads(graph, strategy, mesh, params, batch)
    assert relative_error(got, want) <= X64_TOL


def test_a_pipelined_context_parallel_plan_trains_exactly():
    """Inside pipeline stages (`soapjax.apply._pipelined`) the attention equation runs at its traced
    shapes under XLA's partitioner (not in `soapjax.apply._context_parallel`'s shard_map):
    Megatron's
    TP 2 x CP 2 x PP 2 on the 2-node cpu8 mesh, 2 sequences a microbatch, computes the
    unsharded step in float64."""
    topology = load_topology(str(pathlib.Path(__file__).parent / "meshes" / "cpu8-nodes.toml"))
    cfg = dataclasses.replace(CONFIG, num_layers=2, batch_size=8)
    w = llama.build_llama("llama", "tiny-flash-x64", cfg, "linen")
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        params = jax.tree.map(lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape),
                                                    jnp.float64), w.abstract_params())
        batch = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, cfg.vocab_size, s.shape),
                                                   s.dtype), w.abstract_batch())
        graph = trace(w.loss_fn, params, batch, name="llama")
        want = jax.jit(jax.grad(w.loss_fn), compiler_options=FAST_COMPILE)(params, batch)
        strategy = megatron_3d(graph, topology, tp=2, pp=2, cp=2, microbatch_size=2)
        assert strategy.pipelined
        keep = optax.GradientTransformation(
            lambda p: jax.tree.map(jnp.zeros_like, p),
            lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))
        step, sh = sharded_train_step(graph, strategy, make_mesh(topology), keep, params=params,
                                      batch=batch, compiler_options=FAST_COMPILE)
        placed = device_put_global((params, keep.init(params), batch),
                                   (sh.params, sh.opt_state, sh.batch))
        _, grads, _ = step(*placed, np.int32(0))
        text = step.lower(*placed, np.int32(0)).compile().as_text()
    assert relative_error(grads, want) <= X64_TOL
    # its queries are one block there, every tile computed (`bind_attention`'s whole_queries):
    # a loop over blocks of queries, or a conditional per tile, has XLA gather the grouped
    # queries whole ([B, T, K, G, H]) and compute them on every device; the keys' and values'
    # blocks are what it gathers, [S / block, B, block, K, H]
    blocks = SEQ_LEN // CONFIG.attention_block
    gathered = [tuple(int(n) for n in s.split(",")) for s in
                re.findall(r"= f64\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", text)]
    ranked5 = [s for s in gathered if len(s) == 5]
    assert ranked5 and all(s[0] == blocks for s in ranked5), gathered


def test_inside_pipeline_stages_a_split_attention_is_priced_as_xla_runs_it():
    """A pipeline stage's simulation (`Simulation(pipeline_stage=True)`, as
    `soapjax.simulate.pipesim` builds it) prices a sequence-split attention as apply runs it there:
    every tile computed
    (1 / `causal_tiles` the flat step's kernel time), and no balancing sends."""
    from soapjax.cost.kernels import causal_tiles
    from soapjax.simulate._flatsim import Simulation

    graph = case()[0]
    cm = cost_model(graph, TOPOLOGY, mode="analytic")
    strategy = STRATEGIES["cp_model"](graph)
    times = {}
    with Resharder(MESH, mode="ideal") as resharder:
        for stage in (False, True):
            sim = Simulation(graph, TOPOLOGY, cm, resharder, strategy, pipeline_stage=stage)
            tasks = sim.result().tasks
            times[stage] = next(t.end_s - t.start_s for t in tasks
                                if t.kind == "forward" and t.name.endswith("layers_0/attn"))
            permutes = [t for t in tasks if t.name.startswith("collective_permute")]
            assert bool(permutes) is not stage
    assert times[True] == pytest.approx(times[False] / causal_tiles(SEQ_LEN), rel=1e-9)


def test_flash_attention_keeps_its_inputs_and_a_log_sum_exp_only():
    """Its backward reads what flash attention saves: the queries and keys after their rotary
    embedding (made inside the operator: kept by it, their heads following the query heads),
    the values (kept by their producer), and a log-sum-exp per query and head; nothing
    ``T x S``. Megatron's selective recomputation has nothing left to drop in it: it is no
    attention core."""
    graph = case()[0]
    j = graph.index("layers_0/attn")
    r = residuals(graph, j)
    assert r.inputs == (False, False, True)  # q and k before the rotary embedding; v
    assert r.internal == (((2, SEQ_LEN, 8, 4), "float64", (0, 1, 2, 4)),
                          ((2, SEQ_LEN, 4, 4), "float64", (0, 5, 2, 4)),
                          ((2, 8, SEQ_LEN), "float64", (0, 2, 1)))
    assert not attention_core(graph.operators[j])
    assert not recomputes(graph.operators[j], "selective")


def test_the_kernel_model_prices_one_flash_kernel():
    """Llama 3 8B at 128K tokens on an H100: one layer's attention is one `FlashKernel` of
    4 B N T S H FLOPs less the causal mask's hidden tiles, at `attention_efficiency` (0.042, what
    soapjax's own flash attention reached on an H100)."""
    w = soapjax_zoo.get("llama", "8b-128k")
    graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="llama")
    op = graph.operator("layers_0/attn")
    device = load_topology("dgx-h100x8").device
    for degrees, t in (((1,) * 6, 131072), ((1, 8, 1, 1, 1, 1), 131072 // 8)):
        kernels = shard_kernels(graph, op, degrees)
        flash = [k for k in kernels.forward if isinstance(k, FlashKernel)]
        assert len(flash) == 1 and flash[0].causal
        k = flash[0]
        assert (k.batch, k.t, k.s, k.h, k.hv) == (8 * 32, t, 131072, 128, 128)
        n = 131072 // 128
        assert k.flops == pytest.approx(4 * 8 * 32 * t * 131072 * 128 * (n + 1) / (2 * n))
        assert flash_time(k, 989e12, device.memory_bandwidth, device.kernels) == pytest.approx(
            k.flops / (989e12 * 0.042) + 3e-6)
        assert flash_time(k, 989e12, device.memory_bandwidth, device.kernels,
                          backward=True) == pytest.approx(2.5 * k.flops / (989e12 * 0.042) + 3e-6)


@pytest.mark.parametrize("kind", ["cp_data_tp_model", "ring_data_tp_model"])
def test_with_tensor_parallelism_every_collective_is_priced_as_compiled(kind):
    """The sequence over ``data`` and the heads over ``model`` (the projections' and
    attention's; the grouped key/value heads follow the query heads, one per device): every
    collective kind as compiled, counts and bytes, but for the loss's partial sum (8 bytes,
    which the gradient-only program drops) and the ring's key positions, which XLA sends once
    for both layers (`test_ring_attention_sends_are_priced_as_compiled`)."""
    xla, sim = compiled(kind), simulated(kind)
    assert set(xla) == set(sim), (xla, sim)
    for k in set(xla) - {"all_reduce", "collective_permute"}:
        assert xla[k] == sim[k], (k, xla, sim)
    n, b = sim["all_reduce"]
    assert xla["all_reduce"] == (n - 1, b - 8)
    n, b = sim["collective_permute"]  # the gathered form's balancing sends, the ring's
    if kind.startswith("ring"):
        assert xla["collective_permute"] == (n - 1, b)  # 2 layers' positions, sent once: 512 B
    else:
        assert xla["collective_permute"] == (n, b)


@pytest.mark.parametrize("kind", ["cp_model", "ring_model"])
def test_delta_simulation_equals_full(kind):
    """Random single-operator moves from the context-parallel flash llama, gathered and ring,
    accepted or rejected: after each, every task's start and end equal a fresh simulation's."""
    graph = case()[0]
    assert_delta_equals_full(graph, TOPOLOGY, STRATEGIES[kind](graph), 80)
