"""The hand-made strategies every plan is compared with, pinned on a DGX (data=2, model=4)."""

import dataclasses
import functools
import re

import pytest
from test_corpus import (
    X64_TOL,
    float64_workload,
    relative_error,
    sharded_grads,
    worst_leaf,
)

import soapjax_zoo
from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import trace
from soapjax.strategy.baselines import (
    BASELINES,
    NAMES,
    baselines,
    expert_dim,
    expert_parallel_axes,
    intra_node_axes,
    maxtext_moe,
    megatron_3d,
    megatron_grid,
    sequence_dims,
)
from soapjax.strategy.space import MeshShape, data_parallel
from soapjax.topology.cluster import load_topology, make_mesh
from soapjax_zoo import llama, moe

DGX = load_topology("dgx-h100x8")  # one node: both axes are in-node
D, M, DM = ("data",), ("model",), ("data", "model")


@functools.cache
def graph(name):
    w = soapjax_zoo.get(name, "tiny")
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name), w.family


def configs(name):
    g, family = graph(name)
    return {k: [c.axes for c in s.configs] for k, s in baselines(g, DGX, family).items()}


def test_intra_node_axes():
    assert intra_node_axes(DGX) == ("data", "model")
    assert intra_node_axes(load_topology("p100x16")) == ("gpu",)  # node=4, gpu=4


def test_every_baseline_by_name():
    g, _ = graph("mlp")
    assert tuple(baselines(g, DGX)) == NAMES  # no family: both paper experts
    assert list(baselines(g, DGX, family="cnn")) == ["data-parallel", "megatron", "fsdp",
                                                       "expert-cnn"]
    assert tuple(baselines(g, DGX, family="transformer")) == NAMES  # the experts: no family's


def test_the_table_is_the_one_list_of_baselines():
    """`BASELINES` is the one list: `NAMES` (the command line's --strategy and
    `parse_strategy` read it) is its keys, and `baselines` returns its rows for the family."""
    assert NAMES == tuple(BASELINES)
    g, _ = graph("mlp")
    for family in (None, "cnn", "rnn", "transformer", "mlp"):
        want = [n for n, b in BASELINES.items() if family is None or b.for_family(family)]
        assert list(baselines(g, DGX, family)) == want


def test_megatron_alternates_column_and_row_parallel_matmuls():
    # mlp: fc1, fc2, head ([batch, out | in]) then the loss; tensor parallel on the innermost
    # in-node axis (model), data parallel on the other
    assert configs("mlp")["megatron"] == [
        (D, M, ()),  # column parallel: output features over model
        (D, (), M),  # row parallel: its input arrives split, so the contraction is split
        (D, (), ()),  # the input arrives whole again: the head's 10 classes do not divide
        ((), D),
    ]


def test_fsdp_is_data_parallel_compute_with_sharded_state():
    g, family = graph("mlp")
    out = baselines(g, DGX, family)
    assert out["fsdp"].configs == out["data-parallel"].configs
    assert out["fsdp"].zero_axes == DM and out["data-parallel"].zero_axes == ()
    assert configs("mlp")["data-parallel"] == [(DM, (), ())] * 3 + [((), DM)]


def test_the_cnn_expert_splits_convolutions_by_batch_and_dense_layers_by_features():
    got = configs("lenet")["expert-cnn"]
    g, _ = graph("lenet")
    by_name = dict(zip([op.name for op in g.operators], got))
    assert by_name["conv1"] == (DM, (), (), ()) and by_name["conv2"] == (DM, (), (), (), ())
    assert by_name["fc1"] == ((), DM, ())  # 32 output features over all 8 devices
    assert by_name["fc2"] == ((), D, ())  # 10 classes: only the 2-way axis divides


@pytest.mark.parametrize("name", ["mlp", "lenet", "rnnlm"])
def test_every_baseline_has_a_config_per_operator(name):
    g, family = graph(name)
    for strategy in baselines(g, DGX, family).values():
        assert len(strategy.configs) == len(g.operators)


@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
def test_every_layer_of_a_scan_runs_one_config_in_every_baseline(name):
    # The layers' parameters are stacked, one layout for all: a layer at another config made
    # XLA move its slice of the stack every step by all-to-alls no price held (the tiny MoE
    # under Megatron TP4: its shared expert's residual add led the walk to column-parallel
    # down projections, and the second layer went row parallel throughout)
    g, family = graph(name)
    built = dict(baselines(g, CPU8, family))
    built["megatron-3d-tp4"] = megatron_3d(g, CPU8, tp=4, recompute="none")
    built["megatron-3d-tp4-sp"] = megatron_3d(g, CPU8, tp=4, recompute="none",
                                              sequence_parallel=True)
    assert g.repeated_blocks()
    for label, strategy in built.items():
        for group in g.repeated_blocks():
            names = (label, g.operators[group[0]].name)
            assert len({strategy.configs[i] for i in group}) == 1, names


def test_megatron_follows_the_matmuls_input_not_a_value_added_to_its_result():
    # the tiny MoE's shared expert's down projection adds the routed experts' output (no dim
    # split over model) to its own: its contracted input arrives split over its ffn dim, so it
    # is row parallel, and the next layer starts as the first did
    g, _ = graph("moe")
    got = by_name(g, megatron_3d(g, CPU8, tp=4, recompute="none"))
    assert got["layers_0/moe/shared/down"] == (D, (), (), M)  # [B, T, d | ffn]
    assert got["layers_1/attn/q"] == got["layers_0/attn/q"] == (D, (), M, (), ())


# --- Megatron's configuration space ---------------------------------------------------------------

A100 = load_topology("dgx-a100x3072-16")  # two DGX A100s: node=2 (InfiniBand), data=2, model=4
N = ("node",)


@functools.cache
def gpt(batch_size=16):
    w = soapjax_zoo.get("gpt", "tiny", batch_size=batch_size)
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")


def test_megatron_3d_alternates_column_and_row_inside_a_node_and_data_parallel_across():
    g, _ = graph("mlp")
    s = megatron_3d(g, A100, tp=4, recompute="none")  # batch 8: 4 replicas of 2
    assert [c.axes for c in s.configs] == [
        (N + D, M, ()),  # column parallel over the node's model axis
        (N + D, (), M),  # row parallel
        (N + D, (), ()),
        ((), N + D),
    ]
    assert (s.microbatches, s.recompute, s.zero_axes) == (1, (), ())
    wide = megatron_3d(g, A100, tp=8, recompute="none")  # the whole node: data and model
    assert [c.axes for c in wide.configs][:2] == [(N, DM, ()), (N, (), DM)]


def test_megatron_3d_sequence_parallel_splits_norms_along_the_sequence():
    g = gpt()
    s = megatron_3d(g, A100, tp=8, microbatch_size=2, recompute="selective",
                    sequence_parallel=True)
    by_name = {op.name: c.axes for op, c in zip(g.operators, s.configs)}
    for name in ("wte", "layers_0/ln_1", "layers_0/ln_2", "layers_1/ln_2", "ln_f"):
        assert by_name[name] == (N, DM, ())  # [batch over node, sequence over the node's 8]
    assert by_name["layers_0/mlp/fc1"] == (N, (), DM, ())  # column: the sequence gathered
    assert by_name["layers_0/mlp/fc2"] == (N, (), (), DM)  # row: reduce-scattered after
    plain = megatron_3d(g, A100, tp=8, recompute="selective")
    assert dict(zip(by_name, [c.axes for c in plain.configs]))["layers_0/ln_1"] == (N, (), ())
    # 16 sequences over dp=2: 8 per replica, microbatches of 2
    assert s.microbatches == 4
    policies = dict(zip(by_name, s.recompute))
    assert policies["layers_0/ln_1"] == policies["layers_1/mlp/fc2"] == "selective"
    assert policies["wte"] == policies["ln_f"] == policies["wte.attend"] == "none"
    assert set(megatron_3d(g, A100, tp=1).recompute) == {"none", "full"}
    assert megatron_3d(g, A100, tp=1).configs == data_parallel(g, MeshShape.of(A100)).configs


def test_megatron_3d_with_pipeline_stages_plans_one_stage_of_nodes():
    """pp=2 on two DGX nodes: each stage is one node (mesh data=2 x model=4), TP8 inside it,
    dp = 16 / (8 x 2) = 1, the 16 sequences as microbatches of 4 (M = 4), 1F1B; with
    interleave=2 the interleaved schedule."""
    g = gpt()
    s = megatron_3d(g, A100, tp=8, pp=2, microbatch_size=4)
    assert (s.stages, s.virtual_stages, s.schedule, s.microbatches) == (2, 1, "1f1b", 4)
    assert s.configs == megatron_3d(g, load_topology("dgx-a100x3072-8"), tp=8,
                                    microbatch_size=4).configs
    v = megatron_3d(g, A100, tp=8, pp=2, interleave=2, microbatch_size=4, sequence_parallel=True)
    assert (v.stages, v.virtual_stages, v.schedule) == (2, 2, "interleaved")
    grid = megatron_grid(g, A100, pp=(1, 2), interleave=(1, 2))
    assert grid["megatron-tp8-pp2-v2-mb4-full"] == v
    assert "megatron-tp8-mb2-full" in grid and "megatron-tp8-pp2-mb1-none" in grid


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=4, pp=3), "pp=3: 3 pipeline stages split the outermost mesh axis 'node' (size 2) "
                       "of 'dgx-a100x3072-16'; choose a divisor of 2"),
    (dict(tp=4, interleave=2), "interleave=2: expected 1, or 2 or more virtual stages per "
                               "device with pp >= 2 (got pp=1)"),
    (dict(tp=3), "tp=3 on topology 'dgx-a100x3072-16': tensor parallelism stays inside a "
                 "node, over its in-node axes ('data', 'model'); expected one of [1, 2, 4, 8]"),
    (dict(tp=16), "expected one of [1, 2, 4, 8]"),
    (dict(tp=4, dp=2), "dp=2 x tp=4 x pp=1 = 8 devices; topology 'dgx-a100x3072-16' has 16: "
                       "expected dp=4"),
    (dict(tp=2, microbatch_size=3), "microbatch_size=3: expected a divisor of the per-replica "
                                    "batch 2 (batch 16 / dp=8)"),
    (dict(tp=4, recompute="some"), "recompute='some': expected one of"),
])
def test_megatron_3d_refuses_what_it_cannot_build(kwargs, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        megatron_3d(gpt(), A100, **kwargs)


def test_the_large_model_baselines_recompute():
    out = baselines(gpt(), A100, "transformer")
    assert out["fsdp-recompute"].configs == out["fsdp"].configs
    assert set(out["fsdp-recompute"].recompute) == {"none", "full"}
    assert set(out["megatron-sp"].recompute) == {"none", "selective"}


# --- mixtures of experts and long sequences: expert and context parallelism ---------------------
#
# The tiny MoE (soapjax_zoo.moe: 4 experts, 16 tokens, capacity dispatch; "tiny-dropless": the
# same model with sorted tokens and grouped matmuls) and the tiny llama (8 tokens) on cpu8
# (data=2 x model=4, one node): the baselines' strategies, and their float64 gradients against
# the unsharded step's (tests/test_moe.py's measure, 1e-12 relative).

CPU8 = load_topology("cpu8")
CPU8_MESH = MeshShape.of(CPU8)


@functools.cache
def float64_case(name: str, config: str = "tiny"):
    """`name`'s `config` in float64: graph, params (init + N(0, 0.05)), batch, and the
    unsharded ``jax.grad`` of the loss."""
    if name == "moe":
        cfg = dataclasses.replace(moe.MOE_CONFIGS[config], param_dtype="float64")
        w = moe.build_moe("moe", f"{config}-x64", cfg, "linen")
    else:
        cfg = dataclasses.replace(llama.LLAMA_CONFIGS[config], param_dtype="float64")
        w = llama.build_llama("llama", f"{config}-x64", cfg, "linen")
    return float64_workload(w, name)


def gradient_error(strategy, name: str, config: str = "tiny") -> float:
    """The relative error of `strategy`'s float64 gradients on cpu8, against the unsharded."""
    graph, params, batch, want = float64_case(name, config)
    mesh = make_mesh(CPU8)
    got = sharded_grads(graph, strategy, mesh, params, batch)
    err = relative_error(got, want)
    assert err <= X64_TOL, f"{name} {config}: {err:.3g}; worst leaf {worst_leaf(got, want)}"
    return err


def by_name(graph, strategy) -> dict[str, tuple[tuple[str, ...], ...]]:
    return {op.name: c.axes for op, c in zip(graph.operators, strategy.configs)}


def test_the_expert_dim_is_the_stacked_expert_weights_batch_dim():
    # [E, B, C, F | D]: the kernel [E, d, ffn] and the buffers [E, B, C, d] share E with the
    # output; no other matmul (attention, router, shared expert, head) has one, nor do the
    # dropless form's grouped matmuls (their expert dim is no iteration dim)
    g = float64_case("moe")[0]
    got = {op.name: expert_dim(op) for op in g.operators if expert_dim(op) is not None}
    assert got == {f"layers_{i}/moe/experts/{w}": 0 for i in (0, 1)
                   for w in ("gate", "up", "down")}
    dropless = float64_case("moe", "tiny-dropless")[0]
    assert not any(expert_dim(op) is not None for op in dropless.operators)
    assert expert_parallel_axes(g, CPU8_MESH, DM) == M  # 4 experts: model's 4, not data's 2
    assert expert_parallel_axes(dropless, CPU8_MESH, DM) == ()


def test_the_sequence_follows_the_tokens_and_attention_keeps_its_queries():
    g = float64_case("llama")[0]
    seq = dict(zip([op.name for op in g.operators], sequence_dims(g)))
    assert seq["embed"] == seq["layers_0/attn/q"] == seq["layers_1/mlp/down"] == 1  # [B, T, ...]
    assert seq["layers_0/attn/dot_general"] == 2  # the scores [B, H, Tq, Tk | hd]: the queries
    assert seq["layers_0/attn/dot_general_1"] == 1  # [B, Tq, H, hd | Tk]
    moe_graph = float64_case("moe")[0]
    moe_seq = dict(zip([op.name for op in moe_graph.operators], sequence_dims(moe_graph)))
    assert moe_seq["layers_0/moe/experts/gate"] is None  # the buffers [E, B, C, d]: no tokens
    assert moe_seq["layers_0/moe/dot_general_3"] == 4  # dispatch [E, B, C, d | T]


def test_megatron_3d_splits_experts_over_data_parallel_axes():
    # tp=4: model; ep=2 carved out of the data-parallel axis (data): the experts' expert dim
    # over data and their ffn tensor parallel over model (gate and up column, down row);
    # the attention data parallel over data, tensor parallel over model
    g = float64_case("moe")[0]
    s = megatron_3d(g, CPU8, tp=4, ep=2, recompute="none")
    got = by_name(g, s)
    assert got["layers_0/moe/experts/gate"] == (D, (), (), M, ())  # [E, B, C, F | D]
    assert got["layers_0/moe/experts/down"] == (D, (), (), (), M)  # [E, B, C, D | F]
    assert got["layers_0/attn/q"] == (D, (), M, (), ())  # [B, T, H, hd | d]
    assert got["layers_0/moe/dot_general_3"][1] == D  # dispatch: data parallel over data
    assert gradient_error(s, "moe") <= X64_TOL


def test_megatron_3d_orders_its_axes_tp_cp_ep_dp():
    # two DGX A100s (node=2 x data=2 x model=4), tp=4, cp=2, ep=2: TP over model, CP over the
    # innermost axis left (data), EP over the data-parallel axis left (node), dp=2 over node
    g = float64_case("moe")[0]
    got = by_name(g, megatron_3d(g, A100, tp=4, cp=2, ep=2, recompute="none"))
    assert got["layers_0/attn/q"] == (N, D, M, (), ())  # [B, T, H, hd | d]
    assert got["layers_0/moe/experts/gate"] == (N, (), (), M, ())  # [E, B, C, F | D]
    assert got["layers_0/moe/router"] == (N, D, M, ())  # [B, T, E | d]: column parallel


def test_maxtext_moe_is_fsdp_with_the_experts_over_an_fsdp_axis():
    g = float64_case("moe")[0]
    s = baselines(g, CPU8, "transformer")["maxtext-moe"]
    assert s == maxtext_moe(g, CPU8_MESH, M) and s.zero_axes == DM
    got = by_name(g, s)
    assert got["layers_1/moe/experts/up"] == (M, D, (), (), ())  # experts over model, batch data
    fsdp = baselines(g, CPU8, "transformer")["fsdp"]
    for op, c, f in zip(g.operators, s.configs, fsdp.configs):
        assert c == f or expert_dim(op) is not None, op.name
    assert gradient_error(s, "moe") <= X64_TOL
    dense, _ = graph("mlp")  # without experts it is FSDP
    assert maxtext_moe(dense, MeshShape.of(DGX)) == baselines(dense, DGX)["fsdp"]
    dropless = float64_case("moe", "tiny-dropless")[0]
    assert maxtext_moe(dropless, CPU8_MESH) == baselines(dropless, CPU8)["fsdp"]


@pytest.mark.parametrize("name, config, kwargs", [
    # context parallel over data, expert parallel over model
    ("moe", "tiny", dict(tp=1, cp=2, ep=4)),
    # the grouped matmuls tensor parallel (ragged_dot_general is dense), context parallel
    ("moe", "tiny-dropless", dict(tp=4, cp=2)),
    # tensor and sequence parallel over data, context parallel over model
    ("llama", "tiny", dict(tp=2, cp=4, sequence_parallel=True)),
], ids=["moe-cp2-ep4", "dropless-tp4-cp2", "llama-tp2-cp4-sp"])
def test_megatron_3d_context_parallel_is_exact(name, config, kwargs):
    g = float64_case(name, config)[0]
    s = megatron_3d(g, CPU8, recompute="none", **kwargs)
    seq = sequence_dims(g)
    cp_axes = {2: D, 4: M}[kwargs["cp"]]
    split = [op.name for op, d, c in zip(g.operators, seq, s.configs)
             if d is not None and c.axes[d][:len(cp_axes)] == cp_axes]
    assert len(split) == sum(d is not None for d in seq)  # every sequence dim over cp's axes
    assert gradient_error(s, name, config) <= X64_TOL


@pytest.mark.parametrize("name, config, kwargs, message", [
    ("moe", "tiny", dict(tp=1, ep=8), "ep=8: 8 expert shards of the 4 experts of "
     "'layers_0/moe/experts/gate'; expected a divisor of 4"),
    ("moe", "tiny", dict(tp=1, ep=3), "ep=3: expert parallelism is carved out of the "
     "data-parallel axes, here data=2, model=4; expected one of [1, 2, 4, 8]"),
    ("moe", "tiny", dict(tp=4, ep=4), "ep=4: expert parallelism is carved out of the "
     "data-parallel axes, here data=2; expected one of [1, 2]"),
    ("moe", "tiny-dropless", dict(tp=1, ep=2), "ep=2: graph 'moe' has no expert dim to split "
     "(a matmul over stacked expert weights [experts, in, out]): its grouped matmuls "
     "(jax.lax.ragged_dot) never split their experts; expected ep=1"),
    ("llama", "tiny", dict(tp=1, ep=2), "ep=2: graph 'llama' has no expert dim to split (a "
     "matmul over stacked expert weights [experts, in, out]); expected ep=1"),
    ("llama", "tiny", dict(tp=1, cp=3), "cp=3: context parallelism takes the mesh axes tensor "
     "parallelism leaves, here data=2, model=4; expected one of [1, 2, 4, 8]"),
    ("llama", "tiny", dict(tp=1, cp=8, dp=2), "dp=2 x tp=1 x pp=1 x cp=8 = 16 devices; "
     "topology 'cpu8' has 8: expected dp=1"),
], ids=["ep-experts", "ep-axes", "ep-after-tp", "ep-dropless", "ep-dense", "cp-axes", "cp-dp"])
def test_megatron_3d_refuses_experts_and_contexts_it_cannot_split(name, config, kwargs,
                                                                  message):
    g = float64_case(name, config)[0]
    with pytest.raises(PlanError, match=re.escape(message)):
        megatron_3d(g, CPU8, **kwargs)


def test_megatron_3d_refuses_a_context_the_sequence_does_not_divide():
    cfg = dataclasses.replace(llama.LLAMA_CONFIGS["tiny"], seq_len=12)
    w = llama.build_llama("llama", "tiny-12", cfg, "linen")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="llama")
    with pytest.raises(PlanError, match=re.escape(
            "cp=8: 8 context shards of a sequence of 12 tokens; expected a divisor of 12")):
        megatron_3d(g, CPU8, tp=1, cp=8)
    mlp, _ = graph("mlp")
    with pytest.raises(PlanError, match=re.escape(
            "cp=2: graph 'mlp' has no token sequence (an integer [batch, sequence] batch leaf) "
            "to split; expected cp=1")):
        megatron_3d(mlp, CPU8, tp=1, cp=2)


def test_megatron_grid_names_its_expert_and_context_points():
    g = float64_case("moe")[0]
    grid = megatron_grid(g, CPU8, tp=(1, 4), ep=(1, 2, 4), cp=(1, 2))
    assert grid["megatron-tp4-ep2-mb4-none"] == megatron_3d(g, CPU8, tp=4, ep=2,
                                                            recompute="none",
                                                            sequence_parallel=True)
    assert "megatron-tp1-cp2-ep4-mb2-full" in grid and "megatron-tp4-cp2-mb8-full" in grid
    assert not any("tp4-cp2-ep" in n or "tp4-ep4" in n for n in grid)  # no axes left for them
