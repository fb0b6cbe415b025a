"""A model's own remat regions (`jax.checkpoint`, `nn.remat`, `nnx.remat` around scanned layers)
priced as XLA runs them: the operators inside recompute their forward in the backward, with its
statistics, partial sums and reshardings, but a parameter gathered outside the region is not
gathered again (`soapjax.graph._remat`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import assert_delta_equals_full

from soapjax.check import compare_on_devices
from soapjax.cost.flops import FlopCounter
from soapjax.cost.operators import cost_model
from soapjax.graph._remat import remat_recomputes, remat_rereads
from soapjax.graph.opgraph import trace
from soapjax.simulate.front import simulate
from soapjax.strategy import baselines, space
from soapjax.strategy.plan import Plan
from soapjax.topology.cluster import load_topology
from soapjax_zoo.user import load


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln")(x)
        return x + nn.Dense(16, name="fc2")(nn.gelu(nn.Dense(32, name="fc1")(h)))


class _Two(nn.Module):
    policy: object

    @nn.compact
    def __call__(self, x):
        block = nn.remat(_Mlp, policy=self.policy) if self.policy != "none" else _Mlp
        return _Mlp(name="b1")(block(name="b0")(x))


def _graph(policy):
    model = _Two(policy)
    x = jnp.ones((8, 16))
    params = model.init(jax.random.key(0), x)
    return trace(lambda p, x: jnp.mean(model.apply(p, x) ** 2), params, x)


@pytest.mark.parametrize("policy, recomputed", [
    (None, {"b0/ln", "b0/fc1", "b0/fc2"}),  # nn.remat's default: nothing saved
    (jax.checkpoint_policies.nothing_saveable, {"b0/ln", "b0/fc1", "b0/fc2"}),
    (jax.checkpoint_policies.dots_saveable, {"b0/ln"}),  # the matmuls' results kept
    (jax.checkpoint_policies.everything_saveable, set()),
    ("none", set()),  # no remat at all
])
def test_operators_inside_a_models_remat_region_recompute(policy, recomputed):
    g = _graph(policy)
    got = {op.name for j, op in enumerate(g.operators) if remat_recomputes(g, j)}
    assert got == recomputed, [op.name for op in g.operators]


def test_only_what_a_backward_in_the_region_reads_is_computed_again():
    """The block's last matmul feeds the next block, outside the region: XLA does not run it
    again (nor its partial sums' all-reduce); the others feed the block's own backward."""
    g = _graph(None)
    again = {op.name for j, op in enumerate(g.operators) if remat_rereads(g, j)}
    assert again == {"b0/ln", "b0/fc1"}


def test_a_models_remat_adds_its_forward_to_the_backward():
    """Priced as the plan's own full recomputation would be: the step and the FLOPs grow by
    the recomputed forward."""
    with_remat, without = _graph(None), _graph("none")
    topo = load_topology("cpu8")
    mesh = space.MeshShape.of(topo)

    def step(g):
        s = baselines.baselines(g, topo)["data-parallel"]
        sim = simulate(g, topo, s, cost_model=cost_model(g, topo, mode="analytic"))
        return sim, FlopCounter(g).step(s, mesh)

    (a, fa), (b, fb) = step(with_remat), step(without)
    assert a.compute_s > b.compute_s
    assert fa.recompute > 0 and fb.recompute == 0
    assert fa.forward == pytest.approx(fb.forward, rel=0.05)


def _check(model: str, plan: str):
    w = load(f"corpus.{model}:make")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    topo = load_topology("cpu8")
    strategy = baselines.baselines(g, topo)[plan]
    return g, topo, strategy, compare_on_devices(Plan.make(g, topo, strategy), w, repeats=1,
                                                 costs="analytic", reshard="xla")


@pytest.mark.parametrize("model, plan, rel", [("nnx_scan_transformer", "expert-rnn", 0.05),
                                              ("linen_scan_transformer", "megatron", 0.01),
                                              ("linen_scan_transformer", "fsdp", 0.01)])
def test_check_of_scanned_remat_layers_matches_xla(model, plan, rel):
    """Scanned layers under the model's own remat (`nnx.remat`, `nn.remat` in `nn.scan`):
    XLA's collective bytes (0.71 and 0.90 of them predicted before the model's remat was
    priced: the recomputed forward's all-reduces and all-gathers, inside
    ``rematted_computation``; 1.10 of them while every recomputed partial sum was counted
    again). FSDP: XLA gathers each parameter once (the gathered copy is what enters the
    region), and so does the simulator (1.42 while it gathered them again)."""
    g, topo, strategy, r = _check(model, plan)
    assert r.max_abs_diff < 1e-5
    assert r.predicted_collective_bytes == pytest.approx(r.hlo_collective_bytes, rel=rel)
    if plan != "fsdp":
        assert_delta_equals_full(g, topo, strategy, moves=20)


def test_check_of_rwkv_under_its_own_remat_matches_xla():
    """The corpus RWKV (`nn.remat(Block, policy=save_only_these_names("proj"))`, a WKV scan
    over time reading its decays ``-exp(w)``), its blocks' time mixing over the batch split on
    `data` and the rest whole, as the sweep's searched plan had it: 0.712 of XLA's bytes
    predicted before, 0.880 with the first change below, 0.992 with all three. The block's
    input entered the region whole and XLA's recomputation took it as the slice its first
    norm reads, then gathered it again for the residual add (the region's inputs are held in
    their producers' layouts inside the checkpoint now, `Program._run_checkpointed`); the
    projections' `checkpoint_name`s had joined the scan's operator, so its equations
    interleaved with the projections' and it ran equation by equation (a name stays with the
    operator that made the value now); and so the scan's decay and bonus cotangents were
    all-reduced at every step of the backward loop (it runs per group of samples now,
    `_grouped_loop`, as a loop reading no parameter of its own but a value made from them
    may too)."""
    w = load("corpus.rwkv:make")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    topo = load_topology("cpu8")
    assert g.replaceable("blocks_0") and g.replaceable("blocks_1")
    mixing = ("ln1", "receptance", "key", "value", "output")
    configs = []
    for op in g.operators:
        axes = [()] * len(op.iteration_sizes)
        block, _, part = op.name.partition("/")
        if block in ("blocks_0", "blocks_1") and (part in mixing or not part):
            axes[space.sample_dim(op)] = ("data",)
        configs.append(space.Config(tuple(axes)))
    strategy = space.Strategy(tuple(configs))
    r = compare_on_devices(Plan.make(g, topo, strategy), w, repeats=1, costs="analytic",
                           reshard="xla")
    assert r.max_abs_diff < 1e-5
    assert r.predicted_collective_bytes == pytest.approx(r.hlo_collective_bytes, rel=0.03)
