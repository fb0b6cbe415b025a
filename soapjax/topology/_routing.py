"""Routes over a topology's link graph, and what the rings of a collective see on them.

Devices and switches are the vertices; links the edges. A transfer from one device to another
takes the widest path (largest bottleneck bandwidth, then fewest hops); devices never forward
traffic; the path's latency is the sum of its links'. The rings of a collective run at once, so
their flows share links: a ring's per-device bandwidth is the minimum over links of bandwidth /
(ring flows crossing that link in that direction), and its latency the slowest hop's.
`soapjax.topology.cluster.Topology` asks these questions and memoises the answers.

At cluster scale one widest-path search per source over the whole graph is too slow (the
3072-GPU DGX A100 file: 3072 searches over 6,500 vertices, 9.4 million routes stored, 60 s and
4 GB for `Topology.summary`). Clusters are made of identical nodes, though, and when no node
forwards traffic between two others (its switches reach at most one cluster-wide switch each),
a route between two nodes never enters a third: it is the route between nodes 0 and 1 of the
two-node cluster, renamed. `_NodeSymmetry` checks that the file has that shape (the same
vertices and links in every node, listed in the same relative order, so ties break alike) and
then answers every route from the 2-node graph: 16 searches instead of 3072, with the same
routes hop for hop. The flows of an all-pairs collective are counted from the 2-node routes
too (each pair of nodes contributes alike), not route by route. Other shapes take the search
on the whole graph.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from soapjax.base.errors import TopologyError
from soapjax.topology._topology_file import Link


class RingStats(NamedTuple):
    """What a ring over some devices sees, with every ring of the collective running at once.

    Attributes:
      size: devices per ring (n).
      bandwidth: bytes/s each device gets (the contended bottleneck).
      latency: seconds for the slowest hop's path.
      link: index into ``Topology.links`` of the bottleneck link (None when size < 2).
      sharing: ring flows crossing the bottleneck link in the same direction.
      solo_bandwidth: bytes/s of the slowest hop with nothing else on the links.
    """

    size: int
    bandwidth: float
    latency: float
    link: int | None
    sharing: int
    solo_bandwidth: float


Hop = tuple[int, int]  # (link index, 0 for a->b, 1 for b->a)
IDLE = RingStats(1, math.inf, 0.0, None, 0, math.inf)


class Routes:
    """The link graph of `num_devices` devices and `switches`, with memoised widest paths.

    With `devices_per_node`, routes of a cluster of identical nodes come from its first two
    (`_NodeSymmetry`) where its shape allows.
    """

    def __init__(self, num_devices: int, switches: Sequence[str], links: Sequence[Link],
                 devices_per_node: int | None = None):
        self.num_devices = num_devices
        self.links = tuple(links)
        names = [f"device:{d}" for d in range(num_devices)] + list(switches)
        index = {v: i for i, v in enumerate(names)}
        self._adj: list[list[tuple[int, int, int]]] = [[] for _ in names]
        for i, link in enumerate(self.links):
            self._adj[index[link.a]].append((index[link.b], i, 0))
            self._adj[index[link.b]].append((index[link.a], i, 1))
        self._from: dict[int, dict[int, tuple[Hop, ...]]] = {}
        self._symmetry = (_NodeSymmetry.of(num_devices, devices_per_node, switches, self.links)
                          if devices_per_node else None)

    def routes_from(self, src: int) -> dict[int, tuple[Hop, ...]]:
        """Widest-then-shortest paths from device ``src`` to every device it reaches."""
        if src in self._from:
            return self._from[src]
        best = {src: (-math.inf, 0)}
        back: dict[int, tuple[int, int, int]] = {}
        heap = [(-math.inf, 0, src)]
        while heap:
            neg_bw, hops, v = heapq.heappop(heap)
            if (neg_bw, hops) > best[v] or (v != src and v < self.num_devices):
                continue  # stale entry, or a device: devices do not forward
            for w, link, direction in self._adj[v]:
                key = (max(neg_bw, -self.links[link].bandwidth), hops + 1)
                if w not in best or key < best[w]:
                    best[w], back[w] = key, (v, link, direction)
                    heapq.heappush(heap, (*key, w))
        routes = {}
        for dst in range(self.num_devices):
            if dst in back:
                path, v = [], dst
                while v != src:
                    v, link, direction = back[v]
                    path.append((link, direction))
                routes[dst] = tuple(reversed(path))
        self._from[src] = routes
        return routes

    def route(self, a: int, b: int) -> tuple[Hop, ...]:
        """The hops from device `a` to device `b`."""
        if self._symmetry is not None:
            return self._symmetry.route(a, b)
        return self.routes_from(a)[b]

    def check_connected(self) -> None:
        """Raises TopologyError unless every device reaches device 0."""
        reached = self.routes_from(0)
        for d in range(1, self.num_devices):
            if d not in reached:
                raise TopologyError(
                    f"links: device:{d} cannot reach device:0; expected the links to join every "
                    f"pair of devices"
                )

    def rings_stats(self, rings: Iterable[Sequence[int]]) -> RingStats:
        """The bottleneck of all `rings` running at once (each a sequence of device ids)."""
        load: Counter[Hop] = Counter()
        size, latency, solo = 1, 0.0, math.inf
        for ring in rings:
            size = max(size, len(ring))
            if len(ring) < 2:
                continue
            for a, b in zip(ring, (*ring[1:], ring[0])):
                route = self.route(a, b)
                load.update(route)
                latency = max(latency, sum(self.links[i].latency for i, _ in route))
                solo = min(solo, min(self.links[i].bandwidth for i, _ in route))
        if not load:
            return IDLE
        hop = min(load, key=lambda h: (self.links[h[0]].bandwidth / load[h], h))
        return RingStats(
            size, self.links[hop[0]].bandwidth / load[hop], latency, hop[0], load[hop], solo
        )

    def all_pairs(self, groups: Iterable[Sequence[int]]) -> tuple[Counter[Hop], float]:
        """Flows per link direction when every device of every group sends to every other,
        and the slowest pair's latency."""
        if self._symmetry is not None:
            return self._symmetry.all_pairs(groups)
        load: Counter[Hop] = Counter()
        latency = 0.0
        for group in groups:
            for a in group:
                for b in group:
                    if a != b:
                        route = self.route(a, b)
                        load.update(route)
                        latency = max(latency, sum(self.links[i].latency for i, _ in route))
        return load, latency

    def all_to_all_bandwidth(self, load: Counter[Hop], n: int) -> float:
        """Bytes/s each device of an `n`-device all-to-all gets under the all-pairs `load`."""
        return (n - 1) / max(load[h] / self.links[h[0]].bandwidth for h in load)


def _node_of_vertex(name: str, per_node: int) -> tuple[int | None, str]:
    """(node, name inside the node) of a vertex; node None for a cluster-wide switch."""
    if name.startswith("device:"):
        d = int(name[7:])
        return d // per_node, f"device:{d % per_node}"
    if m := re.fullmatch(r"node:(\d+)/(.+)", name):
        return int(m.group(1)), m.group(2)
    return None, name


def _same_order(pos: np.ndarray, cluster: Sequence[int]) -> bool:
    """Whether any two nodes' items (rows of `pos`: global positions, one row per node) and the
    cluster-wide ones interleave as nodes 0 and 1 do; then ties break alike between any two."""
    n = len(pos)
    first_before = pos[0][:, None] < pos[1][None, :]  # item k of the lower node before item l
    later = pos[1:]
    prefix_max = np.maximum.accumulate(pos[:-1], axis=0)  # over the nodes before each later one
    prefix_min = np.minimum.accumulate(pos[:-1], axis=0)
    ok_before = prefix_max[:, :, None] < later[:, None, :]
    ok_after = prefix_min[:, :, None] > later[:, None, :]
    if not np.all(np.where(first_before, ok_before, ok_after)):
        return False
    c = np.asarray(cluster, dtype=np.int64)
    node_before = pos[:, :, None] < c[None, None, :]
    return n < 2 or bool(np.all(node_before == node_before[0]))


class _NodeSymmetry:
    """Routes of a cluster of identical nodes from the routes of its first two nodes.

    Built by `of` only where that is exact: every node holds the same vertices and links (in
    the same relative order as node 0's, against every other node's and the cluster's), no link
    joins two nodes directly, and no node switch reaches two cluster-wide switches (so no node
    forwards traffic between others). Then the widest-path search from a device, restricted to
    its own node, the destination's and the cluster switches, visits them in the same order as
    on the whole graph: the 2-node graph's route, renamed, is the route.
    """

    def __init__(self, per_node: int, pair: Routes, where: list[tuple[int, int]],
                 node_links: np.ndarray) -> None:
        self.per_node = per_node
        self.pair = pair  # the graph of nodes 0 and 1 and the cluster switches
        self.where = where  # pair link -> (0 or 1: its node, -1: cluster; index in that list)
        self.node_links = node_links  # [node, k] -> global index of the node's k-th link
        self._pair_routes: dict[tuple[int, int], tuple[Hop, ...]] = {}

    @classmethod
    def of(cls, num_devices: int, per_node: int, switches: Sequence[str],
           links: Sequence[Link]) -> _NodeSymmetry | None:
        num_nodes = num_devices // per_node
        if num_nodes < 3:
            return None  # nothing to gain
        names = [f"device:{d}" for d in range(num_devices)] + list(switches)
        placed = [_node_of_vertex(v, per_node) for v in names]
        vertices: list[list[tuple[int, str]]] = [[] for _ in range(num_nodes)]
        cluster_vertices = []
        for i, (node, local) in enumerate(placed):
            (vertices[node] if node is not None else cluster_vertices).append((i, local))
        node_links: list[list[int]] = [[] for _ in range(num_nodes)]
        shapes: list[list[tuple]] = [[] for _ in range(num_nodes)]
        cluster_links, exits = [], {}
        for i, link in enumerate(links):
            na, la = _node_of_vertex(link.a, per_node)
            nb, lb = _node_of_vertex(link.b, per_node)
            nodes = {n for n in (na, nb) if n is not None}
            if len(nodes) > 1:
                return None  # a direct link between nodes
            if not nodes:
                cluster_links.append(i)
                continue
            node = nodes.pop()
            node_links[node].append(i)
            shapes[node].append((la, lb, na is None, nb is None, link.link_class,
                                 link.bandwidth, link.latency))
            for inside, other, other_node in ((la, lb, nb), (lb, la, na)):
                if other_node is None and not inside.startswith("device:"):
                    exits.setdefault((node, inside), set()).add(other)
        if any(len(e) > 1 for e in exits.values()):
            return None  # a node switch that could forward between cluster switches
        local_names = [[v for _, v in vs] for vs in vertices]
        if any(x != local_names[0] for x in local_names) or any(x != shapes[0] for x in shapes):
            return None
        vpos = np.array([[i for i, _ in vs] for vs in vertices])
        lpos = np.array(node_links)
        if not (_same_order(vpos, [i for i, _ in cluster_vertices])
                and _same_order(lpos, cluster_links)):
            return None
        keep = sorted([*lpos[0], *lpos[1], *cluster_links])
        side = {int(g): (0, k) for k, g in enumerate(lpos[0])}
        side |= {int(g): (1, k) for k, g in enumerate(lpos[1])}
        where = [side.get(g, (-1, g)) for g in keep]
        pair_switches = [v for v in switches if _node_of_vertex(v, per_node)[0] in (0, 1, None)]
        pair = Routes(2 * per_node, pair_switches, [links[g] for g in keep])
        return cls(per_node, pair, where, lpos)

    def _pair_route(self, a: int, b: int) -> tuple[Hop, ...]:
        key = (a, b)
        if key not in self._pair_routes:
            self._pair_routes[key] = self.pair.route(a, b)
        return self._pair_routes[key]

    def _rename(self, hops: tuple[Hop, ...], lower: int, upper: int) -> tuple[Hop, ...]:
        out = []
        for link, direction in hops:
            side, k = self.where[link]
            out.append((k if side < 0 else int(self.node_links[(lower, upper)[side], k]),
                        direction))
        return tuple(out)

    def route(self, a: int, b: int) -> tuple[Hop, ...]:
        """The hops from device `a` to device `b`, from the 2-node graph's route."""
        p = self.per_node
        (i, ra), (j, rb) = divmod(a, p), divmod(b, p)
        if i == j:
            return self._rename(self._pair_route(ra, rb), i, i)
        if i < j:
            return self._rename(self._pair_route(ra, p + rb), i, j)
        return self._rename(self._pair_route(p + ra, rb), j, i)

    def all_pairs(self, groups: Iterable[Sequence[int]]) -> tuple[Counter[Hop], float]:
        """`Routes.all_pairs`, counting each kind of 2-node route once per group."""
        load: Counter[Hop] = Counter()
        latency = 0.0
        links = self.pair.links
        p = self.per_node
        for group in groups:
            ranks: dict[int, list[int]] = {}
            for d in group:
                ranks.setdefault(d // p, []).append(d % p)
            for node, rs in ranks.items():  # pairs inside a node
                for ra in rs:
                    for rb in rs:
                        if ra != rb:
                            hops = self._pair_route(ra, rb)
                            load.update(self._rename(hops, node, node))
                            latency = max(latency, sum(links[h].latency for h, _ in hops))
            nodes = sorted(ranks)
            shared = all(ranks[n] == ranks[nodes[0]] for n in nodes)
            pairs = [(nodes[0], nodes[1])] if shared and len(nodes) > 1 else \
                [(x, y) for t, x in enumerate(nodes) for y in nodes[t + 1:]]
            for lower, upper in pairs:  # pairs across nodes, both ways
                counts: Counter[Hop] = Counter()
                for ra in ranks[lower]:
                    for rb in ranks[upper]:
                        for hops in (self._pair_route(ra, p + rb), self._pair_route(p + rb, ra)):
                            counts.update(hops)
                            latency = max(latency, sum(links[h].latency for h, _ in hops))
                if not shared:
                    for (link, direction), c in counts.items():
                        load[self._rename(((link, direction),), lower, upper)[0]] += c
                    continue
                m = len(nodes)
                for (link, direction), c in counts.items():
                    side, k = self.where[link]
                    if side < 0:
                        load[(k, direction)] += c * m * (m - 1) // 2
                        continue
                    for t, node in enumerate(nodes):  # lower in m-1-t pairs, upper in t
                        times = m - 1 - t if side == 0 else t
                        if times:
                            load[(int(self.node_links[node, k]), direction)] += c * times
        return load, latency
