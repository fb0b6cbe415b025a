"""Hand-made strategies: the baselines every searched plan is compared with (and starts from).

Each is a `Strategy` scored by the same simulator, so comparisons are like for like:

* ``data-parallel``: every operator split over its sample dim by every mesh axis.
* ``megatron``: Megatron-LM tensor parallelism over the innermost in-node mesh axis (matmuls
  alternate column- and row-parallel: a layer whose input arrives split along its contracting
  dim splits that dim, others split their output features; everything else follows its input)
  with data parallelism over every other axis.
* ``fsdp``: data parallel compute with parameters, gradients and optimizer state sharded over
  every axis (ZeRO-3).
* ``expert``: the FlexFlow paper's expert strategies: for CNNs, data parallel convolutions and
  pooling with model-parallel dense layers (Krizhevsky's "one weird trick"); for RNNs, data
  parallel across nodes and model parallel within a node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from soapjax.graph import Operator, OpGraph
from soapjax.space import Config, MeshShape, Strategy, data_parallel, dividing_axes, sample_dim

_DENSE = ("dot_general", "conv_general_dilated", "scan")

# Every baseline's name, as `baselines` returns them (with no family: both experts).
NAMES: tuple[str, ...] = ("data-parallel", "megatron", "fsdp", "expert-cnn", "expert-rnn")


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


def _p_dims(op: Operator) -> list[int]:
    return [d for d in op.divisible_dims if d < len(op.shape) and op.roles[d] == "P"]


def _weights(op: Operator) -> bool:
    return op.anchor in _DENSE and any(o.kind == "param" and len(o.shape) >= 2 for o in op.inputs)


def megatron(graph: OpGraph, mesh: MeshShape, intra: Sequence[str]) -> Strategy:
    """Tensor parallel over the `intra` (in-node) axes, data parallel over the others."""
    outer = [a for a in mesh.axis_names if a not in intra]

    def choose(op: Operator, incoming: dict[int, list[str]]) -> list[int]:
        if not _weights(op):
            return []
        n = len(op.shape)
        split_in = [d for d, axes in incoming.items() if d >= n and set(axes) & set(intra)]
        return split_in or _p_dims(op)  # row parallel if the input arrives split, else column

    return _layered(graph, mesh, outer, intra, choose)


def fsdp(graph: OpGraph, mesh: MeshShape) -> Strategy:
    """Data parallel compute, parameters and optimizer state sharded over every axis."""
    return Strategy(data_parallel(graph, mesh).configs, zero_axes=tuple(mesh.axis_names))


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


def baselines(graph: OpGraph, topology, family: str | None = None) -> dict[str, Strategy]:
    """Every baseline for `graph` on `topology`, by name.

    Args:
      graph: the operator graph.
      topology: a `Topology` (its node structure decides which axes are intra-node).
      family: "cnn", "rnn", "transformer" or "mlp" (the zoo's `Workload.family`); None gives
        both paper experts.
    """
    mesh = MeshShape.of(topology)
    intra = intra_node_axes(topology) or tuple(mesh.axis_names[-1:])
    out = {"data-parallel": data_parallel(graph, mesh),
           "megatron": megatron(graph, mesh, intra[-1:]),  # TP on the innermost node axis
           "fsdp": fsdp(graph, mesh)}
    families = {"cnn": ["cnn"], "rnn": ["rnn"]}.get(family or "", ["cnn", "rnn"])
    for f in families:
        out[f"expert-{f}"] = expert(graph, mesh, intra, f)
    return out
