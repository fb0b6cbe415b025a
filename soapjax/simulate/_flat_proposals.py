"""The flat simulation's proposals (a part of `soapjax.simulate._flatsim.Simulation`): delta
simulation of one or many operators' new configs (the paper's Algorithm 2), a whole strategy
proposed by full simulation (Algorithm 1), and `accept` or `reject` ending either, with the
undo record that makes `reject` cheap.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Sequence

from soapjax.graph._inner import partial_sum_value
from soapjax.simulate._flat_leaves import _LeafTasks
from soapjax.simulate._flat_tasks import _EdgeTasks, _OpComm, _View
from soapjax.strategy.space import (
    Config,
    Strategy,
)

__all__: list[str] = []


def _settled(method: Callable) -> Callable:
    """Rebuilds a rejected full proposal's previous strategy first (`Simulation.reject`
    leaves it stale: a search in full simulation proposes the next strategy whole, which
    needs no rebuild)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._stale is not None:
            before, self._stale = self._stale, None
            self.reset(before)
        return method(self, *args, **kwargs)

    return run


class _Batch:
    """A pending proposal: one `_Undo` per changed operator, and the timeline before it."""

    __slots__ = ("busy", "end", "start", "undos")

    def __init__(self) -> None:
        self.undos: list[_Undo] = []
        self.start: list[float] = []
        self.end: list[float] = []
        self.busy: list[float] = []


class _Undo:
    """What `reject` needs to restore the state before one operator's change."""

    __slots__ = ("activation_bytes", "deps", "edges", "leaf_activation_bytes", "leaves",
                 "new_tasks", "old_tasks", "op", "op_comm", "scatter", "stored_bytes", "view")

    def __init__(self, op: int, view: _View) -> None:
        self.op, self.view = op, view  # the operator and its view before the proposal
        self.activation_bytes = self.stored_bytes = self.leaf_activation_bytes = 0
        self.op_comm: list[tuple[int, _OpComm]] = []
        self.scatter: list[tuple[int, tuple]] = []  # (operator, its `_scatter_of` before)
        self.edges: list[tuple[int, _EdgeTasks]] = []
        self.leaves: list[tuple[int, _LeafTasks]] = []
        self.old_tasks: list[int] = []
        self.new_tasks: list[int] = []
        self.deps: list[tuple[int, list[int]]] = []  # (task, its dependencies before)


class _Proposals:
    """Delta and full proposals of a `Simulation`, and their undo."""

    @_settled
    def prefetch(self, changes: Iterable[tuple[int, Config]] = ()) -> int:
        """Has the resharder work out at once (`Resharder.prefetch`: one batch of compilations)
        every resharding that the current strategy and the given single-operator changes need.

        Returns:
          How many reshardings were compiled (0 for those already known).
        """
        return self._prefetch(self.strategy, changes)

    @_settled
    def propose(self, i: int, config: Config, recompute: str | None = None) -> float:
        """Delta-simulates operator `i` taking `config` (Algorithm 2); returns the step time.

        With `recompute` (a policy, `soapjax.strategy.memory`) the operator takes that recompute
        policy too (None: it keeps its own). A change of microbatches is a `reset` (every task
        changes).

        Rebuilds the tasks whose collectives the change touches (operator `i`'s own all-reduces
        of statistics and partial sums, the reshardings of its input and output edges, the
        gathers, gradient synchronisations and updates of the parameters it reads), retimes its
        forward and backward tasks, and retimes the timeline from the first changed task on, as
        far as the change reaches. The change stays pending until `accept` or `reject`.

        Raises:
          PlanError: `config` does not fit operator `i` or the mesh.
          RuntimeError: a proposal is already pending.
        """
        return self.propose_many([(i, config, recompute)])

    @_settled
    def propose_many(self, changes: Sequence[tuple[int, Config, str | None]]) -> float:
        """Delta-simulates several operators' changes as one proposal: ``(operator, config,
        recompute policy or None)`` each, applied in order, then one retiming pass from the
        first changed task (a repeated block's position moves in every layer at once: one
        pass instead of one per layer). `accept` keeps them all, `reject` rolls them all back.
        The timeline is the one the changes made one by one give (delta == full)."""
        if self._pending is not None:
            raise RuntimeError("accept() or reject() the pending proposal before proposing again")
        task_graph = self._task_graph
        batch = self._pending = _Batch()
        for i, config, recompute in changes:
            old = self._views[i]
            try:
                view = self._view(i, config, old.policy if recompute is None else recompute)
            except Exception:
                self.reject()  # the changes before it
                raise
            if view is old:
                continue
            if not batch.undos:
                batch.start, batch.end = list(task_graph.start), list(task_graph.end)
                batch.busy = list(task_graph.busy)
            undo = _Undo(i, old)
            batch.undos.append(undo)
            undo.activation_bytes = self._act
            undo.stored_bytes, undo.leaf_activation_bytes = self._stored_bytes, self._leaf_bytes
            self._views[i] = view
            self._act = None
            scattered = self._rescatter(undo, i)
            op_comm, edges, leaves = self._changed_units(i, view, old)
            layout = self._layout
            edges = sorted(set(edges) | {s for q in scattered
                                         for e in layout.in_edges[q] + layout.out_edges[q]
                                         for s in layout.siblings[e]})
            rebuilt = sorted(set(scattered) | ({i} if op_comm else set()))
            self._replace_units(undo, rebuilt, edges, leaves)
            self._retime_and_rewire(undo, i, edges, leaves)
        task_graph.sweep()
        return self.step_time()

    def propose_strategy(self, strategy: Strategy) -> float:
        """Full simulation (Algorithm 1) of `strategy` as a proposal; returns the step time.

        The counterpart of `propose_many` by full simulation: `accept` keeps it, `reject`
        returns to the strategy before (rebuilt when next needed, so a search that proposes
        whole strategies one after another rebuilds each once).
        """
        if self._pending is not None or self._before is not None:
            raise RuntimeError("accept() or reject() the pending proposal first")
        before = self.strategy
        self.reset(strategy)
        self._before = before
        return self.step_time()

    def accept(self) -> None:
        """Keeps the pending proposal."""
        if self._before is not None:
            self._before = None
            return
        for undo in self._take_pending().undos:
            self._task_graph.release(undo.old_tasks)

    def reject(self) -> None:
        """Rolls the pending proposal back: the old tasks return, with their old times."""
        if self._before is not None:
            self._stale, self._before = self._before, None
            return
        batch = self._take_pending()
        task_graph = self._task_graph
        for undo in reversed(batch.undos):
            i = undo.op
            for t, deps in reversed(undo.deps):
                task_graph.set_deps(t, deps)
            for t in reversed(undo.new_tasks):
                task_graph.detach(t)
            self._count_buffers(undo.new_tasks, -1)
            task_graph.release(undo.new_tasks)
            for t in undo.old_tasks:
                task_graph.attach(t)
            self._count_buffers(undo.old_tasks, +1)
            task_graph.dur[self._forward_task[i]] = undo.view.forward_s
            task_graph.dur[self._backward_task[i]] = undo.view.backward_s
            self._views[i] = undo.view
            for q, unit in undo.op_comm:
                self._op_comm[q] = unit
            for q, target in undo.scatter:
                self._scatter[q] = target
            for e, unit in undo.edges:
                self._edge_tasks[e] = unit
            for leaf, unit in undo.leaves:
                self._leaf_tasks[leaf] = unit
            self._act = undo.activation_bytes
            self._stored_bytes, self._leaf_bytes = undo.stored_bytes, undo.leaf_activation_bytes
        if batch.undos:
            n = len(batch.start)
            task_graph.start[:n] = batch.start
            task_graph.end[:n] = batch.end
            task_graph.busy[:n] = batch.busy
        task_graph.discard_marks()

    # --- full simulation ----------------------------------------------------------------------

    def _prefetch(self, strategy: Strategy, changes: Iterable[tuple[int, Config]]) -> int:
        prefetch = getattr(self._pricing.resharder, "prefetch", None)
        if prefetch is None or getattr(self._pricing.resharder, "mode", None) == "ideal":
            return 0  # nothing to compile: the ideal model prices transitions by formula
        seen: list = []
        shadow = copy.copy(self)  # `_build` gives it its own task graph and unit lists
        shadow._pricing, shadow._pending = self._pricing.recording(seen), None
        shadow._memo = {}  # its chains are the recorder's empty ones
        shadow.reset(strategy)
        for i, config in changes:
            shadow.propose(i, config)
            shadow.reject()
        return prefetch(seen)

    # --- delta simulation ---------------------------------------------------------------------

    def _changed_units(self, i: int, view: _View,
                       old: _View) -> tuple[bool, list[int], list[int]]:
        """The units whose collectives change when operator `i` goes from `old` to `view`:
        whether its own collectives do (`_build_op_comm`), the edges and the leaves (the rest
        keep their tasks)."""
        layout = self._layout
        # a matmul reducing its partial sums inside: which of them its config's axes split
        inside = partial_sum_value(self.graph, i) is not None
        op_comm = ((view.out_specs[0:1], view.reduction_axes, view.inner_forward,
                    view.inner_backward, view.config.axes if inside else None)
                   != (old.out_specs[0:1], old.reduction_axes, old.inner_forward,
                       old.inner_backward, old.config.axes if inside else None))
        # an edge starts after its producer's collectives and its way back after its consumer's
        changed = [e for e in layout.in_edges[i] + layout.out_edges[i]
                   if self._edge_signature(e, i, view) != self._edge_signature(e, i, old)
                   or (op_comm and i in (layout.edges[e][0], layout.edges[e][2]))]
        # ... and the edges that share a value with them (which one reshards it may change)
        edges = sorted({s for e in changed for s in layout.siblings[e]})
        leaves = [leaf for leaf in layout.op_leaves[i]
                  if view.recomputes != old.recomputes
                  or any((view.operand_specs[o], view.partial_groups[o])
                         != (old.operand_specs[o], old.partial_groups[o])
                         for j, o in layout.readers[leaf] if j == i)]
        return op_comm, edges, leaves

    def _rescatter(self, undo: _Undo, i: int) -> list[int]:
        """Recomputes `scatter_target` of operator `i` and of its producers (the readers of
        their outputs include `i`) after `i`'s view changed; returns those whose target or
        operand layouts changed (their own collectives and edges are rebuilt), old values
        kept in `undo`."""
        layout, out = self._layout, []
        for q in sorted({i} | {layout.edges[e][0] for e in layout.in_edges[i]}):
            new = self._scatter_of(q)
            if new != self._scatter[q]:
                undo.scatter.append((q, self._scatter[q]))
                self._scatter[q] = new
                out.append(q)
        return out

    def _edge_signature(self, e: int, i: int, view: _View) -> tuple:
        """What edge `e`'s collectives depend on, with operator `i` under `view`."""
        p, k, j, o = self._layout.edges[e]
        src = (view if p == i else self._views[p]).out_specs[k]  # (a slice's: the same key)
        consumer = view if j == i else self._views[j]
        return (src, consumer.operand_specs[o], consumer.partials[o],
                consumer.matmul_specs[o], consumer.recomputes)
        # (a change of `scatter_target` is caught apart: `_rescatter`)

    def _replace_units(self, undo: _Undo, op_comm_of: list[int], edges: list[int],
                       leaves: list[int]) -> None:
        """Takes the old tasks of the changed units off the graph (kept in `undo` for `reject`)
        and builds new ones: the own collectives of the operators `op_comm_of`,
        the `edges` and the `leaves`."""
        task_graph = self._task_graph
        undo.op_comm = [(q, self._op_comm[q]) for q in op_comm_of]
        undo.edges = [(e, self._edge_tasks[e]) for e in edges]
        undo.leaves = [(leaf, self._leaf_tasks[leaf]) for leaf in leaves]
        old = undo.old_tasks = [t for _, unit in undo.op_comm
                                for t in unit.forward + unit.backward]
        old += [t for _, unit in undo.edges for t in unit.forward + unit.backward + unit.again]
        old += [t for _, unit in undo.leaves for t in unit.tasks]
        for t in old:
            task_graph.detach(t)
        self._count_buffers(old, -1)
        new = undo.new_tasks
        for q in op_comm_of:
            unit = self._op_comm[q] = self._build_op_comm(q)
            new += unit.forward + unit.backward
        for e in edges:
            unit = self._edge_tasks[e] = self._build_edge(e)
            new += unit.forward + unit.backward + unit.again
        for leaf in leaves:
            before, unit = self._leaf_tasks[leaf], self._build_leaf(leaf)
            self._leaf_tasks[leaf] = unit
            self._stored_bytes += unit.stored_bytes - before.stored_bytes
            self._leaf_bytes += unit.activation_bytes - before.activation_bytes
            new += unit.tasks
        for t in new:
            task_graph.attach(t)
        self._count_buffers(new, +1)

    def _retime_and_rewire(self, undo: _Undo, i: int, edges: list[int],
                           leaves: list[int]) -> None:
        """Gives operator `i`'s compute tasks their new durations and points the compute tasks
        that wait on the rebuilt `edges` and `leaves` at their new tasks (old ones in `undo`)."""
        layout, task_graph, view = self._layout, self._task_graph, self._views[i]
        task_graph.set_dur(self._forward_task[i], view.forward_s)
        task_graph.set_dur(self._backward_task[i], view.backward_s)
        readers = {i} | {layout.edges[e][2] for e in edges}
        leaf_readers = {j for leaf in leaves for j, _ in layout.readers[leaf]}
        readers |= leaf_readers
        # a backward waits for its cotangents and its parameters' and activations' gathers
        # again, which wait for the cotangents too
        producers = {i} | {layout.edges[e][0] for e in edges} | leaf_readers
        for j in readers:
            t = self._forward_task[j]
            undo.deps.append((t, task_graph.set_deps(t, self._forward_deps(j))))
        for j in sorted(producers | readers):
            t = self._backward_task[j]
            undo.deps.append((t, task_graph.set_deps(t, self._backward_deps(j))))
            for head in self._regather_tasks(j, ends=False) + self._again_tasks(j, ends=False):
                undo.deps.append((head, task_graph.set_deps(head, self._cotangent_deps(j))))

    def _take_pending(self) -> _Batch:
        if self._pending is None:
            raise RuntimeError("no pending proposal: call propose() first")
        undo, self._pending = self._pending, None
        return undo
