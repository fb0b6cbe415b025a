"""soapjax.strategy.plan: plan files round-trip, and refuse other models and topologies."""

import dataclasses
import json

import pytest

import soapjax_zoo as zoo
from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import trace
from soapjax.strategy import space
from soapjax.strategy.plan import Plan, untied_layers, untied_warning
from soapjax.topology.cluster import load_topology


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
    with pytest.raises(PlanError, match=r"made for topology 'cpu8'.* but the topology given is "
                       r"'p100x16' from .*p100x16.toml .*: its mesh is \{node: 4, gpu: 4\}"):
        plan.strategy(graph, load_topology("p100x16"))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="x"), "not a soapjax plan"),
    (lambda d: d.update(version=99), r'"version" must be the integer 1 .*found 99'),
    (lambda d: d.update(version="1"), r'"version" must be the integer 1 .*found the string \'1\''),
    (lambda d: d.pop("model"), r"model is missing; a plan file has it"),
    (lambda d: d.pop("topology"), r"topology is missing"),
    (lambda d: d.update(operators=[]), r"operators: expected a JSON object \(\{\.\.\.\}\), "
     r"found \[\]"),
    (lambda d: d["operators"]["fc1"].update(axes=[["data"], ["gpu"], []]),
     r"operators.fc1.axes\[1\]: mesh axes \['gpu'\] are not in the plan's mesh"),
    (lambda d: d["operators"]["fc1"].update(axes="data"),
     r"operators.fc1.axes: expected one list of mesh axis names per dim"),
    (lambda d: d["operators"]["fc1"].update(axes=[["data"], ["data"], []]),
     r"operators.fc1.axes: mesh axis 'data' splits two dims"),
    (lambda d: d["operators"]["fc1"].update(recompute="sometimes"),
     r"operators.fc1.recompute: expected one of 'none', 'selective', 'full', found 'sometimes'"),
    (lambda d: d["model"].update(batch_size=0), r"model.batch_size: expected an integer >= 1, "
     "found 0"),
    (lambda d: d.update(microbatches=2.5), r"microbatches: expected an integer >= 1, found 2.5"),
    (lambda d: d["params"].update({"['params']['fc1']['kernel']": [["gpu"], []]}),
     r"params.\['params'\]\['fc1'\]\['kernel'\]\[0\]: mesh axes \['gpu'\] are not in"),
    (lambda d: d.update(zero_axes="data"), r"zero_axes: expected a list of mesh axis names"),
    (lambda d: d.update(ring_attention="yes"), r"ring_attention: expected true or false"),
    (lambda d: d["pipeline"].update(stages=1.5), r"pipeline.stages: expected an integer >= 1"),
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
    with pytest.raises(PlanError, match="microbatches: expected an integer >= 1, found 0"):
        Plan.from_json(data)
    data["microbatches"] = 1
    name = graph.operators[0].name
    data["operators"][name]["recompute"] = "some"
    with pytest.raises(PlanError, match=rf"operators.{name}.recompute: expected one of"):
        Plan.from_json(data)


# --- configs bind to operators by name ----------------------------------------------------------


def _megatron_plan(graph, topo) -> Plan:
    mesh = space.MeshShape.of(topo)
    n = len(graph.operators)
    strategy = megatron_like(graph, mesh)
    policies = tuple(("selective", "none")[k % 2] for k in range(n))
    return Plan.make(graph, topo, space.Strategy(strategy.configs, recompute=policies))


def test_configs_bind_by_name_not_position(graph, topo):
    plan = _megatron_plan(graph, topo)
    data = plan.to_json()
    data["operators"] = dict(reversed(data["operators"].items()))  # an edited file's order
    again = Plan.from_json(data)
    assert [n for n, _ in again.configs] == [op.name for op in reversed(graph.operators)]
    assert again.strategy(graph, topo) == plan.strategy(graph, topo)
    assert again.strategy(graph, topo).recompute == plan.recompute


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["operators"].update(fc1x=d["operators"].pop("fc1")),
     r"config for operator 'fc1x', which model 'mlp' does not have; did you mean 'fc1'\?"),
    (lambda d: d["operators"].update(extra=dict(d["operators"]["fc2"])),
     (r"config for operator 'extra', which model 'mlp' does not have \(expected one config per "
      r"operator, by name: 'fc1', 'fc2', 'head', 'mlp'\)")),
    (lambda d: d["operators"].pop("head"),
     r"no config for 1 operator\(s\) of model 'mlp': 'head'; expected one config per operator"),
    (lambda d: d["topology"].update(axes={"data": 4, "model": 2}),
     (r"mesh axes \{data: 4, model: 2\} differ from those of its topology 'cpu8', "
      r"\{data: 2, model: 4\}.*make a new plan")),
], ids=["renamed", "extra", "missing", "mesh-axes"])
def test_edited_operators_and_mesh_are_refused(graph, topo, edit, message):
    data = _megatron_plan(graph, topo).to_json()
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_json(data).strategy(graph, topo)


def test_a_spec_that_disagrees_with_the_axes_is_refused(graph, topo):
    data = _megatron_plan(graph, topo).to_json()
    assert data["operators"]["fc1"]["spec"] == "P('data', 'model')"
    data["operators"]["fc1"]["spec"] = 'P( "data" , "model")'  # spelling does not matter
    Plan.from_json(data)
    data["operators"]["fc1"]["spec"] = "P('model', None)"
    with pytest.raises(PlanError, match=r"plan: operator 'fc1' has spec \"P\('model', None\)\", "
                       r"but its axes \[\['data'\], \['model'\], \[\]\] give \"P\('data', "
                       r"'model'\)\".*edit \"axes\""):
        Plan.from_json(data)


def test_an_operator_twice_in_the_file_is_refused(graph, topo, tmp_path):
    text = json.dumps(_megatron_plan(graph, topo).to_json())
    entry = json.dumps({"axes": [[], [], []]})
    path = tmp_path / "twice.json"
    path.write_text(text.replace('"operators": {', f'"operators": {{"fc2": {entry}, ', 1))
    with pytest.raises(PlanError, match=f"{path}: key 'fc2' appears twice in one JSON object"):
        Plan.load(path)


def test_load_and_save_name_the_path_not_a_temp_file(graph, topo, tmp_path):
    plan = _megatron_plan(graph, topo)
    with pytest.raises(PlanError, match=f"{tmp_path} is a directory; expected a plan file"):
        Plan.load(tmp_path)
    with pytest.raises(PlanError, match=f"cannot write the plan to {tmp_path}: it is a "
                       "directory; expected a file path"):
        plan.save(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(PlanError, match=f"cannot write the plan to {tmp_path}/file/p.json: "):
        plan.save(tmp_path / "file" / "p.json")
    (tmp_path / "latin1.json").write_bytes(b'{"format": "\xff"}')
    with pytest.raises(PlanError, match=r"latin1.json: not a plan file \(byte 12 is not UTF-8"):
        Plan.load(tmp_path / "latin1.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "latin1.json"]


def test_a_deeply_nested_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000)
    with pytest.raises(PlanError, match=r"deep.json: not valid JSON \(nested too deeply"):
        Plan.load(path)


def test_a_layer_reading_its_stacked_slice_in_another_layout_is_named():
    # tiny GPT, 2 scanned layers: fc1's stacked kernel [2, 32, 128] is stored as layer 0 reads
    # it (column parallel: its ffn dim over model); layer 1 row parallel reads its slice with
    # the contracted dim over model, a move XLA makes every step and the simulator does not
    # price; the bias [2, 128] is read split in layer 0, whole in layer 1
    w = zoo.get("gpt", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")
    D, M = ("data",), ("model",)
    MESH = space.MeshShape(("data", "model"), (2, 4))
    first, last = next(grp for grp in g.repeated_blocks()
                       if g.operators[grp[0]].name.endswith("fc1"))
    base = space.data_parallel(g, MESH)
    edited = list(base.configs)
    edited[first], edited[last] = space.Config((D, (), M, ())), space.Config((D, (), (), M))
    untied = untied_layers(g, dataclasses.replace(base, configs=tuple(edited)))
    kernel = [u for u in untied if u[0].endswith("['kernel']")]
    assert kernel == [(kernel[0][0], (1,), ((), M), (M, ()))]
    assert "fc1" in kernel[0][0] and {u[1] for u in untied} == {(1,)} and len(untied) == 2
    text = untied_warning(g, dataclasses.replace(base, configs=tuple(edited)))
    assert text.startswith(f"warning: layer 1 of stacked parameter {untied[0][0]} is read split")
    assert "and 1 more" in text and "tie_blocks" in text
    tied = space.tie_blocks(g, dataclasses.replace(base, configs=tuple(edited)))
    assert untied_layers(g, tied) == [] and untied_warning(g, tied) is None
    assert untied_layers(g, base) == []


def test_a_pipelined_plan_file_is_read_on_one_stage_s_mesh(tmp_path):
    """A pipelined plan's configs name one stage's devices: on 4 DGX nodes cut into 2 stages
    a stage's ``node`` axis is 2, so the embedding's 8 features split over node x model
    (2 x 4) fit a stage, where the whole cluster's node x model would be 16 ways. Read back
    from its file it is the same strategy (it was refused as 16 ways)."""
    from soapjax.strategy._strategy_file import parse_strategy
    from soapjax.strategy.baselines import megatron_3d

    w = zoo.get("gpt", "tiny", batch_size=16)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    topo = load_topology("dgx-a100x3072-32")
    strategy = megatron_3d(g, topo, tp=4, pp=2, microbatch_size=2, recompute="none")
    i = g.index("wte")
    axes = [() for _ in g.operators[i].iteration_sizes]
    axes[1] = ("node", "model")
    configs = list(strategy.configs)
    configs[i] = space.Config(tuple(axes))
    strategy = dataclasses.replace(strategy, configs=tuple(configs))
    path = Plan.make(g, topo, strategy, model_config="tiny").save(tmp_path / "plan.json")
    again = parse_strategy(g, topo, str(path))
    assert again == strategy and again.configs[i].axes[1] == ("node", "model")
    edited = json.loads(path.read_text())
    edited["operators"]["wte"]["axes"][1] = ["node", "data", "model"]  # 16 ways in a stage
    del edited["operators"]["wte"]["spec"]
    path.write_text(json.dumps(edited))
    with pytest.raises(PlanError, match="'wte': dim 1 of size 8 .* cannot be split 16 ways"):
        parse_strategy(g, topo, str(path))
