"""Megatron's sequence parallelism (Korthikanti et al. 2022) applied on cpu8: the float64
gradients of the unsharded step, and the tensor-parallel collectives of the compiled step
(over the ``model`` axis) priced by the simulator, kind by kind.

What XLA emits for one layer of the tiny GPT under ``megatron(..., sequence_parallel=True)``
(norms and residual adds split along the sequence over ``model``), as Megatron has it:

* forward: one all-gather of the split LayerNorm output that Q, K and V share and one of the
  second LayerNorm's output before fc1; a reduce-scatter of the row-parallel partial sums of
  attn/out and of fc2 into the sequence split (apply constrains each matmul's result there,
  so the bias and fc2's residual are added on the slice: `soapjax.apply._flatstep._Layouts`);
* backward, mirrored: an all-gather of each of those two outputs' cotangents and a
  reduce-scatter of fc1's input cotangent; of Q, K and V's input cotangents one
  reduce-scatter each (each reduced straight into the sequence split and the three slices
  summed; Megatron sums first and reduce-scatters once: under jax 0.10.2's Auto mesh axes a
  partial sum cannot flow through an add, as ``unreduced`` layouts need Explicit axes).

Before (ce113d5) the row-parallel outputs were all-reduced whole, the residual gathered for
fc2, and Q, K and V's cotangents all-reduced whole and summed before the slice.
"""

from __future__ import annotations

import jax
import pytest
from conftest import float64_model

from soapjax.apply.step import batch_shardings, constrained_loss, device_put_global, param_shardings
from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import Resharder
from soapjax.measure import hlo
from soapjax.simulate.front import simulate
from soapjax.strategy import baselines
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology, make_mesh

TOPOLOGY = load_topology("cpu8")
MESH = MeshShape.of(TOPOLOGY)
_COLLECTIVE_TASKS = ("reshard", "reshard_backward", "partial_sum", "inner_reduce",
                     "inner_reduce_backward", "grad_sync")


@pytest.fixture(scope="module")
def applied():
    """The float64 tiny GPT, its SP strategy, the sharded loss and gradients, the compiled
    HLO of that value_and_grad, and the unsharded reference."""
    w, params, batch, graph, want = float64_model("gpt", 2, 8, fast=True)
    strategy = baselines.megatron(graph, MESH, ("model",), sequence_parallel=True)
    mesh = make_mesh(TOPOLOGY)
    with jax.enable_x64(True):
        loss = constrained_loss(graph, strategy, mesh)
        ps = param_shardings(graph, strategy, mesh, params=params)
        bs = batch_shardings(graph, strategy, mesh, batch=batch)
        step = jax.jit(jax.value_and_grad(loss), in_shardings=(ps, bs), out_shardings=(None, ps),
                       compiler_options={"xla_backend_optimization_level": 0})
        args = device_put_global((params, batch), (ps, bs))
        got = step(*args)
        text = step.lower(*args).compile().as_text()
    return graph, strategy, text, got, want


def _hlo_over_model(text: str) -> dict[str, tuple[int, float]]:
    """Per kind, (collectives, bytes) over the ``model`` axis alone; an instruction of several
    buffers (XLA's combiner merges independent collectives) counts once per buffer. The
    all-reduces are those of matmuls' partial sums (``all_reduce_matmul``) apart from the rest
    (statistics, parameter gradients), which XLA groups over other axes than the simulator."""
    out: dict[str, tuple[int, float]] = {}
    for c in hlo.collectives(text, MESH, reduce_scatter_from_slices=True):
        if c.axes == ("model",):
            k = c.kind.replace("-", "_")
            if k == "all_reduce" and c.op_name.endswith("/dot_general"):
                k = "all_reduce_matmul"
            n, b = out.get(k, (0, 0.0))
            out[k] = (n + len(c.shapes) * c.executions, b + c.nbytes * c.executions)
    return out


def _simulated_over_model(graph, strategy) -> tuple[dict[str, tuple[int, float]], list[str]]:
    """Per kind, (tasks, bytes) of the simulator's collectives over ``model`` (activations and
    gradients), and their names; all-reduces of partial sums and partial cotangents as
    ``all_reduce_matmul``."""
    cm = cost_model(graph, TOPOLOGY, mode="analytic")
    with Resharder(MESH, mode="ideal") as resharder:
        sim = simulate(graph, TOPOLOGY, strategy, cost_model=cm, resharder=resharder)
    out: dict[str, tuple[int, float]] = {}
    names = []
    for t in sim.tasks:
        if t.kind in _COLLECTIVE_TASKS and t.name.endswith(" over model"):
            k = t.name.split(" ", 1)[0]
            if k == "all_reduce" and t.kind in ("partial_sum", "reshard_backward"):
                k = "all_reduce_matmul"
            n, b = out.get(k, (0, 0.0))
            out[k] = (n + 1, b + t.nbytes)
            names.append(t.name)
    return out, names


def test_sequence_parallel_gradients_are_exact(applied):
    *_, got, want = applied
    (loss, grads), (want_loss, want_grads) = got, want
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-12)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert g.dtype == w.dtype == "float64"
        assert float(abs(g - w).max()) <= 1e-12 * max(1.0, float(abs(w).max()))


def test_sequence_parallel_collectives_are_priced_as_compiled(applied):
    graph, strategy, text, *_ = applied
    xla = _hlo_over_model(text)
    predicted, _ = _simulated_over_model(graph, strategy)
    # per layer 2 gathers forward (ln_1 shared by Q/K/V, ln_2 before fc1), 2 backward (the
    # cotangents of attn/out and fc2), but the last layer's fc2 cotangent comes from ln_f: 2 * 4;
    # the head's input gather (float64 activations of 8 x 8 x 32 per data replica: 8192
    # bytes each); and the tied embedding's gradient (64 x 32), gathered from its
    # sequence-split reader
    assert xla["all_gather"] == (2 * 4 + 1 + 1, 9 * 8192.0 + 64 * 32 * 8), (xla, predicted)
    # per layer 2 forward (attn/out, fc2), 4 backward (fc1's input, Q's, K's, V's); the head's
    # input cotangent (bytes: the whole buffer each reduces)
    assert xla["reduce_scatter"] == (2 * 6 + 1, 13 * 8192.0), (xla, predicted)
    # no matmul's partial sums all-reduced whole any more
    assert "all_reduce_matmul" not in xla, xla
    assert "all_reduce_matmul" not in predicted, predicted
    for kind in ("all_gather", "reduce_scatter"):
        (n, b), (pn, pb) = xla[kind], predicted[kind]
        assert pn == n, (kind, xla, predicted)
        assert pb == pytest.approx(b, rel=0.10), (kind, b, pb)


def test_one_gather_feeds_q_k_and_v(applied):
    graph, strategy, *_ = applied
    _, names = _simulated_over_model(graph, strategy)
    for layer in ("layers_0", "layers_1"):
        into_qkv = [n for n in names if n.startswith(f"all_gather {layer}/ln_1 -> ")]
        assert into_qkv == [f"all_gather {layer}/ln_1 -> {layer}/attn/query over model"]
        # the row-parallel outputs are reduce-scattered into the norms' sequence split
        for op in ("attn/out", "mlp/fc2"):
            assert f"reduce_scatter {layer}/{op} (partial sums) over model" in names
        # the cotangents of Q, K and V are reduce-scattered each into the sequence split
        back = [n.split(" ", 1)[0] for n in names if n.startswith(("all_reduce d(",
                "reduce_scatter d(")) and f"{layer}/ln_1 -> " in n]
        assert back == ["reduce_scatter"] * 3
        # fc2 adds the residual on its slice: nothing gathers it
        assert not [n for n in names if n.startswith(f"all_gather {layer}/ln_2 -> ")
                    and "fc2" in n]
