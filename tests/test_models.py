"""Tests of the model zoo: registry, tiny training steps, default sizes and costs, nnx twins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import soapjax_zoo as zoo
from soapjax.base.errors import SoapjaxError, UnknownModelError
from soapjax_zoo.gpt2 import GPT2Config
from soapjax_zoo.workload import ModelConfigError

NAMES = ("alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "lenet", "mlp", "gpt2")
LARGE = ("gpt", "llama", "moe")  # billions of parameters: tests/test_zoo_large.py
TWINS = ("mlp", "lenet")  # models with an nnx version

# On 2 CPU cores XLA's compile time, not run time, dominates these tests. Optimisation level 0
# and the classic (non-MLIR) fusion emitters compile the tiny steps several times faster, for
# the same values (Inception-v3's init: 160 s of CPU -> 9 s; its train step: 45 s -> 5 s).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}

# Tiny steps that take over ~5 s on 2 cores (mostly compilation).
SLOW_TINY = {"alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "gpt2"}
# Default summaries that take over ~5 s (tracing the full-size step).
SLOW_DEFAULT = {"inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "gpt2"}


def _variants(*, slow: set[str] = frozenset()) -> list:
    """(name, api) for every model and api, with readable ids; `slow` ones marked slow."""
    return [
        pytest.param(name, api, id=f"{name}-{api}", marks=[pytest.mark.heavy] * (name in slow))
        for name in NAMES
        for api in zoo.apis(name)
    ]


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)


def _shapes_by_module_path(params) -> dict[str, tuple[int, ...]]:
    """``{"fc1/kernel": shape}``: linen's ``params`` collection and nnx's ``.value`` dropped."""
    shapes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        shapes["/".join(keys[1:] if keys[0] == "params" else keys)] = leaf.shape
    return shapes


# Registry ----------------------------------------------------------------------------------


def test_names_in_registry_order():
    assert zoo.names() == NAMES + LARGE
    assert zoo.names(large=False) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_model_has_default_and_tiny(name):
    assert zoo.configs(name)[:2] == ("default", "tiny")


def test_get_returns_the_same_workload():
    assert zoo.get("mlp", "tiny") is zoo.get("mlp", "tiny")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda: zoo.get("gtp2"),
            r"^unknown model 'gtp2'; expected one of: alexnet, inception_v3, resnet101, rnntc, "
            r"rnnlm, nmt, lenet, mlp, gpt2, gpt, llama, moe; did you mean 'gpt2'\?$",
            id="get-typo",
        ),
        pytest.param(
            lambda: zoo.configs("vgg16"),
            r"^unknown model 'vgg16'; expected one of: alexnet, .*, gpt2, gpt, llama, moe$",
            id="configs-no-close-match",
        ),
        pytest.param(
            lambda: zoo.get("gpt2", "huge"),
            r"^model 'gpt2' has no config 'huge'; expected one of: default, tiny$",
            id="unknown-config",
        ),
        pytest.param(
            lambda: zoo.get("gpt2", "tiny", api="nnx"),
            r"^model 'gpt2' is not available in api 'nnx'; expected one of: linen$",
            id="unknown-api",
        ),
    ],
)
def test_unknown_names_raise(call, message):
    with pytest.raises(UnknownModelError, match=message) as info:
        call()
    assert isinstance(info.value, SoapjaxError)


@pytest.mark.parametrize("name", NAMES)
def test_batch_size_overrides_the_config(name):
    w = zoo.get(name, "tiny", batch_size=24)
    assert w.batch_size == 24 and w.config == "tiny"
    assert all(x.shape[0] == 24 for x in jax.tree.leaves(w.abstract_batch()))
    assert zoo.get(name, "tiny", batch_size=24) is w
    assert zoo.get(name, "tiny").batch_size == 8  # the config itself is unchanged


def test_batch_size_must_be_positive():
    with pytest.raises(ModelConfigError, match="mlp.*batch_size must be a positive integer, got 0"):
        zoo.get("mlp", batch_size=0)


def test_inconsistent_config_raises():
    with pytest.raises(SoapjaxError, match="d_model 30 must be divisible by num_heads 4"):
        GPT2Config(d_model=30, num_heads=4)


# Tiny configs ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "api"), _variants())
def test_tiny_batch_leaves_lead_with_the_batch(name, api):
    w = zoo.get(name, "tiny", api=api)
    batch = w.abstract_batch()
    assert w.batch_size == 8
    assert {k: v.shape[0] for k, v in batch.items()} == {k: 8 for k in batch}


@pytest.mark.parametrize(
    ("name", "scans"),
    [
        pytest.param("rnntc", ["lstm_0", "lstm_1", "lstm_2", "lstm_3"], id="rnntc"),
        pytest.param("rnnlm", ["lstm_0", "lstm_1"], id="rnnlm"),
        pytest.param(
            "nmt",
            ["encoder/lstm_0", "encoder/lstm_1", "decoder/lstm_0", "decoder/lstm_1"],
            id="nmt",
        ),
    ],
)
def test_every_lstm_layer_is_one_named_scan(name, scans):
    w = zoo.get(name, "tiny")
    jaxpr = jax.make_jaxpr(w.loss_fn)(w.abstract_params(), w.abstract_batch()).jaxpr
    found = [str(e.source_info.name_stack) for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert [s.split("/", 1)[1] for s in found] == scans
    assert {e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"} == {8}


@pytest.mark.parametrize(("name", "api"), _variants(slow=SLOW_TINY))
def test_tiny_train_step_learns(name, api):
    w = zoo.get(name, "tiny", api=api)
    rng = jax.random.key(0)
    params = _compile(w.init_params, rng)(rng)
    abstract = w.abstract_params()
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    assert _shapes_by_module_path(params) == _shapes_by_module_path(abstract)
    opt_state = _compile(w.optimizer.init, params)(params)
    batch = _compile(w.make_batch, rng)(jax.random.key(1))
    step = _compile(w.train_step(), params, opt_state, batch)

    params1, opt_state1, loss0 = step(params, opt_state, batch)
    _, _, loss1 = step(params1, opt_state1, batch)

    assert (loss0.shape, loss0.dtype) == ((), jnp.float32)
    assert np.isfinite(float(loss0)) and np.isfinite(float(loss1))
    assert float(loss1) < float(loss0)  # the first update lowered the loss on its batch
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, params1)
    assert max(jax.tree.leaves(moved)) > 0


# The nnx twins -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TWINS)
@pytest.mark.parametrize("config", ["tiny", "default"])
def test_nnx_twin_has_linen_parameter_paths_and_shapes(name, config):
    linen = _shapes_by_module_path(zoo.get(name, config).abstract_params())
    nnx = _shapes_by_module_path(zoo.get(name, config, api="nnx").abstract_params())
    assert nnx == linen
    assert "fc1/kernel" in nnx


@pytest.mark.parametrize("name", TWINS)
def test_nnx_twin_operators_have_linen_names(name):
    def operator_names(w):
        jaxpr = jax.make_jaxpr(w.loss_fn)(w.abstract_params(), w.abstract_batch()).jaxpr
        anchors = ("dot_general", "conv_general_dilated")
        return [str(e.source_info.name_stack) for e in jaxpr.eqns if e.primitive.name in anchors]

    linen = operator_names(zoo.get(name, "tiny"))  # e.g. "MLP/fc1": linen adds its root
    nnx = operator_names(zoo.get(name, "tiny", api="nnx"))
    assert nnx == [n.split("/", 1)[1] for n in linen]
    assert nnx[0] in ("fc1", "conv1")


# Default configs: sizes and costs, from shapes only ----------------------------------------

# Parameter counts: torchvision's AlexNet, Inception-v3 (27,161,264 less the 3,326,696 of the
# aux head) and ResNet-101; GPT-2 small with tied embeddings; the others by hand below.
EXPECTED_PARAMS = {
    "alexnet": 61_100_840,
    "inception_v3": 23_834_568,
    "resnet101": 44_549_160,
    # embedding 32000x1024, 4 LSTMs of 8H^2+4H (input 1024 = H), classifier 1024x2+2
    "rnntc": 32000 * 1024 + 4 * (8 * 1024**2 + 4 * 1024) + 2050,
    # embedding 10000x2048, 2 LSTMs of 8H^2+4H, softmax 2048x10000+10000
    "rnnlm": 10000 * 2048 + 2 * (8 * 2048**2 + 4 * 2048) + 2048 * 10000 + 10000,
    # 2 embeddings, 4 LSTMs, attention W_a (HxH) and W_c (2HxH), softmax
    "nmt": 2 * 32000 * 1024 + 4 * (8 * 1024**2 + 4 * 1024) + 3 * 1024**2 + 1024 * 32000 + 32000,
    "lenet": 520 + 25_050 + 400_500 + 5010,
    "mlp": (1024 * 4096 + 4096) + 3 * (4096 * 4096 + 4096) + 4096 * 1000 + 1000,
    "gpt2": 124_439_808,
}


def _lstm_train_flops(batch, steps, layers, d_in, hidden):
    return 3 * batch * steps * layers * 2 * (d_in + hidden) * 4 * hidden


# Training FLOPs, about 3x the forward matmuls, where a closed form is easy; the RNN ones check
# that every one of the 40 scan steps is counted.
EXPECTED_FLOPS = {
    "rnntc": _lstm_train_flops(64, 40, 4, 1024, 1024),
    "rnnlm": _lstm_train_flops(64, 40, 2, 2048, 2048) + 3 * 2 * 64 * 40 * 2048 * 10000,
    "nmt": _lstm_train_flops(64, 40, 4, 1024, 1024) + 3 * 2 * 64 * 40 * 1024 * 32000,
    "mlp": 6 * 256 * EXPECTED_PARAMS["mlp"],
    # 6 N T over the matmul weights (all but wpe and LayerNorms) plus 3 x 4 T^2 d per layer
    "gpt2": 6 * 8 * 1024 * (124_439_808 - 1024 * 768 - 25 * 2 * 768)
    + 3 * 4 * 8 * 1024**2 * 768 * 12,
    # 3 x 2 x 7.8 GMACs x 64 images
    "resnet101": 3 * 2 * 7.8e9 * 64,
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, id=n, marks=[pytest.mark.heavy] * (n in SLOW_DEFAULT)) for n in NAMES],
)
def test_default_summary(name):
    w = zoo.get(name)
    live_bytes = sum(x.nbytes for x in jax.live_arrays())
    s = zoo.summarize(w)
    assert sum(x.nbytes for x in jax.live_arrays()) - live_bytes < 2**20  # nothing materialised
    assert (s.name, s.config, s.api, s.batch_size) == (name, "default", "linen", w.batch_size)
    assert s.param_count == EXPECTED_PARAMS[name]
    assert s.param_bytes == 4 * s.param_count
    assert s.flops_per_step > 0
    if name in EXPECTED_FLOPS:
        assert s.flops_per_step == pytest.approx(EXPECTED_FLOPS[name], rel=0.1)


def test_step_flops_counts_every_scan_step():
    def step(w, xs):
        return jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), xs[0], xs)[0]

    args = (
        jax.ShapeDtypeStruct((64, 64), jnp.float32),
        jax.ShapeDtypeStruct((10, 8, 64), jnp.float32),
    )
    looped = jax.jit(step).lower(*args).cost_analysis()["flops"]
    assert looped < 2 * 2 * 8 * 64 * 64  # XLA's own count: the loop body once
    assert zoo.step_flops(step, *args) == pytest.approx(10 * 2 * 8 * 64 * 64, rel=0.05)


def test_default_batches_follow_the_paper():
    shapes = {n: zoo.get(n).abstract_batch() for n in NAMES}
    assert shapes["alexnet"]["image"].shape == (256, 224, 224, 3)
    assert shapes["inception_v3"]["image"].shape == (64, 299, 299, 3)
    assert shapes["resnet101"]["image"].shape == (64, 224, 224, 3)
    assert shapes["lenet"]["image"].shape == (64, 28, 28, 1)
    assert shapes["rnntc"]["tokens"].shape == (64, 40)
    assert shapes["rnnlm"]["inputs"].shape == (64, 40)
    assert {k: v.shape for k, v in shapes["nmt"].items()} == {
        "source": (64, 40),
        "target_inputs": (64, 40),
        "targets": (64, 40),
    }
    assert shapes["gpt2"]["inputs"].shape == (8, 1024)
    assert shapes["mlp"]["inputs"].shape == (256, 1024)


def test_summary_of_nnx_twin_matches_linen():
    linen = zoo.summarize(zoo.get("mlp", "tiny"))
    nnx = zoo.summarize(zoo.get("mlp", "tiny", api="nnx"))
    assert (nnx.api, nnx.param_count) == ("nnx", linen.param_count)
    assert nnx.flops_per_step == pytest.approx(linen.flops_per_step, rel=0.01)
