"""The SOAP space: what `configs` enumerates for each kind of operator, and MeshShape."""

import dataclasses
import functools

import jax
import pytest
from jax.sharding import AbstractMesh

import soapjax_zoo
from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import trace
from soapjax.strategy.space import (
    Config,
    MeshShape,
    SpaceLimits,
    configs,
    data_parallel,
    tie_blocks,
    validate_config,
)
from soapjax.topology.cluster import load_topology

MESH = MeshShape(("data", "model"), (2, 4))
D, M, DM = ("data",), ("model",), ("data", "model")


@functools.cache
def graph(name):
    w = soapjax_zoo.get(name, "tiny")
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=name)


def op(name, op_name):
    return next(o for o in graph(name).operators if o.name == op_name)


def axes(op_, **kw):
    return {c.axes for c in configs(op_, MESH, SpaceLimits(**kw))}


def test_a_matmul_splits_batch_features_and_contraction():
    fc1 = op("mlp", "fc1")  # [8, 32] outputs, contracting 16: S, P | R
    assert (fc1.iteration_sizes, fc1.iteration_roles) == ((8, 32, 16), ("S", "P", "R"))
    # each axis on any of the three dims, or on none: 4 x 4 configs, and every degree divides
    every = set()
    for data_dim in (None, 0, 1, 2):
        for model_dim in (None, 0, 1, 2):
            dims = [[], [], []]
            for axis, d in (("data", data_dim), ("model", model_dim)):
                if d is not None:
                    dims[d].append(axis)
            every.add(tuple(map(tuple, dims)))
    assert axes(fc1) == every and len(every) == 16
    assert configs(fc1, MESH)[0] == Config(((), (), ()))  # the replicated config first
    # FlexFlow's space has no reduction splits: 9 configs
    assert axes(fc1, allow_reduction=False) == {x for x in every if not x[2]}


def test_a_convolution_keeps_height_and_width_whole_by_default():
    conv = op("lenet", "conv1")  # [8, 24, 24, 4]: S, A, A, P
    assert conv.iteration_roles == ("S", "A", "A", "P")
    assert axes(conv) == {
        ((), (), (), ()), (M, (), (), ()), ((), (), (), M), (D, (), (), ()), (DM, (), (), ()),
        (D, (), (), M), ((), (), (), D), (M, (), (), D),
    }  # 4 output channels: never over both axes (8 ways)
    assert len(axes(conv, allow_spatial=True)) == 22


def test_an_embedding_splits_batch_and_features_not_the_position():
    embed = op("rnnlm", "embed")  # a gather: [8, 8, 32]: S, -, P
    assert embed.iteration_roles == ("S", "-", "P")
    assert axes(embed) == {
        ((), (), ()), (M, (), ()), ((), (), M), (D, (), ()), (DM, (), ()), (D, (), M),
        ((), (), D), (M, (), D), ((), (), DM),
    }


def test_a_loop_splits_only_its_batch():
    lstm = op("rnnlm", "lstm_0")  # a scan: the carry makes every other dim whole
    assert lstm.anchor == "scan" and lstm.divisible_dims == (0,)
    assert axes(lstm) == {((), (), (), ()), (M, (), (), ()), (D, (), (), ()),
                          (DM, (), (), ())}


def test_data_parallel_splits_every_sample_dim_over_every_axis():
    dp = data_parallel(graph("mlp"), MESH)
    assert [c.axes for c in dp.configs] == [(DM, (), ())] * 3 + [((), DM)]


def test_validate_config_names_the_operator():
    g = graph("mlp")
    validate_config(g, 0, Config((D, M, ())), MESH)
    with pytest.raises(PlanError, match=r"operator 'fc1': config .* has 2 dims, expected 3"):
        validate_config(g, 0, Config((D, M)), MESH)
    with pytest.raises(PlanError, match=r"operator 'fc1': dim 1 uses unknown mesh axes \['x'\]"):
        validate_config(g, 0, Config(((), ("x",), ())), MESH)


# --- MeshShape ---------------------------------------------------------------------------------


def test_mesh_shape_speaks_jax():
    assert (MESH.size, MESH.num_devices, MESH.shape) == (8, 8, {"data": 2, "model": 4})
    assert MESH.axis_size("model") == 4 and MESH.degree(DM) == 8 and MESH.degree(()) == 1
    abstract = MESH.abstract_mesh
    assert isinstance(abstract, AbstractMesh) and abstract.shape == MESH.shape
    assert MeshShape.of(AbstractMesh((2, 4), ("data", "model"))) == MESH


def test_mesh_shape_of_a_topology_and_a_jax_mesh():
    assert MeshShape.of(load_topology("cpu4")) == MeshShape(("data", "model"), (2, 2))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    assert MeshShape.of(mesh) == MESH and hash(MeshShape.of(mesh)) == hash(MESH)


@pytest.mark.parametrize("names, sizes, message", [
    (("a", "b"), (2,), r"2 axis names \('a', 'b'\) but 1 sizes"),
    (("a", "a"), (2, 2), "mesh axis names must be distinct"),
])
def test_mesh_shape_refuses_nonsense(names, sizes, message):
    with pytest.raises(ValueError, match=message):
        MeshShape(names, sizes)


@pytest.mark.parametrize("layer", [0, -1])
def test_tie_blocks_gives_every_layer_one_layers_config_and_policy(layer):
    # tiny GPT, 2 scanned layers: layer 0's fc1 column parallel, layer 1's row parallel
    g = graph("gpt")
    groups = g.repeated_blocks()
    first, last = next(grp for grp in groups if g.operators[grp[0]].name.endswith("fc1"))
    base = data_parallel(g, MESH)
    column, row = Config((D, (), M, ())), Config((D, (), (), M))
    edited = list(base.configs)
    edited[first], edited[last] = column, row
    recompute = ["none"] * len(edited)
    recompute[last] = "full"
    tied = tie_blocks(g, dataclasses.replace(base, configs=tuple(edited),
                                             recompute=tuple(recompute)), layer=layer)
    want = (column, "none") if layer == 0 else (row, "full")
    assert (tied.configs[first], tied.recompute_of(first)) == want
    assert (tied.configs[last], tied.recompute_of(last)) == want
    assert all(len({tied.configs[i] for i in grp}) == 1 for grp in groups)
    assert [c for i, c in enumerate(tied.configs) if i not in (first, last)] == \
        [c for i, c in enumerate(base.configs) if i not in (first, last)]



def test_a_cotangent_reduces_into_its_producer_only_with_every_partial_axis_scattered():
    """`space.reduces_into`: one dim gains, and where it is already split it gains every
    partial axis (Megatron's sequence parallelism); an axis moving between dims, two dims
    gaining, or some partial axes scattered into an already split dim with the others left to
    an all-reduce is not (XLA computed wrong gradients through each:
    docs/xla-workarounds.md)."""
    from soapjax.strategy.space import reduces_into

    # sequence parallelism: the sequence dim gains model, the cotangent's one partial axis
    assert reduces_into((("data",), (), ()), (("data",), ("model",), ()), ["model"])
    assert reduces_into((("node",), (), ()), (("node",), ("data", "model"), ()),
                        ["model", "data"])
    # the same layout: reduced where it is
    assert reduces_into((("data",), ()), (("data",), ()), ["model"])
    # some partial axes scattered into an already split dim, the others all-reduced (the GQA
    # decoder's values); into an unsplit dim it is exact (LLaMA's sequence parallelism)
    assert not reduces_into((("node",), (), (), ()), (("node", "data"), (), (), ()),
                            ["data", "model"])
    assert reduces_into(((), (), (), ()), ((), (), ("data",), ()), ["data", "model"])
    # two dims gaining; an axis moving between dims; a gained axis that is not partial
    assert not reduces_into(((), (), ()), (("model",), ("node",), ()), ["model", "node"])
    assert not reduces_into((("data",), ()), ((), ("data",)), ["data"])
    assert not reduces_into(((), ()), (("data",), ()), ["model"])
