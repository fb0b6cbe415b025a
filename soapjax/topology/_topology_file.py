"""The topology file: a cluster as TOML, read into the fields of a
`soapjax.topology.cluster.Topology`.

A topology is one TOML file in ``soapjax/topology/meshes/`` (``load_topology("p100x16")``) or
anywhere else (``load_topology("path/to/mine.toml")``). Numbers are SI base units (bytes, bytes/s,
seconds, FLOP/s); a string with a unit is accepted too and is easier to check against a datasheet:
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
    # efficiency = { peak_flops = { float16 = 0.8 }, memory_bandwidth = 0.9 }   # optional

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
    # efficiency = 0.8                 # optional: the fraction of the line rate collectives
                                       # reach (NCCL's protocol overhead); default 1
    latency = "1.5 us"
    connect = [["host", "ib"]]         # "device:*" expands to every device of the node; two
                                       # starred ends pair up by index ("device:*", "nic:*")

The analytic cost model prices an operator at the datasheet peaks above, reached in full (a
roofline). Where kernels are known to reach less, the optional ``[device.efficiency]`` table
gives the measured fractions: ``peak_flops`` per dtype (what large matmuls reach of the peak,
from a GEMM benchmark; dtypes not listed: 1) and ``memory_bandwidth`` (what a streaming kernel
reaches, from a copy benchmark).

Measured collectives (written by ``soapjax calibrate --links``, `soapjax.measure.links`) replace the
link model for the collectives and mesh axes they name, for a buffer of ``nbytes`` (the
convention of `soapjax.base.collectives`): either ``points``, measured times joined by straight
lines (past the last point, the last line; below the first, the first line, or the first time where
that line would fall below zero), which is what calibrate writes, or hand-written ``segments``:
``latency + nbytes / bandwidth`` of the segment whose ``from`` is the largest not above
``nbytes``. ``[compute]`` says how many devices compute at once where they share
cores (virtual CPU devices): the simulator stretches every compute task by
``devices / concurrent_devices``, adds ``kernel_overhead`` per task, and adds to every step what
calling it costs: ``step_overhead`` per call plus ``output_overhead`` per array the step returns
(parameters, optimizer state, loss: their buffers are handed over and back on every device, and
the kernels that update them cost more in a call's top-level program than in the loop where
operators are timed).
``comm_overlap`` (0 to 1, default 1) is how much of a collective independent compute hides;
below 0.5 each device's collectives take its compute stream's time too (XLA:CPU's devices copy
and reduce on the cores that compute)::

    [compute]
    concurrent_devices = 2.0
    kernel_overhead = "20 us"
    step_overhead = "100 us"
    output_overhead = "8 us"
    comm_overlap = 0.0

    [[collectives]]
    kind = "all_reduce"
    axes = ["model"]
    segments = [{ from = "0 B", latency = "30 us", bandwidth = "1.5 GB/s" }]

    [[collectives]]
    kind = "all_gather"
    axes = ["model"]
    points = [{ size = "1 KB", time = "31 us" }, { size = "1 MB", time = "700 us" }]

With ``scope = "cluster"`` a link entry is not repeated: ``device:K`` is the global device K and
``node:N/host`` names a switch inside node N, so any explicit link graph can be written.

This module parses and validates one file (units, known keys, link ends, channels) and returns
the fields; `soapjax.topology.cluster.load_topology` finds the file by name and builds the
`Topology`.

One module past ~600 lines, on purpose: it is the file format, one key table and one
validator per section, each error naming the file and key; splitting it would split the format.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from soapjax.base.collectives import COLLECTIVES
from soapjax.base.errors import TopologyError

Platform = Literal["gpu", "cpu", "tpu"]
PLATFORMS: tuple[str, ...] = ("gpu", "cpu", "tpu")


class Capabilities(NamedTuple):
    """What a platform's XLA does that the simulator and the command line must know, asked of
    the topology (`Topology.capabilities`) instead of "is it the CPU?".

    Attributes:
      reduce_scatter: XLA turns the partitioner's all-reduce and slice into a reduce-scatter
        (XLA:GPU and TPU; XLA:CPU runs the all-reduce of the whole input).
      combines_all_reduces: XLA combines the optimizer's small per-parameter all-reduces (a
        global-norm clip's scalars) into one collective (XLA:GPU's and TPU's combiners).
      virtual_devices: the devices are virtual, as many as ``XLA_FLAGS=
        --xla_force_host_platform_device_count=N`` says (XLA:CPU).
      sinks_loop_all_reduces: XLA moves an all-reduce whose result a loop only accumulates
        out of the loop, once after it (XLA:GPU's ``WhileLoopAllReduceCodeMotion``, in its
        collective optimisations; reduce-scatters only under a flag that is off by default).
        XLA:CPU runs it every iteration (measured: docs/checks.md); TPU's pipeline is not
        public, so it is priced as the CPU's.
    """

    reduce_scatter: bool
    combines_all_reduces: bool
    virtual_devices: bool
    sinks_loop_all_reduces: bool = False


CAPABILITIES: dict[str, Capabilities] = {
    "gpu": Capabilities(reduce_scatter=True, combines_all_reduces=True, virtual_devices=False,
                        sinks_loop_all_reduces=True),
    "tpu": Capabilities(reduce_scatter=True, combines_all_reduces=True, virtual_devices=False),
    "cpu": Capabilities(reduce_scatter=False, combines_all_reduces=False, virtual_devices=True),
}
LINK_CLASSES: tuple[str, ...] = ("nvlink", "pcie", "infiniband", "ethernet", "shared_memory", "ici")
REQUIRED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
KNOWN_DTYPES = (*REQUIRED_DTYPES, "float64", "int8", "float8_e4m3fn", "float8_e5m2")

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
# Past these a figure is a typo (a device's memory of 1e308 GB): a exabyte of memory, an exabyte
# per second, a zettaFLOP/s, a day's latency.
_LARGEST = {"bytes": 1e18, "bytes/s": 1e18, "FLOP/s": 1e21, "seconds": 86400.0}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")


def _quantity(value: object, unit: str, where: str, *, allow_zero: bool = False) -> float:
    """A number in SI base units, or a string such as "100 Gb/s", as a float of `unit`."""
    units = _UNITS[unit]
    example = {"bytes/s": '"20 GB/s"', "bytes": '"16 GB"', "seconds": '"1.5 us"'}.get(
        unit, '"10.6 TFLOP/s"'
    )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        x = float(value)
    elif isinstance(value, str) and value.strip().startswith("-") \
            and (m := _QUANTITY.match(value.strip()[1:])) and m.group(2) in units:
        raise TopologyError(f"{where}: {value!r} is negative; expected a positive {unit}, e.g. "
                            f"{example}")
    elif isinstance(value, str) and (m := _QUANTITY.match(value)) and m.group(2) in units:
        x = float(m.group(1)) * units[m.group(2)]
    else:
        raise TopologyError(
            f"{where}: expected {unit} as a number or a string like {example} "
            f"(units: {', '.join(units)}), found {value!r}"
        )
    if not math.isfinite(x) or x > _LARGEST.get(unit, math.inf):
        raise TopologyError(f"{where}: {value!r} is too large for any device or link; expected "
                            f"a finite {unit} up to {_LARGEST.get(unit, math.inf):g}, e.g. "
                            f"{example}")
    if x < 0:
        raise TopologyError(f"{where}: {value!r} is negative; expected a positive {unit}, e.g. "
                            f"{example}")
    if x == 0 and not allow_zero:
        raise TopologyError(f"{where}: expected a positive {unit}, found {value!r} (zero)")
    return x



# --- records -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Measured fractions of a device's datasheet peaks that its kernels reach.

    The analytic cost model divides by them; the default, 1 everywhere, is the bare roofline.

    Attributes:
      peak_flops: ``(dtype name, fraction)`` pairs, sorted by name; dtypes not listed reach 1.
      memory_bandwidth: the fraction of the memory bandwidth reached.
    """

    peak_flops: tuple[tuple[str, float], ...] = ()
    memory_bandwidth: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", tuple(sorted(self.peak_flops)))
        for where, x in [*((f"peak_flops.{n}", f) for n, f in self.peak_flops),
                         ("memory_bandwidth", self.memory_bandwidth)]:
            if not (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1):
                raise TopologyError(f"[device.efficiency].{where}: expected a fraction of the "
                                    f"peak in (0, 1], found {x!r}")
        unknown = [n for n, _ in self.peak_flops if n not in KNOWN_DTYPES]
        if unknown:
            raise TopologyError(f"[device.efficiency].peak_flops: unknown dtype {unknown[0]!r}; "
                                f"expected some of {', '.join(KNOWN_DTYPES)}")

    def flops_fraction(self, dtype: Any) -> float:
        """The fraction of the peak FLOP/s of `dtype` (a name or a numpy/jax dtype) reached."""
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        return dict(self.peak_flops).get(name, 1.0)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """How a GPU runs an operator's kernels (`soapjax.cost.kernels`): the ``[device.kernels]``
    table.

    With it, the analytic cost model prices each shard as the kernels XLA:GPU runs for it
    (every matmul a GEMM of its own, the elementwise and reduction work between them fused
    into memory-bound kernels) instead of one roofline per operator.

    Attributes:
      gemm_efficiency: the fraction of the dtype's peak FLOP/s that a large GEMM's tiles reach
        (before tile and wave quantisation, which `soapjax.cost.kernels` applies per shape).
      memory_efficiency: the fraction of the memory bandwidth a fused elementwise or reduction
        kernel reaches (and a GEMM whose operands outweigh its arithmetic).
      launch: seconds each kernel costs beyond its work (launch and the gap between kernels).
      sms: streaming multiprocessors: how many output tiles run at once (one wave).
      tile: ``(rows, columns)`` of the output tile one SM computes at a time.
      float32_matmul: FLOP/s of a float32 matmul at XLA's default precision (TF32 tensor
        cores on Ampere and later); 0: the ``peak_flops`` float32 figure.
      attention_efficiency: the fraction of the peak a flash attention kernel's FLOPs reach
        (`soapjax.cost.kernels.FlashKernel`); 0: `gemm_efficiency`.
      cudnn_attention_efficiency: the same for cuDNN's fused attention kernel, which
        `soapjax.base.attention.flash_attention(..., implementation="cudnn")` runs where the
        sequence is whole; 0: `attention_efficiency`.
      source: where the figures come from (free text, shown in reports).
      overlap_slowdown: how much longer compute takes while a collective runs beside it
        (NCCL's kernels hold SMs): 0.2 runs it at 1 / 1.2 of its rate then
        (`soapjax.simulate._taskgraph`, contention); 0: no contention.
    """

    gemm_efficiency: float
    memory_efficiency: float
    launch: float
    sms: int
    tile: tuple[int, int] = (128, 128)
    float32_matmul: float = 0.0
    attention_efficiency: float = 0.0
    source: str = ""
    cudnn_attention_efficiency: float = 0.0
    overlap_slowdown: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tile", tuple(self.tile))
        x = self.overlap_slowdown
        if not (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 4):
            raise TopologyError(f"[device.kernels].overlap_slowdown: expected a number from 0 "
                                f"to 4 (0.2: compute beside a collective takes 1.2 times as "
                                f"long; 0: no contention), found {x!r}")
        for where, x, zero in (("attention_efficiency", self.attention_efficiency,
                                "gemm_efficiency"),
                               ("cudnn_attention_efficiency", self.cudnn_attention_efficiency,
                                "attention_efficiency")):
            if not (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1):
                raise TopologyError(f"[device.kernels].{where}: expected a fraction in [0, 1] "
                                    f"(0: {zero}), found {x!r}")
        for where, x in (("gemm_efficiency", self.gemm_efficiency),
                         ("memory_efficiency", self.memory_efficiency)):
            if not (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1):
                raise TopologyError(f"[device.kernels].{where}: expected a fraction in (0, 1], "
                                    f"found {x!r}")
        if not (isinstance(self.sms, int) and self.sms >= 1):
            raise TopologyError(f"[device.kernels].sms: expected a positive integer, found "
                                f"{self.sms!r}")
        if len(self.tile) != 2 or not all(isinstance(t, int) and t >= 1 for t in self.tile):
            raise TopologyError(f"[device.kernels].tile: expected [rows, columns], two positive "
                                f"integers, found {list(self.tile)!r}")
        if self.launch < 0 or self.float32_matmul < 0:
            raise TopologyError("[device.kernels]: expected launch >= 0 and float32_matmul >= 0")


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (all devices of a topology are alike).

    Attributes:
      kind: the device's model name, e.g. ``"H100 SXM5 80GB"``.
      peak_flops: ``(dtype name, FLOP/s)`` pairs, sorted by name; dense peak, no sparsity.
      memory_bandwidth: bytes/s of the device's own memory.
      memory_bytes: size of the device's own memory.
      efficiency: measured fractions of those peaks that kernels reach (default: all of them).
      kernels: the GPU kernel model's parameters (``[device.kernels]``), or None: one roofline
        per operator.
    """

    kind: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bandwidth: float
    memory_bytes: int
    efficiency: Efficiency = Efficiency()
    kernels: KernelSpec | None = None

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


@dataclasses.dataclass(frozen=True)
class CollectiveModel:
    """A measured collective over some mesh axes: piecewise ``latency + nbytes / bandwidth``.

    Attributes:
      kind: a `soapjax.base.collectives.COLLECTIVES` name (``"all_reduce"``, ...).
      axes: the mesh axes it runs over, in mesh order.
      segments: ``(from_bytes, latency_s, bandwidth)`` sorted by ``from_bytes``, the first at 0.
        A segment's time at its ``from`` is >= 0 and its bandwidth > 0 (``inf``: flat), so a
        segment between two measured points may have a negative latency (time growing faster
        than the size, past a cache).
      points: ``(nbytes, seconds)`` the segments join, where the model was made `through`
        measured points (what a topology file writes then); empty for hand-written segments.
    """

    kind: str
    axes: tuple[str, ...]
    segments: tuple[tuple[float, float, float], ...]
    points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        where = f"[[collectives]] {self.kind} over {list(self.axes)}"
        if self.kind not in COLLECTIVES:
            raise TopologyError(f"{where}: kind: expected one of {', '.join(COLLECTIVES)}")
        if not self.segments or self.segments[0][0] != 0:
            raise TopologyError(f"{where}: expected segments, the first from 0 bytes")
        if any(b[0] <= a[0] for a, b in zip(self.segments, self.segments[1:])):
            raise TopologyError(f"{where}: segments' `from` must increase")
        if any(not (bw > 0 and lat + start / bw >= 0) for start, lat, bw in self.segments):
            raise TopologyError(f"{where}: expected bandwidth > 0 and a time >= 0 where each "
                                f"segment starts (latency >= 0 for the first)")

    @classmethod
    def through(cls, kind: str, axes: Sequence[str], points: Sequence[tuple[float, float]]
                ) -> CollectiveModel:
        """The model joining measured ``(nbytes, seconds)`` points with straight lines.

        Between two points, the line through them; past the last one, the last line; below
        the first, the first line down to 0 bytes, or the first point's time where that line
        would cross zero. Collinear neighbours share one segment, so points on one line make
        one segment.

        >>> m = CollectiveModel.through("all_reduce", ("data",), [(1e3, 2e-5), (1e6, 1e-3)])
        >>> m.segments[0][0], round(m.time(5e5) * 1e6, 1), round(m.time(2e6) * 1e6, 1)
        (0.0, 509.5, 1981.0)
        """
        pts = tuple(sorted((float(s), float(t)) for s, t in points))
        where = f"[[collectives]] {kind} over {list(axes)}.points"
        if len(pts) < 2 or any(b[0] <= a[0] for a, b in itertools.pairwise(pts)):
            raise TopologyError(f"{where}: expected 2 or more distinct sizes, found "
                                f"{[s for s, _ in pts]}")
        if any(not (t > 0 and math.isfinite(t)) for _, t in pts) or pts[0][0] <= 0:
            raise TopologyError(f"{where}: expected positive sizes and times, found {pts}")
        if any(b[1] < a[1] for a, b in itertools.pairwise(pts)):
            raise TopologyError(f"{where}: expected times that do not fall as sizes grow, "
                                f"found {pts}")
        lines = []
        for (s0, t0), (s1, t1) in itertools.pairwise(pts):
            slope = (t1 - t0) / (s1 - s0)
            lines.append((s0, t0 - s0 * slope, 1.0 / slope if slope > 0 else math.inf))
        segs = [(0.0, pts[0][1], math.inf)] if lines[0][1] < 0 else []
        for start, lat, bw in lines:
            if segs and _same_line(segs[-1], (start, lat, bw)):
                continue
            segs.append((0.0 if not segs else start, lat, bw))
        return cls(kind, tuple(axes), tuple(segs), pts)

    def time(self, nbytes: float) -> float:
        """Seconds for a buffer of `nbytes` (0 bytes costs nothing)."""
        if nbytes <= 0:
            return 0.0
        seg = next(s for s in reversed(self.segments) if s[0] <= nbytes)
        return seg[1] + nbytes / seg[2]


def _same_line(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Whether two segments' lines agree (to 1e-9): then the second adds nothing."""
    inv_a, inv_b = 1.0 / a[2], 1.0 / b[2]
    return (math.isclose(a[1], b[1], rel_tol=1e-9, abs_tol=1e-15)
            and math.isclose(inv_a, inv_b, rel_tol=1e-9, abs_tol=1e-21))


@dataclasses.dataclass(frozen=True)
class ComputeSharing:
    """How the devices' compute shares the host (virtual CPU devices).

    Attributes:
      concurrent_devices: how many devices' kernels run at full speed at once; a compute task
        measured alone takes ``num_devices / concurrent_devices`` times as long in a step
        (never less than alone).
      kernel_overhead: seconds added to every compute task (dispatch of its kernels).
      step_overhead: seconds one call of a jitted step costs beyond its kernels and
        collectives (dispatch, argument handling).
      output_overhead: seconds per array a step returns, beyond what its kernels cost in a
        loop (a buffer handed over and back on every device, and the dispatch of the few
        kernels a step runs per array: `soapjax.measure.links.measure_call_overhead`).
      comm_overlap: how much of a collective's time independent compute hides, from 0 to 1
        (measured: 1 where links and kernels run on their own engines, as NCCL beside CUDA
        kernels; 0 where the same cores copy and compute, as XLA:CPU's devices). Below 0.5
        the simulator runs each device's collectives on its compute stream (`serial_comm`).
    """

    concurrent_devices: float
    kernel_overhead: float = 0.0
    step_overhead: float = 0.0
    output_overhead: float = 0.0
    comm_overlap: float = 1.0

    def __post_init__(self) -> None:
        if not self.concurrent_devices > 0 or not min(
                self.kernel_overhead, self.step_overhead, self.output_overhead) >= 0:
            raise TopologyError(
                f"[compute]: expected concurrent_devices > 0 and kernel_overhead, "
                f"step_overhead, output_overhead >= 0, found {self.concurrent_devices}, "
                f"{self.kernel_overhead}, {self.step_overhead} and {self.output_overhead}"
            )
        if not 0.0 <= self.comm_overlap <= 1.0:
            raise TopologyError(f"[compute].comm_overlap: expected a number from 0 to 1, found "
                                f"{self.comm_overlap}")

    @property
    def serial_comm(self) -> bool:
        """Whether collectives take the compute stream's time (`comm_overlap` below 0.5)."""
        return self.comm_overlap < 0.5

    def stretch(self, num_devices: int) -> float:
        """The factor a lone device's compute time is multiplied by when all of them run."""
        return max(1.0, num_devices / self.concurrent_devices)

    def call_time(self, outputs: int) -> float:
        """Seconds a step call costs beyond its tasks, for a step returning `outputs` arrays."""
        return self.step_overhead + self.output_overhead * max(0, outputs)


# --- parsing --------------------------------------------------------------------------------------


_TOP_KEYS = {
    "name": False,
    "platform": True,
    "description": False,
    "device": True,
    "nodes": True,
    "fabric": False,
    "mesh": True,
    "links": True,
    "compute": False,
    "collectives": False,
}
_COMPUTE_KEYS = {"concurrent_devices": True, "kernel_overhead": False,
                 "step_overhead": False, "output_overhead": False, "comm_overlap": False}
_COLLECTIVE_KEYS = {"kind": True, "axes": True, "segments": False, "points": False}
_SEGMENT_KEYS = {"from": True, "latency": True, "bandwidth": True}
_POINT_KEYS = {"size": True, "time": True}
_DEVICE_KEYS = {"kind": True, "peak_flops": True, "memory_bandwidth": True, "memory_bytes": True,
                "efficiency": False, "kernels": False}
_KERNEL_KEYS = {"gemm_efficiency": True, "memory_efficiency": True, "launch": True, "sms": True,
                "tile": False, "float32_matmul": False, "attention_efficiency": False,
                "cudnn_attention_efficiency": False, "source": False,
                "overlap_slowdown": False}
_EFFICIENCY_KEYS = {"peak_flops": False, "memory_bandwidth": False}
_NODES_KEYS = {"count": True, "devices_per_node": True, "switches": False}
_FABRIC_KEYS = {"switches": False}
_MESH_KEYS = {"axes": True, "device_order": False}
_LINK_KEYS = {"class": True, "bandwidth": True, "latency": True, "connect": True, "scope": False,
              "efficiency": False}
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
    "concurrent_devices": "how many devices compute at once, e.g. 2.0",
    "segments": '[{ from = "0 B", latency = "30 us", bandwidth = "1.5 GB/s" }, ...]',
    "points": '[{ size = "1 KB", time = "31 us" }, { size = "1 MB", time = "700 us" }, ...]',
    "size": 'bytes of the buffer, a number or a string like "64 KB"',
    "time": 'seconds, a number or a string like "31 us"',
    "from": 'the smallest buffer the segment prices, e.g. "1 MB"',
    "gemm_efficiency": "the fraction of the peak a large GEMM reaches, e.g. 0.8",
    "memory_efficiency": "the fraction of the memory bandwidth a streaming kernel reaches",
    "launch": 'seconds per kernel, a number or a string like "3 us"',
    "sms": "the GPU's streaming multiprocessors, e.g. 108 on an A100",
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


def parse(data: dict[str, Any], *, default_name: str, source: str) -> dict[str, Any]:
    """The `Topology` fields a parsed TOML file declares (checked key by key)."""
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
    return {
        "name": name,
        "platform": data["platform"],
        "device": device,
        "num_devices": num_nodes * per_node,
        "axis_names": tuple(axes),
        "axis_sizes": sizes,
        "device_order": tuple(order),
        "num_nodes": num_nodes,
        "devices_per_node": per_node,
        "switches": (*(f"node:{n}/{s}" for n in range(num_nodes) for s in local_sw), *global_sw),
        "links": tuple(parsed),
        "description": str(data.get("description", "")),
        "source_file": source,
        "compute": _parse_compute(data["compute"]) if "compute" in data else None,
        "collective_models": _parse_collectives(data.get("collectives", []), tuple(axes)),
    }


def _parse_compute(table: object) -> ComputeSharing:
    c = _table(table, "[compute]", _COMPUTE_KEYS)
    n = c["concurrent_devices"]
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        raise TopologyError(f"[compute].concurrent_devices: expected a number, found {n!r}")
    seconds = {k: _quantity(c.get(k, 0.0), "seconds", f"[compute].{k}", allow_zero=True)
               for k in ("kernel_overhead", "step_overhead", "output_overhead")}
    overlap = c.get("comm_overlap", 1.0)
    if not isinstance(overlap, (int, float)) or isinstance(overlap, bool):
        raise TopologyError(f"[compute].comm_overlap: expected a number from 0 to 1, found "
                            f"{overlap!r}")
    return ComputeSharing(float(n), **seconds, comm_overlap=float(overlap))


def _parse_collectives(entries: object, axis_names: tuple[str, ...]
                       ) -> tuple[CollectiveModel, ...]:
    if not isinstance(entries, list):
        raise TopologyError("collectives: expected [[collectives]] tables")
    out, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"[[collectives]] {i}"
        e = _table(entry, where, _COLLECTIVE_KEYS)
        axes = e["axes"]
        if (not isinstance(axes, list) or not axes
                or not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes)
                or any(a not in axis_names for a in axes)):
            raise TopologyError(f"{where}.axes: expected distinct mesh axes among "
                                f"{list(axis_names)}, found {axes!r}")
        kind, mesh_axes = str(e["kind"]), tuple(a for a in axis_names if a in axes)
        if ("segments" in e) == ("points" in e):
            raise TopologyError(f"{where}: expected one of segments ({_HELP['segments']}) or "
                                f"points ({_HELP['points']})")
        key = "segments" if "segments" in e else "points"
        listed = e[key]
        if not isinstance(listed, list) or not listed:
            raise TopologyError(f"{where}.{key}: expected a list, e.g. {_HELP[key]}")
        if key == "points":
            pts = []
            for j, point in enumerate(listed):
                pw = f"{where}.points[{j}]"
                t = _table(point, pw, _POINT_KEYS)
                pts.append((_quantity(t["size"], "bytes", f"{pw}.size"),
                            _quantity(t["time"], "seconds", f"{pw}.time")))
            model = CollectiveModel.through(kind, mesh_axes, pts)
        else:
            segs = []
            for j, seg in enumerate(listed):
                sw = f"{where}.segments[{j}]"
                t = _table(seg, sw, _SEGMENT_KEYS)
                segs.append((_quantity(t["from"], "bytes", f"{sw}.from", allow_zero=True),
                             _quantity(t["latency"], "seconds", f"{sw}.latency",
                                       allow_zero=True),
                             _quantity(t["bandwidth"], "bytes/s", f"{sw}.bandwidth")))
            model = CollectiveModel(kind, mesh_axes, tuple(segs))
        if (model.kind, model.axes) in seen:
            raise TopologyError(f"{where}: {model.kind} over {axes} is given twice")
        seen.add((model.kind, model.axes))
        out.append(model)
    return tuple(out)


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
        efficiency=_parse_efficiency(dev.get("efficiency", {})),
        kernels=_parse_kernels(dev["kernels"]) if "kernels" in dev else None,
    )


def _parse_kernels(table: object) -> KernelSpec:
    k = _table(table, "[device.kernels]", _KERNEL_KEYS)
    tile = k.get("tile", [128, 128])
    if not isinstance(tile, list) or len(tile) != 2 or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tile):
        raise TopologyError(f"[device.kernels].tile: expected [rows, columns], two positive "
                            f"integers, found {tile!r}")
    sms = k["sms"]
    if not isinstance(sms, int) or isinstance(sms, bool) or sms < 1:
        raise TopologyError(f"[device.kernels].sms: expected a positive integer, found {sms!r}")
    return KernelSpec(
        gemm_efficiency=k["gemm_efficiency"], memory_efficiency=k["memory_efficiency"],
        launch=_quantity(k["launch"], "seconds", "[device.kernels].launch", allow_zero=True),
        sms=k["sms"], tile=tuple(k.get("tile", (128, 128))),
        float32_matmul=(_quantity(k["float32_matmul"], "FLOP/s", "[device.kernels]."
                                  "float32_matmul") if "float32_matmul" in k else 0.0),
        attention_efficiency=k.get("attention_efficiency", 0.0),
        cudnn_attention_efficiency=k.get("cudnn_attention_efficiency", 0.0),
        overlap_slowdown=k.get("overlap_slowdown", 0.0),
        source=str(k.get("source", "")))


def _parse_efficiency(table: object) -> Efficiency:
    eff = _table(table, "[device.efficiency]", _EFFICIENCY_KEYS)
    flops = eff.get("peak_flops", {})
    if not isinstance(flops, dict):
        raise TopologyError(f"[device.efficiency].peak_flops: expected a table of dtype = "
                            f"fraction, found {flops!r}")
    return Efficiency(tuple(flops.items()), eff.get("memory_bandwidth", 1.0))


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
    efficiency = entry.get("efficiency", 1.0)
    if not (isinstance(efficiency, (int, float)) and not isinstance(efficiency, bool)
            and 0 < efficiency <= 1):
        raise TopologyError(f"{where}.efficiency: expected the fraction of the line rate "
                            f"collectives reach, in (0, 1], found {efficiency!r}")
    bandwidth *= efficiency  # what the collectives see of the line rate
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
