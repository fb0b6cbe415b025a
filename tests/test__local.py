"""soapjax.graph._local: shard programs keep custom derivative rules (never a silent primal)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from soapjax.cost.flops import step_flops
from soapjax.exactness import first_step
from soapjax.graph._local import CustomRuleError, has_custom_rules, operator_fn
from soapjax.graph.opgraph import trace
from soapjax.strategy import space
from soapjax.strategy.space import MeshShape, data_parallel
from soapjax.topology.cluster import load_topology, make_mesh


@jax.custom_vjp
def ste_round(x):
    return jnp.round(x)


ste_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))


@jax.custom_jvp
def relu(x):
    return jnp.maximum(x, 0.0)


relu.defjvp(lambda p, t: (relu(p[0]), jnp.where(p[0] > 0, t[0], 0.0)))


def ste_loss(params, batch):
    return jnp.sum(ste_round(batch @ params["w"]) ** 2)


def relu_loss(params, batch):  # relu at exactly 0: the rule says 0, max's tie rule says 1/2
    return jnp.sum(relu(batch @ params["w"]))


def _graph_and_env(loss, params, batch):
    g = trace(loss, params, batch)
    env = dict(zip([leaf.value for leaf in g.params + g.batch], jax.tree.leaves((params, batch))))
    return g, env


def _replace_all(g, **kw):
    return {op.name: operator_fn(g, op.name, **kw)[0]
            for op in g.operators if g.replaceable(op.name)}


@pytest.mark.parametrize("loss", [ste_loss, relu_loss], ids=["custom_vjp-ste", "custom_jvp-relu"])
def test_whole_operator_programs_keep_custom_rules(loss):
    params = {"w": jnp.eye(4) * 0.5}
    batch = jnp.asarray([[1.0, -2.0, 0.0, 3.0]] * 8) * jnp.arange(8.0)[:, None] / 3
    g, _ = _graph_and_env(loss, params, batch)
    assert any(has_custom_rules(g, op.name) for op in g.operators)
    replaced = _replace_all(g)
    assert replaced, "the operator holding the rule is computed by its own program"

    def via_programs(p, b):
        return g.evaluate(*jax.tree.leaves(p), *jax.tree.leaves(b), replace=replaced)

    want = jax.grad(loss)(params, batch)
    got = jax.grad(via_programs)(params, batch)
    np.testing.assert_array_equal(got["w"], want["w"])


def test_straight_through_gradient_is_the_identity_rule():
    params = {"w": jnp.eye(4) * 0.3}
    batch = jnp.arange(32.0).reshape(8, 4) / 7
    g, _ = _graph_and_env(ste_loss, params, batch)
    replaced = _replace_all(g)
    got = jax.grad(lambda p, b: g.evaluate(p["w"], b, replace=replaced))(params, batch)["w"]
    h = batch @ params["w"]
    np.testing.assert_allclose(got, batch.T @ (2 * jnp.round(h)), rtol=1e-6)
    assert float(jnp.abs(got).max()) > 1  # the primal (round) would give exactly 0


def test_split_custom_rule_is_refused_or_priced_as_primal():
    params = {"w": jnp.eye(4)}
    batch = jnp.ones((8, 4))
    g, env = _graph_and_env(ste_loss, params, batch)
    op = next(op for op in g.operators if has_custom_rules(g, op.name))
    degrees = tuple(2 if s == 8 else 1 for s in op.iteration_sizes)  # the batch dim (an R here)
    fn, avals = operator_fn(g, op.name, degrees)
    with pytest.raises(CustomRuleError, match="custom_vjp_call.*traced for"):
        jax.eval_shape(fn, *avals)
    fn, avals = operator_fn(g, op.name, degrees, rules="primal")  # the cost stage's timing
    assert [a.shape for a in avals] == [(4, 4), (4, 4)]
    assert jax.eval_shape(fn, *avals)[0].shape == ()


# --- library-style models (issue 29): literals, reshapes to heads ----------------------------


def masked_log_softmax_loss(p, b):
    """An additive attention mask built as encoder libraries build it: `jnp.full` fills whose
    scalar fill values are jaxpr literals (jax 0.10's `TypedFloat`, no ``.shape``)."""
    h = b["x"] @ p["w"]
    bias = jax.lax.select(b["m"] > 0, jnp.full(b["m"].shape, 0.0), jnp.full(b["m"].shape, -1e9))
    return jnp.mean(jax.nn.log_softmax(h + bias))


def test_a_literal_broadcast_builds_at_every_split():
    p = {"w": jnp.ones((32, 16))}
    b = {"x": jnp.ones((8, 32)), "m": jnp.ones((8, 16), jnp.int32)}
    g = trace(masked_log_softmax_loss, p, b)
    (op,) = g.operators
    for degrees in [(1,) * len(op.iteration_sizes), (8, 1, 1), (2, 4, 1), (1, 1, 4)]:
        if len(degrees) != len(op.iteration_sizes):
            continue
        fn, avals = operator_fn(g, op.name, degrees, rules="primal")
        (out,) = jax.eval_shape(fn, *avals)
        assert out.shape == (), degrees


def test_the_literal_mask_step_counts_its_flops():
    p = {"w": jnp.ones((32, 16))}
    b = {"x": jnp.ones((8, 32)), "m": jnp.ones((8, 16), jnp.int32)}
    g = trace(masked_log_softmax_loss, p, b)
    mesh = MeshShape.of(load_topology("cpu8"))
    flops = step_flops(g, data_parallel(g, mesh), mesh)
    # the forward matmul alone: 2 * 8 * 32 * 16 multiply-adds over 8 devices
    assert flops.forward >= 2 * 8 * 32 * 16 / 8 and flops.backward > 0


class _FusedHeads(nn.Module):
    """Llama-style projections: plain Dense layers reshaped to heads after the matmul, 8 query
    heads over 4 key/value heads (each repeated for its group of 2)."""

    @nn.compact
    def __call__(self, x):
        B, T, _ = x.shape
        q = nn.Dense(8 * 16, use_bias=False, name="q")(x).reshape(B, T, 8, 16)
        k = nn.Dense(4 * 16, use_bias=False, name="k")(x).reshape(B, T, 4, 16)
        v = nn.Dense(4 * 16, use_bias=False, name="v")(x).reshape(B, T, 4, 16)
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        s = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), -1)
        o = jnp.einsum("bnts,bsnh->btnh", s, v).reshape(B, T, 128)
        return nn.Dense(64, use_bias=False, name="o")(o)


def _fused_heads_graph():
    model = _FusedHeads()
    x = jnp.ones((8, 16, 64))
    params = model.init(jax.random.key(0), x)
    return trace(lambda p, b: jnp.mean(model.apply(p, b["x"]) ** 2), params, {"x": x})


def test_projections_reshaped_to_heads_build_at_every_split():
    """Every config of every operator builds, its outputs at their shard shapes (measured costs
    fell back to estimates for 31 of them: a reshape to heads after the matmul did not split
    the matmul's output with the heads)."""
    g = _fused_heads_graph()
    mesh = MeshShape.of(load_topology("cpu8"))
    for op in g.operators:
        for degrees in sorted({c.degrees(mesh) for c in space.configs(op, mesh)}):
            fn, avals = operator_fn(g, op.name, degrees, rules="primal")
            got = [tuple(o.shape) for o in jax.eval_shape(fn, *avals)]
            want = [tuple(s // (degrees[d] if d is not None else 1)
                          for s, d in zip(t.shape, t.dims)) for t in op.outputs]
            assert got == want, (op.name, degrees)


def test_a_projection_reshaped_to_heads_is_split_by_heads():
    """The query projection's heads are a parameter dim: its weight's output features follow
    the heads (a head's columns are contiguous), and splitting heads and head dims splits the
    weight's columns by both in its shard program."""
    g = _fused_heads_graph()
    q = g.operator("q")
    assert q.iteration_roles[:4] == ("S", "A", "P", "A")
    (w,) = [o for o in q.inputs if o.kind == "param"]
    assert w.dims == (4, 2)  # (input features: the reduction, output features: the heads)
    _, avals = operator_fn(g, "q", (1, 1, 2, 4, 1), rules="primal")
    assert [a.shape for a in avals] == [(8, 16, 64), (64, 16)]


@pytest.mark.parametrize("strategy", ["data-parallel", "megatron", "fsdp"])
def test_the_literal_mask_step_trains_as_the_unsharded_step(strategy):
    """The issue's snippet: the step crashed under every strategy (``'TypedFloat' object has
    no attribute 'shape'``). In float64, one SGD step equals the unsharded one."""
    import optax

    from soapjax import training

    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        p = {"w": jnp.asarray(rng.standard_normal((32, 16)))}
        b = {"x": jnp.asarray(rng.standard_normal((8, 32))),
             "m": jnp.asarray(rng.random((8, 16)) > 0.3, jnp.int32)}
        run = training.shard_training(masked_log_softmax_loss, p, b, optax.sgd(1.0),
                                      mesh="cpu8", strategy=strategy)
        after, _, loss = run.step(run.params, run.opt_state, run.shard_batch(b))
        want_loss, want_grad = jax.value_and_grad(masked_log_softmax_loss)(p, b)
        assert float(loss) == pytest.approx(float(want_loss), rel=1e-12)
        np.testing.assert_allclose(np.asarray(p["w"]) - np.asarray(after["w"]), want_grad["w"],
                                   rtol=0, atol=1e-12 * float(jnp.max(jnp.abs(want_grad["w"]))))


class _ConvEnsemble(nn.Module):
    """An ensemble of convolutional heads by `nn.vmap` over the parameters (the input
    broadcast): JAX batches a convolution with batched weights into one grouped convolution,
    reading its operands through ``reshape(x, sizes, dimensions=(1, 2, 0, 3))``, a reshape
    that transposes first."""

    @nn.compact
    def __call__(self, x):
        def head(mdl, x):
            h = nn.relu(nn.Conv(8, (1,), name="mix")(x))
            return nn.Conv(4, (1,), name="out")(h)
        heads = nn.vmap(lambda mdl, x: head(mdl, x), variable_axes={"params": 0},
                        split_rngs={"params": True}, in_axes=None, out_axes=0, axis_size=4)
        return heads(self, x)


def _ensemble_case():
    model = _ConvEnsemble()
    x = jax.random.normal(jax.random.key(1), (8, 6, 8), jnp.zeros(()).dtype)
    params = model.init(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(2), a.shape,
                                                               a.dtype), params)
    return lambda p, b: jnp.mean(jnp.tanh(model.apply({"params": p}, b["x"])) ** 2), params, \
        {"x": x}


@pytest.mark.parametrize("strategy", ["replicated", "data-parallel"])
def test_a_reshape_that_transposes_first_is_computed_so(strategy):
    """A reshape with ``dimensions`` (vmap's grouped convolution of an ensemble's heads) was
    computed as a plain reshape in operator programs: with nothing split, the loss was 7 %
    off and every gradient wrong, silently. In float64 on `cpu8`, the loss and every gradient
    leaf equal `jax.grad`'s, each against its own scale."""
    with jax.enable_x64(True):
        loss, params, batch = _ensemble_case()
        closed = jax.make_jaxpr(loss)(params, batch)
        assert any(e.primitive.name == "reshape" and e.params["dimensions"] is not None
                   for e in closed.jaxpr.eqns), "the idiom under test"
        g = trace(loss, params, batch)
        topology = load_topology("cpu8")
        mesh = MeshShape.of(topology)
        s = (space.Strategy(tuple(space.Config.replicated(op) for op in g.operators))
             if strategy == "replicated" else data_parallel(g, mesh))
        result = first_step(g, s, make_mesh(topology), loss, params, batch,
                            tolerance=1e-12)
        assert result.passed, result.describe()


def test_a_reshape_that_transposes_first_labels_its_dims_so():
    """The ensemble's member dim reaches the second convolution's output as its member dim:
    the labels follow the transpose before the reshape (they took the operand's dims in
    their stored order)."""
    loss, params, batch = _ensemble_case()
    g = trace(loss, params, batch)
    mix = g.operator("mix")
    assert mix.iteration_roles[:4] == ("P", "S", "A", "P")
    # it reduces over the input's channels, a parameter dim as in any convolution (the
    # operand's channels were labelled as its time steps: an attribute dim)
    assert [(r.size, r.role) for r in mix.reduction_dims] == [(8, "P")]


def test_an_nnx_vmapped_ensemble_of_convolutions_trains_exactly():
    """The same idiom in nnx: heads made by `nnx.vmap` under `nnx.split_rngs` and run by
    `nnx.vmap` over the module (``in_axes=(0, None)``); float64 data parallel on `cpu8`
    equals `jax.grad`, every leaf against its own scale."""
    import optax
    from flax import nnx

    class Head(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(8, 8, (3,), padding="CAUSAL", param_dtype=jnp.float64,
                                 rngs=rngs)
            self.out = nnx.Conv(8, 4, (1,), param_dtype=jnp.float64, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.conv(x)))

    class Ensemble(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Conv(3, 8, (3,), padding="SAME", param_dtype=jnp.float64,
                                 rngs=rngs)

            @nnx.split_rngs(splits=4)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Head(rngs)

            self.heads = make(rngs)

        def __call__(self, x):
            @nnx.vmap(in_axes=(0, None), out_axes=0)
            def run(head, h):
                return head(h)

            return run(self.heads, nnx.relu(self.stem(x)))  # [members, B, T, classes]

    with jax.enable_x64(True):
        graphdef, params, rest = nnx.split(Ensemble(nnx.Rngs(0)), nnx.Param, ...)
        batch = {"x": jax.random.normal(jax.random.key(1), (8, 16, 3), jnp.float64),
                 "y": jax.random.randint(jax.random.key(2), (8, 16), 0, 4)}

        def loss(p, b):
            logits = nnx.merge(graphdef, p, rest)(b["x"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, jnp.broadcast_to(b["y"], logits.shape[:-1])).mean()

        closed = jax.make_jaxpr(loss)(params, batch)
        assert any(e.primitive.name == "reshape" and e.params["dimensions"] is not None
                   for e in closed.jaxpr.eqns), "the idiom under test"
        g = trace(loss, params, batch)
        topology = load_topology("cpu8")
        s = data_parallel(g, MeshShape.of(topology))
        result = first_step(g, s, make_mesh(topology), loss, params, batch,
                            tolerance=1e-12)
    assert result.passed, result.describe()


def argsort_loss(p, b):
    """MAE's masking: the rows' order of per-sample noise (``jnp.argsort``: a sort of the
    noise and an iota of positions, the iota built inside the operator), the kept quarter
    gathered per sample."""
    order = jnp.argsort(b["noise"], axis=1)[:, :4]
    kept = jnp.take_along_axis(b["x"] @ p["w"], order[:, :, None].repeat(16, axis=2), axis=1)
    return jnp.mean(kept ** 2)


def test_an_argsort_splits_its_positions_with_its_keys():
    """The positions argsort sorts beside the keys are an iota (weak labels, never joined):
    they are cut as the keys are, so the sort's shard program builds at a batch split and
    each row's order is the whole sort's (it raised "Arguments to sort must have equal
    shapes", and the operator was priced by a fallback)."""
    noise = jax.random.uniform(jax.random.key(0), (8, 16))
    p = {"w": jnp.ones((32, 16))}
    b = {"x": jnp.ones((8, 16, 32)), "noise": noise}
    g = trace(argsort_loss, p, b)
    (op,) = [o for o in g.operators if o.anchor == "sort"]
    assert op.roles[0] == "S"
    degrees = (8,) + (1,) * (len(op.iteration_sizes) - 1)
    fn, avals = operator_fn(g, op.name, degrees, rules="primal")
    assert avals[0].shape == (1, 16)
    (index,) = fn(noise[:1])  # the kept positions, repeated over the features: [1, 4, 16, 1]
    assert index.shape == (1, 4, 16, 1)
    np.testing.assert_array_equal(np.asarray(index)[0, :, 0, 0],
                                  np.argsort(np.asarray(noise[0]))[:4])
