"""soapjax.cost.updates: what an optimizer's update reads, writes and reduces, from its jaxpr."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_delta_equals_full
from jax.sharding import PartitionSpec

from soapjax.cost.updates import (
    DEFAULT_UPDATE_PASSES,
    freeze,
    optimizer_problem,
    update_passes,
    update_reductions,
    update_whole_dims,
    whole_along,
)
from soapjax.graph.opgraph import trace
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology

OPTIMIZERS = {
    # (passes over the parameter bytes, scalars reduced per parameter)
    "none": (None, DEFAULT_UPDATE_PASSES, 0),
    "sgd": (optax.sgd(0.1), 3.0, 0),  # read p, g; write p
    "momentum": (optax.sgd(0.1, momentum=0.9), 5.0, 0),  # and read and write the trace
    # two moments, and the step count's 4 bytes over a 4 KB vector
    "adam": (optax.adam(1e-3), 7.0 + 2 * 4 / 4096, 0),
    "clipped adam": (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
                     7.0 + 2 * 4 / 4096, 1),
    # the trust ratio's two norms: four reductions to a scalar in optax 0.2's jaxpr
    "lamb": (optax.lamb(1e-3), None, 4),
}


@pytest.mark.parametrize("name", OPTIMIZERS, ids=list(OPTIMIZERS))
def test_passes_and_reductions(name):
    optimizer, passes, reductions = OPTIMIZERS[name]
    if passes is not None:
        assert update_passes(optimizer) == passes
    assert update_reductions(optimizer) == reductions


# --- updates that contract a parameter's dims (Muon) -------------------------------------------

P = {"b": jax.ShapeDtypeStruct((8,), "float32"), "w": jax.ShapeDtypeStruct((8, 16), "float32"),
     "tall": jax.ShapeDtypeStruct((32, 8), "float32"),
     "stack": jax.ShapeDtypeStruct((2, 8, 8), "float32")}


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "clipped adam", "lamb", "adafactor",
                                  "lion", "prodigy"])
def test_elementwise_updates_contract_no_dims(name):
    """Adam, SGD, LAMB's norms, Adafactor's factored row and column means, a global-norm clip,
    Prodigy's ``vdot`` of the gradient and the distance travelled: partial sums (an
    all-reduce of a scalar or a vector), never a contraction into a matrix."""
    optimizer = {"adafactor": optax.adafactor(1e-3, min_dim_size_to_factor=4),
                 "lion": optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3)),
                 "prodigy": optax.contrib.prodigy(1.0),
                 }.get(name) or OPTIMIZERS[name][0]
    dims = update_whole_dims(optimizer, P)
    assert dims.whole == ((),) * 4


def test_muon_contracts_both_dims_of_its_matrices():
    """`optax.contrib.muon`: each matrix's momentum orthogonalised by five Newton-Schulz steps
    (``X X^T``, ``A A``, ``B X`` on the wide orientation), so both dims whole; vectors and the
    3-D leaf (no dimension numbers given) go to its Adam."""
    dims = update_whole_dims(optax.contrib.muon(1e-3), P)
    assert dims.whole == ((), (), (0, 1), (0, 1))  # leaves in key order: b, stack, tall, w

    def ns(m, n):  # the five steps on an m x n matrix, m <= n
        return 5 * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)
    assert dims.flops == (0.0, 0.0, ns(8, 32), ns(8, 16))


def test_an_untraceable_update_reads_as_elementwise():
    def init(params):
        raise ValueError("needs the real arrays")
    weird = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
    assert update_whole_dims(weird, P).whole == ((),) * 4
    assert whole_along((("data",), ("model",)), (0, 1)) == ((), ())


def _muon_llama(dtype=jnp.float32, weight_decay=0.0):
    import corpus

    loss_fn, params, batch = corpus.get("llama_gqa", dtype=dtype)
    return loss_fn, params, batch, optax.contrib.muon(1e-2, weight_decay=weight_decay)


def _muon_llama_decayed():
    return _muon_llama(weight_decay=0.1)


def _galore_llama():
    import corpus

    loss_fn, params, batch = corpus.get("llama_gqa")
    return loss_fn, params, batch, optax.contrib.galore(1e-3, rank=4)


def _lbfgs_llama():
    import corpus

    return (*corpus.get("llama_gqa"), optax.lbfgs())


def test_galore_factors_its_matrices_whole():
    """GaLore's projector is the SVD of each matrix's gradient: both dims whole (a
    factorisation reads the whole matrix), where its products alone contract one."""
    dims = update_whole_dims(optax.contrib.galore(1e-3, rank=2), P)
    assert dims.whole == ((), (), (0, 1), (0, 1))


def test_an_optimizer_the_step_cannot_run_is_refused_plainly():
    """L-BFGS's line search needs the loss itself; Lookahead updates `LookaheadParams`: the
    command line and apply say so before anything is searched or compiled (the search
    crashed in the measured update's timing with optax's traceback)."""
    from soapjax import apply
    from soapjax.base.errors import ArgumentError, WorkloadError
    from soapjax.strategy.space import data_parallel
    from soapjax.topology.cluster import make_mesh
    from soapjax_zoo.user import load

    assert optimizer_problem(optax.adam(1e-3), P) is None
    assert "needs the loss itself" in optimizer_problem(optax.lbfgs(), P)
    assert "LookaheadParams" in optimizer_problem(
        optax.lookahead(optax.adam(1e-3), sync_period=2, slow_step_size=0.5), P)
    with pytest.raises(WorkloadError, match="cannot update its parameters.*line search"):
        load(f"{__name__}:_lbfgs_llama")
    loss_fn, params, batch, lbfgs = _lbfgs_llama()
    g = trace(loss_fn, params, batch)
    topo = load_topology("cpu8")
    with pytest.raises(ArgumentError, match="optimizer: .*needs the loss itself"):
        apply.sharded_train_step(g, data_parallel(g, MeshShape.of(topo)), make_mesh(topo),
                                 lbfgs, params=params, batch=batch)


def test_an_update_that_reads_the_parameter_says_so():
    """AdamW's and Muon's weight decay read the parameter; Adam and Muon without decay read
    only the gradient and the state."""
    reads = {name: update_whole_dims(opt, P).reads_params for name, opt in {
        "adam": optax.adam(1e-3), "adamw": optax.adamw(1e-3),
        "muon": optax.contrib.muon(1e-3), "muon wd": optax.contrib.muon(1e-3, weight_decay=0.1),
    }.items()}
    assert reads["adam"] == reads["muon"] == (False,) * 4
    assert reads["adamw"] == (True,) * 4
    assert reads["muon wd"][2:] == (True, True)  # its matrices (its Adam's decay is masked)


def test_a_muon_step_under_megatron_is_the_unsharded_step_in_float64():
    """Muon under Megatron's tensor parallelism on ``cpu8``: apply gathers each matrix's
    gradient whole (its state kept so, its update constrained there), as distributed Muon
    does; one step's parameters and optimizer state match the unsharded step's, each leaf
    within 1e-9 of its own scale (with weight decay: the parameter read gathered too).
    Before, XLA's partitioner split the Newton-Schulz products
    after the parameters' sharding (75 collective-permutes, 58 all-reduces): the same numbers,
    three times the step time, and none of it priced."""
    from soapjax.strategy import baselines

    topo = load_topology("cpu8")
    with jax.enable_x64(True):
        loss_fn, params, batch, muon = _muon_llama(jnp.float64, weight_decay=0.1)
        g = trace(loss_fn, params, batch, name="llama_gqa")
        sh = _step_is_exact(g, baselines.megatron(g, MeshShape.of(topo), ("model",)), topo,
                            loss_fn, params, batch, muon)
    kernel = sh.grads["layers_0"]["mlp"]["gate_proj"]["kernel"]
    assert kernel.spec == PartitionSpec(None, None)  # the gradient Muon reads: whole


def test_a_distributed_muon_step_is_the_unsharded_step_in_float64():
    """The tiny GPT's stacked matrices under the distributed optimizer (below): each device
    orthogonalising its share of the layers computes the unsharded step in float64."""
    from soapjax.strategy import baselines
    from soapjax_zoo.user import load

    topo = load_topology(str(Path(__file__).parent / "meshes" / "cpu8-nodes.toml"))
    w = load(f"{__name__}:_muon_gpt")
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(jnp.float64),
                              w.init_params(jax.random.key(0)))
        batch = w.make_batch(jax.random.key(1))
        g = trace(w.loss_fn, params, batch, name=w.name)
        sh = _step_is_exact(g, baselines.megatron_3d(g, topo, tp=2, distributed_optimizer=True),
                            topo, w.loss_fn, params, batch, w.optimizer)
    assert sh.grads["params"]["layers"]["mlp"]["fc1"]["kernel"].spec == PartitionSpec(
        "node", None, None)


def _step_is_exact(g, strategy, topo, loss_fn, params, batch, optimizer):
    """One sharded step's parameters and optimizer state against the unsharded step's, each
    leaf within 1e-9 of its own scale (and 1e-12 absolute: the GPT's attention key bias has a
    zero gradient, its Muon state rounding noise of 1e-25); the step's shardings."""
    from soapjax import apply
    from soapjax.topology.cluster import make_mesh

    step, sh = apply.sharded_train_step(g, strategy, make_mesh(topo), optimizer,
                                        params=params, batch=batch, donate=False)
    state = optimizer.init(params)
    ref = jax.jit(lambda p, s, b: _update(optimizer, loss_fn, p, s, b))(params, state, batch)
    got = step(apply.device_put_global(params, sh.params),
               apply.device_put_global(state, sh.opt_state),
               apply.device_put_global(batch, sh.batch), 0)
    for want, have in zip(jax.tree.leaves(ref[:2]), jax.tree.leaves(got[:2])):
        want, have = np.asarray(want), np.asarray(have)
        assert np.max(np.abs(have - want)) <= max(1e-9 * np.max(np.abs(want)), 1e-12)
    return sh


def _update(optimizer, loss_fn, params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


@pytest.mark.parametrize("loader", ["_muon_llama", "_muon_llama_decayed", "_galore_llama"])
def test_the_simulator_prices_muons_gathers_as_xla_compiles_them(loader):
    """The same plan checked: XLA's collectives are the prediction's (the gradient gathers
    included; with weight decay the parameters' too, which the update reads: without them
    XLA split the products after the parameters, 0.574 of its bytes predicted), the update's
    matrix products are in the predicted FLOPs, and delta simulation equals full. GaLore
    likewise (0.752 before its SVD made both dims whole)."""
    from soapjax.strategy import baselines

    _runs_as_priced(loader, load_topology("cpu8"),
                    lambda g, topo: baselines.megatron(g, MeshShape.of(topo), ("model",)))


def _runs_as_priced(loader, topo, make_strategy, module=__name__):
    """`check` of the strategy on the model `loader` (a function of `module`) returns: the
    step XLA compiles computes the unsharded one, its collective bytes and FLOPs are the
    prediction's within 10 %, and delta simulation equals full (the graph as `check` plans
    it: the parameters its optimizer freezes marked)."""
    from soapjax.check import compare_on_devices
    from soapjax.strategy.plan import Plan
    from soapjax_zoo.user import load

    w = load(f"{module}:{loader}")
    g = freeze(trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name),
               w.optimizer)
    strategy = make_strategy(g, topo)
    r = compare_on_devices(Plan.make(g, topo, strategy), w, repeats=1, costs="analytic",
                           reshard="xla")
    assert r.max_abs_diff < 1e-5
    assert r.predicted_collective_bytes == pytest.approx(r.hlo_collective_bytes, rel=0.10)
    assert r.predicted_flops == pytest.approx(r.hlo_flops, rel=0.10)
    assert_delta_equals_full(g, topo, strategy, moves=20, optimizer=w.optimizer)


def _muon_gpt():
    """The zoo's tiny GPT (scanned layers: matrices stacked ``[L, d, f]``) with Muon
    orthogonalising each layer's matrix (its layer dim a batch dim: `MuonDimensionNumbers`)
    and the embeddings."""
    from optax.contrib import MuonDimensionNumbers

    from soapjax_zoo import registry

    def dims(params):
        def one(path, x):
            if "layers" not in jax.tree_util.keystr(path) and x.ndim == 2:
                return MuonDimensionNumbers(reduction_axis=0, output_axis=1)
            if x.ndim == 3 and min(x.shape[1:]) > 1:
                return MuonDimensionNumbers(reduction_axis=1, output_axis=2)
            return None
        return jax.tree_util.tree_map_with_path(one, params)

    w = registry.get("gpt", "tiny")
    return (w.loss_fn, w.abstract_params(), w.abstract_batch(),
            optax.contrib.muon(1e-3, muon_weight_dimension_numbers=dims))


def test_a_distributed_optimizer_splits_muons_stacked_layers():
    """Under Megatron's distributed optimizer (``cpu8-nodes``: node=2 x data=2 x model=2, TP
    over ``model``), a stacked matrix's gradient and Muon state are whole along the matrix
    dims and split over ``node`` along the layer dim: each device orthogonalises its share of
    the layers (a ZeRO-1 distributed Muon; the layout: the float64 test above), then the
    updated layers are gathered; it runs as priced (`_runs_as_priced`)."""
    from soapjax.strategy import baselines

    _runs_as_priced("_muon_gpt", load_topology(str(Path(__file__).parent / "meshes"
                                                   / "cpu8-nodes.toml")),
                    lambda g, topo: baselines.megatron_3d(g, topo, tp=2,
                                                          distributed_optimizer=True))


def test_an_update_that_needs_the_parameters_tree_is_priced_not_timed():
    """`optax.multi_transform` with a label tree (Muon for the hidden matrices, AdamW for the
    rest, as Muon's users write it) cannot update the lone vector the measured cost model
    times an update on: its update time is the analytic one (the search crashed there with
    optax's pytree error), and its Muon matrices are still read as contracted."""
    import corpus

    from soapjax.cost.operators import cost_model

    loss_fn, params, batch = corpus.get("llama_gqa")
    labels = jax.tree_util.tree_map_with_path(
        lambda p, x: "muon" if x.ndim == 2 and "embed" not in jax.tree_util.keystr(p)
        else "adam", params)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
        {"muon": optax.contrib.muon(1e-3), "adam": optax.adamw(1e-3)}, labels))
    g = trace(loss_fn, params, batch)
    cm = cost_model(g, load_topology("cpu8"), mode="measured", optimizer=optimizer)
    assert cm.update_time(4096.0) == cm._analytic_update(4096.0) > 0
    whole = update_whole_dims(optimizer, params).whole
    assert sum(map(bool, whole)) == 15  # 2 layers x 7 matrices, and the head
