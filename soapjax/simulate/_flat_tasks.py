"""The flat simulation's task building (a part of `soapjax.simulate._flatsim.Simulation`): one
operator under one config as a view (times, layouts, partial sums), and the units of the task
graph built from views: an operator's own collectives, an activation edge's resharding both
ways (a parameter's gathers, gradient synchronisation and update: `_flat_leaves`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from soapjax.base.errors import PlanError
from soapjax.graph._cotangents import differentiated_operands, has_backward
from soapjax.graph._cuts import fft_gathers, inner_cuts, moved_elements
from soapjax.graph._inner import (
    inner_reductions,
    matmul_operands,
    partial_sum_value,
    query_dims,
)
from soapjax.graph._remat import remat_recomputes, remat_rereads
from soapjax.simulate._flat_memory import shard_bytes
from soapjax.simulate._simresult import (
    BACKWARD,
    FORWARD,
    INNER_REDUCE,
    INNER_REDUCE_BWD,
    PARAM_GATHER,
    PARTIAL_SUM,
    RESHARD,
    RESHARD_BWD,
    UPDATE,
    UPDATE_REDUCE,
)
from soapjax.simulate._taskgraph import CHAIN, EDGE, LEAF, Comm, TaskGraph
from soapjax.strategy.memory import (
    microbatch_degrees,
    microbatch_error,
    microbatch_shape,
    recomputes,
)
from soapjax.strategy.space import (
    Config,
    MeshShape,
    Strategy,
    reduces_into,
    validate_config,
)

__all__: list[str] = ["scatter_target", "scattered_operand_axes"]


class _View(NamedTuple):
    """One operator under one config: times, tensor specs, partial sums, activation bytes."""

    config: Config
    forward_s: float
    backward_s: float
    out_specs: tuple[tuple[tuple[str, ...], ...], ...]
    operand_specs: tuple[tuple[tuple[str, ...], ...], ...]
    partials: tuple[tuple[str, ...], ...]  # per operand: axes its cotangent is a partial sum on
    reduction_axes: tuple[str, ...]  # the axes splitting its reduction dims (partial sums)
    inner_forward: tuple[Comm, ...]  # all-reduces of statistics it reduces over split dims,
    # then the moves of pieces it cuts along split dims (`soapjax.graph._cuts`)
    inner_backward: tuple[Comm, ...]  # ... and their backward (`soapjax.graph._inner`)
    output_bytes: tuple[int, ...]  # per output, its shard (one microbatch's)
    operand_bytes: tuple[int, ...]  # per operand, its shard at its layout here (0: not activation)
    internal_bytes: int  # the values inside it its backward reads (`memory.residuals`)
    policy: str  # its recompute policy (`soapjax.strategy.memory`)
    recomputes: bool  # whether it drops its outputs and runs its forward again
    # per operand, `partials` grouped by the iteration dim they split (`_by_dim`)
    partial_groups: tuple[tuple[tuple[str, ...], ...], ...] = ()
    # per operand with a partial cotangent that the operator computes on before its matmul:
    # the shard of what the matmul reads in its place, where XLA reduces it (else 0) ...
    matmul_bytes: tuple[int, ...] = ()
    # ... and that value's layout here (else None)
    matmul_specs: tuple[tuple[tuple[str, ...], ...] | None, ...] = ()


def scatter_target(op: Any, config: Config, consumer_axes: Sequence[tuple],
                   mesh: MeshShape) -> tuple | None:
    """The layout a row-parallel operator's partial sums are reduce-scattered into, or None.

    Where `config` splits reduction dims of `op` (its output is a partial sum over those
    axes) and every consumer of its one output reads it in one layout that is the config's
    output layout with some dims split further over all of those same axes (Megatron's
    sequence parallelism: attn/out's and fc2's outputs go into norms split along the
    sequence over the tensor-parallel axes), the partial sums are reduce-scattered straight
    into that layout, and what the operator does after its matmul (the bias, a residual add)
    runs on the slice. Apply constrains the matmul's result to it (`soapjax.apply._flatstep`); the
    simulator prices the reduce-scatter in place of the all-reduce. Not where the readers
    split over only some of the axes: a sum over ``node`` and ``model`` constrained to the
    batch over ``data`` and ``model`` (a reduce-scatter over one axis, an all-reduce over the
    other) made XLA's partitioners (both; docs/xla-workarounds.md) compute wrong values (ViT, found
    by `scripts/fuzz_exactness.py`; `tests/test_exactness.py` keeps XLA's canary).

    Args:
      op: the operator.
      config: its config.
      consumer_axes: the operand axes (`Config.operand_axes`) of each reader of its output,
        under the readers' own configs.
      mesh: the mesh.
    """
    red = config.reduction_axes(op)
    if not red or len(op.outputs) != 1 or not consumer_axes:
        return None
    dst = tuple(tuple(a) for a in consumer_axes[0])
    if any(tuple(tuple(a) for a in c) != dst for c in consumer_axes[1:]):
        return None
    x = op.outputs[0]
    out = config.operand_axes(x.dims)
    if len(dst) != len(out) or dst == out:
        return None
    added = set()
    for o, d, size in zip(out, dst, x.shape):
        if d[:len(o)] != o or not set(d[len(o):]) <= set(red) or size % mesh.degree(d):
            return None
        added |= set(d[len(o):])
    if added != set(red):
        return None  # part scattered, part all-reduced: XLA computes it wrongly (module doc)
    return dst


def scattered_operand_axes(op: Any, config: Config, o: int, target: tuple | None,
                           mesh: MeshShape) -> tuple:
    """Operand `o`'s layout where `op`'s partial sums are reduce-scattered into `target`
    (`scatter_target`): an activation added after the matmul (its value flows into none of
    the split reduction dims: `Operand.outside`, a residual) is read split as the output is,
    so the add runs on the slice; any other operand (and every one where `target` is None)
    keeps its config's layout."""
    x = op.inputs[o]
    axes = config.operand_axes(x.dims)
    if target is None or x.kind != "activation":
        return axes
    split = {d for d in range(len(op.shape), len(config.axes)) if config.axes[d]}
    if not split <= set(x.outside):
        return axes
    out = config.operand_axes(op.outputs[0].dims)
    extra = {d: t[len(a):] for d, a, t in zip(op.outputs[0].dims, out, target) if d is not None}
    new = tuple(a + extra.get(d, ()) if d is not None else a for a, d in zip(axes, x.dims))
    if any(size % mesh.degree(a) for size, a in zip(x.shape, new)):
        return axes
    return new


class _OpComm(NamedTuple):
    """An operator's own collectives (`Simulation._build_op_comm`)."""

    forward: list[int]  # its statistics' all-reduces, then its partial sums'
    inner: int  # how many of `forward` are statistics
    backward: list[int]  # its statistics' all-reduces in the backward pass


class _EdgeTasks(NamedTuple):
    """An activation edge's communication tasks."""

    forward: list[int]  # its resharding (empty when a sibling edge's serves it: `_resharded_by`)
    backward: list[int]  # its cotangent's way back (empty when a sibling's serves it)
    # its resharding again before a recomputing reader's backward (`_build_again`; empty
    # when the reader keeps its outputs, or a sibling's serves it: `_again_by`)
    again: list[int] = []


def _by_dim(dims: Sequence[tuple[str, ...]], axes: tuple[str, ...]
            ) -> tuple[tuple[str, ...], ...]:
    """`axes` (in mesh order) grouped by the dim of `dims` (a config's axes per iteration dim)
    that each splits, in dim order: ``(("data",), (), ("model",))`` groups ``("data",
    "model")`` as ``(("data",), ("model",))``."""
    return tuple(g for d in dims if (g := tuple(a for a in axes if a in d)))


class _TaskBuilding:
    """The units of a `Simulation`'s task graph, built from its operators' views."""

    def _validate(self, strategy: Strategy) -> None:
        if len(strategy.configs) != self._layout.n:
            raise PlanError(f"strategy has {len(strategy.configs)} configs, graph "
                            f"{self.graph.name!r} has {self._layout.n} operators")
        for field in ("zero_axes", "optimizer_axes"):
            unknown = [a for a in getattr(strategy, field) if a not in self.mesh.axis_names]
            if unknown:
                raise PlanError(f"{field} {unknown} are not mesh axes "
                                f"{list(self.mesh.axis_names)}")

    def _build(self, strategy: Strategy) -> None:
        """Builds the task graph of `strategy` (untimed)."""
        if strategy.pipelined:
            raise PlanError(f"a strategy with {strategy.stages} pipeline stages is simulated by "
                            "soapjax.simulate.front.simulate (or open_simulation), which runs this "
                            "Simulation on one stage's devices")
        self._validate(strategy)
        layout = self._layout
        self._zero = tuple(strategy.zero_axes)
        self._optimizer = tuple(a for a in strategy.optimizer_axes if a not in self._zero)
        self._micro = strategy.microbatches
        self._ring = strategy.ring_attention
        self._views = [self._view(j, c, strategy.recompute_of(j))
                       for j, c in enumerate(strategy.configs)]
        self._scatter = [self._scatter_of(j) for j in range(layout.n)]
        kernels = self.topology.device.kernels
        self._task_graph = task_graph = TaskGraph(
            len(self._pricing.resource_channels),
            contention=kernels.overlap_slowdown if kernels is not None else 0.0)
        self._buffer_counts: dict[int, int] = {}  # communication buffer bytes -> tasks
        self._forward_task = [
            task_graph.new(layout.fwd_key(j, layout.slots - 2), v.forward_s, (0,), [],
                           (FORWARD, j)) for j, v in enumerate(self._views)]
        self._backward_task = [
            task_graph.new(layout.bwd_key(j, 0), v.backward_s, (0,), [], (BACKWARD, j))
            for j, v in enumerate(self._views)]
        self._op_comm = [self._build_op_comm(j) for j in range(layout.n)]
        self._edge_tasks = [self._build_edge(e) for e in range(len(layout.edges))]
        self._leaf_tasks = [self._build_leaf(leaf) for leaf in range(len(layout.leaf_source))]
        for j in range(layout.n):
            task_graph.deps[self._forward_task[j]] = self._forward_deps(j)
            task_graph.deps[self._backward_task[j]] = self._backward_deps(j)
            for head in self._again_tasks(j, ends=False):
                task_graph.deps[head] = self._cotangent_deps(j)
        self._act = None
        self._stored_bytes = sum(unit.stored_bytes for unit in self._leaf_tasks)
        self._leaf_bytes = sum(unit.activation_bytes for unit in self._leaf_tasks)
        task_graph.build()
        self._count_buffers([t for t in task_graph.order
                             if task_graph.info[t][0] not in (FORWARD, BACKWARD)], +1)

    def _scatter_of(self, j: int) -> tuple[tuple | None, tuple]:
        """Operator `j`'s `scatter_target` under the current views (None where its partial
        sums are all-reduced) and its operands' layouts (`scattered_operand_axes`)."""
        layout, views, v = self._layout, self._views, self._views[j]
        if not v.reduction_axes:
            return None, v.operand_specs
        op = self.graph.operators[j]
        readers = [views[layout.edges[e][2]].operand_specs[layout.edges[e][3]]
                   for e in layout.out_edges[j]]
        target = scatter_target(op, v.config, readers, self.mesh)
        if target is None:
            return None, v.operand_specs
        return target, tuple(scattered_operand_axes(op, v.config, o, target, self.mesh)
                             for o in range(len(op.inputs)))

    def _dst(self, j: int, o: int) -> tuple:
        """The layout operator `j` reads operand `o` in (`_scatter_of`)."""
        return self._scatter[j][1][o]

    def _view(self, j: int, config: Config, policy: str = "none") -> _View:
        m = self._micro
        key = (self._canon[j], config, policy, m, self._ring)
        v = self._views_memo.get(key)
        if v is None:
            validate_config(self.graph, j, config, self.mesh)
            op = self.graph.operators[j]
            why = microbatch_error(op, config, self.mesh, m)
            if why:
                raise PlanError(f"{why}; choose microbatches dividing every operator's "
                                "per-device batch")
            if m == 1:
                t = self.cost_model.op_time(j, config)
            else:  # one microbatch's shard, M times (`soapjax.strategy.memory`)
                t = self.cost_model.shard_time(
                    j, microbatch_degrees(op, config.degrees(self.mesh), m))
            # no cotangents back, no partial sums of them where there is no backward
            # (`soapjax.graph._cotangents`); recomputing, the forward runs again all the same
            differentiated = differentiated_operands(self.graph, j)
            recompute = recomputes(op, policy) or remat_recomputes(self.graph, j)
            forward = m * self._compute_time(float(t.forward_s))
            backward = m * self._compute_time(float(t.backward_s))
            if recompute:
                backward += forward
            outs = tuple(config.operand_axes(x.dims) for x in op.outputs)
            specs = tuple(config.operand_axes(x.dims) for x in op.inputs)
            partials = tuple(config.cotangent_partials(x, self.mesh.axis_names) if d else ()
                             for x, d in zip(op.inputs, differentiated))
            ring = self._ring_of(j, config)
            if ring is not None:  # the keys and values stay split; the ring moves them
                forward, backward = forward * ring.work, backward * ring.work
                specs, partials = ring.specs(op, specs, partials)
            whole = self._whole_tiles(j, config)
            forward, backward = forward * whole, backward * whole
            sample = self._sample[j]
            def nbytes(shape, dims, dtype, spec):
                return shard_bytes(microbatch_shape(shape, dims, sample, m), spec, dtype,
                                   self.mesh)

            output_bytes = tuple(nbytes(x.shape, x.dims, x.dtype, s)
                                 for x, s in zip(op.outputs, outs))
            operand_bytes = tuple(nbytes(x.shape, x.dims, x.dtype, s)
                                  if x.kind == "activation" else 0
                                  for x, s in zip(op.inputs, specs))
            internal = sum(nbytes(shape, dims, dtype, config.operand_axes(dims))
                           for shape, dtype, dims in self._segments.internal[j])
            inner_forward, inner_backward = self._inner_chains(j, config)
            if ring is not None:
                inner_forward += self._ring_chain(j, ring, specs, backward=False)
                inner_backward += self._ring_chain(j, ring, specs, backward=True)
            elif not self._whole_queries:
                zigzag = self._zigzag_chain(j, config)
                inner_forward, inner_backward = inner_forward + zigzag, inner_backward + zigzag
            if not has_backward(self.graph, j):
                inner_backward = ()
            if recompute:  # the forward it runs again all-reduces its statistics again
                inner_backward = inner_forward + inner_backward
            v = self._views_memo[key] = _View(
                config, forward, backward, outs, specs, partials,
                tuple(config.reduction_axes(op)), inner_forward, inner_backward, output_bytes,
                operand_bytes, internal, policy, recompute,
                tuple(_by_dim(config.axes, p) for p in partials),
                tuple(nbytes(m.shape, m.dims, m.dtype, config.operand_axes(m.dims))
                      if m is not None and p else 0
                      for m, p in zip(matmul_operands(self.graph, j), partials)),
                tuple(config.operand_axes(m.dims) if m is not None and p else None
                      for m, p in zip(matmul_operands(self.graph, j), partials)))
        return v

    def _inner_chains(self, j: int, config: Config) -> tuple[tuple[Comm, ...], tuple[Comm, ...]]:
        """The all-reduces of the statistics operator `j` reduces over dims `config` splits
        (`soapjax.graph._inner`), forward and backward: per set of mesh axes one collective of all
        of them (XLA combines them), priced as one all-reduce per statistic, each microbatch;
        then the moves of pieces it cuts or joins along split dims (`_cut_moves`), and the
        gathers of what its transforms read (`soapjax.graph._cuts.fft_gathers`)."""
        groups: dict[tuple[str, ...], list[tuple[Comm, bool]]] = {}
        for r in inner_reductions(self.graph, j):
            axes = tuple(a for a in self.mesh.axis_names
                         if any(a in config.axes[d] for d in r.reduced))
            if not axes:
                continue
            spec = tuple(config.axes[d] if d is not None else () for d in r.dims)
            shape = microbatch_shape(r.shape, r.dims, self._sample[j], self._micro)
            c = self._pricing.comm("all_reduce", shard_bytes(shape, spec, r.dtype, self.mesh),
                                   axes)
            if c is not None:
                groups.setdefault(axes, []).append((c, r.backward))

        def combined(comms: list[Comm]) -> tuple[Comm, ...]:
            if not comms:
                return ()
            return (comms[0]._replace(nbytes=sum(c.nbytes for c in comms),
                                      dur=sum(c.dur for c in comms),
                                      sent=sum(c.sent for c in comms)),)

        forward = tuple(c for cs in groups.values() for c in combined([c for c, _ in cs]))
        backward = tuple(c for cs in groups.values() for c in combined([c for c, b in cs if b]))
        moves = self._cut_moves(j, config)
        forward += tuple(c for c, _ in moves)
        backward += tuple(c for c, b in moves if b)
        for g in fft_gathers(self.graph, j):  # XLA computes a transform whole: gathered first
            axes = tuple(a for d in g.dims if d is not None for a in config.axes[d])
            shape = microbatch_shape(g.shape, g.dims, self._sample[j], self._micro)
            c = self._pricing.comm("all_gather", shard_bytes(shape, (), g.dtype, self.mesh),
                                   axes) if axes else None  # (its result's bytes, as XLA's)
            if c is not None:
                backward, forward = (backward + (c,), forward) if g.backward else (
                    backward, forward + (c,))
        return self._per_microbatch(forward), self._per_microbatch(backward)

    def _cut_moves(self, j: int, config: Config) -> list[tuple[Comm, bool]]:
        """The collective-permutes of the pieces operator `j` cuts from, or joins into, a dim
        `config` splits (`soapjax.graph._cuts`: each device's block of a piece is not where
        its block of the whole is), each with whether the backward moves them back."""
        out = []
        queries = query_dims(self.graph, j)
        if queries is not None and config.axes[queries.sequence]:
            return out  # context parallelism: apply runs the attention's program itself
        for cut in inner_cuts(self.graph, j):
            axes = tuple(config.axes[cut.dim])
            degree = self.mesh.degree(axes) if axes else 1
            moved = moved_elements(cut, degree)
            if not moved:
                continue
            shape = microbatch_shape(cut.shape, cut.dims, self._sample[j], self._micro)
            block = shard_bytes(shape, config.operand_axes(cut.dims), cut.dtype, self.mesh)
            c = self._pricing.comm("collective_permute",
                                   block * moved / (cut.whole / degree), axes)
            if c is not None:
                out.append((c, cut.backward))
        return out

    def _per_microbatch(self, chain: tuple[Comm, ...]) -> tuple[Comm, ...]:
        """`chain` run once per microbatch: M times its time, bytes sent and runs."""
        m = self._micro
        if m == 1 or not chain:
            return chain
        key = (chain, m)
        out = self._scaled.get(key)
        if out is None:
            out = self._scaled[key] = tuple(c._replace(dur=c.dur * m, sent=c.sent * m,
                                                       runs=c.runs * m) for c in chain)
        return out

    def _activation_chain(self, x: Any, sample: int | None, src: tuple, dst: tuple,
                          partial: tuple[str, ...] = ()) -> tuple[Comm, ...]:
        """The resharding of activation `x` (an operand or output, `dims` of an operator whose
        sample dim is `sample`) for each microbatch, at microbatch size."""
        key = ("activation", x.shape, x.dims, x.dtype, sample, src, dst, partial, self._micro)
        out = self._memo.get(key)
        if out is None:
            shape = microbatch_shape(x.shape, x.dims, sample, self._micro)
            out = self._memo[key] = self._per_microbatch(
                self._pricing.chain(shape, x.dtype, src, dst, partial))
        return out

    def _chain_tasks(self, chain: tuple[Comm, ...], key: int, head: list[int], kind: str,
                     subject: Any) -> list[int]:
        """One task per collective of `chain`, each after the previous, the first after
        `head`; keys from `key` on."""
        task_graph, out = self._task_graph, []
        if len(chain) >= CHAIN:  # keys would run into the next slot's
            raise RuntimeError(f"{len(chain)} collectives in one chain of {kind} tasks; the "
                               f"task graph's keys leave room for {CHAIN - 1}")
        for pos, c in enumerate(chain):
            out.append(task_graph.new(key + pos, c.dur, c.res, [out[-1]] if out else list(head),
                                      (kind, c, subject)))
        return out

    def _build_op_comm(self, j: int) -> _OpComm:
        """Operator `j`'s own collectives: after its forward task the all-reduces of the
        statistics it reduces over split dims (`_inner_chains`), then of its partial sums (none
        unless it splits a reduction); after its backward task the statistics' backward, and
        where the model's own remat runs the partial sums again (`soapjax.graph._remat`),
        those first."""
        v, layout = self._views[j], self._layout
        key = layout.fwd_key(j, layout.slots - 1)
        forward = self._chain_tasks(v.inner_forward, key, [self._forward_task[j]],
                                    INNER_REDUCE, j)
        again: tuple[Comm, ...] = ()
        if v.reduction_axes:
            x, src = self.graph.operators[j].outputs[0], v.out_specs[0]
            target = self._scatter[j][0] or src  # reduce-scattered, else all-reduced
            chain, partial, axes = (), v.reduction_axes, v.config.axes
            summed = partial_sum_value(self.graph, j)
            if summed is not None and self._scatter[j][0] is None:  # reduced before the output
                inside = tuple(a for d in summed.summed for a in axes[d])
                if inside:  # the matmul's own sums: at its result, over the axes splitting them
                    spec = tuple(tuple(axes[d]) if d is not None else () for d in summed.dims)
                    chain = self._activation_chain(summed, self._sample[j], spec, spec, inside)
                    partial = tuple(a for a in partial if a not in inside)  # the output's rest
            if partial:
                chain += self._activation_chain(x, self._sample[j], src, target, partial)
            forward += self._chain_tasks(chain, key + len(forward),
                                         forward[-1:] or [self._forward_task[j]], PARTIAL_SUM, j)
            if remat_rereads(self.graph, j):  # the model's remat runs its partial sums again
                again = chain
        # slot 0 holds the backward task at position 0; the statistics follow it
        backward = self._chain_tasks(again + v.inner_backward, layout.bwd_key(j, 0, 1),
                                     [self._backward_task[j]], INNER_REDUCE_BWD, j)
        return _OpComm(forward, len(v.inner_forward), backward)

    def _output_ready(self, p: int, k: int) -> int:
        """The task after which operator `p`'s output `k` is complete: the all-reduce of its
        partial sums (output 0 only), else of its statistics, else its forward task."""
        comm = self._op_comm[p]
        tasks = comm.forward if k == 0 else comm.forward[:comm.inner]
        return tasks[-1] if tasks else self._forward_task[p]

    def _backward_done(self, j: int) -> int:
        """The task after which operator `j`'s operands' cotangents are complete: the
        all-reduce of its statistics' backward, else its backward task."""
        backward = self._op_comm[j].backward
        return backward[-1] if backward else self._backward_task[j]

    def _same_layout(self, e: int, *, backward: bool = False) -> list[int]:
        """The edges carrying edge `e`'s value to the same layout, in edge order (consumers in
        program order): the first one's forward resharding serves them all (XLA computes the
        collective once). Backward, the same where the cotangents come back whole (no partial
        axes): XLA adds them in the consumers' layout and moves the sum once (a MoE's gate and
        up read the dispatched tokens: one all-to-all back, not two). Partial sums are each
        reduced where they are made, as the gradient syncs are: `e` alone."""
        layout, views = self._layout, self._views
        _, _, j, o = layout.edges[e]
        dst = self._dst(j, o)
        if backward and views[j].partials[o]:
            return [e]
        out = []
        for s in layout.siblings[e]:  # backward: of those that get a cotangent back
            js, os = layout.edges[s][2:]
            if s == e or (self._dst(js, os) == dst and not (backward and (
                    views[js].partials[os] or not differentiated_operands(self.graph, js)[os]))):
                out.append(s)
        return out

    def _resharded_by(self, e: int, *, backward: bool = False) -> int:
        """The edge whose resharding serves edge `e` (`_same_layout`'s first)."""
        return self._same_layout(e, backward=backward)[0]

    def _build_edge(self, e: int) -> _EdgeTasks:
        layout = self._layout
        p, k, j, o = layout.edges[e]
        x = self.graph.operators[j].inputs[o]
        # a reduce-scattered output is made in its readers' layout; its cotangent goes back to
        # the config's (the reduce-scatter's transpose: an all-gather)
        made = x.read_of(self._scatter[p][0] or self._views[p].out_specs[k])
        src, dst, sample = x.read_of(self._views[p].out_specs[k]), self._dst(j, o), self._sample[j]
        forward = [] if self._resharded_by(e) != e else self._chain_tasks(
            self._activation_chain(x, sample, made, dst),
            layout.fwd_key(j, o), [self._output_ready(p, k)], RESHARD, e)
        partial = self._views[j].partials[o]
        # apply reduces a partial cotangent straight into its producer's layout where the two
        # differ (`soapjax.apply._flatstep`: Q, K and V's into the sequence split, a reduce-scatter
        # each); only where they are the same are several summed after their all-reduces
        summed = self._summed_partials(e) if partial and dst == src else [e]
        again = self._build_again(e)
        if len(summed) > 1:  # each reduced in this layout, then their sum moved once
            return _EdgeTasks(forward, [] if e != summed[0] else self._summed_tasks(summed),
                              again)
        if not differentiated_operands(self.graph, j)[o]:  # no cotangent comes back
            return _EdgeTasks(forward, [], again)
        shared = self._same_layout(e, backward=True)
        if partial and dst != src and not reduces_into(dst, src, partial):
            # apply leaves it in the reader's layout: all-reduced there, then moved
            back = self._reduced(j, o, dst, dst) + self._activation_chain(x, sample, dst, src)
        else:
            back = (self._reduced(j, o, dst, src) if partial else
                    self._activation_chain(x, sample, dst, src))
        backward = [] if shared[0] != e else self._chain_tasks(
            back, layout.bwd_key(j, 1 + o),
            [self._backward_done(layout.edges[s][2]) for s in shared], RESHARD_BWD, e)
        return _EdgeTasks(forward, backward, again)

    def _again_by(self, e: int) -> int:
        """The edge whose resharding again serves edge `e`'s recomputing reader: the last of
        `e`'s siblings into the same layout (`_same_layout`, in program order) whose reader
        recomputes, the first backward of them (its checkpoint makes the copy once for the
        readers it holds; the others' backwards come after it, as task keys must)."""
        layout, views = self._layout, self._views
        return next(s for s in reversed(self._same_layout(e))
                    if views[layout.edges[s][2]].recomputes)

    def _build_again(self, e: int) -> list[int]:
        """Edge `e`'s resharding again, before its reader's backward, where the reader
        recomputes: the reader's ``jax.checkpoint`` (`soapjax.apply._flatstep`; a pipeline's
        layer, `soapjax.apply._pipelined`) keeps the value as its producer made it and runs
        the change of layout again with the rest of its forward, after the cotangents reach it
        (compiled HLO: the all-gathers inside ``rematted_computation``, docs/checks.md). Its
        first task waits for those cotangents (set with the compute tasks' dependencies:
        `_again_tasks`); keys from the reader's gathers-again slot (`_regather_key`). Empty
        where the reader keeps its outputs, the layout does not change, or a sibling's serves
        it (`_again_by`)."""
        layout = self._layout
        p, k, j, o = layout.edges[e]
        if not self._views[j].recomputes or self._again_by(e) != e:
            return []
        x = self.graph.operators[j].inputs[o]
        made = self._scatter[p][0] or self._views[p].out_specs[k]
        chain = self._activation_chain(x, self._sample[j], x.read_of(made), self._dst(j, o))
        key, room = self._regather_key(j, o)
        if not chain or len(chain) > room:
            return []
        return self._chain_tasks(chain, key, [], RESHARD, e)

    def _again_tasks(self, j: int, *, ends: bool) -> list[int]:
        """The last tasks of operator `j`'s activations' reshardings again (`_build_again`,
        on the edge that serves each: what its backward waits for); not `ends`: the first
        tasks of those on `j`'s own edges (each waits for `j`'s cotangents)."""
        out, layout = [], self._layout
        if not self._views[j].recomputes:
            return out
        for code, ref, _ in layout.operands[j]:
            if code != EDGE:
                continue
            chain = self._edge_tasks[self._again_by(ref) if ends else ref].again
            if chain:
                out.append(chain[-1] if ends else chain[0])
        return out

    def _reduced_in_place(self, j: int, o: int) -> tuple[Comm, ...]:
        """The all-reduce of operand `o`'s partial cotangent in operator `j`'s layout, where it
        is made (`_reduced` into that same layout)."""
        here = self._views[j].operand_specs[o]
        return self._reduced(j, o, here, here)

    def _reduced(self, j: int, o: int, dst: tuple, to: tuple) -> tuple[Comm, ...]:
        """The way back of operand `o`'s partial cotangent from operator `j`'s layout `dst`
        into layout `to` (its producer's, or `dst` itself), as XLA compiles it for apply's
        constraint of the cotangent to `to` (`soapjax.apply._flatstep`).

        Where the matmul reads the operand itself: ``reshard(dst -> to, partial)``, a
        reduce-scatter over the partial axes `to` splits a dim by, an all-reduce over the rest.
        Where the operator computes on the operand before its matmul (a rotary embedding,
        GQA's repeat: `soapjax.graph._inner.matmul_operands`), the partial sums are what the
        matmul's transpose makes, and XLA reduces them there, before that computation's backward: at
        the shard of what the matmul reads, reduce-scattered over the partial axes that `to`
        splits a dim of the operand by which that value has too (divisibly; its backward then
        runs on the slice), all-reduced over the rest (whole, then sliced); then the operand
        moves from that layout to `to`, reducing the partial axes that split the matmul's
        value but not the operand (a repeat's backward sums their slices into partial sums)."""
        v, sample = self._views[j], self._sample[j]
        x, partial = self.graph.operators[j].inputs[o], v.partials[o]
        m_dst = v.matmul_specs[o]
        if m_dst is None:
            return self._activation_chain(x, sample, dst, to, partial)
        m = matmul_operands(self.graph, j)[o]
        key = ("reduced", m, m_dst, x.shape, x.dims, x.dtype, sample, dst, to, partial,
               self._micro)
        out = self._memo.get(key)
        if out is not None:
            return out
        shape = microbatch_shape(m.shape, m.dims, sample, self._micro)
        # axes that split the matmul's operand (GQA's repeated heads, where the operand's own
        # heads are whole) make their partial sums in the repeat's backward: reduced there
        at_matmul = tuple(a for a in partial if not any(a in axes for axes in m_dst))
        m_to, x_to = list(m_dst), list(dst)
        for d, it in enumerate(x.dims):
            axes = tuple(a for a in to[d] if a in at_matmul) if d < len(to) else ()
            if not axes or it is None or it not in m.dims:
                continue
            k = m.dims.index(it)
            if shape[k] % self.mesh.degree(m_to[k] + axes):
                continue
            m_to[k] += axes
            x_to[d] += axes
        reduce = self._per_microbatch(
            self._pricing.chain(shape, m.dtype, m_dst, tuple(m_to), at_matmul))
        rest = tuple(a for a in partial if a not in at_matmul)
        out = self._memo[key] = reduce + self._activation_chain(x, sample, tuple(x_to), to, rest)
        return out

    def _summed_tasks(self, summed: list[int]) -> list[int]:
        """The way back of partial cotangents `summed` (`_summed_partials`), all in the first
        edge's unit: their all-reduces in backward order (the last consumer's first), each after
        its consumer's backward and the one before, then the move of their sum to the
        producer's layout; its last task is after all of them."""
        layout, tasks = self._layout, []
        for s in reversed(summed):
            _, _, j, o = layout.edges[s]
            chain = self._reduced_in_place(j, o)
            tasks += self._chain_tasks(chain, layout.bwd_key(j, 1 + o),
                                       [self._backward_done(j)] + tasks[-1:], RESHARD_BWD, s)
        p, k, j, o = layout.edges[summed[0]]
        x = self.graph.operators[j].inputs[o]
        move = self._activation_chain(x, self._sample[j], self._views[j].operand_specs[o],
                                      x.read_of(self._views[p].out_specs[k]))
        first = len(self._reduced_in_place(j, o))
        return tasks + self._chain_tasks(move, layout.bwd_key(j, 1 + o) + first, tasks[-1:],
                                         RESHARD_BWD, summed[0])

    def _summed_partials(self, e: int) -> list[int]:
        """The edges carrying edge `e`'s value to the same layout whose cotangents are partial
        sums over the same axes, in edge order, where that layout is the producer's (plain
        Megatron's Q, K and V read the replicated norm): each is all-reduced where it is made,
        their sum needs no move. Where the layouts differ, apply has each reduced straight
        into the producer's layout (`_build_edge`)."""
        layout, views = self._layout, self._views
        _, _, j, o = layout.edges[e]
        key = (self._dst(j, o), views[j].partials[o])
        return [s for s in layout.siblings[e]
                if (self._dst(*layout.edges[s][2:]),
                    views[layout.edges[s][2]].partials[layout.edges[s][3]]) == key]

    def _forward_deps(self, j: int) -> list[int]:
        """What operator `j`'s forward task waits for: its inputs' reshardings (or, with none,
        their producers) and its parameters' gathers."""
        layout, out = self._layout, []
        for code, ref, reader in layout.operands[j]:
            if code == EDGE:
                chain = self._edge_tasks[self._resharded_by(ref)].forward
                out.append(chain[-1] if chain else self._output_ready(*layout.edges[ref][:2]))
            elif code == LEAF:
                t = self._leaf_tasks[ref].gather_ends[reader]
                if t >= 0:
                    out.append(t)
        return out

    def _cotangent_deps(self, j: int) -> list[int]:
        """When operator `j`'s outputs' cotangents are back from each consumer (after their
        resharding, where there is one): the tasks."""
        layout, out = self._layout, []
        for e in layout.out_edges[j]:
            chain = self._edge_tasks[e].backward
            out.append(chain[-1] if chain else self._backward_done(layout.edges[e][2]))
        return out

    def _backward_deps(self, j: int) -> list[int]:
        """What operator `j`'s backward task waits for: its outputs' cotangents
        (`_cotangent_deps`), and the gathers again of the parameters it recomputes with
        (`_build_gathers`) and of its activations (`_build_again`)."""
        return (self._cotangent_deps(j) + self._regather_tasks(j, ends=True)
                + self._again_tasks(j, ends=True))

    def _task_name(self, t: int) -> str:
        kind, ref, *subject = self._task_graph.info[t]
        ops, layout = self.graph.operators, self._layout
        if kind in (FORWARD, BACKWARD):
            return f"{kind} {ops[ref].name}"
        if kind == UPDATE:
            return f"update {layout.leaf_source[ref]}"
        x = subject[0]
        inner = "statistics"
        if kind in (INNER_REDUCE, INNER_REDUCE_BWD) and ref.kind == "collective_permute":
            # context parallelism's sends (`_ring_chain`, `_zigzag_chain`), else `_cut_moves`
            queries = query_dims(self.graph, x)
            cp = queries is not None and self._views[x].config.axes[queries.sequence]
            inner = "ring" if cp else "pieces moved"
        what = (layout.edge_name[x] if kind == RESHARD else f"d({layout.edge_name[x]})"
                if kind == RESHARD_BWD else f"{ops[x].name} (partial sums)"
                if kind == PARTIAL_SUM else f"{ops[x].name} ({inner})"
                if kind == INNER_REDUCE else f"d({ops[x].name} {inner})"
                if kind == INNER_REDUCE_BWD else layout.leaf_source[x]
                if kind == PARAM_GATHER else f"norm {layout.leaf_source[x]}"
                if kind == UPDATE_REDUCE else f"grad {layout.leaf_source[x]}")
        return f"{ref.kind} {what} over {'+'.join(ref.axes)}"
