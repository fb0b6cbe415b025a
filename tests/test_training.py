"""training.shard_training plans by default: find_plan, a plan cache on disk, named baselines.

Every test plans the tiny MLP from `jax.ShapeDtypeStruct`s (nothing allocated, nothing compiled)
with analytic costs and a proposal budget, so the searches are reproducible and take ~0.1 s.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import soapjax_zoo as zoo
from soapjax import SearchSettings, find_plan, training
from soapjax.base.errors import ArgumentError, PlanError, TraceError
from soapjax.graph.opgraph import trace
from soapjax.strategy.baselines import baselines
from soapjax.topology.cluster import load_topology

SETTINGS = SearchSettings(max_proposals=100, seed=0)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SOAPJAX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def mlp():
    return zoo.get("mlp", "tiny")


def shard(w, **kwargs):
    kwargs = {"mesh": "cpu8", "costs": "analytic", "search": SETTINGS} | kwargs
    return training.shard_training(w.loss_fn, w.abstract_params(), w.abstract_batch(),
                                   w.optimizer, name="mlp", **kwargs)


def test_default_strategy_searches_with_find_plan(mlp, capsys, cache_dir):
    run = shard(mlp)
    err = capsys.readouterr().err
    assert "soapjax: planning mlp (4 operators) on cpu8 (8 devices): 100 proposals per chain" in err
    graph = trace(mlp.loss_fn, mlp.abstract_params(), mlp.abstract_batch(), name="mlp")
    topo = load_topology("cpu8")
    expected = find_plan(graph, topo, settings=SETTINGS, costs="analytic",
                         optimizer=mlp.optimizer)
    assert run.plan.step_time_s == expected.step_time_s
    assert run.plan.configs == expected.configs
    assert run.strategy == expected.strategy(graph, topo)
    assert run.plan.step_time_s <= min(t for _, t in run.plan.baselines)
    [path] = (cache_dir / "plans").glob("mlp-cpu8-*.json")
    assert f"cached in {path}" in err
    key = json.loads(path.read_text())["key"]
    assert key["graph"] == graph.fingerprint() and key["topology"] == topo.fingerprint()
    assert key["soapjax"] == "0.1.0" and key["costs"] == "analytic"
    assert key["search"]["max_proposals"] == 100


def test_second_call_reuses_the_cached_plan(mlp, capsys, cache_dir, monkeypatch):
    first = shard(mlp)
    capsys.readouterr()

    def no_search(*args, **kwargs):
        raise AssertionError("searched although a cached plan exists")

    monkeypatch.setattr(training, "find_plan", no_search)
    again = shard(mlp)
    [path] = (cache_dir / "plans").glob("mlp-cpu8-*.json")
    err = capsys.readouterr().err
    ms = f"{first.plan.step_time_s * 1e3:.4g}"
    assert err == (f"soapjax: reusing cached plan for mlp on cpu8 (predicted {ms} ms per step) "
                   f"from {path}\n")
    assert again.plan == first.plan and again.strategy == first.strategy


def test_cache_key_changes_with_topology_and_settings(mlp, capsys, cache_dir):
    shard(mlp)
    raw = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    run = shard(mlp, mesh=raw)
    assert "soapjax: planning mlp (4 operators) on cpu8-as-data4-model2" in capsys.readouterr().err
    assert run.plan.topology == "cpu8-as-data4-model2"
    assert dict(zip(run.plan.mesh.axis_names, run.plan.mesh.axis_sizes)) == {"data": 4,
                                                                             "model": 2}
    shard(mlp, search=SearchSettings(max_proposals=100, seed=1))
    assert "soapjax: planning mlp" in capsys.readouterr().err
    files = sorted(p.name for p in (cache_dir / "plans").glob("*.json"))
    assert len(files) == 3 and sum(f.startswith("mlp-cpu8-as-data4-model2-") for f in files) == 1


def test_cache_key_tells_muon_from_sgd_with_momentum(mlp):
    """SGD with momentum and Muon keep one moment per matrix alike (the key's state size told
    them apart only by Muon's Adam for the biases here), but Muon's update multiplies whole
    matrices, which changes the plan: the key says which dims; Adam's key is as it was (no
    update dims in it)."""
    from soapjax.topology.cluster import load_topology

    graph = trace(mlp.loss_fn, mlp.abstract_params(), mlp.abstract_batch(), name="mlp")
    topo = load_topology("cpu8")

    def key(optimizer):
        return training._cache_key(graph, topo, SETTINGS,
                                   training.PlanOptions(SETTINGS, "analytic", optimizer))
    sgd, muon = key(optax.sgd(0.1, momentum=0.9)), key(optax.contrib.muon(1e-3))
    assert "update_whole" not in sgd
    assert sum(1 for d in muon["update_whole"] if d == [0, 1]) == 3  # the MLP's 3 kernels
    assert "update_whole" not in key(optax.adam(1e-3))


def test_a_corrupt_cache_file_is_replanned_with_a_warning(mlp, capsys, cache_dir):
    first = shard(mlp)
    [path] = (cache_dir / "plans").glob("*.json")
    path.write_text(path.read_text()[:200])
    capsys.readouterr()
    again = shard(mlp)
    err = capsys.readouterr().err
    assert f"soapjax: warning: ignoring the unreadable cached plan {path} (JSONDecodeError" in err
    assert "soapjax: planning mlp" in err
    assert (again.plan.configs, again.plan.step_time_s) == (first.plan.configs,
                                                            first.plan.step_time_s)
    assert json.loads(path.read_text())["plan"] == again.plan.to_json()  # rewritten whole


@pytest.mark.parametrize("name", ["data-parallel", "megatron", "fsdp", "expert-cnn",
                                  "expert-rnn"])
def test_every_baseline_by_name(mlp, capsys, name):
    run = shard(mlp, strategy=name)
    graph = trace(mlp.loss_fn, mlp.abstract_params(), mlp.abstract_batch(), name="mlp")
    assert run.strategy == baselines(graph, load_topology("cpu8"))[name]
    assert run.plan is None and capsys.readouterr().err == ""
    assert set(training.PLANNERS) == {"plan", "data-parallel", "megatron", "fsdp", "megatron-sp",
                                      "fsdp-recompute", "expert-cnn", "expert-rnn",
                                      "maxtext-moe"}


def test_unknown_names_list_the_planners(mlp):
    with pytest.raises(PlanError, match=r"unknown strategy 'data_parallel'; expected one of "
                                        r"plan, data-parallel, megatron, fsdp, megatron-sp, "
                                        r"fsdp-recompute, expert-cnn, expert-rnn, .*; did you "
                                        r"mean 'data-parallel'\?"):
        shard(mlp, strategy="data_parallel")


def test_mesh_topology_of_a_raw_mesh():
    raw = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    topo = training.mesh_topology(raw)
    assert (topo.name, topo.axis_names, topo.axis_sizes) == ("cpu8-as-x2-y2", ("x", "y"), (2, 2))
    assert topo.num_devices == 4 and topo.device == load_topology("cpu8").device
    with pytest.raises(PlanError, match=r"carries no topology and none can be assumed .*cannot "
                                        r"be cut to 3 devices.*; pass mesh= a topology name"):
        training.mesh_topology(Mesh(np.asarray(jax.devices()[:3]), ("x",)))


@pytest.mark.parametrize("name", ["linen_scan_transformer", "nnx_scan_transformer"])
def test_scanned_layers_train_with_the_default_plan(name, capsys):
    """A transformer written with scan over layers (linen nn.scan, nnx.scan over nnx.vmap)
    trains through shard_training's default strategy; where Megatron beats data parallelism
    the plan splits the scanned layers' kernels, every layer alike."""
    import corpus
    import jax.numpy as jnp
    import optax

    loss_fn, model, batch = corpus.get(name, dtype=jnp.float32)
    run = training.shard_training(loss_fn, model, batch, optax.sgd(0.1), mesh="cpu8",
                                  costs="analytic", search=SETTINGS)
    assert "soapjax: plan for" in capsys.readouterr().err
    base = dict(run.plan.baselines)
    kernels = [(op, cfg) for op, cfg in zip(run.graph.operators, run.strategy.configs)
               if op.block_position and any(o.kind == "param" and o.layer and len(o.shape) >= 2
                                            for o in op.inputs)]
    assert kernels, "the layers' matmuls read their layer's slice of the stacked kernels"
    if base["megatron"] < base["data-parallel"]:
        split = [op.name for op, cfg in kernels
                 if any(cfg.axes[d] for d in range(len(cfg.axes)) if op.iteration_roles[d] in "PR")]
        assert split, "Megatron is faster, yet no layer kernel is split"
    for group in run.graph.repeated_blocks():
        assert len({run.strategy.configs[i] for i in group}) == 1
    params, opt_state = run.params, run.opt_state
    losses = []
    for _ in range(3):
        params, opt_state, loss = run.step(params, opt_state, run.shard_batch(batch))
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.parametrize("name, random", [("dropout_nnx", True), ("ste", False)])
def test_each_step_draws_fresh_dropout_masks(name, random):
    """The step counts its calls and folds the count into the keys the loss holds: step 0 is
    the traced function (its loss equals the plain loss), later steps draw other masks (the
    same parameters and batch give another loss), and a loss without randomness is unmoved."""
    import corpus
    import jax.numpy as jnp
    import optax

    loss_fn, model, batch = corpus.get(name, dtype=jnp.float32)
    run = training.shard_training(loss_fn, model, batch, optax.sgd(0.0), mesh="cpu8",
                                  strategy="data-parallel", donate=False)
    placed = run.shard_batch(batch)
    losses = [float(run.step(run.params, run.opt_state, placed)[2]) for _ in range(3)]
    from soapjax._nnx import pure_loss
    pure, params, _ = pure_loss(loss_fn, model, name)
    assert losses[0] == pytest.approx(float(jax.jit(pure)(params, batch)), rel=1e-6)
    if random:
        assert len(set(losses)) == 3, losses
    else:
        assert losses[0] == losses[1] == losses[2]


# --- arguments and batches of the wrong kind: one line that says what to pass -------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"optimizer": "adam"}, (r"shard_training: expected optimizer to be an optax "
                             r"GradientTransformation \(with init and update\), found str "
                             r"'adam'; pass e\.g\. optax\.adam\(learning_rate\)")),
    ({"search": {"budget_s": 1}}, (r"shard_training: expected search to be a SearchSettings "
                                   r"or None, found dict \{'budget_s': 1\}; pass "
                                   r"search=SearchSettings\(budget_s=1\)")),
], ids=["optimizer-name", "settings-dict"])
def test_arguments_of_the_wrong_kind(mlp, kwargs, message):
    optimizer = kwargs.pop("optimizer", mlp.optimizer)
    with pytest.raises(ArgumentError, match=message):
        training.shard_training(mlp.loss_fn, mlp.abstract_params(), mlp.abstract_batch(),
                                optimizer, mesh="cpu8", costs="analytic", **kwargs)


def test_a_batch_missing_a_key_names_it(mlp):
    params = mlp.init_params(jax.random.key(0))
    batch = mlp.make_batch(jax.random.key(1))
    run = training.shard_training(mlp.loss_fn, params, batch, mlp.optimizer, mesh="cpu8",
                                  strategy="data-parallel")
    short = {k: v for k, v in batch.items() if k != "inputs"}
    message = (r"the batch has no leaf \['inputs'\] \(traced with \['inputs'\], \['label'\]; "
               r"found \['label'\]\); expected the batch of the structure shard_training was "
               r"given")
    with pytest.raises(PlanError, match="run.step: " + message):
        run.step(run.params, run.opt_state, short)
    with pytest.raises(PlanError, match="shard_batch: " + message):
        run.shard_batch(short)
    wide = dict(batch, inputs=np.zeros((8, 17), np.float32))
    with pytest.raises(PlanError, match=r"batch leaf \['inputs'\] has shape \(8, 17\), but the "
                       r"step was traced with \(8, 16\)"):
        run.shard_batch(wide)
    assert run.step.count == 0
    _, _, loss = run.step(run.params, run.opt_state, run.shard_batch(batch))
    assert np.isfinite(loss) and run.step.count == 1


def test_a_strategy_whose_scan_layers_read_other_layouts_is_run_with_a_warning():
    """The tiny GPT with its second layer's fc1 row parallel where the first's is column
    parallel: the helper builds the step (XLA moves the stacked slice every step) and warns
    that the move is not priced; tied, it says nothing."""
    import dataclasses
    import warnings

    from soapjax.strategy import baselines
    from soapjax.strategy.space import Config, MeshShape

    w = zoo.get("gpt", "tiny")
    graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")
    strategy = baselines.megatron(graph, MeshShape.of(load_topology("cpu8")), ("model",))
    first, last = next(grp for grp in graph.repeated_blocks()
                       if graph.operators[grp[0]].name.endswith("fc1"))
    configs = list(strategy.configs)
    configs[last] = Config((("data",), (), (), ("model",)))
    untied = dataclasses.replace(strategy, configs=tuple(configs))
    args = (w.loss_fn, w.abstract_params(), w.abstract_batch(), w.optimizer)
    with pytest.warns(UserWarning, match=r"^layer 1 of stacked parameter .*fc1.* not price"):
        training.shard_training(*args, mesh="cpu8", strategy=untied, name="gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        training.shard_training(*args, mesh="cpu8", strategy=strategy, name="gpt")


# A user's file as `soapjax plan --model FILE.py:make_workload` loads it: a contrastive model
# (every sample's logits against every other's) whose temperature is a weakly typed scalar
# parameter (``jnp.array(2.0)``), given as arrays.
CLIP_FILE = '''\
import flax.linen as nn, jax, jax.numpy as jnp, optax

class CLIP(nn.Module):
    @nn.compact
    def __call__(self, img, txt):
        i = nn.Dense(8, name="img")(img)
        t = nn.Dense(8, name="txt")(txt)
        i = i / jnp.linalg.norm(i, axis=-1, keepdims=True)
        t = t / jnp.linalg.norm(t, axis=-1, keepdims=True)
        return jnp.exp(self.param("scale", lambda k: jnp.array(2.0))) * i @ t.T

def clip_loss(params, batch):
    logits = CLIP().apply(params, batch["img"], batch["txt"])
    labels = jnp.arange(logits.shape[0])
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean())

def make_workload():
    k1, k2 = jax.random.split(jax.random.key(0))
    batch = {"img": jax.random.normal(k1, (16, 12)), "txt": jax.random.normal(k2, (16, 10))}
    return clip_loss, CLIP().init(jax.random.key(1), batch["img"], batch["txt"]), batch
'''


def test_a_plan_made_by_the_command_line_binds_to_the_same_model_here(tmp_path, capsys):
    """`soapjax plan --model clip.py:make_workload` names the graph after the file and traces
    the params from their shapes (`jax.eval_shape`, weakly typed where they are); here the same
    function, its params given as arrays, takes the plan as it is (the graph named as the
    plan's, traced with the arrays' weak types), and its first step is exact."""
    import importlib.util

    from soapjax import cli
    from soapjax.strategy.plan import Plan

    path = tmp_path / "clip.py"
    path.write_text(CLIP_FILE)
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", f"{path}:make_workload", "--mesh", "cpu8", "--costs",
                     "analytic", "--proposals", "50", "--out", str(out)]) == 0
    capsys.readouterr()
    spec = importlib.util.spec_from_file_location("clip_user_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss_fn, params, batch = module.make_workload()
    assert jax.tree.leaves(params["params"]["scale"])[0].weak_type
    plan = Plan.load(out)
    run = training.shard_training(loss_fn, params, batch, module.optax.adam(1e-3),
                                  mesh="cpu8", strategy=plan, verify=True)
    assert run.graph.name == "clip" == plan.model
    assert [op.name for op in run.graph.operators] == [name for name, _ in plan.configs]


def test_an_integer_parameter_is_named_before_anything_is_planned(capsys, cache_dir):
    """A step counter kept among the parameters: the step would fail inside jax.jit with jax's
    own message after the search (``grad requires real- or complex-valued inputs``); the leaf
    is named first, and nothing is planned or cached."""
    params = {"w": jnp.ones((3, 2)), "step": jnp.zeros((), jnp.int32)}

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"]) ** 2)

    with pytest.raises(TraceError, match=r"parameter leaf \['step'\] of graph 'loss' is "
                       r"int32\[\]: the step differentiates floating-point parameters only"):
        training.shard_training(loss, params, {"x": jnp.ones((8, 3))}, optax.sgd(0.1),
                                mesh="cpu8", costs="analytic", search=SETTINGS)
    assert "planning" not in capsys.readouterr().err
    assert not list(cache_dir.glob("plans/*.json"))


def test_strategy_none_is_the_default_plan(mlp, capsys):
    """``strategy=None``, as users write for "the default", plans as ``"plan"`` does (it was a
    PlanError: expected a soapjax Strategy, got NoneType)."""
    default = shard(mlp)
    assert shard(mlp, strategy=None).plan.configs == default.plan.configs


def test_an_optimizer_whose_state_follows_the_parameters_tree_plans(mlp, cache_dir):
    """`optax.multi_transform` with a label pytree (a frozen layer) reads the parameters' own
    tree in ``init``: the plan's cache key and the search priced its state on a flat list of
    leaves and crashed (``pytree structure error``); now on the graph's parameter tree, so
    the frozen layer holds no optimizer state in the plan's memory either: the factor is per
    byte of the trained leaves (`soapjax.simulate.front.opt_state_factor`), the frozen one
    marked in the graph (`OpGraph.frozen`: no gradient, no state)."""
    params = mlp.abstract_params()
    labels = jax.tree_util.tree_map_with_path(
        lambda kp, _: "frozen" if "fc1" in jax.tree_util.keystr(kp) else "train", params)
    optimizer = optax.multi_transform({"train": optax.adam(1e-3),
                                       "frozen": optax.set_to_zero()}, labels)
    run = training.shard_training(mlp.loss_fn, params, mlp.abstract_batch(), optimizer,
                                  name="mlp", mesh="cpu8", costs="analytic", search=SETTINGS)
    [path] = cache_dir.glob("plans/*.json")
    factor = json.loads(path.read_text())["key"]["opt_state_factor"]
    # Adam's two moments of the trained leaves (and its step counter: a few bytes)
    assert factor == pytest.approx(2.0, abs=1e-3)
    assert run.plan is not None and run.graph.frozen == ("['params']['fc1']['bias']",
                                                         "['params']['fc1']['kernel']")


def test_a_plan_searched_here_says_what_xla_will_warn_of_and_what_was_estimated():
    """After planning, the helper says what would otherwise puzzle: layout changes XLA makes
    by replicating a tensor whole (XLA prints an "Involuntary full rematerialization" warning
    for each: priced so, found on a user's normalizing flow on cpu8), and operators the
    search priced by estimate; a plan with neither says nothing more. The search info is read
    as a loaded plan holds it too (pairs)."""
    row = {"start": "random-0", "ideal_s": 0.0077, "xla_s": 0.0079, "fits": True,
           "transitions": 20, "replicated_whole": 2, "fallbacks": 0}
    other = dict(row, start="megatron", xla_s=None, replicated_whole=None)
    info = {"best_from": "random-0", "estimated_operators": ["Conv_0", "Dense_1"],
            "reshardings_checked": {"finalists": [row, other], "seconds": 1.0}}
    want = ["XLA makes 2 of the plan's layout changes by replicating the tensor whole (its "
            "'Involuntary full rematerialization' warnings); the predicted time prices them so",
            "2 of the plan's operators are priced by estimate, not measured (the search's "
            "measuring budget ran out); a larger search budget measures them"]
    assert training._plan_caveats(info) == want
    frozen = {"best_from": "random-0", "estimated_operators": ("Conv_0", "Dense_1"),
              "reshardings_checked": (("finalists", (tuple(row.items()), tuple(other.items()))),
                                      ("seconds", 1.0))}
    assert training._plan_caveats(frozen) == want
    assert training._plan_caveats({"best_from": "megatron", "reshardings_checked":
                                   {"finalists": [other]}}) == []
    assert training._plan_caveats({}) == []


class _LoRAMLP:
    """An nnx MLP whose hidden layers are `nnx.LoRALinear` (rank 2), as nnx users fine-tune."""

    def __new__(cls, dtype):
        from flax import nnx

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.fc1 = nnx.LoRALinear(16, 32, lora_rank=2, rngs=rngs, param_dtype=dtype)
                self.fc2 = nnx.LoRALinear(32, 32, lora_rank=2, rngs=rngs, param_dtype=dtype)
                self.head = nnx.Linear(32, 4, rngs=rngs, param_dtype=dtype)

            def __call__(self, x):
                return self.head(jax.nn.relu(self.fc2(jax.nn.relu(self.fc1(x)))))

        return Net(nnx.Rngs(0))


@pytest.mark.parametrize("strategy, how", [("megatron", "wrt"), ("fsdp", "nnx.Optimizer")])
def test_an_nnx_model_trains_only_what_wrt_selects(strategy, how):
    """``wrt=nnx.LoRAParam``, as ``nnx.Optimizer(model, tx, wrt=...)`` takes it: the adapters
    train, the base stays a parameter (split by the plan) the optimizer leaves as it is, no
    gradient computed for it (the graph marks it frozen). In float64 on ``cpu8``, the first
    step is verified against the unsharded one leaf by leaf (``verify=True``), and the base
    is the same after a step (the adapters' ``lora_b`` moved; ``lora_a``, whose gradient is
    zero while ``lora_b`` is, as nnx initialises it, stays too). An ``nnx.Optimizer(model,
    tx, wrt=...)`` in place of the optax transformation says the same."""
    from flax import nnx

    with jax.enable_x64(True):
        model = _LoRAMLP(jnp.float64)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)))
        batch = {"x": x, "y": jnp.tanh(x[:, :4])}

        def loss_fn(model, batch):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        tx = optax.adam(1e-2)
        kwargs = ({"wrt": nnx.LoRAParam} if how == "wrt" else
                  {"optimizer": nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)})
        run = training.shard_training(loss_fn, model, batch, **{"optimizer": tx, **kwargs},
                                      mesh="cpu8", strategy=strategy, verify=True)
        params, _, _ = run.step(run.params, run.opt_state, run.shard_batch(batch))
    frozen = set(run.graph.frozen)
    assert frozen and all("lora" not in path for path in frozen)
    assert len(frozen) == 6  # the kernels and biases of fc1, fc2 and the head
    after = dict(nnx.to_flat_state(run.model_params(params)))
    for path, old in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        same = np.array_equal(*(np.asarray(jax.tree.leaves(v)[0]) for v in (old, after[path])))
        assert same != (path[-1] == "lora_b"), path


def test_wrt_is_refused_for_a_pytree_and_for_a_filter_that_selects_nothing(mlp):
    from flax import nnx

    with pytest.raises(ArgumentError, match="optax.set_to_zero"):
        training.shard_training(mlp.loss_fn, mlp.abstract_params(), mlp.abstract_batch(),
                                optax.adam(1e-3), strategy="data-parallel", wrt=nnx.LoRAParam)
    model = _LoRAMLP(jnp.float32)
    with pytest.raises(ArgumentError, match="selects none"):
        training.shard_training(lambda m, b: jnp.mean(m(b["x"])), model,
                                {"x": jnp.ones((8, 16))}, optax.adam(1e-3),
                                strategy="data-parallel", wrt=nnx.BatchStat)


LORA_FILE = '''
import jax, jax.numpy as jnp, optax
from flax import nnx

class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.LoRALinear(16, 32, lora_rank=2, rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.fc1(x)))

def make():
    model = Net(nnx.Rngs(0))
    loss_fn = lambda model, batch: jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    batch = {"x": jnp.ones((8, 16)), "y": jnp.zeros((8, 4))}
    return loss_fn, model, batch, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)
'''


def test_a_users_file_returning_an_nnx_optimizer_plans_its_wrt_alone(tmp_path, capsys):
    """``--model file.py:make`` returning an ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``
    as its optimizer: the adapters train, the base is planned frozen."""
    from soapjax import cli
    from soapjax.cost.updates import frozen_leaves
    from soapjax_zoo.user import load

    path = tmp_path / "lora_user.py"
    path.write_text(LORA_FILE)
    w = load(f"{path}:make")
    assert frozen_leaves(w.optimizer, w.abstract_params()) == (
        True, True, False, False, True, True)  # fc1's bias, kernel, lora a, b; the head's
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", f"{path}:make", "--mesh", "cpu8", "--costs",
                     "analytic", "--proposals", "20", "--out", str(out)]) == 0
    # the adapters' gradients alone (lora_a [16, 2], lora_b [2, 32]: 384 B, split or not)
    grads = re.search(r"gradients ([\d.]+) (k?B)", capsys.readouterr().out)
    assert grads.group(2) == "B" and float(grads.group(1)) <= 384
