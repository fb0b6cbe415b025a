"""The zoo's mixture-of-experts decoder (`soapjax_zoo.moe`): routing, and exact gradients.

* routing: the tiny config's capacity (4 slots per expert for 16 tokens x 2 choices over 4
  experts) drops tokens; a hand example of GShard's priority (first choices before second);
* float64 gradients through soapjax equal ``jax.grad`` of the loss (cross entropy plus the
  load-balancing loss) to 1e-12, relative, as tests/test_corpus.py measures them: on one
  device, and on ``cpu8`` under data parallelism, Megatron, FSDP, a searched plan (analytic
  costs, 200 proposals, seed 0) and two expert-parallel strategies: the expert dim of the
  stacked expert weights and of the dispatched tokens split over ``model`` (4 experts, one
  per device, the batch over ``data``) or over ``data`` (the batch over ``model``);
* form (b), dropless (``tiny-dropless``: tokens sorted by expert, ``jax.lax.ragged_dot``): a
  hand example of the sort and unsort; it computes the capacity form's loss where the capacity
  drops nothing; its grouped matmuls never split the ragged rows or the experts' group dim
  (no config can: see soapjax.graph._dims._ragged_dot) but split ffn and d_model; float64 gradients
  exact on one device and on ``cpu8`` under data parallelism, Megatron (the experts' ffn dim
  over ``model``), FSDP and a searched plan;
* every real size of both forms traces from shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from test_corpus import FAST_COMPILE, X64_TOL, float64_workload, relative_error, worst_leaf

from soapjax.apply.step import batch_shardings, constrained_loss, device_put_global, param_shardings
from soapjax.cost.operators import cost_model
from soapjax.graph import _dims
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.search import SearchSettings, search
from soapjax.simulate.front import simulate
from soapjax.strategy import baselines, space
from soapjax.strategy.space import Config, MeshShape, Strategy
from soapjax.topology.cluster import load_topology, make_mesh
from soapjax_zoo import moe

TOPOLOGY = load_topology("cpu8")
MESH_SHAPE = MeshShape.of(TOPOLOGY)
TINY = moe.MOE_CONFIGS["tiny"]
DROPLESS = "tiny-dropless"


@functools.cache
def float64_case(config: str = "tiny"):
    """A tiny MoE in float64: graph, params (init + N(0, 0.05)), batch, reference grads."""
    cfg = dataclasses.replace(moe.MOE_CONFIGS[config], param_dtype="float64")
    w = moe.build_moe("moe", f"{config}-x64", cfg, "linen")
    return float64_workload(w, "moe")


# --- routing ------------------------------------------------------------------------------------


def test_route_drops_choices_past_capacity_second_choices_last():
    # 3 tokens, 2 experts, top-2, capacity 2: the three first choices (0, 0, 1) come before the
    # second choices (1, 1, 0); expert 0 fills with tokens 0 and 1, expert 1 with token 2's
    # first choice and token 0's second; token 1's and token 2's second choices are dropped.
    chosen = jnp.array([[[0, 1], [0, 1], [1, 0]]])
    gates = jnp.array([[[0.75, 0.25], [0.5, 0.5], [0.625, 0.375]]])
    dispatch, combine = moe.route(gates, chosen, experts=2, capacity=2)
    assert dispatch.shape == (1, 3, 2, 2)
    want = np.zeros((3, 2, 2))
    want[0, 0, 0] = want[1, 0, 1] = want[2, 1, 0] = want[0, 1, 1] = 1
    np.testing.assert_array_equal(dispatch[0], want)
    want_combine = want * np.array([[0.75, 0.25], [0.5, 0], [0, 0.625]])[:, :, None]
    np.testing.assert_array_equal(combine[0], want_combine)


def test_tiny_drops_tokens():
    # 16 tokens x 2 choices per sequence, 4 experts x 4 slots: at least half are dropped
    assert TINY.capacity == 4 and TINY.capacity * TINY.num_experts < TINY.seq_len * TINY.top_k
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(2), (8, 16, 4)), axis=-1)
    gates, chosen = jax.lax.top_k(probs, 2)
    dispatch, combine = moe.route(gates, chosen, 4, TINY.capacity)
    assert float(dispatch.sum()) <= 8 * 4 * 4 < 8 * 16 * 2
    assert float(dispatch.sum(axis=1).max()) == 1.0  # a slot holds at most one token
    assert float(dispatch.sum(axis=(2, 3)).max()) <= 2  # a token takes at most k slots
    assert float((dispatch.sum(axis=(2, 3)) == 0).sum()) > 0  # some tokens lose both choices
    assert jnp.all((combine > 0) == (dispatch > 0))


def test_load_balancing_loss_is_one_when_uniform():
    probs = jnp.full((2, 4, 4), 0.25)
    chosen = jnp.array([[[0], [1], [2], [3]]] * 2)
    assert float(moe.load_balancing_loss(probs, chosen)) == pytest.approx(1.0)


# --- exact gradients ----------------------------------------------------------------------------


def expert_parallel(graph: OpGraph, expert_axis: str, batch_axis: str) -> Strategy:
    """Data parallelism over `batch_axis`, and in every operator that touches the experts'
    buffers ``[E, B, C, d]`` (dispatch, the experts' SwiGLU, combine) the expert dim split over
    `expert_axis`."""
    buffers = (TINY.num_experts, TINY.batch_size, TINY.capacity)
    configs = {}
    for op, base in zip(graph.operators, space.data_parallel(graph, MESH_SHAPE).configs):
        expert_dims = {t.dims[0] for t in (*op.inputs, *op.outputs)
                       if tuple(t.shape[:3]) == buffers and t.dims[0] is not None}
        axes = [tuple(a for a in dim if a == batch_axis) for dim in base.axes]
        for d in expert_dims:
            axes[d] = (expert_axis,)
        configs[op.name] = Config(tuple(axes))
    assert sum(any(c.axes) and expert_axis in c.used_axes for c in configs.values()) >= 5 * 2
    return space.strategy_from_names(graph, configs)


def ragged_megatron(graph: OpGraph) -> Strategy:
    """Megatron over ``model`` with the dropless experts' SwiGLU split as Megatron splits an
    MLP: ``gate`` and ``up`` column parallel (their ffn output dim), ``down`` row parallel
    (its ffn contracting dim). (`baselines.megatron` leaves the grouped matmuls whole: it
    splits the weights of dense anchors only.)"""
    base = baselines.megatron(graph, MESH_SHAPE, ("model",))
    configs = {}
    for op, cfg in zip(graph.operators, base.configs):
        if op.anchor == "ragged_dot_general":
            ffn = 2 if op.name.endswith("/down") else 1  # [rows, out, in]: down's in is ffn
            axes = [()] * len(op.iteration_sizes)
            axes[ffn] = ("model",)
            cfg = Config(tuple(axes))
        configs[op.name] = cfg
    return space.strategy_from_names(graph, configs)


@functools.cache
def strategy(kind: str, config: str = "tiny") -> Strategy:
    graph = float64_case(config)[0]
    if kind == "data_parallel":
        return space.data_parallel(graph, MESH_SHAPE)
    if kind == "megatron" and config == DROPLESS:
        return ragged_megatron(graph)
    if kind == "megatron":
        return baselines.megatron(graph, MESH_SHAPE, ("model",))
    if kind == "fsdp":
        return baselines.fsdp(graph, MESH_SHAPE)
    if kind == "searched":
        cm = cost_model(graph, TOPOLOGY, mode="analytic")
        return search(graph, TOPOLOGY, cost_model=cm,
                      settings=SearchSettings(max_proposals=200, seed=0)).strategy
    if kind == "expert_model":
        return expert_parallel(graph, "model", "data")
    if kind == "expert_data":
        return expert_parallel(graph, "data", "model")
    raise ValueError(kind)


def soapjax_grads(strategy: Strategy, mesh: Mesh, config: str = "tiny"):
    graph, params, batch, _ = float64_case(config)
    with jax.enable_x64(True):
        ps = param_shardings(graph, strategy, mesh, params=params)
        bs = batch_shardings(graph, strategy, mesh, batch=batch)
        grad = jax.jit(jax.grad(constrained_loss(graph, strategy, mesh)), in_shardings=(ps, bs),
                       out_shardings=ps, compiler_options=FAST_COMPILE)
        return grad(*device_put_global((params, batch), (ps, bs)))


def check(got, where: str, config: str = "tiny") -> None:
    want = float64_case(config)[3]
    err = relative_error(got, want)
    print(f"moe {config} {where}: relative gradient error {err:.3g}")
    assert err <= X64_TOL, f"{where}: {err:.3g}; worst leaf {worst_leaf(got, want)}"


def test_one_device_gradient_is_exact():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    graph = float64_case()[0]
    check(soapjax_grads(space.data_parallel(graph, MeshShape.of(mesh)), mesh), "one device")


KINDS = ("data_parallel", "megatron", "fsdp", "searched", "expert_model", "expert_data")


@pytest.mark.parametrize("kind", KINDS)
def test_cpu8_gradient_is_exact(kind):
    check(soapjax_grads(strategy(kind), make_mesh(TOPOLOGY)), f"cpu8 {kind}")


# --- form (b): dropless, sorted tokens and grouped matmuls --------------------------------------


def test_sort_by_expert_orders_choices_stably_and_counts_groups():
    # 3 tokens, top-2 of 3 experts: the flat choices (token-major) are 2 0 | 0 1 | 2 0
    chosen = jnp.array([[[2, 0], [0, 1], [2, 0]]])
    order, group_sizes = moe.sort_by_expert(chosen, experts=3)
    np.testing.assert_array_equal(order, [1, 2, 5, 3, 0, 4])  # expert 0's rows in token order
    np.testing.assert_array_equal(order // 2, [0, 1, 2, 1, 0, 2])  # the tokens the rows read
    np.testing.assert_array_equal(group_sizes, [3, 1, 2])
    rows = jnp.arange(6.0)[order][:, None]  # row i holds choice i's flat index, sorted
    gates = jnp.array([[[0.5, 0.25], [1.0, 2.0], [4.0, 8.0]]])
    np.testing.assert_array_equal(moe.unsort(rows, order, gates)[0, :, 0],
                                  [0 * 0.5 + 1 * 0.25, 2 * 1.0 + 3 * 2.0, 4 * 4.0 + 5 * 8.0])


def test_dropless_is_the_capacity_form_that_drops_nothing():
    # capacity factor E: C = T * k slots per expert, room for every choice; same parameters
    cfg = dataclasses.replace(moe.MOE_CONFIGS[DROPLESS], param_dtype="float64")
    roomy = dataclasses.replace(cfg, routing="capacity", capacity_factor=cfg.num_experts)
    assert roomy.capacity == cfg.seq_len * cfg.top_k
    _, params, batch, _ = float64_case(DROPLESS)
    with jax.enable_x64(True):
        losses = [float(moe.build_moe("moe", "x", c, "linen").loss_fn(params, batch))
                  for c in (cfg, roomy)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-13)


@pytest.mark.parametrize("mode", ["forward", "weight_gradient"])
def test_grouped_matmul_flops_as_xla_counts_them(mode):
    # ragged non-contracting [m, k] x [g, k, n] (the forward, the input gradient) and ragged
    # contracting [m, k] x [m, n] -> [g, k, n] (the weight gradient), at uneven group sizes
    m, k, n, g = 48, 16, 8, 3
    x, w, e = jnp.ones((m, k)), jnp.ones((g, k, n)), jnp.ones((m, n))
    sizes = jnp.array([10, 0, 38], jnp.int32)
    if mode == "forward":
        fn, args = jax.lax.ragged_dot, (x, w, sizes)
    else:  # what jax's transpose rule binds for the kernel's gradient
        contract_rows = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,),
            rhs_group_dimensions=())
        fn = functools.partial(jax.lax.ragged_dot_general,
                               ragged_dot_dimension_numbers=contract_rows)
        args = (x, e, sizes)
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    assert [q.primitive.name for q in jaxpr.eqns] == ["ragged_dot_general"]
    assert jaxpr.eqns[0].outvars[0].aval.shape == ((m, n) if mode == "forward" else (g, k, n))
    want = jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]
    got = _dims.xla_flops(jaxpr)
    assert got.flops == want and got.matmul == 2 * g * m * k * n


def test_dropless_rows_and_experts_are_never_split():
    # the grouped matmuls' ragged rows (sorted over the whole batch) and the experts' group dim
    # are no iteration dims a config can split (soapjax.graph._dims._ragged_dot): expert parallelism
    # of form (b) needs a ragged all-to-all no sharding expresses; the ffn and d_model dims
    # split as a dense SwiGLU's
    graph = float64_case(DROPLESS)[0]
    cfg = moe.MOE_CONFIGS[DROPLESS]
    rows = cfg.batch_size * cfg.seq_len * cfg.top_k
    ragged = [op for op in graph.operators if op.anchor == "ragged_dot_general"]
    assert len(ragged) == 3 * cfg.num_layers and not any(op.replicate_only for op in ragged)
    for op in ragged:
        assert op.iteration_sizes[0] == rows and op.iteration_roles == ("-", "P", "R")
        kernel = next(o for o in op.inputs if o.kind == "param")
        assert kernel.shape[0] == cfg.num_experts and kernel.dims[0] is None
        matmul = 2 * rows * cfg.d_model * cfg.expert_hidden  # each row meets one expert
        assert matmul <= op.flops <= 1.05 * matmul  # (down: silu(gate) * up folded in)
        splits = {tuple(bool(a) for a in c.axes) for c in space.configs(op, MESH_SHAPE)}
        assert {s[0] for s in splits} == {False} and {s[1:] for s in splits} >= {
            (True, False), (False, True), (True, True)}
    sorts = [op for op in graph.operators if op.anchor == "sort"]
    assert sorts and all(op.iteration_roles[0] == "-" for op in sorts if len(op.shape) == 1)


def test_dropless_one_device_gradient_is_exact():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    graph = float64_case(DROPLESS)[0]
    check(soapjax_grads(space.data_parallel(graph, MeshShape.of(mesh)), mesh, DROPLESS),
          "one device", DROPLESS)


DROPLESS_KINDS = ("data_parallel", "megatron", "fsdp", "searched")


@pytest.mark.parametrize("kind", DROPLESS_KINDS)
def test_dropless_cpu8_gradient_is_exact(kind):
    check(soapjax_grads(strategy(kind, DROPLESS), make_mesh(TOPOLOGY), DROPLESS), f"cpu8 {kind}",
          DROPLESS)


# --- the real sizes, from shapes ----------------------------------------------------------------

# parameters: Mixtral's released configs give 46.7B and 140.6B (141B in Mistral's naming);
# the fine-grained size has Qwen3-30B-A3B's expert shapes plus a shared expert.
SIZES = {"mixtral-8x7b": 46_702_792_704, "mixtral-8x22b": 140_630_071_296,
         "fine-grained": 30_355_949_568}
SIZES |= {f"{size}-dropless": n for size, n in SIZES.items()}  # the same parameters
LIGHT = ("mixtral-8x7b", "mixtral-8x7b-dropless")  # 1-2 s each; the others 3-6 s


@pytest.mark.parametrize("size", [pytest.param(s, marks=[pytest.mark.heavy] * (s not in LIGHT))
                                  for s in SIZES])
def test_every_size_traces_from_shapes(size):
    live = sum(x.nbytes for x in jax.live_arrays())
    cfg = moe.MOE_CONFIGS[size]
    w = moe.build_moe("moe", size, cfg, "linen")
    params = w.abstract_params()
    g = trace(w.loss_fn, params, w.abstract_batch(), name="moe")
    assert sum(x.nbytes for x in jax.live_arrays()) - live < 2**20  # nothing materialised
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) == SIZES[size]
    gate = g.operator("layers_0/moe/experts/gate")
    assert gate.anchor == {"capacity": "dot_general", "dropless": "ragged_dot_general"}[cfg.routing]
    kernel = next(o for o in gate.inputs if o.kind == "param")
    assert kernel.shape == (cfg.num_experts, cfg.d_model, cfg.expert_hidden)
    assert gate.dtype == cfg.dtype == "bfloat16" and kernel.dtype == "float32"
    assert {len(b) for b in g.repeated_blocks()} == {cfg.num_layers}


def test_each_layers_load_balancing_loss_is_an_operator_of_its_own():
    # the router's load-balancing means over batch and tokens stay in their layer, and share
    # nothing with the combine einsum beside them: operators of their own, one per mean (each
    # with one batch dim, which a data-parallel config splits), and their product; never
    # folded into the final loss, whose batch dim is then the logits' and the targets' alone
    graph = float64_case()[0]
    aux = [op for op in graph.operators if "/moe/reduce_sum" in op.name]
    experts = TINY.num_experts
    assert [op.name for op in aux] == [f"layers_{i}/moe/reduce_sum{k}"
                                       for i in range(TINY.num_layers) for k in ("", "_1", "_2")]
    for fraction, mean, product in zip(aux[::3], aux[1::3], aux[2::3]):
        layer = fraction.name.split("/")[0]
        assert [(o.source, o.shape) for o in fraction.inputs] == [
            (f"{layer}/moe/top_k", (TINY.batch_size, TINY.seq_len, TINY.top_k))]
        assert [(o.source, o.shape) for o in mean.inputs] == [
            (f"{layer}/moe/reduce_max", (TINY.batch_size, TINY.seq_len, experts))]
        assert [o.shape for o in fraction.outputs] == [o.shape for o in mean.outputs] == [
            (experts,)]
        assert [o.source for o in product.inputs] == [fraction.name, mean.name]
        assert [o.shape for o in product.outputs] == [()]
    loss = graph.operators[-1]
    big = {o.source: o for o in loss.inputs if o.shape}
    assert set(big) == {"lm_head", "['targets']"}
    assert big["lm_head"].dims[:2] == big["['targets']"].dims  # one batch, one sequence dim
    # data parallelism moves no activation: nothing is gathered for the loss
    result = simulate(graph, TOPOLOGY, space.data_parallel(graph, MESH_SHAPE),
                      cost_model=cost_model(graph, TOPOLOGY, mode="analytic"))
    assert not [t.name for t in result.tasks if t.kind == "reshard"]
