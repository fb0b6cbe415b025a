"""Hand-made strategies: the baselines every searched plan is compared with (and starts from).

Each is a `Strategy` scored by the same simulator, so comparisons are like for like:

* ``data-parallel``: every operator split over its sample dim by every mesh axis.
* ``megatron``: Megatron-LM tensor parallelism over the innermost in-node mesh axis (matmuls
  alternate column- and row-parallel: a layer whose input arrives split along its contracting
  dim splits that dim, others split their output features; everything else follows its input)
  with data parallelism over every other axis.
* ``fsdp``: data parallel compute with parameters, gradients and optimizer state sharded over
  every axis (ZeRO-3).
* ``megatron-sp`` (`megatron_3d`): Megatron-LM's 3D recipe as far as it goes without pipeline
  stages: tensor parallel over every in-node axis with sequence parallelism (norms, dropout
  and residuals split along the sequence), selective recomputation, data parallel across nodes.
* ``fsdp-recompute``: FSDP with every layer recomputed (`fsdp` with ``recompute="full"``).
* ``expert``: the FlexFlow paper's expert strategies: for CNNs, data parallel convolutions and
  pooling with model-parallel dense layers (Krizhevsky's "one weird trick"); for RNNs, data
  parallel across nodes and model parallel within a node.
* ``maxtext-moe`` (`maxtext_moe`): MaxText's rules for a mixture of experts: FSDP over every
  axis, and the experts' expert dim over the in-node axes that divide it (expert parallelism
  over the FSDP axes); on a model without experts it is `fsdp`.

`megatron_3d` (and its grid, `megatron_grid`) is Megatron-LM's configuration space: TP, PP,
DP, microbatches, recomputation and the distributed optimizer, and for mixtures of experts and
long sequences expert parallelism (``ep``: `expert_dim`) and context parallelism (``cp``:
`sequence_dims`).

The module stays one: its strategies share one walk over the graph (`_layered`), its table
(`BASELINES`) and Megatron's grid are built from them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from soapjax.base.errors import PlanError, TopologyError
from soapjax.graph.opgraph import Operator, OpGraph
from soapjax.strategy.memory import microbatch_refusal
from soapjax.strategy.pipeline import DEFAULT_SCHEDULE
from soapjax.strategy.space import (
    RECOMPUTE_POLICIES,
    Config,
    MeshShape,
    RecomputePolicy,
    Strategy,
    data_parallel,
    dividing_axes,
    sample_dim,
    tie_blocks,
)
from soapjax.topology.cluster import stage_topology

__all__ = ["BASELINES", "Baseline", "GridPoint", "NAMES", "baselines", "batch_split_note",
           "expert", "expert_dim", "expert_parallel_axes", "fsdp", "intra_node_axes",
           "maxtext_moe", "megatron", "megatron_3d", "megatron_grid", "megatron_grid_points",
           "microbatch_sizes", "sequence_dims", "tensor_axes", "with_recompute"]

_DENSE = ("dot_general", "ragged_dot_general", "conv_general_dilated", "scan")


def batch_split_note(graph: OpGraph, mesh: MeshShape) -> str | None:
    """Why data parallelism cannot use the mesh for `graph`'s batch, or None: a batch that no
    mesh axis divides leaves the ``"data-parallel"`` baseline replicated, every device
    computing the whole step (it is still scored, as what such a batch gives)."""
    n = graph.batch_size
    if not graph.batch or mesh.size == 1 or dividing_axes(n, mesh.axis_names, mesh):
        return None
    sizes = sorted({s for s in mesh.axis_sizes if s > 1})
    return (f"the batch of {n} samples divides over no mesh axis "
            f"({', '.join(f'{a}={s}' for a, s in zip(mesh.axis_names, mesh.axis_sizes))}), so "
            f"data parallelism splits nothing: every device computes the whole batch; a batch "
            f"that {' or '.join(map(str, sizes))} divides splits it")


def intra_node_axes(topology) -> tuple[str, ...]:
    """Mesh axes whose device groups stay inside one node (they see NVLink, not the network):
    `Topology.intra_node_axes`, kept on the topology (Megatron's grid asks for every point)."""
    return topology.intra_node_axes()


def _assign(op: Operator, axes_of: list[list[str]], d: int | None, axes: Sequence[str],
            mesh: MeshShape) -> None:
    """Adds the axes that divide dim `d` (and are unused by the operator) to it."""
    if d is None or op.replicate_only or d not in op.divisible_dims:
        return
    used = {a for dim in axes_of for a in dim}
    size = op.split_sizes[d] // mesh.degree(axes_of[d])
    for a in dividing_axes(size, [a for a in axes if a not in used], mesh):
        axes_of[d].append(a)


def _incoming(graph: OpGraph, configs: list[Config], op: Operator) -> dict[int, list[str]]:
    """Iteration dim -> axes, as the operator's main activation input arrives split.

    The main input is the largest activation that meets a reduction dim of the operator (a
    matmul's contracted input), else the largest: an operator that adds a value to its
    matmul's result (a residual branch grouped into the projection that ends it) follows how
    its matmul's input arrives, not the added value."""
    out: dict[int, list[str]] = {}
    acts = [o for o in op.inputs if o.kind == "activation"]
    if not acts:
        return out
    n = len(op.shape)
    main = max(acts, key=lambda o: (any(d is not None and d >= n for d in o.dims),
                                    len(o.shape) and o.nbytes))
    p = graph.index(main.source)
    spec = configs[p].operand_axes(main.read_of(graph.operators[p].outputs[main.index].dims))
    for axes, d in zip(spec, main.dims):
        if d is not None and axes:
            out.setdefault(d, []).extend(axes)
    return out


def _layered(graph: OpGraph, mesh: MeshShape, outer: Sequence[str], inner: Sequence[str],
             choose: Callable[[Operator, dict[int, list[str]]], list[int]], *,
             experts: Sequence[str] = (), context: Sequence[str] = ()) -> Strategy:
    """Sample dims over `outer`; `inner` splits the first dim `choose` ranks that it divides,
    or, when it ranks none that way, follows how the operator's input arrives. An expert dim
    (`expert_dim`) takes the `experts` axes first (they are among `outer`: an expert
    operator's batch takes the rest), a sequence dim (`sequence_dims`) the `context` axes."""
    sequence = sequence_dims(graph) if context else (None,) * len(graph.operators)
    configs: list[Config] = []
    for op, seq in zip(graph.operators, sequence):
        axes_of: list[list[str]] = [[] for _ in op.iteration_sizes]
        if experts:
            _assign(op, axes_of, expert_dim(op), experts, mesh)
        _assign(op, axes_of, sample_dim(op), outer, mesh)
        _assign(op, axes_of, seq, context, mesh)
        incoming = _incoming(graph, configs, op)
        for d in choose(op, incoming):
            _assign(op, axes_of, d, inner, mesh)
            if axes_of[d]:
                break
        else:
            for dim, axes in incoming.items():
                _assign(op, axes_of, dim, [a for a in axes if a in inner], mesh)
        configs.append(Config(tuple(tuple(a) for a in axes_of)))
    # one config per layer position: the last layer's, the steady state the walk reached
    return tie_blocks(graph, Strategy(tuple(configs)), layer=-1)


def _a_dims(op: Operator) -> list[int]:
    return [d for d in op.divisible_dims if d < len(op.shape) and op.roles[d] == "A"]


def _p_dims(op: Operator) -> list[int]:
    return [d for d in op.divisible_dims if d < len(op.shape) and op.roles[d] == "P"]


def _weights(op: Operator) -> bool:
    return op.anchor in _DENSE and any(o.kind == "param" and len(o.shape) >= 2 for o in op.inputs)


def expert_dim(op: Operator) -> int | None:
    """The iteration dim along which `op`'s weight stacks its experts, or None.

    The rule: the leading dim of a weight of rank 3 or more that is also an output dim of the
    operator and a dim of an activation input, i.e. a batch dim of the matmul, each expert's
    slice of the input meeting its own slice of the weight. GShard's experts are such
    matmuls: ``einsum("EBCD,EDF->EBCF", buffers, kernel)`` over the stacked kernels
    ``[E, d, ffn]`` (`soapjax_zoo.moe`): iteration dims ``[E, B, C, F | D]``, expert dim 0.
    A dense layer's weight shares no dim with both its input and its output (each of its
    dims is contracted or produced), so no other matmul has one. Nor does the dropless
    form's grouped matmul (``jax.lax.ragged_dot``): its experts' group dim is no iteration
    dim (`soapjax.graph._dims`: a shard of the rows sorted by expert lacks its group offsets).
    """
    if op.anchor not in _DENSE or op.replicate_only:
        return None
    carried = {d for o in op.inputs if o.kind == "activation" for d in o.dims if d is not None}
    for w in op.inputs:
        if w.kind == "param" and len(w.shape) >= 3:
            d = w.dims[0]
            if d is not None and d < len(op.shape) and d in carried and d in op.divisible_dims:
                return d
    return None


def _experts(graph: OpGraph) -> dict[str, int]:
    """Expert operator -> its experts (the extent a split of its expert dim must divide);
    worked out once per graph (every Megatron point of a search's grids asks)."""
    return graph.memo("experts", lambda: {op.name: op.split_sizes[d]
                                          for op in graph.operators
                                          if (d := expert_dim(op)) is not None})


def _tokens(operand) -> bool:
    return operand.kind == "batch" and len(operand.shape) == 2 and "int" in operand.dtype


def sequence_dims(graph: OpGraph) -> tuple[int | None, ...]:
    """Per operator, the iteration dim that follows the tokens' sequence, or None.

    The sequence is dim 1 of the batch's integer ``[batch, sequence]`` leaves (tokens,
    targets); it follows the operators' dims (`Operand.dims`, `OutputTensor.dims`) through
    the graph. An operator that meets it in several dims takes the first: attention's scores
    ``[B, H, Tq, Tk]`` meet the queries' and the keys' sequence, and the queries' comes first
    (output dims before reduction dims, queries before keys), so context parallelism keeps
    the queries local and the keys and values are gathered whole by the resharding into the
    scores. Dims the sequence merges into (the dropless MoE's sorted rows ``[B*T*k, d]``) no
    longer follow it, nor do the operators they feed (its experts).

    E.g. the tiny llama: ``embed`` ``[B, T, d]`` -> 1, ``attn/q`` ``[B, T, H, hd | d]`` -> 1,
    the scores ``attn/dot_general`` ``[B, H, Tq, Tk | hd]`` -> 2, their product with the values
    ``attn/dot_general_1`` ``[B, Tq, H, hd | Tk]`` -> 1.
    """
    carries: dict[tuple[str, int], set[int]] = {}  # (producer, output) -> its sequence dims
    out: list[int | None] = []
    for op in graph.operators:
        dims: set[int] = set()
        for o in op.inputs:
            if _tokens(o):
                seq = {1}
            elif o.kind == "activation":
                seq = carries.get((o.source, o.index), set())
            else:
                continue
            dims |= {o.dims[j] for j in seq if o.dims[j] is not None}
        for k, t in enumerate(op.outputs):
            carries[op.name, k] = {j for j, d in enumerate(t.dims) if d in dims}
        out.append(min(dims) if dims else None)
    return tuple(out)


def _sequence_length(graph: OpGraph) -> int | None:
    lengths = {o.shape[1] for op in graph.operators for o in op.inputs if _tokens(o)}
    return min(lengths) if lengths else None


def _degrees(axes: Sequence[str], mesh: MeshShape) -> dict[int, tuple[str, ...]]:
    """Each degree some of `axes` make, by those axes in `axes`' order (the fewest axes, and
    among those the innermost, where several make one degree)."""
    out: dict[int, tuple[str, ...]] = {}
    for k in range(len(axes) + 1):
        for some in itertools.combinations(reversed(axes), k):
            out.setdefault(mesh.degree(some), tuple(a for a in axes if a in some))
    return out


def expert_parallel_axes(graph: OpGraph, mesh: MeshShape, axes: Sequence[str]
                         ) -> tuple[str, ...]:
    """Those of `axes` whose degree is the largest that divides every expert operator's
    experts (`expert_dim`), innermost first among equals; () for a graph without experts.

    E.g. over axes ``('data', 'model')`` of sizes 2 and 4: ``('data', 'model')`` for 8
    experts, ``('model',)`` for 4, ``('data',)`` for 2.
    """
    experts = set(_experts(graph).values())
    if not experts:
        return ()
    choices = _degrees(axes, mesh)
    return choices[max(d for d in choices if all(e % d == 0 for e in experts))]


def _check_experts(graph: OpGraph, mesh: MeshShape, axes: Sequence[str], what: str) -> None:
    """Raises a `PlanError` naming `what` (``"ep=2"``) unless every expert dim divides over
    `axes` and the graph has one."""
    if not axes:
        return
    experts = _experts(graph)
    degree = mesh.degree(axes)
    if not experts:
        ragged = any(op.anchor == "ragged_dot_general" for op in graph.operators)
        why = (": its grouped matmuls (jax.lax.ragged_dot) never split their experts"
               if ragged else "")
        raise PlanError(f"{what}: graph {graph.name!r} has no expert dim to split (a matmul "
                        f"over stacked expert weights [experts, in, out]){why}; expected ep=1")
    for name, e in experts.items():
        if e % degree:
            raise PlanError(f"{what}: {degree} expert shards of the {e} experts of {name!r}; "
                            f"expected a divisor of {e}")


def _check_context(graph: OpGraph, mesh: MeshShape, axes: Sequence[str], what: str) -> None:
    """Raises a `PlanError` naming `what` (``"cp=2"``) unless the sequence divides over
    `axes`."""
    if not axes:
        return
    length, degree = _sequence_length(graph), mesh.degree(axes)
    if length is None:
        raise PlanError(f"{what}: graph {graph.name!r} has no token sequence (an integer "
                        f"[batch, sequence] batch leaf) to split; expected cp=1")
    if length % degree:
        raise PlanError(f"{what}: {degree} context shards of a sequence of {length} tokens; "
                        f"expected a divisor of {length}")


def megatron(graph: OpGraph, mesh: MeshShape, intra: Sequence[str], *,
             sequence_parallel: bool = False, expert_axes: Sequence[str] = (),
             context_axes: Sequence[str] = ()) -> Strategy:
    """Tensor parallel over the `intra` (in-node) axes, data parallel over the others.

    With `sequence_parallel`, the operators between a row-parallel layer and the next
    column-parallel one (norms, dropout, residual adds: they arrive with no dim split over
    `intra`) split their first attribute dim (the sequence) over `intra` instead of repeating
    the same work on every device; the resharding into them is a reduce-scatter, out of them an
    all-gather, where plain Megatron all-reduces.

    Experts' matmuls (`expert_dim`) are tensor parallel as an MLP's, over their ffn dim
    (Megatron-Core's expert tensor parallelism), never over their expert dim; with
    `expert_axes` (data-parallel axes: Megatron carves expert parallelism out of data
    parallelism) their expert dim is split over those, their batch over the other
    data-parallel axes, and the tokens reach their experts by an all-to-all. With
    `context_axes` (not among `intra`) every operator's sequence dim (`sequence_dims`) is
    split over them (context parallelism: attention's queries stay local, its keys and
    values are gathered whole), the batch over the remaining axes.

    Raises:
      PlanError: expert axes among `intra` or `context_axes`, or that do not divide every
        expert operator's experts, or a graph without experts; context axes among `intra`, or
        a sequence they do not divide.
    """
    outer = [a for a in mesh.axis_names if a not in intra and a not in context_axes]
    if set(expert_axes) - set(outer) or set(context_axes) & set(intra):
        raise PlanError(f"expert_axes={tuple(expert_axes)}, context_axes={tuple(context_axes)} "
                        f"with tensor-parallel axes {tuple(intra)}: expected expert axes among "
                        f"the data-parallel axes {tuple(outer)}, context axes outside the "
                        "tensor-parallel ones")
    _check_experts(graph, mesh, expert_axes, f"expert_axes={tuple(expert_axes)}")
    _check_context(graph, mesh, context_axes, f"context_axes={tuple(context_axes)}")

    def choose(op: Operator, incoming: dict[int, list[str]]) -> list[int]:
        if not _weights(op):
            if sequence_parallel and not any(set(a) & set(intra) for a in incoming.values()):
                return _a_dims(op)[:1]
            return []
        n = len(op.shape)
        split_in = [d for d, axes in incoming.items() if d >= n and set(axes) & set(intra)]
        # row parallel if the input arrives split, else column (never over the experts)
        return split_in or [d for d in _p_dims(op) if d != expert_dim(op)]

    return _layered(graph, mesh, outer, intra, choose, experts=expert_axes,
                    context=context_axes)


def fsdp(graph: OpGraph, mesh: MeshShape) -> Strategy:
    """Data parallel compute, parameters and optimizer state sharded over every axis."""
    return Strategy(data_parallel(graph, mesh).configs, zero_axes=tuple(mesh.axis_names))


def maxtext_moe(graph: OpGraph, mesh: MeshShape, expert_axes: Sequence[str] | None = None
                ) -> Strategy:
    """MaxText's sharding rules for a mixture of experts: FSDP (`fsdp`: every operator data
    parallel over every axis, parameters and optimizer state sharded over them all), and in
    the experts' matmuls (`expert_dim`) the expert dim over `expert_axes`, the batch over the
    other axes: expert parallelism over FSDP axes, as MaxText maps its ``exp`` logical axis to
    a mesh axis that also shards the batch. The expert weights are then stored split by
    expert over `expert_axes`, and ZeRO-split over the rest. On a graph without experts it is
    `fsdp`.

    Example (tiny MoE, 4 experts, cpu8: data=2 x model=4, ``expert_axes=("model",)``):
    ``moe/experts/gate`` ``[E, B, C, F | D]`` gets ``(("model",), ("data",), (), (), ())``,
    every other operator its batch over ``("data", "model")``.

    Args:
      graph: the operator graph.
      mesh: the mesh.
      expert_axes: the axes of expert parallelism; None: `expert_parallel_axes` over all of
        them.

    Raises:
      PlanError: `expert_axes` that do not divide every expert operator's experts.
    """
    names = tuple(mesh.axis_names)
    if expert_axes is None:
        expert_axes = expert_parallel_axes(graph, mesh, names)
    if set(expert_axes) - set(names):
        raise PlanError(f"expert_axes={tuple(expert_axes)}: expected axes of the mesh {names}")
    if expert_axes and _experts(graph):
        _check_experts(graph, mesh, expert_axes, f"expert_axes={tuple(expert_axes)}")
    else:
        expert_axes = ()
    strategy = _layered(graph, mesh, names, (), lambda op, incoming: [], experts=expert_axes)
    return dataclasses.replace(strategy, zero_axes=names)


def with_recompute(graph: OpGraph, strategy: Strategy, recompute: RecomputePolicy) -> Strategy:
    """`strategy` with every operator of a repeated layer recomputing under policy `recompute`
    (``"none"``, ``"selective"``, ``"full"``), as Megatron checkpoints its transformer layers;
    the embedding, final norm and head keep their outputs."""
    if recompute not in RECOMPUTE_POLICIES:
        raise PlanError(f"recompute={recompute!r}: expected one of {RECOMPUTE_POLICIES}")
    policies = graph.memo(("layers recompute", recompute), lambda: tuple(
        recompute if op.block_position else "none" for op in graph.operators))
    return dataclasses.replace(strategy, recompute=policies)


def tensor_axes(topology, tp: int) -> tuple[str, ...]:
    """The in-node mesh axes whose sizes multiply to `tp` (innermost first among equals).

    >>> from soapjax.topology.cluster import load_topology
    >>> tensor_axes(load_topology("dgx-a100x3072-64"), 4), tensor_axes(load_topology("h100x64"), 8)
    (('model',), ('data', 'model'))

    Raises:
      PlanError: no such axes; the message lists the degrees the node allows.
    """
    intra = intra_node_axes(topology)
    choices = _degrees(intra, MeshShape.of(topology))
    if tp not in choices:
        raise PlanError(
            f"tp={tp!r} on topology {topology.name!r}: tensor parallelism stays inside a node, "
            f"over its in-node axes {intra}; expected one of {sorted(choices)}"
        )
    return choices[tp]


def megatron_3d(graph: OpGraph, topology, *, tp: int, pp: int = 1, dp: int | None = None,
                ep: int = 1, cp: int = 1, microbatch_size: int | None = None,
                interleave: int = 1, recompute: RecomputePolicy = "full",
                sequence_parallel: bool = False, distributed_optimizer: bool = False
                ) -> Strategy:
    """Megatron-LM's configuration space (Narayanan et al., SC 2021) as a strategy.

    Tensor parallel over in-node axes of degree `tp` (column- and row-parallel layers
    alternating, as `megatron`), data parallel over every other axis, the per-replica batch as
    microbatches of `microbatch_size` samples (``M = batch / dp / microbatch_size``), every
    transformer layer recomputed under `recompute`.

    Megatron-Core orders its ranks tp, cp, ep, dp, pp (innermost first), and so do the axes
    here: context parallelism takes the innermost axes outside TP of degree `cp`, expert
    parallelism the innermost of the data-parallel axes left of degree `ep` (expert
    parallelism is carved out of data parallelism: the attention's batch stays split over
    them), data parallelism the rest. E.g. on two DGX A100s (node=2 x data=2 x model=4),
    ``tp=4, cp=2, ep=2``: TP over model, CP over data, EP over node, dp=2 over node.

    Args:
      graph: the operator graph.
      topology: the cluster.
      tp: tensor-parallel degree: a product of in-node axis sizes (`tensor_axes`).
      pp: pipeline stages (`soapjax.strategy.pipeline`): the outermost mesh axis cut pp ways
        (`soapjax.topology.cluster.stage_topology`); the configs are then over one stage's devices.
      dp: data-parallel degree; defaults to (and must equal) devices / (tp * pp * cp).
      ep: expert-parallel degree: every expert matmul's expert dim (`expert_dim`: the
        capacity-dispatch MoE's stacked expert weights ``[E, d, ffn]``) split over
        data-parallel axes of that degree, which must divide every expert count; the tokens
        move to their experts and back by all-to-all.
      cp: context-parallel degree: every operator's sequence dim (`sequence_dims`) split over
        axes of that degree, which must divide the sequence (queries local, keys and values
        gathered whole by the resharding into attention's scores).
      microbatch_size: samples per microbatch per replica; default the whole per-replica
        batch (M = 1).
      interleave: virtual stages per device (Megatron's interleaved 1F1B schedule when > 1;
        plain 1F1B otherwise).
      recompute: ``"none"``, ``"selective"`` or ``"full"``.
      sequence_parallel: split norms and dropout along the sequence (`megatron`).
      distributed_optimizer: Megatron's distributed optimizer (``--use-distributed-optimizer``,
        ZeRO-1): the optimizer state sharded over the axes outside tensor parallelism (the
        data-parallel group with the context- and expert-parallel ones, as Megatron-Core
        shards it; `Strategy.optimizer_axes`): gradients reduce-scattered, each replica
        updating its shard, the parameters all-gathered.

    Raises:
      PlanError: a pp that does not divide the outermost mesh axis, an interleave without
        stages (or one the microbatches do not allow: M must be a multiple of pp), a tp the
        node cannot hold, a cp or an ep no axes make (or an ep the experts, a cp the sequence
        do not divide, or a graph without either), a dp that does not fill the mesh, a
        microbatch size that does not divide the per-replica batch.
    """
    if not isinstance(interleave, int) or interleave < 1 or (interleave > 1 and pp < 2):
        raise PlanError(f"interleave={interleave!r}: expected 1, or 2 or more virtual stages "
                        f"per device with pp >= 2 (got pp={pp})")
    try:
        stage = stage_topology(topology, pp)
    except TopologyError as e:
        raise PlanError(f"pp={pp}: {e}") from None
    mesh = MeshShape.of(stage)
    axes = tensor_axes(stage, tp)
    context = _axes_of_degree(mesh, [a for a in mesh.axis_names if a not in axes], cp,
                              f"cp={cp!r}", "context parallelism takes the mesh axes tensor "
                              "parallelism leaves")
    outer = [a for a in mesh.axis_names if a not in axes and a not in context]
    experts = _axes_of_degree(mesh, outer, ep, f"ep={ep!r}", "expert parallelism is carved "
                              "out of the data-parallel axes")
    _check_context(graph, mesh, context, f"cp={cp}")
    n = topology.num_devices
    if dp is not None and dp * tp * pp * cp != n:
        by = f"dp={dp} x tp={tp} x pp={pp}" + (f" x cp={cp}" if cp > 1 else "")
        raise PlanError(f"{by} = {dp * tp * pp * cp} devices; topology {topology.name!r} has "
                        f"{n}: expected dp={n // (tp * pp * cp)}")
    _check_experts(graph, mesh, experts, f"ep={ep}")
    dp = n // (tp * pp * cp)
    batch = graph.batch_size
    if batch % dp:
        raise PlanError(f"batch {batch} over dp={dp} replicas: expected a batch divisible by dp")
    per_replica = batch // dp
    size = per_replica if microbatch_size is None else microbatch_size
    if not isinstance(size, int) or size < 1 or per_replica % size:
        raise PlanError(f"microbatch_size={microbatch_size!r}: expected a divisor of the "
                        f"per-replica batch {per_replica} (batch {batch} / dp={dp})")
    # the layout is the same for every microbatch size, recomputation and optimizer sharding
    # (`megatron_grid` asks for each): worked out once per graph
    strategy = graph.memo(("megatron", mesh, tuple(axes), bool(sequence_parallel),
                           tuple(experts), tuple(context)),
                          lambda: megatron(graph, mesh, axes, sequence_parallel=sequence_parallel,
                                           expert_axes=experts, context_axes=context))
    strategy = dataclasses.replace(strategy, microbatches=per_replica // size)
    # once per layout and microbatch count (the grid asks again for every recomputation and
    # optimizer sharding)
    why = graph.memo(("megatron microbatches", mesh, tuple(axes), bool(sequence_parallel),
                      tuple(experts), tuple(context), strategy.microbatches),
                     lambda: microbatch_refusal(graph, strategy.configs, mesh,
                                                strategy.microbatches))
    if why:
        raise PlanError(why)
    if pp > 1:
        strategy = strategy.with_pipeline(pp, interleave,
                                          "interleaved" if interleave > 1 else DEFAULT_SCHEDULE)
    if distributed_optimizer:
        strategy = dataclasses.replace(strategy, optimizer_axes=tuple(
            a for a in mesh.axis_names if a not in axes))
    return with_recompute(graph, strategy, recompute)


def _axes_of_degree(mesh: MeshShape, axes: Sequence[str], degree: int, what: str,
                    where: str) -> tuple[str, ...]:
    """Those of `axes` (the innermost first among choices) whose sizes multiply to `degree`.

    Raises:
      PlanError: none do; the message says `what` was asked and `where` the axes come from.
    """
    choices = _degrees(axes, mesh)
    if degree not in choices:
        sizes = ", ".join(f"{a}={mesh.axis_size(a)}" for a in axes) or "none"
        raise PlanError(f"{what}: {where}, here {sizes}; expected one of {sorted(choices)}")
    return choices[degree]


def microbatch_sizes(per_replica: int) -> tuple[int, ...]:
    """The microbatch sizes a Megatron user tries: the powers of two that divide the
    per-replica batch, and the whole of it.

    >>> microbatch_sizes(280), microbatch_sizes(12)
    ((1, 2, 4, 8, 280), (1, 2, 4, 12))
    """
    powers = (1 << k for k in range(per_replica.bit_length()))
    return tuple(sorted({b for b in powers if per_replica % b == 0} | {per_replica}))


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One point of Megatron's grid (`megatron_grid_points`): its coordinates, and the name it
    goes by in plans, reports and the search's records (`name`, also its ``str``).

    Attributes:
      tp, cp, ep, pp: tensor-, context-, expert-parallel and pipeline degrees.
      v: virtual stages per device (interleaved 1F1B when above 1).
      do: Megatron's distributed optimizer (optimizer state sharded over the replicas).
      mb: the microbatch size, in samples.
      recompute: a policy of `RECOMPUTE_POLICIES`.
    """

    tp: int
    cp: int = 1
    ep: int = 1
    pp: int = 1
    v: int = 1
    do: bool = False
    mb: int = 1
    recompute: str = RECOMPUTE_POLICIES[0]

    @property
    def name(self) -> str:
        """E.g. ``"megatron-tp8-cp2-ep2-pp4-v2-do-mb1-full"`` (degrees of 1 and no
        distributed optimizer left out)."""
        return (f"megatron-tp{self.tp}" + (f"-cp{self.cp}" if self.cp > 1 else "")
                + (f"-ep{self.ep}" if self.ep > 1 else "")
                + (f"-pp{self.pp}" + (f"-v{self.v}" if self.v > 1 else "") if self.pp > 1 else "")
                + ("-do" if self.do else "") + f"-mb{self.mb}-{self.recompute}")

    def __str__(self) -> str:
        return self.name

    def coordinates(self) -> dict[str, object]:
        """The coordinates by name (``rec`` for `recompute`), for walking the grid along them."""
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp, "v": self.v,
                "do": self.do, "mb": self.mb, "rec": self.recompute}


def megatron_grid(graph: OpGraph, topology, *, pp: Sequence[int] = (1,),
                  interleave: Sequence[int] = (1,), tp: Sequence[int] = (1, 2, 4, 8),
                  ep: Sequence[int] = (1,), cp: Sequence[int] = (1,),
                  distributed_optimizer: Sequence[bool] = (False, True)
                  ) -> dict[str, Strategy]:
    """Megatron's configuration grid (`megatron_3d`), by name: TP in {1, 2, 4, 8} (as the
    node allows, or those of `tp`; sequence parallel when TP > 1), DP over the rest,
    microbatches of every power of two samples dividing the per-replica batch, and all of it
    (`microbatch_sizes`), and recomputation none, selective or full, e.g.
    ``"megatron-tp8-mb1-full"``; with pipeline stages (each of `pp` and, for pp > 1, each of
    `interleave` virtual stages), e.g. ``"megatron-tp8-pp4-v2-mb1-full"``; with each of the
    context- and expert-parallel degrees of `cp` and `ep` above 1, e.g.
    ``"megatron-tp4-cp2-ep2-mb1-full"``; with Megatron's distributed optimizer (each of
    `distributed_optimizer`; only where there are data-parallel replicas to shard over),
    ``-do`` before the microbatches, e.g. ``"megatron-tp8-pp4-do-mb1-full"``. Combinations the
    mesh, batch, experts, sequence or schedule cannot take
    (`soapjax.strategy.pipeline.pipeline_error`: the interleaved schedule's M must be a
    multiple of pp) are left out. The names are `GridPoint.name`s; `megatron_grid_points` keys
    the same grid by its points.

    The search scores all of them and starts a chain from the fastest that fits, so a searched
    plan is never slower than the grid's best under the same simulator.
    """
    return {p.name: s for p, s in megatron_grid_points(
        graph, topology, pp=pp, interleave=interleave, tp=tp, ep=ep, cp=cp,
        distributed_optimizer=distributed_optimizer).items()}


def megatron_grid_points(graph: OpGraph, topology, *, pp: Sequence[int] = (1,),
                         interleave: Sequence[int] = (1,), tp: Sequence[int] = (1, 2, 4, 8),
                         ep: Sequence[int] = (1,), cp: Sequence[int] = (1,),
                         distributed_optimizer: Sequence[bool] = (False, True)
                         ) -> dict[GridPoint, Strategy]:
    """`megatron_grid` by `GridPoint`, in the same order."""
    out = {}
    n = topology.num_devices
    for stages, tp, c, e in itertools.product(pp, tp, cp, ep):
        if n % (tp * stages * c) or graph.batch_size % (n // (tp * stages * c)):
            continue
        per = graph.batch_size // (n // (tp * stages * c))
        for v in (interleave if stages > 1 else (1,)):
            for mb, rec, do in itertools.product(microbatch_sizes(per), RECOMPUTE_POLICIES,
                                                 distributed_optimizer):
                if do and n == tp * stages:  # no replicas: nothing to shard over
                    continue
                try:
                    out[GridPoint(tp, c, e, stages, v if stages > 1 else 1, do, mb, rec)] = \
                        megatron_3d(graph, topology, tp=tp, pp=stages, ep=e, cp=c,
                                    microbatch_size=mb, interleave=v, recompute=rec,
                                    sequence_parallel=tp > 1, distributed_optimizer=do)
                except PlanError:
                    continue
    return out


def expert(graph: OpGraph, mesh: MeshShape, intra: Sequence[str], family: str) -> Strategy:
    """The FlexFlow paper's expert strategy for a CNN or an RNN (`family`)."""
    if family == "cnn":  # data parallel convolutions, model parallel dense layers
        configs = []
        for op, c in zip(graph.operators, data_parallel(graph, mesh).configs):
            axes_of: list[list[str]] = [[] for _ in op.iteration_sizes]
            if op.anchor == "dot_general" and _weights(op):
                for d in _p_dims(op):
                    _assign(op, axes_of, d, mesh.axis_names, mesh)
                    if axes_of[d]:
                        break
            used = any(axes_of)
            configs.append(Config(tuple(tuple(a) for a in axes_of)) if used else c)
        return Strategy(tuple(configs))
    outer = [a for a in mesh.axis_names if a not in intra]

    def choose_rnn(op: Operator, incoming) -> list[int]:  # model parallel within a node
        return _p_dims(op) if _weights(op) else []

    return _layered(graph, mesh, outer, intra, choose_rnn)


class Baseline(NamedTuple):
    """One row of `BASELINES`.

    Attributes:
      build: ``(graph, mesh, intra) -> Strategy``, `intra` the mesh axes inside a node
        (`intra_node_axes`, else the innermost axis).
      for_family: whether it is for a model of that family (the zoo's `Workload.family`); a
        call without a family (``baselines(graph, topology)``) gets every baseline.
    """

    build: Callable[[OpGraph, MeshShape, tuple[str, ...]], Strategy]
    for_family: Callable[[str], bool] = lambda family: True


# Every baseline by name, in the order `baselines` returns them; adding one is a row here.
BASELINES: dict[str, Baseline] = {
    "data-parallel": Baseline(lambda g, mesh, intra: data_parallel(g, mesh)),
    # TP on the innermost node axis
    "megatron": Baseline(lambda g, mesh, intra: megatron(g, mesh, intra[-1:])),
    "fsdp": Baseline(lambda g, mesh, intra: fsdp(g, mesh)),
    # the large models' recipes, where memory binds
    "megatron-sp": Baseline(lambda g, mesh, intra: with_recompute(
        g, megatron(g, mesh, intra, sequence_parallel=True), "selective"),
        lambda family: family == "transformer"),
    "fsdp-recompute": Baseline(lambda g, mesh, intra: with_recompute(g, fsdp(g, mesh), "full"),
                               lambda family: family == "transformer"),
    # the paper's experts: each for its own family, and both for the others
    "expert-cnn": Baseline(lambda g, mesh, intra: expert(g, mesh, intra, "cnn"),
                           lambda family: family != "rnn"),
    "expert-rnn": Baseline(lambda g, mesh, intra: expert(g, mesh, intra, "rnn"),
                           lambda family: family != "cnn"),
    # MaxText's mixture of experts: FSDP, the experts over the in-node axes that divide them
    "maxtext-moe": Baseline(lambda g, mesh, intra: maxtext_moe(
        g, mesh, expert_parallel_axes(g, mesh, intra)), lambda family: family == "transformer"),
}
NAMES: tuple[str, ...] = tuple(BASELINES)


def baselines(graph: OpGraph, topology, family: str | None = None) -> dict[str, Strategy]:
    """Every baseline for `graph` on `topology` (`BASELINES`), by name.

    Args:
      graph: the operator graph.
      topology: a `Topology` (its node structure decides which axes are intra-node).
      family: "cnn", "rnn", "transformer" or "mlp" (the zoo's `Workload.family`): the
        baselines for that family; None gives every one (both paper experts).
    """
    mesh = MeshShape.of(topology)
    intra = intra_node_axes(topology) or tuple(mesh.axis_names[-1:])
    return {name: b.build(graph, mesh, intra) for name, b in BASELINES.items()
            if family is None or b.for_family(family)}
