"""The memory dimensions of a strategy: activation recomputation and microbatches.

Both trade step time for memory, and the simulator prices both sides with the small pure
functions of this module; `soapjax.apply.step` realises them with the same rules.

**Recomputation** (`Strategy.recompute`: per operator ``"none"``, ``"selective"`` or
``"full"``). An operator that *recomputes* does not keep its outputs for the backward pass; its
forward runs again just before its backward (the backward task costs forward + backward).
``"full"`` recomputes the operator; ``"selective"`` is Megatron's selective recomputation
(Korthikanti et al. 2022, section 4.2): it recomputes the *attention core*, the operators built
around a matmul of two activations (`attention_core`: ``q k^T`` with the scaling, masking,
softmax and dropout folded into it, and ``probs v``), whose s x s outputs are a layer's
largest (Megatron counts ``5 a s^2 b`` bytes for them, dropout included, against ``34 s b h``
for the rest) and cheapest to make again, and keeps every other operator's outputs as under
``"none"`` (the matmuls that read weights, the norms, the activations). Found by structure, not
by name: a matmul none of whose operands is a parameter; a model without one (an MLP, a CNN)
recomputes nothing under ``"selective"``, and a softmax grouped into an operator of its own
(not folded into the scores' matmul, as in the zoo's models) is kept.

Recomputing operators are grouped into *segments*: maximal runs of consecutive recomputing
operators (graph order) of one layer (a layer of a scan over layers, `Operator.block_position`;
operators outside any layer form runs of their own). `soapjax.apply.step` evaluates each segment
inside one ``jax.checkpoint`` (``nothing_saveable``): what crosses the segment's border is
kept, what stays inside is recomputed. Hence the memory rule (`activation_bytes`):

* a value is kept iff a backward reads it (`residuals`: a matmul's operands, a nonlinear
  function's input; not a residual add's) and the operator whose backward reads it does not
  recompute, or an operator of another segment reads it (a segment's input, which its
  checkpoint saves). It is counted once, at the smallest of the layouts it takes (its
  producer's output, its keeping readers' operands): under sequence parallelism a norm's
  output is kept split along the sequence and gathered again for the backward, and a
  row-parallel projection's output split as the norm after it reads it (Korthikanti et al.
  2022, section 4.2.2). Values computed inside an operator that a matmul of it reads (a
  GeLU's output) are kept by it, at its layout;
* while a segment's backward runs, its dropped outputs exist again: the peak adds the largest
  segment's dropped bytes;
* a parameter a recomputing operator reads in another layout than it is stored in (under
  ZeRO-3, gathered) enters the segment's checkpoint as stored and is gathered inside it, once
  in the forward pass and again for the recomputation (as FSDP runs it): the gathered copy is
  not kept, but counts among its segment's bytes while the segment runs.

Example: an attention layer ``ln -> q, k, v -> scores (q k^T, softmax) -> probs v -> out``
with ``"selective"`` everywhere recomputes ``scores`` and ``probs v``, one segment: the
probabilities (read only inside it) are dropped, the output of ``probs v`` (read by ``out``) is
kept, and the peak adds one layer's probabilities, alive again while that layer's backward runs.
With ``"full"`` the layer is one segment and only its last output is kept.

**Microbatches** (`Strategy.microbatches`, M): the global batch runs as M microbatches, each
through the forward and backward pass, gradients summed in a ``lax.scan``, synchronised and
applied once. Every operator then runs M times on a shard whose sample dim is divided by M
more (`microbatch_degrees`; operators without a sample dim run M times whole), so it is priced
at those degrees, times M; every activation resharding (and its cotangent's way back, and the
all-reduce of partial sums) runs M times on the tensor at microbatch size (`microbatch_shape`:
its sample dim divided by M); parameter gathers (ZeRO-3) run M times, whole; gradient
synchronisation and the optimizer update run once. Activation memory is that of one
microbatch: the operators' outputs at microbatch size (the rule above). The batch itself and
the parameters' gathered copies are counted whole. M must divide the per-device shard of
every operator's sample dim (`microbatch_error`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from soapjax.base.attention import attention_call
from soapjax.base.errors import PlanError
from soapjax.graph._cotangents import differentiated_values
from soapjax.graph._grouping import attention_heads
from soapjax.graph._local import draws_random_bits
from soapjax.graph.opgraph import Operator, OpGraph
from soapjax.strategy.space import (
    RECOMPUTE_POLICIES,
    Config,
    MeshShape,
    RecomputePolicy,
    sample_dim,
)

__all__ = ["Residuals", "Segments", "attention_core", "check_microbatches", "coupled_samples",
           "layer_of",
           "microbatch_choices",
           "microbatch_degrees", "microbatch_error", "microbatch_refusal", "microbatch_shape",
           "random_operator",
           "recomputes", "residuals"]

_MATMUL_ANCHORS = ("dot_general",)


# --- recomputation ------------------------------------------------------------------------------


def attention_core(op: Operator) -> bool:
    """Whether `op` is part of an attention core: a matmul of two activations (no operand a
    parameter), as ``q k^T`` (with the softmax folded in) and ``probs v`` are.

    >>> from types import SimpleNamespace as Op, SimpleNamespace as X
    >>> attention_core(Op(anchor="dot_general", inputs=(X(kind="activation"),) * 2))
    True
    >>> attention_core(Op(anchor="dot_general", inputs=(X(kind="param"), X(kind="activation"))))
    False
    """
    return op.anchor.startswith(_MATMUL_ANCHORS) and not any(x.kind == "param"
                                                              for x in op.inputs)


def recomputes(op: Operator, policy: RecomputePolicy) -> bool:
    """Whether `op` under `policy` drops its outputs and runs its forward again (module doc).

    >>> from types import SimpleNamespace as Op, SimpleNamespace as X
    >>> fc1 = Op(anchor="dot_general", inputs=(X(kind="param"), X(kind="activation")))
    >>> scores = Op(anchor="dot_general", inputs=(X(kind="activation"),) * 2)
    >>> recomputes(fc1, "selective"), recomputes(scores, "selective"), recomputes(fc1, "full")
    (False, True, True)
    """
    if policy == "none":
        return False
    if policy == "full":
        return True
    if policy == "selective":
        return attention_core(op)
    raise PlanError(f"operator {op.name!r}: recompute policy {policy!r} is not one of "
                    f"{RECOMPUTE_POLICIES}")


def layer_of(op: Operator) -> str:
    """The layer an operator belongs to: its name up to the part `block_position` stars
    (``layers_3/mlp/fc1`` with position ``layers_*/mlp/fc1`` is in ``layers_3``); '' outside."""
    if not op.block_position:
        return ""
    out = []
    for part, pattern in zip(op.name.split("/"), op.block_position.split("/")):
        out.append(part)
        if part != pattern:
            return "/".join(out)
    return op.block_position


class Residuals(NamedTuple):
    """Which of one operator's values its backward reads (`residuals`).

    Attributes:
      inputs: per operand (`Operator.inputs` order), whether its backward reads it.
      outputs: per output, whether its own backward reads it (a norm's residual sum, which
        it exports and normalises).
      internal: the values computed inside it that a matmul of it reads (a GeLU's output
        inside the projection that multiplies it), and flash attention's log-sum-exp per
        query (`soapjax.base.attention.flash_attention` saves it): shape, dtype and iteration
        dims each.
    """

    inputs: tuple[bool, ...]
    outputs: tuple[bool, ...]
    internal: tuple[tuple[tuple[int, ...], str, tuple[int | None, ...]], ...]


# The same value in another dtype or shape: what reads the copy reads the value.
_ALIASES = frozenset({"convert_element_type", "reshape", "broadcast_in_dim", "transpose",
                      "squeeze", "expand_dims", "copy", "copy_p", "reduce_precision"})
# Linear, and their derivative reads none of their operands (a sum's, a slice's).
_NO_RESIDUAL = frozenset({"add", "add_any", "sub", "neg", "reduce_sum", "concatenate", "pad",
                          "slice", "dynamic_slice", "select_n", "stop_gradient", "cumsum",
                          "iota"}) | _ALIASES
# Bilinear: an operand's derivative reads the other operand (x @ W reads W for x, x for W).
_BILINEAR = frozenset({"mul", "dot_general", "conv_general_dilated"})
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def residuals(graph: OpGraph, j: int) -> Residuals:
    """What operator `j`'s backward reads, from its own equations (the VJP of each).

    A value is read when an equation's derivative reads it for a cotangent the backward
    computes (`soapjax.graph._cotangents`: nothing for a value only the batch or a
    ``stop_gradient`` leads to): an operand of a nonlinear equation (``tanh``, ``exp``, a
    norm's ``rsqrt``) that is differentiated, the other factor of a product or matmul whose
    factor is differentiated, a divisor; never the operands
    of linear equations whose derivative reads nothing (adds, subtractions, sums, slices,
    conversions and reshapes, which pass the need on to their operand). An input or output
    read is kept once, by its producer (`Segments.activation_bytes`). Of the values computed
    inside, only a matmul's operands are counted: the elementwise chains around them (a
    GeLU's, a softmax's) are fused, and their backward recomputes its intermediates from the
    chain's input, which is kept (Korthikanti et al. 2022 count GeLU's input and output, and
    the softmax's output).

    >>> import jax, jax.numpy as jnp
    >>> from soapjax.graph.opgraph import trace
    >>> def loss(w, x):
    ...     return jnp.mean(x + jax.nn.gelu(x @ w["fc1"]) @ w["fc2"])
    >>> f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    >>> g = trace(loss, {"fc1": f32(8, 8), "fc2": f32(8, 8)}, f32(4, 8))
    >>> loss_op = g.operators[1]  # GeLU, fc2, the residual add and the mean
    >>> [x.kind for x in loss_op.inputs], residuals(g, 1).inputs  # x: only added
    (['activation', 'param', 'batch'], (True, True, False))
    """
    return graph.memo(("residuals", j), lambda: _residuals(graph, j))


def _residuals(graph: OpGraph, j: int) -> Residuals:
    op = graph.operators[j]
    loc = graph.program.local.get(op.name)
    if loc is None:  # no equations of its own: everything it reads and makes is kept
        return Residuals((True,) * len(op.inputs), (True,) * len(op.outputs), ())
    prog = graph.program
    units = [prog.units[i] for i in loc.units]
    live = set(loc.inputs)  # values that depend on the operator's inputs (not constants)
    # the values the backward differentiates (`soapjax.graph._cotangents`): not the batch's,
    # not a target network's under ``stop_gradient``
    diff = differentiated_values(graph)
    root: dict[int, int] = {}  # a value -> the value it is a copy of (`_ALIASES`)
    for u in units:
        if any(v in live for v in u.ins if v is not None):
            live.update(v for v in u.outs if v is not None)
        if u.eqn.primitive.name in _ALIASES and u.ins and u.ins[0] is not None:
            for v in u.outs:
                if v is not None:
                    root[v] = root.get(u.ins[0], u.ins[0])
    read: set[int] = set()
    by_matmul: set[int] = set()
    for u in units:
        name = u.eqn.primitive.name
        if name in _NO_RESIDUAL:
            continue
        for i, v in enumerate(u.ins):
            if v is None or v not in live or not _floating(prog.dtypes[v]):
                continue
            others = [w for k, w in enumerate(u.ins) if k != i]
            if name in _BILINEAR:  # read for the other factor's cotangent
                if not any(w in diff for w in others if w is not None):
                    continue  # times a constant: its derivative reads the constant only
            elif name == "div" and i == 0:  # x / y: read for y's cotangent
                if not any(w in diff for w in others[:1]):
                    continue
            elif name == "div":  # y: read for either's
                if not any(w in diff for w in u.ins if w is not None):
                    continue
            elif v not in diff:  # a nonlinear function's operand: read for its own cotangent
                continue
            read.add(root.get(v, v))
            if name in _MATMULS or attention_call(u.eqn) is not None:  # flash attention saves
                by_matmul.add(root.get(v, v))  # its operands (a rotary embedding's outputs)
    outer = set(loc.inputs) | set(loc.exports)
    internal = tuple((tuple(prog.shapes[v]), prog.dtypes[v], loc.dims_of(v))
                     for v in sorted(by_matmul - outer)
                     if len(loc.dims_of(v)) == len(prog.shapes[v]))
    if op.anchor == "attention":  # flash attention keeps a log-sum-exp per query and head
        b, t, n = op.shape[:3]
        internal = tuple((shape, dtype, attention_heads(dims, shape, n))
                         for shape, dtype, dims in internal)
        wide = "float64" if op.dtype == "float64" else "float32"
        internal += (((b, n, t), wide, (0, 2, 1)),)
    return Residuals(tuple(v in read for v in loc.inputs), tuple(v in read for v in loc.exports),
                     internal)


def _floating(dtype: str) -> bool:
    return "float" in dtype or dtype.startswith("bf")


class Segments:
    """What the memory rule needs of a graph, computed once: layers, readers and residuals.

    Args:
      graph: the operator graph.
    """

    def __init__(self, graph: OpGraph) -> None:
        self.layers = [layer_of(op) for op in graph.operators]
        res = [residuals(graph, j) for j in range(len(graph.operators))]
        # per activation value (producer, output): whether the producer reads it, and its
        # readers (reader, operand, whether the reader's backward reads it)
        self.values: list[tuple[int, int, bool, list[tuple[int, int, bool]]]] = [
            (p, k, res[p].outputs[k], []) for p, op in enumerate(graph.operators)
            for k in range(len(op.outputs))]
        where = {(p, k): v for v, (p, k, _, _) in enumerate(self.values)}
        pos = {op.name: i for i, op in enumerate(graph.operators)}
        for j, op in enumerate(graph.operators):
            for o, x in enumerate(op.inputs):
                if x.kind == "activation":
                    self.values[where[pos[x.source], x.index]][3].append((j, o, res[j].inputs[o]))
        self.internal = [r.internal for r in res]

    def segments(self, flags: Sequence[bool]) -> list[int]:
        """Per operator, the index of its segment's first operator, or -1 when it keeps its
        outputs."""
        out, first = [-1] * len(flags), -1
        for j, f in enumerate(flags):
            if not f:
                first = -1
                continue
            if first < 0 or self.layers[j] != self.layers[j - 1]:
                first = j
            out[j] = first
        return out

    def kept_bytes(self, flags: Sequence[bool], outputs: Sequence[Sequence[int]],
                   operands: Sequence[Sequence[int]], internal: Sequence[int],
                   transient: Sequence[int] = ()) -> tuple[list[int], int]:
        """Per operator, the bytes it keeps for the backward pass (module doc), and the largest
        segment's dropped bytes (alive again while its backward runs).

        Args:
          flags: per operator, whether it recomputes.
          outputs: per operator, each output's shard bytes at its layout.
          operands: per operator, each operand's shard bytes at its layout.
          internal: per operator, the bytes of its internal values its backward reads
            (`Residuals.internal`) at its layout.
          transient: per recomputing operator, bytes alive only while its segment runs (the
            parameters it gathers inside the segment, and gathers again to recompute); empty
            for none.
        """
        seg = self.segments(flags)
        kept, dropped = [0] * len(flags), {}
        for p, k, own, readers in self.values:
            sizes = [outputs[p][k]] if own and not flags[p] or not readers else []
            sizes += [operands[r][o] for r, o, reads in readers
                      if (reads and not flags[r]) or (flags[r] and seg[r] != seg[p])]
            if sizes:  # kept at the smallest layout it takes (resharded again for the backward)
                kept[p] += min([outputs[p][k], *sizes])
            elif flags[p]:
                dropped[seg[p]] = dropped.get(seg[p], 0) + outputs[p][k]
        for j, n in enumerate(internal):
            if not flags[j]:
                kept[j] += n
            else:
                dropped[seg[j]] = dropped.get(seg[j], 0) + n
        for j, n in enumerate(transient):
            if n and flags[j]:
                dropped[seg[j]] = dropped.get(seg[j], 0) + n
        return kept, max(dropped.values(), default=0)

    def activation_bytes(self, flags: Sequence[bool], outputs: Sequence[Sequence[int]],
                         operands: Sequence[Sequence[int]], internal: Sequence[int],
                         transient: Sequence[int] = ()) -> int:
        """Activation bytes per device under the memory rule (module doc, `kept_bytes`)."""
        kept, peak = self.kept_bytes(flags, outputs, operands, internal, transient)
        return sum(kept) + peak


# --- microbatches -------------------------------------------------------------------------------


def microbatch_degrees(op: Operator, degrees: Sequence[int], microbatches: int) -> tuple[int, ...]:
    """The degrees one microbatch's shard is priced at: the sample dim's times M.

    >>> from types import SimpleNamespace as Op
    >>> op = Op(roles=("S", "P"), reduction_dims=())
    >>> microbatch_degrees(op, (2, 4), 4)
    (8, 4)
    """
    d = sample_dim(op)
    out = list(degrees)
    if d is not None and microbatches > 1:
        out[d] *= microbatches
    return tuple(out)


def microbatch_shape(shape: Sequence[int], dims: Sequence[int | None], sample: int | None,
                     microbatches: int) -> tuple[int, ...]:
    """A tensor's shape at microbatch size: the dim following the sample dim `sample` of the
    operator it belongs to (`dims`: `Operand.dims`), divided by M where it divides."""
    out = list(shape)
    if sample is not None and microbatches > 1 and sample in dims:
        p = list(dims).index(sample)
        if out[p] % microbatches == 0:
            out[p] //= microbatches
    return tuple(out)


def microbatch_error(op: Operator, config: Config, mesh: MeshShape, microbatches: int) -> str:
    """Why `op` under `config` cannot run as `microbatches` microbatches ('' when it can): the
    per-device shard of its sample dim must divide by M."""
    if microbatches == 1:
        return ""
    d = sample_dim(op)
    if d is None:
        return ""
    deg = mesh.degree(config.axes[d]) if d < len(config.axes) else 1
    size = op.split_sizes[d]
    if size % (deg * microbatches):
        return (f"operator {op.name!r}: its sample dim of {size} split {deg} ways leaves "
                f"{size // deg} per device, which {microbatches} microbatches do not divide")
    return ""


def random_operator(graph: OpGraph) -> str | None:
    """The first operator that draws random bits (dropout), if any.

    Microbatches would evaluate it on each microbatch with the traced key, drawing other masks
    than the whole batch does: the step would no longer compute what the unsharded step
    computes. Such graphs keep M = 1.
    """
    return graph.memo("random_operator", lambda: next(
        (op.name for op in graph.operators if draws_random_bits(graph, op.name)), None))


def coupled_samples(graph: OpGraph) -> str:
    """Where the samples of `graph`'s batch interact, so that microbatches would compute
    another step (`OpGraph.sample_coupling`), unless the graph was traced accepting
    statistics per microbatch (`OpGraph.microbatch_statistics`); '' where microbatches keep
    the step."""
    return "" if graph.microbatch_statistics else graph.sample_coupling


def check_microbatches(graph: OpGraph, configs: Sequence[Config], mesh: MeshShape,
                       microbatches: int) -> None:
    """PlanError naming the first operator whose per-device batch M does not divide, that
    draws random bits (see `random_operator`), or where the samples interact
    (`coupled_samples`): `microbatch_refusal`'s reason."""
    why = microbatch_refusal(graph, configs, mesh, microbatches)
    if why:
        raise PlanError(why)


def microbatch_refusal(graph: OpGraph, configs: Sequence[Config], mesh: MeshShape,
                       microbatches: int) -> str:
    """Why `microbatches` do not fit `configs` (`check_microbatches`), or ''."""
    if microbatches > 1 and (name := random_operator(graph)) is not None:
        return (f"operator {name!r} draws random bits (dropout): {microbatches} "
                "microbatches would draw other masks than the whole batch, and the step "
                "would not compute the unsharded step; use microbatches=1")
    if microbatches > 1 and graph.has_aux:
        return (f"graph {graph.name!r} returns values beside its loss (has_aux): "
                f"{microbatches} microbatches would compute them per microbatch, not over the "
                "whole batch; use microbatches=1")
    if microbatches > 1 and (why := coupled_samples(graph)):
        return (f"the samples of graph {graph.name!r} interact: {why}; {microbatches} "
                "microbatches would compute that over each microbatch, not the whole "
                "batch, and the step would not compute the unsharded step; use "
                "microbatches=1 (or trace with microbatch_statistics=True to accept "
                "statistics per microbatch)")
    for op, c in zip(graph.operators, configs):
        why = microbatch_error(op, c, mesh, microbatches)
        if why:
            return f"{why}; choose microbatches dividing every operator's per-device batch"
    return ""


def microbatch_choices(graph: OpGraph, limit: int = 64) -> tuple[int, ...]:
    """The microbatch counts worth trying: the divisors of the batch size up to `limit` (only
    1 for a graph that draws random bits, `random_operator`, whose samples interact,
    `coupled_samples`, or that returns values beside its loss, `OpGraph.has_aux`)."""
    if random_operator(graph) is not None or coupled_samples(graph) or graph.has_aux:
        return (1,)
    b = graph.batch_size
    return tuple(m for m in range(1, min(b, limit) + 1) if b % m == 0)
