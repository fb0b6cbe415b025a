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
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from soapjax.errors import PlanError, TopologyError
from soapjax.graph import Operator, OpGraph
from soapjax.memory import check_microbatches
from soapjax.space import (
    RECOMPUTE_POLICIES,
    Config,
    MeshShape,
    RecomputePolicy,
    Strategy,
    data_parallel,
    dividing_axes,
    sample_dim,
)
from soapjax.topology import stage_topology

__all__ = ["BASELINES", "NAMES", "Baseline", "baselines", "expert", "fsdp", "intra_node_axes",
           "megatron", "megatron_3d", "megatron_grid", "microbatch_sizes", "tensor_axes",
           "with_recompute"]

_DENSE = ("dot_general", "conv_general_dilated", "scan")


def intra_node_axes(topology) -> tuple[str, ...]:
    """Mesh axes whose device groups stay inside one node (they see NVLink, not the network)."""
    out = []
    for axis in topology.axis_names:
        groups = topology.groups((axis,))
        if all(len({topology.node_of(d) for d in g}) == 1 for g in groups):
            out.append(axis)
    return tuple(out)


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
    """Iteration dim -> axes, as the operator's main activation input arrives split."""
    out: dict[int, list[str]] = {}
    pos = {o.name: i for i, o in enumerate(graph.operators)}
    acts = [o for o in op.inputs if o.kind == "activation"]
    if not acts:
        return out
    main = max(acts, key=lambda o: len(o.shape) and o.nbytes)
    producer = graph.operators[pos[main.source]]
    spec = configs[pos[main.source]].operand_axes(producer.outputs[main.index].dims)
    for axes, d in zip(spec, main.dims):
        if d is not None and axes:
            out.setdefault(d, []).extend(axes)
    return out


def _layered(graph: OpGraph, mesh: MeshShape, outer: Sequence[str], inner: Sequence[str],
             choose: Callable[[Operator, dict[int, list[str]]], list[int]]) -> Strategy:
    """Sample dims over `outer`; `inner` splits the first dim `choose` ranks that it divides,
    or, when it ranks none that way, follows how the operator's input arrives."""
    configs: list[Config] = []
    for op in graph.operators:
        axes_of: list[list[str]] = [[] for _ in op.iteration_sizes]
        _assign(op, axes_of, sample_dim(op), outer, mesh)
        incoming = _incoming(graph, configs, op)
        for d in choose(op, incoming):
            _assign(op, axes_of, d, inner, mesh)
            if axes_of[d]:
                break
        else:
            for dim, axes in incoming.items():
                _assign(op, axes_of, dim, [a for a in axes if a in inner], mesh)
        configs.append(Config(tuple(tuple(a) for a in axes_of)))
    return Strategy(tuple(configs))


def _a_dims(op: Operator) -> list[int]:
    return [d for d in op.divisible_dims if d < len(op.shape) and op.roles[d] == "A"]


def _p_dims(op: Operator) -> list[int]:
    return [d for d in op.divisible_dims if d < len(op.shape) and op.roles[d] == "P"]


def _weights(op: Operator) -> bool:
    return op.anchor in _DENSE and any(o.kind == "param" and len(o.shape) >= 2 for o in op.inputs)


def megatron(graph: OpGraph, mesh: MeshShape, intra: Sequence[str], *,
             sequence_parallel: bool = False) -> Strategy:
    """Tensor parallel over the `intra` (in-node) axes, data parallel over the others.

    With `sequence_parallel`, the operators between a row-parallel layer and the next
    column-parallel one (norms, dropout, residual adds: they arrive with no dim split over
    `intra`) split their first attribute dim (the sequence) over `intra` instead of repeating
    the same work on every device; the resharding into them is a reduce-scatter, out of them an
    all-gather, where plain Megatron all-reduces.
    """
    outer = [a for a in mesh.axis_names if a not in intra]

    def choose(op: Operator, incoming: dict[int, list[str]]) -> list[int]:
        if not _weights(op):
            if sequence_parallel and not any(set(a) & set(intra) for a in incoming.values()):
                return _a_dims(op)[:1]
            return []
        n = len(op.shape)
        split_in = [d for d, axes in incoming.items() if d >= n and set(axes) & set(intra)]
        return split_in or _p_dims(op)  # row parallel if the input arrives split, else column

    return _layered(graph, mesh, outer, intra, choose)


def fsdp(graph: OpGraph, mesh: MeshShape) -> Strategy:
    """Data parallel compute, parameters and optimizer state sharded over every axis."""
    return Strategy(data_parallel(graph, mesh).configs, zero_axes=tuple(mesh.axis_names))


def with_recompute(graph: OpGraph, strategy: Strategy, recompute: RecomputePolicy) -> Strategy:
    """`strategy` with every operator of a repeated layer recomputing under policy `recompute`
    (``"none"``, ``"selective"``, ``"full"``), as Megatron checkpoints its transformer layers;
    the embedding, final norm and head keep their outputs."""
    if recompute not in RECOMPUTE_POLICIES:
        raise PlanError(f"recompute={recompute!r}: expected one of {RECOMPUTE_POLICIES}")
    policies = tuple(recompute if op.block_position else "none" for op in graph.operators)
    return dataclasses.replace(strategy, recompute=policies)


def tensor_axes(topology, tp: int) -> tuple[str, ...]:
    """The in-node mesh axes whose sizes multiply to `tp` (innermost first among equals).

    >>> from soapjax.topology import load_topology
    >>> tensor_axes(load_topology("dgx-a100x3072-64"), 4), tensor_axes(load_topology("h100x64"), 8)
    (('model',), ('data', 'model'))

    Raises:
      PlanError: no such axes; the message lists the degrees the node allows.
    """
    intra = intra_node_axes(topology)
    mesh = MeshShape.of(topology)
    choices: dict[int, tuple[str, ...]] = {}
    for k in range(len(intra) + 1):
        for axes in itertools.combinations(reversed(intra), k):
            choices.setdefault(mesh.degree(axes), tuple(a for a in intra if a in axes))
    if tp not in choices:
        raise PlanError(
            f"tp={tp!r} on topology {topology.name!r}: tensor parallelism stays inside a node, "
            f"over its in-node axes {intra}; expected one of {sorted(choices)}"
        )
    return choices[tp]


def megatron_3d(graph: OpGraph, topology, *, tp: int, pp: int = 1, dp: int | None = None,
                microbatch_size: int | None = None, interleave: int = 1,
                recompute: RecomputePolicy = "full", sequence_parallel: bool = False) -> Strategy:
    """Megatron-LM's configuration space (Narayanan et al., SC 2021) as a strategy.

    Tensor parallel over in-node axes of degree `tp` (column- and row-parallel layers
    alternating, as `megatron`), data parallel over every other axis, the per-replica batch as
    microbatches of `microbatch_size` samples (``M = batch / dp / microbatch_size``), every
    transformer layer recomputed under `recompute`.

    Args:
      graph: the operator graph.
      topology: the cluster.
      tp: tensor-parallel degree: a product of in-node axis sizes (`tensor_axes`).
      pp: pipeline stages (`soapjax.pipeline`): the outermost mesh axis cut pp ways
        (`soapjax.topology.stage_topology`); the configs are then over one stage's devices.
      interleave: virtual stages per device (Megatron's interleaved 1F1B schedule when > 1;
        plain 1F1B otherwise).
      dp: data-parallel degree; defaults to (and must equal) devices / (tp * pp).
      microbatch_size: samples per microbatch per replica; default the whole per-replica
        batch (M = 1).
      recompute: ``"none"``, ``"selective"`` or ``"full"``.
      sequence_parallel: split norms and dropout along the sequence (`megatron`).

    Raises:
      PlanError: a pp that does not divide the outermost mesh axis, an interleave without
        stages (or one the microbatches do not allow: M must be a multiple of pp), a tp the
        node cannot hold, a dp that does not fill the mesh, a microbatch size that does not
        divide the per-replica batch.
    """
    if not isinstance(interleave, int) or interleave < 1 or (interleave > 1 and pp < 2):
        raise PlanError(f"interleave={interleave!r}: expected 1, or 2 or more virtual stages "
                        f"per device with pp >= 2 (got pp={pp})")
    try:
        stage = stage_topology(topology, pp)
    except TopologyError as e:
        raise PlanError(f"pp={pp}: {e}") from None
    axes = tensor_axes(stage, tp)
    n = topology.num_devices
    if dp is not None and dp * tp * pp != n:
        raise PlanError(f"dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} devices; topology "
                        f"{topology.name!r} has {n}: expected dp={n // (tp * pp)}")
    dp = n // (tp * pp)
    batch = graph.batch_size
    if batch % dp:
        raise PlanError(f"batch {batch} over dp={dp} replicas: expected a batch divisible by dp")
    per_replica = batch // dp
    size = per_replica if microbatch_size is None else microbatch_size
    if not isinstance(size, int) or size < 1 or per_replica % size:
        raise PlanError(f"microbatch_size={microbatch_size!r}: expected a divisor of the "
                        f"per-replica batch {per_replica} (batch {batch} / dp={dp})")
    mesh = MeshShape.of(stage)
    strategy = megatron(graph, mesh, axes, sequence_parallel=sequence_parallel)
    strategy = dataclasses.replace(strategy, microbatches=per_replica // size)
    check_microbatches(graph, strategy.configs, mesh, strategy.microbatches)
    if pp > 1:
        strategy = strategy.with_pipeline(pp, interleave,
                                          "interleaved" if interleave > 1 else "1f1b")
    return with_recompute(graph, strategy, recompute)


def microbatch_sizes(per_replica: int) -> tuple[int, ...]:
    """The microbatch sizes a Megatron user tries: the powers of two that divide the
    per-replica batch, and the whole of it.

    >>> microbatch_sizes(280), microbatch_sizes(12)
    ((1, 2, 4, 8, 280), (1, 2, 4, 12))
    """
    powers = (1 << k for k in range(per_replica.bit_length()))
    return tuple(sorted({b for b in powers if per_replica % b == 0} | {per_replica}))


def megatron_grid(graph: OpGraph, topology, *, pp: Sequence[int] = (1,),
                  interleave: Sequence[int] = (1,),
                  tp: Sequence[int] = (1, 2, 4, 8)) -> dict[str, Strategy]:
    """Megatron's configuration grid (`megatron_3d`), by name: TP in {1, 2, 4, 8} (as the
    node allows, or those of `tp`; sequence parallel when TP > 1), DP over the rest,
    microbatches of every power of two samples dividing the per-replica batch, and all of it
    (`microbatch_sizes`), and recomputation none, selective or full, e.g.
    ``"megatron-tp8-mb1-full"``; with pipeline stages (each of `pp` and, for pp > 1, each of
    `interleave` virtual stages), e.g. ``"megatron-tp8-pp4-v2-mb1-full"``. Combinations the
    mesh, batch or schedule cannot take (`soapjax.pipeline.pipeline_error`: the interleaved
    schedule's M must be a multiple of pp) are left out.

    The search scores all of them and starts a chain from the fastest that fits, so a searched
    plan is never slower than the grid's best under the same simulator.
    """
    out = {}
    for stages, tp in itertools.product(pp, tp):
        n = topology.num_devices
        if n % (tp * stages) or graph.batch_size % (n // (tp * stages)):
            continue
        per = graph.batch_size // (n // (tp * stages))
        for v in (interleave if stages > 1 else (1,)):
            for mb in microbatch_sizes(per):
                for rec in RECOMPUTE_POLICIES:
                    pipe = f"-pp{stages}" + (f"-v{v}" if v > 1 else "") if stages > 1 else ""
                    try:
                        out[f"megatron-tp{tp}{pipe}-mb{mb}-{rec}"] = megatron_3d(
                            graph, topology, tp=tp, pp=stages, microbatch_size=mb,
                            interleave=v, recompute=rec, sequence_parallel=tp > 1)
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
