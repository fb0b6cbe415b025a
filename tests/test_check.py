"""soapjax check: a plan applied on cpu8 against the unsharded step and the simulator."""

import json

import pytest

import soapjax_zoo as zoo
from soapjax import cli, space
from soapjax.errors import PlanError
from soapjax.graph import trace
from soapjax.plan import Plan
from soapjax.topology import load_topology


@pytest.fixture(scope="module")
def megatron_plan(tmp_path_factory):
    """fc1 column parallel, fc2 row parallel over `model`, batch over `data`."""
    w = zoo.get("mlp", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="mlp")
    topo = load_topology("cpu8")
    by_name = {"fc1": (("data",), ("model",), ()), "fc2": (("data",), (), ("model",)),
               "head": (("data",), (), ()), "mlp": ((), ("data",))}
    strategy = space.Strategy(tuple(space.Config(by_name[op.name]) for op in g.operators))
    path = tmp_path_factory.mktemp("plans") / "mlp.json"
    Plan.make(g, topo, strategy, model_config="tiny").save(path)
    return path


def test_check_json(megatron_plan, capsys):
    argv = ["check", "--plan", str(megatron_plan), "--costs", "analytic", "--reshard", "ideal",
            "--repeats", "2", "--json"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"max_abs_diff", "hlo_collective_bytes", "predicted_collective_bytes",
            "measured_step_s", "predicted_step_s"} <= set(data)
    assert data["max_abs_diff"] < 1e-5
    assert data["loss"] == pytest.approx(data["reference_loss"], rel=1e-6)
    # row-parallel fc2 forward, column-parallel fc1's input cotangent, data-parallel gradients:
    # all all-reduces, and the simulator predicts XLA's bytes
    assert set(data["hlo_collectives"]) == {"all_reduce"}
    assert data["predicted_collective_bytes"] == pytest.approx(data["hlo_collective_bytes"],
                                                               rel=0.10)
    # all-reduces over 2 (gradients) and over 4 (partial sums) devices: a ring all-reduce sends
    # 2(n-1)/n of its buffer, so fewer bytes than the buffers add up to
    assert 0 < data["hlo_sent_bytes"] < 2 * data["hlo_collective_bytes"]
    assert data["predicted_sent_bytes"] == pytest.approx(data["hlo_sent_bytes"], rel=0.10)


def test_check_refuses_a_plan_for_other_devices(tmp_path):
    w = zoo.get("mlp", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="mlp")
    topo = load_topology("dgx-h100x8")
    path = Plan.make(g, topo, space.data_parallel(g, space.MeshShape.of(topo)),
                     model_config="tiny").save(tmp_path / "gpu.json")
    assert cli.main(["check", "--plan", str(path)]) == 2


def test_check_refuses_unknown_models(megatron_plan, tmp_path):
    data = json.loads(megatron_plan.read_text())
    data["model"]["name"] = "mine"
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="model 'mine', which is not in the zoo"):
        zoo.for_plan(Plan.load(tmp_path / "p.json"))
