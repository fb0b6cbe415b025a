"""A dim an operator's output holds twice is split by no config (`soapjax.graph._grouping`).

A fused QKV projection (GPT-2's ``c_attn``, BLOOM's ``query_key_value``) reshaped into heads
and split into queries, keys and values inside the attention operator gives the scores
``[batch, heads, queries, keys]`` one operand dim, the projection's sequence, for both their
query and key dims. Splitting the queries would split that operand and so the keys too: XLA
gathers the keys (and reduce-scatters their cotangent) where the simulator priced nothing, and
the cost stage's shard program computed scores of another shape than the config's. Such a dim
is now '-' in both places and its operand dim is read whole; the operator before it gathers
along the sequence, as priced. (`tests/corpus/padded_lm.py`, written the way HF's OPT and
BLOOM are; Gemma-3's second layer, whose RoPE positions tie the same dims, too.)
"""

from __future__ import annotations

import collections
import functools

import corpus
import jax
import jax.numpy as jnp
import pytest
from test_corpus import (
    FAST_COMPILE,
    X64_TOL,
    case,
    jiggle,
    relative_error,
    sharded_grads_and_hlo,
    worst_leaf,
)

from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import Resharder
from soapjax.graph.opgraph import trace
from soapjax.measure import hlo
from soapjax.simulate.front import simulate
from soapjax.strategy import space
from soapjax.strategy.space import Config, MeshShape, validate_config
from soapjax.topology.cluster import load_topology, make_mesh

TOPOLOGY = load_topology("cpu8")
MESH_SHAPE = MeshShape.of(TOPOLOGY)
SEQ_LEN = 16  # apart from every other dim's size (head dim 8, model 32, hidden 64)
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute")


@pytest.mark.parametrize("name,op_name", [("padded_lm", "0/attn/dot_general"),
                                          ("gemma3", "layers_1/attn/dot_general")])
def test_the_scores_of_one_operands_queries_and_keys_split_neither(name, op_name):
    graph = case(name).graph
    op = graph.operator(op_name)
    assert op.roles[2:] == ("-", "-"), op.roles  # [batch, heads, queries, keys]
    assert op.outputs[0].dims[2:] == (None, None), op.outputs[0].dims
    # no operand dim follows them: the sequence the queries and keys are sliced from is read whole
    assert not [o.dims for o in op.inputs if {2, 3} & set(o.dims)]
    assert not any(cfg.axes[2] or cfg.axes[3]
                   for cfg in space.configs(op, MESH_SHAPE, space.SpaceLimits()))


@functools.cache
def _sequence_split():
    """padded_lm in float64 at 16 tokens; its plan: the batch over ``data`` and, wherever a
    config allows it, the sequence over ``model``."""
    with jax.enable_x64(True):
        loss, params, batch = corpus.get("padded_lm", dtype=jnp.float64, seq_len=SEQ_LEN,
                                         compiler_options=FAST_COMPILE)
        params = jiggle(params, 0.05)
        graph = trace(loss, params, batch, name="padded_lm")
    configs = {}
    for j, op in enumerate(graph.operators):
        axes: list[tuple[str, ...]] = [()] * len(op.iteration_sizes)
        if (d := space.sample_dim(op)) is not None:
            axes[d] = ("data",)
        seq = [k for k, (size, role) in enumerate(zip(op.shape, op.roles))
               if size == SEQ_LEN and role == "A"]
        if seq:
            split = list(axes)
            split[seq[0]] = ("model",)
            try:
                validate_config(graph, j, Config(tuple(split)), MESH_SHAPE)
                axes = split
            except ValueError:
                pass
        configs[op.name] = Config(tuple(axes))
    return loss, params, batch, graph, space.strategy_from_names(graph, configs)


def test_a_sequence_split_plan_gathers_what_the_simulator_prices():
    """The plan's float64 gradients are jax.grad's; XLA's collectives are the simulator's:
    all-gathers in bytes within 1 %, no reduce-scatter in either (before, the scores' split
    queries made XLA gather the keys and reduce-scatter their cotangent, 32 KiB each per
    layer, which the simulator did not price: all-gathers 10 % under, reduce-scatters half)."""
    loss, params, batch, graph, strategy = _sequence_split()
    mesh = make_mesh(TOPOLOGY)
    assert graph.operator("0/attn/qkv").shape[1] == SEQ_LEN
    # the sequence split before the scores
    assert strategy.configs[graph.index("0/attn/qkv")].axes[1] == ("model",)
    got, text = sharded_grads_and_hlo(graph, strategy, mesh, params, batch)
    with jax.enable_x64(True):
        want = jax.jit(jax.grad(loss), compiler_options=FAST_COMPILE)(params, batch)
    err = relative_error(got, want)
    assert err <= X64_TOL, f"{err:.3g}; worst leaf {worst_leaf(got, want)}"

    compiled: collections.Counter = collections.Counter()
    for c in hlo.collectives(text, mesh, reduce_scatter_from_slices=True):
        compiled[c.kind.replace("-", "_")] += c.nbytes * c.executions
    with Resharder(mesh, mode="ideal") as resharder:
        sim = simulate(graph, TOPOLOGY, strategy, cost_model=cost_model(graph, TOPOLOGY,
                       mode="analytic"), resharder=resharder)
    priced: collections.Counter = collections.Counter()
    for t in sim.tasks:
        if (kind := t.name.split(" ", 1)[0]) in COLLECTIVES:
            priced[kind] += t.nbytes
    assert compiled["all_gather"] > 0
    assert priced["all_gather"] == pytest.approx(compiled["all_gather"], rel=0.01), (
        compiled, priced)
    assert compiled["reduce_scatter"] == priced["reduce_scatter"] == 0, (compiled, priced)
