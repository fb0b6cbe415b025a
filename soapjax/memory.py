"""The memory dimensions of a strategy: activation recomputation and microbatches.

Both trade step time for memory, and the simulator prices both sides with the small pure
functions of this module; `soapjax.apply` realises them with the same rules.

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
operators outside any layer form runs of their own). `soapjax.apply` evaluates each segment
inside one ``jax.checkpoint`` (``nothing_saveable``): what crosses the segment's border is
kept, what stays inside is recomputed. Hence the memory rule (`activation_bytes`):

* an operator's output is kept iff it does not recompute, or some operator outside its segment
  reads it (the segment's output; the inputs of a segment are kept by their producers);
* while a segment's backward runs, its dropped outputs exist again: the peak adds the largest
  segment's dropped bytes.

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

from soapjax._local import draws_random_bits
from soapjax.errors import PlanError
from soapjax.graph import Operator, OpGraph
from soapjax.space import RECOMPUTE_POLICIES, Config, MeshShape, RecomputePolicy, sample_dim

__all__ = ["Segments", "attention_core", "check_microbatches", "layer_of", "microbatch_choices",
           "microbatch_degrees", "microbatch_error", "microbatch_shape", "random_operator",
           "recomputes"]

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


class Segments:
    """What the memory rule needs of a graph, computed once: layers and readers.

    Args:
      graph: the operator graph.
    """

    def __init__(self, graph: OpGraph) -> None:
        self.layers = [layer_of(op) for op in graph.operators]
        self.readers: list[list[int]] = [[] for _ in graph.operators]
        for p, j, _ in graph.edges():
            self.readers[p].append(j)

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

    def activation_bytes(self, flags: Sequence[bool], nbytes: Sequence[int]) -> int:
        """Activation bytes per device under the memory rule (module doc): the kept outputs,
        plus the largest segment's dropped ones (alive again while its backward runs)."""
        seg = self.segments(flags)
        kept, dropped = 0, {}
        for j, n in enumerate(nbytes):
            s = seg[j]
            if s < 0 or any(seg[r] != s for r in self.readers[j]) or not self.readers[j]:
                kept += n
            else:
                dropped[s] = dropped.get(s, 0) + n
        return kept + max(dropped.values(), default=0)


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
    return next((op.name for op in graph.operators if draws_random_bits(graph, op.name)), None)


def check_microbatches(graph: OpGraph, configs: Sequence[Config], mesh: MeshShape,
                       microbatches: int) -> None:
    """PlanError naming the first operator whose per-device batch M does not divide, or that
    draws random bits (see `random_operator`)."""
    if microbatches > 1 and (name := random_operator(graph)) is not None:
        raise PlanError(f"operator {name!r} draws random bits (dropout): {microbatches} "
                        "microbatches would draw other masks than the whole batch, and the step "
                        "would not compute the unsharded step; use microbatches=1")
    for op, c in zip(graph.operators, configs):
        why = microbatch_error(op, c, mesh, microbatches)
        if why:
            raise PlanError(f"{why}; choose microbatches dividing every operator's "
                            "per-device batch")


def microbatch_choices(graph: OpGraph, limit: int = 64) -> tuple[int, ...]:
    """The microbatch counts worth trying: the divisors of the batch size up to `limit` (only
    1 for a graph that draws random bits: `random_operator`)."""
    if random_operator(graph) is not None:
        return (1,)
    b = graph.batch_size
    return tuple(m for m in range(1, min(b, limit) + 1) if b % m == 0)
