"""soapjax.cost.flops: the FLOPs of equations and of a training step per device, as XLA counts
them."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import XLA_DEFAULT_EMITTERS

from soapjax.cost.flops import FlopCounter
from soapjax.graph._dims import xla_flops
from soapjax.strategy.baselines import fsdp
from soapjax.strategy.space import MeshShape, data_parallel
from tests.test_cost import cpu8, dense_graph

# --- FLOPs as XLA counts them --------------------------------------------------------------------


def _vjp(f):
    """``x, ct -> (f(x), ct's pullback)``: a forward and backward with nothing dead."""
    def both(x, ct):
        y, pull = jax.vjp(f, x)
        return y, pull(ct)
    return both


_X = jax.ShapeDtypeStruct((8, 16), jnp.float32)
_IMAGE = jax.ShapeDtypeStruct((2, 9, 9, 3), jnp.float32)
_POOLED = jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32)
_MAX_POOL = functools.partial(nn.max_pool, window_shape=(2, 2), strides=(2, 2))

FLOP_CASES = {
    # matmul 2*8*4*16, then 8*4 adds and tanhs; `* 1.0` lowers to nothing
    "dense, tanh, x*1": (lambda x, w: jnp.tanh(x @ w) * 1.0 + 1.0,
                         (_X, jax.ShapeDtypeStruct((16, 4), jnp.float32)), (1056, 32)),
    # a contraction over one element is a multiply to XLA: 1 FLOP per output, not 2
    "outer product": (lambda a, b: jnp.einsum("ik,kj->ij", a[:, None], b[None, :]),
                      (jax.ShapeDtypeStruct((8,), jnp.float32),) * 2, (64, 0)),
    # x**3 two multiplies; a sigmoid is 1 / (1 + exp(-x)) to XLA: 3 FLOPs and an exp
    "x**3 - sigmoid": (lambda x: x ** 3 - jax.nn.sigmoid(x), (_X,), (768, 128)),
    # 'SAME' padding: only the taps inside the image count
    "padded strided conv": (
        lambda i, k: jax.lax.conv_general_dilated(i, k, (2, 2), "SAME",
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC")),
        (_IMAGE, jax.ShapeDtypeStruct((3, 3, 3, 4), jnp.float32)), (8112, 0)),
    "relu and its gradient": (_vjp(jax.nn.relu), (_X, _X), (384, 0)),
    # XLA:CPU expands select-and-scatter: rank + 7 FLOPs per window step, then the adds
    "max pool and its gradient": (_vjp(_MAX_POOL), (_POOLED, jax.ShapeDtypeStruct(
        (2, 4, 4, 3), jnp.float32)), (3552, 0)),
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), (_X,), (504, 128)),
    "log-softmax and its gradient": (_vjp(jax.nn.log_softmax), (_X, _X), (1016, 136)),
    # an FFT: 8 per operand element times floor(log2) of each length, multiplied (XLA's rule,
    # not n log n: 12 x 12 counts 3 * 3); an rfft's operand is real, an irfft's the half spectrum
    "rfft2 of a field, irfft2 back": (
        lambda x: jnp.fft.irfft2(jnp.fft.rfft2(x, axes=(1, 2)), s=(12, 12), axes=(1, 2)),
        (jax.ShapeDtypeStruct((2, 12, 12, 3), jnp.float32),), (8 * 9 * 864 + 8 * 9 * 504, 0)),
    "complex fft along 16": (lambda z: jnp.fft.fft(z, axis=-1),
                             (jax.ShapeDtypeStruct((4, 16), jnp.complex64),), (2048, 0)),
}


@pytest.mark.parametrize("case", FLOP_CASES, ids=list(FLOP_CASES))
def test_xla_flops_count_what_xla_counts(case):
    fn, avals, (flops, transcendentals) = FLOP_CASES[case]
    counted = xla_flops(jax.make_jaxpr(fn)(*avals).jaxpr)
    analysis = jax.jit(fn).lower(*avals).compile(XLA_DEFAULT_EMITTERS).cost_analysis()
    assert (counted.flops, counted.transcendentals) == (flops, transcendentals)
    assert (analysis.get("flops", 0.0), analysis.get("transcendentals", 0.0)) == (
        flops, transcendentals)


def test_a_scan_counts_its_body_once_per_step_which_cost_analysis_does_not():
    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w) + 1.0, None), x, None, length=10)[0]

    avals = (_X, jax.ShapeDtypeStruct((16, 16), jnp.float32))
    body = 2 * 8 * 16 * 16 + 8 * 16  # the matmul and the add
    assert xla_flops(jax.make_jaxpr(f)(*avals).jaxpr) == (10 * body, 10 * 128, 10 * 2 * 8 * 16 * 16)
    # XLA's cost analysis counts the loop body once (and the loop counter's add and compare)
    assert jax.jit(f).lower(*avals).compile().cost_analysis()["flops"] == body + 2


def test_flop_counter_on_one_sample_per_device():
    """Dense4 (width 16, batch 8) data parallel on 8 devices, plain SGD."""
    g = dense_graph(8, 16)
    mesh = MeshShape.of(cpu8())
    counter = FlopCounter(g, optimizer=optax.sgd(0.1))
    dp = data_parallel(g, mesh)
    degrees = dp.configs[0].degrees(mesh)
    a, b = counter.operator(0, degrees), counter.operator(1, degrees)
    assert a.forward == (2 * 16 * 16 + 16, 0, 2 * 16 * 16)  # one sample: matmul, bias
    # the weight gradient of one sample is an outer product (a multiply to XLA); `a` reads
    # the batch, so computes no input gradient; its bias gradient sums one row (nothing)
    assert a.backward == (16 * 16, 0, 16 * 16)
    assert b.backward == (16 * 16 + 2 * 16 * 16, 0, 16 * 16 + 2 * 16 * 16)
    # unsplit, the weight gradient is a matmul over the batch, and the bias gradient sums it
    assert counter.operator(0).backward == (2 * 8 * 16 * 16 + 7 * 16, 0, 2 * 8 * 16 * 16)
    params = 4 * (16 * 16 + 16)
    assert counter.step(dp, mesh).update == 2 * params  # SGD: a multiply and an add, whole
    assert counter.step(fsdp(g, mesh), mesh).update == 2 * params / 8  # on the shards
    step = counter.step(dp, mesh)
    assert step.total == step.forward + step.backward + step.update == 2160 + 2577 + 2176
