"""Topology: the devices, links and named mesh axes of a cluster, and what communication costs.

A topology is one TOML file in ``meshes/`` (``load_topology("p100x16")``) or anywhere else
(``load_topology("path/to/mine.toml")``). Numbers are SI base units (bytes, bytes/s, seconds,
FLOP/s); a string with a unit is accepted too and is easier to check against a datasheet:
``"100 Gb/s"`` (gigaBITS, = 12.5e9 bytes/s), ``"20 GB/s"``, ``"16 GB"``, ``"80 GiB"``, ``"1.5 us"``,
``"10.6 TFLOP/s"``. Bandwidths are per direction (links are full duplex).

Example (two nodes of two GPUs, NVLink inside a node, InfiniBand between nodes)::

    name = "tiny"                      # optional; defaults to the file's stem
    platform = "gpu"                   # "gpu" | "cpu" | "tpu"

    [device]
    kind = "Tesla P100-SXM2-16GB"
    memory_bytes = "16 GB"
    memory_bandwidth = "732 GB/s"
    peak_flops = { float32 = "10.6 TFLOP/s", bfloat16 = "10.6 TFLOP/s", float16 = "21.2 TFLOP/s" }

    [nodes]                            # devices are numbered node by node: device:0 .. device:3
    count = 2
    devices_per_node = 2
    switches = { host = 1 }            # switches inside every node ("host"; a count of 2 gives
                                       # "plx:0" and "plx:1")
    [fabric]
    switches = { ib = 1 }              # switches shared by the whole cluster

    [mesh]
    axes = { node = 2, gpu = 2 }       # in order; sizes multiply to the device count
    # device_order = [0, 1, 2, 3]      # mesh position -> device id (default: 0, 1, 2, ...)

    [[links]]                          # scope "node" (default): repeated in every node, and
    class = "nvlink"                   # device:i is the i-th device of that node
    bandwidth = "20 GB/s"
    latency = "1 us"
    connect = [["device:0", "device:1"]]

    [[links]]
    class = "infiniband"
    bandwidth = "100 Gb/s"
    latency = "1.5 us"
    connect = [["host", "ib"]]         # "device:*" expands to every device of the node; two
                                       # starred ends pair up by index ("device:*", "nic:*")

With ``scope = "cluster"`` a link entry is not repeated: ``device:K`` is the global device K and
``node:N/host`` names a switch inside node N, so any explicit link graph can be written.

Communication model. Devices and switches are the vertices of a graph whose edges are the links.
A transfer from one device to another takes the widest path (largest bottleneck bandwidth, then
fewest hops); devices never forward traffic; the path's latency is the sum of its links'.
A collective over mesh ``axes`` runs on every *group* at once (the devices that differ only along
those axes), as one SPMD collective does, so the flows of all groups share the links. A ring
visits a group's devices node by node (as NCCL's rings do, so it leaves each node once); its
per-device bandwidth ``b`` is the minimum over links of bandwidth / (ring flows crossing that link
in that direction), and its latency ``a`` is the slowest hop's. With ``n`` devices per group and
``s = nbytes``, the closed forms are listed in :meth:`Topology.collective_time`. The hierarchical
algorithm runs the ring inside each node (``m`` devices, ``b_l``, ``a_l``) and across nodes
(``k`` nodes, ``b_x``, ``a_x``, one cross-node ring per local rank); ``"auto"`` takes the cheaper.

Resources for the simulator. Each link belongs to a *channel*: ``node:N/<class>`` for links inside
node N (or from node N to a cluster-wide switch: its NICs), ``cluster/<class>`` for the rest.
:meth:`Topology.channels_used` lists the channels a collective over some axes touches; a simulator
that makes each channel a communication device which runs one transfer at a time (FIFO) sees
concurrent collectives over the same fabric queue behind each other, while an intra-node
collective and an inter-node one overlap. :meth:`Topology.collective_time` already prices the
sharing *within* one collective (all its groups at once), so a collective is one task on its
channels, not one task per group.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import heapq
import json
import math
import re
import tomllib
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from soapjax.errors import TopologyError

Platform = Literal["gpu", "cpu", "tpu"]
PLATFORMS: tuple[str, ...] = ("gpu", "cpu", "tpu")
LINK_CLASSES: tuple[str, ...] = ("nvlink", "pcie", "infiniband", "ethernet", "shared_memory", "ici")
REQUIRED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
KNOWN_DTYPES = (*REQUIRED_DTYPES, "float64", "int8", "float8_e4m3fn", "float8_e5m2")
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "point_to_point",
)
ALGORITHMS: tuple[str, ...] = ("auto", "ring", "hierarchical")

_MESHES_DIRS = (
    Path(__file__).resolve().parent.parent / "meshes",  # a source checkout
    Path(__file__).resolve().parent / "meshes",  # an installed wheel (package data)
)

# --- units ---------------------------------------------------------------------------------------

_UNITS: dict[str, dict[str, float]] = {
    "bytes/s": {
        "B/s": 1.0,
        "KB/s": 1e3,
        "MB/s": 1e6,
        "GB/s": 1e9,
        "TB/s": 1e12,
        "Kb/s": 1e3 / 8,
        "Mb/s": 1e6 / 8,
        "Gb/s": 1e9 / 8,
        "Tb/s": 1e12 / 8,
    },
    "bytes": {
        "B": 1.0,
        "KB": 1e3,
        "MB": 1e6,
        "GB": 1e9,
        "TB": 1e12,
        "KiB": 2.0**10,
        "MiB": 2.0**20,
        "GiB": 2.0**30,
        "TiB": 2.0**40,
    },
    "seconds": {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9},
    "FLOP/s": {"FLOP/s": 1.0, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "PFLOP/s": 1e15},
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")


# Bytes each device sends in a ring collective of n devices, as a fraction of its `nbytes`
# (the `Topology.collective_time` convention).
SENT_FRACTION = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                 "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                 "collective_permute": lambda n: 1.0, "point_to_point": lambda n: 1.0}


def bytes_sent(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes each device sends in one collective (``"all_reduce"`` or ``"all-reduce"``, ...)."""
    return SENT_FRACTION[kind.replace("-", "_")](group_size) * nbytes


def _quantity(value: object, unit: str, where: str, *, allow_zero: bool = False) -> float:
    """A number in SI base units, or a string such as "100 Gb/s", as a float of `unit`."""
    units = _UNITS[unit]
    example = {"bytes/s": '"20 GB/s"', "bytes": '"16 GB"', "seconds": '"1.5 us"'}.get(
        unit, '"10.6 TFLOP/s"'
    )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        x = float(value)
    elif isinstance(value, str) and (m := _QUANTITY.match(value)) and m.group(2) in units:
        x = float(m.group(1)) * units[m.group(2)]
    else:
        raise TopologyError(
            f"{where}: expected {unit} as a number or a string like {example} "
            f"(units: {', '.join(units)}), found {value!r}"
        )
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise TopologyError(f"{where}: expected a positive {unit}, found {value!r}")
    return x


# --- records -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (all devices of a topology are alike).

    Attributes:
      kind: the device's model name, e.g. ``"H100 SXM5 80GB"``.
      peak_flops: ``(dtype name, FLOP/s)`` pairs, sorted by name; dense peak, no sparsity.
      memory_bandwidth: bytes/s of the device's own memory.
      memory_bytes: size of the device's own memory.
    """

    kind: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bandwidth: float
    memory_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", tuple(sorted(self.peak_flops)))
        names = [n for n, _ in self.peak_flops]
        missing = [d for d in REQUIRED_DTYPES if d not in names]
        unknown = [d for d in names if d not in KNOWN_DTYPES]
        if missing or unknown or len(set(names)) != len(names):
            raise TopologyError(
                f"[device].peak_flops: expected one entry for each of {', '.join(REQUIRED_DTYPES)} "
                f"(optionally {', '.join(KNOWN_DTYPES[3:])}), found {', '.join(names) or 'none'}"
            )
        if not self.kind:
            raise TopologyError("[device].kind: expected a non-empty device name")
        if min(f for _, f in self.peak_flops) <= 0 or self.memory_bandwidth <= 0:
            raise TopologyError("[device]: expected positive peak_flops and memory_bandwidth")
        if self.memory_bytes <= 0:
            raise TopologyError(f"[device].memory_bytes: expected > 0, found {self.memory_bytes}")

    def peak_flops_for(self, dtype: Any) -> float:
        """Peak FLOP/s for a dtype, given by name (``"bfloat16"``) or as a numpy/jax dtype.

        Raises:
          TopologyError: the topology file gives no figure for this dtype.
        """
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        for n, flops in self.peak_flops:
            if n == name:
                return flops
        raise TopologyError(
            f"device {self.kind!r} has no peak FLOP/s for dtype {name!r}; the topology gives "
            f"{', '.join(n for n, _ in self.peak_flops)}"
        )


@dataclasses.dataclass(frozen=True)
class Link:
    """A full-duplex link between two vertices (``device:K``, ``node:N/<switch>``, or ``<switch>``).

    Attributes:
      a, b: the vertices it joins.
      link_class: one of :data:`LINK_CLASSES`.
      bandwidth: bytes/s in each direction.
      latency: seconds per hop.
      channel: the simulator resource it belongs to, ``node:N/<class>`` or ``cluster/<class>``.
    """

    a: str
    b: str
    link_class: str
    bandwidth: float
    latency: float
    channel: str

    def __post_init__(self) -> None:
        if self.link_class not in LINK_CLASSES:
            raise TopologyError(
                f"link {self.a} -- {self.b}: class {self.link_class!r} is unknown; expected one "
                f"of {', '.join(LINK_CLASSES)}"
            )
        if self.a == self.b:
            raise TopologyError(f"link {self.a} -- {self.b}: a link must join two vertices")
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise TopologyError(f"link {self.a} -- {self.b}: expected bandwidth > 0, latency >= 0")


class Channel(NamedTuple):
    """A group of links the simulator treats as one communication device (see module doc)."""

    id: str  # "node:3/infiniband", "cluster/infiniband"
    link_class: str
    node: int | None  # None for cluster-wide channels


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


_Hop = tuple[int, int]  # (link index, 0 for a->b, 1 for b->a)
_IDLE = RingStats(1, math.inf, 0.0, None, 0, math.inf)


# --- the topology --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Topology:
    """A cluster: identical devices in nodes, the links between them, and named mesh axes.

    Devices are numbered node by node (node ``i`` holds ``i*devices_per_node`` onwards); mesh
    position ``p`` (row-major over ``axis_sizes``) holds device ``device_order[p]``.

    Attributes:
      name: e.g. ``"p100x16"``.
      platform: the jax platform its devices have (``"gpu"``, ``"cpu"``, ``"tpu"``).
      device: the spec of every device.
      num_devices: device count.
      axis_names, axis_sizes: the mesh axes, e.g. ``("node", "gpu")`` and ``(4, 4)``.
      device_order: mesh position -> device id.
      num_nodes, devices_per_node: the node structure.
      switches: the switch vertices (``node:N/<name>`` or cluster-wide ``<name>``).
      links: every link.
      description: free text from the file.
      source_file: where it was read from (not part of equality or the fingerprint).
    """

    name: str
    platform: Platform
    device: DeviceSpec
    num_devices: int
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    device_order: tuple[int, ...]
    num_nodes: int
    devices_per_node: int
    switches: tuple[str, ...]
    links: tuple[Link, ...]
    description: str = ""
    source_file: str | None = dataclasses.field(default=None, compare=False)
    _memo: dict = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise TopologyError(
                f"platform: expected one of {', '.join(PLATFORMS)}, found {self.platform!r}"
            )
        if self.num_nodes * self.devices_per_node != self.num_devices or self.num_devices < 1:
            raise TopologyError(
                f"[nodes]: count={self.num_nodes} x devices_per_node={self.devices_per_node} "
                f"must equal the device count {self.num_devices}"
            )
        if len(self.axis_names) != len(self.axis_sizes) or not self.axis_names:
            raise TopologyError("[mesh].axes: expected at least one axis, each with a size")
        for a, size in zip(self.axis_names, self.axis_sizes):
            if not a.isidentifier() or size < 1:
                raise TopologyError(
                    f"[mesh].axes: axis {a!r} = {size}: expected an identifier and a size >= 1"
                )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise TopologyError(f"[mesh].axes: axis names repeat: {self.axis_names}")
        if math.prod(self.axis_sizes) != self.num_devices:
            shown = " x ".join(f"{a}={s}" for a, s in zip(self.axis_names, self.axis_sizes))
            raise TopologyError(
                f"[mesh].axes: sizes {shown} = {math.prod(self.axis_sizes)}, expected the device "
                f"count {self.num_devices} ([nodes] count={self.num_nodes} x "
                f"devices_per_node={self.devices_per_node})"
            )
        if sorted(self.device_order) != list(range(self.num_devices)):
            raise TopologyError(
                f"[mesh].device_order: expected each device id 0..{self.num_devices - 1} once, "
                f"found {list(self.device_order)}"
            )
        vertices = set(self.switches) | {f"device:{d}" for d in range(self.num_devices)}
        for i, link in enumerate(self.links):
            for end in (link.a, link.b):
                if end not in vertices:
                    raise TopologyError(
                        f"links: link {i} ({link.a} -- {link.b}): {end!r} is no "
                        f"device or switch of this topology"
                    )
        self._check_connected()

    # --- structure -------------------------------------------------------------------------------

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The device ids of each node."""
        k = self.devices_per_node
        return tuple(tuple(range(i * k, (i + 1) * k)) for i in range(self.num_nodes))

    @property
    def mesh_shape(self) -> dict[str, int]:
        """``{axis name: size}`` in mesh order, like ``jax.sharding.Mesh.shape``."""
        return dict(zip(self.axis_names, self.axis_sizes))

    def node_of(self, device: int) -> int:
        """The node that holds a device id."""
        return device // self.devices_per_node

    def groups(self, axes: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """The device groups a collective over ``axes`` runs on, each in ring order.

        A group is the devices that differ only along ``axes``. Example: on ``node=4, gpu=4``
        ``groups(("gpu",))`` is ``((0, 1, 2, 3), (4, 5, 6, 7), ...)`` and ``groups(("node",))``
        is ``((0, 4, 8, 12), (1, 5, 9, 13), ...)``.
        """
        axes = self._normalise_axes(axes)
        key = ("groups", axes)
        if key not in self._memo:
            arr = np.asarray(self.device_order).reshape(self.axis_sizes)
            inside = [self.axis_names.index(a) for a in axes]
            outside = [i for i in range(arr.ndim) if i not in inside]
            n = math.prod(self.axis_sizes[i] for i in inside)
            rows = arr.transpose(outside + inside).reshape(-1, n).tolist()
            self._memo[key] = tuple(tuple(sorted(r, key=self.node_of)) for r in rows)
        return self._memo[key]

    # --- communication costs ---------------------------------------------------------------------

    def axis_bandwidth(self, axes: Sequence[str]) -> float:
        """Bytes/s each device gets in a ring collective over ``axes`` (inf for one device)."""
        return self.ring_stats(axes).bandwidth

    def axis_latency(self, axes: Sequence[str]) -> float:
        """Seconds of one ring step's latency over ``axes`` (the slowest hop's path)."""
        return self.ring_stats(axes).latency

    def ring_stats(self, axes: Sequence[str]) -> RingStats:
        """The ring over ``axes``: bandwidth, latency, bottleneck link and its sharing."""
        axes = self._normalise_axes(axes)
        return self._cached(("ring", axes), lambda: self._rings_stats(self.groups(axes)))

    def hierarchy_stats(self, axes: Sequence[str]) -> tuple[RingStats, RingStats] | None:
        """(in-node rings, cross-node rings) of the hierarchical algorithm over ``axes``.

        None when a group does not hold the same number of devices in each of its nodes.
        On a group inside one node the cross-node stats have size 1, and vice versa.
        """
        axes = self._normalise_axes(axes)
        return self._cached(("hier", axes), lambda: self._hierarchy(self.groups(axes)))

    def collective_time(
        self, kind: str, nbytes: float, axes: Sequence[str], algorithm: str = "auto"
    ) -> float:
        """Seconds a collective over mesh ``axes`` takes, with every group running at once.

        With ``n`` devices per group, ``s = nbytes``, ring bandwidth ``b`` and latency ``a``
        (:meth:`axis_bandwidth`, :meth:`axis_latency`):

        ==================  ======================================  ===============================
        kind                ring                                    ``nbytes`` is, per device
        ==================  ======================================  ===============================
        all_reduce          ``2(n-1)/n * s/b + 2(n-1) a``           the buffer being reduced
        all_gather          ``(n-1)/n * s/b + (n-1) a``             the gathered OUTPUT
        reduce_scatter      ``(n-1)/n * s/b + (n-1) a``             the INPUT
        all_to_all          ``(n-1)/n * s/b_a2a + (n-1) a_a2a``     the buffer (s/n to each peer)
        collective_permute  ``s/b + a``                             the buffer sent to one peer
        point_to_point      ``s/b_solo + a``                        the buffer; one lone transfer
        ==================  ======================================  ===============================

        ``b_a2a = (n-1) / max over links (flows/bandwidth)`` with every device sending to every
        other at once (on a switch it equals ``b``; it is larger where direct links add up), and
        ``a_a2a`` the slowest pair's latency. ``b_solo`` is ``b`` with nothing else on the links.
        Hierarchical, with ``m`` devices per node (``b_l``, ``a_l``) and ``k`` nodes (``b_x``,
        ``a_x``), writing ``RS/AG(s, n, b, a) = (n-1)/n * s/b + (n-1) a``:
        all_reduce = ``RS(s, m) + AR(s/m, k) + AG(s, m)``; all_gather = ``AG(s/m, k) + AG(s, m)``;
        reduce_scatter = ``RS(s, m) + RS(s/m, k)``.

        Args:
          kind: one of :data:`COLLECTIVES` (HLO spellings like ``"all-reduce"`` work too).
          nbytes: bytes, per the table.
          axes: mesh axis names; ``()`` costs nothing.
          algorithm: ``"ring"``, ``"hierarchical"`` (all_reduce, all_gather, reduce_scatter) or
            ``"auto"``, the cheaper of the two.

        Raises:
          TopologyError: unknown kind, algorithm or axis; hierarchical asked where it cannot run.
        """
        kind = kind.replace("-", "_")
        if kind not in COLLECTIVES:
            raise TopologyError(
                f"collective kind {kind!r}: expected one of {', '.join(COLLECTIVES)}"
            )
        if algorithm not in ALGORITHMS:
            raise TopologyError(f"algorithm {algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
        if nbytes < 0:
            raise TopologyError(f"nbytes: expected >= 0, found {nbytes}")
        ring = self.ring_stats(axes)
        if ring.size == 1:
            return 0.0
        flat = self._ring_time(kind, nbytes, axes, ring)
        if algorithm == "ring" or kind not in ("all_reduce", "all_gather", "reduce_scatter"):
            if algorithm == "hierarchical":
                raise TopologyError(
                    f"algorithm 'hierarchical' is defined for all_reduce, all_gather and "
                    f"reduce_scatter, not {kind}; use 'ring' or 'auto'"
                )
            return flat
        hier = self.hierarchy_stats(axes)
        if hier is None:
            if algorithm == "hierarchical":
                raise TopologyError(
                    f"axes {tuple(axes)} of topology {self.name!r}: the hierarchical algorithm "
                    f"needs the same number of devices of a group in each node"
                )
            return flat
        tiered = _hierarchical_time(kind, nbytes, *hier)
        return tiered if algorithm == "hierarchical" else min(flat, tiered)

    def links_used(self, axes: Sequence[str]) -> tuple[int, ...]:
        """Indices into :attr:`links` of every link a collective over ``axes`` may cross."""
        return tuple(sorted({link for link, _ in self._all_pairs(axes)[0]}))

    def channels_used(self, axes: Sequence[str]) -> tuple[Channel, ...]:
        """The channels (simulator resources) a collective over ``axes`` occupies, sorted by id."""
        return tuple(sorted({self.channel(self.links[i].channel) for i in self.links_used(axes)}))

    @staticmethod
    def channel(channel_id: str) -> Channel:
        """The :class:`Channel` record of a channel id such as ``"node:2/nvlink"``."""
        scope, link_class = channel_id.split("/")
        node = None if scope == "cluster" else int(scope.removeprefix("node:"))
        return Channel(channel_id, link_class, node)

    # --- identity and display --------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 (hex) of the normalised content; independent of comments, units and path."""
        skip = ("source_file", "_memo")
        content = {
            f.name: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
            for f in dataclasses.fields(self)
            if f.name not in skip and (v := getattr(self, f.name)) is not None
        }
        content["links"] = [dataclasses.astuple(link) for link in self.links]
        text = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def summary(self) -> dict[str, Any]:
        """A JSON-able description: devices, axes with the bandwidth each sees, links by kind.

        Per axis, ``bandwidth_GBps`` is gigabytes/s and ``bandwidth_gbps`` gigabits/s that each
        device gets in a ring collective over that axis alone, all groups at once;
        ``bottleneck`` names the link that limits it and how many ring flows share it.
        """
        axes = [self._axis_summary(name) for name in self.axis_names]
        kinds = Counter((k.link_class, k.bandwidth, k.latency) for k in self.links)
        return {
            "name": self.name,
            "platform": self.platform,
            "description": self.description,
            "num_devices": self.num_devices,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": {
                "kind": self.device.kind,
                "peak_tflops": {n: f / 1e12 for n, f in self.device.peak_flops},
                "memory_GB": self.device.memory_bytes / 1e9,
                "memory_bandwidth_GBps": self.device.memory_bandwidth / 1e9,
            },
            "axes": axes,
            "links": [
                {"class": c, "count": count, "bandwidth_GBps": bw / 1e9, "latency_us": lat * 1e6}
                for (c, bw, lat), count in kinds.items()
            ],
            "switches": list(self.switches),
            "fingerprint": self.fingerprint(),
            "source_file": self.source_file,
        }

    def _axis_summary(self, axis: str) -> dict[str, Any]:
        r = self.ring_stats((axis,))
        bottleneck = None
        if r.link is not None:
            link = self.links[r.link]
            bottleneck = {
                "class": link.link_class,
                "link": f"{link.a} -- {link.b}",
                "link_bandwidth_GBps": link.bandwidth / 1e9,
                "sharing": r.sharing,
            }
        return {
            "name": axis,
            "size": r.size,
            "bandwidth_GBps": r.bandwidth / 1e9,
            "bandwidth_gbps": r.bandwidth * 8 / 1e9,
            "latency_us": r.latency * 1e6,
            "bottleneck": bottleneck,
        }

    # --- internals -------------------------------------------------------------------------------

    def _cached(self, key: tuple, compute: Any) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def _normalise_axes(self, axes: Sequence[str]) -> tuple[str, ...]:
        if isinstance(axes, str):
            axes = (axes,)
        unknown = [a for a in axes if a not in self.axis_names]
        if unknown or len(set(axes)) != len(axes):
            raise TopologyError(
                f"axes {tuple(axes)}: expected distinct names among the mesh axes "
                f"{self.axis_names} of topology {self.name!r}"
            )
        return tuple(a for a in self.axis_names if a in axes)  # mesh order: one cache entry

    def _graph(self) -> tuple[dict[str, int], list[list[tuple[int, int, int]]]]:
        def build() -> tuple[dict[str, int], list[list[tuple[int, int, int]]]]:
            names = [f"device:{d}" for d in range(self.num_devices)] + list(self.switches)
            index = {v: i for i, v in enumerate(names)}
            adj: list[list[tuple[int, int, int]]] = [[] for _ in names]
            for i, link in enumerate(self.links):
                adj[index[link.a]].append((index[link.b], i, 0))
                adj[index[link.b]].append((index[link.a], i, 1))
            return index, adj

        return self._cached(("graph",), build)

    def _routes_from(self, src: int) -> dict[int, tuple[_Hop, ...]]:
        """Widest-then-shortest paths from device ``src`` to every device it reaches."""

        def build() -> dict[int, tuple[_Hop, ...]]:
            _, adj = self._graph()
            best = {src: (-math.inf, 0)}
            back: dict[int, tuple[int, int, int]] = {}
            heap = [(-math.inf, 0, src)]
            while heap:
                neg_bw, hops, v = heapq.heappop(heap)
                if (neg_bw, hops) > best[v] or (v != src and v < self.num_devices):
                    continue  # stale entry, or a device: devices do not forward
                for w, link, direction in adj[v]:
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
            return routes

        return self._cached(("routes", src), build)

    def _route(self, a: int, b: int) -> tuple[_Hop, ...]:
        return self._routes_from(a)[b]

    def _check_connected(self) -> None:
        reached = self._routes_from(0)
        for d in range(1, self.num_devices):
            if d not in reached:
                raise TopologyError(
                    f"links: device:{d} cannot reach device:0; expected the links to join every "
                    f"pair of devices"
                )

    def _rings_stats(self, rings: Iterable[Sequence[int]]) -> RingStats:
        load: Counter[_Hop] = Counter()
        size, latency, solo = 1, 0.0, math.inf
        for ring in rings:
            size = max(size, len(ring))
            if len(ring) < 2:
                continue
            for a, b in zip(ring, (*ring[1:], ring[0])):
                route = self._route(a, b)
                load.update(route)
                latency = max(latency, sum(self.links[i].latency for i, _ in route))
                solo = min(solo, min(self.links[i].bandwidth for i, _ in route))
        if not load:
            return _IDLE
        hop = min(load, key=lambda h: (self.links[h[0]].bandwidth / load[h], h))
        return RingStats(
            size, self.links[hop[0]].bandwidth / load[hop], latency, hop[0], load[hop], solo
        )

    def _hierarchy(self, groups: Sequence[Sequence[int]]) -> tuple[RingStats, RingStats] | None:
        local, cross = [], []
        for group in groups:
            by_node: dict[int, list[int]] = {}
            for d in group:
                by_node.setdefault(self.node_of(d), []).append(d)
            parts = list(by_node.values())
            if len({len(p) for p in parts}) != 1:
                return None
            local += parts
            cross += [tuple(p[r] for p in parts) for r in range(len(parts[0]))]
        return self._rings_stats(local), self._rings_stats(cross)

    def _all_pairs(self, axes: Sequence[str]) -> tuple[Counter[_Hop], float]:
        """Flows per link direction when every device of every group sends to every other."""
        axes = self._normalise_axes(axes)

        def build() -> tuple[Counter[_Hop], float]:
            load: Counter[_Hop] = Counter()
            latency = 0.0
            for group in self.groups(axes):
                for a in group:
                    for b in group:
                        if a != b:
                            route = self._route(a, b)
                            load.update(route)
                            latency = max(latency, sum(self.links[i].latency for i, _ in route))
            return load, latency

        return self._cached(("pairs", axes), build)

    def _ring_time(self, kind: str, s: float, axes: Sequence[str], r: RingStats) -> float:
        n = r.size
        if kind == "all_reduce":
            return 2 * (n - 1) / n * s / r.bandwidth + 2 * (n - 1) * r.latency
        if kind in ("all_gather", "reduce_scatter"):
            return _gather_time(s, n, r.bandwidth, r.latency)
        if kind == "collective_permute":
            return s / r.bandwidth + r.latency
        if kind == "point_to_point":
            return s / r.solo_bandwidth + r.latency
        load, latency = self._all_pairs(axes)  # all_to_all
        b_a2a = (n - 1) / max(load[h] / self.links[h[0]].bandwidth for h in load)
        return (n - 1) / n * s / b_a2a + (n - 1) * latency


def _gather_time(s: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather (s = output) or reduce-scatter (s = input) over n devices."""
    return 0.0 if n <= 1 else (n - 1) / n * s / bandwidth + (n - 1) * latency


def _hierarchical_time(kind: str, s: float, local: RingStats, cross: RingStats) -> float:
    m, k = local.size, cross.size
    in_node = _gather_time(s, m, local.bandwidth, local.latency)
    if kind == "all_reduce":
        across = 2 * _gather_time(s / m, k, cross.bandwidth, cross.latency)
        return 2 * in_node + across
    return in_node + _gather_time(s / m, k, cross.bandwidth, cross.latency)


# --- loading -------------------------------------------------------------------------------------


def list_topologies() -> tuple[str, ...]:
    """The names of the shipped topologies (the ``*.toml`` files in ``meshes/``), sorted."""
    names = {p.stem for d in _MESHES_DIRS if d.is_dir() for p in d.glob("*.toml")}
    return tuple(sorted(names))


def load_topology(name_or_path: str | Path) -> Topology:
    """Reads a topology by shipped name (``"p100x16"``) or from a TOML file path.

    Raises:
      TopologyError: no such topology, or the file is malformed (the message names the file,
        the key and what was expected).
    """
    path = Path(name_or_path)
    if path.suffix != ".toml" and len(path.parts) == 1 and not path.is_file():
        candidates = [d / f"{name_or_path}.toml" for d in _MESHES_DIRS]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise TopologyError(
                f"no topology named {str(name_or_path)!r}; expected one of "
                f"{', '.join(list_topologies())} or a path to a .toml file"
            )
        path = found[0]
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise TopologyError(f"{path}: no such topology file") from None
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"{path}: not valid TOML: {e}") from None
    try:
        return _parse(data, default_name=path.stem, source=str(path))
    except TopologyError as e:
        raise TopologyError(f"{path}: {e}") from None


def scaled_topology(topology: Topology | str | Path, num_devices: int) -> Topology:
    """The same cluster cut to its first `num_devices` devices: whole nodes, or part of one.

    Links to the devices (and nodes) left out are dropped, and switches left without links. The
    mesh keeps its axes from the innermost outwards: each keeps its size while the devices
    allow, the next is cut to what is left, and the outer ones (now of size 1) are dropped.
    This needs the topology's mesh positions to be its device ids in order (no
    ``device_order``), so that the first devices are a corner of the mesh.

    Example: ``k80x64`` (16 nodes of 4 GPUs, mesh ``node=16, gpu=4``) cut to 8 devices is 2 of
    its nodes with mesh ``node=2, gpu=4``; cut to 2, one node with two of its GPUs (the two on
    one PCIe switch), mesh ``gpu=2``; ``dgx-h100x8`` (``data=2, model=4``) cut to 4 is
    ``model=4``.

    Args:
      topology: a `Topology`, or a shipped name or TOML path for `load_topology`.
      num_devices: how many devices to keep: a multiple of the devices per node up to the
        node count, or a divisor of the devices per node.

    Returns:
      The cut topology, named ``"<name>-<num_devices>"`` (the topology itself when nothing is
      cut).

    Raises:
      TopologyError: `num_devices` is neither whole nodes nor a divisor of a node, or the mesh
        cannot be cut to it.
    """
    topo = topology if isinstance(topology, Topology) else load_topology(topology)
    n, per_node = num_devices, topo.devices_per_node
    if n == topo.num_devices:
        return topo
    whole = n % per_node == 0 and 0 < n // per_node <= topo.num_nodes
    if not (whole or (0 < n < per_node and per_node % n == 0)):
        raise TopologyError(
            f"topology {topo.name!r} ({topo.num_nodes} nodes of {per_node} devices) cannot be "
            f"cut to {num_devices} devices; expected a multiple of {per_node} up to "
            f"{topo.num_devices}, or a divisor of {per_node}"
        )
    if topo.device_order != tuple(range(topo.num_devices)):
        raise TopologyError(
            f"topology {topo.name!r} sets [mesh].device_order; scaled_topology needs mesh "
            f"position i to be device i"
        )
    sizes, left = [], n
    for size in reversed(topo.axis_sizes):
        keep = size if left % size == 0 else left if size % left == 0 else 0
        if not keep:
            shown = ", ".join(f"{a}={s}" for a, s in zip(topo.axis_names, topo.axis_sizes))
            raise TopologyError(f"topology {topo.name!r}: mesh ({shown}) cannot be cut to "
                                f"{num_devices} devices from the innermost axis outwards")
        sizes.append(keep)
        left //= keep
    kept_axes = [(a, s) for a, s in zip(topo.axis_names, reversed(sizes)) if s > 1]
    axes = kept_axes or [(topo.axis_names[-1], 1)]
    nodes = max(1, n // per_node)

    def kept(v: str) -> bool:
        if v.startswith("device:"):
            return int(v[7:]) < n
        if v.startswith("node:"):
            return int(v[5:].split("/")[0]) < nodes
        return True

    links = tuple(link for link in topo.links if kept(link.a) and kept(link.b))
    linked = {v for link in links for v in (link.a, link.b)}
    return Topology(
        name=f"{topo.name}-{n}",
        platform=topo.platform,
        device=topo.device,
        num_devices=n,
        axis_names=tuple(a for a, _ in axes),
        axis_sizes=tuple(s for _, s in axes),
        device_order=tuple(range(n)),
        num_nodes=nodes,
        devices_per_node=min(n, per_node),
        switches=tuple(s for s in topo.switches if s in linked),
        links=links,
        description=f"the first {n} devices of {topo.name}: {topo.description}",
    )


_TOP_KEYS = {
    "name": False,
    "platform": True,
    "description": False,
    "device": True,
    "nodes": True,
    "fabric": False,
    "mesh": True,
    "links": True,
}
_DEVICE_KEYS = {"kind": True, "peak_flops": True, "memory_bandwidth": True, "memory_bytes": True}
_NODES_KEYS = {"count": True, "devices_per_node": True, "switches": False}
_FABRIC_KEYS = {"switches": False}
_MESH_KEYS = {"axes": True, "device_order": False}
_LINK_KEYS = {"class": True, "bandwidth": True, "latency": True, "connect": True, "scope": False}
_HELP = {  # what a required key holds, for "missing required key" errors
    "platform": f"one of {', '.join(PLATFORMS)}",
    "device": "a [device] table",
    "nodes": "a [nodes] table",
    "mesh": "a [mesh] table",
    "links": "[[links]] tables",
    "kind": 'the device name, e.g. "H100 SXM5 80GB"',
    "peak_flops": 'a table of dtype = FLOP/s, e.g. { float32 = "67 TFLOP/s", ... }',
    "memory_bandwidth": 'bytes/s, a number or a string like "3.35 TB/s"',
    "memory_bytes": 'bytes, a number or a string like "80 GB"',
    "count": "the number of nodes",
    "devices_per_node": "the number of devices in each node",
    "axes": "a table of axis = size, e.g. { node = 4, gpu = 4 }",
    "bandwidth": 'bytes/s in each direction, a number or a string like "20 GB/s"',
    "latency": 'seconds per hop, a number or a string like "1.5 us"',
    "connect": 'a list of [end, end] pairs such as [["device:0", "device:1"]]',
    "class": f"one of {', '.join(LINK_CLASSES)}",
}


def _table(data: object, where: str, keys: dict[str, bool]) -> dict[str, Any]:
    """Checks a TOML table's keys: none unknown, every required one present."""
    if not isinstance(data, dict):
        raise TopologyError(f"{where}: expected a table, found {data!r}")
    for key in data:
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TopologyError(
                f"{where}: unknown key {key!r}{hint}; expected one of: {', '.join(keys)}"
            )
    for key, required in keys.items():
        if required and key not in data:
            raise TopologyError(f"{where}: missing required key {key!r} ({_HELP[key]})")
    return data


def _int(value: object, where: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TopologyError(f"{where}: expected an integer >= {minimum}, found {value!r}")
    return value


def _switch_names(data: object, where: str) -> list[str]:
    """``{plx = 2, host = 1}`` -> ``["plx:0", "plx:1", "host"]``."""
    if not isinstance(data, dict):
        raise TopologyError(f"{where}: expected a table of name = count, found {data!r}")
    names = []
    for name, count in data.items():
        if not re.fullmatch(r"[A-Za-z_][\w-]*", name) or name in ("device", "node"):
            raise TopologyError(
                f"{where}: switch name {name!r}: expected an identifier other "
                f"than 'device' and 'node'"
            )
        count = _int(count, f"{where}.{name}")
        names += [name] if count == 1 else [f"{name}:{i}" for i in range(count)]
    return names


def _parse(data: dict[str, Any], *, default_name: str, source: str) -> Topology:
    _table(data, "top level", _TOP_KEYS)
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise TopologyError(f"name: expected a non-empty string, found {name!r}")
    device = _parse_device(data["device"])
    nodes = _table(data["nodes"], "[nodes]", _NODES_KEYS)
    num_nodes = _int(nodes["count"], "[nodes].count")
    per_node = _int(nodes["devices_per_node"], "[nodes].devices_per_node")
    local_sw = _switch_names(nodes.get("switches", {}), "[nodes].switches")
    fabric = _table(data.get("fabric", {}), "[fabric]", _FABRIC_KEYS)
    global_sw = _switch_names(fabric.get("switches", {}), "[fabric].switches")
    if clash := set(local_sw) & set(global_sw):
        raise TopologyError(f"[fabric].switches: {sorted(clash)} already named in [nodes].switches")
    mesh = _table(data["mesh"], "[mesh]", _MESH_KEYS)
    axes = mesh["axes"]
    if not isinstance(axes, dict) or not axes:
        raise TopologyError(
            f"[mesh].axes: expected a table like {{ node = 4, gpu = 4 }}, found {axes!r}"
        )
    sizes = tuple(_int(v, f"[mesh].axes.{k}") for k, v in axes.items())
    order = mesh.get("device_order", list(range(num_nodes * per_node)))
    if not isinstance(order, list) or not all(isinstance(i, int) for i in order):
        raise TopologyError(f"[mesh].device_order: expected a list of device ids, found {order!r}")
    links = data["links"]
    if not isinstance(links, list) or not links:
        raise TopologyError("links: expected at least one [[links]] table")
    ends = _Ends(num_nodes, per_node, local_sw, global_sw)
    parsed = [link for i, entry in enumerate(links) for link in _parse_link(entry, i, ends)]
    seen: set[frozenset[str]] = set()
    for link in parsed:
        if (pair := frozenset((link.a, link.b))) in seen:
            raise TopologyError(
                f"links: {link.a} -- {link.b} is listed twice; give one link with the summed "
                f"bandwidth"
            )
        seen.add(pair)
    return Topology(
        name=name,
        platform=data["platform"],
        device=device,
        num_devices=num_nodes * per_node,
        axis_names=tuple(axes),
        axis_sizes=sizes,
        device_order=tuple(order),
        num_nodes=num_nodes,
        devices_per_node=per_node,
        switches=(*(f"node:{n}/{s}" for n in range(num_nodes) for s in local_sw), *global_sw),
        links=tuple(parsed),
        description=str(data.get("description", "")),
        source_file=source,
    )


def _parse_device(table: object) -> DeviceSpec:
    dev = _table(table, "[device]", _DEVICE_KEYS)
    flops = dev["peak_flops"]
    if not isinstance(flops, dict):
        raise TopologyError(
            f"[device].peak_flops: expected a table of dtype = FLOP/s, found {flops!r}"
        )
    return DeviceSpec(
        kind=str(dev["kind"]),
        peak_flops=tuple(
            (k, _quantity(v, "FLOP/s", f"[device].peak_flops.{k}")) for k, v in flops.items()
        ),
        memory_bandwidth=_quantity(dev["memory_bandwidth"], "bytes/s", "[device].memory_bandwidth"),
        memory_bytes=int(_quantity(dev["memory_bytes"], "bytes", "[device].memory_bytes")),
    )


class _Ends(NamedTuple):
    num_nodes: int
    per_node: int
    local: list[str]
    cluster: list[str]


def _expand(end: object, scope: str, node: int, ends: _Ends, where: str) -> list[str]:
    """One ``connect`` end -> the vertex names it stands for (several when starred)."""
    if not isinstance(end, str):
        raise TopologyError(f"{where}: expected a string such as 'device:0', found {end!r}")
    n_dev = ends.per_node if scope == "node" else ends.num_nodes * ends.per_node
    if m := re.fullmatch(r"device:(\d+|\*)", end):
        ids = range(n_dev) if m.group(1) == "*" else [int(m.group(1))]
        if ids and max(ids) >= n_dev:
            span = "each node has" if scope == "node" else "the cluster has"
            raise TopologyError(
                f"{where}: {end!r} names a device that does not exist; expected "
                f"device:0 .. device:{n_dev - 1} ({span} {n_dev} devices)"
            )
        base = node * ends.per_node if scope == "node" else 0
        return [f"device:{base + i}" for i in ids]
    prefix, names = "", ends.cluster
    if scope == "node":
        if end.split(":")[0] in {s.split(":")[0] for s in ends.local}:
            prefix, names = f"node:{node}/", ends.local
    elif m := re.fullmatch(r"node:(\d+)/(.+)", end):
        if int(m.group(1)) >= ends.num_nodes:
            raise TopologyError(f"{where}: {end!r}: expected a node 0 .. {ends.num_nodes - 1}")
        prefix, names, end = f"node:{m.group(1)}/", ends.local, m.group(2)
    if end.endswith(":*"):
        stem = end[:-2]
        found = [f"{prefix}{x}" for x in names if x.startswith(stem + ":")]
    else:
        found = [f"{prefix}{end}"] if end in names else []
    if not found:
        known = ", ".join(["device:N"] + ends.local + ends.cluster)
        raise TopologyError(f"{where}: {end!r} is no device or switch; expected one of {known}")
    return found


def _parse_link(entry: object, i: int, ends: _Ends) -> list[Link]:
    where = f"links[{i}]"
    entry = _table(entry, where, _LINK_KEYS)
    cls = entry["class"]
    where = f"links[{i}] (class {cls!r})"
    if cls not in LINK_CLASSES:
        raise TopologyError(f"{where}.class: expected {_HELP['class']}, found {cls!r}")
    bandwidth = _quantity(entry["bandwidth"], "bytes/s", f"{where}.bandwidth")
    latency = _quantity(entry["latency"], "seconds", f"{where}.latency", allow_zero=True)
    scope = entry.get("scope", "node")
    if scope not in ("node", "cluster"):
        raise TopologyError(f"{where}.scope: expected 'node' or 'cluster', found {scope!r}")
    pairs = entry["connect"]
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise TopologyError(f"{where}.connect: expected {_HELP['connect']}, found {pairs!r}")
    out = []
    for node in range(ends.num_nodes) if scope == "node" else [0]:
        for a, b in pairs:
            ea = _expand(a, scope, node, ends, f"{where}.connect")
            eb = _expand(b, scope, node, ends, f"{where}.connect")
            if len(ea) > 1 and len(eb) > 1:
                if len(ea) != len(eb):
                    raise TopologyError(
                        f"{where}.connect: [{a!r}, {b!r}] pairs {len(ea)} ends with {len(eb)}; "
                        f"expected equal counts"
                    )
                joined = list(zip(ea, eb))
            else:
                joined = [(x, y) for x in ea for y in eb]
            for x, y in joined:
                if x == y:
                    raise TopologyError(f"{where}.connect: [{a!r}, {b!r}] joins {x} to itself")
                channel = _channel(x, y, cls, ends.per_node)
                out.append(Link(x, y, cls, bandwidth, latency, channel))
    return out


def _channel(a: str, b: str, link_class: str, per_node: int) -> str:
    """``node:N/<class>`` when the link touches node N only (a NIC counts), else ``cluster/...``."""

    def node(v: str) -> int | None:
        if v.startswith("node:"):
            return int(v[5:].split("/")[0])
        return int(v[7:]) // per_node if v.startswith("device:") else None

    owners = {n for n in (node(a), node(b)) if n is not None}
    return f"node:{owners.pop()}/{link_class}" if len(owners) == 1 else f"cluster/{link_class}"


# --- jax -----------------------------------------------------------------------------------------


def make_mesh(topology: Topology, devices: Sequence[Any] | None = None) -> Any:
    """A ``jax.sharding.Mesh`` of the topology's axes over attached devices, with Auto axes.

    Topology device ``i`` is the ``i``-th device sorted by (process index, id), so with one
    process per node the mesh's ``node`` rows are the processes. Extra devices are left out.

    Args:
      topology: the topology whose axes the mesh has.
      devices: the devices to use; default ``jax.devices()``.

    Raises:
      TopologyError: too few devices, or devices of another platform.
    """
    import jax
    from jax.sharding import AxisType, Mesh

    given = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    platforms = sorted({_jax_platform(d) for d in devices})
    attached = "/".join(platforms) or "no"
    verb = "were given" if given else "are attached"
    need = topology.num_devices
    if platforms != [topology.platform] or len(devices) < need:
        if platforms == [topology.platform]:
            fix = (
                "set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{need} before jax is imported"
                if topology.platform == "cpu"
                else f"run where {need} {topology.platform} devices are attached"
            )
        else:
            fix = (
                f"run on {topology.platform}s, or choose a topology for the attached devices, "
                f"e.g. 'cpu8'"
            )
        raise TopologyError(
            f"topology {topology.name!r} needs {need} {topology.platform} devices but "
            f"{len(devices)} {attached} devices {verb}; {fix}"
        )
    chosen = sorted(devices, key=lambda d: (d.process_index, d.id))[:need]
    grid = np.empty(need, dtype=object)
    for position, device_id in enumerate(topology.device_order):
        grid[position] = chosen[device_id]
    return Mesh(
        grid.reshape(topology.axis_sizes),
        topology.axis_names,
        axis_types=(AxisType.Auto,) * len(topology.axis_names),
    )


def _jax_platform(device: Any) -> str:
    platform = str(device.platform).lower()
    return "gpu" if platform in ("cuda", "rocm") else platform
