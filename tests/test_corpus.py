"""soapjax on Flax models written the way users write them (`tests/corpus`): exact gradients.

Every corpus model is traced once (module cache) and its gradient, computed through soapjax,
is compared with ``jax.grad`` of the user's own loss, in float64:

    error = max over leaves ( max |g_soapjax - g_ref| / max |g_ref| of that leaf )  <=  1e-12

(each leaf against its own scale, `soapjax.exactness`: one global scale would let a small
leaf's wrong gradient hide under a large leaf's)

* on a one-device mesh (data=1 x model=1), and on ``cpu8`` (data=2 x model=4) under data
  parallelism, Megatron-style tensor parallelism (over ``model``), FSDP (ZeRO-3 over both
  axes) and a searched plan (analytic costs, 200 proposals, seed 0): ``jax.grad`` of
  `soapjax.apply.step.constrained_loss`, jitted with the strategy's parameter and batch shardings;
* end to end through `soapjax.training.shard_training` with ``optax.sgd(1.0)`` (gradient =
  parameters before - after), in float64 under data parallelism (its default), and in float32
  (the float64 case rounded) under the searched plan: loss and update within 1e-5, relative,
  of the unsharded float32 step.

Parameters are the models' own initial values plus N(0, 0.05) noise, so no gradient is zero by
construction, except ResNet-18's: its own initialisation (zero BatchNorm scales closing every
residual block) puts exact zeros into its ReLUs, where soapjax must apply relu's own derivative
rule; a perturbed ResNet-18 is compared too. nnx models are made pure as `shard_training`
makes them: ``nnx.split(model, nnx.Param, ...)`` outside, ``nnx.merge`` inside the loss; the
reference is ``nnx.value_and_grad`` of the user's loss on the merged model, checked equal to
``jax.grad`` of that pure loss. A float64 difference above 1e-12 is a wrong gradient, not
rounding: sharded reduction orders move float64 results by ~1e-15.

The corpus models this file holds no fixed strategies' gradients of
(``gradients_in="fuzz"``) are held to ``jax.grad`` here too, on one device and under a seeded
random strategy on ``cpu8`` or ``cpu8-nodes`` (tests/fuzzing.py's subjects): this process makes
every corpus model anyway, and making one is most of what a check of it costs.

Each model is made once (`corpus.made64`); its cases, references and traced graphs are built
once (`case`, cached) and shared by its tests; `test_every_shard_program_builds` also builds
every per-device program the cost stage would time.

mixed_precision computes in bfloat16, so it is held to bfloat16's precision instead (see
`BF16_TOL`). The whole file compiles ~100 small programs; run it alone with
``.venv/bin/python -m pytest -q tests/test_corpus.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import corpus
import fuzzing
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from corpus import ste as ste_model
from flax import nnx
from jax.sharding import Mesh

from soapjax import training
from soapjax.apply.step import (
    batch_shardings,
    constrained_loss,
    device_put_global,
    param_shardings,
)
from soapjax.cost.operators import cost_model
from soapjax.exactness import compare_gradients
from soapjax.graph._local import operator_fn
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.search import SearchSettings, search
from soapjax.strategy import baselines, space
from soapjax.strategy.space import MeshShape, SpaceLimits, Strategy
from soapjax.topology.cluster import load_topology, make_mesh

TOPOLOGY = load_topology("cpu8")
MESH_SHAPE = MeshShape.of(TOPOLOGY)
X64_TOL = 1e-12  # float64: global max |diff| / global max |reference|
F32_TOL = 1e-5  # float32: loss and update, relative
# mixed_precision computes in bfloat16 (8 significant bits, 1 ulp = 2**-8 = 3.9e-3 relative)
# whatever its parameters' type: a different reduction order (sharding), or only other XLA
# fusion choices, moves its gradient by a few ulps of its largest entry (the reference itself,
# compiled with default instead of FAST_COMPILE options, moves by 9.4e-3; sharded: up to
# 1.4e-2). 4e-2 (10 ulps) still fails a missing or doubled gradient reduction (>= 0.5).
BF16_TOL = 4e-2
TOLERANCE = {"mixed_precision": (BF16_TOL, BF16_TOL)}  # name -> (float64, float32)
NOISE = 0.05
# ResNet-18 is compared at its own initialisation: its zero-initialised BatchNorm scales make
# ReLU inputs exactly zero, where relu's custom_jvp rule (derivative 0) and the tie rule of the
# max it is built on (1/2) disagree; perturbed, it is compared too
# (test_resnet18_perturbed_gradient_is_exact).
PERTURB = {"resnet18": 0.0}
FAST_COMPILE = corpus.FAST_COMPILE
jiggle = fuzzing.jiggle  # (tests/test_gpt_dropout.py and test_tied_dims.py import it from here)
STRATEGIES = ("data_parallel", "megatron", "fsdp", "searched")


# --- cases --------------------------------------------------------------------------------------


class Case(NamedTuple):
    """A corpus model ready to compare.

    Attributes:
      name: the corpus name.
      entry: its `corpus.Entry`.
      loss_fn: the user's loss (``(params, batch)`` or ``(model, batch)``).
      user_arg: what the user passes to it and to `shard_training`: params, or the nnx model.
      params: the trained parameters as a pytree (nnx: the `nnx.Param` state).
      batch: the batch.
      pure_loss: ``pure_loss(params, batch) -> scalar`` (nnx: merged inside).
      graph: ``soapjax.graph.opgraph.trace(pure_loss, params, batch)`` (float64 only).
      ref_loss: the loss at (params, batch), by plain jax.
      ref_grads: ``jax.grad`` of the plain loss, like `params`.
      x64: float64 or float32.
    """

    name: str
    entry: corpus.Entry
    loss_fn: Callable
    user_arg: Any
    params: Any
    batch: Any
    pure_loss: Callable
    graph: OpGraph | None
    ref_loss: float
    ref_grads: Any
    x64: bool


def float64_workload(w: Any, name: str) -> tuple[OpGraph, Any, Any, Any]:
    """A zoo workload built in float64: its graph, parameters (init + N(0, 0.05): `jiggle`),
    a batch, and the unsharded ``jax.grad`` of its loss (the reference of the sharded
    gradient tests)."""
    with jax.enable_x64(True):
        params = jiggle(jax.jit(w.init_params, compiler_options=FAST_COMPILE)(jax.random.key(0)),
                        0.05)
        batch = jax.jit(w.make_batch, compiler_options=FAST_COMPILE)(jax.random.key(1))
        grads = jax.jit(jax.grad(w.loss_fn), compiler_options=FAST_COMPILE)(params, batch)
        graph = trace(w.loss_fn, params, batch, name=name)
    return graph, params, batch, grads


@functools.cache
def case(name: str, x64: bool = True, noise: float | None = None) -> Case:
    """The model in float64, or (``x64=False``) its float64 case rounded to float32; its
    parameters perturbed by N(0, noise) (default: `NOISE`, or the entry's in `PERTURB`)."""
    noise = PERTURB.get(name, NOISE) if noise is None else noise
    if not x64:
        return _rounded(case(name, True, noise))
    loss_fn, arg, batch = corpus.made64(name)
    with jax.enable_x64(True):
        if corpus.CORPUS[name].api == "nnx":
            arg = nnx.clone(arg)
            nnx.update(arg, jiggle(nnx.state(arg, nnx.Param), noise))
        else:
            arg = jiggle(arg, noise)
        return _prepare(name, loss_fn, arg, batch, x64=True)


class Traced(NamedTuple):
    """What the graph-only tests read of a model (`traced`)."""

    pure_loss: Callable
    params: Any
    batch: Any
    graph: Any


@functools.cache
def traced(name: str) -> Traced:
    """The float64 model's pure loss, parameters, batch and traced graph: `case`'s where this
    file holds the model's gradients under its fixed strategies, else its `fuzzing.subject`'s
    (test_a_random_strategy_is_exact holds those models' gradients)."""
    if corpus.CORPUS[name].gradients_in == "corpus":
        c = case(name)
        return Traced(c.pure_loss, c.params, c.batch, c.graph)
    s = fuzzing.subject(f"corpus:{name}")
    return Traced(s.loss, s.params, s.batch, s.graph)


def _rounded(c: Case) -> Case:
    """The case with its float parameters, state and batch rounded to float32 (the models'
    ``param_dtype`` only chooses what ``init`` creates; computation follows the arrays)."""
    def cast(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    arg = c.user_arg
    if c.entry.api == "nnx":
        arg = nnx.clone(arg)
        nnx.update(arg, cast(nnx.state(arg)))
    else:
        arg = cast(arg)
    return _prepare(c.name, c.loss_fn, arg, cast(c.batch), x64=False)


def _prepare(name: str, loss_fn: Callable, arg: Any, batch: Any, *, x64: bool) -> Case:
    """The pure loss, the reference loss and gradient, and the traced graph."""
    entry = corpus.CORPUS[name]
    with jax.enable_x64(x64):
        if entry.api == "nnx":
            graphdef, params, rest = nnx.split(arg, nnx.Param, ...)

            def pure_loss(p, b):
                # Fresh Variables for the rest of the state, made in the current trace: merging
                # the split's own would hand nnx.scan variables of the outer trace, which it
                # refuses to update ("Cannot extract graph node from different trace level").
                return loss_fn(nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest)), b)

            def user_value_and_grad(state, b):  # nnx.value_and_grad of the user's loss
                return nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state), b)

            ref_loss, ref_grads = jit(user_value_and_grad)(nnx.state(arg), batch)
            if x64:  # the pure loss is the user's loss
                pure_error = relative_error(jit(jax.grad(pure_loss))(params, batch), ref_grads)
                assert pure_error <= X64_TOL, f"{name}: pure != user's: {pure_error:.3g}"
        else:
            params, pure_loss = arg, loss_fn
            ref_loss, ref_grads = jit(jax.value_and_grad(loss_fn))(params, batch)
        # the float32 tests go through shard_training, which traces for itself
        graph = trace(pure_loss, params, batch, name=name) if x64 else None
    return Case(name, entry, loss_fn, arg, params, batch, pure_loss, graph, float(ref_loss),
                ref_grads, x64)


def jit(fn: Callable, **kwargs) -> Callable:
    return jax.jit(fn, compiler_options=FAST_COMPILE, **kwargs)


def relative_error(got: Any, want: Any, tolerance: float = X64_TOL,
                   computed_in: str | None = None) -> float:
    """The largest over the leaves of max |got - want| over that leaf's own max |want|, each
    leaf against its own scale (a leaf whose true gradient is zero against the floor:
    `soapjax.exactness.compare_gradients`, whose floor depends on `tolerance` and the float
    type the gradients were `computed_in`, default the leaves' own); NaN stays NaN.
    One global scale would hide a small leaf's wrong gradient under a large leaf's."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), (len(got_leaves), len(want_leaves))
    for g, w in zip(got_leaves, want_leaves):
        assert np.shape(g) == np.shape(w), (np.shape(g), np.shape(w))
    err = compare_gradients(0.0, [np.asarray(g) for g in got_leaves], 0.0,
                            [np.asarray(w) for w in want_leaves], tolerance=tolerance,
                            computed_in=computed_in).max_error
    return float("nan") if math.isinf(err) else err


def worst_leaf(got: Any, want: Any) -> str:
    """The path of the leaf with the largest difference, for failure messages."""
    rows = []
    for (kp, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
        d = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
        rows.append((np.nan_to_num(np.max(d), nan=np.inf) if d.size else 0.0,
                     jax.tree_util.keystr(kp)))
    value, path = max(rows)
    return f"{path} (max abs diff {value:.3g})"


# --- strategies ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


@functools.cache
def searched(name: str) -> Strategy:
    """The MCMC search's plan for the float64 graph on cpu8 (analytic costs, 200 proposals,
    seed 0); convolutions are never split spatially (`constrained_loss` refuses that: XLA
    computes it wrongly). The float32 graph has the same operators, so it takes the same plan."""
    c = case(name)
    limits = SpaceLimits(allow_attribute=not corpus.CORPUS[name].has_conv)
    cm = cost_model(c.graph, TOPOLOGY, mode="analytic")
    return search(c.graph, TOPOLOGY, cost_model=cm,
                  settings=SearchSettings(max_proposals=200, seed=0, limits=limits)).strategy


def make_strategy(kind: str, name: str) -> Strategy:
    graph = case(name).graph
    if kind == "data_parallel":
        return space.data_parallel(graph, MESH_SHAPE)
    if kind == "megatron":
        return baselines.megatron(graph, MESH_SHAPE, ("model",))
    if kind == "fsdp":
        return baselines.fsdp(graph, MESH_SHAPE)
    if kind == "searched":
        return searched(name)
    raise ValueError(kind)


@functools.cache
def cpu8_grads(name: str, kind: str) -> Any:
    return soapjax_grads(case(name), make_strategy(kind, name), make_mesh(TOPOLOGY))


def soapjax_grads(c: Case, strategy: Strategy, mesh: Mesh) -> Any:
    """``jax.grad`` of the constrained loss, jitted with the strategy's input shardings."""
    return sharded_grads(c.graph, strategy, mesh, c.params, c.batch, x64=c.x64)


def sharded_grads(graph: Any, strategy: Strategy, mesh: Mesh, params: Any, batch: Any, *,
                  x64: bool = True) -> Any:
    """`soapjax_grads` of any traced graph, its parameters and batch."""
    with jax.enable_x64(x64):
        grad, args = _sharded_grad(graph, strategy, mesh, params, batch)
        return grad(*args)


def sharded_grads_and_hlo(graph: Any, strategy: Strategy, mesh: Mesh, params: Any,
                          batch: Any) -> tuple[Any, str]:
    """`sharded_grads` in float64, and the compiled step's HLO text (its collectives)."""
    with jax.enable_x64(True):
        grad, args = _sharded_grad(graph, strategy, mesh, params, batch)
        return grad(*args), grad.lower(*args).compile().as_text()


def _sharded_grad(graph: Any, strategy: Strategy, mesh: Mesh, params: Any,
                  batch: Any) -> tuple[Callable, tuple[Any, Any]]:
    """``jax.grad`` of the constrained loss, jitted with the strategy's parameter and batch
    shardings, and ``(params, batch)`` placed so (call it under the `jax.enable_x64` the
    values were made in)."""
    ps = param_shardings(graph, strategy, mesh, params=params)
    bs = batch_shardings(graph, strategy, mesh, batch=batch)
    grad = jit(jax.grad(constrained_loss(graph, strategy, mesh)), in_shardings=(ps, bs),
               out_shardings=ps)
    return grad, device_put_global((params, batch), (ps, bs))


def tolerance(name: str, x64: bool) -> float:
    return TOLERANCE.get(name, (X64_TOL, F32_TOL))[0 if x64 else 1]


def computed_in(c: Case) -> str:
    """The float type the case's gradients are computed in (its rounding)."""
    return "bfloat16" if c.name in TOLERANCE else "float64" if c.x64 else "float32"


def check_grads(c: Case, got: Any, where: str) -> None:
    tol = tolerance(c.name, c.x64)
    err = relative_error(got, c.ref_grads, tol, computed_in=computed_in(c))
    print(f"{c.name} {where}: relative gradient error {err:.3g}")
    assert err <= tol, (f"{c.name} {where}: relative gradient error {err:.3g} > {tol}; "
                        f"worst leaf {worst_leaf(got, c.ref_grads)}")


# --- float64 gradients --------------------------------------------------------------------------

NAMES = corpus.names()
# The models whose float64 gradients this file holds under its fixed strategies; the others'
# under a seeded random strategy each (`corpus.Entry.gradients_in`; below).
GRADIENT_NAMES = [n for n in NAMES if corpus.CORPUS[n].gradients_in == "corpus"]
# The others: tests/fuzzing.py's subjects, checked here, where their models are made anyway
FUZZ_NAMES = [n.split(":", 1)[1] for n in fuzzing.MAKE_TEST if n.startswith("corpus:")]


@pytest.mark.parametrize("name", FUZZ_NAMES)
def test_one_device_is_exact(name):
    """The unsharded data-parallel strategy on one device against ``jax.grad`` of the user's
    loss, every leaf within its subject's bar (`fuzzing.one_device`)."""
    out = fuzzing.one_device(f"corpus:{name}")
    assert out.comparison is not None, out.refused
    assert out.comparison.max_error <= fuzzing.subject(f"corpus:{name}").tolerance, \
        out.comparison.describe()


@pytest.mark.parametrize("name", FUZZ_NAMES)
def test_a_random_strategy_is_exact(name):
    """A seeded random strategy (every freedom of the SOAP space, stages where the model has a
    layer scan) on ``cpu8`` or ``cpu8-nodes`` against ``jax.grad`` (`fuzzing.seeded`)."""
    strategy, topology, out = fuzzing.seeded(f"corpus:{name}")
    assert not out.refused, f"{fuzzing.TRIES} strategies refused; the last: {out.refused}"
    assert not out.failed, (topology.name,
                            fuzzing.describe(strategy, traced(name).graph), out.describe())


@pytest.mark.parametrize("name", GRADIENT_NAMES)
def test_one_device_gradient_is_exact(name, one_device_mesh):
    c = case(name)
    strategy = space.data_parallel(c.graph, MeshShape.of(one_device_mesh))
    check_grads(c, soapjax_grads(c, strategy, one_device_mesh), "one device")


CPU8_CASES = [(n, k) for n in GRADIENT_NAMES for k in STRATEGIES]


@pytest.mark.parametrize("name,kind", CPU8_CASES, ids=[f"{n}-{k}" for n, k in CPU8_CASES])
def test_cpu8_gradient_is_exact(name, kind):
    check_grads(case(name), cpu8_grads(name, kind), f"cpu8 {kind}")


def sgd_step(c: Case, strategy: Any, opt_lr: float = 1.0):
    """One `shard_training` step with ``optax.sgd(opt_lr)``: (parameters after it, loss)."""
    with jax.enable_x64(c.x64):
        arg = nnx.clone(c.user_arg) if c.entry.api == "nnx" else c.user_arg
        run = training.shard_training(c.loss_fn, arg, c.batch, optax.sgd(opt_lr),
                                      mesh=TOPOLOGY, strategy=strategy,
                                      compiler_options=FAST_COMPILE)
        after, _, loss = run.step(run.params, run.opt_state, run.shard_batch(c.batch))
        return jax.tree.map(np.asarray, after), float(loss)


@pytest.mark.parametrize("name", GRADIENT_NAMES)
def test_shard_training_float64_gradient_is_exact(name):
    c = case(name)
    after, loss = sgd_step(c, space.data_parallel)
    grads = jax.tree.map(lambda p, q: np.asarray(p, np.float64) - q, c.params, after)
    assert loss == pytest.approx(c.ref_loss, rel=tolerance(c.name, c.x64), abs=0)
    check_grads(c, grads, "shard_training data_parallel")


# The float32 case reuses modules built with param_dtype=float64, which flax reads only to
# check a parameter's shape against its initialiser (jax.eval_shape of it): harmless here.
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64:UserWarning")
@pytest.mark.parametrize("name", GRADIENT_NAMES)
def test_shard_training_float32_step_matches(name):
    c = case(name, x64=False)
    after, loss = sgd_step(c, searched(name))
    update = jax.tree.map(lambda p, q: np.asarray(p, np.float64) - q, c.params, after)
    err = relative_error(update, c.ref_grads, tolerance(c.name, c.x64),
                         computed_in=computed_in(c))
    print(f"{name} float32 searched: loss {loss:.7g} vs {c.ref_loss:.7g}, update error {err:.3g}")
    assert loss == pytest.approx(c.ref_loss, rel=tolerance(c.name, c.x64), abs=0)
    assert err <= tolerance(c.name, c.x64), f"{err:.3g}; {worst_leaf(update, c.ref_grads)}"


@pytest.mark.parametrize("kind", ["data_parallel", "searched"])
def test_resnet18_perturbed_gradient_is_exact(kind):
    c = case("resnet18", noise=NOISE)  # every gradient nonzero: the residual branches' too
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(c.ref_grads))
    check_grads(c, soapjax_grads(c, make_strategy(kind, "resnet18"), make_mesh(TOPOLOGY)),
                f"perturbed, cpu8 {kind}")


# --- shard programs -----------------------------------------------------------------------------


# Every corpus model's, with no exception since 2026-12-04: Gemma-3's second layer (queries' and
# keys' sequence dims tied by one operand: tests/test_tied_dims.py) and CLIP's loss (the labels
# of its batched gather, ``arange(B)``, kept whole where the logits' rows are split) were strict
# xfails until then.
@pytest.mark.parametrize("name", NAMES)
def test_every_shard_program_builds(name):
    """Every operator's per-device program (what the cost stage times) builds at the shard
    shapes of every config in the search space, and returns outputs of those shapes. The
    dgx-h100x8 topology has cpu8's mesh (data=2 x model=4), so this covers both."""
    assert MeshShape.of(load_topology("dgx-h100x8")) == MESH_SHAPE
    c = traced(name)
    limits = SpaceLimits(allow_attribute=not corpus.CORPUS[name].has_conv)
    failures = []
    with jax.enable_x64(True):
        for op in c.graph.operators:
            for degrees in sorted({cfg.degrees(MESH_SHAPE)
                                   for cfg in space.configs(op, MESH_SHAPE, limits)}):
                want = [tuple(size // (degrees[d] if d is not None else 1)
                              for size, d in zip(t.shape, t.dims)) for t in op.outputs]
                try:
                    fn, avals = operator_fn(c.graph, op.name, degrees, rules="primal")
                    got = [tuple(o.shape) for o in jax.eval_shape(fn, *avals)]
                    assert got == want, f"output shapes {got}, expected {want}"
                except Exception as e:  # noqa: BLE001  (collect them all)
                    failures.append(f"{op.name} at degrees {degrees} (roles "
                                    f"{''.join(op.iteration_roles)}): {type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:200]}")
    assert not failures, f"{len(failures)} shard programs fail:\n" + "\n".join(failures)


# --- the straight-through estimator, by hand ----------------------------------------------------


@pytest.mark.parametrize("kind", ["reference", "data_parallel", "megatron"])
def test_ste_gradient_is_the_straight_through_gradient(kind):
    c = case("ste")
    hand = ste_model.hand_grads(c.params, c.batch)
    got = c.ref_grads if kind == "reference" else cpu8_grads("ste", kind)
    err = relative_error(got, hand)
    assert err <= X64_TOL, f"{kind}: {err:.3g} from the hand gradient; {worst_leaf(got, hand)}"
    # differentiating round itself would zero the gradient of everything below the quantiser
    assert float(np.max(np.abs(np.asarray(got["fc1"]["kernel"])))) > 1e-3


# --- the corpus is what it says -----------------------------------------------------------------


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in _subjaxprs(eqn.params):
            names |= _primitives(sub)
    return names


def _subjaxprs(params: dict):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


IDIOMS = {
    "resnet18": {"conv_general_dilated", "reduce_window_max"},
    "ste": {"custom_vjp_call"},
    "safe_norm": {"custom_jvp_call"},
    "nnx_scan_transformer": {"scan", "remat2"},
    "linen_scan_transformer": {"scan", "remat2"},
    "linen_remat_scan_transformer": {"scan", "remat2"},
    "gqa_decoder": {"dot_general"},
    "lstm_dropout": {"scan", "random_bits"},
    "dropout_nnx": {"random_bits"},
    "mixed_precision": {"convert_element_type"},
    "named_axis_bn": {"psum"},
    "bert_encoder": {"select_n", "erfc", "tanh"},
    "t5_encdec": {"log", "scatter", "rsqrt"},
    "numbered_layers": {"dot_general"},
    "llama_gqa": {"gather", "logistic", "rsqrt"},
    "vit": {"conv_general_dilated", "concatenate", "erfc"},
    "convnext": {"conv_general_dilated", "rsqrt"},
    "mobilenet": {"conv_general_dilated", "min"},
    "mamba": {"conv_general_dilated", "pad", "scan", "log1p"},
    "gemma3": {"sin", "cos", "le", "tanh"},
    "qwen3": {"sin", "cos", "rsqrt", "logistic"},
    "whisper": {"conv_general_dilated", "tanh"},
    "kv_cache_decoder": {"dynamic_update_slice"},
    "clip": {"exp", "sqrt", "transpose"},
    "fnet": {"fft", "real"},
    "unet": {"conv_general_dilated", "exp", "cos", "rsqrt"},
    "gnn": {"gather", "scatter-add"},
    "neural_ode": {"scan", "tanh", "concatenate"},
    "padded_lm": {"cumsum", "random_bits", "pad", "concatenate", "rsqrt"},
    "mixer_mod": {"top_k", "scatter-add", "remat2", "transpose", "gather"},
    "switch_moe": {"argmax", "cumsum", "dot_general", "eq"},
    "wavenet": {"conv_general_dilated", "cond", "tanh", "logistic", "reshape"},
    "nchw_sr": {"conv_general_dilated", "rev", "reduce_window_max", "rsqrt"},
    "vivit": {"conv_general_dilated", "transpose", "concatenate", "tanh"},
    "recurrent_bn": {"scan", "top_k", "rsqrt", "logistic"},
    "expert_choice": {"top_k", "gather", "scatter-add", "transpose"},
    "bigru_tagger": {"scan", "gather", "select_n", "logistic", "concatenate"},
    "dynamic_conv": {"conv_general_dilated", "rsqrt", "reshape"},
    "swin": {"gather", "concatenate", "transpose", "slice", "tanh"},
    "dit": {"cumprod", "random_bits", "select_n", "exp", "cos", "sin"},
    "mla_packed": {"cummax", "complex", "real", "imag", "pad", "logistic"},
    "pinn": {"tanh", "add_any", "integer_pow", "unstack"},
    "wgan_gp": {"conv_general_dilated", "stop_gradient", "sqrt"},
    "gat": {"scatter-max", "scatter-add", "gather", "exp"},
    "conformer": {"conv_general_dilated", "logistic", "rsqrt", "log"},
    "glow": {"lu", "conv_general_dilated", "logistic", "transpose"},
    "shared_layers": {"scan", "dot_general", "gather", "tanh"},
    "phi3_fused": {"split", "slice", "concatenate", "logistic"},
    "dlrm": {"rem", "gather", "concatenate", "max"},
    "pointnet": {"conv_general_dilated", "reduce_max", "dot_general", "random_bits"},
    "vq_vae": {"argmin", "gather", "stop_gradient", "conv_general_dilated"},
    "rwkv": {"scan", "pad", "remat2", "name"},
    "deep_kernel_gp": {"cholesky", "triangular_solve", "platform_index", "cond"},
    "capsnet": {"scan", "conv_general_dilated", "stop_gradient", "dot_general"},
    "hyena": {"fft", "pad", "conv_general_dilated", "split"},
    "soft_moe": {"dot_general", "reduce_max", "exp", "sqrt"},
    "sparsemax_tabular": {"sort", "cumsum", "gather", "logistic"},
    "byol": {"conv_general_dilated", "stop_gradient", "rev", "sqrt"},
    "mae": {"sort", "gather", "scatter", "tile", "concatenate"},
    "sngan": {"conv_general_dilated", "stop_gradient", "rsqrt", "custom_jvp_call"},
    "perceiver": {"sin", "cos", "concatenate", "lt", "dot_general"},
    "fno": {"fft", "scatter", "conv_general_dilated", "dot_general"},
    "lru": {"exp", "real", "pad", "concatenate", "dot_general"},
    "ensemble": {"dot_general", "log", "log1p"},
}
# Grouped convolutions (feature_group_count > 1): depthwise, a channel multiplier, 4 groups.
GROUPED = {"convnext": 1, "mobilenet": 2, "mamba": 1, "conformer": 1}


@pytest.mark.parametrize("name", NAMES)
def test_corpus_model_uses_its_idiom(name):
    c = traced(name)
    with jax.enable_x64(True):
        closed = jax.make_jaxpr(c.pure_loss)(c.params, c.batch)
    prims = _primitives(closed.jaxpr)
    assert IDIOMS[name] <= prims, f"{name}: missing {IDIOMS[name] - prims}"
    if name in GROUPED:  # at least so many distinct group counts
        groups = {e.params["feature_group_count"] for e in _eqns(closed.jaxpr)
                  if e.primitive.name == "conv_general_dilated"} - {1}
        assert len(groups) >= GROUPED[name], groups
    if name == "unet":  # nn.ConvTranspose: a convolution of a dilated input
        assert any(set(e.params["lhs_dilation"]) != {1} for e in _eqns(closed.jaxpr)
                   if e.primitive.name == "conv_general_dilated")
    if name == "wavenet":  # dilated causal convolutions, vmap's grouped one of the heads
        convs = [e for e in _eqns(closed.jaxpr) if e.primitive.name == "conv_general_dilated"]
        assert {e.params["rhs_dilation"] for e in convs} >= {(2,), (4,), (8,)}
        assert any(e.params["feature_group_count"] == 4 for e in convs)
        assert any(e.primitive.name == "reshape" and e.params["dimensions"] is not None
                   for e in _eqns(closed.jaxpr))
    if name == "vivit":  # a 3D convolution: [B, T, H, W, C] clips
        assert any(len(e.invars[0].aval.shape) == 5 for e in _eqns(closed.jaxpr)
                   if e.primitive.name == "conv_general_dilated")
    if name == "ensemble":  # nn.vmap's members: matmuls batched over the member axis
        assert any(e.params["dimension_numbers"][1][0] for e in _eqns(closed.jaxpr)
                   if e.primitive.name == "dot_general")
    if name == "mixed_precision":
        dots = [e for e in _eqns(closed.jaxpr) if e.primitive.name == "dot_general"]
        assert dots and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)


def test_numbered_layers_keep_their_numeric_names():
    """Layers named "0".."3" (PyTorch's ModuleList naming) name their operators by the full
    path, the number kept: ``0/ln``, not ``ln`` or ``ln_1``."""
    names = [op.name for op in case("numbered_layers").graph.operators]
    for layer in corpus.numbered_layers.LAYER_NAMES:
        assert f"{layer}/ln" in names and f"{layer}/fc" in names, names
    assert not [n for n in names if n.startswith(("ln", "fc"))], names


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn.params):
            yield from _eqns(sub)
