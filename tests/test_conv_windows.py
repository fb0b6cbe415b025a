"""Convolutions split along a spatial dim whose role is not ``A``.

A learned position embedding added after a convolution (a ViT's patches, a ViViT's frames)
gives the convolution's spatial dim a parameter, so the operator's dim is a ``P`` dim, and the
role-based guard against spatial splits (XLA's partitioner computes them wrongly:
docs/xla-workarounds.md) let them through: ViViT's tubelet kernel gradient came out 1-3x its
own scale off under 12 of 30 random strategies. Now the convolution's own dims decide
(`soapjax.graph._inner.halo_split`): a split at the edges of windows that do not overlap (a
patch embedding) runs in `jax.shard_map` like any other split, exactly; one that needs a halo
is refused whatever its role.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from soapjax.apply import step as apply
from soapjax.apply._manual import conv_units
from soapjax.base.errors import PlanError
from soapjax.exactness import first_step
from soapjax.graph._inner import convolutions, halo_split
from soapjax.graph.opgraph import trace
from soapjax.strategy import space
from soapjax.strategy.space import Config, MeshShape, spatial_convolution
from soapjax.topology.cluster import load_topology, make_mesh

TOPOLOGY = load_topology("cpu8")
MESH = MeshShape.of(TOPOLOGY)


class _Tubelets(nn.Module):
    """ViViT's tubelet embedding: a (2, 4, 4) convolution with that stride, a temporal
    position embedding added per frame."""

    @nn.compact
    def __call__(self, video):
        x = nn.Conv(8, (2, 4, 4), strides=(2, 4, 4), padding="VALID", name="tubelets")(video)
        pos = self.param("pos_t", nn.initializers.normal(0.5), (x.shape[1], 8))
        return jnp.tanh(x + pos[None, :, None, None])


class _SameConv(nn.Module):
    """A 3x3 convolution with SAME padding and a learned [H, W, C] position embedding."""

    @nn.compact
    def __call__(self, image):
        x = nn.Conv(8, (3, 3), padding="SAME", name="conv")(image)
        pos = self.param("pos", nn.initializers.normal(0.5), x.shape[1:])
        return jnp.tanh(x + pos[None])


def _case(module, shape):
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(1), shape, jnp.float64)
        params = module.init(jax.random.key(0), x)["params"]
        params = jax.tree.map(lambda a: a + 0.2 * jax.random.normal(jax.random.key(2), a.shape,
                                                                   a.dtype), params)

    def loss(p, b):
        return jnp.mean(module.apply({"params": p}, b["x"]) ** 2)

    return loss, params, {"x": x}


def _split(graph, j, dims_axes):
    axes = [()] * len(graph.operators[j].iteration_sizes)
    for d, a in dims_axes.items():
        axes[d] = a
    return space.data_parallel(graph, MESH).replace(j, Config(tuple(axes)))


def test_the_windows_that_tile_a_dim_are_told_apart():
    loss, params, batch = _case(_Tubelets(), (8, 8, 8, 8, 3))
    g = trace(loss, params, batch)
    (conv,) = convolutions(g, 0)
    frames = conv.out[1]
    assert g.operators[0].iteration_roles[frames] == "P"  # the position embedding's dim
    assert conv.lhs[1] == frames  # the input's frames follow the same dim
    sizes = g.operators[0].iteration_sizes
    assert all(conv.local_windows(k, sizes[frames] if k == 0 else 2) for k in range(3))
    loss, params, batch = _case(_SameConv(), (8, 8, 8, 3))
    g = trace(loss, params, batch)
    (conv,) = convolutions(g, 0)
    assert not conv.local_windows(0, 8)  # padded, stride 1 < window 3
    axes = [()] * len(g.operators[0].iteration_sizes)
    axes[conv.out[1]] = ("data",)
    assert "straddle" in halo_split(conv, axes, g.operators[0].iteration_sizes)


@pytest.mark.parametrize("split", [{1: ("model",)}, {1: ("model",), 4: ("data",)},
                                   {0: ("data",), 1: ("model",)}],
                         ids=["frames", "frames+channels", "batch+frames"])
def test_a_patch_embedding_split_over_frames_trains_exactly(split):
    """The tubelets' frames split (with the channels or the batch): run in `jax.shard_map`,
    each device on its own frames; float64 loss and every gradient leaf equal `jax.grad`'s,
    each against its own scale (the kernel's was 1-3x its scale off when XLA ran it)."""
    loss, params, batch = _case(_Tubelets(), (8, 8, 8, 8, 3))
    with jax.enable_x64(True):
        g = trace(loss, params, batch)
        (conv,) = convolutions(g, 0)
        split = {conv.out[1] if d == 1 else conv.out[-1] if d == 4 else d: a
                 for d, a in split.items()}
        s = _split(g, 0, split)
        assert spatial_convolution(g, s) is None
        result = first_step(g, s, make_mesh(TOPOLOGY), loss, params, batch,
                            tolerance=1e-12)
    assert result.passed, result.describe()
    assert conv.unit in conv_units(g, 0, s.configs[0])  # run in shard_map, not by XLA


def test_a_halo_split_is_refused_whatever_the_dims_role():
    """Rows of a padded 3x3 convolution split: its dim is a P dim (the position embedding's),
    and apply refuses it all the same, naming the convolution's spatial dim."""
    loss, params, batch = _case(_SameConv(), (8, 8, 8, 3))
    with jax.enable_x64(True):
        g = trace(loss, params, batch)
        (conv,) = convolutions(g, 0)
        assert g.operators[0].iteration_roles[conv.out[1]] == "P"
        s = _split(g, 0, {conv.out[1]: ("data",)})
        name, why = spatial_convolution(g, s)
        assert name == "conv" and "spatial dim 0 is split over ['data']" in why
        with pytest.raises(PlanError, match="spatial dim 0 is split"):
            apply.sharded_value_and_grad(g, s, make_mesh(TOPOLOGY), params=params, batch=batch)


def _dynamic_conv():
    import corpus

    loss, params, batch = corpus.get("dynamic_conv", dtype=jnp.float64)
    params = jax.tree.map(lambda a: a + 0.2 * jax.random.normal(jax.random.key(3), a.shape,
                                                               a.dtype), params)
    return loss, params, batch


def test_the_space_leaves_halo_dims_whole_whatever_their_role():
    """The padded convolution's rows (P: a position embedding's) and the dynamic
    convolution's height and width (R: pooled inside its operator) are halo dims, and no
    config of the search space splits them; the tubelets' frames (windows that do not
    overlap) are offered."""
    loss, params, batch = _case(_SameConv(), (8, 8, 8, 3))
    op = trace(loss, params, batch).operators[0]
    assert op.halo_dims == (1, 2) and op.iteration_roles[1:3] == ("P", "P")
    assert not any(c.axes[1] or c.axes[2] for c in space.configs(op, MESH))
    with jax.enable_x64(True):
        g = trace(*_dynamic_conv())
    dyn = g.operator("conv_general_dilated")
    assert [dyn.iteration_roles[d] for d in dyn.halo_dims] == ["R", "R"]
    assert not any(c.axes[d] for c in space.configs(dyn, MESH) for d in dyn.halo_dims)
    loss, params, batch = _case(_Tubelets(), (8, 8, 8, 8, 3))
    op = trace(loss, params, batch).operators[0]
    frames = convolutions(trace(loss, params, batch), 0)[0].out[1]
    assert frames not in op.halo_dims
    assert any(c.axes[frames] for c in space.configs(op, MESH))


@pytest.mark.parametrize("pool, halo", [
    (lambda x: nn.max_pool(x, (3, 3), (2, 2), padding="SAME"), True),  # overlapping, padded
    (lambda x: nn.avg_pool(x, (2, 2), (2, 2)), False),  # windows that tile the rows
])
def test_a_poolings_overlapping_windows_are_halo_dims(pool, halo):
    """A pooling and a global mean in one operator (nchw_sr's head): its pooled rows and
    columns are reduction dims. Split where the windows overlap, XLA exchanged halos
    (collective-permutes, and an all-gather in the max pool's backward: 0.81 of the plan's
    bytes predicted); the space leaves them whole as it leaves a convolution's."""
    def loss(p, b):
        return jnp.mean((pool(jnp.tanh(b["x"] * p["s"])).mean(axis=(1, 2)) @ p["w"]) ** 2)

    g = trace(loss, {"s": jnp.ones((8,)), "w": jnp.ones((8, 4))}, {"x": jnp.ones((8, 8, 8, 8))})
    op = next(o for o in g.operators if o.anchor.startswith("reduce_window"))
    rows = [d for d, r in enumerate(op.iteration_roles) if r == "R"]
    assert len(rows) == 2
    assert (op.halo_dims == tuple(rows)) if halo else not op.halo_dims
    assert any(c.axes[d] for c in space.configs(op, MESH) for d in rows) == (not halo)


def test_a_pooled_convolution_split_over_its_rows_is_refused():
    """The dynamic convolution's rows are a reduction (R) dim of its operator (the global
    mean pooling is inside it); split, XLA computed the weight-standardised kernel's and the
    bias's gradients 1.3-3.9x their scale off (4 of 40 random strategies before this guard
    read the convolution itself). Apply refuses it now."""
    with jax.enable_x64(True):
        loss, params, batch = _dynamic_conv()
        g = trace(loss, params, batch)
        j = g.index("conv_general_dilated")
        rows = g.operators[j].halo_dims[0]
        s = _split(g, j, {rows: ("model",)})
        name, why = spatial_convolution(g, s)
        assert name == "conv_general_dilated" and "split over ['model']" in why
        with pytest.raises(PlanError, match="spatial dim . is split"):
            apply.sharded_value_and_grad(g, s, make_mesh(TOPOLOGY), params=params, batch=batch)


def test_a_depthwise_convolution_reading_split_channels_is_exact():
    """The dynamic convolution's channels are an A dim (its kernels are activations, not
    parameters), and its input arrives split over them from the convolution before: that is
    no spatial split (the guard refused it when it went by roles); float64 exact."""
    with jax.enable_x64(True):
        loss, params, batch = _dynamic_conv()
        g = trace(loss, params, batch)
        first = g.index("stdconv")
        channels = g.operators[first].iteration_roles.index("P")
        s = _split(g, first, {0: ("data",), channels: ("model",)})
        assert spatial_convolution(g, s) is None
        result = first_step(g, s, make_mesh(TOPOLOGY), loss, params, batch,
                            tolerance=1e-12)
    assert result.passed, result.describe()
