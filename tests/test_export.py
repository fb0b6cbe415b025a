"""soapjax.apply.export: a plan's shardings for a plain `jax.jit` loop, each form trained one step
with `jax.jit` alone and held to the training helper's step and to the unsharded one (float64,
`cpu8`: data=2 x model=4)."""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import soapjax_zoo as zoo
from soapjax import cli
from soapjax.apply import export
from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import trace
from soapjax.strategy.baselines import intra_node_axes, megatron
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology, make_mesh
from soapjax.training import shard_training

CPU8 = load_topology("cpu8")


def _init(kernel_names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), kernel_names)


class Block(nn.Module):
    """A linen MLP whose kernels carry logical axis names, as MaxText writes its layers."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(64, kernel_init=_init(("embed", "mlp")), name="up")(x)
        h = nn.Dense(64, kernel_init=_init(("mlp", "mlp_out")), name="mid")(jax.nn.gelu(h))
        return nn.Dense(16, kernel_init=_init(("mlp_out", "embed")), name="down")(jax.nn.gelu(h))


@pytest.fixture(scope="module")
def model():
    with jax.enable_x64(True):
        block = Block()
        batch = {"x": jax.random.normal(jax.random.key(1), (16, 16), jnp.float64),
                 "y": jax.random.normal(jax.random.key(2), (16, 16), jnp.float64)}
        variables = block.init(jax.random.key(0), batch["x"])
        params = jax.tree.map(lambda x: x.astype(jnp.float64),
                              nn.meta.unbox(variables)["params"])
        logical = nn.get_partition_spec(variables)["params"]

        def loss(p, b):
            return jnp.mean((block.apply({"params": p}, b["x"]) - b["y"]) ** 2)

        graph = trace(loss, params, batch, name="block")
        strategy = megatron(graph, MeshShape.of(CPU8), ("model",))  # TP 4, DP 2
        plan = Plan.make(graph, CPU8, strategy)
        yield graph, plan, loss, params, batch, logical


def _plain_step(loss, optimizer, param_shardings, batch_shardings):
    def step(p, s, b):
        value, grads = jax.value_and_grad(loss)(p, b)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    return jax.jit(step, in_shardings=(param_shardings, None, batch_shardings),
                   out_shardings=(param_shardings, None, None))


def _one_step(step, params, batch, optimizer, param_shardings):
    p = jax.device_put(params, param_shardings)
    return step(p, optimizer.init(p), batch)


def _plain_jit_step(graph, plan, loss, params, batch, param_specs, optimizer):
    """One step of plain `jax.jit` with `param_specs` (a pytree of `PartitionSpec`s) and the
    plan's batch specs on `cpu8`: (new parameters, loss)."""
    mesh = make_mesh(CPU8)
    ps = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs,
                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    exported = export.partition_specs(graph, plan, params=params, batch=batch)
    bs = jax.tree.map(lambda s: NamedSharding(mesh, s), exported.batch)
    step = _plain_step(loss, optimizer, ps, bs)
    new, _, value = _one_step(step, params, jax.device_put(batch, bs), optimizer, ps)
    return new, value


def _helper_step(loss, params, batch, optimizer, plan):
    run = shard_training(loss, params, batch, optimizer, mesh="cpu8", strategy=plan, name="block",
                         donate=False)
    new, _, value = run.step(run.params, run.opt_state, run.shard_batch(batch))
    return new, value


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        scale = float(np.max(np.abs(np.asarray(y)))) or 1.0
        assert float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) <= 1e-12 * scale


def test_partition_specs_train_with_plain_jit_as_the_helper_does(model):
    graph, plan, loss, params, batch, _ = model
    with jax.enable_x64(True):
        exported = export.partition_specs(graph, plan, params=params, batch=batch)
        # Megatron splits the MLP's hidden dim over the node's `model` axis
        assert exported.params["up"]["kernel"] == jax.sharding.PartitionSpec(None, "model")
        assert exported.batch["x"][0] == "data"
        mesh = make_mesh(CPU8)
        ps = jax.tree.map(lambda s: NamedSharding(mesh, s), exported.params)
        bs = jax.tree.map(lambda s: NamedSharding(mesh, s), exported.batch)
        optimizer = optax.adam(1e-2)
        step = _plain_step(loss, optimizer, ps, bs)
        new, _, value = _one_step(step, params, jax.device_put(batch, bs), optimizer, ps)
        assert new["up"]["kernel"].sharding.spec == exported.params["up"]["kernel"]
        ref_new, ref_value = _helper_step(loss, params, batch, optimizer, plan)
        _close(new, ref_new)
        _close(value, ref_value)
        plain = jax.jit(jax.value_and_grad(loss))(params, batch)[0]
        _close(value, plain)
    assert any("activations' layouts" in line for line in exported.not_expressed)


def test_logical_axis_rules_shard_a_linen_model_as_the_plan_does(model):
    graph, plan, loss, params, batch, logical = model
    with jax.enable_x64(True):
        rules, lines = export.logical_axis_rules(graph, plan, logical, params=params)
        assert dict(rules)["mlp"] == "model" and dict(rules)["embed"] is None
        specs = nn.logical_to_mesh(logical, rules)
        # the biases carry no logical names: replicated, as the plan's own specs may differ
        optimizer = optax.sgd(0.1)
        new, value = _plain_jit_step(graph, plan, loss, params, batch, specs, optimizer)
        assert new["mid"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("model", None)
        ref_new, ref_value = _helper_step(loss, params, batch, optimizer, plan)
        _close(new, ref_new)
        _close(value, ref_value)


def test_a_logical_name_the_plan_splits_two_ways_is_said(model):
    graph, plan, _, params, _, logical = model
    # every kernel dim named "x": the plan splits some over `model` and leaves others whole
    same = jax.tree.map(lambda s: ("x",) * len(s), logical,
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    rules, lines = export.logical_axis_rules(graph, plan, same, params=params)
    assert [r[0] for r in rules] == ["x"]
    assert any(line.startswith("logical axis 'x': the plan splits it over") for line in lines)


def test_what_the_specs_cannot_carry_is_said_one_line_each(model):
    graph, plan, *_ = model
    strategy = plan.strategy(graph).with_microbatches(2)
    strategy = dataclasses.replace(strategy, recompute=("full",) * len(graph.operators))
    exported = export.partition_specs(graph, Plan.make(graph, CPU8, strategy))
    text = "\n".join(exported.not_expressed)
    assert "2 microbatches" in text and "recomputation" in text
    assert "whole matrices" not in text  # no optimizer given, or an elementwise one
    assert "whole matrices" not in "\n".join(export.partition_specs(
        graph, plan, optimizer=optax.adam(1e-3)).not_expressed)
    muon = export.partition_specs(graph, plan, optimizer=optax.contrib.muon(1e-3))
    assert any(line.startswith("the optimizer's update multiplies whole matrices")
               for line in muon.not_expressed)


def test_a_pipelined_plan_is_refused_with_what_to_do(model):
    from soapjax_zoo import get

    w = get("gpt", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")
    topo = load_topology("tests/meshes/cpu8-nodes.toml")
    strategy = megatron(g, MeshShape.of(topo), intra_node_axes(topo)).with_microbatches(
        2).with_pipeline(2, 1, "1f1b")
    with pytest.raises(PlanError, match="a pipelined plan cannot be exported"):
        export.partition_specs(g, Plan.make(g, topo, strategy))


def test_the_command_writes_json_and_specs(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "mlp", "--size", "tiny", "--mesh", "cpu8", "--costs",
                     "analytic", "--proposals", "20", "--out", str(plan_file)]) == 0
    capsys.readouterr()
    out = tmp_path / "specs.json"
    assert cli.main(["export", "--plan", str(plan_file), "--format", "json",
                     "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    data = json.loads(out.read_text())
    assert data["mesh"] == {"data": 2, "model": 4}
    assert all(isinstance(v, list) for v in data["params"].values())
    assert data["not_expressed"]
    assert cli.main(["export", "--plan", str(plan_file), "--format", "specs"]) == 0
    printed = capsys.readouterr().out
    assert "# not expressed:" in printed
    # Python a script can run (it was "path: spec" lines before, which no script could), the
    # specs laid over the model's own parameters as its comment says, equal to the JSON's
    names: dict = {}
    exec(printed, names)  # noqa: S102  the command's own output
    assert names["MESH_AXES"] == {"data": 2, "model": 4}
    w = zoo.get("mlp", "tiny")
    specs = jax.tree_util.tree_map_with_path(
        lambda path, _: names["PARAM_SPECS"][jax.tree_util.keystr(path)], w.abstract_params())
    flat = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    assert {jax.tree_util.keystr(k): [list(export._axes(e)) for e in spec]
            for k, spec in flat} == data["params"]
    assert set(names["BATCH_SPECS"]) == set(data["batch"])


class NnxBlock(nnx.Module):
    """An nnx MLP with its layers in a list, as libraries write them (names "0", "1", "2")."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(16, 64, rngs=rngs, param_dtype=jnp.float64),
                                nnx.Linear(64, 64, rngs=rngs, param_dtype=jnp.float64),
                                nnx.Linear(64, 16, rngs=rngs, param_dtype=jnp.float64)])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(jax.nn.gelu(x))
        return x


def test_nnx_metadata_shards_a_plain_jit_step_as_the_helper_does():
    with jax.enable_x64(True):
        model = NnxBlock(nnx.Rngs(0))
        batch = {"x": jax.random.normal(jax.random.key(1), (16, 16), jnp.float64),
                 "y": jax.random.normal(jax.random.key(2), (16, 16), jnp.float64)}

        def loss(m, b):
            return jnp.mean((m(b["x"]) - b["y"]) ** 2)

        graphdef, state = nnx.split(model, nnx.Param)

        def pure(p, b):
            return loss(nnx.merge(graphdef, p), b)

        graph = trace(pure, state, batch, name="NnxBlock")
        plan = Plan.make(graph, CPU8, megatron(graph, MeshShape.of(CPU8), ("model",)))
        lines = export.annotate_nnx(model, graph, plan)
        assert lines and "activations' layouts" in lines[0]
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
        assert tuple(specs["layers"][0]["kernel"].get_value()) == (None, "model")
        optimizer = optax.sgd(0.1)
        new, value = _plain_jit_step(graph, plan, pure, state, batch, specs, optimizer)
        run = shard_training(loss, NnxBlock(nnx.Rngs(0)), batch, optimizer, mesh="cpu8",
                             strategy=plan, name="NnxBlock", donate=False)
        want, _, want_value = run.step(run.params, run.opt_state, run.shard_batch(batch))
        _close(new, want)
        _close(value, want_value)
