"""The flat simulation's parameter leaves (a part of `soapjax.simulate._flatsim.Simulation`): a
parameter's or batch input's gathers for each reader (and again before a recomputing reader's
backward), its gradient synchronisation, the optimizer's reduction and update, and the
distributed optimizer's gather of the updated shards.
"""

from __future__ import annotations

from typing import NamedTuple

from soapjax.cost.updates import whole_along
from soapjax.graph._cotangents import differentiated_operands
from soapjax.graph._remat import remat_recomputes
from soapjax.simulate._simresult import (
    GRAD_SYNC,
    PARAM_GATHER,
    UPDATE,
    UPDATE_REDUCE,
)
from soapjax.simulate._taskgraph import CHAIN, EDGE, LEAF, Comm

__all__: list[str] = []


class _LeafTasks(NamedTuple):
    """A parameter's or batch input's tasks and bytes per device."""

    tasks: list[int]  # gathers, gradient synchronisations, update
    gather_ends: list[int]  # per reader: the last task of its gather, -1 for none
    stored_bytes: int  # its stored shard (parameters; 0 for batch inputs)
    activation_bytes: int  # the batch shard and copies in other layouts, kept for the backward
    optimizer_bytes: int = 0  # the parameter's shard its optimizer state mirrors (parameters)
    # per reader that recomputes and reads the parameter in another layout than it is stored
    # in: the first and last task of its gather again before its backward (-1 for none), and
    # the gathered copy's bytes, alive only while its segment runs (`_build_gathers`)
    regather_heads: tuple[int, ...] = ()
    regather_ends: tuple[int, ...] = ()
    transient_bytes: tuple[int, ...] = ()
    regathers: bool = False  # any reader gathers it again


class _LeafBuilding:
    """The tasks of a `Simulation`'s parameter and batch leaves."""

    def _build_leaf(self, leaf: int) -> _LeafTasks:
        """A parameter's or batch input's tasks (gathers, gradient syncs, update) and bytes."""
        layout = self._layout
        shape, dtype = layout.leaf_shape[leaf], layout.leaf_dtype[leaf]
        store = self._stored_spec(leaf)
        stored = self._shard_bytes(shape, store, dtype)
        gathers, gather_ends, gathered, again = self._build_gathers(leaf, store)
        if not layout.leaf_is_param[leaf]:
            return _LeafTasks(gathers, gather_ends, 0, stored + gathered)
        if layout.leaf_source[leaf] in self._frozen:  # no gradient, state or update
            return _LeafTasks(gathers, gather_ends, stored, gathered, 0, *again, any(again[2]))
        opt, layer_axes = self._optimizer_layout(leaf, store)
        owned = stored if opt == store else self._shard_bytes(shape, opt, dtype)
        syncs, ready = self._build_grad_syncs(leaf, opt)
        seg = layout.update_seg[leaf]
        # an update that contracts the parameter's dims and reads the parameter (Muon's weight
        # decay) reads it gathered as its gradient is (XLA gathers it next to the update)
        entry = self._update_whole.get(layout.leaf_source[leaf])
        read = self._chain_tasks(self._pricing.chain(shape, dtype, store, opt),
                                 layout.key(seg, 0, 0), ready, PARAM_GATHER, leaf) \
            if entry is not None and entry.reads else []
        reduce = self._build_update_reduce(leaf, opt, seg, read[-1:] or ready, len(read))
        matmuls = self._update_matmul_time(leaf, store, opt)
        update = self._task_graph.new(layout.key(seg, 0, len(read) + 1),
                                      self._compute_time(self.cost_model.update_time(owned)
                                                         + matmuls),
                                      (0,), reduce or read[-1:] or ready,
                                      (UPDATE, leaf))
        # the distributed optimizer's all-gather of the updated shards (a scanned layer's
        # slice updated by its share of the devices: gathered along the layer dims apply
        # splits over those axes, as the stored slice)
        gather = (self._pricing.comm("all_gather", stored, layer_axes),) if layer_axes \
            else self._pricing.chain(shape, dtype, opt, store)
        regather = self._chain_tasks(tuple(c for c in gather if c is not None),
                                     layout.key(seg, 1), [update], PARAM_GATHER, leaf)
        heads, ends, transient = again
        return _LeafTasks(gathers + syncs + reduce + read + [update] + regather, gather_ends,
                          stored, gathered, owned, heads, ends, transient, any(transient))

    def _update_matmul_time(self, leaf: int, store: tuple, opt: tuple) -> float:
        """The matrix products of parameter `leaf`'s update (Muon's), on the whole parameter
        (`OpCosts.update_whole`; a scanned layer's slice takes its share), stored as `store`
        and updated as `opt`."""
        entry = self._update_whole.get(self._layout.leaf_source[leaf])
        time_of = getattr(self.cost_model, "update_matmul_time", None)
        if entry is None or time_of is None:
            return 0.0
        # this device's part: the matrices (or layers) the optimizer axes leave it
        shape, dtype = self._layout.leaf_shape[leaf], self._layout.leaf_dtype[leaf]
        part = (self._shard_bytes(shape, opt, dtype)
                / max(1, self._shard_bytes(shape, whole_along(store, entry.dims), dtype)))
        return time_of(entry.path) * entry.share * part

    def _build_update_reduce(self, leaf: int, store: tuple, seg: int, ready: list[int],
                             first: int = 0) -> list[int]:
        """The all-reduce of the scalars the optimizer reduces parameter `leaf` to (its share of
        a global gradient norm), over the mesh axes its stored layout `store` splits it over;
        none when the optimizer reduces nothing or the parameter is whole on every device.
        Once per step, after the gradient's synchronisation: the update waits for it.

        XLA's all-reduce combiner makes the scalars of every parameter one all-reduce. A GPU
        runs that as one collective: each parameter's is priced at its share, the time of one
        scalar all-reduce over the parameter count (about one all-reduce's latency in all
        when every parameter is split). XLA:CPU runs a combined all-reduce as one rendezvous
        per operand: each is priced whole there (GPT-2 tiny's 20 under Megatron: 1.9 ms).

        (Under a global norm every update waits for every parameter's reduction; each waits
        for its own here, which keeps a parameter's tasks one unit for the delta simulation.
        On a device that runs its collectives and kernels one after the other, as XLA:CPU
        does, that is the same time.)
        """
        axes = tuple(a for dim in store for a in dim)
        if not self._reductions or not axes:
            return []
        key = ("norm", axes)
        comm = self._memo.get(key, False)
        if comm is False:
            comm = self._pricing.comm("all_reduce", 4 * self._reductions, axes)
            if comm is not None and self.topology.capabilities.combines_all_reduces:
                comm = comm._replace(dur=comm.dur / max(1, len(self.graph.params)))
            self._memo[key] = comm
        if comm is None:
            return []
        return self._chain_tasks((comm,), self._layout.key(seg, 0, first), ready, UPDATE_REDUCE,
                                 leaf)

    def _build_gathers(self, leaf: int, store: tuple
                       ) -> tuple[list[int], list[int], int, tuple[tuple[int, ...], ...]]:
        """Each reader's resharding of `leaf` from its stored layout `store` (under ZeRO-3 an
        all-gather): the tasks, the last one per reader (-1 for none), the bytes of the
        copies in other layouts kept for the backward pass, and the gathers again of the
        readers that recompute (`_LeafTasks.regather_heads`, ``regather_ends`` and
        ``transient_bytes``).

        A parameter (not a batch input) whose reader recomputes enters the reader's segment's
        ``jax.checkpoint`` in its stored layout (`soapjax.apply._flatstep.stored_inputs`), so
        the gathered copy lives only while the segment runs, and the segment gathers it again
        when it recomputes: after the cotangents reach it (the recomputation waits for them:
        `soapjax.graph._program.recompute_in_backward`), before its backward task.
        """
        layout = self._layout
        shape, dtype = layout.leaf_shape[leaf], layout.leaf_dtype[leaf]
        is_param = layout.leaf_is_param[leaf]
        tasks, ends, gathered = [], [], 0
        heads, again, transient = [], [], []
        for j, o in layout.readers[leaf]:
            spec = self._views[j].operand_specs[o]
            pieces = self._per_microbatch(self._pricing.chain(shape, dtype, store, spec))
            chain = self._chain_tasks(pieces, layout.fwd_key(j, o), [], PARAM_GATHER, leaf)
            tasks += chain
            ends.append(chain[-1] if chain else -1)
            # (a model's own remat region gathers once: the gathered copy is what enters it)
            regathers = is_param and spec != store and self._regathers and \
                self._views[j].recomputes and not remat_recomputes(self.graph, j)
            key, room = self._regather_key(j, o) if regathers else (0, 0)
            regathers = regathers and len(pieces) <= room
            if spec != store and not regathers:
                gathered += self._shard_bytes(shape, spec, dtype)
            twice = self._chain_tasks(pieces, key, self._cotangent_deps(j), PARAM_GATHER,
                                      leaf) if regathers else []
            tasks += twice
            heads.append(twice[0] if twice else -1)
            again.append(twice[-1] if twice else -1)
            transient.append(self._shard_bytes(shape, spec, dtype) if regathers else 0)
        return tasks, ends, gathered, (tuple(heads), tuple(again), tuple(transient))

    def _build_grad_syncs(self, leaf: int, store: tuple) -> tuple[list[int], list[int]]:
        """The gradient synchronisation of each reader's contribution to parameter `leaf`,
        back to its stored layout `store`: the tasks, and those its update waits for.

        Each reader's contribution is synchronised on its own, right after that reader's
        backward, and the synced contributions are summed: XLA's partitioner puts the
        all-reduce (or reduce-scatter) at the operation that makes the partial sum, before the
        add, so a tied embedding's gradient is all-reduced twice (seen in compiled HLO). With
        M microbatches flat apply's loop synchronises each microbatch's contribution as it
        adds it: M times (`Simulation._sync_each_microbatch`; not in a pipeline's stage), but
        for the all-reduces XLA:GPU moves out of the loop (`Capabilities.
        sinks_loop_all_reduces`).
        """
        layout = self._layout
        shape, dtype = layout.leaf_shape[leaf], layout.leaf_dtype[leaf]
        tasks, ready = [], []
        for j, o in reversed(layout.readers[leaf]):
            if not differentiated_operands(self.graph, j)[o]:
                # no gradient from this reader (`soapjax.graph._cotangents`): nothing to sync
                ready.append(self._backward_task[j])
                continue
            v = self._views[j]
            chain = self._partial_chain(shape, dtype, v.operand_specs[o], store,
                                        v.partial_groups[o])
            if self._sync_each_microbatch:
                chain = tuple(c if c.kind == "all_reduce" and self._sinks_all_reduces
                              else self._per_microbatch((c,))[0] for c in chain)
            sync = self._chain_tasks(chain, layout.bwd_key(j, 1 + o), [self._backward_task[j]],
                                     GRAD_SYNC, leaf)
            tasks += sync
            ready += sync[-1:] if sync else [self._backward_task[j]]
        return tasks, ready

    def _partial_chain(self, shape: tuple[int, ...], dtype: str, src: tuple, dst: tuple,
                       groups: tuple[tuple[str, ...], ...]) -> tuple[Comm, ...]:
        """The resharding `src` -> `dst` of a sum partial over the axes of `groups` (one group
        per iteration dim they split): one collective per dim, as XLA's partitioner reduces
        the partial sums of each split contracting dim on its own. A weight's gradient under
        context parallelism (the batch over ``data``, the sequence over ``model``) is two
        all-reduces of the whole gradient, over ``model`` and over ``data``, not one over both
        (docs/xla-workarounds.md: a dot or a sum over two dims split so, on cpu8). The groups `dst`
        does not split are all-reduced in place first, the rest reduced into `dst` last."""
        split = {a for axes in dst for a in axes}
        early = [g for g in groups if not split & set(g)][: len(groups) - 1]
        last = tuple(a for g in groups if g not in early for a in g)
        chain = tuple(c for g in early for c in self._pricing.chain(shape, dtype, src, src, g))
        return chain + self._pricing.chain(shape, dtype, src, dst,
                                           tuple(a for a in self.mesh.axis_names if a in last))

    def _regather_key(self, j: int, o: int) -> tuple[int, int]:
        """The first key of operand `o`'s gather again before operator `j`'s backward, and how
        many collectives it has room for.

        Its keys must lie after the cotangents it waits for (the backward segments of the
        operators after `j`) and before `j`'s backward task: the last slot of the segment just
        before (``2n-2-j``, the next operator's backward segment, whose last slot no backward
        uses), shared among `j`'s parameter and activation operands (an activation's
        resharding again: `_build_again`). For the last operator that segment is its own
        forward segment, whose last slot's first half holds its partial sums' all-reduce: the
        second half, then. A gather that does not fit (none seen: a gather is one to three
        collectives) is kept gathered instead (`_build_gathers`; an activation's is then not
        priced again).
        """
        layout = self._layout
        shared = [p for p, (code, ref, _) in enumerate(layout.operands[j])
                  if code == EDGE or (code == LEAF and layout.leaf_is_param[ref])]
        first, room = (CHAIN // 2, CHAIN // 2) if j == layout.n - 1 else (0, CHAIN)
        room //= len(shared)
        return (layout.key(2 * layout.n - 2 - j, layout.slots - 1, first + shared.index(o) * room),
                room)

    def _regather_tasks(self, j: int, *, ends: bool) -> list[int]:
        """The first tasks (`ends`: the last) of operator `j`'s gathers again
        (`_build_gathers`)."""
        out = []
        for code, ref, reader in self._layout.operands[j]:
            if code == LEAF:
                unit = self._leaf_tasks[ref]
                tasks = unit.regather_ends if ends else unit.regather_heads
                if tasks and tasks[reader] >= 0:
                    out.append(tasks[reader])
        return out
