"""Routes over a topology's link graph, and what the rings of a collective see on them.

Devices and switches are the vertices; links the edges. A transfer from one device to another
takes the widest path (largest bottleneck bandwidth, then fewest hops); devices never forward
traffic; the path's latency is the sum of its links'. The rings of a collective run at once, so
their flows share links: a ring's per-device bandwidth is the minimum over links of bandwidth /
(ring flows crossing that link in that direction), and its latency the slowest hop's.
`soapjax.topology.Topology` asks these questions and memoises the answers.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from soapjax._topology_file import Link
from soapjax.errors import TopologyError


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
    """The link graph of `num_devices` devices and `switches`, with memoised widest paths."""

    def __init__(self, num_devices: int, switches: Sequence[str], links: Sequence[Link]):
        self.num_devices = num_devices
        self.links = tuple(links)
        names = [f"device:{d}" for d in range(num_devices)] + list(switches)
        index = {v: i for i, v in enumerate(names)}
        self._adj: list[list[tuple[int, int, int]]] = [[] for _ in names]
        for i, link in enumerate(self.links):
            self._adj[index[link.a]].append((index[link.b], i, 0))
            self._adj[index[link.b]].append((index[link.a], i, 1))
        self._from: dict[int, dict[int, tuple[Hop, ...]]] = {}

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
