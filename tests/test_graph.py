"""soapjax.graph.opgraph: operators from jaxprs, dim roles, and the per-device shard programs."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import soapjax_zoo as models
from soapjax import cli
from soapjax.base.errors import TraceError
from soapjax.graph._local import operator_fn
from soapjax.graph.opgraph import trace


@functools.cache
def zoo_graph(name: str, api: str = "linen"):
    w = models.get(name, "tiny", api=api)
    return w, trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)


def roles(op) -> str:
    return "".join(op.roles)


# --- the paper's Table 1 on the zoo ------------------------------------------------------------


@pytest.mark.parametrize(
    "model, op_name, want_roles, want_reduction_roles",
    [
        ("mlp", "fc1", "SP", "P"),  # matmul: (S, P); its contracting dim is R
        ("gpt2", "layers_0/mlp/fc2", "SAP", "P"),  # Megatron's row-parallel split is an R split
        ("gpt2", "layers_0/attn/query", "SAPP", "P"),  # heads and head_dim follow the kernel
        ("lenet", "conv1", "SAAP", ""),  # 2D conv: (S; height, width A; channel P); 1 in-channel
        ("alexnet", "conv2", "SAAP", "P"),  # input channels: R
        ("lenet", "reduce_window_max", "SAAA", ""),  # pooling: (S; A; channel as A)
        ("rnntc", "lstm_0", "S-P", "P"),  # LSTM: (S, P); the scan's time axis is not divisible
        ("gpt2", "layers_0/ln_1", "SAP", ""),  # layer norm reads scale/bias along features
    ],
)
def test_table1_roles(model, op_name, want_roles, want_reduction_roles):
    _, g = zoo_graph(model)
    op = g.operator(op_name)
    assert roles(op) == want_roles
    assert "".join(r.role for r in op.reduction_dims) == want_reduction_roles


def test_conv1d_roles():
    class Conv1D(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(16, kernel_size=(3,), name="conv")(x).mean()

    m = Conv1D()
    x = jnp.ones((4, 32, 8))
    g = trace(lambda p, b: m.apply(p, b), m.init(jax.random.key(0), x), x)
    op = g.operator("conv")
    assert (op.shape, roles(op)) == ((4, 32, 16), "SAP")
    assert [(r.size, r.role) for r in op.reduction_dims] == [(8, "P")]  # input channels


def test_loss_reduces_over_the_batch():
    _, g = zoo_graph("mlp")
    loss = g.operators[-1]
    assert loss.name == "mlp" and loss.shape == ()
    assert "S" in [r.role for r in loss.reduction_dims]  # the mean over the batch is an R split


def test_operand_dims_follow_the_config():
    _, g = zoo_graph("mlp")
    fc1 = g.operator("fc1")
    kernel = next(o for o in fc1.inputs if o.source.endswith("['fc1']['kernel']"))
    x = next(o for o in fc1.inputs if o.kind == "batch")
    # iteration dims: 0 batch, 1 out features, 2 in features (reduction)
    assert kernel.dims == (2, 1)
    assert x.dims == (0, 2)


def test_an_operand_added_after_the_reduction_is_outside_it():
    """`Operand.outside`: a bias added after the matmul does not flow into its reduction over
    the input features; a per-sample scale applied before it does, though it has no input
    feature dim."""
    def loss(params, batch):
        x = batch["x"] * batch["scale"][:, None]
        return jnp.tanh(x @ params["w"] + params["b"]).sum()

    params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
    batch = {"x": jnp.ones((4, 16)), "scale": jnp.ones(4)}
    g = trace(loss, params, batch, name="scaled")
    [op] = g.operators  # a scalar: every iteration dim is reduced
    assert op.iteration_sizes == (16, 4, 8)  # input features, batch, output features
    assert {o.source: (o.dims, o.outside) for o in op.inputs} == {
        "['x']": ((1, 0), ()), "['scale']": ((1,), ()),
        "['w']": ((0, 2), ()), "['b']": ((2,), (0,))}


# --- every zoo model -------------------------------------------------------------------------


@pytest.mark.parametrize("name", models.names())
def test_zoo_traces_and_evaluates(name):
    w, g = zoo_graph(name)
    assert not g.unsupported
    # operators reflect layers, not equations
    assert 3 <= len(g.operators) <= g.num_equations / 4
    names = [op.name for op in g.operators]
    assert len(set(names)) == len(names)
    # every activation edge goes forward
    for i, j, operand in g.edges():
        assert i < j, (g.operators[i].name, g.operators[j].name)
    # every parameter is read by some operator
    read = {o.leaf_path for op in g.operators for o in op.inputs if o.kind == "param"}
    assert read == {leaf.path for leaf in g.params}


@pytest.mark.parametrize("name", ["mlp", "lenet", "gpt2", "rnntc", "nmt"])
def test_evaluate_reproduces_the_loss(name):
    """Re-running the grouped equations gives the traced function's own loss."""
    w, g = zoo_graph(name)
    params = w.init_params(jax.random.key(0))
    batch = w.make_batch(jax.random.key(1))
    got = jax.jit(lambda *f: g.evaluate(*f))(*jax.tree.leaves((params, batch)))
    np.testing.assert_allclose(got, jax.jit(w.loss_fn)(params, batch), rtol=1e-5)


def test_nnx_twin_gives_the_same_graph():
    _, lg = zoo_graph("mlp", "linen")
    _, ng = zoo_graph("mlp", "nnx")

    def signature(g):
        return [(op.name, op.anchor, op.shape, op.roles, op.reduction_dims) for op in g.operators]

    assert signature(lg)[:-1] == signature(ng)[:-1]  # all but the loss, named after the function
    assert [op.shape for op in lg.operators] == [op.shape for op in ng.operators]


# --- shard programs -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "gpt2", "rnntc", "lenet"])
def test_shard_programs_have_shard_shapes(name):
    _, g = zoo_graph(name)
    for op in g.operators:
        degrees = tuple(2 if (r in "SP" and s % 2 == 0) else 1
                        for r, s in zip(op.iteration_roles, op.iteration_sizes))
        fn, avals = operator_fn(g, op.name, degrees, rules="primal")
        out = jax.eval_shape(fn, *avals)[0]
        want = tuple(s // degrees[d] if d is not None else s
                     for s, d in zip(op.outputs[0].shape, op.outputs[0].dims))
        assert out.shape == want, op.name
        for operand, aval in zip(op.inputs, avals):
            for size, shard, d in zip(operand.shape, aval.shape, operand.dims):
                if d is not None:  # (an LSTM's H x 4H kernel splits both dims in the program)
                    assert shard == size // degrees[d]


def test_shard_program_computes_a_slice():
    """Split over the output features, fc1's shard program computes those columns exactly."""
    w, g = zoo_graph("mlp")
    op = g.operator("fc1")
    params = w.init_params(jax.random.key(0))
    batch = w.make_batch(jax.random.key(1))
    full_fn, _ = operator_fn(g, "fc1")
    shard_fn, avals = operator_fn(g, "fc1", (1, 2, 1), rules="primal")
    env = dict(zip([leaf.value for leaf in g.params + g.batch], jax.tree.leaves((params, batch))))
    operands = [env[o.value] for o in op.inputs]
    full = full_fn(*operands)[0]
    sliced = [x[..., : a.shape[-1]] if o.dims[-1] == 1 else x
              for x, a, o in zip(operands, avals, op.inputs)]
    np.testing.assert_allclose(shard_fn(*sliced)[0], full[:, : op.shape[1] // 2], rtol=1e-6)


# --- nested primitives and unknown ones ----------------------------------------------------------


def test_nested_primitives_trace_and_evaluate():
    @jax.custom_vjp
    def f_vjp(x):
        return jnp.sin(x)

    f_vjp.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))

    @jax.custom_jvp
    def f_jvp(x):
        return jnp.tanh(x)

    f_jvp.defjvp(lambda p, t: (jnp.tanh(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2)))

    def loss(w, x):
        h = jax.jit(lambda a: a @ w)(x)
        h = f_jvp(f_vjp(h))
        h = jax.checkpoint(lambda z: jnp.sin(z) @ w.T)(h)
        c, _ = jax.lax.scan(lambda carry, row: (carry + row, None), jnp.zeros(h.shape[1:]), h)
        k = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 1.1), (0, c))[1]
        return jax.lax.cond(k.sum() > 0, lambda q: q.sum(), lambda q: -q.sum(), k)

    w = jax.random.normal(jax.random.key(0), (8, 16))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    g = trace(loss, w, x)
    anchors = {op.anchor for op in g.operators}
    assert {"dot_general", "scan", "while", "cond"} <= anchors
    got = jax.jit(lambda *f: g.evaluate(*f))(w, x)
    np.testing.assert_allclose(got, loss(w, x), rtol=1e-6)


def test_unknown_primitive_is_kept_replicate_only():
    def loss(w, x):
        vals, _ = jax.lax.approx_max_k(x @ w, 3)
        return vals.sum()

    g = trace(loss, jnp.ones((8, 16)), jnp.ones((4, 8)))
    assert g.unsupported == ("approx_top_k",)
    op = next(op for op in g.operators if op.anchor == "approx_top_k")
    assert op.replicate_only and op.divisible_dims == ()
    assert "replicate-only" in g.table() and "approx_top_k" in g.table()


def test_top_k_splits_its_rows_never_its_k():
    """A mixture-of-experts router's top_k (issue 32): its leading dims follow the operand's
    (samples split), its k dim is new and never split (a shard's top k are not the row's)."""
    def loss(w, x):
        gates, chosen = jax.lax.top_k(jax.nn.softmax(x @ w, axis=-1), 2)
        return jnp.mean(gates) + jnp.mean(chosen.astype(gates.dtype))

    g = trace(loss, jnp.ones((8, 16)), jnp.ones((32, 8)))
    assert g.unsupported == ()
    op = next(op for op in g.operators if op.anchor == "top_k")
    assert not op.replicate_only
    splittable = [op.iteration_sizes[d] for d in op.divisible_dims]
    assert 32 in splittable and 2 not in splittable  # the 32 rows split, the k = 2 never


# --- bad input ----------------------------------------------------------------------------------


def _loss(params, batch):
    return (batch["x"] @ params["w"]).sum()


PARAMS = {"w": jnp.ones((3, 2))}
BATCH = {"x": jnp.ones((4, 3))}


def test_no_batch_argument():
    with pytest.raises(TraceError, match="needs a batch argument"):
        trace(_loss, PARAMS, BATCH, batch_argnums=())


def test_wrong_number_of_arguments():
    with pytest.raises(TraceError,
                       match=r"3 example argument\(s\) do not fit _loss\(params, batch\)"):
        trace(_loss, PARAMS, BATCH, BATCH)


def test_mismatched_shapes():
    with pytest.raises(TraceError,
                       match=r"tracing _loss with the example arguments .* failed: TypeError"):
        trace(_loss, {"w": jnp.ones((5, 2))}, BATCH)


def test_batch_sizes_disagree():
    """Leaves of different lengths (a batch of graphs packed end to end: nodes and edges) are
    refused, the error saying how to lay them out per sample (tests/corpus/gnn.py's way)."""
    with pytest.raises(TraceError,
                       match=r"batch leaf \['y'\] has batch size 5 .* but \['x'\] has 4.*"
                             r"laid out per sample instead, padded to one size"):
        trace(lambda p, b: _loss(p, b) + b["y"].sum(), PARAMS,
              {"x": jnp.ones((4, 3)), "y": jnp.ones(5)})


def test_scalar_batch_leaf():
    """A value that is not per sample (a temperature) in the batch is refused, and the error
    says how to pass it: a closure, which traces and gives jax.grad's gradient."""
    with pytest.raises(TraceError, match=r"batch leaf \['n'\] .* is a scalar; expected dim 0 "
                       r".*; pass values that are not per sample to _loss another way: "
                       r"functools.partial\(_loss, ...\)"):
        trace(_loss, PARAMS, {"x": jnp.ones((4, 3)), "n": jnp.float32(1)})

    def scaled(p, b, n):
        return _loss(p, b) / n

    params = {"w": jnp.arange(6.0).reshape(3, 2)}
    batch = {"x": jnp.arange(12.0).reshape(4, 3)}
    g = trace(functools.partial(scaled, n=jnp.float32(2)), params, batch)
    got = g.evaluate(*jax.tree.leaves((params, batch)))
    assert float(got) == pytest.approx(float(_loss(params, batch)) / 2)


def test_argnum_out_of_range():
    with pytest.raises(TraceError,
                       match=r"batch_argnums=\(2,\) refers to argument 2, but 2 example"):
        trace(_loss, PARAMS, BATCH, batch_argnums=2)


def test_non_scalar_loss():
    with pytest.raises(TraceError,
                       match=r"must return a scalar loss, but returned \(float32\[4,2\]\)"):
        trace(lambda p, b: b["x"] @ p["w"], PARAMS, BATCH)


def test_a_loss_with_aux_values_is_told_to_pass_has_aux():
    def loss_and_metrics(p, b):
        out = b["x"] @ p["w"]
        return jnp.mean(out ** 2), {"largest": out.max()}

    with pytest.raises(TraceError, match=r"returned \(float32\[\], float32\[\]\); for a loss "
                       r"with other values \(as jax.value_and_grad\(..., has_aux=True\) .*"
                       r"pass has_aux=True"):
        trace(loss_and_metrics, PARAMS, BATCH)
    g = trace(loss_and_metrics, PARAMS, BATCH, has_aux=True)
    params = {"w": jnp.arange(6.0).reshape(3, 2)}
    batch = {"x": jnp.arange(12.0).reshape(4, 3)}
    loss, aux = g.evaluate(*jax.tree.leaves((params, batch)))
    want_loss, want_aux = loss_and_metrics(params, batch)
    assert float(loss) == float(want_loss) and float(aux["largest"]) == float(want_aux["largest"])


def test_unknown_model_on_the_command_line(capsys):
    assert cli.main(["graph", "--model", "gtp2"]) == 2
    assert "unknown model 'gtp2'" in capsys.readouterr().err


# --- the command line ---------------------------------------------------------------------------


def test_graph_json(capsys):
    assert cli.main(["graph", "--model", "mlp", "--config", "tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "mlp" and data["num_equations"] > len(data["operators"])
    fc1 = data["operators"][0]
    assert {"name", "anchor", "shape", "roles", "reduction_dims", "flops", "param_bytes",
            "params"} <= set(fc1)
    assert fc1["name"] == "fc1" and fc1["roles"] == "SP"
    assert fc1["flops"] == 2 * 8 * 16 * 32 + 8 * 32 * 2  # matmul + bias add + relu, tiny config
    assert {"src", "dst", "shape", "dtype"} <= set(data["tensors"][0])
    assert data["tensors"][0]["src"] == "fc1" and data["tensors"][0]["dst"] == "fc2"


def test_graph_table(capsys):
    assert cli.main(["graph", "--model", "gpt2", "--config", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "layers_0/attn/query" in out and "[8S,8A,2P,16P]" in out


# --- scans over layers and remat regions ------------------------------------------------------


def _scanned_mlp(kind: str):
    """A 3-layer residual MLP written as users write scan over layers (linen or nnx)."""
    from flax import nnx

    x, y = jnp.ones((8, 16)), jnp.arange(8) % 10
    if kind == "nnx":
        class Block(nnx.Module):
            def __init__(self, rngs):
                self.fc1 = nnx.Linear(16, 64, rngs=rngs)
                self.fc2 = nnx.Linear(64, 16, rngs=rngs)

            def __call__(self, h):
                return h + self.fc2(jax.nn.gelu(self.fc1(h)))

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.layers = _make(rngs)
                self.head = nnx.Linear(16, 10, rngs=rngs)

            def __call__(self, h):
                h = nnx.scan(nnx.remat(lambda h, b: (b(h), None)),
                             in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(h, self.layers)[0]
                return self.head(h)

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def _make(rngs):
            return Block(rngs)

        model = Net(nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)

        def loss_fn(p, batch):
            logits = nnx.merge(graphdef, p)(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss_fn, params, {"x": x, "y": y}

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + nn.Dense(16, name="fc2")(nn.gelu(nn.Dense(64, name="fc1")(h))), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, h):
            scanned = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                              split_rngs={"params": True}, length=3)
            return nn.Dense(10, name="head")(scanned(name="layers")(h, None)[0])

    net = Net()
    params = net.init(jax.random.key(0), x)

    def loss_fn(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply(p, batch["x"]),
                                                               batch["y"]).mean()
    return loss_fn, params, {"x": x, "y": y}


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_a_scan_over_layers_is_planned_layer_by_layer(kind):
    from soapjax import load_topology
    from soapjax.strategy import baselines
    from soapjax.strategy.space import MeshShape, param_specs

    loss_fn, params, batch = _scanned_mlp(kind)
    g = trace(loss_fn, params, batch)
    names = [op.name for op in g.operators]
    assert [n for n in names if n.endswith("fc1")] == ["layers_0/fc1", "layers_1/fc1",
                                                       "layers_2/fc1"]
    fc1 = g.operator("layers_1/fc1")
    assert fc1.block_position == "layers_*/fc1" and fc1.roles == ("S", "P")
    kernel = next(o for o in fc1.inputs if o.kind == "param" and len(o.shape) == 2)
    assert kernel.layer == (1,) and kernel.shape == (16, 64)  # the layer's slice, not the stack
    assert kernel.source == kernel.leaf_path + "[1]"
    blocks = [[g.operators[i].name for i in b] for b in g.repeated_blocks()]
    assert ["layers_0/fc1", "layers_1/fc1", "layers_2/fc1"] in blocks
    # Megatron splits the stacked kernels like their per-layer slices, the layer dim whole.
    topo = load_topology("cpu8")
    mesh = MeshShape.of(topo)
    specs = param_specs(g, baselines.baselines(g, topo)["megatron"], mesh)
    fc1_kernel = next(p for p in specs if "fc1" in p and "kernel" in p)
    assert specs[fc1_kernel] == ((), (), ("model",))
    fc2_kernel = next(p for p in specs if "fc2" in p and "kernel" in p)
    assert specs[fc2_kernel] == ((), ("model",), ())


def test_remat_regions_are_evaluated_under_checkpoint():
    loss_fn, params, batch = _scanned_mlp("linen")
    g = trace(loss_fn, params, batch)
    assert g.program.regions and all(r["policy"] is None for r in g.program.regions)

    def evaluated(p, b):
        return g.evaluate(*jax.tree.leaves(p), *jax.tree.leaves(b))

    prims = {e.primitive.name for e in jax.make_jaxpr(evaluated)(params, batch).jaxpr.eqns}
    assert "remat2" in prims and "scan" not in prims  # the layers unrolled, each remat kept
    want = jax.grad(loss_fn)(params, batch)
    got = jax.grad(evaluated)(params, batch)
    err = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got),
                                                           jax.tree.leaves(want)))
    assert err <= 1e-6 * max(float(jnp.abs(a).max()) for a in jax.tree.leaves(want))


def test_named_axis_batch_norm_under_vmap_is_a_reduction():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=False, axis_name="batch")(nn.Dense(16)(x))
            return nn.Dense(10)(x)

    net, x = Net(), jnp.ones((8, 12))
    variables = jax.vmap(lambda r: net.init(jax.random.key(0), r), axis_name="batch")(x)
    variables = jax.tree.map(lambda a: a[0], variables)

    def loss_fn(p, batch):
        def one(r):
            return net.apply({"params": p, "batch_stats": variables["batch_stats"]}, r,
                             mutable=["batch_stats"])[0]
        return jax.vmap(one, axis_name="batch")(batch).sum()

    g = trace(loss_fn, variables["params"], x)
    assert not g.unsupported and not any(op.replicate_only for op in g.operators)
    assert "psum" in {u.eqn.primitive.name for u in g.program.units}


def test_sample_sums_are_the_sums_over_the_batch_that_its_statistics_start_from():
    """`OpGraph.sample_sums`: a mean loss sums its samples once and couples nothing; a batch
    norm written out (mean, variance of the centred values, then each sample divided) sums
    them three times, the variance's sum after the mean meets each sample; a max over the
    batch, and a sort of its samples, are no sums: None."""
    w, x = jnp.ones((12, 16)), jnp.ones((8, 12))

    def mean_loss(w, x):
        return jnp.mean(jnp.tanh(x @ w))

    def batch_norm(w, x):
        h = x @ w
        mean = h.mean(axis=0)
        var = ((h - mean) ** 2).mean(axis=0)
        return jnp.mean((h - mean) / jnp.sqrt(var + 1e-5))

    def by_max(w, x):
        h = x @ w
        return jnp.mean(h / h.max(axis=0))

    def sorted_batch(w, x):
        return jnp.mean(jnp.sort(x @ w, axis=0)[:4])

    sums = {}
    for fn in (mean_loss, batch_norm, by_max, sorted_batch):
        g = trace(fn, w, x)
        sums[fn.__name__] = g.sample_sums
        made = {v: u.eqn.primitive.name for u in g.program.units for v in u.outs}
        assert all(made[v] == "reduce_sum" for v in g.sample_sums or ())
        assert bool(g.sample_coupling) == (fn is not mean_loss)
    assert [len(sums[k]) for k in ("mean_loss", "batch_norm")] == [1, 3]
    assert sums["by_max"] is None and sums["sorted_batch"] is None


def test_samples_reading_each_other_couple_the_batch():
    """A value over pairs of samples (two sample dims: a contrastive loss's logits
    ``img @ txt.T``, distances between every two samples), or values moved along the sample
    dim (mixup with the batch flipped, a permuted or shifted batch), makes a sample's loss read
    other samples': coupled, and no sum over the parts of a batch makes it (`sample_sums`
    None); so does an equation that runs along the sample dim (a cumulative sum, a top-k over
    the samples' losses), and a reshape that groups the samples (pairs of views side by side:
    apply's microbatches take every M-th sample and would split a group; a group summed
    element by element is coupled too, conservatively). Microbatches would mix or contrast
    each microbatch within itself (the corpus CLIP: loss 2.79 against 3.43 with 2, before this
    was seen; a SigLIP-style loss with both towers fed the same images, its loss 3 % off, and a
    cumulative sum over the batch, 68 % off, before the sample dims of one label and the
    equations running along the batch were seen). The samples merged with their tokens and
    split out again stay uncoupled."""
    w = jnp.ones((12, 16))
    batch = {"img": jnp.ones((8, 12)), "txt": jnp.ones((8, 12))}

    def contrastive(w, b):
        logits = (b["img"] @ w) @ (b["txt"] @ w).T
        return jnp.mean(jax.nn.log_softmax(logits, axis=-1).diagonal())

    def pairwise(w, b):
        h = b["img"] @ w
        return jnp.sum((h[:, None, :] - h[None, :, :]) ** 2)

    def mixup(w, b):
        x = 0.7 * b["img"] + 0.3 * b["img"][::-1]
        return jnp.mean(jnp.tanh(x @ w))

    def permuted(w, b):
        h = b["img"] @ w
        return jnp.mean((h - h[jnp.array([3, 1, 2, 0, 7, 5, 6, 4])]) ** 2)

    def shifted(w, b):
        h = b["img"] @ w
        return jnp.mean((h[1:] - h[:-1]) ** 2)

    def pairs_of_views(w, b):
        g = (b["img"] @ w).reshape(4, 2, -1)
        return jnp.sum((g[:, 0] - g[:, 1]) ** 2)

    def one_tower(w, b):  # SigLIP-style: both sides from the same images, one sample label
        h = b["img"] @ w
        return jnp.sum(jax.nn.log_sigmoid((2 * jnp.eye(8) - 1) * (h @ (h ** 2).T)))

    def cumulative(w, b):  # a Cox likelihood's risk sets: a cumulative sum over the batch
        return jnp.sum(jax.lax.cumlogsumexp(jnp.tanh(b["img"] @ w)[:, 0]))

    def hardest(w, b):  # online hard example mining: the top quarter of the samples' losses
        return jnp.mean(jax.lax.top_k(jnp.sum(jnp.tanh(b["img"] @ w), axis=1), 2)[0])

    def tokens(w, b):  # [B, T, F] -> [B * T, F] -> [B, T, F]
        h = jnp.stack([b["img"], b["txt"]], axis=1) @ w
        return jnp.sum(jnp.tanh(h.reshape(16, -1)).reshape(8, 2, -1) ** 2)

    for fn, why in ((contrastive, "dot_general gives a value over pairs of samples"),
                    (pairwise, "sub gives a value over pairs of samples"),
                    (mixup, "rev moves values along the sample dim"),
                    (permuted, "gather moves values along the sample dim"),
                    (shifted, "slice moves values along the sample dim"),
                    (pairs_of_views, "reshape splits the sample dim into groups of samples"),
                    (one_tower, "dot_general gives a value over pairs of samples"),
                    (cumulative, "cumlogsumexp moves values along the sample dim or runs"),
                    (hardest, "top_k moves values along the sample dim or runs")):
        g = trace(fn, w, batch)
        assert g.sample_coupling.startswith(why) and g.sample_sums is None, fn.__name__
    g = trace(tokens, w, batch)
    assert g.sample_coupling == "" and g.sample_sums is not None


def test_identical_unrolled_layers_are_repeated_blocks():
    """A Python loop of identical blocks (named, or linen's auto names) gets block positions as
    a scan over layers does; a first and last Dense of other shapes do not; blocks that differ
    (another width) are no family."""
    import flax.linen as nn

    class Block(nn.Module):
        width: int = 64

        @nn.compact
        def __call__(self, x):
            h = nn.Dense(self.width, name="fc1")(nn.LayerNorm()(x))
            return x + nn.Dense(x.shape[-1], name="fc2")(jax.nn.gelu(h))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(32)(x)
            for i in range(4):
                x = Block(name=f"layers_{i}")(x)
            for _ in range(2):
                x = Block()(x)
            x = Block(width=48, name="odd_0")(x)
            x = Block(width=64, name="odd_1")(x)
            return nn.Dense(10)(x)

    m, x = Net(), jnp.ones((8, 16))
    p = m.init(jax.random.key(0), x)
    g = trace(lambda p, x: jnp.mean(m.apply(p, x) ** 2), p, x)
    pos = {op.name: op.block_position for op in g.operators}
    assert pos["layers_2/fc1"] == "layers_*/fc1" and pos["Block_1/fc2"] == "Block_*/fc2"
    assert pos["Dense_0"] == pos["Dense_1"] == pos["odd_0/fc1"] == ""
    assert sorted(len(b) for b in g.repeated_blocks()) == [2, 2, 2, 4, 4, 4]


def test_memo_is_per_graph_and_not_copied():
    """`OpGraph.memo` works a value out once per graph; `dataclasses.replace` (another graph)
    starts empty; `repeated_blocks` hands out copies of its memoised groups."""
    import dataclasses

    _, g = zoo_graph("gpt")
    calls = []
    assert g.memo(("test", 1), lambda: calls.append(1) or 7) == 7
    assert g.memo(("test", 1), lambda: calls.append(1) or 8) == 7 and calls == [1]
    other = dataclasses.replace(g, name="other")
    assert other.memo(("test", 1), lambda: 9) == 9
    blocks = g.repeated_blocks()
    blocks[0].append(-1)
    assert -1 not in g.repeated_blocks()[0]


def test_layers_that_read_a_value_the_first_layer_builds_are_still_one_family():
    """GPT-2 builds its causal mask from iotas: it is computed inside layer 0's attention-score
    operator and read by layer 1's as an extra operand. The layers are still the same
    computation: every layer operator gets a block position, and each position is a block."""
    w = models.get("gpt2", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt2")
    ops = {op.name: op for op in g.operators}
    first, second = ops["layers_0/attn/dot_general"], ops["layers_1/attn/dot_general"]
    assert len(first.inputs) + 1 == len(second.inputs)  # the mask
    assert first.block_position == second.block_position == "layers_*/attn/dot_general"
    layered = [op for op in g.operators if op.name.startswith("layers_")]
    assert layered and all(op.block_position for op in layered)
    assert len(g.repeated_blocks()) == len(layered) // 2


class _NumberedBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="fc")(nn.LayerNorm(name="ln")(x))


class _Numbered(nn.Module):
    names: tuple
    embed: bool = False

    @nn.compact
    def __call__(self, x):
        if self.embed:
            x = nn.Dense(16, name="embed")(x)
        for n in self.names:
            x = _NumberedBlock(name=n)(x)
        return x


@pytest.mark.parametrize("names", [("0", "1"), ("layers_0", "layers_1")], ids=["0-1", "layers_0-1"])
def test_numeric_module_names_are_kept(names):
    """Libraries name list-held layers "0", "1": a name keeps every path component (they were
    dropped: `ln/reduce_sum, fc/dot_general, ln/reduce_sum_1, ...`)."""
    m, x = _Numbered(names), jnp.ones((8, 16))
    p = m.init(jax.random.key(0), x)
    g = trace(lambda p, b: jnp.mean(m.apply(p, b["x"]) ** 2), p, {"x": x})
    a, b = names
    assert [op.name for op in g.operators][:4] == [f"{a}/ln", f"{a}/fc", f"{b}/ln", f"{b}/fc"]


def test_layers_named_by_number_are_one_family():
    """Identical list-held layers "0".."3" are repeated blocks, as ``layers_0..3`` are."""
    m, x = _Numbered(("0", "1", "2", "3"), embed=True), jnp.ones((8, 16))
    p = m.init(jax.random.key(0), x)
    g = trace(lambda p, b: jnp.mean(m.apply(p, b["x"]) ** 2), p, {"x": x})
    pos = {op.name: op.block_position for op in g.operators}
    assert pos["2/fc"] == "*/fc" and pos["3/ln"] == "*/ln"
    assert sorted(len(b) for b in g.repeated_blocks()) == [4, 4]


def test_a_pool_after_the_last_block_is_not_folded_into_the_stem():
    # ResNet's global average pool reads the last block's ReLU, a unit that waits for its
    # consumer to place it: the pool once joined the stem's max pool (the root module's open
    # operator), placed before every block it reads. It is its own operator, before the head
    # and the loss.
    w, g = zoo_graph("resnet101")
    names = [op.name for op in g.operators]
    pool = names.index("reduce_sum")
    assert names[pool + 1:] == ["fc", "resnet101"] and names[pool - 1].startswith("layer4_")
    assert [o.kind for o in g.operators[pool].inputs] == ["activation"]
    stem = g.operators[names.index("reduce_window_max")]
    assert [o.source for o in stem.inputs] == ["bn1"]


def test_an_fft_along_a_moved_axis_keeps_its_operand_whole_but_the_batch():
    """`jnp.fft.rfft(x, n=2T, axis=1)` of ``[B, T, C]`` (the corpus Hyena's long convolution):
    jax moves the time axis last (a transpose, then a pad to ``n``) before the FFT, and
    XLA:CPU's FFT cannot run on that operand split along the channels between (the same
    RET_CHECK as a split transform dim: docs/xla-workarounds.md). Its operator keeps every dim
    but the batch whole; an FFT along the last axis still splits the dims before it."""
    def loss(w, x, axis):
        h = x @ w
        y = jnp.fft.irfft(jnp.fft.rfft(h, n=16, axis=axis), n=16, axis=axis)
        return jnp.mean(jnp.tanh(y) ** 2)

    w, x = jnp.ones((6, 8)), jnp.ones((4, 8, 6))
    moved = trace(lambda w, x: loss(w, x, 1), w, x)
    rfft = next(op for op in moved.operators if op.anchor == "fft")
    assert rfft.iteration_roles == ("S", "-", "-")
    last = trace(lambda w, x: loss(w, x, 2), w, x)
    rfft = next(op for op in last.operators if op.anchor == "fft")
    assert rfft.iteration_roles == ("S", "A", "-")


def test_checkpoint_names_and_platform_indices_are_no_operators():
    """``checkpoint_name`` (MaxText's way of naming what a remat policy keeps: the `name`
    primitive) is an identity, and `jnp.diag`'s `platform_index` a constant: both fold into
    the operators around them, at no FLOPs. Each was an operator of its own (the corpus RWKV's
    six named projections: 31 operators, not 25, and a check 1.155x off in bytes; recomputed,
    the deep-kernel GP's index crashed JAX's linearisation of the `cond` reading it)."""
    from jax.ad_checkpoint import checkpoint_name

    w = jnp.ones((12, 16))
    x = jnp.ones((8, 12))

    def loss(w, x, named):
        h = x @ w
        h = checkpoint_name(h, "proj") if named else h
        return jnp.mean(jnp.tanh(h) ** 2) + jnp.diag(h[:, :8]).sum()

    named, plain = (trace(lambda w, x, n=n: loss(w, x, n), w, x) for n in (True, False))
    assert [op.name for op in named.operators] == [op.name for op in plain.operators]
    assert not any("name" in op.name or "platform" in op.name for op in named.operators)
    assert [op.flops for op in named.operators] == [op.flops for op in plain.operators]


def test_an_fft_never_splits_its_transform_dims():
    """An FFT's operator keeps the dims it transforms whole (XLA:CPU cannot run an FFT split
    there: docs/xla-workarounds.md); its batch dim stays splittable, and the operators around
    it may split the tokens and features: a token mixing by ``fft2`` over [B, T, F], and an
    ``rfft`` over the features whose result the same operator reduces."""
    w = jnp.ones((12, 16))
    x = jnp.ones((8, 6, 12))

    def loss(w, x):
        h = x @ w
        y = jnp.tanh(h + jnp.fft.fft2(h, axes=(-2, -1)).real)
        return jnp.mean(jnp.fft.rfft(y, axis=-1).real ** 2)

    g = trace(loss, w, x)
    mixing, head = [op for op in g.operators if op.anchor == "fft"]
    assert mixing.roles == ("S", "-", "-")
    # the rfft over the features, then the mean: its transform dim is reduced, kept whole
    assert [r.role for r in head.reduction_dims] == ["S", "A", "-"]
    assert g.operators[0].roles == ("S", "A", "P")


def test_abstract_params_keep_the_parameters_tree():
    """`OpGraph.abstract_params`: the parameters in their own pytree (an optimizer's ``init``
    follows it), a tuple of them for several parameter arguments."""
    g = trace(_loss, PARAMS, BATCH)
    tree = g.abstract_params()
    assert jax.tree.structure(tree) == jax.tree.structure(PARAMS)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(tree)] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(PARAMS)]
    two = trace(lambda p, b, q: _loss(p, b) + jnp.sum(q["v"]), PARAMS, BATCH,
                {"v": jnp.ones(3)}, params_argnums=(0, 2))
    assert jax.tree.structure(two.abstract_params()) == jax.tree.structure(
        (PARAMS, {"v": 0}))


def test_a_recomputed_segment_checkpoints_its_own_equations_alone():
    """`Program._checkpoint_order`: another operator's equation between a segment's first and
    last runs before its checkpoint (it reads nothing the segment makes) or after it (it
    does); a segment interleaved both ways keeps its whole span in the checkpoint; one that
    would cut an earlier segment's checkpoint in two runs without recomputation, with a
    warning (its activations are kept, more memory than the plan's prediction). The values
    are the traced function's whatever the order."""
    def f(p, x):
        a = jnp.sin(x * p)      # units 0 (mul), 1 (sin)
        b = jnp.cos(x)          # unit 2
        c = a * b               # unit 3: reads a and b
        return jnp.sum(c + (b + 1.0))  # units 4-6

    g = trace(f, jnp.ones(4), jnp.ones(4))
    program = g.program
    assert [u.eqn.primitive.name for u in program.units][:4] == ["mul", "sin", "cos", "mul"]
    # {sin, mul}: cos reads nothing they make, so it runs before the checkpoint
    order, spans = program._checkpoint_order({1: {1, 3}}, {}, frozenset())
    assert order == [0, 2, 1, 3, 4, 5, 6] and spans == {1: frozenset({1, 3})}
    # {sin, cos} and {mul, add}: nothing between either's equations, the program's order
    order, spans = program._checkpoint_order({1: {1, 2}, 3: {3, 4}}, {}, frozenset())
    assert spans == {1: frozenset({1, 2}), 3: frozenset({3, 4})} and order == list(range(7))
    # {sin, mul} then {cos, add}: the second's span would cut the first's checkpoint (sin
    # before it, mul, reading cos, after it): the second is not recomputed, and says so
    with pytest.warns(UserWarning, match="run without recomputation"):
        order, spans = program._checkpoint_order({1: {1, 3}, 2: {2, 4}}, {}, frozenset())
    assert spans == {1: frozenset({1, 3})}
    # interleaved both ways: {mul (x * p), mul (a * b)} with sin and cos between, the second
    # reading sin's result made from the first's: the whole span recomputes
    order, spans = program._checkpoint_order({0: {0, 3}}, {}, frozenset())
    assert spans == {0: frozenset({0, 1, 2, 3})}
    x, p = jnp.linspace(0.0, 1.0, 4), jnp.full(4, 0.5)
    with pytest.warns(UserWarning, match="run without recomputation"):
        got = jax.grad(lambda p: program.run([p, x], checkpoints={1: {1, 3}, 2: {2, 4}})[0])(p)
    np.testing.assert_allclose(got, jax.grad(f)(p, x), rtol=1e-6)


def test_swin_windows_split_with_the_batch_they_come_from():
    """Swin's window attention, under data parallelism, gathered every block's activations
    twice over the data axis (8 all-gathers forward, their cotangents in the backward, XLA
    compiled and the simulator priced them):

    * the qkv projection's operator partitions ``[B, H, W, C]`` into windows ``[B * H/w *
      W/w, w * w, C]``: its first dim is the merged one, and the operand's B (its major
      part) was read whole. A split of the windows by a degree that divides B is B's split
      (the operator's granularity keeps it so);
    * the attention module reshapes the projection into ``[windows, tokens, 3, heads, head
      dim]`` where the relative position bias table's gather opens an operator; the reshape
      joined that operator with no dim related to the gather's, so its output was read
      whole. It now belongs to the attention's first matmul, which reads it split by windows.
    """
    import corpus

    from soapjax.apply import step as apply
    from soapjax.measure import hlo
    from soapjax.strategy import space
    from soapjax.topology.cluster import load_topology, make_mesh

    loss_fn, params, batch = corpus.get("swin")
    g = trace(loss_fn, params, batch, name="swin")
    for op in g.operators:
        if op.name.endswith("attn/qkv"):
            x = next(o for o in op.inputs if o.kind == "activation")
            assert x.dims[0] == 0 and op.split_sizes[0] == 8, (x.dims, op.split_sizes)
        if op.name.endswith("attn/gather"):  # the bias alone: no activation read
            assert [o for o in op.inputs if o.kind == "activation"] == [], op.inputs
        if op.name.endswith("attn/dot_general"):
            qkv = next(o for o in op.inputs if o.source.endswith("attn/qkv"))
            assert qkv.dims[0] is not None, (op.name, qkv.dims)  # its windows: a split dim
    topo = load_topology("cpu8")
    strategy = space.data_parallel(g, space.MeshShape.of(topo))
    mesh = make_mesh(topo)
    fn, sh = apply.sharded_value_and_grad(g, strategy, mesh, params=params, batch=batch,
                                          compiler_options={"xla_backend_optimization_level": 0})
    args = apply.device_put_global((params, batch), (sh.params, sh.batch))
    text = fn.lower(*args, jax.numpy.zeros((), jax.numpy.int32)).compile().as_text()
    gathers = [(c.shapes, c.op_name) for c in hlo.collectives(text, mesh)
               if c.kind == "all-gather"]
    assert not gathers, gathers
