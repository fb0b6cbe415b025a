"""A layout change as steps XLA makes without replicating: slices, all-to-alls, gathers.

XLA's SPMD partitioner makes a layout change in one go when it is `permute_free` (a local
slice, one all-to-all, gathers; docs/checks.md, "Collective-permutes inside a stage"); many
others it makes by replicating the tensor whole and slicing again ("Involuntary full
rematerialization"), or by exchanging tiles with collective-permutes. The same change made as
a chain of permute-free steps, each held by its own sharding constraint, XLA makes step by
step, as the ideal resharding model prices it (slices first, gathers last):

>>> from soapjax.strategy.space import MeshShape
>>> mesh = MeshShape(("node", "data", "model"), (2, 2, 2))
>>> steps((8, 8, 32), "float32", ((), (), ("model",)), (("data", "model"), (), ()), mesh)
((('data',), (), ('model',)),)

(the samples sliced over ``data`` first, then ``model`` moved to them by one all-to-all; XLA
made the change in one go by an all-gather of the whole tensor over ``model``: four times the
bytes). `steps` finds the cheapest such chain as the ideal model prices its steps
(`soapjax.cost.reshard.ideal_collectives`, bytes per device summed); ``()`` where the change
is permute-free already, None where the search finds none within `MAX_STEPS` steps and
`MAX_STATES` layouts. `soapjax.apply` holds a pipeline's hand-off to each step in turn.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from soapjax.cost.reshard import ideal_collectives, permute_free
from soapjax.strategy.space import MeshShape

__all__ = ["Layout", "steps"]

Layout = tuple[tuple[str, ...], ...]

# a chain has at most this many steps (each slices, moves or gathers something), and the
# search looks at no more than MAX_STATES layouts: a tensor's dims and a mesh's axes are few
MAX_STEPS = 6
MAX_STATES = 4000
# what a step costs beside its bytes: fewer steps where bytes tie
STEP_COST = 1e-3


def steps(shape: Sequence[int], dtype: Any, src: Any, dst: Any,
          mesh: MeshShape) -> tuple[Layout, ...] | None:
    """The layouts to hold a value of `shape` in between `src` and `dst` (each a tuple of
    mesh axis names per dim, or a `PartitionSpec`) so that every step is permute-free on
    `mesh`, the cheapest such chain by the ideal model's bytes; ``()`` where the change is
    permute-free as it is, None where the search finds none (module doc)."""
    a, b = _layout(src, len(shape), mesh), _layout(dst, len(shape), mesh)
    if permute_free(a, b, mesh):
        return ()
    shape = tuple(int(n) for n in shape)
    chain = _ideal_order(a, b, shape, mesh)
    return chain if chain is not None else _search(shape, str(np.dtype(dtype)), a, b, mesh)


def _ideal_order(src: Layout, dst: Layout, shape: tuple[int, ...],
                 mesh: MeshShape) -> tuple[Layout, ...] | None:
    """The ideal model's own order as a chain, where its steps are permute-free and divide
    their dims: the destination's new axes sliced onto the ends of their dims, then the axes
    that change dims moved to the ends of theirs, then the rest gathered; None otherwise (and
    `_search` looks further). Most changes a pipeline's hand-off makes are so, found at once."""
    home = {a: d for d, axes in enumerate(dst) for a in axes}
    held = {a: d for d, axes in enumerate(src) for a in axes}
    sliced = tuple(axes + tuple(a for a in dst[d] if a not in held) for d, axes in enumerate(src))
    moving = [a for a, d in held.items() if a in home and home[a] != d]
    moved = tuple(tuple(a for a in axes if a not in moving)
                  + tuple(a for a in dst[d] if a in moving) for d, axes in enumerate(sliced))
    chain = [layout for layout in (sliced, moved) if layout not in (src, dst)]
    chain = [x for k, x in enumerate(chain) if k == 0 or x != chain[k - 1]]
    layouts = [src, *chain, dst]
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if (all(permute_free(x, y, mesh) for x, y in zip(layouts, layouts[1:]))
            and all(_divides(layout, shape, sizes) for layout in chain)):
        return tuple(chain)
    return None


def _divides(layout: Layout, shape: tuple[int, ...], sizes: dict[str, int]) -> bool:
    """Whether every dim of `shape` divides by its axes in `layout`."""
    return all(n % math.prod(sizes[a] for a in axes) == 0 for n, axes in zip(shape, layout))


@functools.lru_cache(maxsize=4096)
def _search(shape: tuple[int, ...], dtype: str, src: Layout, dst: Layout,
            mesh: MeshShape) -> tuple[Layout, ...] | None:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    wanted = {a for axes in dst for a in axes}
    frontier = [(0.0, 0, src, ())]
    seen: dict[Layout, float] = {src: 0.0}
    order = 0
    while frontier and len(seen) < MAX_STATES:
        cost, _, here, path = heapq.heappop(frontier)
        if here == dst:
            return path[:-1]
        if cost > seen.get(here, float("inf")) or len(path) >= MAX_STEPS:
            continue
        for there in _moves(here, wanted, sizes, shape):
            if not permute_free(here, there, mesh):
                continue
            step = sum(c.nbytes for c in ideal_collectives(shape, dtype, here, there, mesh))
            total = cost + step + STEP_COST
            if total < seen.get(there, float("inf")):
                seen[there] = total
                order += 1
                heapq.heappush(frontier, (total, order, there, path + (there,)))
    return None


def _moves(here: Layout, wanted: set[str], sizes: dict[str, int],
           shape: tuple[int, ...]) -> list[Layout]:
    """The layouts one step from `here`: an axis of the destination sliced onto the end of a
    dim, the last axis of a dim gathered, or the last axes of a dim moved to the end of
    another (one all-to-all); every dim still divided by its axes."""
    used = {a for axes in here for a in axes}
    out = []
    for d, axes in enumerate(here):
        for a in sorted(wanted - used):  # slice
            out.append(_with(here, d, axes + (a,)))
        if axes:  # gather the last
            out.append(_with(here, d, axes[:-1]))
        for k in range(1, len(axes) + 1):  # move the last k to another dim
            for e in range(len(here)):
                if e != d:
                    out.append(_with(_with(here, d, axes[:-k]), e, here[e] + axes[-k:]))
    return [t for t in out if _divides(t, shape, sizes)]


def _with(layout: Layout, d: int, axes: tuple[str, ...]) -> Layout:
    return layout[:d] + (axes,) + layout[d + 1:]


def _layout(spec: Any, rank: int, mesh: MeshShape) -> Layout:
    """`spec` as a tuple of axis-name tuples, one per dim, size-1 axes dropped."""
    entries = list(spec) + [None] * (rank - len(spec))
    out = []
    for entry in entries[:rank]:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(tuple(a for a in axes if mesh.axis_size(a) > 1))
    return tuple(out)
