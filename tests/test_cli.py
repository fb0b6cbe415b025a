"""The command line on user code and on bad input: exit status 2 and one clear line, never a
traceback; a plan file simulates as the plan it holds."""

import json
import re
import textwrap

import pytest

from soapjax import cli
from soapjax.baselines import NAMES

# The README's example, smaller: a ten-line file outside the package.
USER_MODEL = textwrap.dedent('''\
    import flax.linen as nn, jax, jax.numpy as jnp, optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(nn.relu(nn.Dense(32, name="hidden")(x)))

    def make_workload():
        model, x = MLP(), jax.ShapeDtypeStruct((8, 16), jnp.float32)
        batch = {"x": x, "y": jax.ShapeDtypeStruct((8,), jnp.int32)}
        params = jax.eval_shape(model.init, jax.random.key(0), x)
        def loss_fn(params, batch):
            logits = model.apply(params, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss_fn, params, batch
    ''')
PLAN = ["plan", "--mesh", "cpu8", "--costs", "analytic", "--proposals", "50"]


def run(argv, capsys):
    """(exit status, stdout, stderr) of ``soapjax ARGV``."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_code" / "my_model.py"
    path.parent.mkdir()
    path.write_text(USER_MODEL)
    return path


def test_plan_graph_simulate_and_check_user_code_from_a_file(user_file, tmp_path, capsys):
    spec, out = f"{user_file}:make_workload", tmp_path / "plan.json"
    code, stdout, _ = run(PLAN + ["--model", spec, "--out", str(out), "--json"], capsys)
    assert code == 0
    predicted = json.loads(stdout)["step_time_s"]
    plan = json.loads(out.read_text())
    assert plan["model"]["name"] == "my_model" and plan["model"]["workload"] == spec
    assert plan["model"]["config"] == "" and plan["predicted"]["step_time_s"] == predicted
    assert set(plan["operators"]) == {"hidden", "head", "my_model"}
    code, stdout, _ = run(["graph", "--model", spec, "--json"], capsys)
    assert code == 0 and json.loads(stdout)["num_operators"] == 3
    # the plan's model and mesh, and exactly its predicted step
    code, stdout, _ = run(["simulate", "--strategy", str(out), "--costs", "analytic", "--json"],
                          capsys)
    assert code == 0 and json.loads(stdout)["step_time_s"] == predicted
    # check loads the function the plan records, on the 8 test devices
    code, stdout, _ = run(["check", "--plan", str(out), "--costs", "analytic", "--repeats", "1",
                           "--json"], capsys)
    assert code == 0
    checked = json.loads(stdout)
    assert checked["max_abs_diff"] < 1e-5 and checked["predicted_step_s"] == predicted


def test_plan_user_code_as_package_module(user_file, tmp_path, capsys, monkeypatch):
    (user_file.parent / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan.json"
    code, stdout, _ = run(PLAN + ["--model", "user_code.my_model:make_workload", "--out",
                                  str(out)], capsys)
    assert code == 0
    assert "soapjax plan: my_model (batch 8) on cpu8" in stdout
    assert json.loads(out.read_text())["model"]["workload"] == "user_code.my_model:make_workload"


BAD_RETURNS = {  # the function's body, and a regex of the message
    "not-a-tuple": ("return {'loss': 1}", re.escape("must return (loss_fn, params or "
                                                    "nnx.Module, batch[, optimizer]); it "
                                                    "returned dict")),
    "two-items": ("return (lambda p, b: 0.0, {})", "it returned a tuple of 2"),
    "loss-not-callable": ("return (1, {'w': jnp.ones(2)}, {'x': jnp.ones((2, 3))})",
                          "returned int as loss_fn; expected a function"),
    "leaf-not-array": ("return (lambda p, b: 0.0, {'w': 'abc'}, {'x': jnp.ones((2, 3))})",
                       r"params leaf \['w'\] is str; expected an array"),
    "raises": ("raise RuntimeError('no data here')", r"make_workload\(\) raised RuntimeError: "
                                                     r"no data here \(at .*bad\.py:4\)"),
}


@pytest.mark.parametrize("body", list(BAD_RETURNS.values()), ids=list(BAD_RETURNS))
def test_user_functions_that_return_the_wrong_thing(tmp_path, capsys, body):
    code_line, message = body
    path = tmp_path / "bad.py"
    path.write_text(f"import jax.numpy as jnp\n\ndef make_workload():\n    {code_line}\n")
    code, _, err = run(["graph", "--model", f"{path}:make_workload"], capsys)
    assert code == 2
    assert err.startswith(f"soapjax graph: error: --model '{path}:make_workload': ")
    assert err.count("\n") == 1 and re.search(message, err), err


def test_user_code_that_cannot_be_found(user_file, tmp_path, capsys):
    cases = {
        f"{tmp_path}/missing.py:make_workload": f"no file '{tmp_path}/missing.py' (relative "
                                                "paths start at the current directory",
        "no_such_pkg.models:make": "cannot import module 'no_such_pkg.models': no module named "
                                   "'no_such_pkg' on sys.path",
        f"{user_file}:make_model": f"{user_file} has no function 'make_model'; did you mean "
                                   "'make_workload'?",
        f"{user_file}": "expected FILE.py:FUNCTION or package.module:FUNCTION",
    }
    for spec, message in cases.items():
        code, _, err = run(["plan", "--model", spec], capsys)
        assert code == 2 and message in err, (spec, err)
    broken = tmp_path / "broken.py"
    broken.write_text("import numpy\nx = 1 / 0\n")
    code, _, err = run(["simulate", "--model", f"{broken}:f"], capsys)
    assert code == 2 and f"running {broken} raised ZeroDivisionError: division by zero" in err
    code, _, err = run(["plan", "--model", f"{user_file}:make_workload", "--config", "tiny"],
                       capsys)
    assert code == 2 and "is user code: --size and --api are for zoo models" in err
    code, _, err = run(["plan", "--model", "gtp2"], capsys)
    assert code == 2 and "unknown model 'gtp2'" in err and "or user code: FILE.py:FUNCTION" in err


# --- a plan file simulates as the plan it holds -----------------------------------------------


def test_a_plan_made_at_another_batch_size_simulates_from_the_file_alone(tmp_path, capsys):
    """`plan --batch-size 32` records the batch in the file; `simulate --strategy FILE` traces
    the model at it (the graph fingerprint would not match the default batch otherwise)."""
    out = tmp_path / "mlp32.json"
    code, stdout, _ = run(PLAN + ["--model", "mlp", "--config", "tiny", "--batch-size", "32",
                                  "--out", str(out), "--json"], capsys)
    assert code == 0
    assert json.loads(out.read_text())["model"]["batch_size"] == 32
    code, simulated, _ = run(["simulate", "--strategy", str(out), "--costs", "analytic",
                              "--json"], capsys)
    assert code == 0
    assert json.loads(simulated)["step_time_s"] == json.loads(stdout)["step_time_s"]


def test_plan_with_pipelines_writes_stages_and_simulates_them_from_the_file(tmp_path, capsys):
    """`plan --pipelines` on 4 DGX nodes: the tiny GPT's plan (whatever it picks) records its
    pipeline; `simulate --strategy FILE` predicts the same step time, and a pipelined plan
    says so in both reports."""
    out = tmp_path / "gpt.json"
    argv = ["plan", "--model", "gpt", "--size", "tiny", "--batch-size", "16", "--mesh",
            "dgx-a100x3072-32", "--costs", "analytic", "--proposals", "10", "--pipelines",
            "--out", str(out)]
    code, report, _ = run(argv, capsys)
    assert code == 0
    saved = json.loads(out.read_text())
    stages = saved["pipeline"]["stages"]
    assert ("pipeline: " in report) == (stages > 1)
    code, stdout, _ = run(argv + ["--json"], capsys)
    planned = json.loads(stdout)
    code, simulated, _ = run(["simulate", "--strategy", str(out), "--costs", "analytic",
                              "--json"], capsys)
    assert code == 0 and json.loads(simulated)["step_time_s"] == planned["step_time_s"]


def test_plan_then_simulate_gives_the_plans_predicted_time(tmp_path, capsys):
    out = tmp_path / "mlp.json"
    code, stdout, _ = run(PLAN + ["--model", "mlp", "--config", "tiny", "--out", str(out),
                                  "--json"], capsys)
    assert code == 0
    planned = json.loads(stdout)
    assert planned["step_time_s"] < planned["baselines"]["data-parallel"]  # not data parallel
    for extra in ([], ["--model", "mlp", "--config", "tiny", "--mesh", "cpu8"]):
        code, stdout, _ = run(["simulate", "--strategy", str(out), "--costs", "analytic",
                               "--json"] + extra, capsys)
        assert code == 0
        assert json.loads(stdout)["step_time_s"] == planned["step_time_s"]  # exactly
    code, _, err = run(["simulate", "--strategy", str(out), "--model", "mlp", "--config",
                        "tiny", "--mesh", "cpu4"], capsys)
    assert code == 2 and "this plan was made for topology 'cpu8'" in err


@pytest.mark.parametrize("content", ['{"configs_": {}}', "[1, 2]", '{"format": "other"}', "{}"],
                         ids=["wrong-key", "a-list", "other-format", "empty"])
def test_json_that_is_not_a_plan_is_refused(tmp_path, capsys, content):
    path = tmp_path / "x.json"
    path.write_text(content)
    code, _, err = run(["simulate", "--model", "mlp", "--config", "tiny", "--strategy",
                        str(path)], capsys)
    assert code == 2 and err.startswith("soapjax simulate: error: ")
    assert "soapjax plan" in err or "expected a JSON object" in err


def test_simulate_takes_every_baseline_by_name(capsys):
    base = ["simulate", "--model", "mlp", "--config", "tiny", "--costs", "analytic", "--json"]
    times = {}
    for name in NAMES:
        code, stdout, _ = run(base + ["--strategy", name], capsys)
        assert code == 0
        times[name] = json.loads(stdout)["step_time_s"]
    assert len(set(times.values())) > 1  # not data parallelism under other names
    code, _, err = run(base + ["--strategy", "zero3"], capsys)
    assert code == 2
    names = "data-parallel, megatron, fsdp, megatron-sp, fsdp-recompute, expert-cnn, expert-rnn"
    assert f"expected a baseline ({names})" in err
    assert cli.main(["simulate", "--help"]) == 0
    assert names.replace(" ", "") in "".join(capsys.readouterr().out.split())  # wrapped


def test_batch_size_and_a_cut_cluster_reach_the_simulation(capsys):
    base = ["simulate", "--model", "gpt", "--size", "tiny", "--costs", "analytic", "--json",
            "--mesh", "dgx-a100x3072-64", "--strategy", "megatron-sp"]
    code, small, _ = run(base, capsys)  # batch 8 over 8 nodes
    code2, big, _ = run(base + ["--batch-size", "512"], capsys)
    assert code == code2 == 0
    small, big = json.loads(small), json.loads(big)
    assert big["step_time_s"] > small["step_time_s"]
    assert big["memory"]["activations"] > 50 * small["memory"]["activations"]  # 64 x the batch
    code, _, err = run(base + ["--batch-size", "0"], capsys)
    assert code == 2 and "argument --batch-size: expected an integer >= 1" in err
    assert cli.main(["plan", "--help"]) == 0
    assert "NAME-NisitsfirstNdevices" in "".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, message", [
    (["plan", "--budget", "-3"], "argument --budget: expected a number of seconds >= 0, "
                                 "got '-3'"),
    (["plan", "--budget", "nan"], "argument --budget: expected a number of seconds >= 0"),
    (["plan", "--budget", "soon"], "argument --budget: expected a number of seconds >= 0, got "
                                   "'soon'"),
    (["plan", "--proposals", "0"], "argument --proposals: expected an integer >= 1, got '0'"),
    (["plan", "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
    (["check", "--plan", "p.json", "--repeats", "0"], "argument --repeats: expected an "
                                                      "integer >= 1"),
], ids=["negative-budget", "nan-budget", "word-budget", "zero-proposals", "negative-seed",
        "zero-repeats"])
def test_nonsense_numbers_are_usage_errors(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err and err.startswith("usage: soapjax")


def test_a_file_that_cannot_be_written_is_an_error_not_a_traceback(tmp_path, capsys):
    trace_file = tmp_path / "no" / "such" / "dir" / "trace.json"
    code, _, err = run(["simulate", "--model", "mlp", "--config", "tiny", "--costs", "analytic",
                        "--trace", str(trace_file)], capsys)
    assert code == 2
    assert err == f"soapjax simulate: error: No such file or directory: {trace_file}\n"
