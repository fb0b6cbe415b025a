"""Where a pipeline cuts the graph: each operator's layer chunk, and what crosses between the
parts (a chunk boundary's activations, the prologue's hand-off to every stage, the epilogue's
parameters and the values its loss gathers), read off the graph alone and memoised per graph
by `soapjax.simulate.pipesim`, its only user; the pieces a boundary value is sent in
(`send_pieces`, per layout), the collectives the loss's gathers run (`loss_collectives`), and
the share of each operator's work a split backward defers to its W (`weight_shares`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from soapjax.base.errors import PlanError
from soapjax.graph._program import picked_dim, shifted_dims
from soapjax.graph.opgraph import OpGraph
from soapjax.simulate._flat_memory import shard_bytes
from soapjax.simulate._simresult import Kept
from soapjax.strategy._stage_groups import layer_span
from soapjax.strategy.space import Config, MeshShape, sample_dim

__all__ = ["boundary_values", "epilogue_gathers", "epilogue_params", "layer_chunks", "layer_span",
           "loss_collectives", "prologue_params", "send_pieces", "shifted_reads", "stash_bytes",
           "weight_operands", "weight_shares"]


def layer_chunks(graph: OpGraph, chunks: int, sizes: Sequence[int] = ()) -> list[int]:
    """Each operator's model chunk (graph order), for the layers cut into `chunks` runs of
    consecutive layers, equal ones or of `sizes` layers each (uneven stages:
    `Strategy.stage_layers`); operators before the first layer are in chunk 0, after the last
    in the last chunk, between two layers in the chunk of the layer before.

    Raises:
      PlanError: the graph has no repeated layers, or their number does not divide (or does
        not add up to `sizes`).
    """
    layer_of: dict[int, int] = {}
    groups = graph.repeated_blocks()
    num_layers = max((len(g) for g in groups), default=0)
    for group in groups:  # the longest family of layers (a model may repeat smaller blocks too)
        if len(group) == num_layers:
            for k, i in enumerate(group):
                layer_of[i] = k
    if not layer_of:
        raise PlanError(f"graph {graph.name!r} has no repeated layers (a scan over layers or "
                        "identical unrolled layers) to cut into pipeline stages")
    if sizes:
        if len(sizes) != chunks or sum(sizes) != num_layers:
            raise PlanError(f"stage layers {tuple(sizes)} do not cut {num_layers} layers into "
                            f"{chunks} pipeline chunks")
    elif num_layers % chunks:
        raise PlanError(f"{num_layers} layers do not cut into {chunks} equal pipeline chunks "
                        "(stages x virtual stages must divide the layer count)")
    sizes = tuple(sizes) or (num_layers // chunks,) * chunks
    chunk_of_layer = [c for c, n in enumerate(sizes) for _ in range(n)]
    first, last = min(layer_of), max(layer_of)
    out, current = [], 0
    for i in range(len(graph.operators)):
        if i in layer_of:
            current = chunk_of_layer[layer_of[i]]
        elif i < first:
            current = 0
        elif i > last:
            current = chunks - 1
        out.append(current)
    return out


def boundary_values(graph: OpGraph, chunk: Sequence[int]) -> tuple[tuple[tuple[int, int], ...],
                                                                      ...]:
    """Per chunk boundary, the activation values (producer, output index) a later chunk reads
    from an earlier one, each once, in the order the readers first read them."""
    ops = graph.operators
    index = {op.name: i for i, op in enumerate(ops)}
    crossing: list[dict[tuple[int, int], None]] = [dict() for _ in range(len(set(chunk)) - 1)]
    for j, op in enumerate(ops):
        for x in op.inputs:
            if x.kind != "activation":
                continue
            p = index[x.source]
            for b in range(chunk[p], chunk[j]):
                crossing[b][(p, x.index)] = None
    return tuple(tuple(c) for c in crossing)


def prologue_params(graph: OpGraph, first: int) -> tuple[str, ...]:
    """The parameters (their sources) the operators before the first layer read."""
    return _params_read(graph.operators[:first])


def epilogue_params(graph: OpGraph, last: int) -> tuple[str, ...]:
    """The parameters (their sources) the operators after the last layer read."""
    return _params_read(graph.operators[last + 1:])


def _params_read(ops: Sequence) -> tuple[str, ...]:
    """The parameters (their sources) `ops` read, each once, in order."""
    return tuple(dict.fromkeys(x.source for op in ops for x in op.inputs if x.kind == "param"))


def tied_params(graph: OpGraph, first: int, last: int) -> tuple[str, ...]:
    """The parameters (their sources) read both before the first layer and after the last
    (a tied embedding and head): Megatron-LM all-reduces their gradient between the first and
    the last stage, the two that hold them."""
    before = set(prologue_params(graph, first))
    return tuple(src for src in epilogue_params(graph, last) if src in before)


def epilogue_gathers(graph: OpGraph, last: int
                     ) -> tuple[tuple[int, int, tuple[int, ...], tuple[int | None, ...], bool],
                                ...]:
    """The values the operators after `last` (the epilogue: final norm, head, loss) index,
    slice, pad or concatenate along some dims (`soapjax.graph._program.shifted_dims`), which
    apply makes whole along those dims inside the last stage
    (`soapjax.apply._pipelined._run_in_stage`: XLA cannot partition them there), but for a
    gather that picks one element along a dim (`picked_dim`: the loss's pick of the labels'
    log-probabilities), which apply runs as a masked sum: ``(operator index, value id, those
    dims, each of the value's dims' iteration dim of the operator, None where it follows
    none; whether it is picked)``."""
    return shifted_reads(graph, last + 1)


def shifted_reads(graph: OpGraph, start: int
                  ) -> tuple[tuple[int, int, tuple[int, ...], tuple[int | None, ...], bool],
                             ...]:
    """`epilogue_gathers`' entries for the operators from `start` on (the layers' too: what
    a pipeline stage runs in its actions, `soapjax.simulate.pipesim`'s `stage_permutes`)."""
    prog, out = graph.program, []
    for j in range(start, len(graph.operators)):
        loc = prog.local[graph.operators[j].name]
        for i in loc.units:
            unit = prog.units[i]
            picked = picked_dim(unit.eqn) is not None
            for v, dims in zip(unit.ins, shifted_dims(unit.eqn)):
                if dims and v in loc.lab:
                    out.append((j, v, tuple(dims), tuple(loc.labels.lookup(lbl, loc.iter_of)
                                                         for lbl in loc.lab[v]), picked))
    return tuple(out)


def loss_collectives(graph: OpGraph, gathers: Sequence[tuple], choice: Callable[[int], Config],
                     mesh: MeshShape, microbatches: int, topology, memo: dict,
                     megatron: bool = False) -> tuple[tuple[str, int, tuple[str, ...], float],
                                                      ...]:
    """The collectives the last stage runs each microbatch for the epilogue's `gathers`
    (`epilogue_gathers`) where the configs (`choice`: an operator's) split them along the dims
    they index: an all-gather making the value whole along them, or, for a picking gather, an
    all-reduce of the picked values (each device sums its part: `picked_dim`) over those axes.
    ``(kind, bytes per device of one microbatch, axes, seconds)``; `memo` keeps them by
    value and layout. Tiny GPT's log-probabilities under Megatron's vocabulary split: an
    all-reduce of a microbatch's picked ones (docs/checks.md). Megatron-LM (`megatron`) runs
    the picks' all-reduces alone (its vocabulary-parallel loss)."""
    prog, M, out = graph.program, microbatches, []
    for j, v, dims, iters, picked in gathers:
        if megatron and not picked:
            continue
        config, batch = choice(j), sample_dim(graph.operators[j])
        axes = [config.axes[d] if d is not None and d < len(config.axes) else () for d in iters]
        # the batch's axes are the stages' data groups, manual in apply: kept split, not
        # gathered
        manual = [d for d, it in enumerate(iters) if it is not None and it == batch]
        gathered = tuple(a for d in dims if d not in manual for a in axes[d])
        if not gathered:
            continue
        whole = tuple(a if d in manual or d not in dims else () for d, a in enumerate(axes))
        key = (v, whole, gathered, M, picked)
        hit = memo.get(key)
        if hit is None:
            shape = [1 if picked and d in dims else n for d, n in enumerate(prog.shapes[v])]
            n = shard_bytes(shape, whole, prog.dtypes[v], mesh) // M
            kind = "all_reduce" if picked else "all_gather"
            hit = memo[key] = (kind, n, gathered, topology.collective_time(kind, n, gathered))
        out.append(hit)
    return tuple(out)


def send_pieces(shape: Sequence[int], spec: Sequence[Sequence[str]], mesh: MeshShape,
                nbytes: int) -> tuple[int, int, tuple[str, ...]]:
    """``(bytes sent, shard bytes, gather axes)`` of one boundary value (Megatron-LM's
    scatter/gather; `soapjax.simulate.pipesim.PipelinedSimulation._crossings`): cut
    ``r`` ways over the mesh axes it is not split over when a dim of its shard divides by
    ``r`` (the microbatch's share of the batch dim aside: the rule's dim is in practice the
    hidden one, the last)."""
    used = {a for axes in spec for a in axes}
    free = tuple(a for a in mesh.axis_names if a not in used)
    r = mesh.degree(free)
    if r == 1:
        return nbytes, nbytes, ()
    padded = [*spec, *[()] * (len(shape) - len(spec))]
    local = [size // mesh.degree(axes) if size % mesh.degree(axes) == 0 else size
             for size, axes in zip(shape, padded)]
    if not any(d % r == 0 for d in local[1:]):  # dim 0: the batch, cut into microbatches
        return nbytes, nbytes, ()
    return nbytes // r, nbytes, free


def weight_shares(graph: OpGraph) -> tuple[float, ...]:
    """Per operator (graph order), the share of its forward's FLOPs in *weight matmuls*:
    ``dot_general`` equations whose one operand is a parameter (a layer's slice included) or
    its cast and whose other is a float value. A schedule that splits the backward
    (`soapjax.strategy.pipeline`'s ``"zb-h1"``) runs their weights' gradients, the same FLOPs
    again, as its W actions (`soapjax.apply._deferred`, which defers these matmuls in the
    layers); `soapjax.simulate.pipesim` prices a layer operator's W as this share of its
    forward's time. Other equations count one FLOP per output element."""
    prog = graph.program
    weights = _weight_values(prog)
    inexact = [d.startswith(("float", "bfloat")) for d in prog.dtypes]
    out = []
    for op in graph.operators:
        total = weight = 0.0
        for i in prog.local[op.name].units:
            u = prog.units[i]
            outs = [v for v in u.outs if v is not None]
            if u.eqn.primitive.name == "dot_general" and len(u.ins) == 2 and outs:
                (contract, _), _ = u.eqn.params["dimension_numbers"]
                lhs = prog.shapes[u.ins[0]]
                flops = 2.0 * math.prod(prog.shapes[outs[0]]) * math.prod(lhs[d] for d in contract)
                total += flops
                if (sum(v in weights for v in u.ins) == 1
                        and all(inexact[v] for v in u.ins)):
                    weight += flops
            else:
                total += sum(math.prod(prog.shapes[v]) for v in outs)
        out.append(weight / total if total else 0.0)
    return tuple(out)



def weight_operands(graph: OpGraph) -> tuple[tuple[tuple[int, bool], ...], ...]:
    """Per operator, the positions of its operands that its weight matmuls (`weight_shares`)
    read as their other operand, each with whether the matmul reads the operand itself
    (True), or a value made inside the operator from it (GPT's GELU before fc2: False, and
    the operands of that value's shape are given), as `soapjax.apply._pipelined` holds its
    stash (only what a matmul reads itself can be kept lean)."""
    prog = graph.program
    weights = _weight_values(prog)
    out = []
    for op in graph.operators:
        found: dict[int, bool] = {}
        for i in prog.local[op.name].units:
            u = prog.units[i]
            if (u.eqn.primitive.name != "dot_general" or len(u.ins) != 2
                    or sum(v in weights for v in u.ins) != 1):
                continue
            x = u.ins[0] if u.ins[1] in weights else u.ins[1]
            at = [k for k, o in enumerate(op.inputs) if o.value == x]
            alike = [k for k, o in enumerate(op.inputs) if o.kind == "activation"
                     and tuple(prog.shapes[o.value]) == tuple(prog.shapes[x])]
            for k in at or alike:
                found[k] = found.get(k, False) or bool(at)
        out.append(tuple(sorted(found.items())))
    return tuple(out)


def stash_bytes(graph: OpGraph, ranges: Sequence[tuple[int, int]],
                operands: Sequence[tuple[tuple[int, bool], ...]],
                io: Mapping[int, tuple[tuple[Kept, ...], tuple[Kept, ...]]],
                outside: Sequence[bool]
                ) -> tuple[list[int], list[tuple[tuple[Kept, ...], tuple[Kept, ...]]]]:
    """Per chunk (its operators' index `ranges`), what a microbatch whose B has run and W
    has not holds under a split backward, and what its W gathers again: its layer
    operators' (not `outside`) weight matmuls' operands (`operands`: `weight_operands`; each
    value once: attention's q, k and v read one) and outputs, per device, as the stash keeps
    them (`io`: `Simulation.stash_io_by_operator` of those operators; lean where the stage
    holds a value smaller than the matmul uses it, an operand made inside the operator as
    used): the stash of `soapjax.apply._deferred`; the residuals are dropped at the B. The
    second list holds, per chunk, its lean entries (`Kept`: operands, then outputs'
    cotangents), which its W all-gathers again each microbatch."""
    ops = graph.operators
    totals, gathers = [], []
    for lo, hi in ranges:
        seen: set[tuple[str, int]] = set()
        total, lean_x, lean_dy = 0, [], []
        for i in range(lo, hi):
            if not operands[i] or outside[i]:
                continue
            read, outputs = io[i]
            xs = []
            for k, direct in operands[i]:
                x = ops[i].inputs[k]
                if (x.source, x.index) not in seen:
                    seen.add((x.source, x.index))
                    xs.append(read[k] if direct else Kept(read[k].used, read[k].used, ()))
            total += sum(e.kept for e in (*xs, *outputs))
            lean_x += [e for e in xs if e.axes]
            lean_dy += [e for e in outputs if e.axes]
        totals.append(total)
        gathers.append((tuple(lean_x), tuple(lean_dy)))
    return totals, gathers


def _weight_values(prog) -> set[int]:
    """The program's parameters (layers' slices included) and their casts to the compute
    dtype: what a weight matmul reads as its weight."""
    weights = set(prog.param_like)
    for u in prog.units:
        if u.eqn.primitive.name == "convert_element_type" and u.ins and u.ins[0] in weights:
            weights.update(v for v in u.outs if v is not None)
    return weights
