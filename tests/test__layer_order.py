"""soapjax.apply._layer_order: an interleaved pipeline's stacked layers kept in chunk order.

The permutation itself (rows of stage s are the chunks it runs, in order, and back), on host
and on sharded device arrays; a `ChunkOrdered` leaf refused, with what to do, where a model
would use it as an array; and the training helper end to end on ``cpu8-nodes`` (float64):
its parameters in chunk order, one step equal to the unsharded step in the model's layout,
each leaf against its own scale.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import optax
import pytest
from conftest import float64_model
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from test_corpus import relative_error

from soapjax import training
from soapjax.apply import ChunkOrdered, device_put_global, model_layout, step_layout
from soapjax.apply._layer_order import from_chunk_order, to_chunk_order
from soapjax.apply._pipeline_layout import stacked_params
from soapjax.base.errors import PlanError
from soapjax.strategy.baselines import megatron_3d
from soapjax.strategy.plan import Plan
from soapjax.topology.cluster import load_topology

NODES = load_topology(str(pathlib.Path(__file__).parent / "meshes" / "cpu8-nodes.toml"))


def test_stage_rows_hold_the_chunks_the_stage_runs():
    """8 layers, 2 stages, 2 virtual stages (chunks of 2): stage 0 runs chunks 0 and 2
    (layers 0 1 4 5), stage 1 chunks 1 and 3 (2 3 6 7); 3 stages x 2: chunks of 1 layer is
    not 6 | 6 layers' order but 0 3 | 1 4 | 2 5."""
    layers = np.arange(8)
    assert to_chunk_order(layers, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert to_chunk_order(np.arange(6), 3, 2).tolist() == [0, 3, 1, 4, 2, 5]
    x = np.random.default_rng(0).standard_normal((12, 3, 5))
    for s, v in ((2, 2), (3, 2), (2, 3), (3, 4), (1, 4)):
        np.testing.assert_array_equal(from_chunk_order(to_chunk_order(x, s, v), s, v), x)
    assert to_chunk_order(np.arange(8), 2, 1).tolist() == list(range(8))  # v = 1: as is
    with pytest.raises(PlanError, match="10 layers does not divide into 2 x 2 chunks"):
        to_chunk_order(np.arange(10), 2, 2)


def test_device_arrays_keep_their_sharding_both_ways():
    mesh = jax.make_mesh((2, 4), ("stage", "model"), axis_types=(AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("stage", None, "model"))
    host = np.arange(8 * 2 * 4, dtype=np.float32).reshape(8, 2, 4)
    tree = {"w": host, "b": np.ones(3, np.float32)}
    like = {"w": ChunkOrdered(sharding, 2, 2), "b": NamedSharding(mesh, P())}
    placed = device_put_global(tree, like)
    assert isinstance(placed["w"], ChunkOrdered) and placed["w"].value.sharding == sharding
    np.testing.assert_array_equal(np.asarray(placed["w"].value), to_chunk_order(host, 2, 2))
    back = model_layout(placed)
    assert back["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(back["w"]), host)
    np.testing.assert_array_equal(np.asarray(back["b"]), tree["b"])
    # a device array in the model's order, put in chunk order on the device
    again = step_layout(back, like)
    np.testing.assert_array_equal(np.asarray(again["w"].value), to_chunk_order(host, 2, 2))
    assert step_layout(placed, like)["w"] is placed["w"]  # already in chunk order: as it is
    assert step_layout(tree, {"w": sharding, "b": sharding}) is tree  # nothing to order


def test_a_chunk_ordered_parameter_in_the_model_is_a_clear_error():
    """The tiny GPT's loss on parameters in chunk order (as `run.params` holds them under an
    interleaved plan) raises a PlanError saying how to get the model's layout, not a wrong
    loss; in the model's layout it is the loss."""
    w, params, batch, graph, (want, _) = float64_model("gpt", 4, 4)
    wrapped = step_layout(params, _like(graph, params, 2, 2))
    with jax.enable_x64(True):
        with pytest.raises(PlanError, match=r"chunk order.*soapjax\.apply\.model_layout"):
            w.loss_fn(wrapped, batch)
        with pytest.raises(PlanError, match="chunk order"):
            np.asarray(_first_wrapped(wrapped))
        got = w.loss_fn(model_layout(wrapped), batch)
    assert abs(float(got) - float(want)) <= 1e-12 * abs(float(want))


def _like(graph, params, stages, virtual):
    leaves, tree = jax.tree.flatten(params)
    stacked = set(stacked_params(graph))
    return jax.tree.unflatten(tree, [ChunkOrdered(0, stages, virtual) if k in stacked
                                     else 0 for k in range(len(leaves))])


def _first_wrapped(tree):
    return next(x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, ChunkOrdered))
                if isinstance(x, ChunkOrdered))


def test_the_training_helper_keeps_chunk_order_and_steps_exactly():
    """`shard_training` under Megatron's TP 2 x PP 2 x 2 virtual stages (tiny GPT, 4 layers,
    float64): the stacked parameters and their Adam moments held in chunk order, the rest as
    given; one step, taken back to the model's layout (`run.model_params`), equals the
    unsharded Adam step, each leaf against its own scale (`test_corpus.relative_error`)."""
    w, params, batch, graph, _ = float64_model("gpt", 4, 8)
    optimizer = optax.adam(1e-2)
    with jax.enable_x64(True):
        plan = Plan.make(graph, NODES, megatron_3d(graph, NODES, tp=2, pp=2, interleave=2,
                                                   microbatch_size=2, recompute="none"))
        run = training.shard_training(w.loss_fn, params, batch, optimizer, mesh=NODES,
                                      strategy=plan, name="gpt", donate=False)
        stacked = set(stacked_params(graph))
        kinds = [isinstance(x, ChunkOrdered) for x in jax.tree.leaves(
            run.params, is_leaf=lambda x: isinstance(x, ChunkOrdered))]
        assert [k for k, wrapped in enumerate(kinds) if wrapped] == sorted(stacked)
        assert sum(isinstance(x, ChunkOrdered) for x in jax.tree.leaves(
            run.opt_state, is_leaf=lambda x: isinstance(x, ChunkOrdered))) == 2 * len(stacked)
        new_params, new_state, loss = run.step(run.params, run.opt_state,
                                               run.shard_batch(batch))

        def unsharded(p, o, b):
            value, grads = jax.value_and_grad(w.loss_fn)(p, b)
            updates, o = optimizer.update(grads, o, p)
            return optax.apply_updates(p, updates), o, value

        want = jax.jit(unsharded)(params, optimizer.init(params), batch)
        got = (run.model_params(new_params), model_layout(new_state))
        # the model's layout handed back to the step: a clear error, not a step on
        # permuted layers
        with pytest.raises(PlanError, match="given them in the model's layout; pass what "
                                            "run.step returned"):
            run.step(got[0], got[1], run.shard_batch(batch))
    assert abs(float(loss) - float(want[2])) <= 1e-12 * abs(float(want[2]))
    assert relative_error(got, want[:2]) < 1e-10  # (leaves whose gradient is 0: a floor)
    # the updates moved each layer: in chunk order the leaves would differ
    k = sorted(stacked)[0]
    assert not np.array_equal(np.asarray(jax.tree.leaves(got[0])[k]),
                              to_chunk_order(np.asarray(jax.tree.leaves(got[0])[k]), 2, 2))
