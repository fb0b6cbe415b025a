"""The command line on user code and on bad input: exit status 2 and one clear line, never a
traceback; a plan file simulates as the plan it holds."""

import json
import re
import textwrap
import warnings

import pytest

from soapjax import cli
from soapjax.strategy.baselines import NAMES

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


def test_the_plan_header_says_how_shard_programs_were_priced():
    """Measured costs: how many shard programs were measured, read from the cache, estimated
    after the measuring budget or priced by a fallback (analytic costs: nothing to say)."""
    stats = {"measured": 4, "disk_hits": 20, "shared": 3, "fallbacks": 1,
             "updates_measured": 2, "estimated": 7}
    frozen = tuple(sorted(stats.items()))  # as a loaded plan holds it
    assert cli._cost_counts({"cost_stats": frozen}) == (
        " (4 shard programs measured now, 20 from the cache, 7 estimated after the measuring "
        "budget, 1 priced by fallback)")
    assert cli._cost_counts({"cost_stats": dict.fromkeys(stats, 0)}) == ""
    assert cli._cost_counts({}) == ""


def test_the_plan_says_when_its_prediction_rests_on_estimated_operators():
    """A plan searched with measured costs whose budget ran out before some of its own
    operators were measured says so, names them, and says how to measure them (`soapjax
    simulate` of the plan, which then predicts another time: a user's MLP-Mixer on cpu8 at an
    8 s budget, 12.1 ms planned against 8.5 ms simulated); a plan with none says nothing."""
    names = ("Conv_0", "0/LayerNorm_0", "0/Dense_0", "0/Dense_1", "1/Dense_0")
    note = cli._estimated_note({"estimated_operators": names}, "mixer.json")
    assert note == (
        "note: 5 of the plan's operators are priced by estimate, not measured (the measuring "
        "budget ran out: Conv_0, 0/LayerNorm_0, 0/Dense_0, 0/Dense_1 and 1 more); `soapjax "
        "simulate --strategy mixer.json` measures them and may predict another step time; a "
        "larger --budget, or `soapjax profile` first, measures them during the search")
    assert cli._estimated_note({"estimated_operators": ()}, "mixer.json") is None
    assert cli._estimated_note({}, None) is None


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


# An attention LM without positions, its batch ShapeDtypeStructs: drawn tokens all zero made
# every position alike, so its queries' and keys' gradients were zero and check could not see
# them.
ATTENTION_LM = textwrap.dedent('''\
    import flax.linen as nn, jax, jax.numpy as jnp, optax

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, 16, name="embed")(tokens)
            q, k, v = (nn.Dense(16, name=n)(x) for n in "qkv")
            s = jnp.einsum("btd,bsd->bts", q, k) / 4.0
            x = x + jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((8, 8), bool)), s, -1e9)) @ v
            return nn.Dense(64, name="head")(x)

    def make_workload():
        tokens = jax.ShapeDtypeStruct((8, 8), jnp.int32)
        lengths = jax.ShapeDtypeStruct((8,), jnp.int32)
        batch = {"tokens": tokens, "targets": tokens, "lengths": lengths}
        params = LM().init(jax.random.key(0), jnp.zeros((8, 8), jnp.int32))
        def loss_fn(params, batch):
            ce = optax.softmax_cross_entropy_with_integer_labels(
                LM().apply(params, batch["tokens"]), batch["targets"])
            keep = jnp.arange(8) < 8 - batch["lengths"][:, None] % 2
            return jnp.where(keep, ce, 0.0).sum() / keep.sum()
        return loss_fn, params, batch
    ''')


def test_drawn_integers_are_indices_below_what_they_index():
    """`index_bounds`: an integer the loss reads only as an index (an embedding's gather, a
    label picked by ``take_along_axis``, a one-hot's ``eq`` with an iota) is drawn below
    the smallest count it indexes; one used otherwise (``%``, a length) stays zeros."""
    import jax
    import jax.numpy as jnp
    import optax

    from soapjax_zoo.user import index_bounds

    table = jax.ShapeDtypeStruct((50, 4), jnp.float32)
    ids = jax.ShapeDtypeStruct((8, 3), jnp.int32)

    def loss_fn(p, b):
        x = p[b["ids"]].sum(-1)  # [8, 3]
        ce = optax.softmax_cross_entropy_with_integer_labels(x, b["labels"]).sum()
        hot = jax.nn.one_hot(b["classes"], 7).sum()
        return ce + hot + (jnp.arange(3) < b["n"][:, None] % 2).sum()

    batch = {"ids": ids, "labels": jax.ShapeDtypeStruct((8,), jnp.int32),
             "classes": jax.ShapeDtypeStruct((8,), jnp.int32),
             "n": jax.ShapeDtypeStruct((8,), jnp.int32)}
    assert index_bounds(loss_fn, table, batch) == [7, 50, 3, None]  # classes, ids, labels, n


def test_check_of_an_attention_lm_from_shapes_sees_its_query_gradients(tmp_path):
    """`soapjax check` of an attention LM whose batch is `jax.ShapeDtypeStruct`s: the tokens
    are drawn over its vocabulary, so the queries' and keys' gradients are real (not left
    out as zero: all four were with zero tokens), held to their own scale against float64,
    and the Megatron plan passes."""
    import jax

    from soapjax_zoo.user import load

    path = tmp_path / "attention_lm.py"
    path.write_text(ATTENTION_LM)
    w = load(f"{path}:make_workload")
    batch = w.make_batch(jax.random.key(1))
    assert int(batch["tokens"].max()) > 32 and int(batch["targets"].min()) >= 0
    assert int(batch["targets"].max()) < 64 and not batch["lengths"].any()
    from soapjax.check import compare_on_devices
    from soapjax.graph.opgraph import trace
    from soapjax.strategy import baselines
    from soapjax.strategy.plan import Plan
    from soapjax.strategy.space import MeshShape
    from soapjax.topology.cluster import load_topology

    topo = load_topology("cpu8")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    r = compare_on_devices(Plan.make(g, topo, baselines.megatron(g, MeshShape.of(topo),
                                                                   ("model",))),
                           w, repeats=1, costs="analytic")
    noise = [r.gradients.leaves[k].path for k in r.gradients.noise_leaves]
    assert noise == ["['params']['k']['bias']"]  # a softmax cancels it: truly zero
    assert r.gradients.float64
    assert r.gradients.passed and r.verdict()[0], r.table()


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
    assert code == 2 and "is user code: --size tiny is for zoo models" in err
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
    says so in both reports. (Without the finalists' check against XLA's reshardings: with
    it the plan's time is XLA's pricing, which `simulate --reshard xla` gives.)"""
    out = tmp_path / "gpt.json"
    argv = ["plan", "--model", "gpt", "--size", "tiny", "--batch-size", "16", "--mesh",
            "dgx-a100x3072-32", "--costs", "analytic", "--proposals", "10", "--pipelines",
            "--no-reshard-check", "--out", str(out)]
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
    names = ("data-parallel, megatron, fsdp, megatron-sp, fsdp-recompute, expert-cnn, expert-rnn, "
             "maxtext-moe")
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
    (["plan", "--budget", "-3"], "argument --budget: expected a number of seconds from 0 to "
                                 "604800 (a week), got '-3'"),
    (["plan", "--budget", "nan"], "argument --budget: expected a number of seconds from 0 to"),
    (["plan", "--budget", "soon"], "argument --budget: expected a number of seconds from 0 to "
                                   "604800 (a week), got 'soon'"),
    (["plan", "--proposals", "0"], "argument --proposals: expected an integer from 1 to "
     "10,000,000, got '0'"),
    (["plan", "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
    (["plan", "--processes", "0"], "argument --processes: expected an integer from 1 to "
                                   "1024, got '0'"),
    (["check", "--plan", "p.json", "--repeats", "0"], "argument --repeats: expected an "
                                                      "integer >= 1"),
], ids=["negative-budget", "nan-budget", "word-budget", "zero-proposals", "negative-seed",
        "zero-processes", "zero-repeats"])
def test_nonsense_numbers_are_usage_errors(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err and err.startswith("usage: soapjax")


def test_a_file_that_cannot_be_written_is_an_error_not_a_traceback(tmp_path, capsys):
    trace_file = tmp_path / "no" / "such" / "dir" / "trace.json"
    code, _, err = run(["simulate", "--model", "mlp", "--config", "tiny", "--costs", "analytic",
                        "--trace", str(trace_file)], capsys)
    assert code == 2
    assert err == (f"soapjax simulate: error: No such file or directory: {trace_file}; "
                   "expected a path the command can read or write: check it and its "
                   "directory's permissions\n")


# --- mistakes that used to end in a traceback: one line, exit status 2 --------------------------

MLP = ["--model", "mlp", "--size", "tiny"]


def test_a_topology_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'name = "caf\xe9"\n')  # byte 11
    code, _, err = run(["simulate", *MLP, "--mesh", str(path)], capsys)
    assert code == 2
    assert err == (f"soapjax simulate: error: {path}: byte 11 is not UTF-8 text; expected a "
                   "UTF-8 TOML file (save it as UTF-8, or remove the byte)\n")


def test_a_picture_format_matplotlib_cannot_write_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, _, err = run([*PLAN, *MLP, "--out", str(out), "--plot", str(tmp_path / "p.txt")],
                       capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"soapjax plan: error: cannot write a picture to "
                          f"'{tmp_path / 'p.txt'}': matplotlib writes no '.txt' files; expected "
                          "a name ending in one of ")
    assert f"(e.g. {tmp_path / 'p.png'})" in err and not out.exists()


def test_out_at_a_directory_or_an_unwritable_place_names_it(tmp_path, capsys):
    code, _, err = run([*PLAN, *MLP, "--out", str(tmp_path)], capsys)
    assert code == 2
    assert err == (f"soapjax plan: error: cannot write the plan to {tmp_path}: it is a "
                   f"directory; expected a file path, e.g. {tmp_path / 'plan.json'}\n")
    (tmp_path / "file").write_text("")
    code, _, err = run([*PLAN, *MLP, "--out", str(tmp_path / "file" / "p.json")], capsys)
    assert code == 2 and ".tmp" not in err
    assert err.startswith(f"soapjax plan: error: cannot write the plan to "
                          f"{tmp_path / 'file' / 'p.json'}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    code, _, err = run(["check", "--plan", str(tmp_path)], capsys)
    assert code == 2 and err == (f"soapjax check: error: {tmp_path} is a directory; expected a "
                                 "plan file (the JSON file `soapjax plan` wrote), e.g. "
                                 "plans/NAME.json\n")


def test_ctrl_c_is_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    import soapjax.search as search  # what the command line imports find_plan from

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(search, "find_plan", interrupted)
    out = tmp_path / "plan.json"
    code, stdout, err = run([*PLAN, *MLP, "--out", str(out)], capsys)
    assert (code, stdout, err) == (130, "", "\nsoapjax plan: interrupted; no plan written\n")
    assert cli.INTERRUPTED == 130 and not out.exists() and not list(tmp_path.iterdir())


def test_models_with_a_size_no_model_has(capsys):
    code, _, err = run(["models", "--size", "nosuch"], capsys)
    assert code == 2 and "alexnet" not in err
    assert err.startswith("soapjax models: error: no model of the zoo has size 'nosuch'; "
                          "expected one of: default, tiny, tiny-dropout, 1.3b, ")
    code, _, err = run(["models", "--size", "13B"], capsys)
    assert code == 2 and err.endswith("; did you mean '13b'?\n")
    code, out, _ = run(["models", "--size", "13b", "--json"], capsys)
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["gpt"]


def test_calibrate_says_what_its_error_column_is(capsys, tmp_path):
    code, out, _ = run(["calibrate", "--model", "mlp", "--cache-dir", str(tmp_path)], capsys)
    assert code == 0
    assert out.splitlines()[-1].startswith("error = (sum - step) / step: how far the sum of "
                                           "the operators' measured times")


def test_train_example_takes_the_command_lines_size_and_mesh():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "train_example.py"
    spec = importlib.util.spec_from_file_location("train_example", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script._parse(["--size", "tiny", "--mesh", "cpu4"])
    assert (args.size, args.mesh) == ("tiny", "cpu4")
    old = script._parse(["--config", "default", "--topology", "cpu8"])  # the old names
    assert (old.size, old.mesh) == ("default", "cpu8")


LONG_CALL = textwrap.dedent('''\
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    import jax, jax.numpy as jnp
    from soapjax import cli
    f = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, x: jnp.sin(x) + 1.0, x))
    x = jnp.ones((1000,))
    f(x, 10).block_until_ready()
    with cli._ctrl_c_ends_at_once("calibrate"):
        print("started", flush=True)
        f(x, 10**8).block_until_ready()  # minutes in XLA, deaf to KeyboardInterrupt
    ''')


def test_ctrl_c_ends_calibrate_links_inside_a_compiled_call(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "long.py").write_text(LONG_CALL)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, str(tmp_path / "long.py")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline() == "started\n"
        time.sleep(0.3)
        t0 = time.perf_counter()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
        assert time.perf_counter() - t0 < 5
    finally:
        p.kill()
    assert (p.returncode, err) == (130, "\nsoapjax calibrate: interrupted\n")


# --- the bad-input list of 2026-11-28 (issue 43): each one line and status 2, or right ------------

BAD_USER = textwrap.dedent('''\
    import sys
    import jax.numpy as jnp

    def _parts(cast):
        params, batch = {"w": jnp.ones((4, 4))}, {"x": jnp.ones((8, 4))}
        return (lambda p, b: cast(jnp.sum(b["x"] @ p["w"]))), params, batch

    def make_int():
        return _parts(lambda x: x.astype(jnp.int32))

    def make_complex():
        return _parts(lambda x: x.astype(jnp.complex64))

    def make_exit():
        sys.exit(3)
    ''')


@pytest.fixture
def bad_user(tmp_path, monkeypatch):
    (tmp_path / "bad_user.py").write_text(BAD_USER)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--pipelines", "--no-pipelines"],
     "--pipelines and --no-pipelines contradict each other; give one of them"),
    (["--budget", "1e308"], "argument --budget: expected a number of seconds from 0 to 604800"),
    (["--proposals", "100000000000000000000"], "argument --proposals: expected an integer from "
     "1 to 10,000,000"),
    (["--budget", "2", "--proposals", "100"], "--budget stops the search on time and "
     "--proposals on a count (the same plan on any machine); give one of them"),
    (["--mesh", ""], "expected a topology name (one of "),
])
def test_plan_refuses_contradictions_and_endless_searches(argv, message, capsys, tmp_path):
    base = ["plan", "--model", "mlp", "--size", "tiny", "--costs", "analytic",
            "--out", str(tmp_path / "p.json")]
    code, _, err = run([*base, *(["--mesh", "cpu8"] if "--mesh" not in argv else []), *argv],
                       capsys)
    last = err.strip().splitlines()[-1]  # argparse's usage lines come first
    assert code == 2 and message in last and last.startswith("soapjax plan: error:"), err
    assert not (tmp_path / "p.json").exists()


def test_a_batch_no_axis_divides_is_said(capsys, tmp_path):
    code, out, _ = run(["plan", "--model", "mlp", "--size", "tiny", "--mesh", "cpu8", "--costs",
                        "analytic", "--budget", "1", "--batch-size", "7",
                        "--out", str(tmp_path / "p.json")], capsys)
    assert code == 0
    assert "note: the batch of 7 samples divides over no mesh axis (data=2, model=4)" in out
    code, _, err = run(["simulate", "--model", "mlp", "--size", "tiny", "--mesh", "cpu8",
                        "--batch-size", "7", "--strategy", "data-parallel"], capsys)
    assert code == 2 and "data parallelism splits nothing" in err and "--batch-size" in err


def test_output_options_are_checked_before_any_work(capsys, tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    code, out, err = run([*PLAN, *MLP, "--trace", str(tmp_path / "adir"),
                          "--out", str(tmp_path / "p.json")], capsys)
    assert code == 2 and out == "" and "--trace" in err and "a directory; expected a file" in err
    code, _, err = run(["profile", "--model", "mlp", "--size", "tiny", "--mesh", "cpu8",
                        "--cache-dir", str(tmp_path / "afile")], capsys)
    assert code == 2 and "--cache-dir" in err and "is a file; expected a directory" in err
    code, _, err = run(["calibrate", "--model", "mlp", "--write"], capsys)
    assert code == 2 and "--write rewrites a topology file" in err and "needs --links" in err


def test_a_picture_without_a_suffix_is_written_and_named_as_png(capsys, tmp_path):
    code, out, _ = run([*PLAN, *MLP, "--plot", str(tmp_path / "outnoext"),
                        "--out", str(tmp_path / "p.json")], capsys)
    assert code == 0 and f"pictures: {tmp_path / 'outnoext.png'}," in out
    assert (tmp_path / "outnoext.png").is_file() and not (tmp_path / "outnoext").exists()


def test_user_code_that_returns_no_float_or_exits_is_one_line(bad_user, capsys):
    for fn, message in (("make_int", "must return a real floating-point loss to differentiate, "
                                     "but returned int32"),
                        ("make_complex", "returned complex64"),
                        ("make_exit", "make_exit() called sys.exit(3) (at ")):
        code, _, err = run(["plan", "--model", f"bad_user.py:{fn}", "--mesh", "cpu8",
                            "--costs", "analytic", "--budget", "1"], capsys)
        assert code == 2 and message in err, err
    code, _, err = run(["graph", "--model", "bad_user.py:make_int:extra"], capsys)
    assert code == 2 and "expected one ':' between the file or module and the function" in err


def test_a_broken_pipe_ends_quietly(monkeypatch, capsys):
    import io

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_quiet_stdout", lambda: None)  # the test's stdout is not a pipe
    monkeypatch.setattr("sys.stdout", Closed())
    code = cli.main(["mesh", "show", "cpu8", "--json"])
    monkeypatch.undo()
    assert code == cli.BROKEN_PIPE == 141
    assert capsys.readouterr().err == ""


CTRL_C_PLAN = ["plan", "--model", "mlp", "--size", "tiny", "--mesh", "cpu8", "--costs",
               "analytic", "--budget", "8"]


SWALLOWED = """
import gc, signal, sys
from soapjax import cli

class Interrupted:
    def __del__(self):
        raise KeyboardInterrupt

class Broken:
    def __del__(self):
        raise ValueError("not a Ctrl-C")

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
with cli._ctrl_c_kept():
    Interrupted()
    gc.collect()
    print("swallowed", file=sys.stderr, flush=True)
    cli._CTRL_C.set()  # what the handler does before it raises
    try:
        cli._interruptible(None)("a progress line")
    except KeyboardInterrupt:
        print("raised again", file=sys.stderr, flush=True)
    Broken()
    gc.collect()
print("cleared" if not cli._CTRL_C.is_set() else "still set", file=sys.stderr)
"""


def test_a_ctrl_c_swallowed_by_a_callback_prints_no_traceback(tmp_path):
    """A Ctrl-C that lands in a callback Python runs without raising (an import lock's weakref
    callback: seen once in 3 x 3 `test_ctrl_c_at_any_time_ends_in_one_line` runs beside a busy
    process) printed "Exception ignored in ... Traceback" before the command's one line. It is
    remembered and raised again at the next progress line (`_interruptible`), so the command
    line prints nothing for it; other unraisable exceptions are reported as before. In a
    process of its own: pytest replaces the hook that prints them."""
    import subprocess
    import sys

    (tmp_path / "swallowed.py").write_text(SWALLOWED)
    out = subprocess.run([sys.executable, str(tmp_path / "swallowed.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == "swallowed"  # nothing before it: no "Exception ignored", no traceback
    assert lines[1] == "raised again"
    assert "ValueError: not a Ctrl-C" in out.stderr and lines[-1] == "cleared"


@pytest.mark.parametrize("after_s", [0.3, 1.3, 3.0])
def test_ctrl_c_at_any_time_ends_in_one_line(after_s, tmp_path):
    """Ctrl-C while jax imports, while the model traces (where a garbage-collection callback
    could swallow it, and the search went on) and while the chains run: status 130, one line,
    no plan written, no traceback."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    exe = Path(sys.executable).parent / "soapjax"  # the venv's console script
    if not exe.is_file():
        exe = shutil.which("soapjax")
    assert exe is not None, "the soapjax command is not installed beside this python"
    out = tmp_path / "p.json"
    # A shell that starts a job in the background (`make test &`, nohup) starts it with SIGINT
    # ignored, and children inherit that: the command would never see the Ctrl-C (it ran to
    # the end and exited 0 under such a run). The child takes Ctrl-C as a terminal gives it.
    p = subprocess.Popen([str(exe), *CTRL_C_PLAN, "--out", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(after_s)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err.rstrip().splitlines()[-1] in ("soapjax: interrupted while starting",
                                             "soapjax plan: interrupted; no plan written")
    assert not out.exists()


def test_simulate_warns_of_a_plan_whose_scan_layers_read_other_layouts(tmp_path, capsys):
    """A plan file edited by hand so that the tiny GPT's second layer runs fc1 row parallel
    where the first runs it column parallel: the stacked kernel is stored as the first reads
    it, XLA moves the second's slice every step, and the prediction does not price the move;
    `simulate` says so in its report and its JSON."""
    import dataclasses

    import soapjax_zoo
    from soapjax.graph.opgraph import trace
    from soapjax.strategy.plan import Plan
    from soapjax.strategy.space import Config, MeshShape, data_parallel
    from soapjax.topology.cluster import load_topology

    w, topo = soapjax_zoo.get("gpt", "tiny"), load_topology("cpu8")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    first, last = next(grp for grp in g.repeated_blocks()
                       if g.operators[grp[0]].name.endswith("fc1"))
    base = data_parallel(g, MeshShape.of(topo))
    configs = list(base.configs)
    configs[first] = Config((("data",), (), ("model",), ()))
    configs[last] = Config((("data",), (), (), ("model",)))
    path = tmp_path / "untied.json"
    Plan.make(g, topo, dataclasses.replace(base, configs=tuple(configs)),
              model_config="tiny").save(str(path))
    code, out, _ = run(["simulate", "--strategy", str(path), "--costs", "analytic"], capsys)
    assert code == 0
    assert "warning: layer 1 of stacked parameter" in out and "fc1" in out
    assert "the prediction does not price" in out
    code, out, _ = run(["simulate", "--strategy", str(path), "--costs", "analytic", "--json"],
                       capsys)
    assert code == 0 and json.loads(out)["warnings"][0].startswith("warning: layer 1 of")


def test_simulate_warns_of_a_pipelined_plan_whose_stages_would_hang(tmp_path, capsys):
    """A plan file edited by hand so that, inside the tiny GPT's pipeline stages, the
    attention's output projection reads its tokens over ``data`` and writes over ``model``
    where Megatron's layout splits the heads it reads over both: XLA makes that layout change
    with a collective-permute, which apply refuses inside a stage (its step would hang:
    tests/test_apply_pipelined.py). `simulate` names both layers' reads, in its report and its
    JSON; Megatron's own layout gets no such warning."""
    import dataclasses
    import pathlib

    import soapjax_zoo
    from soapjax.graph.opgraph import trace
    from soapjax.strategy.baselines import megatron_3d
    from soapjax.strategy.plan import Plan
    from soapjax.strategy.space import Config
    from soapjax.topology.cluster import load_topology

    mesh = pathlib.Path(__file__).parent / "meshes" / "cpu8-nodes.toml"
    w, topo = soapjax_zoo.get("gpt", "tiny"), load_topology(str(mesh))
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    base = megatron_3d(g, topo, tp=4, pp=2, microbatch_size=2, recompute="none",
                       sequence_parallel=True)
    moved = dataclasses.replace(base, configs=tuple(
        Config(((), ("data",), ("model",), (), ())) if op.name.endswith("attn/out") else c
        for op, c in zip(g.operators, base.configs)))
    for name, strategy in (("megatron", base), ("moved", moved)):
        Plan.make(g, topo, strategy, model_config="tiny").save(str(tmp_path / f"{name}.json"))
    args = ["--costs", "analytic", "--mesh", str(mesh)]
    code, out, _ = run(["simulate", "--strategy", str(tmp_path / "megatron.json"), *args], capsys)
    assert code == 0 and "pipeline: 2 stages" in out and "apply will refuse" not in out
    code, out, _ = run(["simulate", "--strategy", str(tmp_path / "moved.json"), *args], capsys)
    assert code == 0
    assert ("warning: apply will refuse this plan" in out
            and "layers_0/attn/out (operand 0)" in out and "layers_1/attn/out (operand 0)" in out)
    code, out, _ = run(["simulate", "--strategy", str(tmp_path / "moved.json"), *args, "--json"],
                       capsys)
    result = json.loads(out)
    assert code == 0 and result["warnings"][0].startswith("warning: apply will refuse")
    assert result["pipeline"]["stage_permutes"] == [["layers_0/attn/out", 0],
                                                     ["layers_1/attn/out", 0]]


def test_a_loss_with_its_own_sharding_constraints_is_traced_without_them(tmp_path, capsys):
    """A user's file sharded by hand (`with_sharding_constraint` on a mesh of its own): the
    command warns that the trace leaves the constraint out, as a line of the command's own
    (`_warnings_as_lines`), not as Python prints a warning from inside soapjax."""
    path = tmp_path / "by_hand.py"
    source = USER_MODEL.replace(
        "        logits = model.apply(params, batch[\"x\"])\n",
        "        mesh = jax.make_mesh((8,), ('dp',), (jax.sharding.AxisType.Auto,))\n"
        "        x = jax.lax.with_sharding_constraint(\n"
        "            batch['x'], jax.sharding.NamedSharding(mesh, jax.P('dp')))\n"
        "        logits = model.apply(params, x)\n")
    assert source != USER_MODEL
    path.write_text(source)
    with pytest.warns(UserWarning, match=r"loss_fn applies 1 sharding constraint\(s\) of its "
                                         r"own .* the traced step leaves them out"):
        code, stdout, _ = run(["graph", "--model", f"{path}:make_workload", "--json"], capsys)
    assert code == 0 and json.loads(stdout)["num_operators"] == 3
    with cli._warnings_as_lines("graph"):
        mine = warnings.formatwarning("said", UserWarning, cli.__file__, 1)
        theirs = warnings.formatwarning("said", UserWarning, str(path), 1)
    assert mine == "soapjax graph: warning: said\n"
    assert theirs.startswith(f"{path}:1: UserWarning: said")
    assert warnings.formatwarning("said", UserWarning, cli.__file__, 1) != mine  # put back
