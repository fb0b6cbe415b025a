"""Parameters the optimizer freezes (`soapjax.cost.updates.frozen_leaves`,
`soapjax.graph.opgraph.OpGraph.with_frozen`): a LoRA fine-tune written as Flax's guide writes
a partly frozen model, every parameter in the tree and ``optax.set_to_zero()`` for the base
under ``optax.multi_transform``. XLA computes none of the frozen gradients (dead code in the
step); the simulator, the memory rule and the FLOP count leave them out likewise."""

from __future__ import annotations

import corpus
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_delta_equals_full
from test_updates import _runs_as_priced, _step_is_exact

from soapjax.cost.updates import freeze, frozen_leaves, update_signature
from soapjax.graph._cotangents import has_backward
from soapjax.graph.opgraph import trace
from soapjax.simulate import simulate
from soapjax.strategy import baselines
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology

RANK = 4
P = {"base": jax.ShapeDtypeStruct((8, 8), "float32"),
     "head": jax.ShapeDtypeStruct((8, 2), "float32")}
LABELS = {"base": "frozen", "head": "train"}


def _freezing(train=None):
    return optax.multi_transform({"train": train or optax.adam(1e-3),
                                  "frozen": optax.set_to_zero()}, LABELS)


@pytest.mark.parametrize(("optimizer", "frozen"), [
    (_freezing(), (True, False)),
    (_freezing(optax.contrib.muon(1e-3)), (True, False)),
    (optax.adamw(1e-3), (False, False)),
    # a global norm over every gradient reads the base's: XLA computes it
    (optax.chain(optax.clip_by_global_norm(1.0), _freezing()), (False, False)),
    # accumulated into the state, read by a later step
    (optax.MultiSteps(_freezing(), 4), (False, False)),
    # optax.masked passes a masked-out leaf's gradient through as its update
    (optax.masked(optax.adam(1e-3), {"base": False, "head": True}), (False, False)),
    # a zero learning rate still multiplies the gradient
    (optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.sgd(0.0)}, LABELS),
     (False, False)),
], ids=["set_to_zero", "muon and set_to_zero", "adamw", "clip first", "multisteps", "masked",
        "sgd at 0"])
def test_frozen_leaves_are_those_whose_gradient_nothing_reads(optimizer, frozen):
    assert frozen_leaves(optimizer, P) == frozen


def _lora(dtype=jnp.float32):
    """The corpus Llama with rank-4 adapters on every q_proj and v_proj, the base frozen:
    ``(loss_fn, params, batch, optimizer)``."""
    base_loss, base, batch = corpus.get("llama_gqa", dtype=dtype)
    keys = iter(jax.random.split(jax.random.key(7), 8))
    lora = {}
    for path, w in jax.tree_util.tree_flatten_with_path(base)[0]:
        names = [p.key for p in path]
        if names[-2] in ("q_proj", "v_proj"):
            lora["/".join(names)] = {"a": 0.01 * jax.random.normal(next(keys), (w.shape[0], RANK),
                                                                   dtype),
                                     "b": jnp.full((RANK, w.shape[1]), 0.01, dtype)}

    def merged(params):
        def one(path, w):
            ab = params["lora"].get("/".join(p.key for p in path))
            return w if ab is None else w + 2.0 * ab["a"] @ ab["b"]
        return jax.tree_util.tree_map_with_path(one, params["base"])

    def loss_fn(params, batch):
        return base_loss(merged(params), batch)

    labels = {"base": jax.tree.map(lambda _: "frozen", base),
              "lora": jax.tree.map(lambda _: "train", lora)}
    optimizer = optax.multi_transform({"train": optax.adamw(1e-3),
                                       "frozen": optax.set_to_zero()}, labels)
    return loss_fn, {"base": base, "lora": lora}, batch, optimizer


def test_a_frozen_base_has_no_backward_below_its_first_adapter():
    loss_fn, params, batch, optimizer = _lora()
    g = trace(loss_fn, params, batch, name="lora")
    frozen = freeze(g, optimizer)
    assert len(frozen.frozen) == len(jax.tree.leaves(params["base"]))
    assert frozen.fingerprint() == g.fingerprint()  # a plan fits either; a cache key differs
    assert update_signature(optimizer, params) == {"frozen": list(range(len(frozen.frozen)))}
    assert frozen.at_batch_size(4).frozen == frozen.frozen
    embed = next(j for j, op in enumerate(g.operators) if "embed_tokens" in op.name)
    assert has_backward(g, embed) and not has_backward(frozen, embed)
    assert freeze(g, optax.adamw(1e-3)) is g


def test_the_simulator_leaves_out_what_a_frozen_base_does_not_compute():
    """No gradient synchronisation, update or gradient buffer for a frozen leaf, and the
    optimizer state of the adapters alone (`opt_state_factor` per trained byte)."""
    from soapjax.cost.operators import cost_model
    from soapjax.simulate.front import opt_state_factor

    loss_fn, params, batch, optimizer = _lora()
    topo = load_topology("cpu8")
    g = freeze(trace(loss_fn, params, batch, name="lora"), optimizer)
    strategy = baselines.data_parallel(g, MeshShape.of(topo))
    factor = opt_state_factor(optimizer, params)
    sim = simulate(g, topo, strategy, cost_model=cost_model(g, topo, mode="analytic",
                                                            optimizer=optimizer),
                   opt_state_factor=factor)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params["lora"]))
    assert sim.memory.grads == nbytes
    assert sim.memory.opt_state == pytest.approx(2 * nbytes, rel=0.01)  # adamw's two moments
    touched = {t.name.split(" ", 1)[1] for t in sim.tasks if t.kind in ("grad_sync", "update")}
    assert touched and all("lora" in name for name in touched)


@pytest.mark.parametrize("planner", ["megatron", "fsdp"])
def test_a_lora_step_is_the_unsharded_step_in_float64(planner):
    """One sharded step of the frozen base and its adapters, under Megatron's tensor
    parallelism and under FSDP on ``cpu8``: parameters and optimizer state equal the
    unsharded step's, each leaf within 1e-9 of its own scale (the base unchanged)."""
    topo = load_topology("cpu8")
    with jax.enable_x64(True):
        loss_fn, params, batch, optimizer = _lora(jnp.float64)
        g = freeze(trace(loss_fn, params, batch, name="lora"), optimizer)
        make = {"megatron": lambda: baselines.megatron(g, MeshShape.of(topo), ("model",)),
                "fsdp": lambda: baselines.fsdp(g, MeshShape.of(topo))}[planner]
        _step_is_exact(g, make(), topo, loss_fn, params, batch, optimizer)


def _lora_loader():
    return _lora()


def test_check_of_a_lora_plan_counts_what_xla_computes():
    """`soapjax check` of Megatron's plan for the LoRA: the collective bytes and the FLOPs
    XLA compiles are the prediction's within 10 %, and delta simulation equals full. Before
    the base was known frozen, the prediction counted its weight gradients and their
    synchronisation: bytes 1.379 and FLOPs 1.292 of XLA's (data parallel: 7.383 and 1.364;
    docs/checks.md)."""
    _runs_as_priced("_lora_loader", load_topology("cpu8"),
                    lambda g, topo: baselines.megatron(g, MeshShape.of(topo), ("model",)),
                    module=__name__)


def _gpt_attention_frozen():
    """The zoo's tiny GPT (scanned layers) with its attention frozen, the rest trained."""
    from soapjax_zoo import registry

    w = registry.get("gpt", "tiny")
    params = w.abstract_params()
    labels = jax.tree_util.tree_map_with_path(
        lambda p, _: "frozen" if "attn" in jax.tree_util.keystr(p) else "train", params)
    return w.loss_fn, params, w.abstract_batch(), optax.multi_transform(
        {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels)


def test_a_pipelined_plan_with_frozen_layers_is_priced_as_compiled():
    """Two pipeline stages under the distributed optimizer (``cpu8-nodes``), the stacked
    attention weights frozen: the step computes the unsharded one and XLA's collective bytes
    are the prediction's within 10 % (1.068; 1.402 before: the frozen leaves' gradient
    reduce-scatters and the updated shards' gathers)."""
    from pathlib import Path

    from soapjax.check import compare_on_devices
    from soapjax.strategy.plan import Plan
    from soapjax_zoo.user import load

    topo = load_topology(str(Path(__file__).parent / "meshes" / "cpu8-nodes.toml"))
    w = load(f"{__name__}:_gpt_attention_frozen")
    g = freeze(trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name),
               w.optimizer)
    assert g.frozen and len(g.frozen) < len(g.params)
    strategy = baselines.megatron_3d(g, topo, tp=1, pp=2, distributed_optimizer=True)
    r = compare_on_devices(Plan.make(g, topo, strategy), w, repeats=1, costs="analytic",
                           reshard="xla")
    assert r.max_abs_diff < 1e-5
    assert r.predicted_collective_bytes == pytest.approx(r.hlo_collective_bytes, rel=0.10)


def _gpt_lora_merged():
    """The zoo's tiny GPT (scanned layers) with a rank-2 LoRA on ``fc1`` merged into the
    stacked kernel before the scan (``kernel + einsum("ldr,lrf->ldf", a, b)``), the base
    frozen: each layer reads its slice of a value an operator computed."""
    from soapjax_zoo import registry

    w = registry.get("gpt", "tiny")
    base = w.abstract_params()
    layers, d, f = base["params"]["layers"]["mlp"]["fc1"]["kernel"].shape
    lora = {"a": jax.ShapeDtypeStruct((layers, d, 2), jnp.float32),
            "b": jax.ShapeDtypeStruct((layers, 2, f), jnp.float32)}

    def loss_fn(params, batch):
        p = params["base"]["params"]
        fc1 = p["layers"]["mlp"]["fc1"]
        kernel = fc1["kernel"] + jnp.einsum("ldr,lrf->ldf", params["lora"]["a"],
                                            params["lora"]["b"])
        mlp = dict(p["layers"]["mlp"], fc1=dict(fc1, kernel=kernel))
        return w.loss_fn({"params": dict(p, layers=dict(p["layers"], mlp=mlp))}, batch)

    labels = {"base": jax.tree.map(lambda _: "frozen", base),
              "lora": jax.tree.map(lambda _: "train", lora)}
    return loss_fn, {"base": base, "lora": lora}, w.abstract_batch(), optax.multi_transform(
        {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels)


def test_a_layers_slice_of_a_merged_stack_reads_the_operator_that_made_it():
    """Each layer's ``fc1`` reads its slice of the merged stack as an activation of the merge
    (it was a constant: no edge, so nothing of its way back was priced: data parallel's
    collective bytes predicted 0 of XLA's, Megatron's 0.929); the float64 steps equal the
    unsharded one, and data parallel's bytes are XLA's within 10 % (Megatron's: 1.000 too,
    docs/checks.md)."""
    from soapjax.check import compare_on_devices
    from soapjax.strategy.plan import Plan
    from soapjax_zoo.user import load

    topo = load_topology("cpu8")
    w = load(f"{__name__}:_gpt_lora_merged")
    g = freeze(trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name),
               w.optimizer)
    merge = next(op.name for op in g.operators if op.name.startswith("lora"))
    reads = [x for op in g.operators if op.name.endswith("mlp/fc1") for x in op.inputs
             if x.shape == (32, 128)]
    assert [(x.kind, x.source, x.layer) for x in reads] == [
        ("activation", merge, (0,)), ("activation", merge, (1,))]
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: 0.1 * x.astype(jnp.float64) + 0.01,
                              w.init_params(jax.random.key(0)))
        batch = w.make_batch(jax.random.key(1))
        g64 = freeze(trace(w.loss_fn, params, batch, name=w.name), w.optimizer)
        for strategy in (baselines.data_parallel(g64, MeshShape.of(topo)),
                         baselines.megatron(g64, MeshShape.of(topo), ("model",))):
            _step_is_exact(g64, strategy, topo, w.loss_fn, params, batch, w.optimizer)
    strategy = baselines.data_parallel(g, MeshShape.of(topo))
    r = compare_on_devices(Plan.make(g, topo, strategy), w, repeats=1, costs="analytic",
                           reshard="xla")
    assert r.predicted_collective_bytes == pytest.approx(r.hlo_collective_bytes, rel=0.10)
    assert_delta_equals_full(g, topo, baselines.megatron(g, MeshShape.of(topo), ("model",)),
                             moves=20, optimizer=w.optimizer)


def test_the_analytic_backward_of_a_frozen_matmul_is_its_input_gradient_alone():
    """The analytic and GPU kernel models price a matmul's backward as its two transposes;
    a frozen weight's (a LoRA's ``k_proj``) is the input gradient alone, half; the adapted
    ``q_proj`` reads the merged weight, both halves (`soapjax.cost.roofline.backward_share`)."""
    from soapjax.cost.operators import cost_model
    from soapjax.cost.roofline import backward_share

    loss_fn, params, batch, optimizer = _lora()
    g = trace(loss_fn, params, batch, name="lora")
    frozen = freeze(g, optimizer)
    topo = load_topology("dgx-h100x8")
    j = {name: frozen.index(f"layers_1/self_attn/{name}") for name in ("k_proj", "q_proj")}
    assert backward_share(frozen, j["k_proj"]) == 0.5 == 1 - backward_share(g, j["k_proj"]) / 2
    assert backward_share(frozen, j["q_proj"]) == 1.0
    ones = (1,) * len(frozen.operators[j["k_proj"]].iteration_sizes)
    half = cost_model(frozen, topo, mode="analytic").shard_time(j["k_proj"], ones)
    whole = cost_model(g, topo, mode="analytic").shard_time(j["k_proj"], ones)
    assert half.forward_s == whole.forward_s
    assert half.backward_s == pytest.approx(whole.backward_s / 2)


def test_a_base_closed_over_by_the_loss_is_warned_of_and_counted_on_every_device(monkeypatch):
    """LoRA written with the base captured by the loss's closure: the step embeds the base
    as constants, whole on every device. The trace says so, with what to do (pass it as
    frozen parameters), and the plan's memory counts it (it was left out: 3.6 kB of
    parameters for a 91 kB model). (The warning's floor, 1 MiB, lowered for a tiny model.)"""
    from soapjax.cost.operators import cost_model
    from soapjax.graph import _constants

    monkeypatch.setattr(_constants, "_CONSTANT_WARNING_BYTES", 0)

    loss_fn, params, batch, _ = _lora()
    base, lora = params["base"], params["lora"]
    with pytest.warns(UserWarning, match=r"closes over .* no plan can split them.*"
                                         r"optax.set_to_zero"):
        g = trace(lambda lora, batch: loss_fn({"base": base, "lora": lora}, batch), lora,
                  batch, name="lora_closure")
    nbytes = sum(x.nbytes for x in jax.tree.leaves(base))
    assert g.constant_bytes >= nbytes
    topo = load_topology("cpu8")
    sim = simulate(g, topo, baselines.data_parallel(g, MeshShape.of(topo)),
                   cost_model=cost_model(g, topo, mode="analytic"))
    assert sim.memory.constants == g.constant_bytes
    assert sim.memory.total >= nbytes + sum(x.nbytes for x in jax.tree.leaves(lora))
