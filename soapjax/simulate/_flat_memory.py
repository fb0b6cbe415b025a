"""The flat simulation's memory accounting (a part of `soapjax.simulate._flatsim.Simulation`):
the bytes of a tensor's shard, where parameters and optimizer state are stored, and the buffers
the step holds at its peak.
"""

from __future__ import annotations

from collections.abc import Sequence

from soapjax.base._dtypes import itemsize
from soapjax.cost.updates import whole_update_spec
from soapjax.simulate._simresult import (
    UPDATE,
    MemoryBreakdown,
)
from soapjax.strategy.space import (
    MeshShape,
    storage_spec,
)

__all__: list[str] = ["shard_bytes"]


def shard_bytes(shape: Sequence[int], spec: Sequence[Sequence[str]], dtype: str,
                mesh: MeshShape) -> int:
    """Bytes of one device's shard of a tensor laid out as `spec` (per-dim mesh axes)."""
    n = itemsize(dtype)
    for size, axes in zip(shape, spec):
        d = mesh.degree(axes)
        n *= size // d if size % d == 0 else size
    for size in shape[len(spec):]:
        n *= size
    return n


class _MemoryAccounting:
    """Memory per device of a `Simulation`: stored layouts, shard bytes, buffers at the peak."""

    def _stored_spec(self, leaf: int) -> tuple[tuple[str, ...], ...]:
        """A leaf's layout: `space.storage_spec` of its first reader's operand spec."""
        layout = self._layout
        j, o = layout.readers[leaf][0]
        zero = self._zero if layout.leaf_is_param[leaf] else ()
        key = ("stored", self._views[j].operand_specs[o], layout.leaf_shape[leaf], zero)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = storage_spec(key[1], key[2], zero, self.mesh)
        return out

    def _shard_bytes(self, shape: tuple[int, ...], spec: tuple, dtype: str) -> int:
        key = ("bytes", shape, spec, dtype)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = shard_bytes(shape, spec, dtype, self.mesh)
        return out

    def _optimizer_spec(self, leaf: int, store: tuple) -> tuple[tuple[str, ...], ...]:
        """Parameter `leaf`'s optimizer state layout: its stored layout `store` split further
        over the distributed optimizer's axes (`space.optimizer_specs`); for one whose update
        contracts some of its dims (`OpCosts.update_whole`), whole along them and split over
        the ZeRO and optimizer axes on its other dims, as apply lays it out
        (`soapjax.cost.updates.whole_update_spec`). A scanned layer's slice has no layer dims
        to split: the axes apply puts on them (each device updating its share of the layers)
        are put on the slice's own dims instead, which moves and keeps the same bytes."""
        return self._optimizer_layout(leaf, store)[0]

    def _optimizer_layout(self, leaf: int, store: tuple
                          ) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
        """`_optimizer_spec`, and the axes apply splits a scanned layer's stacked leaf over
        on its layer dims (() for the rest)."""
        entry = self._update_whole.get(self._layout.leaf_source[leaf])
        if not self._optimizer and entry is None:
            return store, ()
        shape = self._layout.leaf_shape[leaf]
        key = ("optimizer", store, shape, self._zero, self._optimizer, entry)
        out = self._memo.get(key)
        if out is None:
            if entry is None:
                out = storage_spec(store, shape, self._optimizer, self.mesh), ()
            else:
                k = entry.layers
                full = whole_update_spec(((),) * k + tuple(store), entry.leaf_shape,
                                         entry.leaf_dims, self._zero + self._optimizer,
                                         self.mesh)
                on_layers = tuple(a for dim in full[:k] for a in dim)
                out = (storage_spec(full[k:], shape, on_layers, self.mesh) if on_layers
                       else tuple(full[k:])), on_layers
            self._memo[key] = out
        return out

    # --- accounting ---------------------------------------------------------------------------

    def _count_buffers(self, tasks: list[int], sign: int) -> None:
        info, counts = self._task_graph.info, self._buffer_counts
        for t in tasks:
            if info[t][0] != UPDATE:
                n = info[t][1].nbytes
                c = counts.get(n, 0) + sign
                if c:
                    counts[n] = c
                else:
                    del counts[n]

    def _transient_bytes(self) -> list[int]:
        """Per operator, the parameters it gathers inside its recomputing segment
        (`_LeafTasks.transient_bytes`)."""
        out = [0] * self._layout.n
        for readers, unit in zip(self._layout.readers, self._leaf_tasks):
            if unit.regathers:
                for (j, _), n in zip(readers, unit.transient_bytes):
                    out[j] += n
        return out

    def _memory(self) -> MemoryBreakdown:
        p = self._stored_bytes
        if self._act is None:  # exact whatever the order of changes: a pure function of views
            views = self._views
            self._act = self._segments.activation_bytes(
                [v.recomputes for v in views], [v.output_bytes for v in views],
                [v.operand_bytes for v in views], [v.internal_bytes for v in views],
                self._transient_bytes())
        # the distributed optimizer's shards (`Strategy.optimizer_axes`); an update that
        # contracts a parameter's dims keeps its state and gradient whole along them
        # (a frozen parameter has neither: `OpGraph.frozen`)
        owned = (sum(unit.optimizer_bytes for unit in self._leaf_tasks)
                 if self._optimizer or self._update_whole or self._frozen else p)
        grads = (sum(max(unit.stored_bytes, unit.optimizer_bytes) for unit in self._leaf_tasks)
                 if self._update_whole else p)
        if self._frozen:
            grads -= sum(unit.stored_bytes for source, unit in zip(self._layout.leaf_source,
                                                                    self._leaf_tasks)
                         if source in self._frozen)
        return MemoryBreakdown(params=p, grads=grads,
                               opt_state=round(owned * self.opt_state_factor),
                               activations=self._act + self._leaf_bytes,
                               comm_buffers=max(self._buffer_counts, default=0),
                               constants=self.graph.constant_bytes)
