"""The ideal resharding model: which collectives move a tensor between two shardings.

Per dim, the longest common prefix of source and destination axes stays; of the rest, an axis
split in the source but not the destination is all-gathered, one that moves to another dim goes
through one all-to-all, one that only the destination splits is a free local slice, one that
changes place within a dim is a collective-permute; partial axes are reduce-scattered where the
destination splits a dim by them and all-reduced otherwise. Slices come first where they can,
gathers last, so every collective moves the smallest buffer it can. `soapjax.cost.reshard` is the
API (and says where XLA decides otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from soapjax.base._dtypes import itemsize
from soapjax.base.collectives import XLA_COLLECTIVES
from soapjax.strategy.space import MeshShape

KINDS: tuple[str, ...] = XLA_COLLECTIVES  # a resharding is made of what XLA emits


class Collective(NamedTuple):
    """One collective of a resharding.

    Attributes:
      kind: one of `KINDS`.
      nbytes: bytes per device, in the `Topology.collective_time` convention: all_reduce and
        all_to_all the buffer, all_gather the gathered output, reduce_scatter the input,
        collective_permute the buffer sent.
      axes: the mesh axes its groups span, in mesh order.
      group_size: devices per group where a group spans only part of `axes` (XLA sometimes
        gathers over two of the four devices of an axis); 0 where it spans all of them.
    """

    kind: str
    nbytes: float
    axes: tuple[str, ...]
    group_size: int = 0


class NormalTransition(NamedTuple):
    """A normalised transition (`soapjax.cost.reshard` builds them and keys its caches by them):
    specs per dim, size-1 axes dropped, partial axes in mesh order."""

    shape: tuple[int, ...]
    dtype: str
    src: tuple[tuple[str, ...], ...]
    dst: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...]


def ideal(k: NormalTransition, mesh: MeshShape) -> tuple[Collective, ...]:
    """The collectives of transition `k` on `mesh`, in the order they run (module doc)."""
    rank = len(k.shape)
    keep = [_common_prefix(k.src[d], k.dst[d]) for d in range(rank)]
    src_rest = [k.src[d][len(keep[d]) :] for d in range(rank)]
    src_dim = {a: d for d in range(rank) for a in src_rest[d]}
    dst_dim = {a: d for d in range(rank) for a in k.dst[d][len(keep[d]) :]}
    deg = [mesh.degree(k.src[d]) for d in range(rank)]
    nbytes = itemsize(k.dtype)

    def buffer() -> float:
        return float(nbytes * math.prod(-(-n // g) for n, g in zip(k.shape, deg)))

    def ordered(axes: Iterable[str]) -> tuple[str, ...]:
        axes = set(axes)
        return tuple(a for a in mesh.axis_names if a in axes)

    out = []
    sliced = [a for a in dst_dim if a not in src_dim and a not in k.partial]
    early = [a for a in sliced if not src_rest[dst_dim[a]]]
    for a in early:
        deg[dst_dim[a]] *= mesh.axis_size(a)
    if scattered := ordered(a for a in k.partial if a in dst_dim):
        out.append(Collective("reduce_scatter", buffer(), scattered))
        for a in scattered:
            deg[dst_dim[a]] *= mesh.axis_size(a)
    if reduced := ordered(a for a in k.partial if a not in dst_dim):
        out.append(Collective("all_reduce", buffer(), reduced))
    if reordered := ordered(a for a in src_dim if dst_dim.get(a) == src_dim[a]):
        out.append(Collective("collective_permute", buffer(), reordered))
    if moving := ordered(a for a in src_dim if dst_dim.get(a, src_dim[a]) != src_dim[a]):
        out.append(Collective("all_to_all", buffer(), moving))
        for a in moving:
            deg[src_dim[a]] //= mesh.axis_size(a)
            deg[dst_dim[a]] *= mesh.axis_size(a)
    if gathered := ordered(a for a in src_dim if a not in dst_dim):
        for a in gathered:
            deg[src_dim[a]] //= mesh.axis_size(a)
        out.append(Collective("all_gather", buffer(), gathered))
    for a in sliced:
        if a not in early:
            deg[dst_dim[a]] *= mesh.axis_size(a)
    assert deg == [mesh.degree(axes) for axes in k.dst], (k, deg)
    return tuple(out)


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
