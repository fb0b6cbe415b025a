"""The backward split in two (soapjax.apply._deferred): weight matmuls found in a layer
program, their deferred backward, and the weights' gradients computed from the stash, each
equal to ``jax.vjp``'s (the whole step: tests/test__pipelined.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from soapjax.apply._deferred import (
    WeightMatmul,
    deferred_dot,
    stash_of,
    stash_shapes,
    weight_grads,
    weight_matmuls,
)
from soapjax.graph._program import LayerScan, Program


def layer(x, w_in, w_out, scale, w_gate):
    """A layer as the zoo writes them: bfloat16 compute over float32 parameters (each kernel
    cast), a weight on the right and one on the left, two matmuls reading the same operand
    (a gate, as attention's q, k and v do), and a parameter read elementwise."""
    h = jnp.tanh(x @ w_in.astype(jnp.bfloat16)) * scale.astype(jnp.bfloat16)
    h = h * jax.nn.sigmoid(x @ w_gate.astype(jnp.bfloat16))
    return jnp.einsum("od,nd->no", w_out.astype(jnp.bfloat16), h)


def program_and_scan():
    x = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
    w_in = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    w_out = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    scale = jax.ShapeDtypeStruct((16,), jnp.float32)
    w_gate = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    prog = Program(jax.make_jaxpr(layer)(x, w_in, w_out, scale, w_gate))
    params = tuple(prog.inputs[1:])
    scan = LayerScan((), ((prog.inputs[0],), (prog.outputs[0],)), (params,), ((),), (0,), ())
    units = tuple(range(len(prog.units)))
    return prog, scan, units


def test_weight_matmuls_are_the_dots_that_read_a_cast_parameter():
    prog, scan, units = program_and_scan()
    found = weight_matmuls(prog, scan, units)
    # (einsum puts the weight second: its dot_general reads h, then w_out); the gate reads
    # the first matmul's operand, stashed once
    assert [(m.weight, m.param, m.cast, m.own_x) for m in found] == [
        (1, 0, jnp.float32, True), (1, 3, jnp.float32, False), (1, 1, jnp.float32, True)]
    assert [(m.stash_x, m.stash_dy) for m in found] == [(0, 1), (0, 2), (3, 4)]
    assert [s.shape for s in stash_shapes(prog, found)] == [(4, 8), (4, 16), (4, 16), (4, 16),
                                                            (4, 8)]


def test_the_deferred_backward_hands_on_x_and_dy_and_the_weights_get_their_gradients():
    """Per layer (stacked 3 deep, as a chunk runs them): the input's gradient from the
    deferred backward equals ``jax.vjp``'s, the weights get none there, and `weight_grads`
    from the stash equals ``jax.vjp``'s weight gradients (the same bfloat16 products, to
    bfloat16's rounding); the elementwise parameter keeps its gradient in the backward."""
    prog, scan, units = program_and_scan()
    found = weight_matmuls(prog, scan, units)
    dots = {m.unit: deferred_dot(prog.units[m.unit].eqn, m.weight, own_x=m.own_x)
            for m in found}
    rng = np.random.default_rng(0)
    depth = 3
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16)
    params = [jnp.asarray(rng.standard_normal((depth, 8, 16)), jnp.float32),
              jnp.asarray(rng.standard_normal((depth, 8, 16)), jnp.float32),
              jnp.asarray(rng.standard_normal((depth, 16)), jnp.float32),
              jnp.asarray(rng.standard_normal((depth, 8, 16)), jnp.float32)]
    dy = jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16)

    def run(x, ps, stash):
        def one(c, p_s):
            p, st = p_s
            env = dict(prog.consts)
            env.update(prog.literals)
            env.update(zip(scan.slices[0], p))
            env[prog.inputs[0]] = c
            calls = {m.unit: (lambda *a, m=m: [dots[m.unit](a[1 - m.weight], a[m.weight],
                                                           *stash_of(m, st))])
                     for m in found}
            prog.run_units(units, env, calls)
            return env[prog.outputs[0]], None
        return jax.lax.scan(one, x, (ps, stash))[0]

    def plain(x, ps):
        return jax.lax.scan(lambda c, p: (layer(c, *p), None), x, ps)[0]

    stash = [jnp.zeros((depth, *s.shape), s.dtype) for s in stash_shapes(prog, found)]
    out, vjp = jax.vjp(run, x, params, stash)
    want_out, want_vjp = jax.vjp(plain, x, params)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    dx, dparams, dstash = vjp(dy)
    want_dx, want_dparams = want_vjp(dy)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(want_dx, np.float32))
    assert not any(np.any(np.asarray(dparams[k])) for k in (0, 1, 3))
    np.testing.assert_array_equal(np.asarray(dparams[2]), np.asarray(want_dparams[2]))
    grads = weight_grads(prog, found, params, dstash)
    assert grads[2] is None
    for k in (0, 1, 3):  # to bfloat16's rounding: XLA drops the round trip f32 -> bf16 -> f32
        assert grads[k].dtype == jnp.float32  # of the reference's weight gradient (excess
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want_dparams[k]),
                                   rtol=2 ** -7, atol=2 ** -7)  # precision), not of ours


def test_a_weight_matmul_record_names_its_parts():
    m = WeightMatmul(unit=3, weight=1, param=0)
    assert m.cast is None and m.own_x and (m.stash_x, m.stash_dy) == (0, 1)
