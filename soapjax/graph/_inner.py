"""Reductions inside an operator that a split turns into collectives of their own.

A config splits an operator's iteration dims over mesh axes. Splitting a reduction (``R``) dim
leaves partial sums that one all-reduce of the output completes after the operator
(`Config.reduction_axes`; the simulator's partial-sum task). Some reductions cannot wait for
the output:

* a reduction over a dim the output keeps: a layer norm's mean and mean square over the
  hidden dim, a softmax's max and sum over the keys. Split that dim and every device needs the
  whole statistic before it can normalise its part, so XLA all-reduces the statistic inside
  the operator (f32[B, T] for a layer norm over [B, T, D]). The backward pass reduces over the
  dim again, where the statistic was broadcast back along it: one more all-reduce per
  differentiable statistic (the sum, not the max);
* a reduction over an ``R`` dim whose result is used non-linearly before the output: the max
  and the sum of a cross-entropy's log-sum-exp over a vocabulary split across devices. A sum
  that reaches the output through linear steps only (the cross-entropy's final mean) stays a
  partial sum.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from soapjax.graph.opgraph import trace
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(64, name="fc")(nn.LayerNorm(name="ln")(x))
    >>> x = jnp.ones((8, 16, 64))
    >>> params = Block().init(jax.random.key(0), x)
    >>> graph = trace(lambda p, x: jnp.mean(Block().apply(p, x) ** 2), params, x)
    >>> ln = graph.index("ln")                      # iteration dims [B, T, D]: D is dim 2
    >>> [(r.primitive, r.reduced, r.shape, r.backward) for r in inner_reductions(graph, ln)]
    [('reduce_sum', (2,), (8, 16), True), ('reduce_sum', (2,), (8, 16), True)]
    >>> inner_reductions(graph, graph.index("fc"))  # a matmul's sum: the output's partial sum
    ()

`inner_reductions` finds them in the operator's own equations (`soapjax.graph._program`): what each
reduces (iteration dims), the statistic's shape and dtype and which iteration dim indexes each
of its dims. The simulator prices one all-reduce of the statistics over the axes that split
the reduced dims (`soapjax.simulate.front`). Only the operator's own equations are read, not the
bodies of its loops (an LSTM's scan): a reduction inside a loop is not found.

The backward pass has one more: an operand's cotangent that is a partial sum (a config splits
a dim the operand lacks) is made by the transposed matmul, at the shape the matmul reads. When
the operator computes on the operand first (attention's rotary embedding and GQA's repeat of
the key and value heads, between the gathered keys and the scores' matmul), XLA all-reduces
the cotangent there, whole, runs that computation's backward on the whole, and only then
slices the operand's part: one all-reduce of the matmul's operand, not a reduce-scatter of
the operator's (the tiny llama under context parallelism; docs/xla-workarounds.md).
`matmul_operands` says, per operand, what the matmul reads in its place, where that is not the
operand itself up to layout and dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from soapjax.base.attention import attention_call
from soapjax.graph._ir import Convolution, read_convolutions
from soapjax.graph.opgraph import OpGraph

# Primitives that reduce axes of their first operand (`axes`), and dot_general's contraction.
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                     "argmin", "reduce_and", "reduce_or", "reduce_xor"})
_DIFFERENTIABLE = frozenset({"reduce_sum", "reduce_prod", "dot_general"})
# Linear in any one operand: a partial sum through them is still a partial sum of the result.
_LINEAR = frozenset({"add", "add_any", "sub", "neg", "reduce_sum", "convert_element_type",
                     "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
                     "copy", "copy_p", "stop_gradient", "slice", "concatenate", "pad",
                     "select_n", "dot_general", "mul", "div", "reduce_precision"})


class InnerReduction(NamedTuple):
    """One statistic an operator reduces inside itself (see the module docstring).

    Attributes:
      primitive: the reducing primitive (``reduce_sum``, ``reduce_max``, ``dot_general``, ...).
      reduced: the iteration dims it reduces over; splitting any all-reduces the statistic.
      shape, dtype: the statistic's global shape and dtype.
      dims: per dim of the statistic, the iteration dim it follows (None: none).
      backward: whether the backward pass all-reduces it again (a differentiable statistic
        over a dim the output keeps).
    """

    primitive: str
    reduced: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]
    backward: bool


def inner_reductions(graph: OpGraph, j: int) -> tuple[InnerReduction, ...]:
    """The reductions inside operator `j` that a split of their dims makes collective."""
    return graph.memo(("inner_reductions", j), lambda: _find(graph, j))


def _find(graph: OpGraph, j: int) -> tuple[InnerReduction, ...]:
    op = graph.operators[j]
    prog = graph.program
    loc = prog.local.get(op.name)
    if loc is None:
        return ()
    n_out = len(op.shape)
    units = [prog.units[i] for i in loc.units]
    exports = set(loc.exports)

    out = []
    for k, u in enumerate(units):
        name = u.eqn.primitive.name
        if name not in _REDUCE and name != "dot_general":
            continue
        result = u.outs[0]
        if result is None or result in exports or result not in loc.lab or not u.ins:
            continue
        if name == "dot_general":
            (axes, _), _ = u.eqn.params["dimension_numbers"]
        else:
            axes = u.eqn.params.get("axes", ())
        src = loc.dims_of(u.ins[0])
        reduced = tuple(sorted({src[a] for a in axes if a < len(src) and src[a] is not None}))
        if not reduced:
            continue
        kept = any(d < n_out for d in reduced)  # over a dim the output keeps
        if not kept and (name == "dot_general" or _linear_to_output(units[k + 1:], result)):
            continue  # a partial sum the output's all-reduce completes
        used = [w for w in units[k + 1:] if result in w.ins]
        differentiable = name in _DIFFERENTIABLE and any(
            w.eqn.primitive.name != "stop_gradient" for w in used)
        out.append(InnerReduction(name, reduced, tuple(prog.shapes[result]),
                                  prog.dtypes[result], loc.dims_of(result),
                                  kept and differentiable))
    return tuple(out)


def _linear_to_output(later, value: int) -> bool:
    """Whether every use of `value` in the equations `later` (in order) is linear in it, up to
    the operator's outputs: a sum of partial results is then the partial result of the sum."""
    depends = {value}
    for u in later:
        hit = [i for i, v in enumerate(u.ins) if v in depends]
        if not hit:
            continue
        name = u.eqn.primitive.name
        if name not in _LINEAR:
            return False
        if name in ("mul", "dot_general") and len(hit) > 1:
            return False  # a product of two partial sums
        if name == "select_n" and 0 in hit:
            return False  # the partial sum decides which branch
        if name == "div" and hit != [0]:
            return False  # divided by a partial sum
        depends.update(v for v in u.outs if v is not None)
    return True


# Change only the layout or the dtype: the partitioner slices a reduced cotangent through them.
_LAYOUT = frozenset({"reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p",
                     "convert_element_type", "reduce_precision"})


# What makes an operand's partial cotangent: its transpose reads the cotangent of what it read.
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


class MatmulOperand(NamedTuple):
    """The value a matmul reads in an operand's place, where the operator computes on the
    operand first (see the module docstring).

    Attributes:
      shape, dtype: its global shape and dtype.
      dims: per dim, the iteration dim it follows (None: none).
    """

    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]


def matmul_operands(graph: OpGraph, j: int) -> tuple[MatmulOperand | None, ...]:
    """Per input of operator `j`, what its first matmul (``dot_general``, or a convolution)
    reads in the input's place when that is computed from the input by more than layout and
    dtype changes (a rotary embedding, a repeat, the half of the channels a coupling layer's
    convolution reads); None where the matmul reads the input itself, or none does.

    >>> import jax.numpy as jnp
    >>> from soapjax.graph.opgraph import trace
    >>> def f(p, x):  # x [4, 8]: sin, repeated to [4, 16], then a matmul; and x itself
    ...     y = jnp.repeat(jnp.sin(x), 2, axis=1)
    ...     return jnp.sum(y @ p["w"]) + jnp.sum(x @ p["v"])
    >>> g = trace(f, {"w": jnp.ones((16, 3)), "v": jnp.ones((8, 2))}, jnp.ones((4, 8)))
    >>> [[m.shape if m else None for m in matmul_operands(g, j)] for j in range(2)]
    [[(4, 16), None], [None, None, None]]
    """
    return graph.memo(("matmul_operands", j), lambda: _matmul_operands(graph, j))


def _matmul_operands(graph: OpGraph, j: int) -> tuple[MatmulOperand | None, ...]:
    op = graph.operators[j]
    prog = graph.program
    loc = prog.local.get(op.name)
    if loc is None:
        return (None,) * len(op.inputs)
    units = [prog.units[i] for i in loc.units]
    out = []
    for vid in loc.inputs:
        found = None
        reached = {vid: False}  # value -> computed from the input by more than layout?
        for u in units:
            hit = [v for v in u.ins if v in reached]
            if not hit:
                continue
            if u.eqn.primitive.name in _MATMULS:
                if reached[hit[0]] and hit[0] in loc.lab:
                    found = MatmulOperand(
                        tuple(prog.shapes[hit[0]]), prog.dtypes[hit[0]],
                        loc.dims_of(hit[0]))
                break
            moved = any(reached[v] for v in hit) or u.eqn.primitive.name not in _LAYOUT
            reached.update((v, moved) for v in u.outs if v is not None)
        out.append(found)
    return tuple(out)


class PartialSum(NamedTuple):
    """A matmul's result whose partial sums are reduced inside its operator
    (`partial_sum_value`).

    Attributes:
      shape, dtype: its global shape and dtype.
      dims: per dim, the iteration dim it follows.
      summed: the iteration dims the matmul contracts: the axes splitting them leave the
        partial sums.
    """

    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]
    summed: tuple[int, ...]


def partial_sum_value(graph: OpGraph, j: int) -> PartialSum | None:
    """Where operator `j`'s one matmul sums over a dim its output lacks and uses the sum
    non-linearly before the output (a GLU: one Dense to twice the width, cut in halves, one
    gating the other by a sigmoid), the matmul's result: a split of that dim leaves partial
    sums XLA all-reduces there, at the result's shape, not at the output's (the corpus
    sparsemax TabNet's gate: ``f32[8,32]``, not its output's ``f32[8,16]``; tied logits
    reduced to a loss). None where the sum reaches the output linearly, where the result is
    as large as the output (a Dense, its bias and activation), where a dim of it follows no
    iteration dim (a fused projection's columns), or where the operator has other matmuls
    (attention's scores and values) or other outputs (DiT's adaLN Dense, cut six ways for
    six readers, each reduced where it is read).

    >>> import jax, jax.numpy as jnp
    >>> from soapjax.graph.opgraph import trace
    >>> def glu(w, x):
    ...     a, b = jnp.split(x @ w, 2, axis=-1)
    ...     return jnp.sum(a * jax.nn.sigmoid(b))
    >>> g = trace(glu, jnp.ones((12, 32)), jnp.ones((8, 12)))
    >>> partial_sum_value(g, 0).shape
    (8, 32)
    """
    return graph.memo(("partial_sum_value", j), lambda: _partial_sum_value(graph, j))


def _partial_sum_value(graph: OpGraph, j: int) -> PartialSum | None:
    op = graph.operators[j]
    prog = graph.program
    loc = prog.local.get(op.name)
    if loc is None:
        return None
    units = [prog.units[i] for i in loc.units]
    matmuls = [k for k, u in enumerate(units) if u.eqn.primitive.name == "dot_general"]
    if len(matmuls) != 1 or len(op.outputs) != 1:
        return None
    k = matmuls[0]
    result = units[k].outs[0]
    if (result is None or result not in loc.lab or result in set(loc.exports)
            or math.prod(prog.shapes[result]) == math.prod(op.outputs[0].shape)
            or _linear_to_output(units[k + 1:], result)):
        return None

    dims = loc.dims_of(result)
    if any(d is None and size > 1 for d, size in zip(dims, prog.shapes[result])):
        return None
    (contracted, _), _ = units[k].eqn.params["dimension_numbers"]
    lhs = loc.dims_of(units[k].ins[0])
    summed = tuple(sorted({lhs[a] for a in contracted if a < len(lhs) and lhs[a] is not None}))
    return PartialSum(tuple(prog.shapes[result]), prog.dtypes[result], dims, summed)


class QueryDims(NamedTuple):
    """Which iteration dims of an attention operator its attention equation's queries
    ``[B, T, N, H]`` and keys ``[B, S, K, H]`` follow (`query_dims`)."""

    batch: int | None
    sequence: int
    heads: int | None
    keys: int  # the keys' sequence: a reduction dim
    heads_size: int  # N
    kv_heads: int  # K


def query_dims(graph: OpGraph, j: int) -> QueryDims | None:
    """`QueryDims` of operator `j` where it is an attention operator (anchor ``attention``,
    `soapjax.base.attention.flash_attention`), read from the operands of its attention equation;
    None for any other."""
    return graph.memo(("query_dims", j), lambda: _query_dims(graph, j))


def _query_dims(graph: OpGraph, j: int) -> QueryDims | None:
    i = attention_unit(graph, j)
    if i is None:
        return None
    prog, loc = graph.program, graph.program.local[graph.operators[j].name]
    u = prog.units[i]
    q, k = ([loc.labels.lookup(x, loc.iter_of) for x in loc.lab[v]] for v in u.ins[:2])
    if q[1] is None or k[1] is None:
        return None
    # the heads: the output's (its equation regroups the query heads by key/value head,
    # which hides them from the labels; `_grouping.attention_heads`)
    return QueryDims(q[0], q[1], 2, k[1], prog.shapes[u.ins[0]][2], prog.shapes[u.ins[1]][2])


def splits_queries(graph: OpGraph, configs: Sequence[Any]) -> bool:
    """Whether `configs` (`soapjax.strategy.space.Config`s, one per operator) split some attention
    operator's query sequence: context parallelism."""
    return any((dims := query_dims(graph, j)) is not None and cfg.axes[dims.sequence]
               for j, cfg in enumerate(configs))


def attention_unit(graph: OpGraph, j: int) -> int | None:
    """The program unit of attention operator `j`'s attention equation (None for another
    operator)."""
    if graph.operators[j].anchor != "attention":
        return None
    prog = graph.program
    return next((i for i in prog.local[graph.operators[j].name].units
                 if attention_call(prog.units[i].eqn) is not None), None)


def attention_call_of(graph: OpGraph, j: int):
    """The `soapjax.base.attention.AttentionCall` of attention operator `j` (None for another)."""
    i = attention_unit(graph, j)
    return None if i is None else attention_call(graph.program.units[i].eqn)


def convolutions(graph: OpGraph, j: int) -> tuple[Convolution, ...]:
    """Operator `j`'s convolution equations (those built from constants alone left out: they
    are computed whole)."""
    return graph.memo(("convolutions", j), lambda: _convolutions(graph, j))


def _convolutions(graph: OpGraph, j: int) -> tuple[Convolution, ...]:
    loc = graph.program.local[graph.operators[j].name]
    return read_convolutions(loc.units, graph.program.units, loc.lab,
                             lambda x: loc.labels.lookup(x, loc.iter_of))


def split_windows(graph: OpGraph, j: int, axes: Sequence[Sequence[str]]
                  ) -> tuple[Convolution, str] | None:
    """The first convolution of operator `j` whose spatial dims the per-iteration-dim mesh
    `axes` split where a device would need its neighbours' rows (a halo), and why
    (`halo_split`); None where every convolution is computed by each device on its own
    shards."""
    sizes = graph.operators[j].iteration_sizes
    for conv in convolutions(graph, j):
        why = halo_split(conv, axes, sizes)
        if why is not None:
            return conv, why
    return None


def halo_split(conv: Convolution, axes: Sequence[Sequence[str]], sizes: Sequence[int]
               ) -> str | None:
    """Why `conv`'s spatial dims, split as the per-iteration-dim mesh `axes` split them, need
    a halo; None where none is split, or each is split at the edges of windows that do not
    overlap, its input and result alike (`Convolution.needs_halo`)."""
    for k, (a, b) in enumerate(conv.spatial()):
        ax_in = tuple(axes[a]) if a is not None else ()
        ax_out = tuple(axes[b]) if b is not None else ()
        if not (ax_in or ax_out) or not conv.needs_halo(k, sizes):
            continue
        return (f"its convolution's spatial dim {k} is split over {list(ax_in or ax_out)} "
                f"(input {list(ax_in)}, result {list(ax_out)}), where its windows overlap or "
                "straddle the shards")
    return None
