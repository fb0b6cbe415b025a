"""A loss that returns values beside it (``has_aux=True``): metrics and a linen model's updated
batch statistics, computed inside the sharded step and handed back, exactly as
``jax.value_and_grad(loss_fn, has_aux=True)`` computes them on one device.

The model is a small linen CNN with BatchNorm in training mode (batch statistics), written the
way Flax's examples write it: ``model.apply(..., mutable=["batch_stats"])`` inside the loss, the
updated statistics and the batch's accuracy returned as the aux. In float64, every gradient
leaf, every aux leaf and the loss are held to the unsharded step's, each relative to its own
scale, under data parallelism, Megatron, FSDP and a searched plan on ``cpu8``, and on one
device.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import soapjax_zoo as zoo
from soapjax import SearchSettings, find_plan, training
from soapjax.apply.step import validate_strategy
from soapjax.base.errors import PlanError, TraceError
from soapjax.exactness import compare_gradients
from soapjax.graph.opgraph import trace
from soapjax.search.pipelines import stage_choices
from soapjax.strategy import memory
from soapjax.strategy.baselines import megatron_3d
from soapjax.strategy.plan import Plan
from soapjax.strategy.space import MeshShape, data_parallel
from soapjax.topology.cluster import load_topology, make_mesh

OPTIONS = {"xla_backend_optimization_level": 0}


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), padding=1, use_bias=False, param_dtype=x.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9,
                                 param_dtype=x.dtype)(x))
        x = nn.Conv(8, (3, 3), strides=(2, 2), padding=1, use_bias=False,
                    param_dtype=x.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, param_dtype=x.dtype)(x))
        x = x.mean(axis=(1, 2))
        x = nn.relu(nn.Dense(16, param_dtype=x.dtype)(x))
        return nn.Dense(4, param_dtype=x.dtype)(x)


def _workload(dtype=jnp.float64):
    model = Net()
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    images = jax.random.normal(kx, (8, 8, 8, 3), dtype)
    labels = jax.random.randint(ky, (8,), 0, 4)
    variables = model.init(kp, images)
    stats = variables["batch_stats"]

    def loss_fn(params, batch):
        logits, updates = model.apply({"params": params, "batch_stats": stats}, batch["image"],
                                      mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
        return loss, {"batch_stats": updates["batch_stats"], "accuracy": accuracy}

    return loss_fn, variables["params"], {"image": images, "label": labels}


def _relative(got, want) -> float:
    """The largest leaf error, each leaf against its own scale."""
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        worst = max(worst, float(np.max(np.abs(g - w))) / (float(np.max(np.abs(w))) or 1.0))
    return worst


@pytest.mark.parametrize("strategy", ["data-parallel", "megatron", "fsdp", "plan"])
def test_metrics_and_batch_statistics_come_back_from_the_sharded_step_exactly(strategy,
                                                                              tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("SOAPJAX_CACHE_DIR", str(tmp_path))
    with jax.enable_x64(True):
        loss_fn, params, batch = _workload()
        sgd = optax.sgd(1.0)  # the update is the gradient: parameters before - after
        run = training.shard_training(loss_fn, params, batch, sgd, mesh="cpu8",
                                      strategy=strategy, costs="analytic",
                                      search=SearchSettings(max_proposals=50, seed=0),
                                      compiler_options=OPTIONS, verify=True, has_aux=True)
        assert run.strategy.microbatches == 1 and not run.strategy.pipelined
        new_params, _, (loss, aux) = run.step(run.params, run.opt_state, run.shard_batch(batch))
        (want_loss, want_aux), want_grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
            params, batch)
        before = Net().init(jax.random.key(0), batch["image"])["batch_stats"]
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-13)
    assert jax.tree.structure(aux) == jax.tree.structure(want_aux)
    assert _relative(aux, want_aux) <= 1e-12
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new_params)
    assert _relative(grads, want_grads) <= 1e-12
    # the statistics are this batch's, not the initial ones: the aux really comes back
    assert _relative(aux["batch_stats"], before) > 0.01


def test_one_device_computes_the_unsharded_aux():
    with jax.enable_x64(True):
        loss_fn, params, batch = _workload()
        run = training.shard_training(loss_fn, params, batch, optax.adam(1e-3), mesh="cpu8-1",
                                      strategy="data-parallel", compiler_options=OPTIONS,
                                      verify=True, has_aux=True)
        _, _, (loss, aux) = run.step(run.params, run.opt_state, run.shard_batch(batch))
        (want_loss, want_aux), _ = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-13)
    assert _relative(aux, want_aux) <= 1e-12


def test_a_graph_with_aux_keeps_one_microbatch_and_no_stages():
    loss_fn, params, batch = _workload(jnp.float32)
    graph = trace(loss_fn, params, batch, has_aux=True)
    assert graph.has_aux and len(graph.program.outputs) == 1 + 5  # loss, 4 statistics, accuracy
    # a plan cached for the loss alone (microbatches, stages) is never read for a graph with
    # aux values, even where they add no operator (the labels handed back as they came)
    def loss_alone(p, b):
        return loss_fn(p, b)[0]

    def with_labels(p, b):
        return loss_alone(p, b), b["label"]

    alone = trace(loss_alone, params, batch, name="net")
    labelled = trace(with_labels, params, batch, name="net", has_aux=True)
    assert [op.name for op in alone.operators] == [op.name for op in labelled.operators]
    assert alone.fingerprint() != labelled.fingerprint()
    # a plan file says which, and binding it to the other names the difference
    topo = load_topology("cpu8")
    plan = Plan.from_json(Plan.make(labelled, topo, data_parallel(labelled, MeshShape.of(topo))
                                    ).to_json())
    assert plan.aux_outputs == 1
    with pytest.raises(PlanError, match=r"the plan's loss returned \(loss, aux\) with 1 aux "
                                        r"leaves, this function returns its loss alone"):
        plan.validate_for(alone)
    assert memory.microbatch_choices(graph) == (1,)
    dp = data_parallel(graph, MeshShape.of(topo))
    with pytest.raises(PlanError, match=r"returns values beside its loss \(has_aux\): 2 "
                                        r"microbatches would compute them per microbatch"):
        validate_strategy(graph, dp.with_microbatches(2), make_mesh(topo))


def test_a_pipelined_strategy_is_refused_for_a_graph_with_aux(tmp_path, monkeypatch):
    monkeypatch.setenv("SOAPJAX_CACHE_DIR", str(tmp_path))
    w = zoo.get("gpt", "tiny")

    def with_metric(params, batch):
        loss = w.loss_fn(params, batch)
        return loss, {"perplexity": jnp.exp(loss)}

    graph = trace(with_metric, w.abstract_params(), w.abstract_batch(), has_aux=True)
    topo = load_topology("cpu8")
    strategy = megatron_3d(graph, topo, tp=4, pp=2, recompute="none")
    with pytest.raises(PlanError, match=r"returns values beside its loss \(has_aux\), which a "
                                        r"pipeline does not hand back"):
        validate_strategy(graph, strategy, make_mesh(topo))
    # where nothing fits, the error says why stages and microbatches were not tried
    states = 4 * sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in graph.params)
    tight = dataclasses.replace(topo, device=dataclasses.replace(
        topo.device, memory_bytes=states // topo.num_devices + 1000))
    with pytest.raises(PlanError, match=r"no strategy found .*; its loss returns values beside "
                                        r"it \(has_aux\), so plans keep one microbatch and no "
                                        r"pipeline stages"):
        find_plan(graph, tight, settings=SearchSettings(max_proposals=5, seed=0),
                  costs="analytic")
    # and the search, asked for pipelines, offers none (the loss alone would have them)
    plain = trace(w.loss_fn, w.abstract_params(), w.abstract_batch())
    assert stage_choices(plain, topo) and stage_choices(graph, topo) == ()
    plan = find_plan(graph, topo, settings=SearchSettings(pipelines=True, max_proposals=20,
                                                          seed=0), costs="analytic")
    assert plan.pipeline[0] == 1 and plan.microbatches == 1


def test_trace_says_what_to_do_with_a_pair_and_refuses_a_pair_that_is_not_one():
    loss_fn, params, batch = _workload(jnp.float32)
    with pytest.raises(TraceError, match=r"must return a scalar loss, but returned .*; for a loss "
                                         r"with other values .* pass has_aux=True"):
        trace(loss_fn, params, batch)

    def three(p, b):
        return loss_fn(p, b) + (1.0,)

    with pytest.raises(TraceError, match=r"\(has_aux=True\) must return a pair \(loss, aux\), "
                                         r"but returned a tuple of 3"):
        trace(three, params, batch, has_aux=True)

    def logits_as_loss(p, b):
        loss, aux = loss_fn(p, b)
        return jnp.stack([loss, loss]), aux

    with pytest.raises(TraceError, match=r"must return \(loss, aux\) with a scalar loss"):
        trace(logits_as_loss, params, batch, has_aux=True)


def test_a_wrong_aux_fails_the_comparison_though_the_gradients_agree():
    grads = {"w": np.ones(3)}
    aux = {"mean": np.array([1.0, 2.0]), "count": np.array(8)}
    good = compare_gradients(1.0, grads, 1.0, grads, tolerance=1e-12, aux=aux, reference_aux=aux)
    assert good.passed and [e.path for e in good.aux] == ["aux['count']", "aux['mean']"]
    scaled = {"mean": aux["mean"] * 4, "count": aux["count"]}
    bad = compare_gradients(1.0, grads, 1.0, grads, tolerance=1e-12, aux=scaled,
                            reference_aux=aux)
    assert not bad.passed and bad.max_error == pytest.approx(3.0)
    assert "worst aux value aux['mean'] 3 of its scale 2" in bad.describe()


USER_FILE = '''
import flax.linen as nn, jax, jax.numpy as jnp, optax

class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(8, use_bias=False)(x)))
        return nn.Dense(4)(x)

MODEL = Net()
X = jax.random.normal(jax.random.key(0), (8, 6))
Y = jax.random.randint(jax.random.key(1), (8,), 0, 4)
VARIABLES = MODEL.init(jax.random.key(2), X)

def loss_fn(params, batch):
    logits, updates = MODEL.apply({"params": params, "batch_stats": VARIABLES["batch_stats"]},
                                  batch["x"], mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    accuracy = jnp.mean(logits.argmax(-1) == batch["y"])
    return loss, {"stats": updates["batch_stats"], "accuracy": accuracy}

def make_workload():
    return loss_fn, VARIABLES["params"], {"x": X, "y": Y}
'''


def test_a_users_file_whose_loss_returns_aux_plans_on_the_command_line_and_binds(
        tmp_path, monkeypatch, capsys):
    """`soapjax plan --model file.py:make_workload` of a loss returning (loss, aux) plans it
    as has_aux (its graph holds the aux's operators), and the plan file binds in
    shard_training(has_aux=True) of the same function."""
    from soapjax import cli
    from soapjax.strategy.plan import Plan

    monkeypatch.setenv("SOAPJAX_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "bn_user.py").write_text(USER_FILE)
    spec = f"{tmp_path / 'bn_user.py'}:make_workload"
    assert zoo.load(spec).has_aux
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", spec, "--mesh", "cpu8", "--costs", "analytic",
                     "--proposals", "20", "--out", str(out)]) == 0
    assert ("note: the loss returns values beside it (planned as has_aux=True: run it with "
            "shard_training(..., has_aux=True))") in capsys.readouterr().out
    plan = Plan.load(str(out))
    module = zoo.load(spec)  # the user's module, imported as the command line imports it
    loss_fn = module.loss_fn
    params, batch = module.init_params(jax.random.key(0)), module.make_batch(jax.random.key(1))
    run = training.shard_training(loss_fn, params, batch, optax.sgd(0.1), mesh="cpu8",
                                  strategy=plan, compiler_options=OPTIONS, has_aux=True)
    _, _, (loss, aux) = run.step(run.params, run.opt_state, run.shard_batch(batch))
    (want_loss, want_aux), _ = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert _relative(aux, want_aux) <= 1e-5


# flax's BatchNorm keeps float32 statistics and writes the float64 batch's into them
@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")
def test_an_nnx_model_hands_back_its_batch_statistics_to_update_it_with():
    """nnx's BatchNorm updates its `BatchStat`s in the model the loss merges; returned as the
    aux (``nnx.state(model, nnx.BatchStat)``) they come back from the sharded step, and
    ``nnx.update`` writes them into the user's model. Each step's are one update of the
    statistics the model had at `shard_training` (traced into the step as constants), not a
    running average across steps: the second step's are the first model's update on the
    second batch (docs/apply.md says how to keep a running average)."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            kw = {"rngs": rngs, "param_dtype": jnp.float64}
            self.fc1 = nnx.Linear(6, 8, use_bias=False, **kw)
            self.bn = nnx.BatchNorm(8, use_running_average=False, **kw)
            self.fc2 = nnx.Linear(8, 4, **kw)

        def __call__(self, x):
            return self.fc2(nnx.relu(self.bn(self.fc1(x))))

    def loss_fn(model, batch):
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, nnx.state(model, nnx.BatchStat)

    with jax.enable_x64(True):
        model = Net(nnx.Rngs(0))
        batch = {"x": jax.random.normal(jax.random.key(0), (8, 6), jnp.float64),
                 "y": jax.random.randint(jax.random.key(1), (8,), 0, 4)}
        run = training.shard_training(loss_fn, model, batch, optax.sgd(0.1), mesh="cpu8",
                                      strategy="fsdp", compiler_options=OPTIONS, verify=True,
                                      has_aux=True)
        first = nnx.clone(model)
        params, opt_state, (loss, stats) = run.step(run.params, run.opt_state,
                                                    run.shard_batch(batch))
        want_loss, want_stats = loss_fn(nnx.clone(first), batch)
        other = {"x": batch["x"] * 2.0 + 1.0, "y": batch["y"]}
        stepped = nnx.clone(first)  # the step's parameters, the first statistics
        nnx.update(stepped, jax.tree.map(np.asarray, run.model_params(params)))
        _, want_second = loss_fn(stepped, other)
        _, _, (_, second) = run.step(params, opt_state, run.shard_batch(other))
    assert _relative(second, want_second) <= 1e-6
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-13)
    assert _relative(stats, want_stats) <= 1e-6  # BatchStats are float32
    assert float(np.abs(model.bn.mean[...]).max()) == 0.0  # the initial running mean
    nnx.update(model, stats)
    np.testing.assert_array_equal(model.bn.mean[...], want_stats["bn"]["mean"][...])
