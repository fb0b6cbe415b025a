"""The zoo's mixture-of-experts decoder (`soapjax_zoo.moe`): routing, and exact gradients.

* routing: the tiny config's capacity (4 slots per expert for 16 tokens x 2 choices over 4
  experts) drops tokens; a hand example of GShard's priority (first choices before second);
* float64 gradients through soapjax equal ``jax.grad`` of the loss (cross entropy plus the
  load-balancing loss) to 1e-12, relative, as tests/test_corpus.py measures them: on one
  device, and on ``cpu8`` under data parallelism, Megatron, FSDP, a searched plan (analytic
  costs, 200 proposals, seed 0) and two expert-parallel strategies: the expert dim of the
  stacked expert weights and of the dispatched tokens split over ``model`` (4 experts, one
  per device, the batch over ``data``) or over ``data`` (the batch over ``model``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from test_corpus import FAST_COMPILE, X64_TOL, jiggle, relative_error, worst_leaf

from soapjax import baselines, space
from soapjax.apply import batch_shardings, constrained_loss, device_put_global, param_shardings
from soapjax.cost import cost_model
from soapjax.graph import OpGraph, trace
from soapjax.search import SearchSettings, search
from soapjax.space import Config, MeshShape, Strategy
from soapjax.topology import load_topology, make_mesh
from soapjax_zoo import moe

TOPOLOGY = load_topology("cpu8")
MESH_SHAPE = MeshShape.of(TOPOLOGY)
TINY = moe.MOE_CONFIGS["tiny"]


@functools.cache
def float64_case():
    """The tiny MoE in float64: graph, params (init + N(0, 0.05)), batch, reference grads."""
    cfg = dataclasses.replace(TINY, param_dtype="float64")
    w = moe.build_moe("moe", "tiny-x64", cfg, "linen")
    with jax.enable_x64(True):
        params = jiggle(jax.jit(w.init_params, compiler_options=FAST_COMPILE)(jax.random.key(0)),
                        0.05)
        batch = jax.jit(w.make_batch, compiler_options=FAST_COMPILE)(jax.random.key(1))
        grads = jax.jit(jax.grad(w.loss_fn), compiler_options=FAST_COMPILE)(params, batch)
        graph = trace(w.loss_fn, params, batch, name="moe")
    return graph, params, batch, grads


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


@functools.cache
def strategy(kind: str) -> Strategy:
    graph = float64_case()[0]
    if kind == "data_parallel":
        return space.data_parallel(graph, MESH_SHAPE)
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


def soapjax_grads(strategy: Strategy, mesh: Mesh):
    graph, params, batch, _ = float64_case()
    with jax.enable_x64(True):
        ps = param_shardings(graph, strategy, mesh, params=params)
        bs = batch_shardings(graph, strategy, mesh, batch=batch)
        grad = jax.jit(jax.grad(constrained_loss(graph, strategy, mesh)), in_shardings=(ps, bs),
                       out_shardings=ps, compiler_options=FAST_COMPILE)
        return grad(*device_put_global((params, batch), (ps, bs)))


def check(got, where: str) -> None:
    want = float64_case()[3]
    err = relative_error(got, want)
    print(f"moe tiny {where}: relative gradient error {err:.3g}")
    assert err <= X64_TOL, f"{where}: {err:.3g}; worst leaf {worst_leaf(got, want)}"


def test_one_device_gradient_is_exact():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    graph = float64_case()[0]
    check(soapjax_grads(space.data_parallel(graph, MeshShape.of(mesh)), mesh), "one device")


KINDS = ("data_parallel", "megatron", "fsdp", "searched", "expert_model", "expert_data")


@pytest.mark.parametrize("kind", KINDS)
def test_cpu8_gradient_is_exact(kind):
    check(soapjax_grads(strategy(kind), make_mesh(TOPOLOGY)), f"cpu8 {kind}")


# --- the real sizes, from shapes ----------------------------------------------------------------

# parameters: Mixtral's released configs give 46.7B and 140.6B (141B in Mistral's naming);
# the fine-grained size has Qwen3-30B-A3B's expert shapes plus a shared expert.
SIZES = {"mixtral-8x7b": 46_702_792_704, "mixtral-8x22b": 140_630_071_296,
         "fine-grained": 30_355_949_568}


@pytest.mark.parametrize("size", [pytest.param(s, marks=[pytest.mark.heavy] * (s != "mixtral-8x7b"))
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
    kernel = next(o for o in gate.inputs if o.kind == "param")
    assert kernel.shape == (cfg.num_experts, cfg.d_model, cfg.expert_hidden)
    assert gate.dtype == cfg.dtype == "bfloat16" and kernel.dtype == "float32"
    assert {len(b) for b in g.repeated_blocks()} == {cfg.num_layers}
