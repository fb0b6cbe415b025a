"""The hand-made strategies every plan is compared with, pinned on a DGX (data=2, model=4)."""

import functools

import pytest

import soapjax_zoo
from soapjax.baselines import NAMES, baselines, intra_node_axes
from soapjax.graph import trace
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
