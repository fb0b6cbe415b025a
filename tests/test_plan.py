"""soapjax.plan: plan files round-trip, and refuse other models and topologies."""

import json

import pytest

import soapjax_zoo as zoo
from soapjax import space
from soapjax.errors import PlanError
from soapjax.graph import trace
from soapjax.plan import Plan
from soapjax.topology import load_topology


@pytest.fixture(scope="module")
def graph():
    w = zoo.get("mlp", "tiny")
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="mlp")


@pytest.fixture(scope="module")
def topo():
    return load_topology("cpu8")


def megatron_like(graph, mesh):
    """Data parallel over the first axis, features over the second."""
    dp = space.data_parallel(graph, space.MeshShape(mesh.axis_names[:1], mesh.axis_sizes[:1]))
    configs = []
    for op, c in zip(graph.operators, dp.configs):
        axes = [list(a) for a in c.axes]
        p = next((d for d in op.divisible_dims if op.iteration_roles[d] == "P"), None)
        if p is not None and op.iteration_sizes[p] % mesh.axis_sizes[1] == 0:
            axes[p].append(mesh.axis_names[1])
        configs.append(space.Config(tuple(tuple(a) for a in axes)))
    return space.Strategy(tuple(configs))


def test_round_trip(graph, topo, tmp_path):
    mesh = space.MeshShape.of(topo)
    strategy = megatron_like(graph, mesh)
    plan = Plan.make(graph, topo, strategy, model_config="tiny",
                     predicted={"step_time_s": 0.5, "peak_memory_bytes": [1, 2]},
                     search={"seed": 3, "budget_s": 1.5}, baselines={"data-parallel": 0.7})
    path = plan.save(tmp_path / "plan.json")
    again = Plan.load(path)
    assert again == plan
    assert again.strategy(graph, topo) == strategy
    assert json.loads(path.read_text())["operators"]["fc1"]["axes"] == [["data"], ["model"], []]
    assert again.to_json() == plan.to_json()


def test_param_specs_follow_the_first_reader(graph, topo):
    mesh = space.MeshShape.of(topo)
    plan = Plan.make(graph, topo, megatron_like(graph, mesh))
    params = dict(plan.params)
    assert params["['params']['fc1']['kernel']"] == ((), ("model",))
    assert params["['params']['fc1']['bias']"] == (("model",),)


def test_zero_axes_shard_replicated_params(graph, topo):
    mesh = space.MeshShape.of(topo)
    dp = space.data_parallel(graph, mesh)
    zero = space.Strategy(dp.configs, zero_axes=("data", "model"))
    specs = space.param_specs(graph, zero, mesh)
    kernel = specs["['params']['fc1']['kernel']"]  # (16, 32): 8-way over its largest dim
    assert sorted(a for dim in kernel for a in dim) == ["data", "model"]


def test_refuses_another_model(graph, topo):
    mesh = space.MeshShape.of(topo)
    plan = Plan.make(graph, topo, space.data_parallel(graph, mesh))
    w = zoo.get("lenet", "tiny")
    other = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="lenet")
    with pytest.raises(PlanError, match=r"made for model 'mlp' \(4 operators.*traces to 'lenet'"):
        plan.strategy(other)


def test_refuses_another_topology(graph, topo):
    mesh = space.MeshShape.of(topo)
    plan = Plan.make(graph, topo, space.data_parallel(graph, mesh))
    with pytest.raises(PlanError, match=r"made for topology 'cpu8'.* not 'p100x16'"):
        plan.strategy(graph, load_topology("p100x16"))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="x"), "not a soapjax plan"),
    (lambda d: d.update(version=99), "version 99 is not supported"),
    (lambda d: d.pop("model"), "malformed plan: KeyError: 'model'"),
    (lambda d: d["operators"]["fc1"].update(axes=[["data"], ["gpu"], []]),
     r"operator 'fc1' uses mesh axes \['gpu'\] not in the plan's mesh"),
])
def test_bad_files(graph, topo, tmp_path, mutate, message):
    plan = Plan.make(graph, topo, space.data_parallel(graph, space.MeshShape.of(topo)))
    data = plan.to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(PlanError, match="no plan file at"):
        Plan.load(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(tmp_path / "x.json")


def test_round_trip_with_microbatches_and_recompute(graph, topo, tmp_path):
    mesh = space.MeshShape.of(topo)
    n = len(graph.operators)
    policies = tuple(("none", "selective", "full")[k % 3] for k in range(n))
    strategy = space.data_parallel(graph, mesh).with_microbatches(2)
    strategy = space.Strategy(strategy.configs, microbatches=2, recompute=policies)
    plan = Plan.make(graph, topo, strategy)
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["microbatches"] == 2
    assert [op.get("recompute", "none") for op in data["operators"].values()] == list(policies)
    again = Plan.load(path)
    assert again == plan and again.strategy(graph, topo) == strategy


def test_old_plan_files_without_the_memory_fields_load(graph, topo, tmp_path):
    mesh = space.MeshShape.of(topo)
    data = Plan.make(graph, topo, space.data_parallel(graph, mesh)).to_json()
    del data["microbatches"]
    assert not any("recompute" in op for op in data["operators"].values())
    plan = Plan.from_json(data)
    strategy = plan.strategy(graph, topo)
    assert (strategy.microbatches, strategy.recompute) == (1, ())
    assert strategy == space.data_parallel(graph, mesh)


def test_bad_memory_fields(graph, topo):
    data = Plan.make(graph, topo, space.data_parallel(graph, space.MeshShape.of(topo))).to_json()
    data["microbatches"] = 0
    with pytest.raises(PlanError, match="microbatches must be an integer >= 1"):
        Plan.from_json(data)
    data["microbatches"] = 1
    data["operators"][graph.operators[0].name]["recompute"] = "some"
    with pytest.raises(PlanError, match=r"recompute\[0\] is 'some'"):
        Plan.from_json(data)
