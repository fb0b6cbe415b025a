"""Apply for an attention operator whose query sequence is split: context parallelism, as
the simulator prices it.

An attention operator (`soapjax.base.attention.flash_attention`, anchor ``attention``) whose config
splits its query sequence over some mesh axes runs its attention equation in `jax.shard_map`,
manual over every mesh axis (the batch's, the sequence's and the heads' as the config splits
them; a device whose query heads all use one key/value head slices it). The operator's other
equations (a rotary embedding's) run at their traced shapes under XLA's partitioner, where
iotas know their offsets. Inside, each device holds its block of queries and its block of the
keys and values, as their producers made them (every operator's sequence split alike,
Megatron's and Llama 3's layout), and computes its queries' attention at their true positions
(``axis_index x block + arange``: the causal mask needs them, and an ``iota`` at the shard's
shape would start every block at 0), in one of two forms:

* **gathered** (Llama 3's; the default): the keys and values gathered whole (``all_gather``,
  tiled). The gather's transpose is a reduce-scatter: their cotangents, partial sums over the
  query blocks, come back split along the sequence, one collective each, outside any loop.
  Causal attention is balanced as Megatron-Core and Llama 3 balance it: each device computes
  chunks i and 2 cp - 1 - i of the sequence's 2 cp (`soapjax.base.attention.zigzag_sends`: the
  halves of the query blocks sent there, the outputs sent back, one collective-permute per
  half each way), where with contiguous blocks the last device would compute 2 - 1/cp times
  the mean, and the step would wait for it;
* **ring** (`soapjax.strategy.space.Strategy.ring_attention`):
  `soapjax.base.attention.ring_attention`, the
  blocks passed around the ring with their positions, nothing gathered.

Left to XLA instead (the operator evaluated at its traced shapes under sharding constraints),
the keys' and values' cotangents are all-reduced inside the backward loop over key blocks,
once per block. Same numbers, more and smaller collectives than the simulator prices. That is
what runs inside pipeline stages (`soapjax.apply._pipelined`), which this module does not reach:
there the attention's queries are one block and every tile is computed
(`soapjax.base.attention.bind_attention`'s ``whole_queries``: blocks of queries, or a conditional
per tile, would have XLA gather the queries whole), unbalanced, and the simulator prices a
stage's split attention so (`soapjax.simulate._flatsim.Simulation`'s ``pipeline_stage``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from soapjax.base.attention import AttentionCall, bind_attention, ring_attention, zigzag_sends
from soapjax.graph._inner import attention_call_of, attention_unit, query_dims
from soapjax.graph.opgraph import Operator, OpGraph
from soapjax.strategy.space import Config

__all__ = ["ContextParallel", "context_parallel"]


class ContextParallel(NamedTuple):
    """How apply computes one sequence-split attention operator (`context_parallel`).

    Attributes:
      unit: the program unit of its attention equation.
      call: that equation's attention (causal, key block).
      attention: ``attention(call, q, k, v, q_pos, k_pos) -> out`` at the traced shapes: the
        equation in `jax.shard_map`, the keys and values gathered inside (for
        `soapjax.graph._local.operator_fn`'s ``attention``).
      operands: the sharding each of the operator's operands arrives in: its config's, with
        the keys' and values' sequence split like the queries'.
    """

    unit: int
    call: AttentionCall
    attention: Callable
    operands: tuple[NamedSharding, ...]

    def run_unit(self, q, k, v, q_pos, k_pos) -> list:
        """The attention equation's results (for `OpGraph.evaluate`'s ``units``)."""
        return [self.attention(self.call, q, k, v, q_pos, k_pos)]


def context_parallel(graph: OpGraph, op: Operator, cfg: Config, mesh: Mesh, *,
                     ring: bool = False) -> ContextParallel | None:
    """How apply computes attention operator `op` under context parallelism (module doc); None
    where `op` is no attention operator or its config keeps its queries whole.

    The operator's own equations around its attention (a rotary embedding's) run at their
    traced shapes under XLA's partitioner, where iotas know their offsets; only the attention
    equation runs in `jax.shard_map`. With `ring` (`Strategy.ring_attention`) it runs
    `soapjax.base.attention.ring_attention` there instead: nothing gathered, the key/value blocks
    passed around the ring with their positions.
    """
    j = graph.index(op.name)
    dims = query_dims(graph, j)
    if dims is None or not cfg.axes[dims.sequence]:
        return None
    batch, seq, heads = (tuple(cfg.axes[d]) if d is not None else ()
                         for d in (dims.batch, dims.sequence, dims.heads))
    n_heads, kv_heads = dims.heads_size, dims.kv_heads
    split = math.prod(mesh.shape[a] for a in heads)
    local_heads = n_heads // split
    if kv_heads % split == 0:
        kv_split = heads  # each device's query heads use its own block of key/value heads
    elif (n_heads // kv_heads) % local_heads == 0:
        kv_split = ()  # they all use one key/value head: sliced inside
    else:
        return None
    q_spec = PartitionSpec(batch or None, seq, heads or None, None)
    kv_spec = PartitionSpec(batch or None, seq, kv_split or None, None)

    def local(call: AttentionCall, q, k, v):
        if heads and not kv_split:  # the one key/value head this device's query heads use
            first = jax.lax.axis_index(heads) * local_heads // (n_heads // kv_heads)
            k, v = (jax.lax.dynamic_slice_in_dim(x, first, 1, axis=2) for x in (k, v))
        index = jax.lax.axis_index(seq)
        mine = index * q.shape[1] + jnp.arange(q.shape[1])
        if ring:
            theirs = index * k.shape[1] + jnp.arange(k.shape[1])
            pieces = 2 if q.shape[1] % 2 == 0 and k.shape[1] % 2 == 0 else 1
            axis = seq if len(seq) > 1 else seq[0]
            return ring_attention(q, k, v, mine, theirs, axis_name=axis, causal=call.causal,
                                  pieces=pieces)
        k = jax.lax.all_gather(k, seq, axis=1, tiled=True)
        v = jax.lax.all_gather(v, seq, axis=1, tiled=True)
        if call.causal and balanced(q.shape[1]):
            return _zigzagged(call, q, k, v, seq, index, cp)
        return bind_attention(call, q, k, v, mine, jnp.arange(k.shape[1]))

    cp = math.prod(mesh.shape[a] for a in seq)

    def balanced(block: int) -> bool:
        return cp > 1 and block % 2 == 0

    def gathered(call: AttentionCall, q, k, v, q_pos, k_pos):
        return jax.shard_map(functools.partial(local, call), mesh=mesh,
                             in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                             check_vma=False)(q, k, v)

    unit = attention_unit(graph, j)
    shardings = tuple(NamedSharding(mesh, _with_sequence(cfg.operand_axes(o.dims), o.dims,
                                                         dims.keys, seq)) for o in op.inputs)
    return ContextParallel(unit, attention_call_of(graph, j), gathered, shardings)


def _zigzagged(call: AttentionCall, q, k, v, seq: tuple[str, ...], index, cp: int
               ) -> jax.Array:
    """This device's output block of causal attention computed in `zigzag`'s layout: the
    halves of every device's query block sent to the devices that compute them
    (`soapjax.base.attention.zigzag_sends`), attended to the gathered keys and values at their
    positions, the outputs sent back. Each device then computes chunks i and 2 cp - 1 - i of
    the 2 cp, the same work everywhere, where device cp - 1 of contiguous blocks would do
    2 - 1/cp times the mean (Megatron-Core's and Llama 3's balancing; the simulator prices the
    balanced work, and these sends)."""
    axis = seq if len(seq) > 1 else seq[0]
    sends = zigzag_sends(cp)
    half = q.shape[1] // 2

    def move(x, pairs, back=False):
        if pairs is None:
            return x
        return jax.lax.ppermute(x, axis, [(b, a) for a, b in pairs] if back else list(pairs))

    lo, hi = jnp.split(q, 2, axis=1)
    q = jnp.concatenate([move(lo, sends.even), move(hi, sends.odd)], axis=1)
    chunks = jnp.asarray(sends.chunks)[index]
    positions = jnp.concatenate([chunks[0] * half + jnp.arange(half),
                                 chunks[1] * half + jnp.arange(half)])
    out = bind_attention(call, q, k, v, positions, jnp.arange(k.shape[1]))
    lo, hi = jnp.split(out, 2, axis=1)
    return jnp.concatenate([move(lo, sends.even, back=True), move(hi, sends.odd, back=True)],
                           axis=1)


def _with_sequence(axes: Sequence[tuple[str, ...]], dims: Sequence[int | None], k_dim: int,
                   seq: tuple[str, ...]) -> PartitionSpec:
    """An operand's config spec with its keys' sequence dim (`k_dim`) split over `seq`: it
    arrives split, as its producer made it, and is gathered inside (`attention_program`)."""
    return PartitionSpec(*((seq if d == k_dim else tuple(a)) or None
                           for a, d in zip(axes, dims)))
