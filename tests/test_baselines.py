"""The hand-made strategies every plan is compared with, pinned on a DGX (data=2, model=4)."""

import functools
import re

import pytest

import soapjax_zoo
from soapjax.baselines import (
    BASELINES,
    NAMES,
    baselines,
    intra_node_axes,
    megatron_3d,
    megatron_grid,
)
from soapjax.errors import PlanError
from soapjax.graph import trace
from soapjax.space import MeshShape, data_parallel
from soapjax.topology import load_topology

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
