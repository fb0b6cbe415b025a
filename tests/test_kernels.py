"""The GPU kernel model (`soapjax.cost.kernels`): which kernels a shard runs, and what they cost.

* an attention score operator (matmul, mask, softmax) is a GEMM plus three fused kernels (a
  reduction ends a kernel) that read the scores three times and write the probabilities
  once, where the roofline counted the s x s bytes once;
* a dense layer's float32 weights cast to float16 are not a kernel of the layer (hoisted out of
  the microbatch loop); its bias add is;
* an embedding lookup reads its rows, not its table;
* tile and wave quantisation: one tile past a full wave costs a second wave;
* the backward of a GEMM is its two transposes; of a fused kernel, twice its bytes;
* an operator holding a loop falls back to the roofline;
* the topology file's ``[device.kernels]`` table and a link's ``efficiency``: parsed, checked
  (one-line errors), and in the fingerprint only when given.
"""

from __future__ import annotations

import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from soapjax.base.errors import TopologyError
from soapjax.cost.kernels import (
    FusedKernel,
    Gemm,
    Kernels,
    gemm_time,
    kernel_op_time,
    kernels_time,
    shard_kernels,
)
from soapjax.cost.operators import cost_model
from soapjax.cost.roofline import analytic_op_time
from soapjax.graph.opgraph import trace
from soapjax.topology.cluster import MESHES_DIR, KernelSpec, load_topology, scaled_topology

SPEC = KernelSpec(gemm_efficiency=0.5, memory_efficiency=0.5, launch=0.0, sms=4, tile=(2, 2))
A100 = scaled_topology(load_topology("dgx-a100x3072"), 8)


def _attention(q, k):
    s = jnp.einsum("btnh,bsnh->bnts", q, k)
    mask = jnp.arange(q.shape[1])[:, None] >= jnp.arange(q.shape[1])[None, :]
    probs = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(s.dtype).min), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, k)


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(64, dtype=jnp.float16, param_dtype=jnp.float32, name="fc")(x)


def _graph(fn, *args):
    return trace(fn, *args, name="case")


def test_attention_scores_are_a_gemm_and_a_fused_softmax_reading_and_writing_the_scores():
    q = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.float32)
    g = _graph(lambda p, b: _attention(b["q"], b["k"]).sum(), {}, {"q": q, "k": q})
    op = next(o for o in g.operators if o.anchor == "dot_general")
    k = shard_kernels(g, op, (1,) * len(op.iteration_sizes))
    scores = 2 * 4 * 16 * 16 * 4  # bytes of [b, n, t, s] float32
    gemms = [x for x in k.forward if isinstance(x, Gemm)]
    fused = [x for x in k.forward if isinstance(x, FusedKernel)]
    assert [(x.batch, x.m, x.n, x.k) for x in gemms] == [(8, 16, 16, 8)]
    # max; exp and sum; normalise: three kernels, each reading the scores (recomputing the
    # mask and the exponentials rather than reading them), the last writing the probabilities
    assert len(fused) == 3
    # (plus the row maxima and sums: written once, read by the kernels after them)
    assert sum(x.nbytes for x in fused) == 4 * scores + 5 * (2 * 4 * 16 * 4)
    # split 2 ways over the batch: each shard's kernels halve
    half = shard_kernels(g, op, tuple(2 if s == 2 else 1 for s in op.iteration_sizes))
    assert [x.batch for x in half.forward if isinstance(x, Gemm)] == [4]


def test_weight_cast_is_hoisted_and_bias_add_is_a_kernel():
    m = _Dense()
    x = jax.ShapeDtypeStruct((32, 48), jnp.float16)
    params = jax.eval_shape(m.init, jax.random.key(0), x)
    g = _graph(lambda p, b: m.apply(p, b["x"]).astype(jnp.float32).sum(), params, {"x": x})
    op = g.operator("fc")
    k = shard_kernels(g, op, (1,) * len(op.iteration_sizes))
    gemm = [x for x in k.forward if isinstance(x, Gemm)]
    fused = [x for x in k.forward if isinstance(x, FusedKernel)]
    assert [(x.m, x.n, x.k, x.dtype) for x in gemm] == [(32, 64, 48, "float16")]
    # no kernel reads only the float32 kernel (48 x 64 x 4 bytes read, x 2 written); one
    # fused kernel reads the GEMM's float16 output and the float32 bias and writes the sum,
    # cast to float32 for the loss
    assert [x.nbytes for x in fused] == [32 * 64 * 2 + 64 * 4 + 32 * 64 * 4]


def test_embedding_lookup_reads_rows_not_the_table():
    emb = nn.Embed(50_000, 64, dtype=jnp.float16, param_dtype=jnp.float32)
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    params = jax.eval_shape(emb.init, jax.random.key(0), tokens)
    g = _graph(lambda p, b: emb.apply(p, b["t"]).astype(jnp.float32).sum(), params, {"t": tokens})
    op = g.operators[0]
    k = shard_kernels(g, op, (1,) * len(op.iteration_sizes))
    table = 50_000 * 64 * 4
    assert k.forward and sum(x.nbytes for x in k.forward) < table / 100


def test_one_tile_past_a_wave_costs_a_second_wave():
    # 4 SMs, 2 x 2 tiles: [4, 4] output = 4 tiles = one wave; [4, 6] = 6 tiles = two waves
    one = gemm_time(Gemm(1, 4, 4, 10, "float16", 0.0), 1e12, 1e12, SPEC)
    two = gemm_time(Gemm(1, 4, 6, 10, "float16", 0.0), 1e12, 1e12, SPEC)
    assert one == pytest.approx(4 * 2 * 2 * 2 * 10 / (1e12 * 0.5))
    assert two == pytest.approx(2 * one)
    # bound by bytes when they outweigh the arithmetic
    assert gemm_time(Gemm(1, 4, 4, 10, "float16", 1e6), 1e12, 1e9, SPEC) == pytest.approx(
        1e6 / (1e9 * 0.5))


def test_backward_is_the_two_transposes_and_twice_a_fused_kernels_bytes():
    device = dataclasses.replace(A100.device, kernels=dataclasses.replace(
        A100.device.kernels, launch=0.0))
    spec = device.kernels
    g = Gemm(1, 4096, 1024, 512, "float16", 0.0)
    dx, dw = g.transposes()
    assert (dx.m, dx.n, dx.k) == (4096, 512, 1024) and (dw.m, dw.n, dw.k) == (512, 1024, 4096)
    peak = device.peak_flops_for("float16")
    bw = device.memory_bandwidth
    assert kernels_time([g], device, spec, backward=True) == pytest.approx(
        gemm_time(dx, peak, bw, spec) + gemm_time(dw, peak, bw, spec))
    f = FusedKernel(1e9)
    assert kernels_time([f], device, spec, backward=True) == pytest.approx(
        2 * kernels_time([f], device, spec))
    # float32 matmuls run at the TF32 figure the file gives, not the CUDA cores' 19.5 TFLOP/s
    f32 = Gemm(1, 8192, 8192, 8192, "float32", 0.0)
    t = kernels_time([f32], device, spec)
    assert t == pytest.approx(f32.flops / (156e12 * spec.gemm_efficiency), rel=0.02)


def test_an_operator_with_a_loop_keeps_the_roofline():
    def loss(p, b):
        def body(c, x):
            return jnp.tanh(c + x), None
        return jax.lax.scan(body, jnp.zeros(16), b["x"])[0].sum()

    g = _graph(loss, {}, {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32)})
    op = next(o for o in g.operators if "scan" in o.name or o.anchor == "scan")
    degrees = (1,) * len(op.iteration_sizes)
    k = shard_kernels(g, op, degrees)
    assert k.forward is None and "scan" in k.why
    assert kernel_op_time(k, op, degrees, A100.device, "float32") == analytic_op_time(
        op, degrees, A100.device, "float32")


def test_cost_model_prices_with_kernels_where_the_device_has_them():
    q = jax.ShapeDtypeStruct((8, 512, 16, 64), jnp.float16)
    g = _graph(lambda p, b: _attention(b["q"], b["k"]).astype(jnp.float32).sum(), {},
               {"q": q, "k": q})
    i = next(i for i, o in enumerate(g.operators) if o.anchor == "dot_general")
    degrees = (1,) * len(g.operators[i].iteration_sizes)
    with_kernels = cost_model(g, A100, mode="analytic").shard_time(i, degrees)
    bare = dataclasses.replace(A100, device=dataclasses.replace(A100.device, kernels=None))
    roofline = cost_model(g, bare, mode="analytic").shard_time(i, degrees)
    # the roofline takes the larger of FLOPs and the operator's own bytes; the kernels add the
    # GEMM and the fused softmax's read and write of the scores
    assert with_kernels.forward_s > 1.5 * roofline.forward_s
    assert isinstance(shard_kernels(g, g.operators[i], degrees), Kernels)


def test_device_kernels_table_is_parsed_and_checked(tmp_path):
    t = load_topology("dgx-a100x3072")
    assert t.device.kernels.sms == 108 and t.device.kernels.tile == (128, 128)
    assert t.device.kernels.float32_matmul == pytest.approx(156e12)
    base = (MESHES_DIR / "dgx-a100x3072.toml").read_text()
    bad = re.sub(r"gemm_efficiency = [0-9.]+", "gemm_efficiency = 1.5", base)
    f = tmp_path / "bad.toml"
    f.write_text(bad)
    with pytest.raises(TopologyError, match=r"\[device.kernels\].gemm_efficiency: expected a "
                       r"fraction in \(0, 1\], found 1.5"):
        load_topology(str(f))
    f.write_text(base.replace("sms = 108\n", ""))
    with pytest.raises(TopologyError, match="missing required key 'sms'"):
        load_topology(str(f))
    f.write_text(base.replace("efficiency = 0.8\n", "efficiency = 0\n", 1))
    with pytest.raises(TopologyError, match="efficiency: expected the fraction of the line rate"):
        load_topology(str(f))


def test_link_efficiency_scales_what_collectives_see():
    t = load_topology("dgx-a100x3072-8")
    nvlink = next(link for link in t.links if link.link_class == "nvlink")
    assert nvlink.bandwidth == pytest.approx(0.8 * 300e9)
    # a 100 MB all-reduce over the 8 GPUs of a node: 2 x 7/8 x 100 MB at 240 GB/s, plus
    # 14 latencies
    ar = t.collective_time("all_reduce", 100e6, t.axis_names)
    assert ar == pytest.approx(2 * 7 / 8 * 100e6 / 240e9, rel=0.05)
    assert math.isfinite(ar)


def test_topologies_without_kernels_keep_their_fingerprint():
    t = load_topology("p100x16")
    assert t.device.kernels is None
    assert "kernels" not in str(t.fingerprint())  # a hash; the content without the key
    bare = dataclasses.replace(A100, device=dataclasses.replace(A100.device, kernels=None))
    assert bare.fingerprint() != A100.fingerprint()
