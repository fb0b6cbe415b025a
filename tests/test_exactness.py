"""soapjax.exactness: gradients leaf by leaf; the defects it exists to catch, each kept as a test.

* `compare_gradients` on hand-made trees: a leaf scaled by a constant c has error |c - 1|, a
  leaf whose true gradient is zero is held to the floor, NaNs fail, a NaN reference says so;
  a float32 leaf whose gradient is real but under the floor is held to its own scale against
  the float64 gradients (a millionth of the largest, 1.3x: it passed the floor).
* **Grouped and depthwise convolutions** (float64, `cpu8`): XLA's SPMD partitioner computes a
  grouped convolution's kernel gradient multiplied by the size of the mesh axes its input is
  replicated over while its batch is split (4x for ``P('data')`` on ``data=2, model=4``; the
  canary below holds XLA to it). soapjax splits the input's channels with the output's, in
  whole groups, and runs every grouped convolution its config splits in `jax.shard_map`
  (`soapjax.apply._manual`), so every split (channels over one axis or both, with and without the
  batch split, the batch alone, 1-D and 2-D, a channel multiplier, a 4-group convolution)
  gives ``jax.grad``'s gradients.
* **A dead value inside an operator** (a Mamba-style conv state sliced from the padded input
  after the convolution, never read by the loss) no longer crashes the step: the program drops
  dead equations as XLA does, keeping an unrolled layer's while another layer's is live.
* `soapjax check` and ``shard_training(verify=True)`` fail a plan whose step scales one
  gradient leaf by a constant under Adam (a test-only hook breaks the step on purpose), which
  the step comparison alone passes.
* **A platform-dependent index** (`jnp.diag`'s `cond` on `platform_index`) is folded into the
  operator that reads it: an operator of its own, recomputed, it crashed JAX's linearisation.
* **The reference of coupled samples** (statistics per microbatch: the MoE's load-balancing
  loss) splits its microbatches as apply does (samples k, k + M, ...), not into blocks.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import corpus
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn, nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import soapjax_zoo as zoo
from soapjax import exactness, training
from soapjax.apply import step as apply
from soapjax.check import compare_on_devices
from soapjax.exactness import (
    TOLERANCE,
    VerificationError,
    compare_gradients,
    first_step,
    rounding_tolerance,
    step_difference,
)
from soapjax.graph.opgraph import trace
from soapjax.search import SearchSettings
from soapjax.strategy import space
from soapjax.strategy.baselines import baselines
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import Config, MeshShape
from soapjax.topology.cluster import load_topology, make_mesh

TOPOLOGY = load_topology("cpu8")
MESH_SHAPE = MeshShape.of(TOPOLOGY)  # data=2, model=4
X64 = TOLERANCE["float64"]
FAST = {"xla_backend_optimization_level": 0}


# --- compare_gradients --------------------------------------------------------------------------


def test_a_scaled_leaf_has_error_c_minus_one_and_is_named():
    want = {"a": np.array([1.0, -2.0]), "b": np.array([[0.5, 0.25]])}
    got = {"a": want["a"], "b": 4.0 * want["b"]}
    c = compare_gradients(1.0, got, 1.0, want, tolerance=1e-9, operators=["fc1", "fc2"])
    assert c.leaves[0].error == 0.0
    assert c.leaves[1].error == pytest.approx(3.0)
    assert c.worst.path == "['b']" and c.worst.operator == "fc2"
    assert not c.passed
    assert "FAIL gradients" in c.describe() and "['b']" in c.describe() and "'fc2'" in c.describe()


def test_a_leaf_whose_gradient_is_zero_is_held_to_the_floor():
    # float64 rounding noise on an exactly-zero gradient: relative to itself it would be 1;
    # against the floor (the largest gradient x 30 eps / tolerance) it passes
    want = {"w": np.array([3.0, -1.0]), "bias": np.zeros(2)}
    got = {"w": want["w"] * (1 + 1e-15), "bias": np.array([2e-16, -1e-16])}
    c = compare_gradients(0.5, got, 0.5, want, tolerance=1e-9)
    assert c.passed, c.describe()
    floor = 3.0 * 30 * np.finfo(np.float64).eps / 1e-9
    assert c.leaves[0].scale == pytest.approx(floor) and c.leaves[1].scale == 3.0
    # a real gradient where the reference has none still fails
    bad = compare_gradients(0.5, {"w": want["w"], "bias": np.array([0.1, 0.0])}, 0.5, want,
                            tolerance=1e-9)
    assert not bad.passed and bad.worst.path == "['bias']"
    assert [e.noise for e in c.leaves] == [True, False]  # 'bias' sorts first


def test_the_step_leaves_out_a_parameter_whose_gradient_is_noise():
    """A bias before a normalisation has a zero gradient: both steps hold rounding noise, and
    Adam's first update is ``lr * g / |g|``, so they move it by the learning rate, maybe in
    opposite directions. `soapjax check` failed the step bar on a correct Conformer plan so
    (0.00197 at lr 1e-3), and ``shard_training(verify=True)`` would have raised; the step's
    bar leaves such parameters out (their gradients are held to the floor)."""
    import optax

    want = {"bias": np.zeros(3), "w": np.array([1.0, -2.0, 0.5])}
    got = {"bias": np.array([1e-6, -1e-6, 0.0]), "w": want["w"] * (1 + 1e-9)}
    c = compare_gradients(0.5, got, 0.5, want, tolerance=1e-3, computed_in="float32")
    assert c.passed and [e.noise for e in c.leaves] == [True, False]
    adam = optax.adam(1e-3)
    params = {"bias": np.zeros(3), "w": np.ones(3)}

    def step(g):
        updates, state = adam.update(g, adam.init(params), params)
        return optax.apply_updates(params, updates), state, 0.5

    ours, ref = step(got), step(want)
    assert step_difference(ours, ref) == pytest.approx(1e-3, rel=0.02)  # the noise's sign
    skip = {k for k, e in enumerate(c.leaves) if e.noise}
    assert step_difference(ours, ref, skip_params=skip) < 1e-6  # its Adam moments: ~g


def test_the_step_leaves_out_elements_whose_gradient_sign_the_bar_leaves_open():
    """In bfloat16 the bar is 4 % of a leaf's scale: an element whose reference gradient is
    1 % of it may come out with the other sign and still pass, and Adam's first step moves it
    by the learning rate the other way. `soapjax check` failed the step bar on a correct
    bfloat16 plan so (the corpus's mixed_precision: 0.002 at lr 1e-3); the step's bar leaves
    such elements out, and still holds the rest of the leaf."""
    import optax

    want = {"w": np.array([1.0, 0.01, -0.5])}
    got = {"w": np.array([1.0, -0.01, -0.5])}
    c = compare_gradients(0.5, got, 0.5, want, tolerance=0.04, computed_in="bfloat16")
    assert c.passed and not c.noise_leaves
    assert c.leaves[0].unsettled.tolist() == [False, True, False]
    adam = optax.adam(1e-3)
    params = {"w": np.ones(3)}

    def step(g):
        updates, state = adam.update(g, adam.init(params), params)
        return optax.apply_updates(params, updates), state, 0.5

    assert step_difference(step(got), step(want)) == pytest.approx(2e-3, rel=0.02)
    assert step_difference(step(got), step(want), gradients=c) < 1e-4
    wrong = {"w": np.array([1.0, 0.01, 0.5])}  # a settled element's sign: still seen
    assert step_difference(step(wrong), step(want), gradients=c) == pytest.approx(0.1)  # mu


def test_nans_fail_and_a_nan_reference_says_so():
    want = {"w": np.array([1.0, 2.0])}
    c = compare_gradients(1.0, {"w": np.array([1.0, np.nan])}, 1.0, want, tolerance=1e-3)
    assert c.leaves[0].error == math.inf and not c.passed
    ref_nan = compare_gradients(np.nan, want, np.nan, want, tolerance=1e-3)
    assert not ref_nan.passed
    assert "the unsharded loss itself is NaN" in ref_nan.describe()



def test_a_complex_parameters_imaginary_part_is_compared():
    """A Fourier neural operator's spectral weights are complex (tests/corpus/fno.py). The
    step's bar cast every leaf to float64, so an update wrong only in its imaginary part
    passed (with numpy's ComplexWarning); the gradients' near-zero mask did the same."""
    want = {"w": np.array([1.0 + 2.0j, -0.5 + 0.25j])}
    got = {"w": np.array([1.0 - 2.0j, -0.5 + 0.25j])}  # the first one's conjugate
    c = compare_gradients(0.5, got, 0.5, want, tolerance=1e-9)
    assert c.leaves[0].error == pytest.approx(4.0 / abs(1 + 2j)) and not c.passed
    sgd = optax.sgd(0.1)
    params = {"w": np.ones(2, np.complex128)}

    def step(g):
        updates, state = sgd.update(g, sgd.init(params), params)
        return optax.apply_updates(params, updates), state, 0.5

    with warnings.catch_warnings():
        warnings.simplefilter("error", np.exceptions.ComplexWarning)
        assert step_difference(step(got), step(want)) == pytest.approx(0.4)
        imaginary = {"w": np.array([0.5j, 1.0])}
        c = compare_gradients(0.5, imaginary, 0.5, imaginary, tolerance=1e-9)
    assert c.passed and c.leaves[0].unsettled is None  # 0.5j's sign is settled: it is not 0

def test_trees_of_another_structure_are_refused():
    with pytest.raises(ValueError, match="pytree"):
        compare_gradients(0.0, {"a": np.zeros(1)}, 0.0, {"b": np.zeros(1)}, tolerance=1e-3)


def test_the_bar_follows_the_narrowest_float_type():
    def loss(p, b):
        return jnp.sum((b["x"].astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16)) ** 2
                       ).astype(jnp.float32)

    params = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    assert rounding_tolerance(trace(loss, params, batch)) == TOLERANCE["bfloat16"]
    f32 = trace(lambda p, b: jnp.sum((b["x"] @ p["w"]) ** 2), params, batch)
    assert rounding_tolerance(f32) == TOLERANCE["float32"]


# --- grouped and depthwise convolutions, channels split -----------------------------------------


def _conv_model(kind: str):
    """(loss, params, batch) in float64: a convolution of `kind` then a LayerNorm and an MLP,
    the ConvNeXt block's shape (the channels' gradient flows on through the norm)."""
    c = 8
    convs = {
        "depthwise2d": dict(in_features=c, out_features=c, kernel_size=(7, 7), padding=3,
                            feature_group_count=c),
        "multiplier2d": dict(in_features=c, out_features=2 * c, kernel_size=(3, 3), padding=1,
                             feature_group_count=c),
        "grouped2d": dict(in_features=c, out_features=c, kernel_size=(3, 3), padding=1,
                          feature_group_count=4),
        "depthwise1d": dict(in_features=c, out_features=c, kernel_size=(4,), padding="CAUSAL",
                            feature_group_count=c),
    }
    spec = convs[kind]
    rank = len(spec["kernel_size"])

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(**spec, param_dtype=jnp.float64, rngs=rngs)
            out = spec["out_features"]
            self.norm = nnx.LayerNorm(out, param_dtype=jnp.float64, rngs=rngs)
            self.fc = nnx.Linear(out, c, param_dtype=jnp.float64, rngs=rngs)

        def __call__(self, x):
            return self.fc(nnx.gelu(self.norm(self.conv(x))))

    with jax.enable_x64(True):
        model = Block(nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)
        params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape,
                                                                     p.dtype), params)
        x = jax.random.normal(jax.random.key(2), (8,) + (8,) * rank + (c,), jnp.float64)
    batch = {"x": x, "y": jnp.sin(x[..., :c])}

    def loss(params, batch):
        return jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)

    return loss, params, batch


# (batch axes, channel axes) of the convolution's config: channels over one axis or both, with
# and without the batch split over the other
SPLITS = [((), ("model",)), (("data",), ("model",)), ((), ("data",)), (("model",), ("data",)),
          ((), ("data", "model")), (("data",), ())]


@pytest.mark.parametrize("kind", ["depthwise2d", "multiplier2d", "grouped2d", "depthwise1d"])
def test_grouped_convolutions_split_over_channels_give_exact_gradients(kind):
    loss, params, batch = _conv_model(kind)
    mesh = make_mesh(TOPOLOGY)
    with jax.enable_x64(True):
        graph = trace(loss, params, batch)
        (j, op), = [(j, op) for j, op in enumerate(graph.operators)
                    if op.anchor == "conv_general_dilated"]
        groups = {"depthwise2d": 8, "multiplier2d": 8, "grouped2d": 4, "depthwise1d": 8}[kind]
        channel = len(op.shape) - 1
        # the input's channels split with the output's, in whole groups
        assert op.inputs[0].dims[channel] == channel
        assert op.split_sizes[channel] == groups
        offered = {cfg.axes[channel] for cfg in space.configs(op, MESH_SHAPE)
                   if not any(cfg.axes[1:channel])}
        tried = 0
        for batch_axes, channel_axes in SPLITS:
            degree = MESH_SHAPE.degree(channel_axes)
            if groups % degree:
                assert channel_axes not in offered  # a split cutting a group is never offered
                continue
            axes = [()] * len(op.iteration_sizes)
            axes[0], axes[channel] = batch_axes, channel_axes
            strategy = space.data_parallel(graph, MESH_SHAPE).replace(j, Config(tuple(axes)))
            c = first_step(graph, strategy, mesh, loss, params, batch, compiler_options=FAST)
            assert c.max_error <= X64, (batch_axes, channel_axes, c.describe())
            tried += 1
        assert tried >= 4


def test_xla_still_gets_the_depthwise_kernel_gradient_wrong_with_the_batch_split():
    """The canary: XLA's SPMD partitioner (jax 0.10.2) computes a depthwise convolution's kernel
    gradient `model`-fold when its input's batch is split over `data` and replicated over
    `model` (split over both, or over `data` and the channels over `model`, it is right). The
    day this fails, XLA fixed it, and soapjax's `jax.shard_map` for grouped convolutions
    (`soapjax.apply._manual`) can go."""
    mesh = make_mesh(TOPOLOGY)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (8, 8, 8, 8), jnp.float64)
        k = jax.random.normal(jax.random.key(1), (7, 7, 1, 8), jnp.float64)

        def f(k, x, input_spec):
            if input_spec is not None:
                x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, input_spec))
            y = jax.lax.conv_general_dilated(x, k, (1, 1), [(3, 3), (3, 3)],
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                             feature_group_count=8)
            return jnp.sum(jnp.sin(y))

        grad = jax.jit(jax.grad(f), static_argnums=2)
        want = grad(k, x, None)
        replicated = grad(k, x, P("data"))  # batch over data, replicated over model
        split = grad(k, x, P("data", None, None, "model"))
        ratio = float(jnp.sum(replicated * want) / jnp.sum(want * want))
    assert ratio == pytest.approx(4.0, rel=1e-9)  # the bug: MESH 'model' = 4
    np.testing.assert_allclose(split, want, rtol=1e-10, atol=1e-12)


def test_batch_group_count_is_never_split():
    def loss(p, b):
        y = jax.lax.conv_general_dilated(b["x"], p["k"], (1,), "VALID",
                                         dimension_numbers=("NWC", "WIO", "NWC"),
                                         batch_group_count=4)
        return jnp.sum(y ** 2)

    graph = trace(loss, {"k": jax.ShapeDtypeStruct((3, 4, 8), jnp.float32)},
                  {"x": jax.ShapeDtypeStruct((8, 10, 4), jnp.float32)})
    op = graph.operators[0]
    assert op.anchor == "conv_general_dilated"
    assert op.split_sizes[0] == 1 and op.split_sizes[-1] == 1  # batch and features: never
    assert all(cfg.axes[0] == () and cfg.axes[-1] == ()
               for cfg in space.configs(op, MESH_SHAPE))


# --- a dead value inside an operator ------------------------------------------------------------


class _CausalConv(nnx.Module):
    """Pads for a causal depthwise conv1d, convolves, then slices the padded input's last
    steps as a conv state (dead: the loss never reads it)."""

    def __init__(self, channels: int, k: int, rngs: nnx.Rngs):
        self.k = k
        self.kernel = nnx.Param(0.3 * jax.random.normal(rngs.params(), (k, 1, channels),
                                                        jnp.float64))

    def __call__(self, x):
        x_padded = jnp.pad(x, ((0, 0), (self.k - 1, 0), (0, 0)))
        y = jax.lax.conv_general_dilated(x_padded, self.kernel[...], (1,), "VALID",
                                         dimension_numbers=("NWC", "WIO", "NWC"),
                                         feature_group_count=x.shape[-1])
        conv_state = x_padded[:, -self.k:, :]
        return y, conv_state


class _Mixer(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.conv1d = _CausalConv(d, 4, rngs)
        self.norm = nnx.RMSNorm(d, param_dtype=jnp.float64, rngs=rngs)
        self.out = nnx.Linear(d, d, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        y, _conv_state = self.conv1d(x)
        return x + self.out(y) * self.norm(x)


@pytest.mark.parametrize("strategy", ["data-parallel", "fsdp", "channels"])
def test_a_dead_value_inside_an_operator_is_dropped(strategy):
    with jax.enable_x64(True):
        model = _Mixer(16, nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(2), (8, 16, 16), jnp.float64)
        batch = {"x": x, "y": jnp.cos(x)}

        def loss_fn(model, batch):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        chosen = strategy
        if strategy == "channels":
            def chosen(graph, mesh_shape):
                s = space.data_parallel(graph, mesh_shape)
                j = next(j for j, op in enumerate(graph.operators)
                         if op.anchor == "conv_general_dilated")
                return s.replace(j, Config((("data",), (), ("model",))))

        run = training.shard_training(loss_fn, model, batch, optax.sgd(1.0), mesh="cpu8",
                                      strategy=chosen, verify=True, compiler_options=FAST)
        # the slice of the padded input the loss never reads is gone, as XLA drops it
        prog = run.graph.program
        assert [u.eqn.primitive.name for u in prog.units].count("slice") == 0
        _, _, loss = run.step(run.params, run.opt_state, run.shard_batch(batch))
        assert float(loss) == pytest.approx(float(loss_fn(model, batch)), rel=1e-12)


@pytest.mark.parametrize("strategy", ["data-parallel", "plan"])
def test_a_loop_its_loss_sums_over_the_batch_splits_the_batch_exactly(strategy, monkeypatch,
                                                                      tmp_path):
    """A neural ODE (`corpus.neural_ode`: RK4 steps in a ``fori_loop``) whose loss reads the
    final state: grouped with its loss, the loop is one operator whose batch dim is a reduction
    dim of role S. Data parallelism splits it there; the space refused it (a loop operator
    split only an *output* S dim), so the search's first simulation, of data parallelism,
    raised PlanError and ``shard_training`` could plan nothing for the model."""
    monkeypatch.setenv("SOAPJAX_CACHE_DIR", str(tmp_path))  # a plan searched here, not cached
    with jax.enable_x64(True):
        loss_fn, params, batch = corpus.get("neural_ode", dtype=jnp.float64,
                                            compiler_options=FAST)
        run = training.shard_training(loss_fn, params, batch, optax.sgd(1.0), mesh="cpu8",
                                      strategy=strategy, costs="analytic",
                                      search=SearchSettings(max_proposals=50, seed=0),
                                      verify=True, compiler_options=FAST)
    j = next(j for j, op in enumerate(run.graph.operators) if op.is_loop)
    loop = run.graph.operators[j]
    d = space.sample_dim(loop)
    assert d >= len(loop.shape) and d in loop.divisible_dims  # the batch, summed inside
    if strategy == "data-parallel":
        assert run.strategy.configs[j].axes[d] == ("data", "model")


class _Annotated(nn.Module):
    """Written for hand sharding, MaxText's way: logical names on the activations and the
    kernels, mapped to mesh axes by the caller's rules under the caller's mesh."""

    @nn.compact
    def __call__(self, x):
        partitioned = nn.with_logical_partitioning
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = nn.Dense(32, param_dtype=jnp.float64, kernel_init=partitioned(
            nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
        return nn.Dense(8, param_dtype=jnp.float64, kernel_init=partitioned(
            nn.initializers.lecun_normal(), ("mlp", "embed")))(h)


def test_a_model_sharded_by_hand_runs_the_plan_inside_its_own_mesh(monkeypatch, tmp_path):
    """``shard_training`` called inside the user's ``jax.set_mesh`` (its devices in another
    order than soapjax's mesh) and logical-axis rules, on a model with constraints of its own:
    the trace leaves the constraints out, saying so (they name the user's mesh; the plan sets
    the layouts), every step runs on soapjax's mesh, and ``verify`` runs the reference where
    the user's function runs. Before, the first jitted call failed ("Received incompatible
    devices for jitted computation": jit's context mesh against the step's shardings), and
    without the context the reference, on one device, failed on the constraints' devices."""
    monkeypatch.setenv("SOAPJAX_CACHE_DIR", str(tmp_path))
    model = _Annotated()
    user_mesh = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("fsdp", "tensor"),
                     axis_types=(AxisType.Auto,) * 2)
    rules = (("batch", "fsdp"), ("length", None), ("embed", None), ("mlp", "tensor"))
    with jax.enable_x64(True), jax.set_mesh(user_mesh), nn.logical_axis_rules(rules):
        x = jax.random.normal(jax.random.key(0), (16, 4, 8), jnp.float64)
        batch = {"x": x, "y": jnp.cos(x)}
        params = nn.unbox(jax.jit(model.init)(jax.random.key(1), x)["params"])

        def loss_fn(params, batch):
            return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

        with pytest.warns(UserWarning, match="applies 2 sharding constraint"):
            run = training.shard_training(loss_fn, params, batch, optax.sgd(1.0), mesh="cpu8",
                                          strategy="megatron", verify=True,
                                          compiler_options=FAST)
        _, _, loss = run.step(run.params, run.opt_state, run.shard_batch(batch))
        want = float(loss_fn(params, batch))
    assert run.graph.program.dropped == 2
    assert "sharding_constraint" not in {u.eqn.primitive.name for u in run.graph.program.units}
    assert float(loss) == pytest.approx(want, rel=1e-12)


def test_a_plan_step_traces_inside_the_callers_jit_and_eval_shape():
    """The applied step sets its own mesh as jax's context while it runs; called under a
    trace (the caller's ``jax.jit``, or ``jax.eval_shape`` as scripts/bench_accuracy.py does)
    jax refuses ``set_mesh`` ("can only be used outside of `jax.jit`"), and every plan of the
    bench failed so. Under a trace the outer call's context stands; the numbers are the step's."""
    w = zoo.get("mlp", "tiny")
    graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    strategy = baselines(graph, TOPOLOGY)["megatron"]
    params, batch = w.init_params(jax.random.key(0)), w.make_batch(jax.random.key(1))
    step, sh = apply.sharded_train_step(graph, strategy, make_mesh(TOPOLOGY), w.optimizer,
                                        params=params, batch=batch, donate=False)
    args = (apply.device_put_global(params, sh.params),
            apply.device_put_global(w.optimizer.init(params), sh.opt_state),
            apply.device_put_global(batch, sh.batch))
    shapes = jax.eval_shape(step, *args)
    direct = step(*args)
    inside = jax.jit(lambda *a: step(*a))(*args)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), shapes) == jax.tree.map(
        lambda x: (x.shape, x.dtype), direct)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(inside), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- check and verify catch a scaled gradient under Adam ----------------------------------------


def _scale_one_leaf(monkeypatch, path: str, factor: float = 4.0) -> None:
    """A test-only hook: the applied step's gradient leaf at `path` times `factor` (what the
    depthwise convolution's wrong partitioning did), everything else untouched."""
    original = apply._value_and_grad

    def broken(check, shardings, allow_spatial):
        fn = original(check, shardings, allow_spatial)

        def scaled(params, batch, count):
            loss, grads = fn(params, batch, count)
            return loss, jax.tree_util.tree_map_with_path(
                lambda kp, g: g * factor if jax.tree_util.keystr(kp) == path else g, grads)

        return scaled

    monkeypatch.setattr(apply, "_value_and_grad", broken)


def test_check_fails_a_plan_that_scales_one_gradient_under_adam(monkeypatch, tmp_path):
    w = zoo.get("mlp", "tiny")
    graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    plan = Plan.make(graph, TOPOLOGY, baselines(graph, TOPOLOGY)["data-parallel"],
                     model_config="tiny")
    leaf = exactness.reading_operators(graph)
    path = graph.params[0].path
    _scale_one_leaf(monkeypatch, path)
    result = compare_on_devices(plan, w, repeats=1, costs="analytic")
    passed, lines = result.verdict()
    assert not passed
    assert lines[0].startswith("FAIL gradients") and path in lines[0] and leaf[0] in lines[0]
    assert result.gradients.worst.error == pytest.approx(3.0, rel=1e-5)
    # Adam's first update is the same for the gradient and 4x it: only the gradients show it
    g = jnp.linspace(-1.0, 1.0, 8)
    adam = optax.adam(1e-3)
    first = [adam.update(x, adam.init(g), g)[0] for x in (g, 4 * g)]
    np.testing.assert_allclose(first[0], first[1], rtol=1e-6)
    assert json.loads(json.dumps(result.to_json()))["gradients"]["passed"] is False


def test_verify_refuses_a_step_that_scales_one_gradient(monkeypatch):
    loss, params, batch = _conv_model("depthwise2d")
    with jax.enable_x64(True):
        ok = training.shard_training(loss, params, batch, optax.adam(1e-3), mesh="cpu8",
                                     strategy="data-parallel", verify=True,
                                     compiler_options=FAST)
        assert ok.step.count == 0  # verifying ran copies; the run's own step is untouched
        _scale_one_leaf(monkeypatch, "['conv']['kernel'].value")
        with pytest.raises(VerificationError, match=r"\['conv'\]\['kernel'\].*operator 'conv'"):
            training.shard_training(loss, params, batch, optax.adam(1e-3), mesh="cpu8",
                                    strategy="data-parallel", verify=True,
                                    compiler_options=FAST)


class _SmallFirstLayers(nn.Module):
    """``first``'s and ``pre``'s gradients about 1e-6 of the head bias's (``mid``'s kernel is
    tiny); ``pre``'s bias has none at all (the batch mean is taken out after it)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="pre")(x)
        h = nn.tanh(nn.Dense(32, name="first")(h - h.mean(0, keepdims=True)))
        h = nn.tanh(nn.Dense(32, kernel_init=nn.initializers.normal(1e-6), name="mid")(h))
        return nn.Dense(8, name="head")(h)


def _small_first_layers(dtype=None):
    """The model's loss; with `dtype`, its input and logits cast to it whatever theirs."""
    model = _SmallFirstLayers()
    kx, ky, kp = jax.random.split(jax.random.key(3), 3)
    batch = {"x": jax.random.normal(kx, (16, 24)), "y": jax.random.randint(ky, (16,), 0, 8)}
    params = model.init(kp, batch["x"])

    def loss_fn(params, batch):
        logits = model.apply(params, batch["x"] if dtype is None
                             else batch["x"].astype(dtype))
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(dtype or
                                                                         logits.dtype),
                                                               batch["y"]).mean()

    return loss_fn, params, batch


def test_a_small_real_gradient_scaled_by_a_third_fails_against_float64():
    """The model-wide floor (the largest gradient x 30 eps / bar) held a leaf whose gradient
    is real but a millionth of the largest to a thousandth of the floor: that gradient 1.3x
    passed. Against the float64 gradients each leaf has its own floor, what the float32
    unsharded step is off by there (x 30, over the bar): it fails by 0.3; the leaf whose
    true gradient is zero keeps the model-wide floor."""
    loss_fn, params, batch = _small_first_layers()
    graph = trace(loss_fn, params, batch, name="small_first_layers")
    loss, ref = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    scales = {jax.tree_util.keystr(k): float(jnp.abs(g).max())
              for k, g in jax.tree_util.tree_leaves_with_path(ref)}
    assert scales["['params']['first']['kernel']"] < 1e-5 * max(scales.values())
    got = jax.tree_util.tree_map_with_path(
        lambda k, g: 1.3 * g if jax.tree_util.keystr(k) == "['params']['first']['kernel']"
        else g, ref)
    exact = exactness.float64_reference(loss_fn, graph, space.data_parallel(
        graph, MeshShape(("data",), (1,))), params, batch)
    assert exact is not None
    kw = dict(tolerance=rounding_tolerance(graph), computed_in="float32")
    assert compare_gradients(loss, got, loss, ref, **kw).passed  # the floor alone: passes
    bad = compare_gradients(loss, got, loss, ref, truth=exact, **kw)
    assert not bad.passed and bad.float64 and "against float64" in bad.describe()
    assert bad.worst.path == "['params']['first']['kernel']"
    assert bad.worst.error == pytest.approx(0.3, rel=1e-3)
    ok = compare_gradients(loss, ref, loss, ref, truth=exact, **kw)
    assert ok.passed and ok.max_error < 1e-5
    assert [ok.leaves[k].path for k in ok.noise_leaves] == ["['params']['pre']['bias']"]


def test_check_holds_small_gradients_of_a_megatron_step_to_their_own_scale(monkeypatch):
    """`first_step` on ``cpu8`` under Megatron (the float32 step, sharded for real): the
    small gradients pass against float64, each leaf but the zero one held to its own
    scale; the same step with one of them 1.3x fails, naming it."""
    loss_fn, params, batch = _small_first_layers()
    graph = trace(loss_fn, params, batch, name="small_first_layers")
    strategy = baselines(graph, TOPOLOGY)["megatron"]
    run = lambda: first_step(graph, strategy, make_mesh(TOPOLOGY), loss_fn, params, batch,  # noqa: E731
                             mesh_shape=MESH_SHAPE, compiler_options=FAST)
    ok = run()
    assert ok.passed and ok.float64, ok.describe()
    assert [ok.leaves[k].path for k in ok.noise_leaves] == ["['params']['pre']['bias']"]
    _scale_one_leaf(monkeypatch, "['params']['pre']['kernel']", 1.3)
    bad = run()
    assert not bad.passed and bad.worst.path == "['params']['pre']['kernel']", bad.describe()


def test_a_loss_that_fixes_float32_somewhere_keeps_the_model_wide_floor():
    """A loss with a value it computes in float32 whatever its inputs (``astype``) has no
    float64 truth (its gradients would round as the float32 ones do): `float64_reference`
    says so, and the comparison keeps the one floor."""
    loss_fn, params, batch = _small_first_layers(jnp.float32)
    graph = trace(loss_fn, params, batch, name="small_first_layers_f32")
    assert exactness.float64_reference(loss_fn, graph, space.data_parallel(
        graph, MeshShape(("data",), (1,))), params, batch) is None


def test_a_layer_equation_dead_in_all_but_the_last_layer_stays_in_every_layer():
    """A carry each layer overwrites without reading (the last layer's attention statistics,
    say) is live only in the last layer: every layer keeps the equation, so the layers keep one
    body and a pipeline can cut them; the gradients are jax.grad's."""
    import flax.linen as nn

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, carry, _):
            x, _stat = carry
            y = jnp.tanh(nn.Dense(8, param_dtype=jnp.float64)(x))
            return (x + y, jnp.max(y, axis=-1)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=4)
            (x, stat), _ = scan()((x, jnp.zeros(x.shape[:1], x.dtype)), None)
            return jnp.sum(x ** 2) + jnp.sum(stat)

    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (8, 8), jnp.float64)
        model = Model()
        params = model.init(jax.random.key(1), x)

        def loss(p, b):
            return model.apply(p, b["x"])

        graph = trace(loss, params, {"x": x})
        names = [u.eqn.primitive.name for u in graph.program.units]
        assert names.count("reduce_max") == 4  # one per layer, though three are dead
        c = first_step(graph, space.data_parallel(graph, MESH_SHAPE), make_mesh(TOPOLOGY), loss,
                       params, {"x": x}, compiler_options=FAST)
    assert c.max_error <= X64, c.describe()


def test_resnet18_split_across_two_later_operators_keeps_an_earlier_kernel_gradient():
    """The randomized suite's first find, shrunk (`scripts/fuzz_exactness.py`, seed 27 on
    cpu8-nodes): ResNet-18 with one BatchNorm's batch over `model` and channels over `node` and
    `data`, and the next stage's projection convolution's batch over `data`, output channels
    over `model` and input channels over `node`, everything else replicated. Left to XLA's
    partitioner, stage2_block1/Conv_1's kernel gradient was 2.57 of its scale off; every
    convolution now runs in `jax.shard_map` (`soapjax.apply._manual`)."""
    import fuzzing

    topology = load_topology(str(Path(__file__).resolve().parent / "meshes" / "cpu8-nodes.toml"))
    s = fuzzing.subject("corpus:resnet18")
    strategy = space.Strategy(tuple(Config.replicated(op) for op in s.graph.operators))
    for name, axes in {"stage2_block2/BatchNorm_1": (("model",), (), (), ("node", "data")),
                       "stage3_block1/proj_conv": (("data",), (), (), ("model",), ("node",))
                       }.items():
        strategy = strategy.replace(s.graph.index(name), Config(axes))
    out = fuzzing.check(s, strategy, topology)
    assert out.comparison is not None, out.refused
    assert out.comparison.max_error <= X64, out.comparison.describe()


def test_a_cotangent_moving_an_axis_between_dims_is_left_to_xla():
    """The randomized suite's second find, shrunk (seed 1111 on cpu8): nnx_scan_transformer
    with every layer's value projection's sequence over `data` and heads over `model`, and the
    attention output's queries over `model` and heads over `data`. The value's cotangent, a
    partial sum over `model`, was constrained into the projection's layout (the heads'
    `data` moving to the sequence): both of XLA's partitioners then computed the value kernel's
    gradient wrong (0.998 of its scale). Such a cotangent is now constrained only where it
    reaches the producer's layout by a reduce-scatter alone (`soapjax.apply._flatstep`)."""
    import fuzzing

    s = fuzzing.subject("corpus:nnx_scan_transformer")
    splits = {"attn/value": (((), ("data",), ("model",), (), ())),
              "dot_general_1": (((), ("model",), ("data",), (), ()))}
    strategy = space.Strategy(tuple(Config.replicated(op) for op in s.graph.operators))
    for j, op in enumerate(s.graph.operators):
        for suffix, axes in splits.items():
            if op.name.endswith("/" + suffix):
                strategy = strategy.replace(j, Config(axes))
    out = fuzzing.check(s, strategy, TOPOLOGY)
    assert out.comparison is not None, out.refused
    assert out.comparison.max_error <= X64, out.comparison.describe()


def test_xla_still_computes_a_partly_scattered_partial_sum_wrongly():
    """The canary of `soapjax.simulate._flatsim.scatter_target`'s rule: a contraction split over two
    axes (node, model) whose result is constrained to split the batch over data and one of them
    (a reduce-scatter over model, an all-reduce over node) gives wrong attention weights under
    both of XLA's partitioners (jax 0.10.2); over one axis, or scattered over both, it is
    right. The day this fails, XLA fixed it."""
    mesh = jax.make_mesh((2, 2, 2), ("node", "data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)

    def f(q, k, rsplit, target):
        if rsplit is not None:
            q = jax.lax.with_sharding_constraint(q, NamedSharding(mesh, P("data", None, None,
                                                                          rsplit)))
            k = jax.lax.with_sharding_constraint(k, NamedSharding(mesh, P("data", None, None,
                                                                          rsplit)))
        s = jax.lax.dot_general(q, k, (([3], [3]), ([0, 2], [0, 2])))
        if target is not None:
            s = jax.lax.with_sharding_constraint(s, NamedSharding(mesh, P(target)))
        return jax.nn.softmax(s, axis=-1)

    with jax.enable_x64(True):
        q, k = (jax.random.normal(key, (8, 17, 4, 8), jnp.float64)
                for key in jax.random.split(jax.random.key(0)))
        want = f(q, k, None, None)
        run = jax.jit(f, static_argnums=(2, 3))
        wrong = float(jnp.max(jnp.abs(run(q, k, ("node", "model"), ("data", "model")) - want)))
        right = float(jnp.max(jnp.abs(run(q, k, "model", ("data", "model")) - want)))
    assert wrong > 0.1 and right < 1e-12


def test_vit_with_a_partly_scattered_attention_score_is_exact():
    """The randomized suite's find, shrunk (seed 2473 on cpu8-nodes): ViT's attention scores
    with the head dim (contracted) over node and model, their readers' batch over data and
    model; scattered over `model` alone, the scores came out wrong (loss 7.6e-4 off)."""
    import fuzzing

    topology = load_topology(str(Path(__file__).resolve().parent / "meshes" / "cpu8-nodes.toml"))
    s = fuzzing.subject("corpus:vit")
    strategy = space.Strategy(tuple(Config.replicated(op) for op in s.graph.operators))
    for layer in ("0", "1"):
        for name, axes in ((f"encoder/{layer}/attention/attention/dot_general",
                            (("data",), (), (), (), ("node", "model"))),
                           (f"encoder/{layer}/attention/attention/dot_general_1",
                            (("data", "model"), (), ("node",), ()))):
            strategy = strategy.replace(s.graph.index(name), Config(axes))
    out = fuzzing.check(s, strategy, topology)
    assert out.comparison is not None, out.refused
    assert out.comparison.max_error <= X64, out.comparison.describe()


def test_moe_with_a_cotangent_scattered_into_two_dims_is_exact():
    """The randomized suite's find, shrunk (seed 10754 on cpu8-nodes): the tiny MoE's norm laid
    out with the batch over data and model and the sequence over node, read by the token
    dispatch with the batch over data and its groups over node and model. The dispatch's
    cotangent, a partial sum over node and model, constrained straight to the norm's layout
    (model reduce-scattered into the batch, node into the sequence) made the norm's scale
    gradient 0.43 of its scale off; a reduce-scatter into one dim only is constrained so."""
    _assert_exact_on_nodes("zoo:moe:tiny", {
        "/moe_norm": Config((("data", "model"), ("node",), ())),
        "/moe/dot_general_3": Config(((), ("data",), ("node", "model"), (), ()))})


def _assert_exact_on_nodes(subject: str, configs: dict[str, Config]) -> None:
    """The randomized suite's `subject` on cpu8-nodes under data parallelism but for the
    operators whose names end with a key of `configs` (that config): every gradient leaf
    within float64's bar of its own scale."""
    import fuzzing

    topology = load_topology(str(Path(__file__).resolve().parent / "meshes" / "cpu8-nodes.toml"))
    s = fuzzing.subject(subject)
    strategy = space.data_parallel(s.graph, MeshShape.of(topology))
    for op in s.graph.operators:
        for suffix, config in configs.items():
            if op.name.endswith(suffix):
                strategy = strategy.replace(s.graph.index(op.name), config)
    out = fuzzing.check(s, strategy, topology)
    assert out.comparison is not None, out.refused
    assert out.comparison.max_error <= X64, out.comparison.describe()


def test_gqa_with_a_cotangent_scattered_over_some_of_its_partial_axes_is_exact():
    """The randomized suite's find, shrunk (seed 2026120155 on cpu8-nodes): the corpus GQA
    decoder's value projection with the batch over node and data, read by the attention's
    probabilities-times-values matmul with the batch over node and the queries over data and
    model. The values' cotangent, a partial sum over data and model, constrained straight to
    the projection's layout (data reduce-scattered into the batch, model left to an
    all-reduce) made the projection's kernel gradient 0.73 of its scale off; it is
    constrained so only where every partial axis is scattered."""
    _assert_exact_on_nodes("corpus:gqa_decoder", {
        "/attn/v": Config((("node", "data"), (), (), (), ())),
        "/attn/dot_general_1": Config((("node",), ("data", "model"), (), (), ()))})


def test_xla_still_miscomputes_a_cotangent_scattered_over_some_of_its_partial_axes():
    """The XLA behaviour above in plain JAX (docs/xla-workarounds.md), the canary that says
    when the workaround may go: a GQA attention's values [B, S, K, H] made with the batch over
    node and data, the probabilities [B, N, T, S] with the batch over node and the queries
    over data and model, the values' cotangent constrained to their own layout in the
    backward (a custom_vjp, as apply constrains it). Both partitioners, jax 0.10.2: the
    value kernel's gradient 1.01 of its scale off; every partial axis scattered (the batch
    over node, data and model), exact."""
    import functools

    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("node", "data", "model"))

    def constrain(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def operand(x, spec, back):
        return constrain(x, *spec)

    operand.defvjp(lambda x, spec, back: (operand(x, spec, back), None),
                   lambda spec, back, _, ct: (constrain(ct, *back),))
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((8, 8, 32)))
        kernel = jnp.asarray(rng.standard_normal((32, 2, 8)))
        probs = jnp.asarray(rng.standard_normal((8, 4, 8, 8)))

        def loss(kernel, made):
            v = jnp.einsum("BTD,DKH->BTKH", x, kernel)
            if made is not None:
                v = operand(constrain(v, made), ("node",), (made,))
            p = constrain(probs, "node", None, ("data", "model")) if made is not None else probs
            return jnp.sum(jnp.einsum("BNTS,BSNH->BTNH", p, jnp.repeat(v, 2, axis=2)) ** 2)

        grad = jax.jit(jax.grad(loss), static_argnums=1)
        want = grad(kernel, None)

        def error(made):
            return float(jnp.max(jnp.abs(grad(kernel, made) - want)) / jnp.max(jnp.abs(want)))

        assert error(("node", "data")) > 0.5  # some partial axes scattered: wrong
        assert error(("node", "data", "model")) < 1e-12  # every one: exact


def test_the_reference_of_coupled_samples_splits_microbatches_as_apply_does():
    """Where a graph accepts statistics per microbatch (the zoo's MoE: its load-balancing loss
    is a mean times a mean over the microbatch's tokens), the reference step is the mean of
    the microbatches' own steps, microbatch ``k`` holding samples ``k, k + M, ...`` as
    `soapjax.apply` splits them (the flat step and the pipeline alike). It split them into
    contiguous blocks, another loss: `soapjax check` of a tiny MoE pipeline (TP1 PP2, 2
    microbatches) read a 6e-4 difference, now 5e-7."""
    import dataclasses

    from soapjax.graph.opgraph import trace
    from soapjax.strategy.space import Strategy
    from soapjax_zoo import moe

    cfg = dataclasses.replace(moe.MOE_CONFIGS["tiny"], param_dtype="float64")
    w = moe.build_moe("moe", "tiny-x64", cfg, "linen")
    with jax.enable_x64(True):
        params = w.init_params(jax.random.key(0))
        batch = w.make_batch(jax.random.key(1))
        g = trace(w.loss_fn, params, batch, name="moe")
        assert g.microbatch_statistics and g.sample_coupling
        m = 2
        strategy = dataclasses.replace(Strategy(()), microbatches=m)
        loss, grads = exactness.reference_value_and_grad(w.loss_fn, g, strategy)(params, batch)

        def strided(p):
            return sum(w.loss_fn(p, jax.tree.map(lambda x: x[k::m], batch))
                       for k in range(m)) / m

        want_loss, want = jax.value_and_grad(strided)(params)
        half = jax.tree.leaves(batch)[0].shape[0] // m
        blocks = sum(w.loss_fn(params, jax.tree.map(lambda x: x[k * half:(k + 1) * half],
                                                    batch))
                     for k in range(m)) / m
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-12)
    assert exactness.compare_gradients(loss, grads, want_loss, want, tolerance=1e-12).passed
    assert abs(float(blocks) - float(want_loss)) > 1e-6  # the split matters here


def test_fnet_under_microbatches_with_its_norm_split_runs_exact():
    """The randomized suite's find on the corpus FNet, shrunk (seed 2026120424 of an outside
    FNet on cpu8): 2 microbatches, the first mixing norm's batch over data and features over
    model, every other operator whole. XLA:CPU gave the FFT in the microbatch loop's body a
    layout its FFT cannot run (a runtime RET_CHECK: no step at all); apply unrolls the loop
    of a graph with an FFT on CPU devices."""
    import fuzzing

    s = fuzzing.subject("corpus:fnet")
    strategy = space.Strategy(tuple(Config.replicated(op) for op in s.graph.operators))
    strategy = strategy.with_microbatches(2).replace(s.graph.index("blocks_0/mix_norm"),
                                                     Config((("data",), (), ("model",))))
    out = fuzzing.check(s, strategy, TOPOLOGY)
    assert out.comparison is not None, out.refused or out.crashed
    assert out.comparison.max_error <= X64, out.comparison.describe()


def test_a_platform_dependent_index_joins_the_cond_that_reads_it():
    """The randomized suite's find on the corpus's deep-kernel GP (seed 15 on cpu8-nodes),
    shrunk: `jnp.diag` picks its implementation by a `cond` on `platform_index`, an equation of
    no operands that was an operator of its own. Recomputed after a recomputed `y @ alpha`, its
    index reached the `cond` with a materialised float0 tangent, and JAX's linearisation of
    `cond` asserts there is none (an AssertionError without a message: no step). It is a cheap
    equation now, folded into the operator that reads it."""
    import dataclasses

    import fuzzing

    s = fuzzing.subject("corpus:deep_kernel_gp")
    names = [op.name for op in s.graph.operators]
    assert "platform_index" not in names and any(
        op.anchor == "cond" for op in s.graph.operators), names
    strategy = space.Strategy(tuple(Config.replicated(op) for op in s.graph.operators))
    recompute = ["none"] * len(names)
    recompute[-2:] = ["selective", "full"]  # y @ alpha, then the loss with its diag
    out = fuzzing.check(s, dataclasses.replace(strategy, recompute=tuple(recompute)), TOPOLOGY)
    assert out.comparison is not None, out.refused or out.crashed
    assert out.comparison.max_error <= X64, out.comparison.describe()


def test_xla_cpu_at_level_0_still_loses_a_max_pools_gradient():
    """The canary of `corpus.Entry.exact_compile` (docs/xla-workarounds.md): PointNet's shared
    MLP, two layers of a batch norm with a scale and a bias (as flax's, the variance clipped at
    zero) and a ReLU, pooled by a max over the points. Jax differentiates the max by comparing
    the input with the pooled value; XLA:CPU at ``xla_backend_optimization_level=0`` (the
    suite's, for speed) computes the two apart and the gradient below the pool comes out
    wrong, in `jax.jit` alone, while level 1 agrees with the unjitted gradient (this small
    program shows it with XLA's fusion emitters; PointNet itself with the suite's older
    emitter too). When this fails, XLA computes it right: see whether PointNet still needs
    its ``exact_compile``."""
    def layer(h, kernel):
        h = h @ kernel
        mean, sq = h.mean((0, 1)), (h * h).mean((0, 1))
        var = jnp.maximum(0.0, sq - mean * mean)
        return jax.nn.relu((h - mean) * (jax.lax.rsqrt(var + 1e-5) * 1.1) + 0.1)

    def loss(w):
        h = layer(layer(x, w["w1"]), w["w2"]).max(axis=1)
        return jax.nn.log_softmax(h @ w["w3"])[:, 0].mean()

    with jax.enable_x64(True):
        k = jax.random.split(jax.random.key(0), 8)
        x = jax.random.normal(k[0], (8, 16, 3))
        w = {"w1": jax.random.normal(k[1], (3, 16)),
             "w2": 0.3 * jax.random.normal(k[3], (16, 32)),
             "w3": 0.3 * jax.random.normal(k[4], (32, 8))}
        got = {level: jax.jit(jax.grad(loss), compiler_options={
            "xla_backend_optimization_level": level, "xla_cpu_use_fusion_emitters": True})(w)
               for level in (0, 1)}
        err = {level: max(float(jnp.abs(g[n] - got[1][n]).max() / jnp.abs(got[1][n]).max())
                          for n in ("w1", "w2")) for level, g in got.items()}
    assert err[0] > 0.1, err


def test_xla_still_gathers_an_fft_split_along_its_batch():
    """`jnp.fft.fft` along the last axis of ``[8, 16, 32]`` split over `data` along the batch
    alone, input and output held there, compiles to an all-gather of the whole transform (XLA
    computes it whole on every device), and the simulator prices it so
    (`soapjax.graph._cuts.fft_gathers`; the corpus Hyena's plan read 0.65 of XLA's collective
    bytes before, docs/xla-workarounds.md). Keeping an FFT's operator whole would save the
    gathers, but XLA:CPU's FFT then failed in FNet's backward under a norm splitting its
    tokens, so it is not done; when this fails, XLA partitions an FFT's batch, and
    `fft_gathers` prices gathers it no longer makes."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    split = NamedSharding(mesh, P("data"))
    x = jax.device_put(jnp.ones((8, 16, 32)), split)
    text = jax.jit(lambda x: jnp.fft.fft(x, axis=-1).real, in_shardings=split,
                   out_shardings=split).lower(x).compile().as_text()
    assert any("all-gather(" in line and "c64[8,16,32]" in line for line in text.splitlines())


_FFT_CANARY = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
jax.config.update("jax_enable_x64", True)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 6, 16)))
w = jnp.asarray(np.random.default_rng(1).standard_normal((16, 16)))
def c(v, *spec):
    return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P(*spec)))
def mixed(w, x, spec):  # the FFT's input split along the tokens, a transform dim
    h = c(x @ w, *spec) if spec is not None else x @ w
    return jnp.sum(jnp.tanh(jnp.fft.fft2(h, axes=(-2, -1)).real))
def block(w, x, norm):  # an FNet block, the norm's layout another than the FFT's
    h = c(x @ w) if norm is not None else x @ w
    y = h + jnp.fft.fft2(h, axes=(-2, -1)).real
    y = c(c(y), *norm) if norm is not None else y
    y = (y - y.mean(-1, keepdims=True)) / jnp.sqrt(y.var(-1, keepdims=True) + 1e-6)
    return jnp.sum(jnp.tanh(c(y) if norm is not None else y))
def looped(w, x, unroll):  # over 2 microbatches, samples k, k + 2, ... as apply takes them
    def body(acc, xm):
        return acc + jax.grad(block)(w, xm, ("data", None, "model")), None
    xs = x.reshape(4, 2, 6, 16).swapaxes(0, 1)
    return jax.lax.scan(body, jnp.zeros_like(w), xs, unroll=unroll)[0]
for name, fn, want in (
        ("split", lambda w, x: jax.grad(mixed)(w, x, (None, "model")),
         jax.grad(mixed)(w, x, None)),
        ("looped", lambda w, x: looped(w, x, 1), jax.grad(block)(w, x, None)),
        ("unrolled", lambda w, x: looped(w, x, True), jax.grad(block)(w, x, None))):
    try:
        got = jax.block_until_ready(jax.jit(fn)(w, x))
        print(name, "error", float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))))
    except Exception as e:
        print(name, "failed", "RET_CHECK" in str(e) and "fft" in str(e))
"""


def test_xla_cpu_still_cannot_run_an_fft_split_or_resharded_in_a_loop():
    """The canary of the two FFT rules (docs/xla-workarounds.md), in plain JAX in a process of
    its own (XLA aborts the process at exit after such a failure): an FFT whose transform dim
    is split, and an FFT in a loop whose result is resharded (the FNet above's 2 microbatches),
    fail at run time on XLA:CPU (jax 0.10.2); the loop unrolled runs, exact."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", _FFT_CANARY], env=env, capture_output=True,
                         text=True, timeout=300)
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert lines.get("split") == "failed True", run.stdout + run.stderr[-2000:]
    assert lines.get("looped") == "failed True", run.stdout + run.stderr[-2000:]
    assert float(lines["unrolled"].split()[1]) < 1e-12


def _bf16_head():
    """An embedding, a ReLU layer and a head over 1,001 classes in bfloat16 (parameters and
    compute), the labels all 0: the head bias's gradient at class 0 is the mean of 192 equal
    terms, which the unsharded step accumulates in bfloat16 about 10 % off."""
    class Head(nn.Module):
        @nn.compact
        def __call__(self, t):
            kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16}
            head = nn.Dense(1001, name="head", **kw)
            h = nn.Embed(1001, 32, **kw)(t)
            return head(jax.nn.relu(nn.Dense(64, **kw)(h)))

    model = Head()
    tokens = jax.random.randint(jax.random.key(1), (24, 8), 0, 1001)
    batch = {"t": tokens, "y": jnp.zeros((24, 8), jnp.int32)}
    params = model.init(jax.random.key(0), tokens)

    def loss_fn(params, batch):
        logp = jax.nn.log_softmax(model.apply(params, batch["t"]))
        return -jnp.take_along_axis(logp, batch["y"][..., None], -1).mean()

    return loss_fn, params, batch


def test_a_bfloat16_models_gradients_are_held_against_its_widened_step(monkeypatch):
    """`first_step` of a model in bfloat16 throughout, data parallel on ``cpu8``: its own
    gradients fail the bar (the unsharded step's head bias at class 0 is the farther from the
    exact -0.999), so both are held against the step with its bfloat16 values widened to
    float32 (`widened_reference`): the sharded one passes; with one leaf doubled it fails,
    naming it."""
    loss_fn, params, batch = _bf16_head()
    graph = trace(loss_fn, params, batch, name="bf16_head")
    strategy = baselines(graph, TOPOLOGY)["data-parallel"]
    run = lambda: first_step(graph, strategy, make_mesh(TOPOLOGY), loss_fn, params, batch,  # noqa: E731
                             mesh_shape=MESH_SHAPE)
    exact = exactness.widened_reference(loss_fn, graph, strategy, params, batch)
    unsharded = float(jax.jit(jax.grad(loss_fn))(params, batch)["params"]["head"]["bias"][0])
    assert float(exact["params"]["head"]["bias"][0]) == pytest.approx(-0.999, abs=2e-3)
    assert abs(unsharded + 0.999) > 0.05  # bfloat16's own accumulation
    ok = run()
    assert ok.passed and ok.widened and "2-byte floats widened" in ok.describe(), ok.describe()
    _scale_one_leaf(monkeypatch, "['params']['head']['kernel']", 2.0)
    bad = run()
    assert not bad.passed and bad.worst.path == "['params']['head']['kernel']", bad.describe()


def test_widened_runs_a_bfloat16_program_in_float32():
    """`exactness.widened`: a bfloat16 function (a scan, a cond, a scatter-add, relu's custom
    derivative, differentiated) runs as the same function written in float32."""
    def make(dtype):
        def f(w, x):
            def body(c, xi):
                y = jax.lax.cond(xi.sum() > 0, jnp.tanh, jax.nn.relu, xi * w + c)
                return y, y.sum()
            c, ys = jax.lax.scan(body, jnp.zeros_like(w), x)
            return jnp.zeros(8, dtype).at[jnp.arange(32) % 8].add(c).sum() + ys.sum()
        return lambda w, x: jax.value_and_grad(f)(w.astype(dtype), x.astype(dtype))
    w = jax.random.normal(jax.random.key(0), (32,)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (5, 32)).astype(jnp.bfloat16)
    wide = exactness.widened(make(jnp.bfloat16))(w, x)
    f32 = jax.jit(make(jnp.float32))(w, x)
    assert wide[1].dtype == jnp.float32
    for a, b in zip(jax.tree.leaves(wide), jax.tree.leaves(f32)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    narrow = jax.jit(make(jnp.bfloat16))(w, x)
    assert not np.allclose(np.asarray(narrow[1], np.float32), np.asarray(f32[1]), rtol=1e-6)
