"""The memory dimensions' rules (soapjax.memory): recomputation segments, microbatch shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from soapjax import memory
from soapjax.errors import PlanError
from soapjax.graph import trace
from soapjax.space import Config, MeshShape, Strategy, data_parallel


def mlp_graph(batch=16):
    def loss(w, x):
        h = jax.nn.gelu(x @ w["fc1"])      # fc1 (dot), gelu
        h = jnp.tanh(h @ w["fc2"])         # fc2 (dot), tanh
        return jnp.mean(h ** 2)            # the loss
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return trace(loss, {"fc1": f32(8, 32), "fc2": f32(32, 32)}, f32(batch, 8))


def test_strategy_checks_its_memory_fields():
    c = (Config(((),)),)
    with pytest.raises(PlanError, match="microbatches must be an integer >= 1"):
        Strategy(c, microbatches=0)
    with pytest.raises(PlanError, match=r"recompute\[0\] is 'al'; expected one of"):
        Strategy(c, recompute=("al",))
    with pytest.raises(PlanError, match="2 policies for 1 operators"):
        Strategy(c, recompute=("full", "none"))
    assert Strategy(c, recompute=("none",)) == Strategy(c)  # one spelling of "none"
    assert Strategy(c).with_recompute(0, "full").recompute_of(0) == "full"


def test_selective_keeps_matmuls_and_recomputes_the_rest():
    g = mlp_graph()
    anchors = [op.anchor for op in g.operators]
    flags = [memory.recomputes(op, "selective") for op in g.operators]
    assert flags == [not a.startswith("dot_general") for a in anchors]
    assert all(memory.recomputes(op, "full") for op in g.operators)
    assert not any(memory.recomputes(op, "none") for op in g.operators)


def test_activation_bytes_rule_by_hand():
    """A chain a -> b -> c -> d -> e (a second reader of b: e): bytes 1, 10, 100, 1000, 10000."""
    seg = memory.Segments.__new__(memory.Segments)
    seg.layers = [""] * 5
    seg.readers = [[1], [2, 4], [3], [4], []]
    n = [1, 10, 100, 1000, 10000]
    assert seg.activation_bytes([False] * 5, n) == 11111
    # b, c, d recompute: one segment; b is read by e outside it (kept), c is not, d is (kept)
    assert seg.segments([False, True, True, True, False]) == [-1, 1, 1, 1, -1]
    assert seg.activation_bytes([False, True, True, True, False], n) == 1 + 10 + 1000 + 10000 + 100
    # split by layers: c alone in its segment of layer "x"
    seg.layers = ["", "", "x", "", ""]
    assert seg.segments([False, True, True, True, False]) == [-1, 1, 2, 3, -1]
    assert seg.activation_bytes([False, True, True, True, False], n) == 11111


def test_microbatches_must_divide_the_per_device_batch():
    g = mlp_graph(batch=16)
    mesh = MeshShape(("data",), (8,))
    dp = data_parallel(g, mesh)
    memory.check_microbatches(g, dp.configs, mesh, 2)  # 16 / 8 = 2 per device: fine
    with pytest.raises(PlanError, match="leaves 2 per device, which 4 microbatches do not"):
        memory.check_microbatches(g, dp.configs, mesh, 4)
    assert memory.microbatch_choices(g) == (1, 2, 4, 8, 16)
    op = g.operators[0]
    assert memory.microbatch_degrees(op, (8, 1, 1), 2) == (16, 1, 1)
    assert memory.microbatch_shape((16, 32), (0, 1), 0, 4) == (4, 32)
    assert memory.microbatch_shape((16, 32), (None, 1), 0, 4) == (16, 32)


# --- applied: recomputation and microbatches compute the unsharded step ----------------------

import numpy as np  # noqa: E402
import optax  # noqa: E402

import soapjax_zoo  # noqa: E402
from soapjax.apply import device_put_global, sharded_train_step  # noqa: E402
from soapjax.baselines import megatron  # noqa: E402
from soapjax.topology import load_topology, make_mesh  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}


def keep_gradients() -> optax.GradientTransformation:
    """An "optimizer" that stores the gradients in its state and leaves the parameters: the
    step's gradients come out exactly (no params - lr * grads to undo)."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def float64_case(name: str, batch_size: int):
    w = soapjax_zoo.get(name, "tiny", batch_size=batch_size)
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        params = jax.tree.map(lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape),
                                                    jnp.float64), w.abstract_params())
        batch = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, 2, s.shape), s.dtype)
                             if jnp.issubdtype(s.dtype, jnp.integer) else
                             jnp.asarray(rng.standard_normal(s.shape), jnp.float64),
                             w.abstract_batch())
        graph = trace(w.loss_fn, params, batch, name=name)
    return w, params, batch, graph


def layered_recompute(graph, layer: str, other: str) -> tuple[str, ...]:
    return tuple(layer if op.block_position else other for op in graph.operators)


def run_step(graph, strategy, params, batch, mesh):
    with jax.enable_x64(True):
        opt = keep_gradients()
        step, sh = sharded_train_step(graph, strategy, mesh, opt, params=params, batch=batch,
                                      compiler_options=FAST)
        placed = device_put_global((params, opt.init(params), batch),
                                   (sh.params, sh.opt_state, sh.batch))
        _, grads, loss = step(*placed)
        return loss, grads, step, placed


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_microbatches_and_recompute_compute_the_unsharded_step(name):
    """Megatron on cpu8 (data 2 x model 4) with 4 microbatches, every layer operator
    recomputed in full and the rest selectively: loss and gradients equal the unsharded step's
    in float64 to 1e-12 (global max |diff| / global max |ref|)."""
    w, params, batch, graph = float64_case(name, batch_size=16)
    topo = load_topology("cpu8")
    mesh = make_mesh(topo)
    base = megatron(graph, MeshShape.of(topo), ("model",))
    strategy = Strategy(base.configs, microbatches=4,
                        recompute=layered_recompute(graph, "full", "selective"))
    loss, grads, _, _ = run_step(graph, strategy, params, batch, mesh)
    with jax.enable_x64(True):
        want_loss, want = jax.jit(jax.value_and_grad(w.loss_fn))(params, batch)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)))
    scale = max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(want))
    assert diff / scale < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12


def compiled_temp_and_simulated(strategies, name="gpt", batch_size=64):
    from soapjax.cost import cost_model
    from soapjax.simulate import simulate

    w, params, batch, graph = float64_case(name, batch_size)
    topo = load_topology("cpu8")
    mesh, costs = make_mesh(topo), cost_model(graph, topo, mode="analytic")
    base = megatron(graph, MeshShape.of(topo), ("model",))
    out = []
    for make in strategies:
        st = make(graph, base)
        _, _, step, placed = run_step(graph, st, params, batch, mesh)
        with jax.enable_x64(True):
            temp = step.lower(*placed).compile().memory_analysis().temp_size_in_bytes
        out.append((temp, simulate(graph, topo, st, cost_model=costs).memory.activations))
    return out


def test_microbatches_cut_compiled_memory_as_simulated():
    """Tiny GPT, batch 64, Megatron on cpu8: the compiled step's temporary bytes (XLA's
    `memory_analysis`, which holds the activations kept for the backward pass and little
    else on this model) with 4 microbatches over those without, against the simulator's
    activation bytes, same ratio: measured 438,152 / 2,041,328 = 0.215 compiled, 301,064 /
    1,185,800 = 0.254 simulated; within 20% of each other."""
    (t1, a1), (t4, a4) = compiled_temp_and_simulated(
        [lambda g, b: Strategy(b.configs), lambda g, b: Strategy(b.configs, microbatches=4)])
    assert a4 < a1 and t4 < t1
    assert abs((t4 / t1) / (a4 / a1) - 1) < 0.2


def test_recompute_cuts_compiled_memory_as_simulated():
    """Full recomputation of every layer operator: compiled temporaries and simulated
    activations fall by the same fraction (20%): measured 1,172,208 / 2,041,328 = 0.574
    compiled, 776,200 / 1,185,800 = 0.655 simulated. Before `_program.recompute_in_backward`
    tied the recomputation to the cotangent, XLA:CPU scheduled it beside the forward pass and
    the temporaries did not fall at all (2,041,328 -> 2,041,456)."""
    (t0, a0), (t1, a1) = compiled_temp_and_simulated(
        [lambda g, b: Strategy(b.configs),
         lambda g, b: Strategy(b.configs, recompute=layered_recompute(g, "full", "none"))])
    assert a1 < a0
    assert abs((t1 / t0) / (a1 / a0) - 1) < 0.2


def test_a_graph_that_draws_dropout_masks_keeps_one_microbatch():
    """Microbatches would draw other dropout masks than the whole batch: refused, and the
    search never proposes them."""
    import corpus
    from soapjax.apply import validate_strategy
    from soapjax.memory import microbatch_choices, random_operator
    from soapjax.training import _pure_loss

    loss_fn, model, batch = corpus.get("dropout_nnx", dtype=jnp.float32)
    loss, params, _ = _pure_loss(loss_fn, model, "dropout_nnx")
    graph = trace(loss, params, batch)
    assert random_operator(graph) is not None and microbatch_choices(graph) == (1,)
    mesh = MeshShape.of(load_topology("cpu8"))
    dp = data_parallel(graph, mesh)
    with pytest.raises(PlanError, match=r"draws random bits \(dropout\): 2 microbatches"):
        validate_strategy(graph, Strategy(dp.configs, microbatches=2),
                          make_mesh(load_topology("cpu8")))
