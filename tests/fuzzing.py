"""The randomized exactness suite: seeded random strategies, each held to ``jax.grad`` in float64.

A *subject* is a model built in float64 (parameters perturbed by N(0, 0.05), so no gradient is
zero by construction) with its traced graph and the unsharded loss and gradients of the user's
own loss, computed once: every corpus model (`tests/corpus`, the styles users write) and the
zoo's tiny models that carry what the corpus has not (a layer scan to pipeline, experts,
soapjax's flash attention for ring attention).

`draw` makes a random strategy of a subject on a topology: a config for every operator drawn
from its SOAP space with up to two mesh axes on a dim (`soapjax.search.random_strategy`, the
layers of a scan tied), and at random recomputation (per operator, or per position of every
layer), microbatches, ZeRO-3 axes, the distributed optimizer, ring attention where the model
has flash attention, and pipeline stages (every schedule and interleave the model's layer
scan allows) where it has a layer scan. `check` applies it
(`soapjax.apply.step.sharded_value_and_grad` on the topology's mesh of virtual CPU devices) and
compares loss and every gradient leaf with the reference, each leaf relative to its own scale
(`soapjax.exactness`): at most 1e-9. A strategy apply refuses (a `PlanError`: a config its
validation does not allow) is counted as refused, not as a failure; `shrink` cuts a failing strategy
down to the fewest changes from data parallelism that still fail.

``make test`` runs a fixed few per subject (`one_device`, `seeded`): the corpus models' in
`tests/test_corpus.py`, the zoo's in `tests/test_fuzz_exactness.py`;
`scripts/fuzz_exactness.py` runs thousands.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NamedTuple

import corpus
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import soapjax_zoo as zoo
from soapjax.apply import step as apply
from soapjax.apply._pipeline_layout import check_pipelinable
from soapjax.base.errors import PlanError
from soapjax.exactness import (
    TOLERANCE as EXACT_BARS,
    GradientComparison,
    compare_gradients,
    narrowest_float,
    reading_operators,
)
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.search import interleave_choices, random_strategy, stage_choices
from soapjax.strategy import space
from soapjax.strategy.memory import microbatch_choices, microbatch_error
from soapjax.strategy.pipeline import SCHEDULES
from soapjax.strategy.space import RECOMPUTE_POLICIES, MeshShape, SpaceLimits, Strategy
from soapjax.topology.cluster import Topology, load_topology, make_mesh, stage_topology

NOISE = 0.05
TOLERANCE = 1e-9  # float64, per leaf (soapjax.exactness); `Subject.tolerance` may be coarser
FAST = corpus.FAST_COMPILE
LIMITS = SpaceLimits(max_axes_per_dim=2)
# The zoo's tiny models the corpus lacks the idioms of: a layer scan (pipelines; four layers
# for 4 stages and interleaved ones), experts, soapjax's own flash attention (ring
# attention). (Its LSTMs start their carries in float32, so they do not trace in float64;
# the corpus's lstm_dropout stands for them.)
ZOO = (("gpt", "tiny"), ("llama", "tiny"), ("llama", "tiny-flash"), ("llama", "tiny-deep"),
       ("moe", "tiny"), ("lenet", "tiny"))
# mixed_precision computes in bfloat16 whatever its parameters are: not a float64 subject
SKIP = {"mixed_precision"}


class Subject(NamedTuple):
    """A model ready to fuzz.

    Attributes:
      name: ``corpus:<name>`` or ``zoo:<name>:<config>``.
      graph: its traced graph (float64).
      params, batch: the values (float64 parameters).
      loss: the pure ``loss(params, batch)`` the graph traced.
      reference: ``(loss, grads)`` of the user's loss, unsharded, on one device.
      operators: per parameter leaf, the operator reading it.
      tolerance: the bar per leaf: `TOLERANCE`, or coarser where the model rounds to a
        narrower float whatever its parameters' type (``jax.nn.dot_product_attention``
        takes its softmax in float32: `soapjax.exactness.rounding_tolerance`).
      computed_in: the narrowest float type the step computes in, whose rounding sets the
        floor of a leaf whose true gradient is zero (`soapjax.exactness.compare_gradients`).
      compiler_options: what the reference and every applied step compile with: `FAST`,
        and a corpus model's `corpus.Entry.exact_compile` over it.
    """

    name: str
    graph: OpGraph
    params: Any
    batch: Any
    loss: Callable[[Any, Any], Any]
    reference: tuple[Any, Any]
    operators: list[str]
    computed_in: str
    compiler_options: dict[str, Any] = FAST

    @property
    def tolerance(self) -> float:
        """The bar per leaf (see the attribute list): `computed_in`'s."""
        return max(TOLERANCE, EXACT_BARS[self.computed_in])


def names() -> list[str]:
    """Every subject's name: the corpus first, then the zoo's."""
    return ([f"corpus:{n}" for n in corpus.names() if n not in SKIP]
            + [f"zoo:{m}:{c}" for m, c in ZOO])


# --- make test's few: a seeded random strategy per subject ----------------------------------------

# Every subject whose float64 gradients tests/test_corpus.py's fixed strategies do not hold
# already: the corpus models with ``gradients_in="fuzz"`` (checked in tests/test_corpus.py,
# whose process makes the model anyway: `corpus.made64`) and the zoo's
# (tests/test_fuzz_exactness.py).
MAKE_TEST = [n for n in names() if not n.startswith("corpus:")
             or corpus.CORPUS[n.split(":", 1)[1]].gradients_in == "fuzz"]
TRIES = 4  # a strategy apply refuses (`PlanError`) is redrawn, up to so many times
CPU8 = load_topology("cpu8")
NODES = load_topology(str(Path(__file__).resolve().parent / "meshes" / "cpu8-nodes.toml"))
ONE = load_topology("cpu8-1")


def one_device(name: str) -> Outcome:
    """The unsharded data-parallel strategy of subject `name` on one device, checked."""
    s = subject(name)
    return check(s, space.data_parallel(s.graph, MeshShape.of(ONE)), ONE)


def seeded(name: str) -> tuple[Strategy, Topology, Outcome]:
    """Make test's random strategy of `name` (one of `MAKE_TEST`): drawn with a seed of its
    own on ``cpu8`` (data=2 x model=4) or ``cpu8-nodes`` (node=2 x data=2 x model=2, where
    stages cut the node axis; the subjects alternate) and checked; one apply refuses is
    redrawn, up to `TRIES` times. Returns the last strategy, its topology and outcome."""
    s = subject(name)
    rng = np.random.default_rng(sum((k + 1) * ord(c) for k, c in enumerate(name)))
    topology = (CPU8, NODES)[MAKE_TEST.index(name) % 2]
    for _ in range(TRIES):
        strategy = draw(s, topology, rng)
        out = check(s, strategy, topology)
        if not out.refused:
            break
    return strategy, topology, out


@functools.cache
def subject(name: str) -> Subject:
    """The subject `name` (built once per process)."""
    kind, rest = name.split(":", 1)
    options = FAST | dict(corpus.CORPUS[rest].exact_compile if kind == "corpus" else ())
    with jax.enable_x64(True):
        if kind == "corpus":
            loss_fn, arg, batch = corpus.made64(rest)  # (shared with tests/test_corpus.py)
            if corpus.CORPUS[rest].api == "nnx":
                graphdef, params, other = nnx.split(arg, nnx.Param, ...)

                def loss(p, b, loss_fn=loss_fn, graphdef=graphdef, other=other):
                    return loss_fn(nnx.merge(graphdef, p, jax.tree.map(jnp.asarray, other)), b)
            else:
                loss, params = loss_fn, arg
        else:
            model, config = rest.split(":")
            w = zoo.get(model, config)
            params = jax.jit(w.init_params, compiler_options=FAST)(jax.random.key(0))
            params = jax.tree.map(lambda x: x.astype(jnp.float64)
                                  if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
            batch = jax.jit(w.make_batch, compiler_options=FAST)(jax.random.key(1))
            loss = w.loss_fn
        params = jiggle(params, NOISE)
        # exact semantics even for the zoo's mixture of experts (which accepts statistics per
        # microbatch: `soapjax.trace`): the reference is the whole batch's step
        graph = trace(loss, params, batch, name=name.replace(":", "-"),
                      microbatch_statistics=False)
        reference = jax.jit(jax.value_and_grad(loss), compiler_options=options)(params, batch)
    return Subject(name, graph, params, batch, loss, reference, reading_operators(graph),
                   narrowest_float(graph), options)


def jiggle(tree: Any, noise: float, seed: int = 0) -> Any:
    """Adds N(0, noise) to every float leaf (deterministic): parameters a few steps in. In
    numpy: XLA would compile an add per leaf shape (the sum is the same IEEE one)."""
    rng = np.random.default_rng(seed)

    def add(x):
        if not noise or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jnp.asarray(np.asarray(x) + (noise * rng.standard_normal(x.shape)).astype(x.dtype))

    return jax.tree.map(add, tree)


def draw(s: Subject, topology: Topology, rng: np.random.Generator,
         schedules: Collection[str] | None = None) -> Strategy:
    """A random strategy of `s` on `topology` (module doc). `schedules`: pipelined ones alone
    (where the subject takes stages), of those schedules."""
    graph = s.graph
    stages = stage_choices(graph, topology) if _pipelinable(graph) else ()
    S = int(rng.choice(stages)) if stages and rng.random() < 0.4 else 1
    if schedules is not None and stages and S == 1:
        S = int(rng.choice(stages))
    # a pipelined strategy's configs are over one stage's devices (the outer axis cut)
    mesh = MeshShape.of(stage_topology(topology, S) if S > 1 else topology)
    # no attribute splits where the model convolves: a spatially split input to a convolution
    # is refused (XLA computes it wrongly; `soapjax.apply.step.constrained_loss`), as the corpus
    # tests plan them
    convolves = any(op.anchor == "conv_general_dilated" for op in graph.operators)
    strategy = random_strategy(graph, mesh, rng,
                               dataclasses.replace(LIMITS, allow_attribute=not convolves))
    axes = list(mesh.axis_names)
    if rng.random() < 0.3:  # recomputation: per operator, tied over every layer's position
        policies = [RECOMPUTE_POLICIES[int(k)] for k in
                    rng.integers(len(RECOMPUTE_POLICIES), size=len(graph.operators))]
        for group in graph.repeated_blocks():
            for j in group[1:]:
                policies[j] = policies[group[0]]
        strategy = dataclasses.replace(strategy, recompute=tuple(policies))
    if rng.random() < 0.25:
        ms = [m for m in microbatch_choices(graph) if m in (2, 4)
              and _divides(graph, strategy, mesh, m)]
        if ms:
            strategy = strategy.with_microbatches(int(rng.choice(ms)))
    if rng.random() < 0.25:
        strategy = dataclasses.replace(strategy, zero_axes=_subset(axes, rng))
    elif rng.random() < 0.2:
        strategy = dataclasses.replace(strategy, optimizer_axes=_subset(axes, rng))
    if S > 1:
        return _pipelined(graph, strategy, S, mesh, rng, schedules)
    if any(op.anchor == "attention" for op in graph.operators) and rng.random() < 0.3:
        strategy = dataclasses.replace(strategy, ring_attention=True)
    return strategy


def _pipelinable(graph: OpGraph) -> bool:
    """Whether apply can pipeline `graph` at all (one layer scan, no random bits)."""
    try:
        check_pipelinable(graph, stages=1, microbatches=1)
    except PlanError:
        return False
    return True


def _subset(axes: list[str], rng: np.random.Generator) -> tuple[str, ...]:
    picked = tuple(a for a in axes if rng.random() < 0.5)
    return picked or (axes[int(rng.integers(len(axes)))],)


def _divides(graph: OpGraph, strategy: Strategy, mesh: MeshShape, m: int) -> bool:
    """Whether `m` microbatches divide every operator's per-device batch (apply refuses
    them otherwise: `soapjax.strategy.memory.microbatch_error`)."""
    return not any(microbatch_error(op, c, mesh, m)
                   for op, c in zip(graph.operators, strategy.configs))


def _pipelined(graph: OpGraph, strategy: Strategy, S: int, mesh: MeshShape,
               rng: np.random.Generator, schedules: Collection[str] | None = None
               ) -> Strategy:
    """`strategy` with a random pipeline of `S` stages its numbers allow (else unchanged), of
    `schedules` where given."""
    options = []
    for v in interleave_choices(graph, S):
        for schedule in SCHEDULES if schedules is None else schedules:
            for m in microbatch_choices(graph):
                if not _divides(graph, strategy, mesh, m):
                    continue
                try:
                    check_pipelinable(graph, stages=S, microbatches=m, virtual=v,
                                      schedule=schedule)
                except PlanError:
                    continue
                options.append((v, schedule, m))
    if not options:
        return strategy
    v, schedule, m = options[int(rng.integers(len(options)))]
    return strategy.with_microbatches(m).with_pipeline(S, v, schedule)


class Outcome(NamedTuple):
    """What `check` found: a comparison, the reason apply refused the strategy (a
    `PlanError`), or the error it crashed with (anything else: a failure too)."""

    comparison: GradientComparison | None
    refused: str = ""
    crashed: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.crashed) or (self.comparison is not None and not self.comparison.passed)

    def describe(self) -> str:
        return (f"CRASH {self.crashed}" if self.crashed else f"refused: {self.refused}"
                if self.refused else self.comparison.describe())


def error_line(e: BaseException) -> str:
    """``Type: the first line of its message`` (an assertion may have none), at most 300
    characters of it: how a crash is reported."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def check(s: Subject, strategy: Strategy, topology: Topology) -> Outcome:
    """Applies `strategy` and compares its loss and gradients with the reference."""
    mesh = make_mesh(topology)
    with jax.enable_x64(True):
        try:
            fn, sh = apply.sharded_value_and_grad(s.graph, strategy, mesh, params=s.params,
                                                  batch=s.batch,
                                                  compiler_options=s.compiler_options)
            loss, grads = jax.block_until_ready(fn(apply.device_put_global(s.params, sh.params),
                                                   apply.device_put_global(s.batch, sh.batch)))
        except PlanError as e:  # (blocked: a step failing at run time is a crash, reported)
            return Outcome(None, str(e))
        except Exception as e:  # noqa: BLE001  apply crashing is a failure to report
            return Outcome(None, crashed=error_line(e))
        # an interleaved pipeline's stacked layers come back in chunk order
        return Outcome(compare_gradients(loss, apply.model_layout(grads), *s.reference,
                                         tolerance=s.tolerance, operators=s.operators,
                                         computed_in=s.computed_in))


def describe(strategy: Strategy, graph: OpGraph) -> str:
    """The strategy's step-level choices and the operators it splits, in one line."""
    parts = []
    if strategy.pipelined:
        parts.append(f"S={strategy.stages} v={strategy.virtual_stages} {strategy.schedule}")
    if strategy.microbatches > 1:
        parts.append(f"M={strategy.microbatches}")
    if strategy.zero_axes:
        parts.append(f"zero={','.join(strategy.zero_axes)}")
    if strategy.optimizer_axes:
        parts.append(f"zero1={','.join(strategy.optimizer_axes)}")
    if strategy.ring_attention:
        parts.append("ring")
    recomputed = sum(p != "none" for p in strategy.recompute)
    if recomputed:
        parts.append(f"recompute x{recomputed}")
    split = sum(bool(c.used_axes) for c in strategy.configs)
    parts.append(f"{split}/{len(strategy.configs)} operators split")
    return ", ".join(parts)


def shrink(s: Subject, strategy: Strategy, topology: Topology) -> Strategy:
    """The failing `strategy` with as many of its choices undone (each operator's config
    replicated, with every layer's where layers repeat; each step-level choice dropped) as
    keep it failing: a small reproducer."""
    def fails(candidate: Strategy) -> bool:
        return check(s, candidate, topology).failed

    for field, plain in (("stages", None), ("ring_attention", False), ("zero_axes", ()),
                         ("optimizer_axes", ()), ("recompute", ()), ("microbatches", 1)):
        if field == "stages":
            candidate = strategy.with_pipeline(1, 1, "1f1b")
        else:
            candidate = dataclasses.replace(strategy, **{field: plain})
        if candidate != strategy and fails(candidate):
            strategy = candidate
    group_of = {j: g for g in s.graph.repeated_blocks() for j in g}
    for j, op in enumerate(s.graph.operators):
        if strategy.configs[j].used_axes and group_of.get(j, [j])[0] == j:
            candidate = strategy  # a layer's operator with every layer's (a scan's are tied)
            for k in group_of.get(j, [j]):
                candidate = candidate.replace(k, space.Config.replicated(s.graph.operators[k]))
            if fails(candidate):
                strategy = candidate
    return strategy
