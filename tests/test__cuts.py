"""Pieces cut from, or joined into, a split dim inside an operator (`soapjax.graph._cuts`):
found in the operator's equations, priced as the collective-permutes XLA compiles for them,
and held to XLA's compile of a fused-projection model under Megatron's layout."""

import jax.numpy as jnp
import pytest
from conftest import assert_delta_equals_full

from soapjax.check import compare_on_devices
from soapjax.cost.operators import cost_model
from soapjax.graph._cuts import InnerCut, inner_cuts, moved_elements
from soapjax.graph.opgraph import trace
from soapjax.simulate.front import simulate
from soapjax.strategy import baselines
from soapjax.strategy.plan import Plan
from soapjax.topology.cluster import load_topology
from soapjax_zoo.user import load


def _cut(whole, pieces, joins=False):
    return InnerCut("split", 0, whole, tuple(pieces), joins, (whole,), "float32", (0,), True)


def test_cuts_found_with_their_pieces():
    def f(p, x):
        y = x @ p["w"]  # [4, 24]
        a, b = jnp.split(y, 2, axis=-1)  # halves
        c = y[:, 4:20]  # a slice
        d = jnp.concatenate([a, b], axis=-1)  # joined again
        e = jnp.pad(y, ((0, 0), (8, 0)))  # padded on the left
        f = y[:, ::2]  # every other column
        return jnp.sum(a * b) + jnp.sum(c) + jnp.sum(d ** 2) + jnp.sum(e) + jnp.sum(f ** 3)

    g = trace(f, {"w": jnp.ones((8, 24))}, jnp.ones((4, 8)))
    cuts = {c.primitive: c for j in range(len(g.operators)) for c in inner_cuts(g, j)}
    assert cuts["split"].pieces == ((0, 12, 1), (12, 12, 1)) and not cuts["split"].joins
    assert cuts["slice"].pieces in (((4, 16, 1),), ((0, 12, 2),))
    assert cuts["concatenate"].pieces == ((0, 12, 1), (12, 12, 1))
    assert cuts["concatenate"].joins and cuts["concatenate"].whole == 24
    assert cuts["pad"].pieces == ((8, 24, 1),) and cuts["pad"].whole == 32
    assert all(c.backward for c in cuts.values())


def test_a_slice_of_the_batch_alone_moves_nothing_back():
    """Integer tokens shifted by one (``tokens[:, 1:]``): no cotangent to move back."""
    def f(p, b):
        return jnp.sum(p["e"][b["t"][:, 1:]] * p["e"][b["t"][:, :-1]])
    g = trace(f, {"e": jnp.ones((16, 4))}, {"t": jnp.zeros((4, 9), jnp.int32)})
    cuts = [c for j in range(len(g.operators)) for c in inner_cuts(g, j)]
    assert cuts and not any(c.backward for c in cuts)


@pytest.mark.parametrize("degree, whole, pieces, moved", [
    (1, 128, [(0, 64, 1), (64, 64, 1)], 0),  # nothing split
    (2, 128, [(0, 64, 1), (64, 64, 1)], 64),  # XLA: 2 permutes of 32 columns
    (4, 128, [(0, 64, 1), (64, 64, 1)], 64),  # device 1's quarter of the gate on device 0 ...
    (4, 128, [(0, 120, 1)], 6),  # the last 8 columns cut: 2 of each block's 32 shift left
    (4, 128, [(0, 64, 2)], 0),  # a stride-2 slice: each block's elements stay
    (4, 128, [(1, 64, 2)], 0),
])
def test_moved_elements(degree, whole, pieces, moved):
    assert moved_elements(_cut(whole, pieces), degree) == moved


def test_moved_elements_of_a_join_mirror_the_cut():
    pieces = [(0, 32, 1), (32, 32, 1), (64, 32, 1)]
    assert moved_elements(_cut(96, pieces, joins=True), 4) \
        == moved_elements(_cut(96, pieces), 4) == 48


def _phi3(make: str = "make"):
    w = load(f"corpus.phi3_fused:{make}")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    return w, g


def test_megatron_on_fused_projections_pays_for_moving_the_pieces():
    """Megatron's layout on Phi-3's fused projections splits the fused columns; the query and
    key columns (cut before the heads are made, split as the heads are) and the gate and up
    halves then move (collective-permutes, priced in the operator that cuts them), and their
    cotangents move back."""
    w, g = _phi3()
    topo = load_topology("cpu8")
    s = baselines.baselines(g, topo)["megatron"]
    sim = simulate(g, topo, s, cost_model=cost_model(g, topo, mode="analytic"))
    moved = {t.name for t in sim.tasks if "pieces moved" in t.name}
    # the split sits in the down projection's operator, which reads the gate and the up
    assert moved == {f"collective_permute {d} over model"
                     for layer in ("layers_0", "layers_1")
                     for part in ("mlp/down_proj", "self_attn/dot_general")
                     for d in (f"{layer}/{part} (pieces moved)", f"d({layer}/{part} pieces moved)")}
    assert_delta_equals_full(g, topo, s, moves=40)


def test_check_of_megatron_on_a_fused_mlp_matches_xla():
    """`soapjax check`'s bar on Megatron's layout over Phi-3's fused gate and up projection:
    the numbers of the unsharded step, XLA's collective bytes within 10 % (0.38 of XLA's
    before the halves' moves were priced)."""
    w, g = _phi3("make_mlp_stack")
    topo = load_topology("cpu8")
    plan = Plan.make(g, topo, baselines.baselines(g, topo)["megatron"])
    r = compare_on_devices(plan, w, repeats=1, costs="analytic", reshard="xla")
    assert r.max_abs_diff < 1e-5
    assert r.predicted_collective_bytes == pytest.approx(r.hlo_collective_bytes, rel=0.10)
    kinds = {kind for kind, _, _ in r.predicted_collectives}
    assert "collective_permute" in kinds


def test_a_transform_gathers_its_operand_and_its_results_cotangent():
    """`fft_gathers`: each transform an operator of its own, its operand gathered forward and
    its result's cotangent backward, at their shapes and dtypes (an ``rfft`` of a padded
    float operand, an ``irfft`` of a complex one)."""
    from soapjax.graph._cuts import fft_gathers

    def f(p, x):  # a long convolution by FFT
        h = x @ p["w"]  # [4, 8, 16]
        k = jnp.fft.rfft(h, n=32, axis=-1) * jnp.fft.rfft(h[::-1], n=32, axis=-1)
        return jnp.sum(jnp.fft.irfft(k, n=32, axis=-1)[..., :16] ** 2)

    g = trace(f, {"w": jnp.ones((8, 16))}, jnp.ones((4, 8, 8)))
    found = {g.operators[j].name: [(x.shape, x.dtype, x.backward) for x in fft_gathers(g, j)]
             for j in range(len(g.operators)) if fft_gathers(g, j)}
    assert len(found) == 3 and all(len(x) == 2 for x in found.values())
    rffts = [x for x in found.values() if x[0][1] == "float32"]
    assert len(rffts) == 2 and all(x == [((4, 8, 32), "float32", False),
                                         ((4, 8, 17), "complex64", True)] for x in rffts)
    irfft = [x for x in found.values() if x[0][1] == "complex64"]
    assert irfft == [[((4, 8, 17), "complex64", False), ((4, 8, 32), "float32", True)]]
    assert not fft_gathers(g, 0)  # the matmul's operator


def test_check_of_hyena_prices_the_gathers_of_its_batch_split_transforms():
    """The corpus Hyena data parallel (every FFT operator's batch split): XLA's partitioner
    gathers each transform's operand whole, forward and backward (the canary
    `tests/test_exactness.py::test_xla_still_gathers_an_fft_split_along_its_batch`); the
    simulator priced a batch-split FFT as parallel work. Its searched plan read 0.555 of XLA's
    collective bytes; this one's gathers are all there."""
    from soapjax.strategy.space import MeshShape, data_parallel

    w = load("corpus.hyena:make")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    topo = load_topology("cpu8")
    strategy = data_parallel(g, MeshShape.of(topo))
    r = compare_on_devices(Plan.make(g, topo, strategy), w, repeats=1, costs="analytic",
                           reshard="xla")
    assert r.max_abs_diff < 1e-5
    assert r.predicted_collective_bytes == pytest.approx(r.hlo_collective_bytes, rel=0.10)
    assert_delta_equals_full(g, topo, strategy, moves=20)
