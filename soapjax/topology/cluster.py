"""Topology: the devices, links and named mesh axes of a cluster, and what communication costs.

A topology is one TOML file in ``soapjax/topology/meshes/`` (``load_topology("p100x16")``) or
anywhere else (``load_topology("path/to/mine.toml")``); the file format, with an example, is
documented in `soapjax.topology._topology_file`. ``load_topology("p100x16-4")`` is the first 4
devices of ``p100x16`` (`scaled_topology`).

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

One module past ~600 lines, on purpose: `Topology` is one record whose collective costs, ring
statistics, channel lists, cuts (`scaled_topology`) and summary all read the same routes; the
file format and the routing engine already live apart (`_topology_file`, `_routing`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import math
import tomllib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from soapjax.base.collectives import (
    ALGORITHMS as ALGORITHMS,
    COLLECTIVES as COLLECTIVES,
    FORMULAS,
    bytes_sent as bytes_sent,
    hierarchical_time,
    kind_name,
    ring_time,
    tree_time,
)
from soapjax.base.errors import TopologyError
from soapjax.topology import _topology_file
from soapjax.topology._routing import Hop, RingStats as RingStats, Routes
from soapjax.topology._topology_file import (
    CAPABILITIES as CAPABILITIES,
    KNOWN_DTYPES as KNOWN_DTYPES,
    LINK_CLASSES as LINK_CLASSES,
    PLATFORMS as PLATFORMS,
    REQUIRED_DTYPES as REQUIRED_DTYPES,
    Capabilities as Capabilities,
    CollectiveModel as CollectiveModel,
    ComputeSharing as ComputeSharing,
    DeviceSpec as DeviceSpec,
    Efficiency as Efficiency,
    KernelSpec as KernelSpec,
    Link as Link,
    Platform as Platform,
)

__all__ = ["ALGORITHMS", "CAPABILITIES", "COLLECTIVES", "Capabilities", "Channel",
           "CollectiveModel", "ComputeSharing", "DeviceSpec", "Efficiency", "KNOWN_DTYPES",
           "KernelSpec", "LINK_CLASSES", "Link", "MESHES_DIR", "PLATFORMS", "Platform",
           "REQUIRED_DTYPES", "RingStats", "Topology", "bytes_sent", "list_topologies",
           "load_topology", "make_mesh", "scaled_topology", "stage_topology"]

# The shipped topologies: package data beside this module, in a checkout and installed alike
# (`importlib.resources`; a wheel installs them unzipped).
MESHES_DIR = Path(str(importlib.resources.files(__package__).joinpath("meshes")))


class Channel(NamedTuple):
    """A group of links the simulator treats as one communication device (see module doc)."""

    id: str  # "node:3/infiniband", "cluster/infiniband"
    link_class: str
    node: int | None  # None for cluster-wide channels


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
      compute: how the devices share the host's cores (``[compute]``; None: they do not).
      collective_models: measured collectives (``[[collectives]]``, `soapjax.measure.links`), which
        price the collectives and axes they name instead of the link model.
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
    compute: ComputeSharing | None = None
    collective_models: tuple[CollectiveModel, ...] = ()
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
        self._routes().check_connected()

    # --- structure -------------------------------------------------------------------------------

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The device ids of each node."""
        k = self.devices_per_node
        return tuple(tuple(range(i * k, (i + 1) * k)) for i in range(self.num_nodes))

    @property
    def capabilities(self) -> Capabilities:
        """What its platform's XLA does that pricing and the command line must know
        (`CAPABILITIES`)."""
        return CAPABILITIES[self.platform]

    @property
    def mesh_shape(self) -> dict[str, int]:
        """``{axis name: size}`` in mesh order, like ``jax.sharding.Mesh.shape``."""
        return dict(zip(self.axis_names, self.axis_sizes))

    def node_of(self, device: int) -> int:
        """The node that holds a device id."""
        return device // self.devices_per_node

    def intra_node_axes(self) -> tuple[str, ...]:
        """The mesh axes whose device groups stay inside one node (they see the node's links,
        NVLink, not the network), in mesh order; worked out once per topology."""
        return self._cached(("intra_node_axes",), lambda: tuple(
            a for a in self.axis_names
            if all(len({self.node_of(d) for d in g}) == 1 for g in self.groups((a,)))))

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
        return self._cached(("ring", axes), lambda: self._routes().rings_stats(self.groups(axes)))

    def hierarchy_stats(self, axes: Sequence[str]) -> tuple[RingStats, RingStats] | None:
        """(in-node rings, cross-node rings) of the hierarchical algorithm over ``axes``.

        None when a group does not hold the same number of devices in each of its nodes.
        On a group inside one node the cross-node stats have size 1, and vice versa.
        """
        axes = self._normalise_axes(axes)
        return self._cached(("hier", axes), lambda: self._hierarchy(self.groups(axes)))

    def collective_time(
        self,
        kind: str,
        nbytes: float,
        axes: Sequence[str],
        algorithm: str = "auto",
        *,
        group_size: int | None = None,
    ) -> float:
        """Seconds a collective over mesh ``axes`` takes, with every group running at once.

        The ring formulas are the table of `soapjax.base.collectives` with ``n`` devices per group,
        at ring bandwidth ``b`` and latency ``a`` (:meth:`axis_bandwidth`, :meth:`axis_latency`),
        except that all_to_all runs at ``b_a2a = (n-1) / max over links (flows/bandwidth)`` with
        every device sending to every other at once (on a switch it equals ``b``; it is larger
        where direct links add up) and ``a_a2a``, the slowest pair's latency, and
        point_to_point at ``b_solo``, ``b`` with nothing else on the links. Hierarchical: in-node
        rings of ``m`` devices, then cross-node rings of ``k`` nodes
        (`soapjax.base.collectives.hierarchical_time`).

        Args:
          kind: one of :data:`COLLECTIVES` (HLO spellings like ``"all-reduce"`` work too).
          nbytes: bytes per device, in the table's convention.
          axes: mesh axis names; ``()`` costs nothing.
          algorithm: ``"ring"``, ``"hierarchical"`` (all_reduce, all_gather, reduce_scatter),
            ``"tree"`` (all_reduce: NCCL's tree, `soapjax.base.collectives.tree_time`) or
            ``"auto"``, the cheapest of them.
          group_size: devices per group where a group spans only part of `axes` (XLA gathering
            over two of an axis's four devices): the ring formulas for that many devices, at
            the bandwidth and latency a ring over the whole of `axes` sees.

        Raises:
          TopologyError: unknown kind, algorithm or axis; hierarchical asked where it cannot run.
        """
        kind = kind_name(kind)
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
        if algorithm != "hierarchical" and (
            measured := self._measured(kind, axes, ring.size if group_size is None else group_size)
        ):
            return measured.time(nbytes)
        if group_size is not None and group_size != ring.size:
            if not 1 <= group_size < ring.size or algorithm in ("hierarchical", "tree"):
                raise TopologyError(
                    f"group_size {group_size} over axes {tuple(axes)}: expected 1 .. "
                    f"{ring.size} with the ring algorithm"
                )
            return self._ring_time(kind, nbytes, axes, ring, group_size)
        flat = self._ring_time(kind, nbytes, axes, ring, ring.size)
        if algorithm == "tree" and kind != "all_reduce":
            raise TopologyError(f"algorithm 'tree' is defined for all_reduce, not {kind}; use "
                                "'ring', 'hierarchical' or 'auto'")
        if algorithm == "ring" or not FORMULAS[kind].hierarchical:
            if algorithm == "hierarchical":
                raise TopologyError(
                    f"algorithm 'hierarchical' is defined for all_reduce, all_gather and "
                    f"reduce_scatter, not {kind}; use 'ring' or 'auto'"
                )
            return flat
        hier = self.hierarchy_stats(axes)
        if hier is None:
            if algorithm in ("hierarchical", "tree"):
                raise TopologyError(
                    f"axes {tuple(axes)} of topology {self.name!r}: the {algorithm} algorithm "
                    f"needs the same number of devices of a group in each node"
                )
            return flat
        local, cross = hier
        tiered = hierarchical_time(kind, nbytes, local[:3], cross[:3])
        tree = tree_time(kind, nbytes, local[:3], cross[:3]) if kind == "all_reduce" else math.inf
        return {"hierarchical": tiered, "tree": tree}.get(algorithm, min(flat, tiered, tree))

    def _measured(self, kind: str, axes: Sequence[str], group_size: int) -> CollectiveModel | None:
        """The measured model of `kind` over `axes` (over an axis of `group_size` devices
        where a group spans part of `axes`); point_to_point reads collective_permute's.

        Where the platform's XLA makes no reduce-scatters (`Capabilities.reduce_scatter`: the
        CPU), a reduce_scatter reads all_reduce's model: XLA:CPU has no pass that turns the SPMD
        partitioner's all-reduce + slice into a reduce-scatter (XLA:GPU has),
        so the compiled step runs an all-reduce of the whole input (`soapjax check` counts
        them: GPT-2 tiny under FSDP on cpu8, 36 all-reduces and no reduce-scatter).
        """
        if not self.collective_models:
            return None
        kind = "collective_permute" if kind == "point_to_point" else kind
        if kind == "reduce_scatter" and not self.capabilities.reduce_scatter:
            kind = "all_reduce"
        axes = self._normalise_axes(axes)
        by_key = {(m.kind, m.axes): m for m in self.collective_models}
        if group_size == math.prod(self.mesh_shape[a] for a in axes):
            return by_key.get((kind, axes))
        return next((m for (k, a), m in by_key.items() if k == kind and len(a) == 1
                     and self.mesh_shape[a[0]] == group_size), None)

    def links_used(self, axes: Sequence[str]) -> tuple[int, ...]:
        """Indices into :attr:`links` of every link a collective over ``axes`` may cross."""
        return tuple(sorted({link for link, _ in self._all_pairs(axes)[0]}))

    def channels_used(self, axes: Sequence[str]) -> tuple[Channel, ...]:
        """The channels (simulator resources) a collective over ``axes`` occupies, sorted by id."""
        return self._cached(("channels", tuple(axes)), lambda: tuple(sorted(
            {self.channel(self.links[i].channel) for i in self.links_used(axes)})))

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
            if f.name not in skip and (v := getattr(self, f.name)) is not None and v != ()
        }
        if self.collective_models:
            content["collective_models"] = [dataclasses.astuple(m) for m in self.collective_models]
        content["links"] = [dataclasses.astuple(link) for link in self.links]
        if content["device"].get("efficiency") == dataclasses.asdict(Efficiency()):
            del content["device"]["efficiency"]  # no measured efficiencies: the old fingerprint
        if content["device"].get("kernels", 0) is None:
            del content["device"]["kernels"]  # no kernel model: the old fingerprint
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

    def _routes(self) -> Routes:
        return self._cached(("routes",), lambda: Routes(
            self.num_devices, self.switches, self.links, self.devices_per_node))

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
        return self._routes().rings_stats(local), self._routes().rings_stats(cross)

    def _all_pairs(self, axes: Sequence[str]) -> tuple[Counter[Hop], float]:
        """Flows per link direction when every device of every group sends to every other."""
        axes = self._normalise_axes(axes)
        return self._cached(("pairs", axes), lambda: self._routes().all_pairs(self.groups(axes)))

    def _ring_time(self, kind: str, s: float, axes: Sequence[str], r: RingStats, n: int) -> float:
        """The table's ring formula for `n` devices at what a ring over `axes` sees."""
        if kind == "all_to_all":
            load, latency = self._all_pairs(axes)
            return ring_time(kind, s, n, self._routes().all_to_all_bandwidth(load, r.size), latency)
        bandwidth = r.solo_bandwidth if kind == "point_to_point" else r.bandwidth
        return ring_time(kind, s, n, bandwidth, r.latency)


# --- loading -------------------------------------------------------------------------------------


def is_shipped(topology: Topology) -> bool:
    """Whether `topology` is one of soapjax's (a file of ``soapjax/topology/meshes/``, or one cut
    from it), so `load_topology` finds it by name; else it was read from a file of the user's."""
    if topology.source_file is None:
        return True
    folder = Path(topology.source_file).resolve().parent
    return folder == MESHES_DIR.resolve()


def list_topologies() -> tuple[str, ...]:
    """The names of the shipped topologies (the ``*.toml`` files in ``soapjax/topology/meshes/``),
    sorted."""
    names = {p.stem for p in MESHES_DIR.glob("*.toml")}
    return tuple(sorted(names))


def load_topology(name_or_path: str | Path) -> Topology:
    """Reads a topology by shipped name (``"p100x16"``) or from a TOML file path.

    A shipped name with ``-N`` after it is that cluster cut to its first N devices
    (`scaled_topology`): ``"p100x16-4"`` is one node of four P100s, mesh ``gpu=4``.

    >>> load_topology("k80x64-8").mesh_shape
    {'node': 2, 'gpu': 4}

    Raises:
      TopologyError: no such topology, a cut the cluster cannot make, or a malformed file (the
        message names the file, the key and what was expected).
    """
    if not str(name_or_path).strip():
        raise TopologyError(f"expected a topology name (one of {', '.join(list_topologies())}) "
                            f"or a path to a .toml file, got {str(name_or_path)!r}")
    path = Path(name_or_path)
    if path.suffix != ".toml" and len(path.parts) == 1 and not path.is_file():
        candidates = [MESHES_DIR / f"{name_or_path}.toml"]
        found = [c for c in candidates if c.is_file()]
        base, _, count = str(name_or_path).rpartition("-")
        if not found and base in list_topologies() and count.isdigit():
            return scaled_topology(base, int(count))
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
    except IsADirectoryError:
        raise TopologyError(f"{path}: a directory; expected a topology .toml file, e.g. "
                            f"{path / 'cluster.toml'}") from None
    except OSError as e:
        raise TopologyError(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:  # tomllib decodes the bytes as UTF-8 first
        raise TopologyError(f"{path}: byte {e.start} is not UTF-8 text; expected a UTF-8 TOML "
                            "file (save it as UTF-8, or remove the byte)") from None
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"{path}: not valid TOML: {e}") from None
    try:
        return Topology(**_topology_file.parse(data, default_name=path.stem, source=str(path)))
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
        keep = size if left % size == 0 else left if left < size else 0
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
        compute=topo.compute,  # measured collectives priced groups of the whole mesh: dropped
    )


# --- jax -----------------------------------------------------------------------------------------


def make_mesh(topology: Topology, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``jax.sharding.Mesh`` of the topology's axes over attached devices, with Auto axes.

    Topology device ``i`` is the ``i``-th device sorted by (process index, id), so with one
    process per node the mesh's ``node`` rows are the processes. Extra devices are left out.

    Args:
      topology: the topology whose axes the mesh has.
      devices: the devices to use; default ``jax.devices()``.

    Raises:
      TopologyError: too few devices, or devices of another platform.
    """
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
                if topology.capabilities.virtual_devices
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


def stage_topology(topology: Topology, stages: int) -> Topology:
    """The devices of one of `stages` pipeline stages (`soapjax.strategy.pipeline`): the outermost
    mesh axis cut `stages` ways (`scaled_topology` to ``N / stages`` devices): stages are groups of
    whole nodes, and the links between stages are the links between nodes.

    Raises:
      TopologyError: the outermost axis does not divide into `stages` parts.
    """
    axis, size = topology.axis_names[0], topology.axis_sizes[0]
    if stages < 1 or size % stages:
        raise TopologyError(f"{stages} pipeline stages split the outermost mesh axis {axis!r} "
                            f"(size {size}) of {topology.name!r}; choose a divisor of {size}")
    if stages == 1:
        return topology
    # kept on the topology: the stage topology's routes and channels are worked out once
    return topology._cached(("stage_topology", stages),
                            lambda: scaled_topology(topology, topology.num_devices // stages))
