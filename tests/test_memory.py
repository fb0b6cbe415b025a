"""The memory dimensions' rules (soapjax.memory): recomputation segments, microbatch shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from soapjax import memory
from soapjax.errors import PlanError
from soapjax.graph import trace
from soapjax.space import Config, MeshShape, Strategy, data_parallel


def mlp_graph(batch=16):
    def loss(w, x):
        h = jax.nn.gelu(x @ w["fc1"])      # fc1 (dot), gelu
        h = jnp.tanh(h @ w["fc2"])         # fc2 (dot), tanh
        return jnp.mean(h ** 2)            # the loss
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return trace(loss, {"fc1": f32(8, 32), "fc2": f32(32, 32)}, f32(batch, 8))


def test_strategy_checks_its_memory_fields():
    c = (Config(((),)),)
    with pytest.raises(PlanError, match="microbatches must be an integer >= 1"):
        Strategy(c, microbatches=0)
    with pytest.raises(PlanError, match=r"recompute\[0\] is 'al'; expected one of"):
        Strategy(c, recompute=("al",))
    with pytest.raises(PlanError, match="2 policies for 1 operators"):
        Strategy(c, recompute=("full", "none"))
    assert Strategy(c, recompute=("none",)) == Strategy(c)  # one spelling of "none"
    assert Strategy(c).with_recompute(0, "full").recompute_of(0) == "full"


def test_selective_keeps_matmuls_and_recomputes_the_rest():
    g = mlp_graph()
    anchors = [op.anchor for op in g.operators]
    flags = [memory.recomputes(op, "selective") for op in g.operators]
    assert flags == [not a.startswith("dot_general") for a in anchors]
    assert all(memory.recomputes(op, "full") for op in g.operators)
    assert not any(memory.recomputes(op, "none") for op in g.operators)


def test_activation_bytes_rule_by_hand():
    """A chain a -> b -> c -> d -> e (a second reader of b: e): bytes 1, 10, 100, 1000, 10000."""
    seg = memory.Segments.__new__(memory.Segments)
    seg.layers = [""] * 5
    seg.readers = [[1], [2, 4], [3], [4], []]
    n = [1, 10, 100, 1000, 10000]
    assert seg.activation_bytes([False] * 5, n) == 11111
    # b, c, d recompute: one segment; b is read by e outside it (kept), c is not, d is (kept)
    assert seg.segments([False, True, True, True, False]) == [-1, 1, 1, 1, -1]
    assert seg.activation_bytes([False, True, True, True, False], n) == 1 + 10 + 1000 + 10000 + 100
    # split by layers: c alone in its segment of layer "x"
    seg.layers = ["", "", "x", "", ""]
    assert seg.segments([False, True, True, True, False]) == [-1, 1, 2, 3, -1]
    assert seg.activation_bytes([False, True, True, True, False], n) == 11111


def test_microbatches_must_divide_the_per_device_batch():
    g = mlp_graph(batch=16)
    mesh = MeshShape(("data",), (8,))
    dp = data_parallel(g, mesh)
    memory.check_microbatches(g, dp.configs, mesh, 2)  # 16 / 8 = 2 per device: fine
    with pytest.raises(PlanError, match="leaves 2 per device, which 4 microbatches do not"):
        memory.check_microbatches(g, dp.configs, mesh, 4)
    assert memory.microbatch_choices(g) == (1, 2, 4, 8, 16)
    op = g.operators[0]
    assert memory.microbatch_degrees(op, (8, 1, 1), 2) == (16, 1, 1)
    assert memory.microbatch_shape((16, 32), (0, 1), 0, 4) == (4, 32)
    assert memory.microbatch_shape((16, 32), (None, 1), 0, 4) == (16, 32)
