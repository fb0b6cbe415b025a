"""soapjax.cost.roofline: the analytic cost model's dtype and efficiencies (`compute_dtype`,
``[device.efficiency]``).

A mixed-precision layer (``nn.Dense(dtype=float16, param_dtype=float32)``) casts its float32
kernel to float16 before its matmul: it runs at the float16 peak, like the same layer with
float16 parameters. The cost model used to take the widest operand (the float32 kernel) and
priced such layers at the float32 peak, 16x slower on an A100 (a 22B GPT under 8-way tensor
parallelism on 8 A100s: 7.2 s a step instead of 0.70 s).
"""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from soapjax.base.errors import TopologyError
from soapjax.cost.operators import cost_model
from soapjax.cost.roofline import ANALYTIC_KERNEL_OVERHEAD_S, compute_dtype, roofline_time
from soapjax.graph.opgraph import trace
from soapjax.topology.cluster import MESHES_DIR, load_topology, scaled_topology

MESHES = MESHES_DIR
A100_PEAK_16 = 312e12  # A100 SXM4 float16 and bfloat16 tensor-core peak, FLOP/s
A100_PEAK_32 = 19.5e12


@pytest.fixture(scope="module")
def a100():
    """One DGX A100 priced by the roofline: its [device.kernels] table (the GPU kernel model,
    tests/test_kernels.py) dropped."""
    t = scaled_topology(load_topology("dgx-a100x3072"), 8)
    return dataclasses.replace(t, device=dataclasses.replace(t.device, kernels=None))


def dense_graph(dtype, param_dtype, *, tokens: int = 1024, features: int = 1024):
    """One Dense layer traced from shapes: [tokens, features] @ [features, features]."""
    layer = nn.Dense(features, dtype=dtype, param_dtype=param_dtype)
    x = jax.ShapeDtypeStruct((tokens, features), dtype)
    params = jax.eval_shape(layer.init, jax.random.key(0), x)

    def loss(p, batch):
        return layer.apply(p, batch["x"]).astype(jnp.float32).sum()

    return trace(loss, params, {"x": x}, name="dense")


def matmul_time(graph, topology):
    costs = cost_model(graph, topology, mode="analytic")
    i = next(i for i, op in enumerate(graph.operators) if op.anchor == "dot_general")
    return graph.operators[i], costs.shard_time(i, (1,) * len(graph.operators[i].iteration_sizes))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_a_16_bit_dense_over_float32_parameters_runs_at_the_16_bit_peak(dtype, a100):
    mixed = dense_graph(dtype, jnp.float32)
    pure = dense_graph(dtype, dtype)
    op, t_mixed = matmul_time(mixed, a100)
    _, t_pure = matmul_time(pure, a100)
    assert compute_dtype(mixed, op) == jnp.dtype(dtype).name
    assert {o.dtype for o in op.inputs if o.kind == "param"} == {"float32"}  # read as float32
    # 2.1 GFLOP: compute-bound at 312 TFLOP/s (6.9 us) over 8.4 MB at 2 TB/s (4.1 us)
    assert t_mixed == t_pure
    assert t_mixed.forward_s == pytest.approx(
        op.flops / A100_PEAK_16 + ANALYTIC_KERNEL_OVERHEAD_S, rel=1e-12)


def test_a_float32_dense_runs_at_the_float32_peak(a100):
    g = dense_graph(jnp.float32, jnp.float32)
    op, t = matmul_time(g, a100)
    assert compute_dtype(g, op) == "float32"
    assert t.forward_s == pytest.approx(op.flops / A100_PEAK_32 + ANALYTIC_KERNEL_OVERHEAD_S,
                                        rel=1e-12)


def test_the_matmul_is_found_inside_a_custom_jvp_body():
    @jax.custom_jvp
    def matmul(x, w):
        return x @ w.astype(x.dtype)

    matmul.defjvp(lambda primals, tangents: (
        matmul(*primals), tangents[0] @ primals[1].astype(primals[0].dtype)
        + primals[0] @ tangents[1].astype(primals[0].dtype)))

    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
    g = trace(lambda p, b: matmul(b["x"], p["w"]).astype(jnp.float32).sum(), {"w": w}, {"x": x})
    (op,) = [op for op in g.operators if "float32" in {o.dtype for o in op.inputs}]
    assert compute_dtype(g, op) == "bfloat16"


def test_operators_without_a_matmul_take_their_widest_float_operand():
    norm = nn.LayerNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    x = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
    params = jax.eval_shape(norm.init, jax.random.key(0), x)
    g = trace(lambda p, b: norm.apply(p, b["x"]).astype(jnp.float32).sum(), params, {"x": x})
    assert compute_dtype(g, 0) == "float32"


# --- measured efficiencies ------------------------------------------------------------------------


def with_efficiency(tmp_path, table: str):
    """The A100 file with a [device.efficiency] table and without its [device.kernels] one (so
    the roofline prices it)."""
    text = (MESHES / "dgx-a100x3072.toml").read_text()
    text = re.sub(r"\[device\.kernels\].*?\n\n", "", text, flags=re.S)
    text += "\n[device.efficiency]\n" + table
    path = tmp_path / "a100-measured.toml"
    path.write_text(text)
    return scaled_topology(load_topology(path), 8)


def test_efficiencies_scale_the_roofline(tmp_path, a100):
    measured = with_efficiency(tmp_path, "peak_flops = { float16 = 0.5 }\nmemory_bandwidth = 0.8\n")
    eff = measured.device.efficiency
    assert (eff.flops_fraction("float16"), eff.flops_fraction("bfloat16")) == (0.5, 1.0)
    assert a100.device.efficiency.flops_fraction("float16") == 1.0  # the shipped file: none
    g = dense_graph(jnp.float16, jnp.float32)
    op, ideal = matmul_time(g, a100)
    _, real = matmul_time(g, measured)
    assert real.forward_s == pytest.approx(
        op.flops / (0.5 * A100_PEAK_16) + ANALYTIC_KERNEL_OVERHEAD_S, rel=1e-12)
    assert real.forward_s - ANALYTIC_KERNEL_OVERHEAD_S == pytest.approx(
        2 * (ideal.forward_s - ANALYTIC_KERNEL_OVERHEAD_S), rel=1e-12)
    # memory-bound work (the optimizer update) at 80 % of the bandwidth
    bw = measured.device.memory_bandwidth
    assert roofline_time(0.0, 1e9, "float32", measured.device) == pytest.approx(
        1e9 / (0.8 * bw) + ANALYTIC_KERNEL_OVERHEAD_S, rel=1e-12)
    update = cost_model(g, measured, mode="analytic").update_time(1e6)
    assert update == pytest.approx(7 * 1e6 / (0.8 * bw) + ANALYTIC_KERNEL_OVERHEAD_S, rel=1e-12)
    assert measured.fingerprint() != a100.fingerprint()


@pytest.mark.parametrize(("table", "message"), [
    ("memory_bandwidth = 1.5\n",
     r"\[device.efficiency\].memory_bandwidth: expected a fraction of the peak in \(0, 1\], found"),
    ("peak_flops = { float16 = 0 }\n", r"\[device.efficiency\].peak_flops.float16: expected"),
    ("peak_flops = { float17 = 0.5 }\n", r"unknown dtype 'float17'"),
    ("peak_flop = { float16 = 0.5 }\n", r"unknown key 'peak_flop' \(did you mean 'peak_flops'\?\)"),
], ids=["above-one", "zero", "unknown-dtype", "typo"])
def test_bad_efficiencies_are_refused(tmp_path, table, message):
    with pytest.raises(TopologyError, match=message):
        with_efficiency(tmp_path, table)
