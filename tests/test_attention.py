"""Ring attention (`soapjax.base.attention`) on cpu8: the float64 output and gradients of whole
causal attention, with the sequence over a ring of 8 or of 4 (the batch over the other axis)
or on one device, in contiguous blocks or zigzag; and the compiled step's collective-permutes,
as `ring_sends` counts them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from test_corpus import FAST_COMPILE, X64_TOL, relative_error

from soapjax.base.attention import reference_attention, ring_attention, ring_sends, unzigzag, zigzag
from soapjax.measure import hlo
from soapjax.strategy.space import MeshShape

SHAPE = (2, 64, 4, 8)  # [B, T, N, H]


def _mesh(ring: int):
    """The sequence over a ring of 8 (every device), 4 (the batch over ``data``) or 1 (one
    device: the blockwise computation alone, no sends)."""
    if ring == 1:
        return jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:1])
    axes = ("seq",) if ring == 8 else ("data", "seq")
    sizes = (8,) if ring == 8 else (2, 4)
    return jax.make_mesh(sizes, axes, axis_types=(AxisType.Auto,) * len(axes))


@functools.cache
def _inputs():
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(0), 3)
        return tuple(jax.random.normal(k, SHAPE, jnp.float64) for k in keys)


def _ring(ring: int, causal: bool):
    """Ring attention of the whole arrays (already in the ring's layout, with their positions):
    the sequence over ``seq``, the batch over ``data`` where the mesh has it."""
    mesh = _mesh(ring)
    batch = "data" if "data" in mesh.axis_names else None
    spec = jax.P(batch, "seq")
    return jax.shard_map(
        lambda q, k, v, p: ring_attention(q, k, v, p, p, axis_name="seq", causal=causal),
        mesh=mesh, in_specs=(spec, spec, spec, jax.P("seq")), out_specs=spec)


def _loss(fn):
    return lambda q, k, v, *pos: jnp.sum(fn(q, k, v, *pos) ** 2)


@pytest.mark.parametrize("ring,layout,causal", [
    (8, "contiguous", True), (8, "zigzag", True), (4, "contiguous", True), (4, "zigzag", True),
    (8, "contiguous", False), (1, "contiguous", True)])
def test_ring_attention_is_attention(ring, layout, causal):
    q, k, v = _inputs()
    with jax.enable_x64(True):
        pos = jnp.arange(SHAPE[1])
        want = reference_attention(q, k, v, causal=causal)
        want_grads = jax.grad(_loss(functools.partial(reference_attention, causal=causal)),
                              (0, 1, 2))(q, k, v)
        if layout == "zigzag":  # the data laid out once, as a data loader would
            q, k, v = (zigzag(x, ring) for x in (q, k, v))
            pos = zigzag(pos, ring, axis=0)
        fn = _ring(ring, causal)
        got = jax.jit(fn, compiler_options=FAST_COMPILE)(q, k, v, pos)
        grads = jax.jit(jax.grad(_loss(fn), (0, 1, 2)), compiler_options=FAST_COMPILE)(
            q, k, v, pos)
        if layout == "zigzag":
            got, grads = unzigzag(got, ring), [unzigzag(g, ring) for g in grads]
    assert relative_error(got, want) <= X64_TOL
    assert relative_error(list(grads), list(want_grads)) <= X64_TOL


@pytest.mark.parametrize("ring", [8, 4])
def test_the_compiled_ring_sends_what_ring_sends_counts(ring):
    """Forward: cp - 1 steps of the keys, the values and the key positions, one
    collective-permute each; backward: the keys' and values' cotangents, back around the ring.
    Nothing else is communicated (the batch over ``data`` needs nothing)."""
    q, k, v = _inputs()
    with jax.enable_x64(True):
        pos = jnp.arange(SHAPE[1], dtype=jnp.int32)
        text = jax.jit(jax.grad(_loss(_ring(ring, True)), (0, 1, 2)),
                       compiler_options=FAST_COMPILE).lower(q, k, v, pos).compile().as_text()
    mesh = _mesh(ring)
    found = hlo.collectives(text, MeshShape.of(mesh))
    kinds = {c.kind for c in found}
    assert kinds == {"collective-permute"}, kinds
    sends = sum(len(c.shapes) * c.executions for c in found)
    nbytes = sum(c.nbytes * c.executions for c in found)
    block = jax.ShapeDtypeStruct((SHAPE[0] // (8 // ring), SHAPE[1] // ring, *SHAPE[2:]),
                                 jnp.float64)
    want = ring_sends(block, ring)
    assert sends == want.forward + want.backward == 5 * (ring - 1)
    assert nbytes == want.forward_bytes + want.backward_bytes


def test_zigzag_gives_each_device_a_chunk_from_each_end():
    x = jnp.arange(16)
    assert zigzag(x, 4, axis=0).tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7,
                                             8, 9]
    assert (unzigzag(zigzag(x, 4, axis=0), 4, axis=0) == x).all()
    with pytest.raises(ValueError, match=r"zigzag: a sequence of 12 does not cut into 2 x 4 "
                       r"equal chunks"):
        zigzag(jnp.arange(12), 4, axis=0)


def test_pieces_must_divide_the_blocks():
    q = jnp.zeros((1, 6, 2, 4))
    fn = jax.shard_map(lambda q, p: ring_attention(q, q, q, p, p, axis_name="seq", pieces=4),
                       mesh=jax.make_mesh((2,), ("seq",), axis_types=(AxisType.Auto,),
                                          devices=jax.devices()[:2]),
                       in_specs=(jax.P(None, "seq"), jax.P("seq")), out_specs=jax.P(None, "seq"))
    with pytest.raises(ValueError, match=r"pieces=4 must divide the query block \(3\)"):
        fn(q, jnp.arange(6))


def test_reference_attention_is_the_zoos():
    from soapjax_zoo.workload import causal_attention
    q, k, v = _inputs()
    with jax.enable_x64(True):
        np.testing.assert_allclose(reference_attention(q, k, v), causal_attention(q, k, v),
                                   rtol=1e-14)


def test_flash_attention_never_holds_the_scores_whole():
    """Forward-only evaluation runs blockwise too (no gradient: the custom VJP's primal body):
    no value of its jaxpr, nested bodies included, is as large as one head's ``T x S``
    scores; the graph reads the attention written whole (`analysis_jaxpr`), whose scores
    are ``[B, K, G, T, S]``."""
    from jax.extend import core as jcore

    from soapjax.base.attention import analysis_jaxpr, flash_attention

    t, block = 256, 32
    q = jax.ShapeDtypeStruct((1, t, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)
    closed = jax.make_jaxpr(lambda q, k, v: flash_attention(q, k, v, block=block))(q, kv, kv)

    def sizes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (np.prod(v.aval.shape) for v in eqn.outvars)
            for sub in jcore.jaxprs_in_params(eqn.params):
                yield from sizes(sub)

    assert max(sizes(closed.jaxpr)) < t * t
    call = next(e for e in closed.jaxpr.eqns if e.primitive.name == "custom_vjp_call")
    dense = analysis_jaxpr(call)
    assert max(sizes(dense.jaxpr)) == 1 * 2 * 2 * t * t


def test_flash_attention_skips_the_tiles_a_causal_mask_hides():
    """A tile of queries and keys that a causal mask hides whole is never computed, as a flash
    kernel skips it (about half of ``T x S``: what `soapjax.cost.kernels.FlashKernel` prices):
    keys and values that are NaN in the last key block poison only the queries that see it,
    their outputs and, backward, their gradients; computed and masked, ``0 x NaN`` would poison
    every query."""
    from soapjax.base.attention import flash_attention

    t, block = 64, 16
    q, k, v = (jax.random.normal(jax.random.key(i), (1, t, 4, 8)) for i in range(3))
    k, v = (x[:, :, :2].at[:, t - block:].set(jnp.nan) for x in (k, v))  # GQA: 2 kv heads
    seen = t - block  # the queries that never see the last key block
    out, dq = jax.value_and_grad(
        lambda q: flash_attention(q, k, v, block=block)[:, :seen].sum())(q)
    assert np.isfinite(out) and np.isfinite(dq[:, :seen]).all()
    full = flash_attention(q, k, v, block=block)
    assert np.isfinite(full[:, :seen]).all() and np.isnan(full[:, seen:]).all()
    # the same attention without its mask computes every tile
    assert np.isnan(flash_attention(q, k, v, causal=False, block=block)).all()


def test_zigzag_sends_balance_the_gathered_forms_causal_tiles():
    """Under the gathered form each device attends its queries to the whole sequence; causal
    tiles it computes (tiles of 8, `flash_attention` skips the rest): with contiguous blocks
    device i computes 2i + 1 of every 2 cp units of work, with `zigzag_sends`' chunks every
    device the same; each device receives one even and one odd chunk, and every chunk goes
    to exactly one device."""
    from soapjax.base.attention import zigzag_sends

    cp, t, tile = 4, 128, 8
    half = t // cp // 2

    def tiles(positions):
        q = np.asarray(positions).reshape(-1, tile)
        k = np.arange(t).reshape(-1, tile)
        return sum(int(qb.max() >= kb.min()) for qb in q for kb in k)

    sends = zigzag_sends(cp)
    chunks = [c for pair in sends.chunks for c in pair]
    assert sorted(chunks) == list(range(2 * cp))
    assert all(a % 2 == 0 and b % 2 == 1 for a, b in sends.chunks)
    balanced = {tiles(np.concatenate([np.arange(c * half, (c + 1) * half) for c in pair]))
                for pair in sends.chunks}
    contiguous = [tiles(np.arange(d * t // cp, (d + 1) * t // cp)) for d in range(cp)]
    mean = sum(contiguous) / cp
    assert balanced == {mean}
    assert max(contiguous) / mean == pytest.approx(1.75, rel=0.05)  # 2 - 1/cp
