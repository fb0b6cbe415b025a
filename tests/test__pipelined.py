"""The pipelined step (soapjax.apply._pipelined): the unsharded step's numbers, the schedule's
transfers.

Every case runs on cpu8 as stage 2 x data 2 x model 2 with M = 4 microbatches of the batch of
16, in float64, the layers' parameters split over ``model`` as Megatron-LM splits them (heads
and the MLP's hidden dim), the batch over ``data`` (the data axes, but where a case says
otherwise). Compiled programs are shared between the tests (`compiled`), so each is compiled
once.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import float64_model
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from test_corpus import _eqns

from soapjax.apply._deferred import weight_matmuls
from soapjax.apply._pipeline_layout import from_pipelined, pipelined_layout_shardings, to_pipelined
from soapjax.apply._pipelined import _cut, _Groups, _split_axes, pipelined_value_and_grad, ticks
from soapjax.base.errors import PlanError
from soapjax.exactness import compare_gradients
from soapjax.measure.hlo import collectives
from soapjax.strategy.pipeline import SCHEDULES, device_orders
from soapjax.strategy.space import RecomputePolicy

FAST = {"xla_backend_optimization_level": 0}
STAGES, MICROBATCHES, BATCH = 2, 4, 16
# Megatron's split of a layer over "model", by module: the dim of its stacked kernel and of its
# bias that "model" splits (column-parallel q/k/v and fc1/gate/up split heads or the hidden
# dim; row-parallel out/fc2/down split their input, and their bias not at all).
MODEL_SPLIT = {**dict.fromkeys(("query", "key", "value", "q", "k", "v"), (2, 1)),
               **dict.fromkeys(("fc1", "gate", "up"), (2, 1)),
               **dict.fromkeys(("out", "o", "fc2", "down"), (1, None))}


def mesh(model: int = 2):
    """stage 2 x data 2 x model 2, or with ``model=4`` stage 2 x data 1 x model 4."""
    return jax.make_mesh((STAGES, 4 // model, model), ("stage", "data", "model"),
                         axis_types=(AxisType.Auto,) * 3)


def model_case(name: str, layers: int):
    """`float64_model` (tests/conftest.py) at this file's batch, compiled as here; no workload."""
    return float64_model(name, layers, BATCH, fast=True)[1:]


def megatron_specs(params):
    def spec(path, x):
        module, leaf = (getattr(k, "key", None) for k in path[-2:])
        kernel_dim, bias_dim = MODEL_SPLIT.get(module, (None, None))
        dim = kernel_dim if leaf == "kernel" else bias_dim
        if dim is None or getattr(path[1], "key", None) != "layers":
            return PartitionSpec()
        return PartitionSpec(*(["model" if d == dim else None for d in range(x.ndim)]))

    return jax.tree_util.tree_map_with_path(spec, params)


def compiled(name: str, schedule: str, virtual: int, recompute: RecomputePolicy,
             data_axes: tuple[str, ...] = ("data",), *, scatter_gather: bool | None = None,
             model: int = 2):
    """The compiled pipelined step of the tiny model (2 layers per virtual stage), its loss and
    gradients (in the model's layout). Scatter/gather is on but where `data_axes` is empty:
    the batch is split over ``data`` all the same, which the step would take for a model axis
    the activations are replicated over (`pipelined_value_and_grad`)."""
    if scatter_gather is None:
        scatter_gather = bool(data_axes)
    return _compiled(name, schedule, virtual, recompute, data_axes, scatter_gather, model)


@functools.cache  # every argument passed, so each case has one key
def _compiled(name: str, schedule: str, virtual: int, recompute: RecomputePolicy,
              data_axes: tuple[str, ...], scatter_gather: bool, model: int):
    params, batch, graph, _ = model_case(name, STAGES * virtual)
    m = mesh(model)
    with jax.enable_x64(True):
        step = pipelined_value_and_grad(graph, m, stages=STAGES, microbatches=MICROBATCHES,
                                        virtual=virtual, schedule=schedule, recompute=recompute,
                                        data_axes=data_axes, scatter_gather=scatter_gather)
        shardings = pipelined_layout_shardings(graph, m, megatron_specs(params), stages=STAGES,
                                               virtual=virtual)
        placed = jax.device_put(to_pipelined(graph, params, stages=STAGES, virtual=virtual),
                                shardings)
        batch = jax.device_put(batch, NamedSharding(m, PartitionSpec("data")))
        exe = jax.jit(step).lower(placed, batch).compile(compiler_options=FAST)
        loss, grads = exe(placed, batch)
        grads = from_pipelined(graph, grads, stages=STAGES, virtual=virtual)
    return loss, grads, exe


def assert_unsharded(name: str, virtual: int, loss, grads) -> None:
    """Loss and every gradient equal ``jax.value_and_grad(loss_fn)`` on one device to 1e-12
    (global max |diff| / global max |ref|)."""
    _, _, _, (want_loss, want) = model_case(name, STAGES * virtual)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)))
    scale = max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(want))
    assert diff / scale < 1e-12
    assert abs(float(loss) - float(want_loss)) / abs(float(want_loss)) < 1e-12


# name, schedule, virtual, recompute, data axes
CASES = [("gpt", "gpipe", 1, "none", ("data",)), ("gpt", "1f1b", 1, "none", ("data",)),
         ("gpt", "1f1b", 1, "full", ("data",)), ("gpt", "interleaved", 2, "none", ("data",)),
         ("gpt", "1f1b", 1, "full", ()), ("llama", "1f1b", 1, "none", ("data",)),
         ("gpt", "zb-h1", 1, "selective", ("data",)),
         ("llama", "zb-interleaved", 2, "none", ("data",))]
IDS = ["gpt-gpipe-saved", "gpt-1f1b-saved", "gpt-1f1b-recomputed", "gpt-interleaved-saved",
       "gpt-1f1b-recomputed-whole-microbatches", "llama-1f1b-saved", "gpt-zb-h1-selective",
       "llama-zb-interleaved-saved"]


def test_every_schedule_of_the_table_runs_here():
    """Every order of the table (the gathered-stash forms run the zero-bubble ones: without
    a plan's layouts the two are one, tests/test_apply_pipelined.py runs both with them)."""
    assert {SCHEDULES[case[1]].order for case in CASES} == {r.order for r in SCHEDULES.values()}


@pytest.mark.parametrize("name,schedule,virtual,recompute,data_axes", CASES, ids=IDS)
def test_the_pipelined_step_computes_the_unsharded_step(name, schedule, virtual, recompute,
                                                        data_axes):
    """The unsharded step's loss and gradients (`assert_unsharded`): 2 layers on 2 stages
    (gpipe, 1f1b), 4 layers in 4 chunks (interleaved, 2 virtual stages), with the residuals
    saved or recomputed.

    Not the whole product: each case covers what the others do not. GPipe (a stage keeps all
    M microbatches in flight), 1F1B and interleaved (middle chunks, whose forward and backward
    neither start from the prologue nor end in the epilogue) with saved residuals, where each
    kind of chunk keeps its own (`_Residuals`); recomputation, which keeps each chunk's input
    instead, with 1F1B; LLaMA (RMSNorm, rotary embeddings, an untied head split over the
    vocabulary, whose gather `_run_in_stage` makes whole first) with its residuals saved,
    where the head's are among them; and the stages over whole microbatches (no data axes,
    XLA reducing the gradients in the loop), once. Four of them are compiled for the other
    tests anyway. tests/test_apply_pipelined.py recomputes both models under 1F1B and
    interleaved (and GPT tiny 1F1B without and with selective recomputation), so recomputed
    interleaved chunks and recomputed LLaMA are checked there.
    """
    loss, grads, _ = compiled(name, schedule, virtual, recompute, data_axes)
    assert_unsharded(name, virtual, loss, grads)


def over_data(exe) -> list:
    """The compiled step's collectives over the ``data`` axis (with others or alone)."""
    return [c for c in collectives(exe.as_text(), mesh()) if "data" in (c.axes or ())]


def test_the_data_parallel_gradients_are_reduced_once_per_step():
    """With the data axes, each data group's backwards add its own share of the gradients,
    and the step all-reduces them over ``data`` once, after the tick loop: one all-reduce of
    86,920 bytes per device, run once (GPT tiny, 1F1B). That is one stage's layer gradients,
    51,584 bytes (one layer under Megatron's split: 6,448 float64 per device), the final
    norm's, the tied embedding's twice (read by the head in the last chunk and by the
    prologue, each reduced before they are added) and the position embedding's, 4,416 float64
    = 35,328 bytes, and the loss, 8 (XLA combines them into one).

    Without data axes the stages run whole microbatches and XLA all-reduces each backward's
    gradients over ``data`` inside the loop, M = 4 times a step: 68,480 bytes per backward on
    stage 0 and 51,584 on stage 1 (each in its branch of the tick's switch), and 8 per
    last-chunk forward (the loss), besides the 18,432 of the embeddings' gradients after the
    loop (`HloCollective.executions` counts a collective in the loop once per tick; its
    branch runs on M of them). The numbers are the same (`CASES`).
    """
    once = over_data(compiled("gpt", "1f1b", 1, "none")[2])
    assert [(c.kind, c.executions) for c in once] == [("all-reduce", 1)] * len(once)
    assert sum(c.nbytes for c in once) == 86_920
    in_loop = over_data(compiled("gpt", "1f1b", 1, "full", ())[2])
    ticks_1f1b = len(ticks("1f1b", STAGES, MICROBATCHES))
    assert sorted((c.kind, c.nbytes, c.executions) for c in in_loop) == [
        ("all-reduce", 8, ticks_1f1b), ("all-reduce", 18_432, 1),
        ("all-reduce", 51_584, ticks_1f1b), ("all-reduce", 68_480, ticks_1f1b)]


def sending_sets(rows, kind: str, step: int, keep) -> list[tuple[tuple[int, int], ...]]:
    """Per tick of the tick table, the (source, target) stages that send a `kind` result."""
    return [tuple((s, (s + step) % STAGES) for s, a in enumerate(row)
                  if a is not None and a.kind == kind and keep(a.chunk)) for row in rows]


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2)],
                         ids=["1f1b", "interleaved"])
def test_the_stages_send_what_the_schedule_needs(schedule, virtual):
    """The compiled program's collective-permutes are the pipeline's transfers and no others.

    Per microbatch and chunk boundary one activation goes forward (chunk c's forward to chunk
    c + 1's stage) and one gradient back: M (C - 1) of each, C = S v chunks: 4 + 4 for 1F1B
    (C = 2), 12 + 12 interleaved (C = 4). The tick loop holds one collective-permute per
    direction and *set* of stages that send at one tick, inside a switch on the tick, over
    exactly those stages (each stage pair is data x model = 4 device pairs): 1F1B has one set
    per direction (stage 0 -> 1 forward, 1 -> 0 back); interleaved three ({0 -> 1}, {1 -> 0}
    and both at once, where two stages send at one tick). Each moves half a microbatch's
    activation: 4 samples / data 2 x 8 tokens x d_model 32 x 8 bytes = 4096 bytes per device,
    replicated over "model" (Megatron's split), so each of the 2 replicas sends its half
    (scatter/gather, `test_scatter_gather_sends_one_piece_per_model_replica`).
    """
    text = compiled("gpt", schedule, virtual, "none")[2].as_text()
    chunks = STAGES * virtual
    rows = ticks(schedule, STAGES, MICROBATCHES, virtual)
    m = mesh()
    permutes = [c for c in collectives(text, m) if c.kind == "collective-permute"]
    seen = {"pipeline_activations": [], "pipeline_gradients": []}
    for c in permutes:
        scope = next(s for s in seen if s in c.op_name)  # no other collective-permutes
        assert c.nbytes == 2048 and c.axes == ("stage",)
        stage_of = {d: d // 4 for d in range(8)}  # device id -> stage (row-major mesh)
        pairs = {(stage_of[a], stage_of[b]) for a, b in c.source_target_pairs}
        assert len(c.source_target_pairs) == 4 * len(pairs)
        seen[scope].append(tuple(sorted(pairs)))
    for scope, kind, step, keep in (("pipeline_activations", "F", 1, lambda c: c < chunks - 1),
                                    ("pipeline_gradients", "B", -1, lambda c: c > 0)):
        per_tick = sending_sets(rows, kind, step, keep)
        assert sorted(seen[scope]) == sorted({tuple(sorted(p)) for p in per_tick if p})
        assert sum(len(p) for p in per_tick) == MICROBATCHES * (chunks - 1)
    assert len(permutes) == {"1f1b": 2, "interleaved": 6}[schedule]


def pipeline_collectives(exe, m) -> list[tuple[str, str, tuple[str, ...], int]]:
    """The compiled step's collectives of the stage-to-stage sends: (scope, kind, axes, bytes
    per device)."""
    scopes = ("pipeline_activations", "pipeline_gradients")
    return sorted((next(s for s in scopes if s in c.op_name), c.kind, c.axes, c.nbytes)
                  for c in collectives(exe.as_text(), m) if any(s in c.op_name for s in scopes))


@pytest.mark.parametrize("model", [2, 4], ids=["model2-data2", "model4"])
def test_scatter_gather_sends_one_piece_per_model_replica(model):
    """Megatron-LM's scatter/gather (`soapjax.apply._pipelined`): the activation a stage sends and
    the gradient it sends back, replicated over the r = `model` replicas of Megatron's split,
    go as r pieces, one per replica, each 1/r of the whole along d_model (the last dim r
    divides), and the receiver all-gathers them over ``model``; the numbers stay the unsharded
    step's. GPT tiny 1F1B: a microbatch's activation is [2, 8, 32] float64 per device with
    data 2 (4096 bytes), [4, 8, 32] with data 1 (8192); with scatter_gather=False it goes
    whole and nothing is gathered. Every other collective of the step is the same either way.
    """
    whole_bytes = {2: 4096, 4: 8192}[model]
    m = mesh(model)
    got, others = {}, {}
    for on in (False, True):
        loss, grads, exe = compiled("gpt", "1f1b", 1, "none", scatter_gather=on, model=model)
        assert_unsharded("gpt", 1, loss, grads)
        got[on] = pipeline_collectives(exe, m)
        others[on] = sorted((c.kind, c.axes, c.nbytes, c.executions)
                            for c in collectives(exe.as_text(), m) if "pipeline_" not in c.op_name)
    assert others[True] == others[False]  # the layers' own layouts stay as they were
    scopes = ("pipeline_activations", "pipeline_gradients")
    assert got[False] == [(s, "collective-permute", ("stage",), whole_bytes) for s in scopes]
    assert got[True] == sorted(
        [(s, "collective-permute", ("stage",), whole_bytes // model) for s in scopes]
        + [(s, "all-gather", ("model",), whole_bytes) for s in scopes])


@pytest.mark.parametrize("model,data_axes,groups,on,want", [
    (2, ("data",), ("data",), True, (("model", 2),)),
    (4, ("data",), (), True, (("model", 4),)),
    (2, (), (), True, (("data", 2), ("model", 2))),
    (2, ("data",), (), True, ()),
    (2, ("data",), ("data",), False, ()),
], ids=["data-groups", "data-of-size-1", "no-data-axes", "whole-microbatches-over-data", "off"])
def test_the_values_sent_are_split_over_the_model_axes(model, data_axes, groups, on, want):
    """The axes the scatter/gather splits a sent value over: the stage's automatic axes but
    the data axes; none where the stages run whole microbatches of a batch split over an
    automatic data axis (its layout there is XLA's), or with scatter_gather=False."""
    count = 2 if groups else 1
    assert _split_axes(mesh(model), "stage", data_axes, _Groups(groups, count, (0,)),
                       on) == want


def test_1f1b_keeps_fewer_activations_than_gpipe():
    """Same numbers, less memory: the compiled step's temporaries (XLA's memory analysis) with
    1F1B, which keeps at most S microbatches' residuals per stage, below GPipe's, which keeps
    all M (recomputing, the chunk inputs only: fewer still)."""
    def temp(schedule, recompute="none"):
        exe = compiled("gpt", schedule, 1, recompute)[2]
        return exe.memory_analysis().temp_size_in_bytes

    assert temp("1f1b") < temp("gpipe")
    assert temp("1f1b", "full") < temp("1f1b")


def test_ticks_follow_the_schedule_orders():
    """Every stage runs `device_orders` in order, each action once."""
    for schedule, virtual, m in (("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved", 2, 4)):
        rows = ticks(schedule, STAGES, m, virtual)
        for s, order in enumerate(device_orders(schedule, STAGES, m, virtual)):
            assert tuple(row[s] for row in rows if row[s] is not None) == order


@pytest.mark.parametrize("recompute", [True, "selected"], ids=["a-bool", "a-misspelling"])
def test_recompute_is_one_of_the_strategy_policies(recompute):
    _, _, graph, _ = model_case("gpt", 2)
    with pytest.raises(PlanError, match=r"recompute=.*: expected one of "
                                        r"\('none', 'selective', 'full'\)"):
        pipelined_value_and_grad(graph, mesh(), stages=STAGES, microbatches=MICROBATCHES,
                                 recompute=recompute)


@pytest.mark.parametrize("data_axes", [("batch",), ("stage",), ("data", "data")],
                         ids=["not-on-the-mesh", "the-stage-axis", "twice"])
def test_data_axes_that_are_not_other_mesh_axes_are_refused(data_axes):
    _, _, graph, _ = model_case("gpt", 2)
    with pytest.raises(PlanError, match=rf"data_axes={re.escape(str(data_axes))}: expected "
                                        r"distinct axes of the mesh \{'stage': 2, 'data': 2, "
                                        r"'model': 2\} other than the stage axis 'stage'"):
        pipelined_value_and_grad(graph, mesh(), stages=STAGES, microbatches=MICROBATCHES,
                                 data_axes=data_axes)


CANARY = """
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"), axis_types=(AxisType.Auto,) * 3)

def loss(w, x, y):
    logp = jax.nn.log_softmax(x @ w)
    return -jnp.take_along_axis(logp, y[..., None], -1).mean()

def body(w, x, y):
    value, grad = jax.value_and_grad(loss)(w, x, y)
    return value[None], grad[None]

f = jax.shard_map(body, mesh=mesh, axis_names={"stage"}, in_specs=(P(), P(), P()),
                  out_specs=(P("stage"), P("stage")), check_vma=False)
w = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P(None, "model")))
x = jax.device_put(jnp.ones((4, 8, 32)), NamedSharding(mesh, P("data")))
y = jax.device_put(jnp.zeros((4, 8), jnp.int32), NamedSharding(mesh, P("data")))
print(jax.jit(f)(w, x, y)[0])
"""


def test_xla_still_aborts_on_a_gather_split_along_its_index_inside_shard_map():
    """The canary for `_run_in_stage`: a vocabulary-split head and ``take_along_axis`` of the
    log-probabilities inside a shard_map manual over ``stage`` abort XLA (jax 0.10.2), so the
    chunks make a gather's operand whole along the dims it indexes first. The day this test
    fails, XLA partitions it and the all-gather can go."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", CANARY], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "Check failed: partition_group_list" in proc.stderr, (
        proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])


def _gathers(jaxpr) -> list:
    return [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name == "gather"]


def _run(jaxpr, args, swap):
    """`jaxpr` evaluated equation by equation, `swap(eqn)` (or None) computing one instead."""
    env = dict(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [v.val if isinstance(v, jax.extend.core.Literal) else env[v] for v in eqn.invars]
        fn = swap(eqn)
        if fn is not None:
            outs = fn(*ins)
        elif eqn.primitive.name in ("jit", "pjit"):
            outs = _run(eqn.params["jaxpr"].jaxpr, ins, swap)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [env[v] for v in jaxpr.outvars]


TAKES = {  # take_along_axis as losses write it, and the forms jnp traces it to
    "last": lambda x, i: jnp.take_along_axis(x, i[..., None], -1),
    "clip": lambda x, i: jnp.take_along_axis(x, i[..., None], -1, mode="clip"),
    "middle": lambda x, i: jnp.take_along_axis(x.transpose(0, 2, 1), i[:, None, :], 1),
    "first": lambda x, i: jnp.take_along_axis(x.transpose(2, 0, 1), i[None], 0),
    "one sample": lambda x, i: jnp.take_along_axis(x[:1], i[:1, :, None], -1),
    "one token": lambda x, i: jnp.take_along_axis(x[:, :1], i[:, :1, None], -1),
    "optax": lambda x, i: optax.softmax_cross_entropy_with_integer_labels(x, i),
}


@pytest.mark.parametrize("take", TAKES)
@pytest.mark.parametrize("labels", [[[0, 4, 2], [1, 3, -1]], [[0, 7, 2], [1, 3, -9]]],
                         ids=["in range", "out of range"])
def test_a_picking_gather_runs_as_a_masked_sum_with_the_same_numbers(take, labels):
    """`_masked_pick` (what a stage runs for a gather `picked_dim` names) against the gather
    itself, in float64: the same values and gradients bit for bit, an index out of range
    giving the gather's fill (NaN) or clamped; an embedding lookup and a plain index are not
    picks."""
    from soapjax.apply._pipelined import _masked_pick
    from soapjax.graph._program import picked_dim

    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 5)))
        i = jnp.asarray(labels, jnp.int32)
        closed = jax.make_jaxpr(TAKES[take])(x, i)
        # optax's also picks element 0 of the picked values' size-1 dim (``[..., 0]``)
        picks = [e for e in _gathers(closed.jaxpr) if picked_dim(e) is not None]
        assert len(picks) == (2 if take == "optax" else 1)

        def run(x, masked):
            return _run(closed.jaxpr, [x, i], lambda e: _masked_pick(e, picked_dim(e))
                        if masked and any(e is p for p in picks) else None)[0]

        want, got = run(x, False), run(x, True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # FILL_OR_DROP fills an index out of range with NaN; "one token" keeps none of them
        out_of_range = labels[0][1] == 7 and take not in ("clip", "one token")
        assert np.isnan(np.asarray(want)).any() == out_of_range
        grad = [jax.grad(lambda x, m=m: jnp.nansum(run(x, m) ** 2))(x) for m in (False, True)]
        np.testing.assert_array_equal(np.asarray(grad[1]), np.asarray(grad[0]))
        table = jnp.zeros((7, 4))
        for lookup in (lambda t, j: t[j], lambda t, j: jnp.take(t, j[0], axis=1)):
            eqns = _gathers(jax.make_jaxpr(lookup)(table, i).jaxpr)
            assert eqns and all(picked_dim(e) is None for e in eqns)


def test_a_pick_of_bfloat16_or_integers_is_exact_and_of_booleans_is_not_a_pick():
    """bf16 log-probabilities (bf16 compute) and integers pick exactly by a masked sum; a
    boolean gather is left a gather (no sum of booleans)."""
    from soapjax.apply._pipelined import _masked_pick
    from soapjax.graph._program import picked_dim

    i = jnp.asarray([[0, 4, 2], [1, 3, 4]], jnp.int32)
    x = np.random.default_rng(1).standard_normal((2, 3, 5)) * 100
    for dtype in (jnp.bfloat16, jnp.int32, jnp.bool_):
        xs = jnp.asarray(x > 0 if dtype == jnp.bool_ else x, dtype)
        closed = jax.make_jaxpr(TAKES["last"])(xs, i)
        eqn = _gathers(closed.jaxpr)[0]
        if dtype == jnp.bool_:
            assert picked_dim(eqn) is None
            continue
        got = _run(closed.jaxpr, [xs, i], lambda e: _masked_pick(e, 2) if e is eqn else None)
        np.testing.assert_array_equal(np.asarray(got[0], np.float64),
                                      np.asarray(TAKES["last"](xs, i), np.float64))


@pytest.mark.parametrize("name,schedule,virtual,recompute", [
    ("gpt", "zb-h1", 1, "selective"), ("llama", "zb-interleaved", 2, "none"),
    ("llama", "zb-h1", 1, "none"), ("llama", "zb-h1", 1, "full")])
def test_a_split_backward_computes_each_gradient_leaf_of_the_unsharded_step(
        name, schedule, virtual, recompute):
    """ZB-H1 and the zero-bubble interleaved schedule (the weights' gradients deferred to W
    actions, `soapjax.apply._deferred`): every
    gradient leaf within 1e-12 of its own scale (`compare_gradients`), the weight matmuls
    found (GPT: q, k, v, out, fc1, fc2; Llama: q, k, v, o, gate, up, down) so the W branch
    is the one computing their gradients."""
    loss, grads, exe = compiled(name, schedule, virtual, recompute)
    _, _, graph, (want_loss, want) = model_case(name, STAGES * virtual)
    cut = _cut(graph)
    assert len(weight_matmuls(cut.program, cut.scan, cut.layer)) == {"gpt": 6, "llama": 7}[name]
    comparison = compare_gradients(loss, grads, want_loss, want, tolerance=1e-12)
    assert comparison.passed, comparison.describe()
