"""Reductions inside an operator (`soapjax.graph._inner`): found, priced, and what XLA runs."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

from soapjax.apply import step as apply
from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import Resharder
from soapjax.graph._inner import inner_reductions
from soapjax.graph.opgraph import trace
from soapjax.measure import hlo
from soapjax.simulate.front import simulate
from soapjax.strategy.space import Config, MeshShape, data_parallel
from soapjax.topology.cluster import load_topology, make_mesh

B, T, D, V = 8, 4, 16, 32


class LM(nn.Module):
    """A layer norm, a Dense layer and vocabulary logits: the statistics of a transformer."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        x = nn.Dense(D, name="fc")(nn.LayerNorm(name="ln")(x))
        return nn.Dense(V, name="logits")(x)


def lm_loss(params, batch):
    logits = LM().apply(params, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


@functools.cache
def lm():
    tokens = jnp.zeros((B, T), jnp.int32)
    params = LM().init(jax.random.key(0), tokens)
    batch = {"tokens": jax.random.randint(jax.random.key(1), (B, T), 0, V),
             "labels": jax.random.randint(jax.random.key(2), (B, T), 0, V)}
    return trace(lm_loss, params, batch, name="lm"), params, batch


def test_a_layer_norm_and_a_cross_entropy_reduce_their_statistics_inside():
    g, _, _ = lm()
    ln = inner_reductions(g, g.index("ln"))  # iteration dims [B, T, D]
    assert [(r.primitive, r.reduced, r.shape, r.dims, r.backward) for r in ln] == [
        ("reduce_sum", (2,), (B, T), (0, 1), True)] * 2  # the mean and the mean square
    assert inner_reductions(g, g.index("fc")) == ()  # a matmul's sum is its output's partial sum
    loss = g.operators[-1]
    assert loss.name == "lm" and all(r == "R" for r in loss.iteration_roles)
    stats = inner_reductions(g, len(g.operators) - 1)
    vocab = loss.iteration_sizes.index(V)
    # log-sum-exp's max and sum over the vocabulary; not the final mean, which stays a
    # partial sum, and nothing in the backward pass (the vocabulary is no output dim)
    assert [(r.primitive, r.reduced, r.shape, r.backward) for r in stats] == [
        ("reduce_max", (vocab,), (B, T), False), ("reduce_sum", (vocab,), (B, T), False)]


def split(g, mesh, **configs):
    dp = data_parallel(g, mesh)
    return dataclasses.replace(dp, configs=tuple(
        configs.get(op.name, c) for op, c in zip(g.operators, dp.configs)))


def test_the_simulator_all_reduces_the_statistics_of_a_split_hidden_dim():
    g, _, _ = lm()
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    costs, rs = cost_model(g, topo, mode="analytic"), Resharder(mesh, mode="ideal")
    plain = simulate(g, topo, split(g, mesh), cost_model=costs, resharder=rs)
    assert not [t for t in plain.tasks if t.kind.startswith("inner_reduce")]
    ln = Config((("data",), (), ("model",)))  # batch over data, hidden over model
    r = simulate(g, topo, split(g, mesh, ln=ln), cost_model=costs, resharder=rs)
    tasks = {t.name: t for t in r.tasks}
    one = B // 2 * T * 4  # one f32 statistic per token of a device's half of the batch
    price = 2 * topo.collective_time("all_reduce", one, ("model",))
    for name, kind in (("all_reduce ln (statistics) over model", "inner_reduce"),
                       ("all_reduce d(ln statistics) over model", "inner_reduce_backward")):
        t = tasks[name]
        assert (t.kind, t.nbytes) == (kind, 2 * one)
        assert t.end_s - t.start_s == pytest.approx(price, rel=1e-12)
    forward, stats = tasks["forward ln"], tasks["all_reduce ln (statistics) over model"]
    assert stats.start_s >= forward.end_s
    # fc reads the normalised hidden dim whole: its input waits for the statistics
    gather = [t for t in r.tasks if t.kind == "reshard" and "ln -> fc" in t.name]
    assert gather and min(t.start_s for t in gather) >= stats.end_s
    assert r.step_time_s > plain.step_time_s


def test_the_vocabulary_split_cross_entropy_all_reduces_its_max_and_sum():
    g, _, _ = lm()
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    loss = g.operators[-1]
    vocab = loss.iteration_sizes.index(V)
    axes = [()] * len(loss.iteration_sizes)
    axes[vocab] = ("model",)
    logits = Config((("data",), (), ("model",), ()))  # vocab-parallel logits
    r = simulate(g, topo, split(g, mesh, logits=logits, lm=Config(tuple(axes))),
                 cost_model=cost_model(g, topo, mode="analytic"),
                 resharder=Resharder(mesh, mode="ideal"))
    stats = [t for t in r.tasks if t.kind.startswith("inner_reduce")]
    # every device holds the whole batch here (the loss splits only the vocabulary)
    assert [(t.name, t.nbytes) for t in stats] == [
        ("all_reduce lm (statistics) over model", 2 * B * T * 4)]


def test_xla_all_reduces_the_statistics_the_simulator_prices():
    """The compiled step of the plan with the layer norm's hidden dim split: XLA all-reduces
    [B/2, T] float32 statistics over `model`, two forward and two backward, as priced."""
    g, params, batch = lm()
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    strategy = split(g, mesh, ln=Config((("data",), (), ("model",))))
    optimizer = optax.sgd(0.1)
    step, sh = apply.sharded_train_step(g, strategy, make_mesh(topo), optimizer, params=params,
                                        batch=batch)
    args = (apply.device_put_global(params, sh.params),
            apply.device_put_global(optimizer.init(params), sh.opt_state),
            apply.device_put_global(batch, sh.batch))
    text = step.lower(*args).compile().as_text()
    stat = f"f32[{B // 2},{T}]"
    found = [c for c in hlo.collectives(text, mesh)
             if c.kind == "all-reduce" and c.axes == ("model",) and stat in c.shapes]
    assert sum(c.shapes.count(stat) for c in found) == 4
    sim = simulate(g, topo, strategy, cost_model=cost_model(g, topo, mode="analytic"),
                   resharder=Resharder(mesh, mode="ideal"))
    priced = [t for t in sim.tasks if t.kind.startswith("inner_reduce")]
    assert sum(t.nbytes for t in priced) == 4 * (B // 2) * T * 4


def test_a_convolution_of_half_the_channels_makes_partial_sums_of_that_half():
    """Glow's coupling layer convolves half of its input's channels (``jnp.split``); with the
    convolution's output channels split, the cotangent of its input is a partial sum of that
    half alone (XLA all-reduces ``f32[8,4,4,4]``, then pads it into the whole's gradient), so
    `matmul_operands` names the half as what the convolution reads in the input's place."""
    from soapjax.graph._inner import matmul_operands
    from soapjax_zoo.user import load

    w = load("corpus.glow:make")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    j = g.index("step_0_coupling/conv_in")
    assert g.operators[j].inputs[0].shape == (8, 4, 4, 8)
    assert matmul_operands(g, j)[0].shape == (8, 4, 4, 4)


def test_check_of_glow_prices_the_half_it_convolves():
    """The plan a 15 s search gave Glow (channels split over `data` and `model` in the
    couplings' convolutions): XLA's collective bytes within 10 % of the simulator's (0.65 of
    them predicted before apply held an operator's values in its layout and the cotangent of
    a coupling's input was priced as the half its convolution reads)."""
    from soapjax.check import compare_on_devices
    from soapjax.strategy.plan import Plan
    from soapjax.strategy.space import Strategy
    from soapjax_zoo.user import load

    w = load("corpus.glow:make")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    split = {"step_0_coupling/conv_in": {3: ("data",)}, "step_0_coupling": {3: ("data",)},
             "step_1_actnorm": {1: ("data",)}, "step_1_coupling/conv_in": {3: ("model",)},
             "step_1_coupling/conv_out": {4: ("model",)}, "step_1_coupling": {1: ("data",)}}
    configs = []
    for op in g.operators:
        axes = [()] * len(op.iteration_sizes)
        for d, a in split.get(op.name, {}).items():
            axes[d] = a
        configs.append(Config(tuple(axes)))
    plan = Plan.make(g, load_topology("cpu8"), Strategy(tuple(configs)))
    r = compare_on_devices(plan, w, repeats=1, costs="analytic", reshard="xla")
    assert r.max_abs_diff < 1e-5
    assert r.predicted_collective_bytes == pytest.approx(r.hlo_collective_bytes, rel=0.10)


def test_check_of_a_glu_prices_the_partial_sums_of_its_whole_matmul():
    """The corpus sparsemax TabNet's GLU blocks (one Dense to twice the width, cut in halves,
    one gating the other by a sigmoid), each Dense's contraction split over `data`: XLA
    all-reduces each matmul's whole result (``f32[8,32]``) before the sigmoid. The simulator
    priced the partial sums at the operator's output (``f32[8,16]``): 0.67 of XLA's bytes on
    the searched plan; `soapjax.graph._inner.partial_sum_value` gives the matmul's result, and
    delta simulation stays full simulation's."""
    from conftest import assert_delta_equals_full

    from soapjax.check import compare_on_devices
    from soapjax.graph._inner import partial_sum_value
    from soapjax.strategy.plan import Plan
    from soapjax.strategy.space import Strategy
    from soapjax_zoo.user import load

    w = load("corpus.sparsemax_tabular:make")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    glus = [j for j, op in enumerate(g.operators) if op.name.endswith("/fc")]
    assert glus and all(partial_sum_value(g, j).shape == (8, 32) for j in glus)
    configs = []
    for j, op in enumerate(g.operators):
        axes = [()] * len(op.iteration_sizes)
        if j in glus and len(op.iteration_sizes) > len(op.shape):
            axes[len(op.shape)] = ("data",)  # the contraction: a reduction dim after the output's
        configs.append(Config(tuple(axes)))
    topo = load_topology("cpu8")
    strategy = Strategy(tuple(configs))
    r = compare_on_devices(Plan.make(g, topo, strategy), w, repeats=1, costs="analytic",
                           reshard="xla")
    assert r.max_abs_diff < 1e-5
    assert r.predicted_collective_bytes == pytest.approx(r.hlo_collective_bytes, rel=0.05)
    assert_delta_equals_full(g, topo, strategy, moves=20)
