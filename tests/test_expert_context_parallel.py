"""Expert and context parallelism applied on cpu8 (issue 32): the float64 gradients of the
unsharded step, and the compiled step's collectives against the simulator's, kind by kind.

* Expert parallelism, GShard's form: the tiny MoE (`soapjax_zoo.moe`, capacity dispatch)
  data parallel over every axis, and in its experts' operators (``moe/experts/gate``, ``up``,
  ``down`` over the buffers ``[E, B, C, d]``) the expert dim split over one axis and the batch
  over the other. The dispatched tokens go to their experts by one all-to-all over the expert
  axis and come back by another; the backward pass moves their cotangents the same way, once
  for gate and up together (XLA adds the two cotangents before moving them). Experts over
  ``model``: 4 all-to-alls per layer; over ``data``: the batch changes its axis too, a
  collective-permute beside each all-to-all. (tests/test_moe.py's expert-parallel strategies
  keep the tokens whole along the expert axis, so dispatch is a local slice and combine an
  all-reduce: no all-to-all at all.)
* Context parallelism, all-gather form: the tiny llama (`soapjax_zoo.llama`) at 128 tokens,
  16 times its tiny config's, every operator's sequence dim split over ``model`` and the
  batch over ``data``; attention's queries stay local and its keys and values are
  all-gathered (one all-gather each per layer). Their cotangents are partial sums over the
  query shards, which apply constrains to the keys' and values' own layout (the sequence
  split: `soapjax.apply._flatstep`); XLA reduce-scatters them where the scores' and the output's
  matmuls make them, at those matmuls' operand (every query head after GQA's repeat: twice
  the keys' bytes), and runs the rotary embedding's backward and the repeat's sum on the
  slice (`soapjax.graph._inner.matmul_operands`); every weight's gradient, partial over the batch's
  axis and the sequence's, is all-reduced over each on its own.

The compiled program is ``jax.grad`` of the constrained loss in float64 (no optimizer: its
global-norm reductions are left out of the simulated collectives too). Every collective of
both models is counted. The MoE's differ only in its load-balancing loss: the simulator
all-reduces each layer's two means over the batch (choices and probabilities, ``[experts]``),
XLA fewer buffers (it combines them); the loss's 8-byte partial sum, which the gradient-only
program drops; and one 8-byte cotangent of a layer's loss carried to the next layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from conftest import assert_delta_equals_full
from test_corpus import (
    X64_TOL,
    float64_workload,
    relative_error,
    sharded_grads_and_hlo,
    worst_leaf,
)

from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import Resharder
from soapjax.graph.opgraph import OpGraph
from soapjax.measure import hlo
from soapjax.simulate.front import simulate
from soapjax.strategy import space
from soapjax.strategy.space import Config, MeshShape, Strategy
from soapjax.topology.cluster import load_topology, make_mesh
from soapjax_zoo import llama, moe

TOPOLOGY = load_topology("cpu8")
MESH = MeshShape.of(TOPOLOGY)
SEQ_LEN = 128  # the long sequence: 16 x the tiny llama's 8; not the vocabulary's 64
BYTES_TOL = 0.10
# the simulator's collective tasks of one value_and_grad (the optimizer's norm reductions are
# not in it)
_COLLECTIVE_TASKS = ("reshard", "reshard_backward", "partial_sum", "inner_reduce",
                     "inner_reduce_backward", "grad_sync", "param_gather")


@functools.cache
def float64_case(name: str):
    """The tiny MoE or the tiny llama at `SEQ_LEN` tokens, in float64: graph, params (init +
    N(0, 0.05)), batch, and the unsharded ``jax.grad`` of the loss."""
    if name == "moe":
        cfg = dataclasses.replace(moe.MOE_CONFIGS["tiny"], param_dtype="float64")
        w = moe.build_moe("moe", "tiny-x64", cfg, "linen")
    else:
        cfg = dataclasses.replace(llama.LLAMA_CONFIGS["tiny"], param_dtype="float64",
                                  seq_len=SEQ_LEN, batch_size=2)
        w = llama.build_llama("llama", "tiny-x64", cfg, "linen")
    return float64_workload(w, name)


def gshard(graph: OpGraph, expert_axis: str) -> Strategy:
    """Data parallel over every mesh axis; the experts' operators split their expert dim (the
    buffers' first) over `expert_axis` and their batch dim over the other axes."""
    rest = tuple(a for a in MESH.axis_names if a != expert_axis)
    configs = {}
    for op, base in zip(graph.operators, space.data_parallel(graph, MESH).configs):
        if "/moe/experts/" in op.name:
            axes = [()] * len(base.axes)
            axes[0], axes[1] = (expert_axis,), rest
            base = Config(tuple(axes))
        configs[op.name] = base
    return space.strategy_from_names(graph, configs)


def context_parallel(graph: OpGraph, axis: str, seq_len: int) -> Strategy:
    """Every operator's first iteration dim of extent `seq_len` (the query sequence: output dims
    come first, so attention's scores split their queries, not their keys) over `axis`, its
    sample dim over the other axes."""
    rest = tuple(a for a in MESH.axis_names if a != axis)
    configs = {}
    for op in graph.operators:
        axes: list[tuple[str, ...]] = [()] * len(op.iteration_sizes)
        if (d := space.sample_dim(op)) is not None:
            axes[d] = rest
        if seq_len in op.iteration_sizes:
            axes[op.iteration_sizes.index(seq_len)] = (axis,)
        configs[op.name] = Config(tuple(axes))
    return space.strategy_from_names(graph, configs)


STRATEGIES = {
    "ep_model": ("moe", lambda g: gshard(g, "model")),
    "ep_data": ("moe", lambda g: gshard(g, "data")),
    "cp_model": ("llama", lambda g: context_parallel(g, "model", SEQ_LEN)),
}


@functools.cache
def applied(kind: str):
    """The sharded float64 gradients of `kind` on cpu8 and the compiled program's text."""
    name, build = STRATEGIES[kind]
    graph, params, batch, _ = float64_case(name)
    strategy, mesh = build(graph), make_mesh(TOPOLOGY)
    return sharded_grads_and_hlo(graph, strategy, mesh, params, batch)


def compiled(kind: str) -> dict[str, tuple[int, float]]:
    """Per kind, (buffers, bytes per device) of the compiled step's collectives: an instruction
    of several buffers (XLA's combiner merges independent collectives) counts once per buffer,
    an all-to-all (one buffer per peer) once."""
    out: dict[str, tuple[int, float]] = {}
    for c in hlo.collectives(applied(kind)[1], MESH, reduce_scatter_from_slices=True):
        k = c.kind.replace("-", "_")
        n, b = out.get(k, (0, 0.0))
        buffers = 1 if k == "all_to_all" else len(c.shapes)
        out[k] = (n + buffers * c.executions, b + c.nbytes * c.executions)
    return out


@functools.cache
def _simulation(kind: str):
    name, build = STRATEGIES[kind]
    graph = float64_case(name)[0]
    cm = cost_model(graph, TOPOLOGY, mode="analytic")
    with Resharder(MESH, mode="ideal") as resharder:
        return simulate(graph, TOPOLOGY, build(graph), cost_model=cm, resharder=resharder)


def simulated(kind: str) -> tuple[dict[str, tuple[int, float]], tuple[str, ...]]:
    """Per collective kind, (tasks, bytes per device) of the simulator's collectives, and
    their names."""
    out: dict[str, tuple[int, float]] = {}
    names = []
    for t in _simulation(kind).tasks:
        if t.kind in _COLLECTIVE_TASKS:
            k = t.name.split(" ", 1)[0]
            n, b = out.get(k, (0, 0.0))
            out[k] = (n + 1, b + t.nbytes)
            names.append(t.name)
    return out, tuple(names)


def simulate_tasks(kind: str) -> dict[str, tuple[int, float]]:
    """Per task kind (``grad_sync``, ``reshard_backward``, ...), (tasks, bytes per device)."""
    out: dict[str, tuple[int, float]] = {}
    for t in _simulation(kind).tasks:
        if t.kind in _COLLECTIVE_TASKS:
            n, b = out.get(t.kind, (0, 0.0))
            out[t.kind] = (n + 1, b + t.nbytes)
    return out


@pytest.mark.parametrize("kind", STRATEGIES)
def test_gradients_are_exact(kind):
    want = float64_case(STRATEGIES[kind][0])[3]
    got = applied(kind)[0]
    err = relative_error(got, want)
    assert err <= X64_TOL, f"{kind}: {err:.3g}; worst leaf {worst_leaf(got, want)}"


def _assert_same(kind: str, collective: str, count: int, nbytes: float) -> None:
    """XLA's and the simulator's `collective`s of `kind`: `count` of them each, `nbytes` in all
    in XLA's, the simulator's within `BYTES_TOL`."""
    xla, predicted = compiled(kind), simulated(kind)[0]
    assert xla.get(collective) == (count, nbytes), (collective, xla, predicted)
    n, b = predicted.get(collective, (0, 0.0))
    assert n == count, (collective, xla, predicted)
    assert b == pytest.approx(nbytes, rel=BYTES_TOL), (collective, xla, predicted)


# 2 layers x 4 moves (dispatch and combine, forward and backward) of one shard of the expert
# buffers [E, B, C, d] = [4, 8, 4, 32] in float64 over 8 devices: 4 KiB each
_EXPERT_MOVES = (2 * 4, 2 * 4 * 4 * 8 * 4 * 32 * 8 / 8)


@pytest.mark.parametrize("kind", ["ep_model", "ep_data"])
def test_expert_all_to_alls_are_priced_as_compiled(kind):
    _assert_same(kind, "all_to_all", *_EXPERT_MOVES)
    if kind == "ep_data":  # the batch moves from `model` (after `data`) to first place
        _assert_same(kind, "collective_permute", *_EXPERT_MOVES)
    else:
        assert "collective_permute" not in compiled(kind)
    names = simulated(kind)[1]
    for layer in ("layers_0", "layers_1"):
        back = [n for n in names if n.startswith("all_to_all d(") and f"{layer}/moe/dot_general_3"
                in n]
        assert len(back) == 1, back  # gate's and up's cotangents summed, then moved once


def _xla_all_reduces(kind: str) -> dict[str, tuple[int, float]]:
    """The compiled step's all-reduces as (buffers, bytes): those a dot's transpose makes
    (partial cotangents, ``"dot"``) apart from the rest (gradients, ``"other"``)."""
    out: dict[str, tuple[int, float]] = {}
    for c in hlo.collectives(applied(kind)[1], MESH, reduce_scatter_from_slices=True):
        if c.kind == "all-reduce":
            k = "dot" if c.op_name.endswith("transpose(jvp())/dot_general") else "other"
            n, b = out.get(k, (0, 0.0))
            out[k] = (n + len(c.shapes) * c.executions, b + c.nbytes * c.executions)
    return out


def test_context_parallel_collectives_are_priced_as_compiled():
    kind = "cp_model"
    xla, sim = _xla_all_reduces(kind), simulate_tasks(kind)
    # per layer the keys and the values gathered whole along the sequence, before the scores'
    # and the output's dots: [1 sequence, 128 tokens, 4 kv heads, 4] float64, 16 KiB each
    _assert_same(kind, "all_gather", 2 * 2, 2 * 2 * 128 * 4 * 4 * 8)
    assert set(compiled(kind)) == set(simulated(kind)[0]) == {"all_gather", "all_reduce",
                                                                "reduce_scatter"}
    # their cotangents, partial sums over the query shards: reduce-scattered into the keys'
    # and values' sequence split where the dots make them, at the dots' operand (every query
    # head after GQA's repeat, the whole sequence; 32 KiB in), the rotary embedding's
    # backward and the repeat's sum run on the slice; no dot's all-reduce
    _assert_same(kind, "reduce_scatter", 2 * 2, 2 * 2 * 128 * 8 * 4 * 8)
    assert "dot" not in xla
    assert sim["reshard_backward"] == (2 * 2, 2 * 2 * 128 * 8 * 4 * 8)
    # gradients: the batch over data and the sequence over model split two reduction dims of
    # every weight's gradient, which XLA all-reduces over each on its own (21 weights, twice)
    grads = sum(8 * np.prod(x.shape) for x in jax.tree.leaves(float64_case("llama")[1]))
    assert xla["other"] == sim["grad_sync"] == (2 * 21, 2 * grads)
    # and the loss's partial sums (8 bytes), which jax.grad's program drops
    assert sim["partial_sum"] == (1, 8)


@pytest.mark.parametrize("kind", ["ep_model", "ep_data"])
def test_expert_parallel_other_collectives(kind):
    """The rest of the MoE's collectives: nothing gathered (the router's top k runs on the
    rows each device holds: `soapjax.apply._manual`); every gradient's and partial cotangent's
    all-reduce the same, count and bytes; the load-balancing loss's means (module doc) the
    only difference, a few bytes each."""
    xla, predicted = compiled(kind), simulated(kind)[0]
    assert set(xla) == set(predicted) and "all_gather" not in xla, (xla, predicted)
    forward = [c for c in hlo.collectives(applied(kind)[1], MESH, reduce_scatter_from_slices=True)
               if c.kind == "all-reduce" and c.op_name.endswith("jvp()/reduce_sum")]
    n, b = xla["all_reduce"]
    tasks = simulate_tasks(kind)
    assert tasks["grad_sync"] == (n - sum(len(c.shapes) for c in forward),
                                  b - sum(c.nbytes for c in forward)), (xla, tasks)
    # the means over the batch of each layer's choices and probabilities, [experts] float64:
    # the simulator all-reduces both, XLA (which combines them) one buffer per layer; and the
    # loss's scalar (8 bytes), which the gradient-only program drops
    layers, experts = moe.MOE_CONFIGS["tiny"].num_layers, moe.MOE_CONFIGS["tiny"].num_experts
    assert {s for c in forward for s in c.shapes} == {f"f64[{experts}]"}
    assert layers <= sum(len(c.shapes) for c in forward) <= 2 * layers
    assert tasks["partial_sum"] == (2 * layers + 1, 8 * (2 * layers * experts + 1))


def test_context_parallel_delta_equals_full():
    """Random single-operator moves from the context-parallel llama (the keys' and values'
    cotangents reduced at the matmuls' operand, `Simulation._reduced`), accepted or rejected:
    after each, every task's start and end equal a fresh simulation's."""
    graph = float64_case("llama")[0]
    assert_delta_equals_full(graph, TOPOLOGY, context_parallel(graph, "model", SEQ_LEN), 60)
