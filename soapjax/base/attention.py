"""Attention as models call it and plans run it: flash attention, one operator of the graph,
and ring attention, context parallelism's second form.

**Flash attention** (`flash_attention`): ``softmax(q k^T / sqrt(H)) v`` over blocks of keys with
an online softmax, a custom VJP whose backward recomputes each block's scores, so no ``T x S``
array is ever whole in memory; grouped-query heads are served without a repeat. Its equation
(`attention_call` recognises it) becomes one *attention operator* of the graph, which splits
its batch, its query sequence and its heads; the kernel model prices it as one flash kernel
(`soapjax.cost.kernels.FlashKernel`), and apply runs it under context parallelism in
`jax.shard_map` (`soapjax.apply._context_parallel`).

**Context parallelism** splits a long sequence over a mesh axis of size ``cp``. Its all-gather
form (Llama 3's; a plan's default) keeps the queries local and gathers every key and value:
each device holds the whole sequence's keys and values and computes its ``T/cp x T`` block of
scores. Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"; a plan with `soapjax.strategy.space.Strategy.ring_attention`) keeps the keys
and values local too: in ``cp`` steps each device attends its queries to one block of keys and
values and hands that block to the next device (``jax.lax.ppermute``), combining the blocks'
results with the online softmax (a running maximum and sum per query, in float32 or wider).
Each device then holds the key/value blocks it has received and one ``T/cp x T/cp`` block of
scores, and the sends can overlap the blocks' computation.

`ring_attention` is the per-device program, called inside `jax.shard_map` manual over the ring's
axis. Which keys a query sees comes from position arrays that travel with the blocks, so any
layout of the sequence over the ring works: contiguous blocks (device i holds tokens
``[i T/cp, (i+1) T/cp)``), where causal attention leaves device i with i + 1/2 blocks to
compute and skips the rest (the last device does about 2 cp times the first's work, and the
ring waits for it: `ring_work`), or the zigzag layout of `zigzag` (device i holds chunks i and
2 cp - 1 - i of 2 cp), where every device computes the same amount (Megatron-Core's and Llama
3's load balancing). Sub-blocks a causal mask hides whole are skipped (`_attend`). Plans keep
every operator's sequence in contiguous blocks; the gathered form balances causal attention
inside the attention operator, each device computing zigzag's chunks (`zigzag_sends`: the
halves of its query block sent there, the output sent back); the ring runs the contiguous
blocks, unbalanced (`ring_work`).

The ring's backward pass is autodiff's: each step's block computation is a ``jax.checkpoint``
(the scores are recomputed, never kept), and the ppermutes transpose into ppermutes the other
way around the ring, carrying the keys' and values' cotangents home. Per device and attention
call the ring sends ``cp - 1`` key blocks, ``cp - 1`` value blocks and their positions forward,
and ``cp - 1`` cotangent blocks of each backward (`ring_sends`).

Example (8 devices, the sequence over all of them)::

    mesh = jax.make_mesh((8,), ("seq",))
    spec = jax.P(None, "seq")
    ring = jax.shard_map(lambda q, k, v, p: ring_attention(q, k, v, p, p, axis_name="seq"),
                         mesh=mesh, in_specs=(spec, spec, spec, jax.P("seq")), out_specs=spec)
    out = ring(q, k, v, jnp.arange(q.shape[1]))   # == causal attention of q, k, v
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["AttentionCall", "AttentionImplementation", "IMPLEMENTATIONS", "RingSends",
           "ZigzagSends", "analysis_jaxpr", "attention_call", "bind_attention", "cudnn_eligible",
           "flash_attention", "reference_attention", "ring_attention", "ring_sends", "ring_work",
           "unzigzag", "zigzag", "zigzag_sends"]


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        causal: bool = True) -> jax.Array:
    """``softmax(q k^T / sqrt(H)) v`` over ``[B, T, N, H]`` queries and ``[B, S, N, H]`` keys and
    values (``N`` heads each: repeat grouped key/value heads first), the softmax in float32 or
    wider, causal as ``query position >= key position`` where `causal`: the function
    `ring_attention` computes, written whole."""
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    if causal:
        mask = jnp.arange(q.shape[1])[:, None] >= jnp.arange(k.shape[1])[None, :]
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("BNTS,BSNH->BTNH", probs, v)


class _Partial(NamedTuple):
    """One query block's attention to the key blocks seen so far: the unnormalised output
    (``[B, T, N, H]``, float32 or wider), and per query the scores' running maximum and the sum
    of their exponentials (``[B, N, T]``)."""

    out: jax.Array
    top: jax.Array
    total: jax.Array


def _block(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
           causal: bool) -> _Partial:
    """The attention of one query block to one key/value block (``K`` key/value heads serving
    ``N`` query heads, K dividing N). A query none of whose keys it may see gets maximum
    ``finfo.min`` and weights exp(0) = 1 on every key, which `_merge` scales to nothing
    against any block it does see."""
    wide = jnp.promote_types(q.dtype, jnp.float32)
    b, t, n, _ = q.shape
    scores, mask = _grouped_scores(_grouped(q, k.shape[2]), k, q_pos, k_pos, causal)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(wide).min)
    top = jnp.max(scores, axis=-1)
    weights = jnp.exp(scores - top[..., None])
    if mask is not None:
        weights = jnp.where(mask, weights, 0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights.astype(v.dtype), v).astype(wide)
    return _Partial(out.reshape(b, t, n, v.shape[-1]), top.reshape(b, n, t),
                    jnp.sum(weights, axis=-1).reshape(b, n, t))


def _merge(a: _Partial, b: _Partial) -> _Partial:
    """Two partials of the same queries over disjoint key blocks, as one (the online softmax)."""
    top = jnp.maximum(a.top, b.top)
    sa, sb = jnp.exp(a.top - top), jnp.exp(b.top - top)
    return _Partial(a.out * _per_query(sa) + b.out * _per_query(sb), top,
                    a.total * sa + b.total * sb)


def _per_query(x: jax.Array) -> jax.Array:
    """``[B, N, T]`` per-query values as ``[B, T, N, 1]``, to scale an output block."""
    return jnp.moveaxis(x, 1, 2)[..., None]


def _skipped(q: jax.Array, k: jax.Array, v: jax.Array) -> _Partial:
    """The partial of a query block that sees none of a key block: contributes nothing. Its
    arrays carry the inputs' varying manual axes, as the computed branch's do (``lax.cond``
    inside `jax.shard_map` needs both branches' types alike)."""
    wide = jnp.promote_types(q.dtype, jnp.float32)
    b, t, n, _ = q.shape
    tie = _zero_of(q, k, v).astype(wide)
    zeros = jnp.zeros((b, n, t), wide) + tie
    return _Partial(jnp.zeros((b, t, n, v.shape[-1]), wide) + tie,
                    zeros + jnp.finfo(wide).min, zeros)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
            causal: bool, pieces: int) -> _Partial:
    """One ring step: this device's queries against the key/value block it holds, cut into
    ``pieces x pieces`` sub-blocks of which those a causal mask hides whole are skipped
    (``lax.cond``: each device takes its own branch). With contiguous blocks that skips the
    upper half of the diagonal block and every block from a later device; with `zigzag`'s
    layout half of every other step."""
    rows = []
    for qc, qp in zip(jnp.split(q, pieces, axis=1), jnp.split(q_pos, pieces)):
        acc = None
        for kc, vc, kp in zip(jnp.split(k, pieces, axis=1), jnp.split(v, pieces, axis=1),
                              jnp.split(k_pos, pieces)):
            if causal:
                part = jax.lax.cond(jnp.max(qp) >= jnp.min(kp),
                                    lambda a, b, c, d, e: _block(a, b, c, d, e, True),
                                    lambda a, b, c, d, e: _skipped(a, b, c),
                                    qc, kc, vc, qp, kp)
            else:
                part = _block(qc, kc, vc, qp, kp, False)
            acc = part if acc is None else _merge(acc, part)
        rows.append(acc)
    return _Partial(jnp.concatenate([r.out for r in rows], axis=1),
                    jnp.concatenate([r.top for r in rows], axis=2),
                    jnp.concatenate([r.total for r in rows], axis=2))


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                   k_positions: jax.Array, *, axis_name: str, causal: bool = True,
                   pieces: int = 2) -> jax.Array:
    """This device's block of ``softmax(q k^T / sqrt(H)) v``, the keys and values passed around
    the ring of `axis_name` (call it inside `jax.shard_map` manual over that axis).

    Args:
      q: this device's queries, ``[B, T/cp, N, H]``.
      k, v: this device's keys and values, ``[B, S/cp, K, H]``, K dividing q's heads N
        (grouped-query attention: query head n uses key/value head ``n // (N / K)``).
      q_positions, k_positions: the sequence positions of this device's queries and keys
        (``[T/cp]``, ``[S/cp]`` integers): the contiguous block's, or `zigzag`'s. Every query
        must see at least one key of its own device's block (self-attention: the query's own
        position).
      axis_name: the mesh axis the sequence is split over (size cp).
      causal: a query sees the keys at positions up to its own; else every key.
      pieces: each step's blocks are cut into ``pieces x pieces`` sub-blocks, and a causal
        mask's hidden ones skipped; it must divide both blocks' lengths.

    Returns:
      This device's output block, ``[B, T/cp, N, H]`` in v's dtype: exactly (up to rounding)
      `reference_attention` of the whole sequence, at this device's query positions.
    """
    if q.shape[1] % pieces or k.shape[1] % pieces:
        raise ValueError(f"ring_attention: pieces={pieces} must divide the query block "
                         f"({q.shape[1]}) and the key block ({k.shape[1]}); choose a divisor")
    cp = jax.lax.axis_size(axis_name)
    ring = [(i, (i + 1) % cp) for i in range(cp)]
    step = jax.checkpoint(_attend, static_argnums=(5, 6))
    acc = step(q, k, v, q_positions, k_positions, causal, pieces)
    for _ in range(cp - 1):
        # the next block is on its way while this one is computed (XLA overlaps the
        # collective-permute with the independent einsums)
        k, v, k_positions = jax.lax.ppermute((k, v, k_positions), axis_name, ring)
        acc = _merge(acc, step(q, k, v, q_positions, k_positions, causal, pieces))
    return (acc.out / _per_query(acc.total)).astype(v.dtype)


def ring_work(cp: int, pieces: int = 2) -> float:
    """The attention work of one causal `ring_attention` call over contiguous blocks, as a
    fraction of the whole ``T/cp x S`` block row a device would compute without a mask.

    The ring is synchronous: each step waits for its slowest device. At every step but the
    first some device holds a block it sees whole (device cp - 1 sees every block), and at the
    first each device computes its diagonal block less the ``pieces x pieces`` sub-blocks the
    mask hides whole: ``(cp - 1 + (pieces + 1) / (2 pieces)) / cp``, about twice the work of a
    balanced causal split (`zigzag`'s, or the gathered form's with Megatron's balancing).

    >>> ring_work(4)
    0.9375
    """
    return (cp - 1 + (pieces + 1) / (2 * pieces)) / cp


def zigzag(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """`x` with its `axis` (the sequence, of 2 cp chunks) reordered so that contiguous blocks of
    it over a ring of cp devices give device i chunks i and 2 cp - 1 - i: causal attention's
    work is then equal on every device. `unzigzag` undoes it."""
    n = x.shape[axis]
    if n % (2 * cp):
        raise ValueError(f"zigzag: a sequence of {n} does not cut into 2 x {cp} equal chunks; "
                         f"use a length that 2 x cp = {2 * cp} divides")
    order = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
    chunks = jnp.split(x, 2 * cp, axis=axis)
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def unzigzag(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """The inverse of `zigzag`."""
    order = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
    chunks = jnp.split(x, 2 * cp, axis=axis)
    back = [0] * (2 * cp)
    for j, c in enumerate(order):
        back[c] = j
    return jnp.concatenate([chunks[back[c]] for c in range(2 * cp)], axis=axis)


class ZigzagSends(NamedTuple):
    """How the gathered form's queries move to `zigzag`'s layout and their outputs back
    (`zigzag_sends`): each device's block is two chunks of the 2 cp, its first half (an even
    chunk) and its second (an odd one); ``even`` and ``odd`` are the `jax.lax.ppermute` pairs
    (source device, destination device) that take each half to the device that computes it,
    each None where it sends nothing (every half already there); ``chunks[d]`` the chunks
    device d computes, in the order it receives them: (the even one, the odd one)."""

    even: tuple[tuple[int, int], ...] | None
    odd: tuple[tuple[int, int], ...] | None
    chunks: tuple[tuple[int, int], ...]


def zigzag_sends(cp: int) -> ZigzagSends:
    """`ZigzagSends` over a ring of `cp` devices holding contiguous blocks.

    >>> zigzag_sends(2)  # device 0 computes chunks 0 and 3, device 1 chunks 2 and 1
    ZigzagSends(even=None, odd=((0, 1), (1, 0)), chunks=((0, 3), (2, 1)))
    """
    def owner(c: int) -> int:
        return c if c < cp else 2 * cp - 1 - c

    pairs = [tuple((d, owner(2 * d + h)) for d in range(cp)) for h in (0, 1)]
    got = [{dst: 2 * src + h for src, dst in pairs[h]} for h in (0, 1)]
    even, odd = (None if all(a == b for a, b in p) else p for p in pairs)
    return ZigzagSends(even, odd, tuple((got[0][d], got[1][d]) for d in range(cp)))


class RingSends(NamedTuple):
    """What one device sends in one ring attention call (`ring_sends`)."""

    forward: int  # collective-permutes in the forward pass (keys, values and key positions)
    forward_bytes: int
    backward: int  # and in the backward pass (the keys' and values' cotangents)
    backward_bytes: int


def ring_sends(k_block: jax.ShapeDtypeStruct, cp: int, position_itemsize: int = 4) -> RingSends:
    """The sends of `ring_attention` per device: forward, cp - 1 steps of the key block, the
    value block (each of `k_block`'s shape and dtype) and the key positions; backward, the
    transposed sends of the keys' and values' cotangents (the positions are integers: none).
    """
    import numpy as np

    kv = int(np.prod(k_block.shape)) * jnp.dtype(k_block.dtype).itemsize
    positions = k_block.shape[1] * position_itemsize
    steps = cp - 1
    return RingSends(forward=3 * steps, forward_bytes=steps * (2 * kv + positions),
                     backward=2 * steps, backward_bytes=steps * 2 * kv)


# --- flash attention: one operator of the graph, its s x s scores never kept -------------------


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                    block: int = 512, implementation: AttentionImplementation = "xla"
                    ) -> jax.Array:
    """``softmax(q k^T / sqrt(H)) v`` (`reference_attention`'s numbers, grouped-query heads
    served by their key/value head) computed as flash attention does: over blocks of `block`
    keys with an online softmax, saving for the backward pass only the inputs, the output and
    one log-sum-exp per query, and recomputing each block's scores in the backward pass. No
    ``T x S`` array is ever whole in memory.

    The graph (`soapjax.graph.opgraph.trace`) sees one *attention operator* (anchor ``attention``)
    whose dims are the queries' ``[B, T, N, H]``: batch, sequence (split: context parallelism,
    the keys and values gathered), heads (split: tensor parallelism); the keys' sequence and
    the head dim are not split. The simulator prices it as one fused kernel
    (`soapjax.cost.kernels.FlashKernel`) and keeps its inputs, its output and the log-sum-exp for
    the backward pass; apply runs a sequence-split one in `jax.shard_map`, the keys and
    values all-gathered or passed around a ring (`soapjax.apply._context_parallel`).

    Args:
      q: ``[B, T, N, H]`` queries.
      k, v: ``[B, S, K, H]`` keys and values, ``K`` dividing ``N``: query head ``n`` attends
        with key/value head ``n // (N / K)`` (grouped-query attention, no `jnp.repeat`).
      causal: query position ``t`` sees keys ``s <= t``.
      block: keys per block (the largest divisor of S not above it is used).
      implementation: ``"xla"``, the blockwise attention above, compiled by XLA on any
        backend; ``"cudnn"``, cuDNN's fused attention kernel
        (``jax.nn.dot_product_attention(..., implementation="cudnn")``) where it runs: on a
        GPU, for float16 or bfloat16, head dims at most 128 and a multiple of 8, as many keys
        as queries (`cudnn_eligible`); the blockwise attention anywhere else (a CPU that
        plans or tests, a float32 model), with the same numbers up to rounding. The graph
        sees the same attention operator either way. A plan that splits the sequence
        (context parallelism) runs the blockwise attention on each shard: cuDNN's kernel
        takes no positions. The kernel model prices the cuDNN kernel at the topology's
        ``cudnn_attention_efficiency``, where its sequence is whole (an H100 runs it about
        10 times as fast as the blockwise one, docs/accuracy.md).

    Forward-only evaluation (no gradient) runs the blockwise forward too; the graph reads the
    operator's dims from the attention written whole (`analysis_jaxpr`).
    """
    if q.ndim != 4 or k.shape != v.shape[:3] + k.shape[3:] or q.shape[2] % k.shape[2]:
        raise ValueError(f"flash_attention: expected q [B, T, N, H] and k, v [B, S, K, H] with "
                         f"K dividing N; found q {q.shape}, k {k.shape}, v {v.shape}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"flash_attention: implementation is {implementation!r}; expected one "
                         f"of {IMPLEMENTATIONS}")
    q_pos = jnp.arange(q.shape[1])
    k_pos = jnp.arange(k.shape[1])
    op = _attention_op(causal, _block_size(k.shape[1], block),
                       cudnn=implementation == "cudnn")
    return op(q, k, v, q_pos, k_pos)


# How an attention equation runs (`flash_attention`'s ``implementation``): soapjax's blockwise
# kernel through XLA, or cuDNN's fused one where it runs.
AttentionImplementation = Literal["xla", "cudnn"]
IMPLEMENTATIONS: tuple[AttentionImplementation, ...] = ("xla", "cudnn")


def cudnn_eligible(q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype) -> bool:
    """Whether cuDNN's fused attention runs an attention of ``[B, T, N, H]`` queries and
    ``[B, S, K, H]`` keys in `dtype` (on a GPU): float16 or bfloat16, ``H <= 128`` and a
    multiple of 8, ``T == S`` (so the causal mask is the plain lower triangle).

    >>> cudnn_eligible((2, 4096, 32, 128), (2, 4096, 8, 128), "bfloat16")
    True
    >>> cudnn_eligible((2, 4096, 32, 128), (2, 4096, 8, 128), "float32")
    False
    """
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and q_shape[-1] <= 128 and q_shape[-1] % 8 == 0 and q_shape[1] == k_shape[1])


def _cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _cudnn_here(q: jax.Array, k: jax.Array) -> bool:
    """cuDNN's kernel runs this call: the default backend is a GPU and the shapes suit it."""
    return jax.default_backend() == "gpu" and cudnn_eligible(q.shape, k.shape, q.dtype)


def _query_block(length: int, block: int, whole_queries: bool) -> int:
    """Queries per block: `block`'s largest divisor of the queries' length, or all of them
    (`bind_attention`'s ``whole_queries``)."""
    return length if whole_queries else _block_size(length, block)


def _block_size(length: int, block: int) -> int:
    b = max(1, min(block, length))
    while length % b:
        b -= 1
    return b


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[B, T, N, H]`` as ``[B, T, K, N / K, H]``: query heads by the key/value head they use."""
    b, t, n, h = q.shape
    return q.reshape(b, t, kv_heads, n // kv_heads, h)


def _grouped_scores(qg: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                    causal: bool) -> tuple[jax.Array, jax.Array | None]:
    """``q k^T / sqrt(H)`` (``[B, K, G, T, S]``, float32 or wider) and the causal mask."""
    wide = jnp.promote_types(qg.dtype, jnp.float32)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k) / jnp.sqrt(qg.shape[-1]).astype(qg.dtype)
    mask = q_pos[:, None] >= k_pos[None, :] if causal else None
    return scores.astype(wide), mask


def _per_grouped_query(x: jax.Array) -> jax.Array:
    """``[B, K, G, T]`` per-query values as ``[B, T, K, G, 1]``, to scale an output block."""
    return jnp.moveaxis(x, 3, 1)[..., None]


_OPS: dict[tuple[bool, int, bool, bool], object] = {}
_NAME = "soapjax_attention"


def _attention_op(causal: bool, block: int, whole_queries: bool = False, *,
                  cudnn: bool = False):
    """The custom-VJP attention for one (causal, block). Its primal body's name,
    ``soapjax_attention_causal_512`` (or ``_full_``; ``_cudnn`` after it for `cudnn`), is what
    the graph recognises and reads them back from (`attention_call`). With `whole_queries`,
    one block of all the queries (`bind_attention`). With `cudnn`, cuDNN's fused kernel
    where `_cudnn_here` (its positions are then the plain ``arange`` `flash_attention`
    makes), the blockwise attention elsewhere."""
    key = (causal, block, whole_queries, cudnn)
    if key in _OPS:
        return _OPS[key]

    def primal(q, k, v, q_pos, k_pos):  # blockwise even without a gradient
        if cudnn and _cudnn_here(q, k):
            return _cudnn_attention(q, k, v, causal)
        return _flash_forward(q, k, v, q_pos, k_pos, causal, block, whole_queries)[0]

    primal.__name__ = primal.__qualname__ = (
        f"{_NAME}_{'causal' if causal else 'full'}_{block}" + ("_cudnn" if cudnn else ""))
    op = jax.custom_vjp(primal)

    def fwd(q, k, v, q_pos, k_pos):
        if cudnn and _cudnn_here(q, k):  # cuDNN's own backward, through its VJP
            out, vjp = jax.vjp(lambda *a: _cudnn_attention(*a, causal), q, k, v)
            return out, (vjp,)
        out, lse = _flash_forward(q, k, v, q_pos, k_pos, causal, block, whole_queries)
        return out, (q, k, v, q_pos, k_pos, out, lse)

    def bwd(saved, g):
        if len(saved) == 1:
            return (*saved[0](g), None, None)
        q, k, v, q_pos, k_pos, out, lse = saved
        dq, dk, dv = _flash_backward(q, k, v, q_pos, k_pos, out, lse, g, causal, block,
                                     whole_queries)
        return dq, dk, dv, None, None

    op.defvjp(fwd, bwd)
    _OPS[key] = op
    return op


def _dense(q, k, v, q_pos, k_pos, causal: bool):
    """The attention written whole (``T x S`` scores): what the graph reads an attention
    equation's dims and FLOPs from (`analysis_jaxpr`)."""
    scores, mask = _grouped_scores(_grouped(q, k.shape[2]), k, q_pos, k_pos, causal)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(q.shape[:3] + v.shape[3:])


_ANALYSIS: dict[tuple, object] = {}


def analysis_jaxpr(eqn):
    """The jaxpr the graph analyses for a `flash_attention` equation (`attention_call`): the
    same function written whole (`_dense`) at the equation's operand shapes, whose einsums tie
    the queries', keys' and output's dims together; its primal body, the blockwise forward
    (a scan over key blocks), would hide them."""
    call = attention_call(eqn)
    body = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    invars = getattr(body, "jaxpr", body).invars
    if len(invars) != 5:  # not (q, k, v, q_pos, k_pos): a call jax folded to constants
        return body
    avals = tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in invars)
    key = (call, avals)
    if key not in _ANALYSIS:
        args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals]
        _ANALYSIS[key] = jax.make_jaxpr(
            lambda *a: _dense(*a, causal=call.causal))(*args)
    return _ANALYSIS[key]


def _kv_blocks(x: jax.Array, block: int) -> jax.Array:
    """``[B, S, ...]`` as ``[S / block, B, block, ...]`` (a scan over blocks of the sequence)."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape((b, s // block, block) + x.shape[2:]), 1, 0)


def _kv_unblocks(x: jax.Array) -> jax.Array:
    n, b, blk = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape((b, n * blk) + x.shape[3:])


def _per_query_blocks(x: jax.Array, block: int) -> jax.Array:
    """``[B, K, G, T]`` per-query values as ``[T / block, B, K, G, block]``."""
    b, kh, grp, t = x.shape
    return jnp.moveaxis(x.reshape(b, kh, grp, t // block, block), 3, 0)


def _per_query_unblocks(x: jax.Array) -> jax.Array:
    n, b, kh, grp, blk = x.shape
    return jnp.moveaxis(x, 0, 3).reshape(b, kh, grp, n * blk)


def _visible(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Whether any query of a block sees any key of a block under a causal mask: a tile it
    hides whole is skipped, as a flash kernel skips it (``lax.cond``, one branch run)."""
    return jnp.max(q_pos) >= jnp.min(k_pos)


def _zero_of(*xs) -> jax.Array:
    """A zero that depends on each of `xs` (a NaN or infinity among them included): a skipped
    tile's branch returns arrays of the same varying manual axes as the computed branch's
    inside `jax.shard_map`, and ``lax.cond`` needs both branches' types alike."""
    return sum(jnp.where(False, x.reshape(-1)[:1], 0).sum() for x in xs)


def _tied(x, *others):
    """`x` made to depend on `others` (`_zero_of`)."""
    tie = _zero_of(*others)
    return jax.tree.map(lambda a: a + tie.astype(a.dtype), x)


def _flash_forward(q, k, v, q_pos, k_pos, causal, block, whole_queries=False):
    """The blockwise forward: per block of `block` queries, the key blocks in turn with an
    online softmax, those a causal mask hides whole skipped (about half of ``T x S``); the
    output in v's dtype and the log-sum-exp per query (``[B, K, G, T]``, float32 or wider)."""
    wide = jnp.promote_types(q.dtype, jnp.float32)
    qg = _grouped(q, k.shape[2])
    b, t, kh, grp, _ = qg.shape
    bq = _query_block(t, block, whole_queries)
    kvs = (_kv_blocks(k, block), _kv_blocks(v, block), k_pos.reshape(-1, block))

    def tile(acc, qb, qp, kb, vb, pb):
        scores, mask = _grouped_scores(qb, kb, qp, pb, causal)
        if mask is not None:
            scores = jnp.where(mask, scores, -jnp.inf)
        top = jnp.maximum(acc.top, jnp.max(scores, axis=-1))
        safe = jnp.where(jnp.isfinite(top), top, 0)
        weights = jnp.exp(scores - safe[..., None])
        scale = jnp.exp(acc.top - safe)
        out = acc.out * _per_grouped_query(scale) + jnp.einsum(
            "BKGTS,BSKH->BTKGH", weights.astype(v.dtype), vb).astype(wide)
        return _Partial(out, top, acc.total * scale + jnp.sum(weights, axis=-1))

    def row(_, qblock):
        qb, qp = qblock
        init = _Partial(jnp.zeros((b, bq, kh, grp, v.shape[-1]), wide),
                        jnp.full((b, kh, grp, bq), -jnp.inf, wide),
                        jnp.zeros((b, kh, grp, bq), wide))

        def step(acc, kvp):
            kb, vb, pb = kvp
            if not causal or whole_queries:
                return tile(acc, qb, qp, kb, vb, pb), None
            return jax.lax.cond(_visible(qp, pb), tile,
                                lambda a, *xs: _tied(a, *xs),
                                acc, qb, qp, kb, vb, pb), None

        acc, _ = jax.lax.scan(step, init, kvs)
        return None, (acc.out / _per_grouped_query(acc.total), acc.top + jnp.log(acc.total))

    _, (out, lse) = jax.lax.scan(row, None, (_kv_blocks(qg, bq), q_pos.reshape(-1, bq)))
    out = _kv_unblocks(out).astype(v.dtype)
    return out.reshape(q.shape[:3] + v.shape[3:]), _per_query_unblocks(lse)


def _flash_backward(q, k, v, q_pos, k_pos, out, lse, g, causal, block, whole_queries=False):
    """The blockwise backward (flash attention's): per block of queries and per key block the
    scores are recomputed (tiles a causal mask hides whole skipped), the probabilities are
    ``exp(scores - lse)``; each query block's gradient is made over the key blocks, the keys'
    and values' accumulate over the query blocks (summed over the query heads each serves)."""
    wide = jnp.promote_types(q.dtype, jnp.float32)
    kh = k.shape[2]
    qg, gg, og = _grouped(q, kh), _grouped(g.astype(v.dtype), kh), _grouped(out, kh)
    bq = _query_block(q.shape[1], block, whole_queries)
    scale = 1 / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    delta = jnp.moveaxis(jnp.sum(gg.astype(wide) * og.astype(wide), axis=-1), 1, 3)
    kvs = (_kv_blocks(k, block), _kv_blocks(v, block), k_pos.reshape(-1, block))

    def tile(dq, dkb, dvb, qb, gb, lb, db, qp, kb, vb, pb):
        scores, mask = _grouped_scores(qb, kb, qp, pb, causal)
        probs = jnp.exp(scores - lb[..., None])
        if mask is not None:
            probs = jnp.where(mask, probs, 0)
        dvb = dvb + jnp.einsum("BKGTS,BTKGH->BSKH", probs.astype(v.dtype), gb).astype(wide)
        dprobs = jnp.einsum("BTKGH,BSKH->BKGTS", gb, vb).astype(wide)
        dscores = (probs * (dprobs - db[..., None])).astype(q.dtype) * scale
        dq = dq + jnp.einsum("BKGTS,BSKH->BTKGH", dscores, kb).astype(wide)
        dkb = dkb + jnp.einsum("BKGTS,BTKGH->BSKH", dscores, qb).astype(wide)
        return dq, dkb, dvb

    def row(dkv, qblock):
        qb, gb, lb, db, qp = qblock

        def step(dq, kvp):
            kb, vb, pb, dkb, dvb = kvp
            args = (dq, dkb, dvb, qb, gb, lb, db, qp, kb, vb, pb)
            if not causal or whole_queries:
                dq, dkb, dvb = tile(*args)
            else:
                dq, dkb, dvb = jax.lax.cond(_visible(qp, pb), tile,
                                            lambda *a: _tied(a[:3], *a[3:]), *args)
            return dq, (dkb, dvb)

        dq, dkv = jax.lax.scan(step, jnp.zeros(qb.shape, wide), kvs + dkv)
        return dkv, dq

    (dk, dv), dq = jax.lax.scan(
        row, (jnp.zeros(kvs[0].shape, wide), jnp.zeros(kvs[1].shape, wide)),
        (_kv_blocks(qg, bq), _kv_blocks(gg, bq), _per_query_blocks(lse, bq),
         _per_query_blocks(delta, bq), q_pos.reshape(-1, bq)))
    return (_kv_unblocks(dq).reshape(q.shape).astype(q.dtype), _kv_unblocks(dk).astype(k.dtype),
            _kv_unblocks(dv).astype(v.dtype))


class AttentionCall(NamedTuple):
    """What a `flash_attention` equation computes (`attention_call`)."""

    causal: bool
    block: int
    implementation: AttentionImplementation = "xla"  # `flash_attention`'s


def attention_call(eqn) -> AttentionCall | None:
    """The `flash_attention` a jaxpr equation is (a ``custom_vjp_call`` whose primal body is
    ``soapjax_attention_*``), or None for any other equation."""
    if eqn.primitive.name not in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
        return None
    body = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    info = getattr(getattr(body, "jaxpr", body), "debug_info", None)
    name = (getattr(info, "func_src_info", None) or "").split(" ", 1)[0]
    cudnn = name.endswith("_cudnn")
    parts = name.removesuffix("_cudnn").rsplit("_", 2)
    if len(parts) != 3 or parts[0] != _NAME or parts[1] not in ("causal", "full"):
        return None
    return AttentionCall(parts[1] == "causal", int(parts[2]), "cudnn" if cudnn else "xla")


def bind_attention(call: AttentionCall, q: jax.Array, k: jax.Array, v: jax.Array,
                   q_pos: jax.Array, k_pos: jax.Array, *, whole_queries: bool = False
                   ) -> jax.Array:
    """The attention equation `call` again, at these operands' shapes (a shard's): its rule is
    soapjax's own, so unlike a user's custom rule it can be traced at any shape. The key
    block is the largest divisor of the keys' length not above the traced one. It is always
    the blockwise attention, which takes the positions it is given (a shard's, a ring
    step's); cuDNN's kernel (``call.implementation``) would take only ``arange``'s.

    With `whole_queries`, all the queries are one block and every tile is computed (no
    ``lax.cond``), so XLA's partitioner can split the queries' sequence: a loop over blocks of
    queries it runs whole on every device, and a conditional's operands it gathers, the
    queries all-gathered either way (a pipeline stage's context parallelism:
    `soapjax.apply._pipelined`)."""
    op = _attention_op(call.causal, _block_size(k.shape[1], call.block), whole_queries)
    return op(q, k, v, q_pos, k_pos)
