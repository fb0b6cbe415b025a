"""soapjax.simulate.front: the task graph, exact delta simulation, memory, trace export and CLI."""

import dataclasses
import functools
import json
import math
import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import soapjax_zoo
from soapjax import cli
from soapjax.apply import step as apply
from soapjax.base.errors import PlanError
from soapjax.cost.operators import OpTime, cost_model
from soapjax.cost.reshard import Resharder
from soapjax.graph.opgraph import trace
from soapjax.measure import hlo
from soapjax.measure._hlo_text import leaf_bytes, parse_type, type_leaves
from soapjax.simulate.front import Simulation, opt_state_factor, parse_strategy, simulate
from soapjax.strategy.space import Config, MeshShape, Strategy, configs, data_parallel
from soapjax.topology.cluster import load_topology, make_mesh

PAIR = """
name = "pair"
platform = "gpu"
[device]
kind = "test device"
memory_bytes = "1 GB"
memory_bandwidth = "100 GB/s"
peak_flops = { float32 = "1 TFLOP/s", float16 = "1 TFLOP/s", bfloat16 = "1 TFLOP/s" }
[nodes]
count = 1
devices_per_node = 2
[mesh]
axes = { data = 2 }
[[links]]
class = "nvlink"
bandwidth = "1 GB/s"
latency = "1 us"
connect = [["device:0", "device:1"]]
"""
B, A = 1e9, 1e-6  # the pair's link: bytes/s, seconds


class FixedCosts:
    """A cost model with given times, whatever the config."""

    source = "fixed"

    def __init__(self, forward, backward, update):
        self.forward, self.backward, self.update = forward, backward, update

    def op_time(self, i, config):
        return OpTime(self.forward[i], self.backward[i], "fixed")

    def update_time(self, nbytes):
        return self.update


def ideal(topology):
    return Resharder(MeshShape.of(topology), mode="ideal")


def traced(module, x, loss=lambda y: jnp.mean(y ** 2), name="model"):
    params = jax.eval_shape(module.init, jax.random.key(0), x)
    return trace(lambda p, b: loss(module.apply(p, b["x"])), params, {"x": x}, name=name)


@functools.cache
def chain_graph():
    class Chain(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, use_bias=False, name="fc")(x)

    return traced(Chain(), jax.ShapeDtypeStruct((4, 16), jnp.float32), name="chain")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("meshes") / "pair.toml"
    path.write_text(PAIR)
    return load_topology(path)


def spans(result):
    return [(t.name, t.start_s, t.end_s) for t in result.tasks]


# --- hand-checked timelines -------------------------------------------------------------------


def test_two_operator_chain_data_parallel(pair):
    g = chain_graph()
    assert [op.name for op in g.operators] == ["fc", "chain"]
    costs = FixedCosts(forward=[1e-3, 2e-3], backward=[2e-3, 4e-3], update=5e-4)
    r = simulate(g, pair, data_parallel(g, MeshShape.of(pair)), cost_model=costs,
                 resharder=ideal(pair))
    loss_sum = 4 / B + 2 * A  # all-reduce of the loss's f32 partial sums: 2(n-1)/n s/b + 2(n-1)a
    grad = 16 * 8 * 4 / B + 2 * A  # all-reduce of the kernel's gradient
    want = [
        ("forward fc", 0.0, 1e-3),
        ("forward chain", 1e-3, 3e-3),
        ("all_reduce chain (partial sums) over data", 3e-3, 3e-3 + loss_sum),
        ("backward chain", 3e-3, 7e-3),
        ("backward fc", 7e-3, 9e-3),
        ("all_reduce grad ['params']['fc']['kernel'] over data", 9e-3, 9e-3 + grad),
        ("update ['params']['fc']['kernel']", 9e-3 + grad, 9.5e-3 + grad),
    ]
    assert [t[0] for t in spans(r)] == [w[0] for w in want]
    assert spans(r) == [(n, pytest.approx(s, abs=1e-15), pytest.approx(e, abs=1e-15))
                        for n, s, e in want]
    assert r.step_time_s == pytest.approx(9.5e-3 + grad, abs=1e-15)
    assert r.compute_s == pytest.approx(9.5e-3)
    assert r.exposed_comm_s == pytest.approx(grad)
    assert r.bytes_moved == 4 + 512  # 2(n-1)/n = 1 at n = 2
    assert [t.resources for t in r.tasks][2] == ("node:0/nvlink",)


def test_two_operator_chain_row_parallel_waits_for_partial_sums(pair):
    """fc splits its reduction dim (Megatron's row-parallel layer): the loss waits for the sum."""
    g = chain_graph()
    costs = FixedCosts(forward=[1e-3, 2e-3], backward=[2e-3, 4e-3], update=5e-4)
    strategy = Strategy((Config(((), (), ("data",))), Config(((), ()))))
    r = simulate(g, pair, strategy, cost_model=costs, resharder=ideal(pair))
    t1 = 1e-3 + 4 * 8 * 4 / B + 2 * A  # fc's output f32[4, 8] all-reduced over data
    assert spans(r) == [
        ("forward fc", 0.0, 1e-3),
        ("all_reduce fc (partial sums) over data", 1e-3, pytest.approx(t1, abs=1e-15)),
        ("forward chain", pytest.approx(t1, abs=1e-15), pytest.approx(t1 + 2e-3, abs=1e-15)),
        ("backward chain", pytest.approx(t1 + 2e-3), pytest.approx(t1 + 6e-3)),
        ("backward fc", pytest.approx(t1 + 6e-3), pytest.approx(t1 + 8e-3)),
        ("update ['params']['fc']['kernel']", pytest.approx(t1 + 8e-3), pytest.approx(t1 + 8.5e-3)),
    ]
    # The kernel is stored split like fc reads it: half of 512 bytes, no gradient sync.
    assert r.memory.params == 256


# --- communication of the classic strategies ---------------------------------------------------


@functools.cache
def zoo(name, config="tiny"):
    w = soapjax_zoo.get(name, config)
    return w, trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)


def test_data_parallel_moves_one_all_reduce_per_parameter():
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    _, g = zoo("mlp")
    r = simulate(g, topo, data_parallel(g, mesh), cost_model=cost_model(g, topo, mode="analytic"),
                 resharder=ideal(topo))
    n = mesh.num_devices
    assert g.batch_size % n == 0
    syncs = {t.name: t for t in r.tasks if t.kind == "grad_sync"}
    params = {leaf.path: leaf for leaf in g.params}
    assert len(syncs) == len(params)
    for path, leaf in params.items():
        t = syncs[f"all_reduce grad {path} over data+model"]
        nbytes = jnp.dtype(leaf.dtype).itemsize * math.prod(leaf.shape)
        assert t.nbytes == nbytes
        assert t.end_s - t.start_s == pytest.approx(
            topo.collective_time("all_reduce", nbytes, ("data", "model")), rel=1e-12)
    assert not [t for t in r.tasks if t.kind in ("reshard", "reshard_backward", "param_gather")]
    partial = [t for t in r.tasks if t.kind == "partial_sum"]
    assert [t.nbytes for t in partial] == [4]  # only the loss, a float32 scalar
    total = sum(t.nbytes for t in syncs.values()) + 4
    assert r.bytes_moved == pytest.approx(2 * (n - 1) / n * total)
    assert r.bytes_by_link_class == {"shared_memory": pytest.approx(r.bytes_moved)}


def test_zero_gathers_parameters_and_reduce_scatters_gradients():
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    _, g = zoo("mlp")
    costs, rs = cost_model(g, topo, mode="analytic"), ideal(topo)
    dp = data_parallel(g, mesh)
    plain = simulate(g, topo, dp, cost_model=costs, resharder=rs)
    zero = simulate(g, topo, dataclasses.replace(dp, zero_axes=("data", "model")),
                    cost_model=costs, resharder=rs)
    comm = [t.name for t in zero.tasks if t.kind in ("param_gather", "grad_sync")]
    for leaf in g.params:  # split 8 ways where the first dim allows it, else over data alone
        axes = "data+model" if leaf.shape[0] % 8 == 0 else "data"
        assert f"all_gather {leaf.path} over {axes}" in comm
        assert f"reduce_scatter grad {leaf.path} over {axes}" in comm
    # The head's bias (10 floats) is split over data only: its gradient is all-reduced over model.
    assert [n for n in comm if n.startswith("all_reduce")] == [
        "all_reduce grad ['params']['head']['bias'] over model"]
    assert zero.memory.params < plain.memory.params / 4
    assert zero.memory.opt_state == 2 * zero.memory.params


CLIPPED = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


def test_a_global_norm_clip_all_reduces_one_scalar_per_split_parameter():
    """clip_by_global_norm sums every gradient's squares: a parameter stored split has a partial
    sum per device, all-reduced over the axes that split it before its update; a replicated one
    has none (its sum is whole on every device)."""
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    _, g = zoo("mlp")
    costs, rs = cost_model(g, topo, mode="analytic", optimizer=CLIPPED), ideal(topo)
    assert costs.update_reductions == 1
    dp = data_parallel(g, mesh)
    assert not [t for t in simulate(g, topo, dp, cost_model=costs, resharder=rs).tasks
                if t.kind == "update_reduce"]
    zero = simulate(g, topo, dataclasses.replace(dp, zero_axes=("data", "model")),
                    cost_model=costs, resharder=rs)
    norms = {t.name: t for t in zero.tasks if t.kind == "update_reduce"}
    assert len(norms) == len(g.params)
    for leaf in g.params:
        axes = "data+model" if leaf.shape[0] % 8 == 0 else "data"
        t = norms[f"all_reduce norm {leaf.path} over {axes}"]
        assert t.nbytes == 4
        assert t.end_s - t.start_s == pytest.approx(
            topo.collective_time("all_reduce", 4, tuple(axes.split("+"))), rel=1e-12)
        update = next(u for u in zero.tasks if u.name == f"update {leaf.path}")
        assert update.start_s >= t.end_s
    plain = simulate(g, topo, dataclasses.replace(dp, zero_axes=("data", "model")),
                     cost_model=cost_model(g, topo, mode="analytic"), resharder=rs)
    assert not [t for t in plain.tasks if t.kind == "update_reduce"]  # Adam alone: no norm
    # On a GPU, XLA combines the scalars into one all-reduce that NCCL runs as one: each
    # parameter's is priced at its share (XLA:CPU, above, runs a rendezvous per operand).
    gpu = remesh("dgx-h100x8", data=2, model=4)
    fsdp = Strategy(data_parallel(g, MeshShape.of(gpu)).configs, ("data", "model"))
    shares = [t for t in simulate(g, gpu, fsdp, cost_model=cost_model(
        g, gpu, mode="analytic", optimizer=CLIPPED), resharder=ideal(gpu)).tasks
        if t.kind == "update_reduce"]
    assert len(shares) == len(g.params)
    for t in shares:
        axes = tuple(t.name.split(" over ")[-1].split("+"))
        assert t.end_s - t.start_s == pytest.approx(
            gpu.collective_time("all_reduce", 4, axes) / len(g.params), rel=1e-12)


def test_collectives_take_the_compute_stream_where_the_cores_move_the_bytes():
    """cpu8 measures comm_overlap 0 (XLA:CPU's devices copy and reduce on the cores that
    compute): no collective runs beside a kernel, and the step is the sum of its tasks. Where
    collectives overlap (a GPU's NCCL kernels), data parallelism hides gradient all-reduces
    behind the backward pass."""
    topo = load_topology("cpu8")
    assert topo.compute.comm_overlap == 0 and topo.compute.serial_comm
    _, g = zoo("mlp")
    strategy = data_parallel(g, MeshShape.of(topo))
    results = {}
    for overlap in (0.0, 1.0):
        t = dataclasses.replace(topo, compute=dataclasses.replace(topo.compute,
                                                                  comm_overlap=overlap))
        results[overlap] = simulate(g, t, strategy, cost_model=cost_model(g, t, mode="analytic"),
                                    resharder=ideal(t))
    serial, overlapped = results[0.0], results[1.0]
    comm = [x for x in serial.tasks if x.resources != ("compute",)]
    kernels = [x for x in serial.tasks if x.resources == ("compute",)]
    assert comm and all("compute" not in x.resources for x in comm)
    assert not [(c, k) for c in comm for k in kernels
                if c.start_s < k.end_s - 1e-15 and k.start_s < c.end_s - 1e-15]
    busy = sum(x.end_s - x.start_s for x in serial.tasks)
    assert serial.step_time_s == pytest.approx(busy + serial.compute_s - sum(
        x.end_s - x.start_s for x in kernels), rel=1e-12)  # tasks end to end, plus the call
    assert overlapped.step_time_s < serial.step_time_s
    assert [x.name for x in overlapped.tasks] == [x.name for x in serial.tasks]


def test_megatron_mlp_all_reduces_activations_once_each_way():
    """Column- then row-parallel: an all-reduce after the second (forward) and of the cotangent
    of the first's replicated input (backward), and nothing between them."""
    topo = load_topology("cpu8")
    _, g = zoo("mlp")
    assert [op.name for op in g.operators] == ["fc1", "fc2", "head", "mlp"]  # "mlp": the loss
    s = Strategy((Config((("data",), (), ())),  # batch over data only
                  Config((("data",), ("model",), ())),  # column-parallel: output features
                  Config((("data",), (), ("model",))),  # row-parallel: input features (R)
                  Config(((), ("data",)))))  # the loss: (classes, batch), both reduced
    r = simulate(g, topo, s, cost_model=cost_model(g, topo, mode="analytic"),
                 resharder=ideal(topo))
    acts = [(t.kind, t.name) for t in r.tasks if t.kind in ("reshard", "reshard_backward",
                                                              "partial_sum")]
    assert acts == [("partial_sum", "all_reduce head (partial sums) over model"),
                    ("partial_sum", "all_reduce mlp (partial sums) over data"),
                    ("reshard_backward", "all_reduce d(fc1 -> fc2) over model")]
    by_name = {t.name: t for t in r.tasks}
    # The backward all-reduce is issued after fc2's backward and holds up fc1's.
    assert (by_name["backward fc2"].end_s <= by_name["all_reduce d(fc1 -> fc2) over model"].start_s
            and by_name["all_reduce d(fc1 -> fc2) over model"].end_s
            <= by_name["backward fc1"].start_s)


def test_a_bias_after_a_row_parallel_matmul_is_summed_over_the_batch_axes_only():
    """The head's bias is added after its matmul's partial sums are all-reduced: its gradient
    is partial over `data` (the batch), not over `model` (the reduction), as its kernel's is.
    The simulated all-reduces are exactly those of XLA's compiled step (a tuple all-reduce
    counted per operand); they used to price the bias's over data+model."""
    topo = load_topology("cpu8")
    w, g = zoo("mlp")
    head = g.operator("head")  # iteration dims: batch, classes | input features (R)
    assert {o.source: o.outside for o in head.inputs} == {
        "fc2": (), "['params']['head']['kernel']": (), "['params']['head']['bias']": (2,)}
    s = Strategy((Config((("data",), (), ())),  # as Megatron's MLP above
                  Config((("data",), ("model",), ())),
                  Config((("data",), (), ("model",))),
                  Config(((), ("data",)))))
    r = simulate(g, topo, s, cost_model=cost_model(g, topo, mode="analytic"),
                 resharder=ideal(topo))
    syncs = dict(t.name.split(" over ") for t in r.tasks if t.kind == "grad_sync")
    assert syncs["all_reduce grad ['params']['head']['bias']"] == "data"
    assert syncs["all_reduce grad ['params']['head']['kernel']"] == "data"
    simulated = sorted((tuple(t.name.split(" over ")[1].split("+")), t.nbytes)
                       for t in r.tasks if t.name.startswith("all_reduce"))

    params, batch = w.init_params(jax.random.key(0)), w.make_batch(jax.random.key(1))
    mesh = make_mesh(topo)
    step, sh = apply.sharded_train_step(g, s, mesh, w.optimizer, params=params, batch=batch)
    args = (apply.device_put_global(params, sh.params),
            apply.device_put_global(w.optimizer.init(params), sh.opt_state),
            apply.device_put_global(batch, sh.batch))
    compiled = []
    for c in hlo.collectives(step.lower(*args).compile().as_text(), mesh):
        assert c.kind == "all-reduce"
        compiled += [(c.axes, sum(leaf_bytes(x) for x in type_leaves(parse_type(shape))))
                     for shape in c.shapes]
    assert sorted(compiled) == simulated


def test_readers_of_one_value_in_one_layout_share_its_resharding():
    # GPT-2's ln_1 output split over the batch feeds query, key and value, which all want it
    # replicated: XLA all-gathers it once (compiled HLO: one f32[8,8,32] all-gather per layer),
    # and so does the simulator. Their cotangents still go back one by one.
    w = soapjax_zoo.get("gpt2", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt2")
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    dp = data_parallel(g, mesh)
    pos = {op.name: i for i, op in enumerate(g.operators)}
    configs_ = list(dp.configs)
    for name in ("query", "key", "value"):
        configs_[pos[f"layers_0/attn/{name}"]] = Config(((), (), (), ("model",), ()))
    cm = cost_model(g, topo, mode="analytic")
    res = simulate(g, topo, Strategy(tuple(configs_)), cost_model=cm,
                   resharder=Resharder(mesh, mode="ideal"))
    fwd = [t.name for t in res.tasks if t.kind == "reshard" and "layers_0/ln_1 ->" in t.name]
    bwd = [t.name for t in res.tasks
           if t.kind == "reshard_backward" and "layers_0/ln_1 ->" in t.name]
    assert fwd == ["all_gather layers_0/ln_1 -> layers_0/attn/query over data+model"]
    assert len(bwd) == 3


def test_memory_that_does_not_fit_is_reported():
    topo = load_topology("cpu8")
    small = dataclasses.replace(topo, device=dataclasses.replace(topo.device, memory_bytes=1000))
    _, g = zoo("mlp")
    r = simulate(g, small, data_parallel(g, MeshShape.of(small)),
                 cost_model=cost_model(g, small, mode="analytic"), resharder=ideal(small))
    assert not r.fits_in_memory
    assert r.peak_memory_bytes == (r.memory.total,) * 8
    assert r.memory.total > 1000 and r.memory_capacity_bytes == 1000


def test_opt_state_factor_of_adam():
    w, _ = zoo("mlp")
    f = opt_state_factor(optax.adam(1e-3), w.abstract_params())
    assert 2.0 <= f < 2.01  # mu and nu, plus a step counter


# --- exact equality of delta and full simulation on random graphs and strategies ---------------


class MLP(nn.Module):
    widths: tuple

    @nn.compact
    def __call__(self, x):
        for i, w in enumerate(self.widths):
            x = nn.Dense(w, name=f"fc{i}")(x)
            x = nn.relu(x) if i < len(self.widths) - 1 else x
        return x


class LSTM(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="head")(nn.RNN(nn.OptimizedLSTMCell(16), name="lstm")(x))


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(h, h)
        return nn.Dense(16, name="out")(nn.gelu(nn.Dense(32, name="up")(x)))


class Tied(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(32, 16, name="embed")
        return embed.attend(nn.Dense(16, name="mix")(embed(tokens)))


def random_graph(kind, rng):
    f32 = jnp.float32
    if kind == "mlp":
        widths = tuple(rng.choice([8, 16, 32]) for _ in range(rng.randint(1, 4)))
        return traced(MLP(widths), jax.ShapeDtypeStruct((16, rng.choice([8, 16])), f32))
    if kind == "lstm":
        return traced(LSTM(), jax.ShapeDtypeStruct((8, 4, 8), f32))
    if kind == "attention":
        return traced(Attention(), jax.ShapeDtypeStruct((8, 8, 16), f32))
    if kind == "tied":
        def loss(logits):
            return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

        return traced(Tied(), jax.ShapeDtypeStruct((8, 4), jnp.int32), loss=loss)
    return zoo(kind)[1]


def contended(topo, slowdown):
    """`topo` with its GPU's compute slowed by `slowdown` beside a running collective."""
    kernels = dataclasses.replace(topo.device.kernels, overlap_slowdown=slowdown)
    return dataclasses.replace(topo, device=dataclasses.replace(topo.device, kernels=kernels))


def remesh(name, **axes):
    topo = load_topology(name)
    return dataclasses.replace(topo, axis_names=tuple(axes), axis_sizes=tuple(axes.values()),
                               device_order=tuple(range(topo.num_devices)))


TOPOLOGIES = {
    "cpu8": lambda: load_topology("cpu8"),
    "p100x16": lambda: load_topology("p100x16"),
    "k80x64": lambda: load_topology("k80x64"),
    "cpu8(x=8)": lambda: remesh("cpu8", x=8),
    "h100x8(a=2,b=2,c=2)": lambda: remesh("dgx-h100x8", a=2, b=2, c=2),
    # compute beside a collective at half its rate: contention moves many tasks
    "h100x8(slowdown=1)": lambda: contended(remesh("dgx-h100x8", a=2, b=4), 1.0),
}
CASES = [("mlp", "cpu8", 0), ("mlp", "p100x16", 1), ("mlp", "h100x8(a=2,b=2,c=2)", 2),
         ("mlp", "cpu8(x=8)", 3), ("lstm", "cpu8", 4), ("lstm", "k80x64", 5),
         ("attention", "cpu8", 6), ("attention", "k80x64", 7), ("tied", "cpu8(x=8)", 8),
         ("tied", "p100x16", 9), ("gpt2", "cpu8", 10), ("nmt", "h100x8(a=2,b=2,c=2)", 11),
         ("gpt2", "h100x8(slowdown=1)", 12), ("attention", "h100x8(slowdown=1)", 13)]
PROPOSALS = 60


def same(sim, strategy, graph, topo, costs, rs):
    """Delta state == a fresh full simulation, task by task, bit for bit."""
    full = Simulation(graph, topo, costs, rs, strategy)
    assert sim.timeline() == full.timeline()
    a, b = sim.result(), full.result()
    assert (a.step_time_s, a.compute_s, a.bytes_moved, a.memory, a.bytes_by_link_class) == (
        b.step_time_s, b.compute_s, b.bytes_moved, b.memory, b.bytes_by_link_class)


@pytest.mark.parametrize("kind, topo_name, seed", CASES, ids=[f"{k}-{t}" for k, t, _ in CASES])
def test_delta_equals_full_simulation(kind, topo_name, seed):
    """Random strategies and single-operator changes, accepted or rejected at random: after
    every proposal and after some rejections, every task's start and end are exactly (==) those
    of a full simulation of the same strategy."""
    rng = random.Random(seed)
    g = random_graph(kind, rng)
    topo = TOPOLOGIES[topo_name]()
    mesh = MeshShape.of(topo)
    # Odd seeds clip the global norm: split parameters all-reduce their scalars too.
    costs = cost_model(g, topo, mode="analytic", optimizer=CLIPPED if seed % 2 else None)
    rs = ideal(topo)
    choices = [configs(op, mesh) for op in g.operators]
    zero = tuple(a for a in mesh.axis_names if rng.random() < 0.3)
    current = Strategy(tuple(rng.choice(c) for c in choices), zero)
    sim = Simulation(g, topo, costs, rs, current)
    same(sim, current, g, topo, costs, rs)
    for step in range(PROPOSALS):
        i = rng.randrange(len(choices))
        config = rng.choice(choices[i])
        candidate = current.replace(i, config)
        t = sim.propose(i, config)
        same(sim, candidate, g, topo, costs, rs)
        assert t == sim.step_time()
        if rng.random() < 0.5:
            sim.accept()
            current = candidate
        else:
            sim.reject()
            if step % 4 == 0:
                same(sim, current, g, topo, costs, rs)
    assert sim.strategy == current


def test_a_reset_to_the_strategy_simulated_keeps_its_build():
    """`Simulation.reset` to the strategy it holds (a search opens a simulation at the point it
    scores first) keeps the task graph it has, also after accepted delta proposals, and is
    bit for bit a fresh simulation of it; any other strategy, or the same after a rejected
    full proposal, is built anew."""
    rng = random.Random(3)
    g = random_graph("gpt2", rng)
    topo = TOPOLOGIES["cpu8"]()
    mesh = MeshShape.of(topo)
    costs, rs = cost_model(g, topo, mode="analytic"), ideal(topo)
    choices = [configs(op, mesh) for op in g.operators]
    current = Strategy(tuple(rng.choice(c) for c in choices), (),
                       recompute=("none",) * len(choices))
    sim = Simulation(g, topo, costs, rs, current)
    built = sim._task_graph
    assert sim.reset(current) == sim.step_time() and sim._task_graph is built
    for _ in range(10):  # delta proposals, accepted: the state is the strategy's
        i = rng.randrange(len(choices))
        current = current.replace(i, rng.choice(choices[i]))
        sim.propose(i, current.configs[i])
        sim.accept()
    sim.reset(current)
    assert sim._task_graph is built
    same(sim, current, g, topo, costs, rs)
    other = current.replace(0, next(c for c in choices[0] if c != current.configs[0]))
    sim.reset(other)
    assert sim._task_graph is not built
    same(sim, other, g, topo, costs, rs)
    built = sim._task_graph
    sim.propose_strategy(current)  # a full proposal, rejected: stale until rebuilt
    sim.reject()
    sim.reset(other)
    assert sim._task_graph is not built
    same(sim, other, g, topo, costs, rs)


def test_delta_equals_full_with_xla_reshardings(tmp_path):
    """The same property with the collectives XLA compiles (permutes, partial groups, ...)."""
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    _, g = zoo("mlp")
    rng = random.Random(3)
    choices = [configs(op, mesh) for op in g.operators]
    current = Strategy(tuple(rng.choice(c) for c in choices), ("data",))
    changes = [(i, rng.choice(choices[i])) for i in
               (rng.randrange(len(choices)) for _ in range(20))]
    costs = cost_model(g, topo, mode="analytic")
    with Resharder(mesh, mode="xla", cache_dir=tmp_path) as rs:
        sim = Simulation(g, topo, costs, rs, current)
        sim.prefetch(changes)
        kinds = set()
        for i, config in changes:
            candidate = current.replace(i, config)
            sim.propose(i, config)
            same(sim, candidate, g, topo, costs, rs)
            kinds |= {t.name.split()[0] for t in sim.result().tasks if t.nbytes}
            if rng.random() < 0.5:
                sim.accept()
                current = candidate
            else:
                sim.reject()
        assert not rs.fallbacks()
    assert {"all_reduce", "all_gather", "reduce_scatter"} <= kinds


def test_pending_proposal_rules():
    topo = load_topology("cpu8")
    _, g = zoo("mlp")
    sim = Simulation(g, topo, cost_model(g, topo, mode="analytic"), ideal(topo),
                     data_parallel(g, MeshShape.of(topo)))
    with pytest.raises(RuntimeError, match="no pending proposal"):
        sim.accept()
    before = sim.timeline()
    sim.propose(0, Config.replicated(g.operators[0]))
    with pytest.raises(RuntimeError, match="accept\\(\\) or reject\\(\\)"):
        sim.propose(1, Config.replicated(g.operators[1]))
    sim.reject()
    assert sim.timeline() == before
    assert sim.prefetch([(0, Config.replicated(g.operators[0]))]) == 0  # ideal: nothing to compile
    assert sim.timeline() == before
    with pytest.raises(PlanError, match="operator 'fc1': config .* has 1 dims, expected 3"):
        sim.propose(g.index("fc1"), Config((("data",),)))


# --- trace export, plans, command line ---------------------------------------------------------


def test_chrome_trace_is_valid_json_with_named_tracks():
    topo = load_topology("p100x16")
    _, g = zoo("mlp")
    r = simulate(g, topo, data_parallel(g, MeshShape.of(topo)),
                 cost_model=cost_model(g, topo, mode="analytic"), resharder=ideal(topo))
    trace_json = json.loads(json.dumps(r.to_chrome_trace()))
    events = trace_json["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert [threads[(1, d)] for d in range(16)] == [f"device:{d} compute" for d in range(16)]
    links = {name for (pid, _), name in threads.items() if pid == 2}
    assert links == set(r.channels) and "node:3/infiniband" in links
    spans_ = [e for e in events if e["ph"] == "X"]
    compute = [t for t in r.tasks if t.resources == ("compute",)]
    comm = [t for t in r.tasks if t.resources != ("compute",)]
    assert len(spans_) == 16 * len(compute) + sum(len(t.resources) for t in comm)
    for e in spans_:
        assert e["dur"] >= 0 and e["ts"] >= 0 and (e["pid"], e["tid"]) in threads
    last = max(e["ts"] + e["dur"] for e in spans_)
    assert last == pytest.approx(r.step_time_s * 1e6)
    capped = r.to_chrome_trace(max_device_tracks=2)
    assert "16 devices run identical timelines" in capped["otherData"]["note"]


def test_a_pipelined_steps_trace_has_the_pipeline_and_names_the_stage_simulation():
    """`soapjax simulate --trace` of a pipelined plan wrote the one-stage simulation's tasks
    (every layer on one stage's devices) as "devices (SPMD: all identical)": the pipeline
    itself is in the trace now (a track per stage, an event per action, ending with the
    schedule), and the stage simulation's processes say what they are."""
    from soapjax.strategy.baselines import baselines

    w = soapjax_zoo.get("gpt", "tiny", batch_size=16)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")
    topo = load_topology("dgx-a100x3072-32")
    piped = baselines(g, topo, w.family)["megatron"].with_microbatches(4).with_pipeline(
        2, 1, "zb-h1")
    r = simulate(g, topo, piped, cost_model=cost_model(g, topo, mode="analytic"))
    events = json.loads(json.dumps(r.to_chrome_trace()))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names[1].startswith("stage simulation (every layer on one stage's devices)")
    assert names[3] == "pipeline: zb-h1, 2 stages, 4 microbatches"
    actions = [e for e in events if e["ph"] == "X" and e["pid"] == 3]
    tl = r.pipeline.timeline
    assert len(actions) == len(tl.tasks) and {e["cat"] for e in actions} == {
        "pipeline F", "pipeline B", "pipeline W"}
    assert max(e["ts"] + e["dur"] for e in actions) == pytest.approx(tl.step_s * 1e6)


def test_parse_strategy_errors_name_the_operator(tmp_path):
    _, g = zoo("mlp")
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    s = parse_strategy(g, topo, {"configs": {"fc1": [["data"], ["model"], []]},
                                 "zero_axes": ["data"]})
    assert s.configs[g.index("fc1")] == Config((("data",), ("model",), ()))
    assert s.zero_axes == ("data",)
    assert parse_strategy(g, topo, "data-parallel") == data_parallel(g, mesh)
    with pytest.raises(PlanError, match="operator 'fc3', which graph 'mlp' does not have; did "
                                        "you mean .*'fc1'"):
        parse_strategy(g, topo, {"configs": {"fc3": [[], [], []]}})
    with pytest.raises(PlanError, match="operator 'fc1': config .* has 2 dims, expected 3"):
        parse_strategy(g, topo, {"configs": {"fc1": [["data"], []]}})
    with pytest.raises(PlanError, match="operator 'fc1': dim 1 uses unknown mesh axes "
                                        r"\['gpu'\]; the mesh has \['data', 'model'\]"):
        parse_strategy(g, topo, {"configs": {"fc1": [[], ["gpu"], []]}})
    with pytest.raises(PlanError, match="zero_axes"):
        parse_strategy(g, topo, {"configs": {}, "zero_axes": ["gpu"]})
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(PlanError, match="is not valid JSON"):
        parse_strategy(g, topo, str(path))


@pytest.mark.parametrize("spec", [{}, {"zero_axes": ["data"]}, {"configs": [], "x": 1},
                                  {"operators": {"fc1": {"axes": [[], [], []]}}}],
                         ids=["empty", "no-configs", "extra-key", "plan-without-format"])
def test_parse_strategy_refuses_json_that_is_no_strategy(spec):
    _, g = zoo("mlp")
    with pytest.raises(PlanError, match='expected a soapjax plan file \\("format": '
                                        '"soapjax-plan"'):
        parse_strategy(g, load_topology("cpu8"), spec)


def test_parse_strategy_takes_every_baseline_name():
    from soapjax.strategy.baselines import NAMES, baselines

    _, g = zoo("mlp")
    topo = load_topology("cpu8")
    every = baselines(g, topo)
    assert set(NAMES) == set(every)
    for name in NAMES:
        assert parse_strategy(g, topo, name) == every[name]
    with pytest.raises(PlanError, match="expected a baseline \\(data-parallel, megatron, fsdp, "
                                        "megatron-sp, fsdp-recompute, expert-cnn, "
                                        "expert-rnn, maxtext-moe\\).*did you mean 'megatron'"):
        parse_strategy(g, topo, "megatorn")


def test_cli_simulate_json_and_trace(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"configs": {"fc1": [["data"], ["model"], []]}}))
    out = tmp_path / "trace.json"
    argv = ["simulate", "--model", "mlp", "--size", "tiny", "--mesh", "cpu8", "--costs",
            "analytic", "--reshard", "ideal", "--json"]
    assert cli.main(argv + ["--strategy", str(plan), "--trace", str(out)]) == 0
    r = json.loads(capsys.readouterr().out)
    # exactly what the library says for the same inputs
    w, g = zoo("mlp")
    topo = load_topology("cpu8")
    with Resharder(MeshShape.of(topo), mode="ideal") as resharder:
        ref = simulate(g, topo, parse_strategy(g, topo, str(plan)), resharder=resharder,
                       cost_model=cost_model(g, topo, mode="analytic", optimizer=w.optimizer),
                       opt_state_factor=opt_state_factor(w.optimizer, w.abstract_params()))
    assert (r["step_time_s"], r["compute_s"], r["bytes_moved"]) == (
        ref.step_time_s, ref.compute_s, ref.bytes_moved)
    assert r["step_time_s"] > r["compute_s"] > 0
    assert r["exposed_comm_s"] == pytest.approx(r["step_time_s"] - r["compute_s"])
    assert r["bytes_moved"] > 0 and r["fits_in_memory"] is True
    assert len(r["peak_memory_bytes"]) == 8 and len(set(r["peak_memory_bytes"])) == 1
    assert json.loads(out.read_text())["traceEvents"]
    assert cli.main(argv[:-1] + ["--strategy", "data-parallel"]) == 0
    assert "step time" in capsys.readouterr().out
    plan.write_text(json.dumps({"configs": {"fc9": [[]]}}))
    assert cli.main(argv + ["--strategy", str(plan)]) == 2
    assert "plan names operator 'fc9'" in capsys.readouterr().err


MEMORY_CASES = [("mlp", "cpu8", 20), ("attention", "cpu8", 21), ("gpt2", "cpu8", 22),
                ("tied", "p100x16", 23), ("lstm", "k80x64", 24),
                ("gpt2", "h100x8(slowdown=1)", 26)]


@pytest.mark.parametrize("kind, topo_name, seed", MEMORY_CASES,
                         ids=[f"{k}-{t}" for k, t, _ in MEMORY_CASES])
def test_delta_equals_full_with_microbatches_and_recompute(kind, topo_name, seed):
    """Random walks that also change recompute policies (delta) and microbatches (a reset, as
    the search does it): after every move the state equals a full simulation, bit for bit."""
    from soapjax.strategy.memory import microbatch_choices, microbatch_error

    rng = random.Random(seed)
    g = random_graph(kind, rng)
    topo = TOPOLOGIES[topo_name]()
    mesh = MeshShape.of(topo)
    costs = cost_model(g, topo, mode="analytic", optimizer=CLIPPED if seed % 2 else None)
    rs = ideal(topo)
    choices = [configs(op, mesh) for op in g.operators]
    policies = ("none", "selective", "full")
    current = Strategy(tuple(rng.choice(c) for c in choices),
                       recompute=tuple(rng.choice(policies) for _ in g.operators))
    sim = Simulation(g, topo, costs, rs, current)
    same(sim, current, g, topo, costs, rs)
    ms = microbatch_choices(g)
    moved_m = 0
    for step in range(PROPOSALS):
        r = rng.random()
        if r < 0.15:  # a change of microbatches: a full reset
            m = rng.choice(ms)
            candidate = current.with_microbatches(m)
            if any(microbatch_error(op, c, mesh, m) for op, c in zip(g.operators, current)):
                continue
            sim.reset(candidate)
            moved_m += m != current.microbatches
            current = candidate
            same(sim, current, g, topo, costs, rs)
            continue
        i = rng.randrange(len(choices))
        fits = [c for c in choices[i]
                if not microbatch_error(g.operators[i], c, mesh, current.microbatches)]
        config = current[i] if r < 0.45 else rng.choice(fits)
        policy = rng.choice(policies) if r < 0.7 else None
        candidate = current.replace(i, config)
        if policy is not None:
            candidate = candidate.with_recompute(i, policy)
        t = sim.propose(i, config, policy)
        same(sim, candidate, g, topo, costs, rs)
        assert t == sim.step_time()
        if rng.random() < 0.5:
            sim.accept()
            current = candidate
        else:
            sim.reject()
            if step % 4 == 0:
                same(sim, current, g, topo, costs, rs)
    assert sim.strategy == current
    assert moved_m > 0 or len(ms) == 1


@pytest.mark.parametrize("kind, topo_name, seed", MEMORY_CASES[:3] + MEMORY_CASES[-1:],
                         ids=[f"{k}-{t}" for k, t, _ in MEMORY_CASES[:3] + MEMORY_CASES[-1:]])
def test_delta_equals_full_when_several_operators_move_at_once(kind, topo_name, seed):
    """`propose_many` (the search's move of a repeated block's position in every layer): 1 to
    4 operators change config and recompute policy in one proposal, retimed in one pass; the
    state equals a full simulation after it, and after `reject` equals the one before, bit for
    bit."""
    rng = random.Random(seed)
    g = random_graph(kind, rng)
    topo = TOPOLOGIES[topo_name]()
    mesh = MeshShape.of(topo)
    costs, rs = cost_model(g, topo, mode="analytic"), ideal(topo)
    choices = [configs(op, mesh) for op in g.operators]
    policies = ("none", "selective", "full")
    current = Strategy(tuple(rng.choice(c) for c in choices))
    sim = Simulation(g, topo, costs, rs, current)
    rejected = 0
    for _ in range(PROPOSALS // 2):
        ops = rng.sample(range(len(choices)), min(len(choices), rng.randint(1, 4)))
        changes = [(i, rng.choice(choices[i]), rng.choice(policies + (None,))) for i in ops]
        candidate = current
        for i, config, policy in changes:
            candidate = candidate.replace(i, config)
            candidate = candidate.with_recompute(i, policy) if policy else candidate
        t = sim.propose_many(changes)
        same(sim, candidate, g, topo, costs, rs)
        assert t == sim.step_time()
        if rng.random() < 0.5:
            sim.accept()
            current = candidate
        else:
            sim.reject()
            rejected += 1
            same(sim, current, g, topo, costs, rs)
    assert rejected


@pytest.mark.parametrize("kind, topo_name, seed", CASES[:2],
                         ids=[f"{k}-{t}" for k, t, _ in CASES[:2]])
def test_full_proposals_are_accepted_and_rejected_like_delta_ones(kind, topo_name, seed):
    """`propose_strategy` (full simulation) mixed with `propose` (delta): after each accept or
    reject the state equals a full simulation of the strategy kept; a rejected full proposal's
    strategy is rebuilt only when asked for, and a delta proposal after it starts from it."""
    rng = random.Random(seed)
    g = random_graph(kind, rng)
    topo = TOPOLOGIES[topo_name]()
    mesh = MeshShape.of(topo)
    costs, rs = cost_model(g, topo, mode="analytic"), ideal(topo)
    choices = [configs(op, mesh) for op in g.operators]
    current = Strategy(tuple(rng.choice(c) for c in choices))
    sim = Simulation(g, topo, costs, rs, current)
    for step in range(12):
        i = rng.randrange(len(choices))
        config = rng.choice(choices[i])
        candidate = current.replace(i, config)
        if step % 2:
            t = sim.propose_strategy(candidate)
        else:
            t = sim.propose(i, config)
        assert t == Simulation(g, topo, costs, rs, candidate).step_time()
        if rng.random() < 0.5:
            sim.accept()
            current = candidate
        else:
            sim.reject()
            assert sim.strategy == current  # known without a rebuild
        same(sim, current, g, topo, costs, rs)
    with pytest.raises(RuntimeError, match="accept"):
        sim.propose_strategy(current)
        sim.reset(current)


@pytest.mark.parametrize("sigma", [0.0, 0.5])
@pytest.mark.parametrize("seed", range(4))
def test_task_graph_edits_time_as_a_graph_built_whole(sigma, seed):
    """The delta pass after random edits (tasks detached and their ids released and reused
    before the next settle, tasks attached, dependencies and durations changed; some edits
    few, some many, so that both ways `settle` places tasks are taken) times every task
    exactly as a graph built whole from the same tasks and timed by the full pass, bit for
    bit; and a rejected edit's undo (detach the new, attach the old) times as before."""
    from soapjax.simulate._taskgraph import TaskGraph

    rng = random.Random(seed)
    resources = 4
    g = TaskGraph(resources, contention=sigma)
    used: set[int] = set()

    def fresh_key() -> int:
        k = rng.randrange(100_000)
        while k in used:
            k = rng.randrange(100_000)
        used.add(k)
        return k

    def random_task(graph, attached) -> int:
        key = fresh_key()
        res = rng.choice([(0,), (0,), (1,), (2,), (1, 2), (0, 3)])
        earlier = [t for t in attached if graph.key[t] < key]
        deps = rng.sample(earlier, min(len(earlier), rng.randrange(3)))
        return graph.new(key, rng.choice([0.5, 1.0, 1.5, 2.25, 3.0]), res, deps, None)

    attached: list[int] = []
    for _ in range(120):
        attached.append(random_task(g, attached))
    g.build()
    g.full_pass()

    def whole(graph) -> dict[int, tuple[float, float]]:
        """The attached tasks built into a new graph and fully timed, by key."""
        h = TaskGraph(resources, contention=sigma)
        ids = {}
        for t in sorted(graph.order, key=graph.key.__getitem__):
            ids[t] = h.new(graph.key[t], graph.dur[t], graph.res[t],
                           [ids[d] for d in graph.deps[t]], None)
        h.build()
        h.full_pass()
        return {h.key[t]: (h.start[t], h.end[t]) for t in h.order}

    def timed(graph) -> dict[int, tuple[float, float]]:
        graph.settle()
        return {graph.key[t]: (graph.start[t], graph.end[t]) for t in graph.order}

    for step in range(12):
        many = step % 2 == 1
        undo = step % 3 == 2  # rolled back after, as `Simulation.reject` does
        n = rng.randrange(20, 40) if many else rng.randrange(1, 4)
        # leaves of the dependency graph only (nothing attached waits on them)
        leaves = [t for t in attached if not g.succ[t]]
        gone = rng.sample(leaves, min(len(leaves), n))
        before = timed(g)
        for t in gone:
            g.detach(t)
            attached.remove(t)
        if not undo:
            g.release(gone)  # their ids may come back before the next settle
        new = []
        for _ in range(n):
            t = random_task(g, attached)
            g.attach(t)
            attached.append(t)
            new.append(t)
        slower = rng.sample(attached, 3)
        old_dur = [g.set_dur(t, g.dur[t] + 0.75) for t in slower]
        g.sweep()
        assert timed(g) == whole(g)
        if undo:  # the new tasks out, the old ones back (the same ids), durations back
            for t in new:
                g.detach(t)
                attached.remove(t)
            g.release(new)
            for t in gone:
                g.attach(t)
                attached.append(t)
            for t, d in zip(slower, old_dur):
                if t in attached:
                    g.set_dur(t, d)
            g.sweep()
            assert timed(g) == whole(g)
            if all(t in attached for t in slower):
                assert timed(g) == before


def test_microbatch_gradient_syncs_follow_the_platform():
    """A flat plan's gradient syncs with M microbatches: every microbatch's on CPU devices
    (XLA:CPU all-reduces each microbatch's gradients in apply's loop:
    tests/test_check.py::test_flat_microbatches_sync_the_gradients_as_often_as_xla), once on
    GPUs, whose XLA moves an all-reduce the loop only accumulates out of it
    (`Capabilities.sinks_loop_all_reduces`); a reduce-scatter (the distributed optimizer's)
    stays in the loop on both, so with it a GPU's syncs run more often, not M times (its
    scalars and indivisible leaves are still all-reduced)."""
    w = soapjax_zoo.get("gpt", "tiny", batch_size=32)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")

    def runs(topology, m: int, optimizer_axes: tuple[str, ...] = ()) -> int:
        strategy = data_parallel(g, MeshShape.of(topology)).with_microbatches(m)
        strategy = dataclasses.replace(strategy, optimizer_axes=optimizer_axes)
        sim = simulate(g, topology, strategy, resharder="ideal",
                       cost_model=cost_model(g, topology, mode="analytic"))
        return sum(t.runs for t in sim.tasks if t.kind == "grad_sync")

    cpu, gpu = load_topology("cpu8"), load_topology("dgx-h100x8")
    assert not cpu.capabilities.sinks_loop_all_reduces and gpu.capabilities.sinks_loop_all_reduces
    assert runs(cpu, 4) == 4 * runs(cpu, 1)
    assert runs(gpu, 4) == runs(gpu, 1)
    zero = gpu.axis_names[:1]
    assert runs(gpu, 1, zero) < runs(gpu, 4, zero) < 4 * runs(gpu, 1, zero)
