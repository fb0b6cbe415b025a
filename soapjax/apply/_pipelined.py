"""Pipeline parallelism as one SPMD program: the traced step cut at its layer scan, its chunks
run on the ``stage`` mesh axis in a schedule's order, activations passed by `jax.lax.ppermute`.

It stays one module past ~600 lines because its three parts (the program cut at its layer scan,
the tick table with its buffer slots, the tick loop that runs them) are one program's pieces,
used by nothing but each other: the loop reads the cut's values and the table's columns by
position. What a pipeline decides before its step runs (the layer scan, the mesh, where the
parameters live) is `soapjax.apply._pipeline_layout`.

The traced loss (`soapjax.graph.opgraph.trace`) of a model whose layers are one scan over stacked
parameters (``nn.scan``: the zoo's GPT, LLaMA and MoE) is cut in three
(`soapjax.graph._program.LayerScan` records what each unrolled layer reads): the *prologue* (the
equations before the layers: the embeddings), one *layer* (layer 0's equations as a function of its
parameter slices, the carry and the values every layer reads), and the *epilogue* (final norm, head,
loss). Outputs the layers stack (the MoE's per-layer load-balancing loss) ride with the carry
as ``[L, ...]`` stacks, each chunk adding its layers' rows, the last handing them to the
epilogue (`_chunk_fn`). The L layers are cut into ``C = S * v`` chunks of ``L / C`` layers;
device stage ``s`` holds chunks `soapjax.strategy.pipeline.chunks_of` ``(s, S, v)``, and every
stacked parameter ``[L, ...]`` is stored in the *pipelined layout* ``[v, S, L / C, ...]`` (chunk
``c = j S + s`` at ``[j, s]``), sharded over ``stage`` on its second dim, so a stage holds its
own layers only
(`soapjax.apply._pipeline_layout`: `to_pipelined`, `pipelined_layout_shardings`). Uneven stages
(one virtual stage, ``stage_layers`` per stage) store them ``[1, S, max(stage_layers), ...]``
(`stage_router`: each stage's run, padded), and each stage's layer scan passes the carry
through its padding (a ``lax.cond`` on the count of layers it runs).

The step is one program (as MaxText's and praxis's pipelines are): nothing new to launch, so it
runs unchanged over processes under `jax.distributed`. In it:

* the prologue runs SPMD on all devices, before the pipeline, for all M microbatches at once
  (``jax.vmap`` over them), each operator's outputs held to the plan's layouts (as the flat
  step holds them: left to XLA, an embedding's were laid out with the samples whole, from which
  XLA reached the stages' data groups by replicating and slicing, not by the all-to-all the
  simulator prices); what it hands the layers and the epilogue is passed to every stage;
  its backward runs after the pipeline, on each stage from the cotangents that stage returns
  (the first stage's, of the embeddings; the epilogue's parameters', on the last), and the
  gradients of the parameters read outside the layers are summed over the stages (one
  all-reduce of those, not of the activations handed to the stages, a whole batch's);
* the layers run inside `jax.shard_map`, manual over ``stage`` and the data axes (those the
  layers split their samples over, ``data_axes``: `soapjax.strategy.space.batch_axes`, whether
  or not the batch arrives split over them): the other mesh axes stay automatic, so model sharding
  still applies inside a stage, and each data group runs its own samples of each microbatch
  (below);
* the epilogue runs on the last stage, as part of the last chunk: its forward adds the
  microbatch's loss, its backward seeds the chunk's backward with ``1 / M`` (``1 / (M D)``
  with D data groups, below).

The schedule is a static *tick table* (`ticks`): every stage runs the actions of
`soapjax.strategy.pipeline.device_orders` in their order, each at the first tick at which what it
needs has arrived (a forward: the previous chunk's forward, one tick earlier or more; a backward:
the
next chunk's backward). The ticks run as one ``lax.fori_loop``; at each tick

1. every stage runs its own action: one ``lax.switch`` on ``kind[tick, stage]`` over the kinds
   of action the schedule has (idle; forward or backward; of the first, a middle or the last
   chunk; and, where the schedule splits the backward, W: the weights' gradients of a
   chunk, `soapjax.apply._deferred`), with the microbatch, the local chunk and the buffer
   slots read from ``[tick, stage]`` tables;
2. per direction, one ``lax.switch`` on the tick (every device takes the same branch, so the
   collective in it is well formed) picks the ``ppermute`` over exactly the stage pairs that
   send at that tick: the activations the forwards made go to the next chunk's stage, the
   gradients the backwards made to the previous chunk's stage, and ticks without a send send
   nothing.

So the program holds one collective-permute per direction and set of sending stages, and one
run sends what the schedule needs and nothing more: per microbatch and chunk boundary one
activation forward and one gradient back, ``M (C - 1)`` of each (measured on the tiny GPT,
stage 2 x data 2 x model 2, M = 4, Megatron's model split: 1F1B holds 1 + 1 collective-permutes
of 2048 bytes per device (scatter/gather, below: half the 4096 of a microbatch's activation)
and sends 4 + 4 times; interleaved with v = 2 and 4 layers 3 + 3 (one stage sending, the
other, or both) and sends 12 + 12 stage-to-stage). A loop rather than
unrolled ticks because the program then does not grow with M: unrolled, the interleaved tiny
GPT compiled in 14-18 s, as a loop in 5-7 s (XLA:CPU, backend optimisation 0, 2 busy cores).

The sends are Megatron-LM's *scatter/gather* (Narayanan et al. SC'21, section 4.1): a value
replicated over the stage's automatic axes (the residual stream under tensor parallelism) would
be sent whole by each of its ``r`` replicas, so each sends a ``1 / r`` piece over its own link
and the receiver all-gathers the pieces over the ``r`` replicas. The rule, per value sent (as
`soapjax.simulate.pipesim` prices it): ``R`` = the automatic mesh axes (all but the stage axis and
the data axes) over which the value is not already split, ``r`` = the product of their sizes; if
``r > 1`` and some dim of the value's per-device shape is divisible by ``r``, the *last* such
dim is split over all of ``R``, in mesh order, for the transfer; otherwise the value goes
whole. A value is held in its plan's layout over the automatic axes (`StageLayouts`: the
layout of the operator that makes it; replicated without a plan, what Megatron's split makes
of the residual stream and its gradient): constrained to it, then to the split (a local
slice), sent (the ppermute in a shard_map manual over the split's axes too: in the stage's
own, a ppermute gathers its operand over the automatic axes first) and constrained back to
its layout (the all-gather). Under sequence parallelism the carry is split along the
sequence over the model axes already, so each device sends its own shard and nothing is
gathered. Without the first constraint XLA carries the split back into the layers (the tiny
GPT's 1F1B step above then ran 16 all-gathers and 19 all-reduces over ``model`` in the
loop, 150,016 bytes, for the 8 all-reduces, 49,152 bytes, it runs either way). On the tiny
GPT above (``R`` = model, ``r`` = 2): a microbatch's ``[2, 8, 32]`` float64 activation goes
as ``[2, 8, 16]``, 2048 bytes per device instead of 4096, then one all-gather over ``model``
(4096 bytes out) per send; every other collective of the step is the same as without
scatter/gather. Where the stages run whole
microbatches while the batch is split over automatic data axes, a value's layout over those
is XLA's own, so values go whole (where tried, constraining them deadlocked XLA:CPU: its
resharding put collective-permutes in the stages' own branches, which only half the devices
run); ``scatter_gather=False`` sends them
whole too, as Megatron's ``--no-scatter-gather-tensors-in-pipeline`` does.

Received values wait in slot buffers until their action runs; the slots are allocated from the
tick table, so a stage keeps as many activations as its schedule has in flight (1F1B: at most S;
GPipe: M). Without recomputation a forward keeps its chunk's residuals (what ``jax.vjp`` saves,
but for the parameters and the values the stage already holds) in a slot until the backward;
with ``recompute="full"`` it keeps only the chunk's input, and the backward recomputes the chunk's
forward from it; with ``"selective"`` each layer runs in a ``jax.checkpoint`` saving its
matmuls' outputs and the outputs of the attention-core operators a plan keeps (``kept``,
`kept_positions`), the rest recomputed. Gradients are summed over microbatches and the loss
is the mean of the microbatch losses: the unsharded step's, for a loss that is a mean over its
samples (as the zoo's are). Microbatch ``k`` holds samples ``k, k + M, ...`` (as
`soapjax.apply.step` splits them).

Data parallelism inside a stage: the stages run the program traced at one data group's share
of a microbatch (B / (M D) samples for D groups), so each group's backward adds its own
partial gradients to its own accumulator, the loss of each group's share weighted 1 / (M D),
and one ``psum`` over the data axes after the tick loop sums them: the gradients are
synchronised once per step, as `soapjax.simulate.pipesim` prices it. With the data axes left
automatic instead, XLA all-reduces every backward's parameter gradients over them as it adds them to
the (data-replicated) accumulator, inside the loop: M times per step (measured on the tiny GPT,
stage 2 x data 2 x model 2, M = 4, 1F1B: 68,480 bytes per backward on stage 0, 51,584 on stage
1, where the sum once after the loop is 86,920, the loss and the embeddings' included). Where
the data groups do not divide a microbatch, or a value the prologue hands the stages has no
sample dim, the stages run whole microbatches and XLA places the reduction itself (in the loop).
Where the samples interact (a statistic over the microbatch: an MoE's load-balancing loss, a
batch norm), the groups add each sum over the samples the statistics start from across each
other (`_Groups.sums`, a ``psum``), so every group computes the microbatch's statistics
(`_whole_statistics`); where a statistic is no sum (a sort over the batch), the stages run
whole microbatches.

Usage::

    graph = soapjax.graph.opgraph.trace(w.loss_fn, params, batch)
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"),
                         axis_types=(AxisType.Auto,) * 3)
    step = jax.jit(pipelined_value_and_grad(graph, mesh, stages=2, microbatches=4,
                                            data_axes=("data",)))
    specs = jax.tree.map(lambda _: PartitionSpec(), params)  # or a plan's
    placed = jax.device_put(to_pipelined(graph, params, stages=2),
                            pipelined_layout_shardings(graph, mesh, specs, stages=2))
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    loss, grads = step(placed, batch)                # grads in the pipelined layout
    grads = from_pipelined(graph, grads, stages=2)   # the model's layout again

XLA aborts the process (``Check failed: partition_group_list...`` in
``spmd_partitioner_util.cc``, either partitioner) when it partitions a gather whose operand is
split along a dim the gather indexes inside a `jax.shard_map` manual over some of the axes:
LLaMA's untied head split over the vocabulary, as Megatron splits it, then the loss's
``take_along_axis`` of the log-probabilities. So inside a stage (`_run_in_stage`) a gather that
picks one element along a dim per index (`soapjax.graph._program.picked_dim`: that
``take_along_axis``) runs as a masked sum along the dim (`_masked_pick`): on the last stage, an
all-reduce over ``model`` of a microbatch's picked log-probabilities, as Megatron-LM's
vocabulary-parallel loss runs; any other gather's operand is first made whole along the dims it
indexes (`tests/test__pipelined.py` keeps a canary of the abort).

`soapjax.apply.step` runs a pipelined `Strategy` with `PipelinedStep`, its step program: the
parameters in the model's layout on `pipelined_mesh` (the user's mesh, its outermost axis cut
into ``stage``; an interleaved pipeline's stacked layers in chunk order,
`soapjax.apply._layer_order`), reshaped to the pipelined layout inside the step and the
gradients back.

Refused with a `PlanError`: a loss that draws random bits (dropout: microbatches would draw
other masks than the whole batch, as in `soapjax.strategy.memory.random_operator`), several layer
scans or nested ones, scans that slice anything but parameters, stack per-layer outputs or run in
reverse, and a stacked parameter read outside the layers.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from soapjax.apply._deferred import (
    DEFERRED_NAME,
    WeightMatmul,
    deferred_dot,
    stash_of,
    stash_shapes,
    weight_grads,
    weight_matmuls,
)
from soapjax.apply._flatstep import _Layouts, split_microbatches
from soapjax.apply._layer_order import ChunkOrdered, unwrapped
from soapjax.apply._pipeline_layout import (
    STAGE_AXIS,
    check_pipelinable,
    check_stage_axis,
    chunk_ordered,
    from_pipelined,
    kept_positions,
    layer_recompute,
    layer_scan,
    pipelined_layout_shardings,
    pipelined_mesh,
    stacked_params,
    stage_mesh_shape,
    stage_router,
    to_pipelined,
)
from soapjax.apply._validation import Checked, validate_program_inputs
from soapjax.base.attention import AttentionCall, attention_call, bind_attention
from soapjax.base.errors import PlanError
from soapjax.cost.reshard_steps import steps as layout_steps
from soapjax.graph._inner import splits_queries
from soapjax.graph._program import LayerScan, Program, picked_dim, shifted_dims
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy._stage_groups import stage_strategy
from soapjax.strategy.pipeline import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    Action,
    ScheduleName,
    device_orders,
)
from soapjax.strategy.space import RECOMPUTE_POLICIES, MeshShape, RecomputePolicy, batch_axes

__all__ = ["BranchRuns", "PipelinedStep", "StageLayouts", "branch_runs", "stage_layouts",
           "count_branch_runs", "pipelined_value_and_grad", "ticks"]


# --------------------------------------------------------------------------------------------
# The program cut at its layer scan


class _Cut(NamedTuple):
    """A traced program as prologue, one layer and epilogue, and what flows between them.

    Attributes:
      program: the program.
      scan: its layer scan.
      prologue, layer, epilogue: unit indices (``layer``: layer 0's, slices excluded).
      params, batch: the program ids of the parameter and batch leaves, in flattening order.
      stacked: positions in ``params`` of the scanned parameters, in the scan's order.
      shared: ids the layers or epilogue read that do not depend on the batch.
      per_mb: ids they read that do (one per microbatch); the layers' first carry first.
      layer_reads, epilogue_reads: the ids of ``shared + per_mb`` each part reads.
      graph: the graph it was cut from.
      stacked_ys: per output a layer stacks (``(carry, aux)`` of an MoE layer: its
        load-balancing loss), the id of the ``[L, ...]`` stack the epilogue reads; the
        epilogue's units that stack them are not in ``epilogue`` (the pipeline carries the
        stack from chunk to chunk and hands the last chunk the whole of it: `_chunk_fn`).
    """

    program: Program
    scan: LayerScan
    prologue: tuple[int, ...]
    layer: tuple[int, ...]
    epilogue: tuple[int, ...]
    params: tuple[int, ...]
    batch: tuple[int, ...]
    stacked: tuple[int, ...]
    shared: tuple[int, ...]
    per_mb: tuple[int, ...]
    layer_reads: tuple[int, ...]
    epilogue_reads: tuple[int, ...]
    graph: OpGraph
    stacked_ys: tuple[int, ...] = ()


def _cut(graph: OpGraph) -> _Cut:
    """The graph's program cut at its layer scan (module doc)."""
    prog = graph.program
    scan, stacked = layer_scan(graph)
    params = tuple(info.value for info in graph.params)
    batch = tuple(info.value for info in graph.batch)
    if list(prog.inputs) != list(params + batch) or len(prog.outputs) != 1:
        raise PlanError(f"graph {graph.name!r}: pipelining needs a loss traced as "
                        "loss_fn(params, batch) -> scalar")
    in_layers = [i for i, u in enumerate(prog.units) if u.iteration]
    first, last = in_layers[0], in_layers[-1]
    assert in_layers == list(range(first, last + 1)), "a scan's units are contiguous"
    layers = _layer_units(prog, range(first, last + 1), len(scan.steps))
    stacks = _ys_stacks(prog, scan, range(last + 1, len(prog.units)), graph.name)
    epilogue = tuple(i for i in range(last + 1, len(prog.units)) if i not in stacks)
    made = _made(prog, range(first))
    epi_reads = ((_read(prog, epilogue) | {prog.outputs[0]}) - _made(prog, epilogue)
                 - set(stacks.values()))
    strays = (epi_reads & _made(prog, range(first, last + 1))) - set(scan.carries[-1])
    if strays:
        raise PlanError(f"graph {graph.name!r}: what follows the layers reads values made "
                        "inside them other than their final carry; pipelining needs it to "
                        "read the carry only")
    roots = {params[k] for k in stacked}
    if roots & (_read(prog, range(first)) | epi_reads):
        raise PlanError(f"graph {graph.name!r}: a stacked layer parameter is read outside the "
                        "layers; pipelining needs it read by the layers only")
    fixed = set(prog.consts) | set(prog.literals)
    epi_reads -= set(scan.carries[-1]) | fixed
    carry = tuple(dict.fromkeys(scan.carries[0]))
    if not all(jnp.issubdtype(prog.jax_dtypes[v], jnp.inexact) for v in carry):
        raise PlanError(f"graph {graph.name!r}: the layers' carry holds non-float values; "
                        "pipelining sends the carry and its gradient between stages")
    needed = (set(scan.consts) - fixed) | epi_reads
    on_batch = _on_batch(prog, range(first), set(batch))
    per_mb = carry + tuple(sorted(v for v in needed - set(carry) if v in on_batch))
    shared = tuple(sorted(needed - set(per_mb)))
    assert needed - set(per_mb + shared) == set() and (made | set(prog.inputs) | fixed) >= needed
    return _Cut(prog, scan, tuple(range(first)), layers, epilogue, params, batch, stacked,
                shared, per_mb, tuple(sorted(set(scan.consts) - fixed)), tuple(sorted(epi_reads)),
                graph, tuple(stacks.values()))


def _ys_stacks(prog: Program, scan: LayerScan, idxs: range, name: str) -> dict[int, int]:
    """Per output the layers stack (`LayerScan.ys`, in the layer's order), the unit among
    `idxs` that stacks it (the traced ``jnp.stack`` of every layer's value) and its result:
    ``{unit: stack id}``; PlanError where a layer's output is stacked other than once, in
    order, or is not a float (the pipeline carries the stack and its cotangent)."""
    if not scan.ys or not scan.ys[0]:
        return {}
    out: dict[int, int] = {}
    for k in range(len(scan.ys[0])):
        wanted = [step[k] for step in scan.ys]
        found = [i for i in idxs if list(prog.units[i].ins) == wanted]
        if (len(found) != 1 or not jnp.issubdtype(prog.jax_dtypes[wanted[0]], jnp.inexact)
                or prog.units[found[0]].outs[0] is None):
            raise PlanError(f"graph {name!r}: its layer scan stacks a per-layer output that "
                            "the rest does not read as one stack of floats; pipelining "
                            "carries such a stack from stage to stage and needs it so")
        out[found[0]] = prog.units[found[0]].outs[0]
    return out


def _layer_units(prog: Program, idxs: range, length: int) -> tuple[int, ...]:
    """Layer 0's units (its slices excluded), after checking every layer runs the same
    equations (a scan's body, inlined once per layer)."""
    per_layer: list[list[int]] = [[] for _ in range(length)]
    for i in idxs:
        u = prog.units[i]
        if len(u.iteration) != 1:
            raise PlanError("pipelining needs one flat layer scan, but the layers hold a nested "
                            "scan over parameters (nn.remat_scan)")
        if i not in prog.slice_units:
            per_layer[u.iteration[0][1]].append(i)
    body = [prog.units[i].eqn for i in per_layer[0]]
    for t, units in enumerate(per_layer):
        assert [prog.units[i].eqn for i in units] == body, f"layer {t} is not layer 0's body"
    return tuple(per_layer[0])


def _made(prog: Program, idxs) -> set[int]:
    return {v for i in idxs for v in prog.units[i].outs if v is not None}


def _read(prog: Program, idxs) -> set[int]:
    return {v for i in idxs for v in prog.units[i].ins}


def _on_batch(prog: Program, idxs, batch: set[int]) -> set[int]:
    """The ids computed by units `idxs` from the batch (and the batch leaves)."""
    out = set(batch)
    for i in idxs:
        u = prog.units[i]
        if any(v in out for v in u.ins):
            out.update(v for v in u.outs if v is not None)
    return out


class _Groups(NamedTuple):
    """The data groups a microbatch is cut into inside a stage (module doc).

    Attributes:
      axes: the mesh axes the groups are split over (manual in the stage's shard_map); empty
        where a stage runs its whole microbatch.
      count: how many groups (the product of the axes' sizes; 1 without axes).
      batch_dims: per value of `_Cut.per_mb`, the dim that holds its samples.
      sums: where the samples interact (`OpGraph.sample_coupling`), the stage program's sums
        over them (`OpGraph.sample_sums`), which the groups add across each other: each then
        computes the whole microbatch's statistics (`_whole_statistics`).
      literals: with `sums`, the stage program's literals traced at the whole microbatch's
        size where they differ at a group's (a mean's divisor), by value id.
    """

    axes: tuple[str, ...]
    count: int
    batch_dims: tuple[int, ...]
    sums: frozenset[int] = frozenset()
    literals: Mapping[int, Any] = {}


def _data_groups(graph: OpGraph, outer: _Cut, mesh: Mesh, microbatches: int,
                 data_axes: Sequence[str], stage_axis: str) -> tuple[_Cut, _Groups]:
    """The program a stage runs, cut (`_cut`) at one data group's share of a microbatch, and
    the groups. The microbatch's own cut without groups where `data_axes` split nothing, the
    groups do not divide the microbatch, a value the prologue hands the stages has no
    sample dim (one the batch was reduced into), or the samples interact
    (`OpGraph.sample_coupling`: an MoE layer's load-balancing loss, a statistic over the
    microbatch as the unpipelined step computes it) other than through sums over them, or the
    two programs do not pair unit for unit: there XLA reduces the gradients where it places
    them, as each microbatch's backward adds them (module doc). Where the samples interact
    through sums only (`OpGraph.sample_sums`), the groups add those sums across each other
    and each computes the whole microbatch's statistics (`_whole_statistics`).

    Raises:
      PlanError: a data axis is not on the mesh, or is the stage axis.
    """
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    bad = [a for a in data_axes if a not in sizes or a == stage_axis]
    if bad or len(set(data_axes)) < len(data_axes):
        raise PlanError(f"data_axes={tuple(data_axes)}: expected distinct axes of the mesh "
                        f"{sizes} other than the stage axis {stage_axis!r}, the ones the batch "
                        f"is split over")
    count = int(np.prod([sizes[a] for a in data_axes], dtype=np.int64))
    whole = outer, _Groups((), 1, (0,) * len(outer.per_mb))
    micro = graph.batch_size // microbatches
    if count == 1 or micro % count or (graph.sample_coupling and graph.sample_sums is None):
        return whole  # (statistics over the microbatch, as unpipelined, other than by sums)
    cut = _cut(graph.at_batch_size(micro // count))
    dims = _batch_dims(outer, cut, count)
    if dims is None:
        return whole
    if not graph.sample_coupling:
        return cut, _Groups(tuple(data_axes), count, dims)
    # the sums by the microbatch's trace (paired value for value with the group's: a trace at
    # one sample cannot tell its sample dim from a dim of size one)
    literals = _whole_statistics(outer.program, cut.program)
    if literals is None or outer.graph.sample_sums is None:
        return whole
    return cut, _Groups(tuple(data_axes), count, dims, frozenset(outer.graph.sample_sums),
                        literals)


def _whole_statistics(whole: Program, share: Program) -> dict[int, Any] | None:
    """What a group's program (`share`, traced at its share of a microbatch) needs, besides
    its sums over the samples added across the groups, to compute the statistics of the
    whole microbatch (`whole`, traced at its size): the literals that differ between the two
    traces, whole's, by value id (a mean's divisor, a ``1 / B`` scale of each sample's loss
    before a sum). None where the programs do not pair unit for unit (the same primitives on
    the same value ids), as traces of one function at two batch sizes do.

    Every statistic is a sum over the samples followed by computations without a sample dim
    (`OpGraph.sample_sums`): with the sums added across the groups and these literals, each
    group computes what the unpipelined step computes on the whole microbatch, and each
    sample's own values (a token's route by the batch's load) too. So every group's loss is
    the microbatch's, and the gradients, summed over the groups with the ``1 / (M D)`` seed
    (module doc), are the microbatch's: the transpose of the sum across the groups is a sum
    across them, of each group's share of the cotangent."""
    a, b = whole.units, share.units
    if len(a) != len(b) or any(x.eqn.primitive is not y.eqn.primitive or x.ins != y.ins
                               or x.outs != y.outs for x, y in zip(a, b)):
        return None
    if whole.literals.keys() != share.literals.keys():
        return None
    return {v: whole.literals[v] for v, x in share.literals.items()
            if not np.array_equal(np.asarray(whole.literals[v]), np.asarray(x))}


def _batch_dims(outer: _Cut, cut: _Cut, count: int) -> tuple[int, ...] | None:
    """Per per-microbatch value, its sample dim: the one dim `count` times smaller in `cut`
    (traced at 1 / count of the samples) than in `outer`. None where a value has no such dim,
    or where the two cuts do not pair value for value (same dtypes, shared values' shapes)."""
    if (len(outer.shared), len(outer.per_mb)) != (len(cut.shared), len(cut.per_mb)):
        return None
    whole, share = outer.program.shapes, cut.program.shapes
    dtypes_of_whole, dtypes_of_share = outer.program.jax_dtypes, cut.program.jax_dtypes
    pairs = list(zip(outer.shared + outer.per_mb, cut.shared + cut.per_mb))
    if any(dtypes_of_whole[a] != dtypes_of_share[b] or len(whole[a]) != len(share[b])
           for a, b in pairs):
        return None
    if any(tuple(whole[a]) != tuple(share[b]) for a, b in pairs[:len(outer.shared)]):
        return None
    dims = []
    for a, b in pairs[len(outer.shared):]:
        differ = [d for d, (x, y) in enumerate(zip(whole[a], share[b])) if x != y]
        if len(differ) != 1 or whole[a][differ[0]] != count * share[b][differ[0]]:
            return None
        dims.append(differ[0])
    return tuple(dims)


def _env(prog: Program, values: dict[int, Any]) -> dict[int, Any]:
    env = dict(prog.consts)
    env.update(prog.literals)
    env.update(values)
    return env


def _prologue_fn(cut: _Cut, hook: Callable | None = None) -> Callable:
    """``(other params, batch) -> (shared values, per-microbatch values)``, the batch one
    microbatch's (the function is vmapped over microbatches). `hook`: `Program.run_units`'s
    (the one holding values to `_Pipeline.prologue_constraints`)."""
    other = [v for k, v in enumerate(cut.params) if k not in cut.stacked]

    def prologue(params: Sequence[Any], batch: Sequence[Any]) -> tuple[list, list]:
        env = _env(cut.program, dict(zip(other, params)))
        env.update(zip(cut.batch, batch))
        cut.program.run_units(cut.prologue, env, hook=hook)
        return [env[v] for v in cut.shared], [env[v] for v in cut.per_mb]

    return prologue


def _run_in_stage(prog: Program, idxs: Sequence[int], env: dict,
                  whole_queries: bool = False, hook: Callable | None = None,
                  reads: Mapping[int, Sequence[tuple]] | None = None,
                  swaps: Mapping[int, Callable] | None = None) -> None:
    """``prog.run_units(idxs, env)`` inside the stage's shard_map, with every gather that
    picks one element per index run as a masked sum (`_masked_pick`) and the operand of every
    other first made whole along the dims it indexes (module doc: XLA aborts otherwise). With
    `whole_queries` (the plan splits attention's query sequence), every flash attention
    equation is bound with its queries as one block and every tile computed
    (`soapjax.base.attention.bind_attention`'s ``whole_queries``): XLA's partitioner runs that
    attention there, and blocks of queries, or a conditional per tile, would have it gather
    the queries whole and compute them on every device. `hook`, `reads`: `Program.run_units`'s
    (the plan's output and operand layouts, `_Pipeline._constraint_hook`). `swaps`: more
    units run by other functions of their operands (the weight matmuls of a split backward,
    `soapjax.apply._deferred`)."""
    calls = {i: _whole_queries(call) for i in idxs
             if whole_queries and len(prog.units[i].ins) == 5
             and (call := attention_call(prog.units[i].eqn)) is not None}
    calls.update((i, _masked_pick(prog.units[i].eqn, d)) for i in idxs
                 if (d := picked_dim(prog.units[i].eqn)) is not None)
    calls.update(swaps or {})
    start = 0
    for k, i in enumerate(idxs):
        unit = prog.units[i]
        whole = [] if i in calls else shifted_dims(unit.eqn)
        if whole:
            prog.run_units(idxs[start:k], env, calls, hook, reads)
            for v, dims in zip(unit.ins, whole):
                if dims and v in env:
                    env[v] = _whole_along(env[v], dims)
            start = k
    prog.run_units(idxs[start:], env, calls, hook, reads)


# The named scopes of the pipeline's own sends (its per-direction ``lax.switch``, which every
# device takes alike): collective-permutes there are well formed.
SEND_SCOPES = ("pipeline_activations", "pipeline_gradients")


def check_compiled(hlo_text: str) -> None:
    """PlanError where XLA put a collective-permute of its own inside a stage's action: a
    resharding inside the layers (a rotary embedding's halves of a split head dim, a shifted
    slice) inside the ``lax.switch`` on the stage's action, which only that stage's devices
    take. XLA:CPU waits for every device at a collective-permute, so that step would hang, and
    abort after 40 s (a tiny Llama with its keys' head dim split, found by
    `scripts/fuzz_exactness.py`). Checked on the compiled step, before it first runs."""
    for line in hlo_text.splitlines():
        if " collective-permute(" not in line and " collective-permute-start(" not in line:
            continue
        name = re.search(r'op_name="([^"]*)"', line)
        where = name.group(1) if name else ""
        if "/cond/branch_" in where and not any(s in where for s in SEND_SCOPES):
            raise PlanError(
                f"XLA exchanges data between the devices of a pipeline stage with a "
                f"collective-permute inside the stage's own action ({where.split('/')[-1]!r} "
                f"at {where}), which only that stage's devices run: the step would hang. The "
                "plan splits a dim there that the layers slice or shift (a rotary "
                "embedding's head dim, a sequence a convolution pads), or reads a value in a "
                "layout XLA reaches only by moving tiles between devices; `soapjax simulate` "
                "names the operators. Plan this model's stages with those reads in their "
                "producers' layouts and those dims whole, or let `soapjax plan` search (it "
                "keeps no such plan), or plan without stages")


_PIPELINE_BRANCH = re.compile(r"shard_map/while/body/closed_call/cond/branch_(\d+)_fun/")


def count_branch_runs(collectives: Sequence[Any], runs: BranchRuns) -> list[Any]:
    """The compiled pipelined step's collectives (`soapjax.measure.hlo.HloCollective`) with
    the ones inside a branch of the step's switches run as often as the schedule takes that
    branch (`branch_runs`), not once per tick as HLO's loop count says: a collective of a
    stage's action runs once per (tick, stage) taking it, summed over the stages (as one
    stage's simulation prices the whole model); one of a send, once per tick sending so."""
    out = []
    for c in collectives:
        m = _PIPELINE_BRANCH.search(c.op_name or "")
        if m is None:
            out.append(c)
            continue
        k, rest = int(m.group(1)), c.op_name[m.end():]
        send = next((d for d, scope in enumerate(SEND_SCOPES) if rest.startswith(scope)), None)
        counts = runs.actions if send is None else runs.sends[send]
        n = counts[k] if k < len(counts) else runs.ticks
        out.append(c._replace(executions=c.executions * n // runs.ticks))
    return out


def _whole_queries(call: AttentionCall) -> Callable:
    return lambda q, k, v, q_pos, k_pos: [bind_attention(call, q, k, v, q_pos, k_pos,
                                                         whole_queries=True)]


def _masked_pick(eqn: Any, d: int) -> Callable:
    """A gather that picks one element along dim `d` per index (`picked_dim`: the loss's
    ``take_along_axis`` of the labels' log-probabilities) as a masked sum along `d`: split
    there, each device sums its part and XLA adds the parts with one all-reduce of the picked
    values, as Megatron-LM's vocabulary-parallel loss does, where the gather would abort
    (module doc) or need its operand whole. Exact: every other term is zero; an index out of
    range gives the gather's fill value (clamped in ``CLIP`` mode), its gradient zero."""
    p = eqn.params
    dn, out_shape = p["dimension_numbers"], eqn.outvars[0].aval.shape
    mode, fill = p["mode"].name, p["fill_value"]
    rank = len(eqn.invars[0].aval.shape)
    index_rank = len(eqn.invars[1].aval.shape) - 1  # without the index vector's dim
    pairs = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims))
    rest = [k for k in range(rank) if k != d]  # the picked values' dims, in operand order
    # the output's dims: the offset dims (x's full slices, in order) where `offset_dims`
    # says, the indices' dims elsewhere (a batching one as its operand dim; others size 1)
    offsets = iter(k for k in rest if k not in dn.operand_batching_dims)
    positions = iter(range(index_rank))
    order = [next(offsets) if o in dn.offset_dims else pairs.get(next(positions))
             for o in range(len(out_shape))]
    transpose = [rest.index(k) for k in order if k is not None]

    def pick(x, index):
        n = x.shape[d]
        # the index of each picked value, in x's dims but d (1 along its full slices)
        i = jnp.reshape(index, index.shape[:-1])
        i = jnp.transpose(i, [*dn.start_indices_batching_dims,
                              *(j for j in range(index_rank) if j not in pairs)])
        i = jnp.reshape(i, [x.shape[k] if k in dn.operand_batching_dims else 1 for k in rest])
        if mode != "FILL_OR_DROP":
            i = jnp.clip(i, 0, n - 1)
        mask = jax.lax.broadcasted_iota(i.dtype, x.shape, d) == jnp.expand_dims(i, d)
        picked = jnp.sum(jnp.where(mask, x, jnp.zeros((), x.dtype)), axis=d, dtype=x.dtype)
        if mode == "FILL_OR_DROP":
            filler = (fill if fill is not None else
                      np.nan if jnp.issubdtype(x.dtype, jnp.inexact) else
                      jnp.iinfo(x.dtype).min if jnp.issubdtype(x.dtype, jnp.signedinteger)
                      else jnp.iinfo(x.dtype).max)
            picked = jnp.where((i >= 0) & (i < n), picked, jnp.asarray(filler, x.dtype))
        return [jnp.reshape(jnp.transpose(picked, transpose), out_shape)]

    return pick


def _whole_along(x: Any, dims: Sequence[int]) -> Any:
    """`x` constrained to be unsplit along `dims` (its other dims as XLA chooses); its
    cotangent is left where XLA makes it (the constraint's own transpose would make it whole
    too: the scatter a gather's backward makes, all-gathered and sliced again for the matmul
    before it, an all-gather of the log-probabilities per microbatch on the last stage)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return x  # every axis manual (the stage's and the data's): nothing for XLA to place
    return _made_whole(x, tuple(dims))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _made_whole(x: Any, dims: tuple[int, ...]) -> Any:
    spec = PartitionSpec(*(None if d in dims else PartitionSpec.UNCONSTRAINED
                           for d in range(np.ndim(x))))
    return _constrain(x, spec)


def _made_whole_fwd(x, dims):
    return _made_whole(x, dims), None


def _made_whole_bwd(dims, _, ct):
    return (ct,)


_made_whole.defvjp(_made_whole_fwd, _made_whole_bwd)


def _split_axes(mesh: Mesh, stage_axis: str, data_axes: Sequence[str], groups: _Groups,
                scatter_gather: bool) -> tuple[tuple[str, int], ...]:
    """The axes (name, size) a value sent between stages is split over for the transfer (the
    scatter/gather rule, module doc): the mesh's automatic axes in a stage, in mesh order, but
    for `data_axes`. Empty without `scatter_gather`, or where the stages run whole microbatches
    while the batch is split over an automatic data axis: how XLA lays a value out over it is
    not known here."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if not scatter_gather or (not groups.axes and any(sizes[a] > 1 for a in data_axes)):
        return ()
    return tuple((a, n) for a, n in sizes.items() if a != stage_axis and a not in data_axes)


def _send_spec(shape: Sequence[int], auto_axes: Sequence[tuple[str, int]],
               held: PartitionSpec = PartitionSpec()) -> PartitionSpec | None:
    """How a value of (per-device) `shape`, held in `held` over the automatic mesh axes
    `auto_axes` (name, size), is split for a stage-to-stage send (the scatter/gather rule,
    module doc): with ``r`` the product of the sizes of the axes `held` does not split it
    over, the last dim of its shard that ``r`` divides is split further over all of those, in
    mesh order. `held` itself where ``r`` is 1 or no dim is divisible (each device sends its
    own shard), None where that is replicated too (the value goes whole).

    >>> _send_spec((2, 8, 32), [("data", 2), ("model", 2)])
    P(None, None, ('data', 'model'))
    >>> _send_spec((2, 8, 6), [("model", 4)])  # 6 is not a multiple of 4, 8 is
    P(None, 'model', None)
    >>> _send_spec((3, 5), [("model", 2)]) is None
    True
    >>> _send_spec((2, 8, 32), [("model", 4)], PartitionSpec(None, "model"))  # sequence split
    P(None, 'model')
    >>> _send_spec((2, 8, 32), [("data", 2), ("model", 2)], PartitionSpec(None, "model"))
    P(None, 'model', 'data')
    """
    dims_axes = [_axes(held[d]) if d < len(held) else () for d in range(len(shape))]
    used = {a for axes in dims_axes for a in axes}
    sizes = dict(auto_axes)
    free = tuple(a for a, _ in auto_axes if a not in used)
    r = int(np.prod([sizes[a] for a in free], dtype=np.int64))
    local = [n // int(np.prod([sizes[a] for a in axes], dtype=np.int64))
             for n, axes in zip(shape, dims_axes)]
    dims = [d for d, n in enumerate(local) if n % r == 0]
    if r == 1 or not dims:
        return held if used else None
    return PartitionSpec(*(_spec_entry(axes + (free if d == dims[-1] else ()))
                           for d, axes in enumerate(dims_axes)))


def _axes(entry: Any) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of axis names."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec_entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _held_spec(spec: PartitionSpec | None, shape: Sequence[int], sizes: dict[str, int],
               manual: set[str]) -> PartitionSpec:
    """`spec` (a plan's layout of a value, over a stage's mesh) as a stage holds the value
    inside its shard_map: the `manual` axes (the stage's and the data groups') dropped, the
    value's (per data group) `shape` left whole along a dim its axes do not divide."""
    if spec is None:
        return PartitionSpec()
    out = []
    for d, n in enumerate(shape):
        axes = tuple(a for a in (_axes(spec[d]) if d < len(spec) else ()) if a not in manual)
        out.append(_spec_entry(axes) if n % int(np.prod([sizes[a] for a in axes],
                                                        dtype=np.int64)) == 0 else None)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _constraining(constraints: Mapping[int, PartitionSpec]) -> Callable | None:
    """`Program.run_units`'s hook holding the values `constraints` names (by id) to their
    layouts; None where it names none."""
    if not constraints:
        return None

    def hook(v: int, value: Any) -> Any:
        spec = constraints.get(v)
        return value if spec is None else _constrain(value, spec)
    return hook


def _held_through(x: Any, layouts: Sequence[tuple]) -> Any:
    """`x` held to each of `layouts` (tuples of mesh axis names per dim) in turn: a layout
    change made in steps (`_Pipeline._hand_off`)."""
    for layout in layouts:
        x = _constrain(x, PartitionSpec(*(_spec_entry(axes) for axes in layout)))
    return x


def _constrain(x: Any, spec: PartitionSpec) -> Any:
    """`x` constrained to `spec` over the automatic axes of the mesh it is traced on."""
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(jax.sharding.get_abstract_mesh(), spec))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _constrain_operand(x: Any, spec: PartitionSpec, back: PartitionSpec | None) -> Any:
    """`_constrain` to `spec`, its cotangent to `back` where given (else `spec`): the flat
    step's operand constraint (`soapjax.apply._flatstep`) inside a stage."""
    return _constrain(x, spec)


def _constrain_operand_fwd(x, spec, back):
    return _constrain(x, spec), None


def _constrain_operand_bwd(spec, back, _, ct):
    return (_constrain(ct, back if back is not None else spec),)


_constrain_operand.defvjp(_constrain_operand_fwd, _constrain_operand_bwd)


def _chunk_fn(cut: _Cut, last: bool, reads: Sequence[int], selective: bool = False,
              whole_queries: bool = False, counted: bool = False,
              hook: Callable | None = None,
              operand_reads: Mapping[int, Sequence[tuple]] | None = None,
              kept: frozenset[int] = frozenset(),
              literals: Mapping[int, Any] | None = None,
              deferred: Sequence[WeightMatmul] = (),
              matmul_specs: Sequence[_StashSpecs] = (),
              carry_specs: Sequence[PartitionSpec | None] = ()) -> Callable:
    """``(chunk params, values, x) -> y`` (the chunk's output carry) or, for the last chunk,
    ``-> loss`` (the epilogue after it); `values` are those of the ids `reads`, the chunk
    params ``[L / C, ...]`` per stacked parameter, in the scan's order. With `selective`, each
    layer runs in a ``jax.checkpoint`` that saves the outputs of matmuls without batch dims
    (``dots_with_no_batch_dims_saveable``: the projections and MLP matmuls, which read a
    parameter) and recomputes the rest, the attention core's batched score and value matmuls
    included: `soapjax.strategy.memory`'s selective recomputation, Megatron's. `whole_queries`: see
    `_run_in_stage`. With `counted` (uneven stages), the function takes the number of layers
    the chunk runs last (``(chunk params, values, x, count)``): its params hold a stage's
    longest run, and layers from `count` on pass the carry through (a ``lax.cond``, so the
    padding costs no compute). `hook`, `operand_reads`: `_run_in_stage`'s `hook` and
    `reads`. `kept` (with `selective`): layer 0's value ids the checkpoint saves as well
    (named `KEPT_NAME`: the outputs of the operators `kept_positions` says; the rest of the
    attention core is recomputed as before). Where the layers stack outputs
    (`_Cut.stacked_ys`), ``x`` ends with one ``[L, ...]`` stack of each, which the chunk adds
    its layers' rows to from row ``offset`` (the function's last argument) and passes on with
    its carry, and the last chunk hands the epilogue whole. `literals`: values of literal ids
    the chunk reads instead of the program's (`_Groups.literals`). `deferred`: the layer's
    weight matmuls, run as `soapjax.apply._deferred.deferred_dot` (a split backward); the
    function then takes their stash (``stash``: ``[L / C, ...]`` stacks of zeros, per
    weight matmul its operand's, once per value, and its cotangent's: `stash_shapes`), whose
    cotangents are what the weights' gradients are made of,
    held in `matmul_specs` (per weight matmul: `_Pipeline._stash_specs`). `carry_specs`:
    where the stages hold the carry (`_Pipeline.between`; None: left to XLA), held so at
    every layer's start and after the chunk's layers: left to XLA, the layer scan's carry took
    the layout its first reader or its maker had (a prologue splitting the sequence, an
    epilogue the batch) and was gathered again inside every layer."""
    prog, scan = cut.program, cut.scan
    literals = dict(literals or {})

    def env_of(values: Mapping[int, Any]) -> dict[int, Any]:
        env = _env(prog, values)
        env.update(literals)
        return env
    layer_hook = hook
    if kept:
        def layer_hook(v: int, value: Any) -> Any:
            value = value if hook is None else hook(v, value)
            return checkpoint_name(value, KEPT_NAME) if v in kept else value

    ys = scan.ys[0] if cut.stacked_ys else ()  # layer 0's outputs the layers stack

    def held(carry: Sequence[Any]) -> tuple:  # the carry where the stages hold it
        return tuple(x if spec is None else _constrain(x, spec)
                     for x, spec in zip(carry, carry_specs or (None,) * len(carry)))

    def layer(vals: Sequence[Any], carry: tuple, slices: list,
              stash: Sequence[Any] = ()) -> tuple[tuple, tuple]:
        carry = held(carry)
        env = env_of(dict(zip(reads, vals)))
        env.update(zip(scan.slices[0], slices))
        env.update(zip(scan.carries[0], carry))
        swaps = {m.unit: _weight_matmul(m, prog, stash_of(m, stash), selective,
                                        (operand_reads or {}).get(m.unit, ()),
                                        matmul_specs[k] if matmul_specs else _StashSpecs())
                 for k, m in enumerate(deferred)}
        _run_in_stage(prog, cut.layer, env, whole_queries, layer_hook, operand_reads, swaps)
        return tuple(env[v] for v in scan.carries[1]), tuple(env[v] for v in ys)

    def passed(carry: tuple) -> tuple[tuple, tuple]:  # a padding layer (uneven stages)
        return carry, tuple(jnp.zeros(prog.shapes[v], prog.jax_dtypes[v]) for v in ys)

    if selective:
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        names = (KEPT_NAME,) * bool(kept) + (DEFERRED_NAME,) * bool(deferred)
        if names:
            policy = jax.checkpoint_policies.save_from_both_policies(
                policy, jax.checkpoint_policies.save_only_these_names(*names))
        layer = jax.checkpoint(layer, policy=policy)

    def chunk(params: list, vals: Sequence[Any], x: tuple, count: Any = None,
              offset: Any = None, stash: Sequence[Any] = ()) -> Any:
        values = dict(zip(reads, vals))
        carry, stacks = tuple(x[:len(x) - len(ys)]), tuple(x[len(x) - len(ys):])
        depth = jax.tree.leaves(params)[0].shape[0]
        stash = list(stash) or [jnp.zeros((depth, *x.shape), x.dtype)  # nothing to hand on
                                for x in stash_shapes(prog, deferred)]
        if count is None:
            y, made = jax.lax.scan(lambda c, ps: layer(list(vals), c, *ps), carry,
                                   (params, stash))
        else:
            def step(c: tuple, p_k: tuple) -> tuple:
                p, st, k = p_k
                return jax.lax.cond(k < count, lambda: layer(list(vals), c, p, st),
                                    lambda: passed(c))

            y, made = jax.lax.scan(step, carry, (params, stash, jnp.arange(depth)))
        y = held(y)
        # the chunk's layers' rows of each stack (`_Cut.stacked_ys`), from row `offset` (rows
        # past a stage's count hold zeros: its padding)
        rows = None if offset is None else offset + jnp.arange(depth)
        stacks = tuple(b.at[rows].add(m, mode="drop") for b, m in zip(stacks, made))
        if not last:
            return (*y, *stacks)
        env = env_of(values)
        env.update(zip(scan.carries[-1], y))
        env.update(zip(cut.stacked_ys, stacks))
        _run_in_stage(prog, cut.epilogue, env, whole_queries, hook, operand_reads)
        return env[prog.outputs[0]]

    return chunk


# The name `_chunk_fn` gives the values a selectively recomputed layer keeps beyond its matmuls.
KEPT_NAME = "soapjax_kept"


def _dot_output_spec(eqn: Any, specs: Sequence[PartitionSpec]) -> PartitionSpec | None:
    """The layout a ``dot_general`` makes its output in from its operands' (`specs`): batch
    and the left operand's free dims as the left holds them, the right's free dims as the
    right does, partial sums over split contracting dims taken whole; None where an axis
    would split two dims."""
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    ranks = [len(v.aval.shape) for v in eqn.invars]

    def axes(k: int, d: int) -> tuple[str, ...]:
        spec = specs[k]
        return _axes(spec[d]) if d < len(spec) else ()

    dims = ([axes(0, d) for d in batch_l]
            + [axes(0, d) for d in range(ranks[0]) if d not in (*contract_l, *batch_l)]
            + [axes(1, d) for d in range(ranks[1]) if d not in (*contract_r, *batch_r)])
    used = [a for entry in dims for a in entry]
    if len(used) != len(set(used)):
        return None
    entries = [_spec_entry(a) if a else None for a in dims]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _smaller(held: PartitionSpec | None, used: PartitionSpec | None, shape: Sequence[int],
             sizes: Mapping[str, int]) -> PartitionSpec | None:
    """`held` where a stash keeps a value in it (`_Pipeline._stash_specs`): where it splits
    the value into smaller pieces per device than `used` does; else `used`."""
    if held is None or used is None:
        return used
    return held if _per_device(held, shape, sizes) < _per_device(used, shape, sizes) else used


def _per_device(spec: PartitionSpec, shape: Sequence[int], sizes: Mapping[str, int]) -> int:
    """Elements of a value of `shape` per device under `spec` (a dim an axis does not divide
    counted whole)."""
    n = 1
    for k, size in enumerate(shape):
        d = math.prod(sizes[a] for a in _axes(spec[k])) if k < len(spec) else 1
        n *= size // d if size % d == 0 else size
    return n


def _read_spec(reads: Sequence[tuple], pos: int) -> PartitionSpec | None:
    """The layout `reads` (`_Pipeline._operand_reads`' entries of one unit) holds operand
    `pos` in, or None."""
    return next((fn.keywords["spec"] for p, _, fn in reads
                 if p == pos and isinstance(fn, functools.partial)), None)


class _StashSpecs(NamedTuple):
    """Where a stage holds one weight matmul's operand and output cotangent
    (`_Pipeline._stash_specs`): as the matmul reads and makes them (`x`, `dy`), and as its
    stash keeps them (`x_kept`, `dy_kept`: the same, or the smaller layout the stage held
    them in before the matmul gathered them, which W gathers again). None: XLA's choice."""

    x: PartitionSpec | None = None
    dy: PartitionSpec | None = None
    x_kept: PartitionSpec | None = None
    dy_kept: PartitionSpec | None = None

    @property
    def lean_x(self) -> bool:
        return self.x_kept is not None and self.x_kept != self.x

    @property
    def lean_dy(self) -> bool:
        return self.dy_kept is not None and self.dy_kept != self.dy


def _weight_matmul(m: WeightMatmul, prog: Program, stash: Sequence[Any], selective: bool,
                   reads: Sequence[tuple], specs: _StashSpecs = _StashSpecs()) -> Callable:
    """The function `_run_in_stage` runs weight matmul `m` with (`deferred_dot`, taking the
    layer's `stash` pair), its operands held to their layouts first (`reads`, as
    `Program.run_units` holds the other units'), the operand and the output's cotangent held
    in `specs` (`_Pipeline._stash_specs`; a lean stash keeps the operand as it was before
    `reads` gathered it), its output named for a selective layer's checkpoint to save (as
    the matmuls' outputs are)."""
    def hold(spec: PartitionSpec | None) -> Callable | None:
        return None if spec is None else functools.partial(_constrain, spec=spec)

    dot = deferred_dot(prog.units[m.unit].eqn, m.weight, hold(specs.x), hold(specs.dy),
                       own_x=m.own_x, keep_x=hold(specs.x_kept) if specs.lean_x else None,
                       keep_dy=hold(specs.dy_kept) if specs.lean_dy else None)
    lean_x = specs.lean_x

    def run(*args: Any) -> list[Any]:
        args = list(args)
        raw = args[1 - m.weight]  # as the stage holds it, before the matmul's layout
        for pos, _, fn in reads:
            args[pos] = fn(args[pos])
        out = dot(args[1 - m.weight], args[m.weight], *(raw,) * lean_x, *stash)
        return [checkpoint_name(out, DEFERRED_NAME) if selective else out]
    return run


# --------------------------------------------------------------------------------------------
# The schedule as a tick table, and its buffer slots


def ticks(schedule: str, stages: int, microbatches: int,
          virtual: int = 1) -> tuple[tuple[Action | None, ...], ...]:
    """The schedule as ticks: per tick, the action each device stage runs (None: idle).

    Every stage runs its `device_orders` in order, each action at the first tick at which its
    input has arrived: a forward one tick or more after the previous chunk's forward, a
    backward after the next chunk's backward (and its own forward).

    >>> for row in ticks("1f1b", stages=2, microbatches=3):
    ...     print(" ".join(f"{a.kind}{a.microbatch}" if a else "--" for a in row))
    F0 --
    F1 F0
    -- B0
    B0 F1
    F2 B1
    B1 F2
    -- B2
    B2 --
    """
    orders = device_orders(schedule, stages, microbatches, virtual)
    chunks = stages * virtual
    done: dict[Action, int] = {}
    pos = [0] * stages
    rows: list[tuple[Action | None, ...]] = []

    def ready(a: Action, t: int) -> bool:
        if a.kind == "W":  # its B ran earlier on the same stage
            return True
        if a.kind == "F":
            return a.chunk == 0 or done.get(Action("F", a.microbatch, a.chunk - 1), t) < t
        return (a.chunk == chunks - 1
                or done.get(Action("B", a.microbatch, a.chunk + 1), t) < t)

    while any(p < len(o) for p, o in zip(pos, orders)):
        t = len(rows)
        row = tuple(o[p] if p < len(o) and ready(o[p], t) else None for p, o in zip(pos, orders))
        assert any(row), f"{schedule}: no stage can move at tick {t}"
        for s, a in enumerate(row):
            if a is not None:
                done[a] = t
                pos[s] += 1
        rows.append(row)
    return tuple(rows)


class _Slots(NamedTuple):
    """Buffer slots from the tick table, per tick and stage (arrays ``[ticks, stages]``).

    A stage keeps a received activation (its chunk's input) from the tick it arrives until its
    forward (until its backward, with recomputation), a received cotangent (the gradient of its
    chunk's output) until its backward, a forward's residuals (per kind: middle or last
    chunk) until its backward, and, where the schedule splits the backward, a B's stash (what
    its W reads, `soapjax.apply._deferred`) until its W. Index ``n`` of a receive buffer of
    ``n`` slots is scratch: stages that receive nothing at a tick write there.

    Attributes:
      activation_read, cotangent_read, residual: the slot the action at a tick reads (a
        forward stores its residuals at `residual`, its backward reads them there).
      stash: the slot a B stores its stash at and its W reads it from.
      activation_recv, cotangent_recv: the slot a value received at a tick goes to.
      counts: slots per buffer: ``activations``, ``cotangents``, ``residuals`` (a middle
        chunk's), ``last_residuals`` (the last chunk's) and ``stash``.
    """

    activation_read: np.ndarray
    activation_recv: np.ndarray
    cotangent_read: np.ndarray
    cotangent_recv: np.ndarray
    residual: np.ndarray
    stash: np.ndarray
    counts: dict[str, int]


def _slots(rows: Sequence[Sequence[Action | None]], stages: int, chunks: int,
           recompute: bool) -> _Slots:
    done = {a: t for t, row in enumerate(rows) for a in row if a is not None}
    shape = (len(rows), stages)
    activation_read, activation_recv, cotangent_read, cotangent_recv, residual, stash = (
        np.zeros(shape, np.int32) for _ in range(6))
    # (buffer, stage) -> (the tick a value arrives, the tick it is read last, the action)
    spans: dict[tuple[str, int], list[tuple[int, int, Action]]] = {}
    for a, t in done.items():
        stage, mb, chunk = a.chunk % stages, a.microbatch, a.chunk
        if a.kind == "F" and chunk > 0:
            end = done[Action("B", mb, chunk)] if recompute else t
            spans.setdefault(("activations", stage), []).append(
                (done[Action("F", mb, chunk - 1)], end, a))
        if a.kind == "B" and chunk < chunks - 1:
            spans.setdefault(("cotangents", stage), []).append(
                (done[Action("B", mb, chunk + 1)], t, a))
        if a.kind == "F" and not recompute:
            buffer = "last_residuals" if chunk == chunks - 1 else "residuals"
            spans.setdefault((buffer, stage), []).append((t, done[Action("B", mb, chunk)], a))
        if a.kind == "W":
            spans.setdefault(("stash", stage), []).append((done[Action("B", mb, chunk)], t, a))
    counts = {k: 0 for k in ("activations", "cotangents", "residuals", "last_residuals",
                             "stash")}
    slot_of: dict[tuple[str, Action], int] = {}
    for (buffer, _), span in spans.items():
        free: list[int] = []  # per slot, the tick from which it is free
        for start, end, a in sorted(span):
            k = next((k for k, f in enumerate(free) if f <= start), len(free))
            free[k:k + 1] = [end]
            slot_of[buffer, a] = k
        counts[buffer] = max(counts[buffer], len(free))
    activation_recv[:], cotangent_recv[:] = counts["activations"], counts["cotangents"]  # scratch
    for a, t in done.items():
        stage, mb, chunk = a.chunk % stages, a.microbatch, a.chunk
        if a.kind == "W":
            stash[t, stage] = stash[done[Action("B", mb, chunk)], stage] = slot_of["stash", a]
            continue
        if a.kind == "F" and chunk > 0:
            activation_read[t, stage] = slot_of["activations", a]
            activation_recv[done[Action("F", mb, chunk - 1)], stage] = slot_of["activations", a]
        if a.kind == "B" and chunk > 0 and recompute:
            activation_read[t, stage] = slot_of["activations", Action("F", mb, chunk)]
        if a.kind == "B" and chunk < chunks - 1:
            cotangent_read[t, stage] = slot_of["cotangents", a]
            cotangent_recv[done[Action("B", mb, chunk + 1)], stage] = slot_of["cotangents", a]
        if not recompute:
            buffer = "last_residuals" if chunk == chunks - 1 else "residuals"
            residual[t, stage] = slot_of[buffer, Action("F", mb, chunk)]
    return _Slots(activation_read, activation_recv, cotangent_read, cotangent_recv, residual,
                  stash, counts)


# The columns of `_Tables.actions`: what the action a stage runs at a tick reads.
(_MICROBATCH, _LOCAL_CHUNK, _ACTIVATION_SLOT, _RESIDUAL_SLOT, _COTANGENT_SLOT,
 _STASH_SLOT) = range(6)


class _Tables(NamedTuple):
    """The tick table as the arrays the tick loop reads (``T`` ticks, ``S`` stages).

    Attributes:
      keys: the kinds of action (`_key`) the schedule runs, in branch order.
      kind: ``[T, S]``: which of `keys` each stage runs at each tick.
      actions: ``[T, S, 6]``: its microbatch, local chunk, activation slot, residual slot,
        cotangent slot and stash slot (the columns `_MICROBATCH` ... `_STASH_SLOT`).
      activation_recv, cotangent_recv: ``[T, S]``: the slot a received activation
        (cotangent) goes to.
      sends: per direction (activations, cotangents), the distinct sets of ``(source,
        target)`` stage pairs that send at one tick, and ``[T]``: which set sends at each tick
        (0: none; k: ``sets[k - 1]``).
    """

    keys: tuple[tuple, ...]
    kind: np.ndarray
    actions: np.ndarray
    activation_recv: np.ndarray
    cotangent_recv: np.ndarray
    sends: tuple[tuple[tuple[tuple[tuple[int, int], ...], ...], np.ndarray], ...]


class BranchRuns(NamedTuple):
    """How often one pipelined step takes each branch of its switches (module doc): what the
    compiled step's collectives inside a branch run, where XLA's HLO says only "once per
    tick" (`soapjax.check` counts with these).

    Attributes:
      ticks: the ticks (the ``fori_loop``'s trip count).
      actions: per branch of the switch on a stage's action (its kinds, in the switch's
        order), how many (tick, stage) pairs take it: summed over the stages, as one stage's
        simulation counts the whole model's operators.
      sends: per direction (activations, then gradients), per branch of its switch (0: no
        send), the ticks that take it.
    """

    ticks: int
    actions: tuple[int, ...]
    sends: tuple[tuple[int, ...], tuple[int, ...]]


def branch_runs(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> BranchRuns:
    """`BranchRuns` of the step `pipelined_value_and_grad` builds for these numbers.

    >>> branch_runs("1f1b", stages=2, microbatches=1)  # B and F of each chunk once; idle 4 x
    BranchRuns(ticks=4, actions=(1, 1, 1, 1, 4), sends=((3, 1), (3, 1)))
    """
    rows = ticks(schedule, stages, microbatches, virtual)
    chunks = stages * virtual
    keys, kind = _kinds(rows, chunks)
    sends = tuple(tuple(int(np.sum(which == j)) for j in range(len(sets) + 1))
                  for sets, which in _sends(rows, stages, chunks))
    return BranchRuns(len(rows), tuple(int(np.sum(kind == k)) for k in range(len(keys))),
                      sends)


def _kinds(rows: Sequence[Sequence[Action | None]], chunks: int
           ) -> tuple[tuple[tuple, ...], np.ndarray]:
    """The kinds of action (the switch's branches, in order) and each (tick, stage)'s."""
    keys = tuple(sorted({_key(a, chunks) for row in rows for a in row}))
    kind = np.array([[keys.index(_key(a, chunks)) for a in row] for row in rows], np.int32)
    return keys, kind


def _sends(rows: Sequence[Sequence[Action | None]], stages: int, chunks: int
           ) -> tuple[tuple[tuple[tuple[tuple[int, int], ...], ...], np.ndarray], ...]:
    """Per direction, the sets of stage pairs that send at one tick and which sends when
    (`_Tables.sends`)."""
    sends = []
    for direction, step, keep in (("F", 1, lambda c: c < chunks - 1), ("B", -1, lambda c: c > 0)):
        per_tick = [tuple((s, (s + step) % stages) for s, a in enumerate(row)
                          if a is not None and a.kind == direction and keep(a.chunk))
                    for row in rows]
        sets = tuple(sorted({p for p in per_tick if p}))
        sends.append((sets, np.array([sets.index(p) + 1 if p else 0 for p in per_tick],
                                     np.int32)))
    return tuple(sends)


def _tables(rows: Sequence[Sequence[Action | None]], stages: int, chunks: int,
            slots: _Slots) -> _Tables:
    keys, kind = _kinds(rows, chunks)
    actions = np.zeros((len(rows), stages, 6), np.int32)
    for t, row in enumerate(rows):
        for s, a in enumerate(row):
            if a is not None:
                actions[t, s, _MICROBATCH] = a.microbatch
                actions[t, s, _LOCAL_CHUNK] = a.chunk // stages
                actions[t, s, _ACTIVATION_SLOT] = slots.activation_read[t, s]
                actions[t, s, _RESIDUAL_SLOT] = slots.residual[t, s]
                actions[t, s, _COTANGENT_SLOT] = slots.cotangent_read[t, s]
                actions[t, s, _STASH_SLOT] = slots.stash[t, s]
    return _Tables(keys, kind, actions, slots.activation_recv, slots.cotangent_recv,
                   _sends(rows, stages, chunks))


# --------------------------------------------------------------------------------------------
# A pipelined strategy's step program (soapjax.apply.step)


class PipelinedStep:
    """The `soapjax.apply._shardings.StepProgram` of a pipelined strategy (`Strategy.pipelined`).

    It runs on `pipelined_mesh` (the user's mesh, its outermost axis cut into ``stage``), its
    configs are over one stage's mesh (`stage_mesh_shape`), its stacked layer parameters are
    split over ``stage`` on their layer dim in the model's layout (interleaved: in chunk
    order, wrapped in `ChunkOrdered`: `chunk_ordered`), and its loss and gradients
    come from `pipelined_value_and_grad` with the strategy's stages, microbatches, schedule,
    `layer_recompute` (with `kept_positions`) and the axes it splits the batch over as data
    axes (`batch_axes`).

    Attributes:
      check: the checked strategy.
      mesh: the pipelined mesh the step runs on.
      config_mesh: one stage's mesh, the configs'.
    """

    def __init__(self, check: Checked):
        self.check = check
        stages = check.strategy.stages
        self.mesh = pipelined_mesh(check.mesh, stages, STAGE_AXIS)
        self.config_mesh = stage_mesh_shape(MeshShape.of(check.mesh), stages)
        self.chunk_ordered = chunk_ordered(check.strategy)

    def stored(self, strategy: Any) -> Any:
        """`strategy` with its stage operators as the data groups run them
        (`soapjax.strategy._stage_groups.stage_strategy`): stored split over a group axis, a
        parameter was gathered into the stages at every step, as each group reads it whole."""
        return stage_strategy(self.check.graph, strategy, self.config_mesh)

    def param_layout(self, shardings: list[NamedSharding]) -> list[Any]:
        """The shardings of their specs, each stacked layer parameter's split over ``stage``
        on its layer dim (unsplit in one stage's specs); in chunk order (wrapped in a
        `ChunkOrdered`, `soapjax.apply._layer_order`) where the stages are interleaved
        (`chunk_ordered`)."""
        out: list[Any] = list(shardings)
        strategy = self.check.strategy
        for k in stacked_params(self.check.graph):
            out[k] = NamedSharding(self.mesh, PartitionSpec(STAGE_AXIS, *out[k].spec[1:]))
            if self.chunk_ordered:
                out[k] = ChunkOrdered(out[k], strategy.stages, strategy.virtual_stages)
        return out

    def value_and_grad(self, param_shardings: Any, batch_shardings: Any, *,
                       allow_spatial_convolutions: bool = False
                       ) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
        """``(params, batch, step) -> (loss, grads)``, parameters and gradients in the model's
        layout (stacked ``[L, ...]``): the parameters reshaped to the pipelined layout
        (`to_pipelined`) and constrained to their shardings there
        (`pipelined_layout_shardings` of `param_shardings`), `pipelined_value_and_grad`, the
        gradients reshaped back (`from_pipelined`), interleaved ones from and to chunk order
        (`ChunkOrdered` leaves in, out: no row changes stage); uneven stages move them with
        `stage_router` and its transpose instead. ``step`` is unused: a pipelined graph
        draws no random bits (`check_pipelinable`). The batch arrives on `batch_shardings`.
        Its stages constrain their operators' outputs and operands to the plan's layouts
        (`stage_layouts`); spatially split convolutions are not refused here (a graph with a
        layer scan of convolutions is not a zoo model)."""
        del batch_shardings, allow_spatial_convolutions
        graph, strategy = self.check.graph, self.check.strategy
        validate_program_inputs(graph)
        stages, virtual = strategy.stages, strategy.virtual_stages
        run = pipelined_value_and_grad(
            graph, self.mesh, stages=stages, microbatches=strategy.microbatches,
            virtual=virtual, schedule=strategy.schedule,
            recompute=layer_recompute(graph, strategy), stage_axis=STAGE_AXIS,
            kept=kept_positions(graph, strategy),
            data_axes=batch_axes(graph, strategy),
            whole_query_attention=splits_queries(graph, strategy.configs),
            stage_layers=strategy.stage_layers,
            layouts=stage_layouts(graph, strategy, self.mesh))
        placed = jax.tree.leaves(pipelined_layout_shardings(
            graph, self.mesh, param_shardings, stages=stages, virtual=virtual,
            stage_axis=STAGE_AXIS))
        route = (stage_router(graph, self.mesh, strategy.stage_layers, STAGE_AXIS)
                 if strategy.stage_layers else None)

        ordered = self.chunk_ordered

        def value_and_grad(params: Any, batch: Any, step: Any = None) -> tuple[Any, Any]:
            del step  # no random bits: see above
            if ordered:  # the stored chunk order, unwrapped (wrapped again on the way out)
                params = unwrapped(params)
            moved = (route(params) if route is not None else
                     to_pipelined(graph, params, stages=stages, virtual=virtual,
                                  chunk_ordered=ordered))
            leaves, tree = jax.tree.flatten(moved)
            leaves = [jax.lax.with_sharding_constraint(x, s) for x, s in zip(leaves, placed)]
            loss, grads = run(jax.tree.unflatten(tree, leaves), batch)
            if route is not None:  # the gradients back the way the parameters came
                (grads,) = jax.linear_transpose(route, params)(grads)
                return loss, grads
            grads = from_pipelined(graph, grads, stages=stages, virtual=virtual,
                                   chunk_ordered=ordered)
            if ordered:
                flat, tree = jax.tree.flatten(grads)
                for k in stacked_params(graph):
                    flat[k] = ChunkOrdered(flat[k], stages, virtual)
                grads = jax.tree.unflatten(tree, flat)
            return loss, grads

        return value_and_grad


class StageLayouts(NamedTuple):
    """Where a plan holds a pipelined step's values inside a stage: each operator's outputs'
    layouts, by operator name, over one stage's mesh (as the flat step constrains them,
    `soapjax.apply._flatstep`: a row-parallel output in its readers' layout where its partial
    sums are reduce-scattered; `stage_layouts`).

    The prologue constrains its operators' outputs to these (over the whole mesh); a stage
    every output its layers and the epilogue make, and every activation its layers and the
    epilogue read (over the automatic axes; the stage's and the data groups' are manual
    there; attention operators' operands are left to XLA: `_Pipeline._operand_reads`), holds
    the layers' carry (the residual stream) in them at a chunk's start, and sends the carry
    so between stages (each device its own shard, split further over the axes its layout
    leaves it whole on: the scatter/gather rule, `_send_spec`), as `soapjax.simulate.pipesim`
    prices them. Without them XLA places a stage's values itself
    and the carry is taken as replicated over a stage's model axes (module doc); under
    sequence parallelism (the carry split along the sequence) XLA then ran the first stage's
    layers without it (all-reducing where the plan reduce-scatters and gathers), and with
    the carry alone held, gathered weights inside the layers instead (tiny GPT, TP 4 x PP 2:
    predicted / XLA collective bytes 1.169, then 0.646; with every output and operand
    constrained 0.949, `tests/test_check.py`)."""

    outputs: Mapping[str, tuple[PartitionSpec, ...]]
    operands: Mapping[str, tuple[tuple[PartitionSpec | None, PartitionSpec | None], ...]]


def stage_layouts(graph: OpGraph, strategy: Any, mesh: Mesh) -> StageLayouts:
    """The layouts `strategy` (over one stage's mesh; `mesh` names its axes) gives `graph`'s
    operator outputs and operands (with the layout each operand's cotangent goes back in, or
    None), as `StageLayouts` holds them (`soapjax.apply._flatstep`'s)."""
    layouts = _Layouts(graph, strategy, mesh)

    def spec(s: NamedSharding | None) -> PartitionSpec | None:
        return None if s is None else s.spec

    return StageLayouts({op.name: tuple(s.spec for s in layouts.outputs(j))
                         for j, op in enumerate(graph.operators)},
                        {op.name: tuple((spec(s), spec(b)) for s, b in layouts.operands(j))
                         for j, op in enumerate(graph.operators)})


# --------------------------------------------------------------------------------------------
# The pipelined step


def pipelined_value_and_grad(graph: OpGraph, mesh: Mesh, *, stages: int, microbatches: int,
                             virtual: int = 1, schedule: ScheduleName = DEFAULT_SCHEDULE,
                             recompute: RecomputePolicy = "none", stage_axis: str = "stage",
                             data_axes: Sequence[str] = (), scatter_gather: bool = True,
                             whole_query_attention: bool = False,
                             stage_layers: tuple[int, ...] = (),
                             layouts: StageLayouts | None = None,
                             kept: Sequence[str] = ()
                             ) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``(params, batch) -> (loss, grads)``: what ``jax.value_and_grad(loss_fn)`` computes, as
    a pipeline over the mesh's `stage_axis` (module doc). Jit it.

    Args:
      graph: the traced loss (``trace(loss_fn, params, batch)``), its layers one scan.
      mesh: the mesh; its `stage_axis` has `stages` devices, other axes are left automatic.
      stages: S, the pipeline's stages.
      microbatches: M; the batch size must be a multiple of it.
      virtual: v, chunks per stage (the interleaved schedule: 2 or more).
      schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (`soapjax.strategy.pipeline`).
      recompute: ``"full"``: each chunk's backward recomputes its forward from
        the chunk's input; ``"selective"``: a forward keeps the outputs of its layers' matmuls
        without batch dims (projections, MLP) and of the operators at `kept`, and the backward
        recomputes the rest, the attention core included (``jax.checkpoint`` with
        ``dots_with_no_batch_dims_saveable`` around each layer); ``"none"`` (default): a
        forward keeps every residual.
      stage_axis: the mesh axis of the stages.
      data_axes: the mesh axes the batch is split over (``("data",)``). Inside a stage each
        of their device groups runs its own samples of every microbatch and keeps its own
        share of the gradients, summed over the groups once after the last backward (module
        doc). Empty: the stages run whole microbatches, and XLA reduces the layers'
        gradients over the batch's axes in every backward. Name every axis the batch is
        split over: the other automatic axes are taken as model axes the values sent between
        stages are replicated over (`scatter_gather`).
      scatter_gather: Megatron-LM's scatter/gather of the values sent between stages (its
        ``--no-scatter-gather-tensors-in-pipeline`` turns it off): each replica over the
        automatic axes sends its piece, the receiver all-gathers them (module doc). False:
        each sends the whole value.
      whole_query_attention: bind every flash attention equation with its queries as one
        block, every tile computed (`_run_in_stage`): for a plan that splits attention's
        query sequence, which XLA's partitioner runs inside the stages.
      stage_layers: uneven stages (one virtual stage): the layers each runs, first to last;
        the parameters then come in `_pipeline_layout.stage_router`'s layout, each stage's
        run padded to the longest, and so do the gradients.
      layouts: where the stages hold their values (`StageLayouts`: a plan's,
        `stage_layouts`); None: where XLA places them, the carry replicated over the
        automatic axes (module doc).
      kept: with ``recompute="selective"``, layer positions (`Operator.block_position`)
        whose outputs each layer's checkpoint saves as well (`kept_positions`: attention-core
        operators a plan keeps).

    Returns:
      The function. It takes the parameters in the pipelined layout (`to_pipelined`; place
      them with `pipelined_layout_shardings`) and the batch, and returns the loss and the
      gradients in the pipelined layout.

    Raises:
      PlanError: the graph has no layer scan (or one that cannot be pipelined, module doc),
        draws random bits, its layers do not divide into ``S v`` chunks, the batch into M
        microbatches, the schedule's numbers do not make a pipeline, or `data_axes` are not
        axes of the mesh besides `stage_axis`, or `kept` names positions without
        ``recompute="selective"`` or that no layer operator has.
    """
    if recompute not in RECOMPUTE_POLICIES:
        raise PlanError(f"recompute={recompute!r}: expected one of {RECOMPUTE_POLICIES}")
    if kept and recompute != "selective":
        raise PlanError(f"kept={tuple(kept)}: operators are kept beyond the matmuls only "
                        f"under recompute='selective', not {recompute!r}")
    check_stage_axis(mesh, stages, stage_axis)
    check_pipelinable(graph, stages=stages, microbatches=microbatches, virtual=virtual,
                      schedule=schedule, stage_layers=stage_layers)
    outer = _cut(graph.at_batch_size(graph.batch_size // microbatches))
    cut, groups = _data_groups(graph, outer, mesh, microbatches, data_axes, stage_axis)
    rows = ticks(schedule, stages, microbatches, virtual)
    pipe = _Pipeline(outer, cut, groups, mesh, stage_axis, stages, virtual, microbatches, rows,
                     recompute, data_axes, scatter_gather, whole_query_attention,
                     tuple(stage_layers), layouts, _kept_values(cut, kept),
                     lean_stash=not SCHEDULES[schedule].gathered_stash)
    return pipe.value_and_grad


def _kept_values(cut: _Cut, positions: Sequence[str]) -> frozenset[int]:
    """The value ids of layer 0's operators at `positions` (the layer program's), which
    `_chunk_fn` keeps; PlanError for a position no operator of layer 0 has."""
    layer, wanted = set(cut.layer), set(positions)
    out, seen = set(), set()
    for op in cut.graph.operators:
        if op.block_position in wanted and layer & set(cut.program.local[op.name].units):
            seen.add(op.block_position)
            out.update(t.value for t in op.outputs)
    if wanted - seen:
        raise PlanError(f"kept positions {sorted(wanted - seen)}: no operator of graph "
                        f"{cut.graph.name!r}'s first layer is at them")
    return frozenset(out)


def _row(buffer: Any, i: Any) -> Any:
    """``buffer[i]``, `i` traced."""
    return jax.lax.dynamic_index_in_dim(buffer, i, 0, keepdims=False)


def _with_row(buffer: Any, i: Any, value: Any) -> Any:
    """`buffer` with ``buffer[i] = value`` (in the buffer's dtype), `i` traced."""
    return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), i, 0)


def _add_to_row(buffer: Any, i: Any, value: Any) -> Any:
    """`buffer` with ``buffer[i] += value``, `i` traced."""
    return _with_row(buffer, i, _row(buffer, i) + value)


class _ChunkFn(NamedTuple):
    """A chunk function, ``(chunk params, floats, others, carry) -> carry`` (middle chunks) or
    ``-> loss`` (the last, with the epilogue), and the ids of the values it reads: floats
    (differentiated) and others."""

    fn: Callable
    floats: tuple[int, ...]
    others: tuple[int, ...]


class _Residuals(NamedTuple):
    """How a forward's ``jax.vjp`` closure is kept: its pytree structure, for each leaf the
    index of the input it is (kept where the stage holds it anyway) or None (stored), and the
    stored leaves' shapes."""

    tree: Any
    spec: tuple[int | None, ...]
    stored: tuple[jax.ShapeDtypeStruct, ...]


class _Pipeline:
    """The pieces of one pipelined step (`pipelined_value_and_grad`): `outer` is the program
    at a microbatch's size (the prologue's), `cut` at one data group's share of it (the
    stages')."""

    def __init__(self, outer: _Cut, cut: _Cut, groups: _Groups, mesh: Mesh, stage_axis: str,
                 stages: int, virtual: int, microbatches: int,
                 rows: Sequence[Sequence[Action | None]], recompute: RecomputePolicy,
                 data_axes: Sequence[str] = (), scatter_gather: bool = True,
                 whole_query_attention: bool = False, stage_layers: tuple[int, ...] = (),
                 layouts: StageLayouts | None = None, kept: frozenset[int] = frozenset(),
                 lean_stash: bool = True):
        self.outer, self.cut, self.groups = outer, cut, groups
        self.lean_stash = lean_stash  # a split backward's stash as the stage holds values
        self.kept = kept  # layer 0's values a selective layer keeps (`_chunk_fn`)
        self.stage_layers = stage_layers  # uneven stages: the layers each runs
        self.mesh, self.stage_axis = mesh, stage_axis
        self.split_axes = _split_axes(mesh, stage_axis, data_axes, groups, scatter_gather)
        self.stages, self.microbatches, self.chunks = stages, microbatches, stages * virtual
        self.rows = rows
        self.full_recompute = recompute == "full"  # keep chunk inputs, not residuals
        self.selective = recompute == "selective"
        self.whole_queries = whole_query_attention
        self.slots = _slots(rows, stages, self.chunks, self.full_recompute)
        self.tables = _tables(rows, stages, self.chunks, self.slots)
        program = cut.program
        self.is_float = {v: bool(jnp.issubdtype(program.jax_dtypes[v], jnp.inexact))
                         for v in cut.shared + cut.per_mb}
        self.where = {v: ("shared", k) for k, v in enumerate(cut.shared)}
        self.where.update({v: ("mb", k) for k, v in enumerate(cut.per_mb)})
        self.carry_positions = tuple(cut.per_mb.index(v) for v in cut.scan.carries[0])
        self.constraints = self._constraints(layouts, data_axes)
        self.prologue_constraints = ({} if layouts is None else
                                     self._prologue_constraints(layouts))
        self.operand_reads = self._operand_reads(layouts) if self.constraints else {}
        # the carry's layouts: the plan's where it has one (replicated too), else None (left
        # to XLA: without layouts, and the stacks of the layers' outputs it carries)
        stacks = (None,) * len(cut.stacked_ys)
        self.entry, self.between = (tuple(self.constraints.get(v) for v in carries) + stacks
                                    for carries in (cut.scan.carries[0], cut.scan.carries[1]))
        self.loss_dtype = program.jax_dtypes[program.outputs[0]]
        # a schedule that splits the backward: the layers' weight matmuls defer their weights'
        # gradients to the W actions (`soapjax.apply._deferred`)
        split = any(a is not None and a.kind == "W" for row in rows for a in row)
        self.deferred = weight_matmuls(program, cut.scan, cut.layer) if split else ()
        self.stash_shapes = stash_shapes(program, self.deferred)
        self.matmul_specs = self._stash_specs(layouts)
        # per entry of the stash (`stash_shapes`): as kept, and as W's matmuls read it
        self.stash_specs, self.stash_reads = (tuple(
            spec for m, specs in zip(self.deferred, self.matmul_specs)
            for spec in (specs[x],) * m.own_x + (specs[dy],)) for x, dy in ((2, 3), (0, 1)))
        self.chunk_fns = {last: self._make_chunk_fn(last) for last in (False, True)}

    def _constraints(self, layouts: StageLayouts | None,
                     data_axes: Sequence[str]) -> dict[int, PartitionSpec]:
        """Per value id of the stage's program that an operator makes, its layout inside a
        stage (`_held_spec` of the plan's). None where `layouts` is None, where a stage's mesh
        has no automatic axes, and where the stages run whole microbatches while the batch is
        split over automatic data axes (how XLA lays values out over those is its own:
        `_split_axes`)."""
        sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
        manual = {self.stage_axis, *self.groups.axes}
        if (layouts is None or all(a in manual for a in sizes)
                or (not self.groups.axes and any(sizes[a] > 1 for a in data_axes))):
            return {}
        program = self.cut.program
        return {t.value: _held_spec(spec, program.shapes[t.value], sizes, manual)
                for op in self.cut.graph.operators
                if op.name in layouts.outputs and op.anchor != "attention"
                for t, spec in zip(op.outputs, layouts.outputs[op.name])}

    def _prologue_constraints(self, layouts: StageLayouts) -> dict[int, PartitionSpec]:
        """Per value id of the prologue's program (`outer`) that an operator before the first
        layer makes, its plan's layout over the whole mesh (no manual axes there; replicated
        over the stage axis, which no layout names)."""
        sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
        program, units = self.outer.program, set(self.outer.prologue)
        return {t.value: _held_spec(spec, program.shapes[t.value], sizes, set())
                for op in self.outer.graph.operators
                if op.name in layouts.outputs and op.anchor != "attention"
                and set(program.local[op.name].units) <= units
                for t, spec in zip(op.outputs, layouts.outputs[op.name])}

    def _operand_reads(self, layouts: StageLayouts) -> dict[int, list[tuple]]:
        """`Program.run`'s ``reads`` constraining every activation the layers and the
        epilogue read to its operator's layout (`StageLayouts.operands`), its cotangent to the
        layout that says, as the flat step's ``on_input`` does (so a stage's backward reads
        the gathered operand its forward kept, as the flat step's does). Not an attention
        operator's (XLA places those itself, as their outputs: `_constraints`). The
        epilogue's once were left to XLA too, which then computed a replicated tied head on
        the final norm's batch split and gathered the logits, where the plan gathers the
        norm's output (tests/test_check.py, the pipelined plan whose layers read another
        layout)."""
        sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
        manual = {self.stage_axis, *self.groups.axes}
        program, units = self.cut.program, set(self.cut.layer) | set(self.cut.epilogue)
        reads: dict[int, list[tuple]] = {}
        for op in self.cut.graph.operators:
            mine = [i for i in program.local[op.name].units if i in units]
            if not mine or op.name not in layouts.operands or op.anchor == "attention":
                continue
            first: dict[int, int] = {}
            for o, ((spec, back), x) in enumerate(zip(layouts.operands[op.name], op.inputs)):
                if x.kind == "activation" and spec is not None:
                    first.setdefault(x.value, o)
            for i in mine:
                for pos, v in enumerate(program.units[i].ins):
                    if v not in first:
                        continue
                    o = first[v]
                    spec, back = layouts.operands[op.name][o]
                    shape = op.inputs[o].shape
                    held = _held_spec(spec, shape, sizes, manual)
                    held_back = None if back is None else _held_spec(back, shape, sizes, manual)
                    reads.setdefault(i, []).append(
                        (pos, (op.name, o), functools.partial(_constrain_operand, spec=held,
                                                              back=held_back)))
        return reads

    def _stash_specs(self, layouts: StageLayouts | None) -> tuple[_StashSpecs, ...]:
        """Where a stage holds its stash (`soapjax.apply._deferred`), per weight matmul: the
        operand as the matmul reads it, and the output's cotangent as the matmul makes the
        output, before any reduction of its partial sums (a row-parallel matmul's whole,
        where the stage holds the output reduce-scattered); and as the stash keeps them: in
        the layout the stage holds the value in outside the matmul where that is smaller
        per device (the *lean* stash: under sequence parallelism the operand split along
        the sequence as its maker left it, a row-parallel matmul's cotangent as its
        reduce-scatter hands it back), which W gathers again; else, and under the schedules
        whose stash is gathered (`Schedule.gathered_stash`), as the matmul uses them, so W
        gathers nothing. `soapjax.simulate.pipesim` prices the same rule. None: where XLA
        puts it (no layouts)."""
        if not self.deferred or not self.constraints or layouts is None:
            return (_StashSpecs(),) * len(self.deferred)
        program = self.cut.program
        sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
        manual = {self.stage_axis, *self.groups.axes}
        op_of = {i: op for op in self.cut.graph.operators
                 for i in program.local[op.name].units}
        out: list[_StashSpecs] = []
        for m in self.deferred:
            unit = program.units[m.unit]
            op = op_of[m.unit]
            slice_id = self.cut.scan.slices[0][m.param]
            w_spec = next((_held_spec(spec, program.shapes[slice_id], sizes, manual)
                           for x, (spec, _) in zip(op.inputs, layouts.operands[op.name])
                           if x.value == slice_id and spec is not None), PartitionSpec())
            x_id = unit.ins[1 - m.weight]
            x_spec = _read_spec(self.operand_reads.get(m.unit, ()), 1 - m.weight)
            if x_spec is None:  # made inside the operator (GPT's GELU before fc2): as its
                shape = program.shapes[x_id]  # inputs of that shape are
                alike = [spec for x, (spec, _) in zip(op.inputs, layouts.operands[op.name])
                         if x.kind == "activation" and spec is not None
                         and tuple(program.shapes[x.value]) == tuple(shape)]
                held = {_held_spec(spec, shape, sizes, manual) for spec in alike}
                if len(held) == 1:  # (SwiGLU's gate and up alike)
                    x_spec = held.pop()
            specs = [w_spec, x_spec] if m.weight == 0 else [x_spec, w_spec]
            dy_spec = None if x_spec is None else _dot_output_spec(unit.eqn, specs)
            y_shape = program.shapes[unit.outs[0]]
            made = {self.constraints[t.value] for t in op.outputs  # the operator's output
                    if t.value in self.constraints and tuple(t.shape) == tuple(y_shape)}
            if not self.lean_stash:  # kept as used (`Schedule.gathered_stash`)
                out.append(_StashSpecs(x_spec, dy_spec, x_spec, dy_spec))
                continue
            out.append(_StashSpecs(
                x_spec, dy_spec,
                _smaller(self.constraints.get(x_id), x_spec, program.shapes[x_id], sizes),
                _smaller(made.pop() if len(made) == 1 else None, dy_spec, y_shape, sizes)))
        return tuple(out)

    def _constraint_hook(self) -> Callable | None:
        """`Program.run_units`'s hook holding every value a stage makes to `constraints`."""
        return _constraining(self.constraints)

    def _stage_hook(self) -> Callable | None:
        """`_constraint_hook`, after adding each of `_Groups.sums` across the data groups (a
        ``psum`` over their axes: the whole microbatch's sum, `_whole_statistics`)."""
        constrain, sums, axes = self._constraint_hook(), self.groups.sums, self.groups.axes
        if not sums:
            return constrain

        def hook(v: int, value: Any) -> Any:
            value = jax.lax.psum(value, axes) if v in sums else value
            return value if constrain is None else constrain(v, value)
        return hook

    def _make_chunk_fn(self, last: bool) -> _ChunkFn:
        """The function of a middle chunk, or with `last` of the last one."""
        reads = set(self.cut.layer_reads) | (set(self.cut.epilogue_reads) if last else set())
        values = self.cut.shared + self.cut.per_mb
        floats = tuple(v for v in values if v in reads and self.is_float[v])
        others = tuple(v for v in values if v in reads and not self.is_float[v])
        fn = _chunk_fn(self.cut, last, floats + others, self.selective, self.whole_queries,
                       counted=bool(self.stage_layers), hook=self._stage_hook(),
                       operand_reads=self.operand_reads, kept=self.kept,
                       literals=self.groups.literals, deferred=self.deferred,
                       matmul_specs=self.matmul_specs,
                       carry_specs=self.between[:len(self.cut.scan.carries[1])])
        # the count (uneven stages) and the stacks' row (`_Cut.stacked_ys`) ride last among the
        # others (`_inputs`)
        extra = (("count",) if self.stage_layers else ()) + (
            ("offset",) if self.cut.stacked_ys else ())
        n = len(extra)

        def call(p: list, f: list, o: list, carry: tuple, stash: Sequence[Any] = ()) -> Any:
            return fn(p, [*f, *o[:len(o) - n]], carry, **dict(zip(extra, o[len(o) - n:])),
                      stash=stash)
        return _ChunkFn(call, floats, others)

    # ---- outside the pipeline: prologue, split and gather

    def value_and_grad(self, params: Any, batch: Any) -> tuple[Any, Any]:
        cut = self.cut
        leaves, tree = jax.tree.flatten(params)
        stacked = [leaves[k] for k in cut.stacked]
        other = [x for k, x in enumerate(leaves) if k not in cut.stacked]
        micro = [split_microbatches(x, self.microbatches) for x in jax.tree.leaves(batch)]
        prologue = _prologue_fn(self.outer, _constraining(self.prologue_constraints))

        def by_kind(values: list, is_float: list[bool]) -> tuple[list, list]:
            return ([x for x, f in zip(values, is_float) if f],
                    [x for x, f in zip(values, is_float) if not f])

        def run_prologue(other_params: list) -> tuple:
            shared, per_mb = jax.vmap(prologue, in_axes=(None, 0), out_axes=(None, 0))(
                other_params, micro)
            shared_floats, shared_others = by_kind(shared, self._floats("shared"))
            mb_floats, mb_others = by_kind(per_mb, self._floats("mb"))
            return (shared_floats, mb_floats), (shared_others, mb_others)

        (shared_floats, mb_floats), prologue_vjp, (shared_others, mb_others) = jax.vjp(
            run_prologue, other, has_aux=True)
        into, back = self._hand_off()
        mb_floats = [_held_through(x, chain) for x, chain in zip(mb_floats, into)]
        loss, grads, d_shared, d_mb = self._shard_map()(
            stacked, shared_floats, shared_others, mb_floats, mb_others)
        d_mb = [_held_through(x, chain) for x, chain in zip(d_mb, back)]
        # each stage's own cotangents through the prologue's backward (linear), its parameters'
        # gradients then summed over the stages: one all-reduce of those, not of the
        # activations the prologue hands the stages (module doc)
        (d_other,) = jax.vmap(prologue_vjp)((d_shared, d_mb))
        d_other = [x.sum(0) for x in d_other]
        by_position, rest = dict(zip(cut.stacked, grads)), iter(d_other)
        out = [by_position[k] if k in by_position else next(rest) for k in range(len(leaves))]
        return loss.sum(), jax.tree.unflatten(tree, out)

    def _hand_off(self) -> tuple[list[tuple], list[tuple]]:
        """Per float the prologue hands the stages per microbatch, the layouts it is held to
        on its way into the stages (``[M, ...]``, from its maker's to the data groups') and
        its cotangent on its way back (``[S, M, ...]``), each step permute-free
        (`soapjax.cost.reshard_steps`); empty where the change is permute-free as it is,
        where no chain makes it, or where mesh axes stay automatic inside a stage (where the
        stage holds the value over those is XLA's). Made in one go, a change that slices the
        samples over one group axis and moves another to them (an embedding's hidden dim split
        over ``model``, the groups ``data`` and ``model``) XLA makes by replicating the value
        whole and slicing it again, where the simulator prices a slice and an all-to-all."""
        sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
        mesh = MeshShape.of(self.mesh)
        automatic = [a for a, n in sizes.items()
                     if n > 1 and a != self.stage_axis and a not in self.groups.axes]
        floats = self._floats("mb")
        into: list[tuple] = []
        back: list[tuple] = []
        for k, v in enumerate(self.outer.per_mb):
            if not floats[k]:
                continue
            made = self.prologue_constraints.get(v)
            if automatic or made is None or not self.groups.axes:
                into.append(())
                back.append(())
                continue
            shape = tuple(self.outer.program.shapes[v])
            dtype = self.outer.program.jax_dtypes[v]
            dim = self.groups.batch_dims[k]
            held = tuple(_axes(made[d]) if d < len(made) else () for d in range(len(shape)))
            grouped = tuple(self.groups.axes if d == dim else () for d in range(len(shape)))
            chains = (layout_steps((self.microbatches, *shape), dtype, ((), *held),
                                   ((), *grouped), mesh),
                      layout_steps((self.stages, self.microbatches, *shape), dtype,
                                   ((self.stage_axis,), (), *grouped),
                                   ((self.stage_axis,), (), *held), mesh))
            into.append(tuple(chains[0] or ()))
            back.append(tuple(chains[1] or ()))
        return into, back

    def _shard_map(self) -> Callable:
        """`_stage_program` manual over the stage axis and the data groups' axes: per stage,
        its loss, its chunks' parameter gradients and the cotangents of what the prologue
        handed it (shared, per microbatch)."""
        axis = self.stage_axis
        mb_floats, mb_others = self._mb_specs((None,))
        d_mb, _ = self._mb_specs((axis, None))
        return jax.shard_map(
            self._stage_program, mesh=self.mesh, axis_names={axis, *self.groups.axes},
            in_specs=(PartitionSpec(None, axis), PartitionSpec(), PartitionSpec(), mb_floats,
                      mb_others),
            out_specs=(PartitionSpec(axis), PartitionSpec(None, axis), PartitionSpec(axis),
                       d_mb),
            # The program's equations are bound as traced, literals and all, which the
            # varying-axes check refuses ("div requires varying manual axes to match").
            check_vma=False)

    def _mb_specs(self, lead: tuple) -> tuple[list, list]:
        """The specs of the per-microbatch floats and others (``[M, ...]``, after `lead`'s
        dims): their samples split over the data axes, so each data group gets its own."""
        data = self.groups.axes or None
        shapes = [self.cut.program.shapes[v] for v in self.cut.per_mb]
        specs = [PartitionSpec(*lead, *(data if k == dim else None for k in range(len(shape))))
                 for shape, dim in zip(shapes, self.groups.batch_dims)]
        floats = self._floats("mb")
        return ([s for s, f in zip(specs, floats) if f],
                [s for s, f in zip(specs, floats) if not f])

    # ---- inside: one stage's program

    def _stage_program(self, stacked: list, shared_floats: list, shared_others: list,
                       mb_floats: list, mb_others: list) -> tuple:
        # What one stage holds, kept on self while the program is traced (the branches read it).
        self.stacked = [x[:, 0] for x in stacked]  # [v, L / C, ...]: this stage's
        self.values = {"shared": _merge(shared_floats, shared_others, self._floats("shared")),
                       "mb": _merge(mb_floats, mb_others, self._floats("mb"))}
        self.stage = jax.lax.axis_index(self.stage_axis)
        self.residuals = ({} if self.full_recompute else
                          {last: self._probe(chunk) for last, chunk in self.chunk_fns.items()})
        state = self._initial_state(shared_floats, mb_floats)
        state = jax.lax.fori_loop(0, len(self.rows), self._tick, state)
        loss, grads, d_shared = state["loss"], state["param_grads"], state["d_shared"]
        if self.groups.axes:  # each data group's share, summed once per step (module doc)
            loss, grads, d_shared = jax.lax.psum((loss, grads, d_shared), self.groups.axes)
        return (loss[None], [g[:, None] for g in grads], [x[None] for x in d_shared],
                [x[None] for x in state["d_mb"]])

    def _floats(self, where: str) -> list[bool]:
        ids = self.cut.shared if where == "shared" else self.cut.per_mb
        return [self.is_float[v] for v in ids]

    def _inputs(self, chunk: _ChunkFn, microbatch: Any,
                local_chunk: Any) -> tuple[list, list, list]:
        """The parameters of the stage's `local_chunk`, and the float and other values
        `chunk` reads for `microbatch`."""
        def value(v):
            where, k = self.where[v]
            x = self.values[where][k]
            return x if where == "shared" else _row(x, microbatch)

        others = [value(v) for v in chunk.others]
        if self.stage_layers:  # the layers this stage runs (one chunk a stage)
            others.append(jnp.asarray(self.stage_layers, jnp.int32)[self.stage])
        if self.cut.stacked_ys:  # the chunk's first layer: its row of the stacks
            if self.stage_layers:
                starts = np.cumsum((0,) + self.stage_layers[:-1])
                others.append(jnp.asarray(starts, jnp.int32)[self.stage])
            else:
                per_chunk = len(self.cut.scan.steps) // self.chunks
                others.append((local_chunk * self.stages + self.stage) * per_chunk)
        return ([_row(p, local_chunk) for p in self.stacked], [value(v) for v in chunk.floats],
                others)

    def _carry_shapes(self) -> list[jax.ShapeDtypeStruct]:
        """The carry a chunk takes and passes on: the layers' own, then a ``[L, ...]`` stack
        of each output they stack (`_Cut.stacked_ys`)."""
        program, scan = self.cut.program, self.cut.scan
        own = [jax.ShapeDtypeStruct(program.shapes[v], program.jax_dtypes[v])
               for v in scan.carries[0]]
        return own + [jax.ShapeDtypeStruct(program.shapes[v], program.jax_dtypes[v])
                      for v in self.cut.stacked_ys]

    def _zeros(self, shapes: Sequence[Any], lead: tuple[int, ...] = ()) -> list:
        return [jnp.zeros(lead + tuple(s.shape), s.dtype) for s in shapes]

    def _probe(self, chunk: _ChunkFn) -> _Residuals:
        """The residuals of a forward of `chunk` (traced once, abstractly)."""
        params, floats, others = self._inputs(chunk, 0, 0)
        carry = tuple(self._zeros(self._carry_shapes()))
        found = {}

        def probe(params, floats, others, carry):
            found["tree"], found["spec"], stored = self._vjp(chunk, params, floats, others,
                                                             carry)[1:]
            return stored

        shapes = jax.eval_shape(probe, params, floats, others, carry)
        return _Residuals(found["tree"], found["spec"], tuple(shapes))

    def _vjp(self, chunk: _ChunkFn, params, floats, others, carry) -> tuple[Any, Any, tuple, list]:
        """The forward's output, the vjp closure's tree, its spec and the leaves to store."""
        out, vjp = self._chunk_vjp(chunk, params, floats, others, carry)
        leaves, tree = jax.tree.flatten(vjp)
        held = [*params, *floats, *others]
        spec = tuple(next((k for k, h in enumerate(held) if h is leaf), None) for leaf in leaves)
        return out, tree, spec, [leaf for leaf, k in zip(leaves, spec) if k is None]

    def _chunk_vjp(self, chunk: _ChunkFn, params, floats, others, carry) -> tuple[Any, Any]:
        """``jax.vjp`` of the chunk in its parameters, floats and carry (and, where its weight
        matmuls defer their gradients, a stash of zeros: `soapjax.apply._deferred`)."""
        if not self.deferred:
            return jax.vjp(lambda p, f, x: chunk.fn(p, f, others, x), params, floats, carry)
        stash = self._zeros(self.stash_shapes, (self.depth,))
        return jax.vjp(lambda p, f, x, st: chunk.fn(p, f, others, x, st), params, floats,
                       carry, stash)

    @property
    def depth(self) -> int:
        """The layers of one chunk's parameters (the longest stage's, uneven)."""
        return int(self.stacked[0].shape[1])

    def _initial_state(self, shared_floats: list, mb_floats: list) -> dict[str, Any]:
        """The tick loop's state: the receive buffers (``activations``, ``cotangents``, a slot
        more than `_Slots.counts` for scratch), the residual slots per kind of chunk, and the
        sums: the parameters' gradients, the cotangents of what the prologue handed the stage,
        the loss."""
        carry = self._carry_shapes()
        counts = self.slots.counts
        return {
            "activations": self._zeros(carry, (counts["activations"] + 1,)),
            "cotangents": self._zeros(carry, (counts["cotangents"] + 1,)),
            "residuals": {
                last: self._zeros(kept.stored,
                                  (max(counts["last_residuals" if last else "residuals"], 1),))
                for last, kept in self.residuals.items()},
            "stash": self._zeros(self.stash_shapes, (max(counts["stash"], 1), self.depth)),
            "param_grads": self._zeros(self.stacked),
            "d_shared": self._zeros(shared_floats),
            "d_mb": self._zeros(mb_floats),
            "loss": jnp.zeros((), self.loss_dtype),
        }

    def _tick(self, tick: Any, state: dict) -> dict:
        """One tick: every stage's action (a switch on the stage's kind), then the transfers:
        per direction, the ppermute over the pairs that send at this tick (a switch on the
        tick: every device takes the same branch, so the collective is well formed)."""
        tables = self.tables
        branches = [self._branch(key) for key in tables.keys]
        action = jnp.asarray(tables.actions)[tick, self.stage]
        if len(branches) == 1:
            state, sent_forward, sent_back = branches[0](state, action)
        else:
            which = jnp.asarray(tables.kind)[tick, self.stage]
            state, sent_forward, sent_back = jax.lax.switch(which, branches, state, action)
        for (sets, sending), buffer, recv, value, name in zip(
                tables.sends, ("activations", "cotangents"),
                (tables.activation_recv, tables.cotangent_recv), (sent_forward, sent_back),
                ("pipeline_activations", "pipeline_gradients")):
            if not sets:
                continue
            moves = [self._none_like] + [self._permute(pairs, name) for pairs in sets]
            got = jax.lax.switch(jnp.asarray(sending)[tick], moves, value)
            slot = jnp.asarray(recv)[tick, self.stage]
            state = {**state, buffer: [_with_row(b, slot, x) for b, x in zip(state[buffer], got)]}
        return state

    def _permute(self, pairs: tuple[tuple[int, int], ...], name: str) -> Callable:
        """The ppermute over `pairs`, each value sent in the pieces of the scatter/gather rule
        (module doc, `_send_spec`) and made whole again on arrival."""
        def move(value: tuple) -> tuple:
            with jax.named_scope(name):
                held = [PartitionSpec() if h is None else h for h in self.between]
                return tuple(self._send(x, h, _send_spec(np.shape(x), self.split_axes, h), pairs)
                             for x, h in zip(value, held))

        return move

    def _send(self, x: Any, held: PartitionSpec, spec: PartitionSpec | None,
              pairs: tuple[tuple[int, int], ...]) -> Any:
        """`x`, held in `held`, sent over `pairs`: whole, or with `spec` (`_send_spec`) each
        device's piece over its own link, then gathered back into `held` (module doc)."""
        if spec is None:
            return jax.lax.ppermute(x, self.stage_axis, list(pairs))
        axes = {a for entry in spec for a in _axes(entry)}
        piece = jax.shard_map(lambda y: jax.lax.ppermute(y, self.stage_axis, list(pairs)),
                              mesh=jax.sharding.get_abstract_mesh(), in_specs=spec,
                              out_specs=spec, axis_names=axes,
                              check_vma=False)(_constrain(_constrain(x, held), spec))
        return _constrain(piece, held)

    def _none_like(self, value: tuple) -> tuple:
        return self._none()

    def _branch(self, key: tuple) -> Callable:
        if key[0] == "idle":
            return self._idle
        kind, first, last = key
        if kind == "W":
            return self._weights
        step = self._forward if kind == "F" else self._backward
        return lambda state, action: step(state, action, first, last)

    def _none(self) -> tuple:
        return self._hold(self._zeros(self._carry_shapes()))

    def _hold(self, carry: Sequence[Any], layouts: Sequence[PartitionSpec] | None = None
              ) -> tuple:
        """The carry (or its cotangent) constrained to where the stages hold it (`between`,
        or `layouts`; None: left to XLA): every branch of a switch that returns it returns it
        there."""
        layouts = self.between if layouts is None else layouts
        return tuple(x if held is None else _constrain(x, held)
                     for x, held in zip(carry, layouts))

    def _idle(self, state: dict, action: Any) -> tuple[dict, tuple, tuple]:
        return state, self._none(), self._none()

    def _chunk_input(self, state: dict, action: Any, first: bool) -> tuple:
        """The carry the chunk of `action` starts from: the prologue's for the first chunk
        (in its maker's layout, `entry`, then converted once to the layers' own, `between`,
        as the simulator prices the first layer's read), else the activation received into
        its slot."""
        if first:  # (the stacks of the layers' outputs start empty)
            carry = [_row(self.values["mb"][k], action[_MICROBATCH])
                     for k in self.carry_positions]
            carry += self._zeros(self._carry_shapes()[len(carry):])
            carry = self._hold(carry, self.entry)
        else:
            carry = [_row(b, action[_ACTIVATION_SLOT]) for b in state["activations"]]
        return self._hold(carry, self.between)

    def _forward(self, state: dict, action: Any, first: bool, last: bool):
        chunk = self.chunk_fns[last]
        params, floats, others = self._inputs(chunk, action[_MICROBATCH], action[_LOCAL_CHUNK])
        carry = self._chunk_input(state, action, first)
        if self.full_recompute:
            out = chunk.fn(params, floats, others, carry)
        else:
            out, _, spec, stored = self._vjp(chunk, params, floats, others, carry)
            assert spec == self.residuals[last].spec, "the forward saves what the probe saw"
            slot = action[_RESIDUAL_SLOT]
            state = {**state, "residuals": {**state["residuals"], last: [
                _with_row(b, slot, v) for b, v in zip(state["residuals"][last], stored)]}}
        if last:
            share = self.microbatches * self.groups.count
            return ({**state, "loss": state["loss"] + out.astype(self.loss_dtype) / share},
                    self._none(), self._none())
        return state, self._hold(out), self._none()

    def _backward(self, state: dict, action: Any, first: bool, last: bool):
        chunk = self.chunk_fns[last]
        microbatch, local_chunk = action[_MICROBATCH], action[_LOCAL_CHUNK]
        vjp = self._pullback(state, action, first, last)
        if last:
            # the loss is the mean over microbatches and data groups of theirs
            cotangent = jnp.full((), 1 / (self.microbatches * self.groups.count),
                                 self.loss_dtype)
        else:
            cotangent = tuple(_row(b, action[_COTANGENT_SLOT]) for b in state["cotangents"])
        d_params, d_floats, d_carry, *d_stash = vjp(cotangent)
        state = {**state, "param_grads": [_add_to_row(g, local_chunk, d)
                                          for g, d in zip(state["param_grads"], d_params)]}
        if self.deferred:  # what the W of this action computes the weights' gradients from
            slot = action[_STASH_SLOT]
            state = {**state, "stash": self._held_stash(
                [_with_row(b, slot, d) for b, d in zip(state["stash"], d_stash[0])])}
        state = self._accumulate(state, microbatch, zip(chunk.floats, d_floats))
        if first:  # the gradient of the layers' input goes back to the prologue
            state = self._accumulate(state, microbatch, zip(self.cut.scan.carries[0], d_carry))
            return state, self._none(), self._none()
        return state, self._none(), self._hold(d_carry)

    def _pullback(self, state: dict, action: Any, first: bool, last: bool) -> Callable:
        """The chunk's vjp closure: recomputed from its input, or rebuilt from the residuals
        its forward kept (and the inputs the stage holds anyway)."""
        chunk = self.chunk_fns[last]
        params, floats, others = self._inputs(chunk, action[_MICROBATCH], action[_LOCAL_CHUNK])
        if self.full_recompute:
            carry = self._chunk_input(state, action, first)
            return self._chunk_vjp(chunk, params, floats, others, carry)[1]
        kept = self.residuals[last]
        held = [*params, *floats, *others]
        stored = iter(_row(b, action[_RESIDUAL_SLOT]) for b in state["residuals"][last])
        return jax.tree.unflatten(kept.tree, [held[k] if k is not None else next(stored)
                                              for k in kept.spec])

    def _weights(self, state: dict, action: Any) -> tuple[dict, tuple, tuple]:
        """A W action: the gradients of its chunk's weights from the stash its B left
        (`soapjax.apply._deferred.weight_grads`), read in the layouts the matmuls use (a
        lean stash gathered again), added to the stage's."""
        local_chunk = action[_LOCAL_CHUNK]
        params = [_row(p, local_chunk) for p in self.stacked]
        stash = [_row(b, action[_STASH_SLOT]) for b in self._held_stash(state["stash"])]
        stash = [x if spec is None else _constrain(x, PartitionSpec(None, *spec))  # gathered
                 for x, spec in zip(stash, self.stash_reads)]  # again where kept lean
        grads = weight_grads(self.cut.program, self.deferred, params, stash)
        state = {**state, "param_grads": [g if d is None else _add_to_row(g, local_chunk, d)
                                          for g, d in zip(state["param_grads"], grads)]}
        return state, self._none(), self._none()

    def _held_stash(self, buffers: Sequence[Any]) -> list[Any]:
        """The stash buffers (``[slots, layers, ...]``) held where `stash_specs` says."""
        return [b if spec is None else _constrain(b, PartitionSpec(None, None, *spec))
                for b, spec in zip(buffers, self.stash_specs)]

    def _accumulate(self, state: dict, microbatch: Any, cotangents) -> dict:
        """Adds the cotangents of values the prologue made: to the shared ones', or to
        `microbatch`'s."""
        d_shared, d_mb = list(state["d_shared"]), list(state["d_mb"])
        shared = {v: k for k, v in enumerate(self._float_ids("shared"))}
        per_mb = {v: k for k, v in enumerate(self._float_ids("mb"))}
        for v, d in cotangents:
            if v in shared:
                d_shared[shared[v]] = d_shared[shared[v]] + d
            else:
                d_mb[per_mb[v]] = _add_to_row(d_mb[per_mb[v]], microbatch, d)
        return {**state, "d_shared": d_shared, "d_mb": d_mb}

    def _float_ids(self, where: str) -> list[int]:
        ids = self.cut.shared if where == "shared" else self.cut.per_mb
        return [v for v in ids if self.is_float[v]]


def _merge(floats: Sequence[Any], others: Sequence[Any], is_float: Sequence[bool]) -> list:
    """Floats and others back in one list, in the order `is_float` says."""
    f, o = iter(floats), iter(others)
    return [next(f) if b else next(o) for b in is_float]


def _key(a: Action | None, chunks: int) -> tuple:
    """The kind of branch an action runs: idle, (F or B, first chunk, last chunk), or W (the
    same for every chunk)."""
    if a is None:
        return ("idle",)
    if a.kind == "W":
        return ("W", False, False)
    return (a.kind, a.chunk == 0, a.chunk == chunks - 1)
