"""Dropout in the zoo's GPT as Megatron-LM has it (issue 31): 0.1 on the embeddings' sum, the
attention probabilities and both residual branches, one uint32 seed per sequence in the batch.

The masks are elementwise hashes of (seed, position), no `jax.random` draw
(`soapjax_zoo.workload.dropout`), so they are what the unsharded step draws under every
sharding and microbatching: checked here in float64 against the unsharded gradients (1e-12
relative) on cpu8 under data parallel, Megatron, FSDP, Megatron with 2 microbatches (gradient
accumulation), and the pipelined ``megatron_3d(tp=2, pp=2)`` with 1F1B.
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
from test_corpus import (
    FAST_COMPILE,
    X64_TOL,
    jiggle,
    relative_error,
    sharded_grads,
    worst_leaf,
)

import soapjax_zoo
from soapjax.apply.step import (
    device_put_global,
    sharded_train_step,
)
from soapjax.cost.kernels import shard_kernels
from soapjax.graph.opgraph import trace
from soapjax.strategy.baselines import fsdp, megatron, megatron_3d
from soapjax.strategy.memory import random_operator
from soapjax.strategy.space import MeshShape, Strategy, data_parallel
from soapjax.topology.cluster import load_topology, make_mesh
from soapjax_zoo.gpt import GPT_CONFIGS, GPT_SIZES, build_gpt
from soapjax_zoo.workload import ModelConfigError, dropout

CPU8 = load_topology("cpu8")
NODES = load_topology(str(pathlib.Path(__file__).parent / "meshes" / "cpu8-nodes.toml"))


@functools.cache
def case(rate: float = 0.1, layers: int = 2, batch_size: int = 8):
    """The tiny GPT with `rate` dropout in float64: workload, graph, params (init +
    N(0, 0.05)), batch, and the unsharded ``jax.value_and_grad`` of its loss."""
    cfg = dataclasses.replace(GPT_CONFIGS["tiny-dropout"], dropout=rate, num_layers=layers,
                              batch_size=batch_size, param_dtype="float64")
    w = build_gpt("gpt", "tiny-dropout-x64", cfg, "linen")
    with jax.enable_x64(True):
        params = jiggle(jax.jit(w.init_params, compiler_options=FAST_COMPILE)(jax.random.key(0)),
                        0.05)
        batch = jax.jit(w.make_batch, compiler_options=FAST_COMPILE)(jax.random.key(1))
        want = jax.jit(jax.value_and_grad(w.loss_fn), compiler_options=FAST_COMPILE)(params,
                                                                                     batch)
        graph = trace(w.loss_fn, params, batch, name="gpt")
    return w, graph, params, batch, want


def test_sizes_default_to_megatrons_dropout_and_tiny_to_none():
    assert {cfg.dropout for cfg in GPT_SIZES.values()} == {0.1}
    assert GPT_CONFIGS["tiny"].dropout == 0.0 and GPT_CONFIGS["tiny-dropout"].dropout == 0.1
    w = soapjax_zoo.get("gpt", "tiny-dropout")
    batch = w.abstract_batch()
    assert (batch["dropout_seed"].shape, batch["dropout_seed"].dtype) == ((8,), jnp.uint32)
    assert "dropout_seed" not in soapjax_zoo.get("gpt", "tiny").abstract_batch()
    with pytest.raises(ModelConfigError, match=r"dropout 1.0 must be in \[0, 1\)"):
        dataclasses.replace(GPT_CONFIGS["tiny"], dropout=1.0)


def test_dropout_drops_its_rate_and_scales_the_rest():
    x = jnp.ones((4, 16, 1024), jnp.float32)
    y = np.asarray(dropout(x, jnp.arange(4, dtype=jnp.uint32), 0.1))
    dropped = (y == 0).mean(axis=(1, 2))
    assert np.all(np.abs(dropped - 0.1) < 0.005), dropped  # 16,384 draws a sample: sd 0.0023
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.9)}
    # one sample's mask depends on its own seed only, not on its neighbours or the batch size
    alone = np.asarray(dropout(x[2:3], jnp.asarray([2], jnp.uint32), 0.1))
    assert np.array_equal(alone[0], y[2])
    assert not np.array_equal(y[0] == 0, y[1] == 0)


def test_dropout_is_applied_and_a_batch_fixes_the_masks():
    w = soapjax_zoo.get("gpt", "tiny-dropout")
    plain = soapjax_zoo.get("gpt", "tiny")
    params = w.init_params(jax.random.key(0))
    batch = w.make_batch(jax.random.key(1))
    loss = jax.jit(w.loss_fn)
    with_dropout = float(loss(params, batch))
    # the same tokens (the seeds are drawn from a folded key), without dropout
    plain_batch = plain.make_batch(jax.random.key(1))
    assert np.array_equal(plain_batch["inputs"], batch["inputs"])
    without = float(jax.jit(plain.loss_fn)(params, plain_batch))
    assert abs(with_dropout - without) > 1e-4, (with_dropout, without)
    # same batch, same numbers; other seeds, other masks
    assert float(loss(params, w.make_batch(jax.random.key(1)))) == with_dropout
    other = dict(batch, dropout_seed=batch["dropout_seed"] + 1)
    assert abs(float(loss(params, other)) - with_dropout) > 1e-4


def test_the_graph_draws_no_random_bits():
    """No `jax.random` primitive in the loss: nothing soapjax refuses to microbatch or
    pipeline (`soapjax.strategy.memory.random_operator`)."""
    assert random_operator(case()[1]) is None


def gradient_error(strategy: Strategy, rate: float = 0.1) -> float:
    """The relative error of `strategy`'s float64 gradients on cpu8 against the unsharded."""
    _, graph, params, batch, (_, want) = case(rate)
    mesh = make_mesh(CPU8)
    got = sharded_grads(graph, strategy, mesh, params, batch)
    err = relative_error(got, want)
    assert err <= X64_TOL, f"{err:.3g}; worst leaf {worst_leaf(got, want)}"
    return err


STRATEGIES = {
    "data_parallel": lambda g, m: data_parallel(g, m),
    "megatron": lambda g, m: megatron(g, m, m.axis_names[1:]),
    "fsdp": fsdp,
    "megatron-2-microbatches": lambda g, m: dataclasses.replace(
        megatron(g, m, m.axis_names[1:]), microbatches=2),
}


@pytest.mark.parametrize("kind", STRATEGIES)
def test_sharded_gradients_with_dropout_are_the_unsharded(kind):
    graph = case()[1]
    strategy = STRATEGIES[kind](graph, MeshShape.of(CPU8))
    assert gradient_error(strategy) <= X64_TOL


def keep_gradients() -> optax.GradientTransformation:
    """An "optimizer" that stores the gradients in its state and leaves the parameters."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def test_a_pipelined_plan_with_dropout_computes_the_unsharded_step():
    """megatron_3d(tp=2, pp=2, microbatch size 2) on cpu8-nodes, 1F1B over 8 microbatches:
    each microbatch carries its sequences' seeds, so it draws the whole batch's masks."""
    _, graph, params, batch, (want_loss, want) = case(layers=2, batch_size=16)
    strategy = megatron_3d(graph, NODES, tp=2, pp=2, microbatch_size=2)
    opt = keep_gradients()
    with jax.enable_x64(True):
        step, shardings = sharded_train_step(graph, strategy, make_mesh(NODES), opt,
                                             params=params, batch=batch,
                                             compiler_options=FAST_COMPILE)
        placed = device_put_global((params, opt.init(params), batch),
                                   (shardings.params, shardings.opt_state, shardings.batch))
        _, grads, loss = step(*placed, np.int32(0))
    assert relative_error(grads, want) <= X64_TOL
    assert abs(float(loss) - float(want_loss)) <= X64_TOL * abs(float(want_loss))


def test_the_masks_cost_the_kernel_model_no_memory_traffic():
    """XLA fuses the mask's hash (iotas and integer ops) into its consumers, so the attention
    core's kernels move the bytes they move without dropout, plus the seeds
    (`soapjax.cost.kernels`: a value reached twice, as ``x ^ (x >> 16)`` reads x, is recomputed,
    not read from memory)."""
    moved = {}
    for rate in (0.0, 0.1):
        graph = case(rate)[1]
        op = next(o for o in graph.operators if o.name == "layers_0/attn/dot_general")
        kernels = shard_kernels(graph, op, (1,) * len(op.iteration_sizes)).forward
        moved[rate] = sum(k.nbytes for k in kernels)
    assert 0 <= moved[0.1] - moved[0.0] <= 4 * 8 * 4  # the [8] uint32 seeds, read and written
