"""Operator times: measured with XLA on the local backend, or a roofline from the device specs.

The simulator needs, for every operator and config, the time of the operator's forward and
backward task on one device (the paper's assumption A1: predictable, independent of the
values). A config fixes a degree per iteration dim, hence the shard shapes each device
computes on; `soapjax.graph._local.operator_fn` gives that per-device program, which is what runs
here:

* **measured** (the local backend is the topology's,
  `soapjax.measure.devices.local_backend_matches`: e.g. topology ``cpu8`` on this CPU): the shard
  program is compiled for ONE device and timed, the forward and the backward (the VJP w.r.t. its
  float activation and parameter operands, from saved residuals) separately, with many repetitions
  inside one compiled loop so the dispatch overhead cancels (see `soapjax.measure._timing`). With
  ``--xla_force_host_platform_device_count=8`` the 8 virtual CPU devices share the host's
  cores, so the one-device time is what a real machine with one such device per slot would
  take, not what a sharded run on the virtual devices shows.
* **analytic** (the target devices are not attached: planning for 64 K80s from a laptop): the
  roofline of the topology's device specs, `soapjax.cost.roofline`.
* **scaled**: a shard program that cannot be built or compiled for a split config falls back
  to the measured unsplit time divided by the number of shards.

The optimizer's update of a parameter shard is priced the same two ways (`CostModel.update_time`:
measured at power-of-two sizes, or ``passes * bytes / bandwidth`` with the passes read from the
optimizer, `soapjax.cost.updates`).

Every `OpTime` says which of the three it is, and measured times are cached on disk, keyed by
backend, device kind, jax/jaxlib versions and the shard program's signature (the pretty-printed
jaxpr, which names variables canonically), so operators with the same shard program share one
measurement: GPT-2's 12 blocks cost one block's measurements.

Example::

    g = trace(loss_fn, params, batch)
    costs = cost_model(g, load_topology("cpu8"))         # measured on this CPU
    costs.op_time(3, Config((("data",), (), ())))
    # OpTime(forward_s=0.00042, backward_s=0.00088, source='measured')   (for example)
    cost_model(g, load_topology("dgx-h100x8")).source   # 'analytic' on a machine without H100s

The names this module used to hold are re-exported from their modules: the roofline
(`soapjax.cost.roofline`), the step's FLOPs (`soapjax.cost.flops`), the optimizer's update
(`soapjax.cost.updates`), the local devices (`soapjax.measure.devices`) and `CostError`
(`soapjax.base.errors`). So are the timing options (`TimingOptions`) and the cache root
(`cache_root`, `CACHE_ENV`: `soapjax.base._cache`), for the scripts that move the caches; the
timing loop itself (`time_loop`, `kick`, `quiet_gc`) is `soapjax.measure`'s.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

from soapjax.base._cache import ENV as CACHE_ENV, cache_root as cache_root
from soapjax.base._dtypes import itemsize
from soapjax.base.errors import CostError as CostError
from soapjax.cost.flops import (
    FlopCounter as FlopCounter,
    StepFlops as StepFlops,
    step_flops as step_flops,
)
from soapjax.cost.kernels import FusedKernel, Kernels, fused_time, kernel_op_time, shard_kernels
from soapjax.cost.roofline import (
    ANALYTIC_KERNEL_OVERHEAD_S as ANALYTIC_KERNEL_OVERHEAD_S,
    OpTime as OpTime,
    analytic_op_time as analytic_op_time,
    backward_share,
    compute_dtype as compute_dtype,
    roofline_time as roofline_time,
)
from soapjax.cost.updates import (
    update_passes,
    update_reductions as update_reductions,
    update_whole_dims,
)
from soapjax.graph._cotangents import differentiated_operands, has_backward
from soapjax.graph._cuts import computed_degrees
from soapjax.graph._local import operator_fn
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.measure import _timing
from soapjax.measure._timing import (
    DiskCache,
    Timing as Timing,
    TimingOptions,
    default_cache_dir,
)
from soapjax.measure.devices import (
    local_backend_matches as local_backend_matches,
    local_topology as local_topology,
)
from soapjax.strategy.memory import microbatch_degrees
from soapjax.strategy.space import Config, MeshShape, SpaceLimits, configs
from soapjax.topology.cluster import Topology

__all__ = ["ANALYTIC_KERNEL_OVERHEAD_S", "CACHE_ENV", "Calibration", "CostError", "CostModel",
           "CostStats", "FlopCounter", "OpTime", "ProfileProgress", "ProfileReport", "StepFlops",
           "Timing", "TimingOptions", "analytic_op_time", "cache_root", "calibrate",
           "compute_dtype", "cost_model", "default_cache_dir", "local_backend_matches",
           "local_topology", "roofline_time", "step_flops", "update_reductions"]

log = logging.getLogger(__name__)

Mode = Literal["auto", "measured", "analytic"]

# Optimizer updates are measured at sizes 2**k bytes and interpolated in between.
_MIN_UPDATE_BUCKET = 2**12


class CostStats(NamedTuple):
    """What a `CostModel` has done so far.

    Attributes:
      measured: shard programs timed in this process (each a forward and a backward).
      disk_hits: shard programs read from the on-disk cache instead.
      shared: (operator, degrees) pairs that reused another operator's measurement of the same
        signature in this process.
      fallbacks: pairs that fell back to ``scaled`` or ``analytic`` (no shard program could
        be built or timed).
      updates_measured: optimizer-update sizes timed.
      estimated: pairs left unmeasured when the measuring deadline passed, priced
        ``estimated`` (`CostModel.measure_until`).
    """

    measured: int
    disk_hits: int
    shared: int
    fallbacks: int
    updates_measured: int
    estimated: int = 0


class ProfileProgress(NamedTuple):
    """Progress of `CostModel.profile`, passed to its `progress` callback."""

    done: int
    total: int
    distinct: int
    measured: int
    elapsed_s: float


class ProfileReport(NamedTuple):
    """What filling the cache for every config of every operator took.

    Attributes:
      pairs: (operator, config) pairs in the search space.
      shard_programs: distinct (operator, degrees) pairs among them.
      distinct: distinct shard-program signatures (what had to be measured at most).
      measured: signatures measured in this run (the rest came from the cache).
      fallbacks: pairs priced ``scaled`` or ``analytic`` instead.
      seconds: wall time of the whole run.
    """

    pairs: int
    shard_programs: int
    distinct: int
    measured: int
    fallbacks: int
    seconds: float


_DEFERRED = OpTime(math.nan, math.nan, "deferred")  # `CostModel._measured`: past the deadline


def _first_line(e: BaseException, limit: int = 160) -> str:
    """An exception's first line, cut to `limit` characters: a lowering error carries ~2 KB
    of MLIR locations that would drown the progress output."""
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


# --- the cost model ------------------------------------------------------------------------------


class CostModel:
    """Operator and optimizer-update times for one graph on one topology.

    Built by `cost_model`. `op_time` is memoised per (operator, config): after the first call
    it is one dictionary lookup, so the search can call it millions of times.

    Attributes:
      graph: the operator graph.
      topology: the target cluster.
      mesh: the mesh whose axes configs name (the topology's, unless given).
      source: ``"measured"`` or ``"analytic"``: how times are obtained.
      update_reductions: values the optimizer's update reduces each parameter to
        (`update_reductions`: 1 under a global-norm clip, 0 for plain Adam).
      update_whole: parameter path -> the dims its update contracts, for the parameters
        whose update does (Muon: `soapjax.cost.updates.update_whole_dims`).
      update_reads: the paths of those whose update reads the parameter too (weight decay).
    """

    def __init__(self, graph: OpGraph, topology: Topology, *, source: str, mesh: MeshShape,
                 cache: DiskCache, options: TimingOptions, optimizer: Any = None):
        self.graph = graph
        self.topology = topology
        self.mesh = mesh
        self.source = source
        self._cache = cache
        self._options = options
        self._optimizer = optimizer
        self._memo: list[dict[tuple[tuple[str, ...], ...], OpTime]] = [
            {} for _ in graph.operators]
        self._by_degrees: dict[tuple[int, tuple[int, ...]], OpTime] = {}
        self._by_sig: dict[str, OpTime] = {}
        self._sig_of: dict[tuple[int, tuple[int, ...]], str | None] = {}
        self._unbuilt: set[int] = set()  # operators one of whose shard programs failed to build
        self._updates: dict[int, float] = {}  # measured, per power-of-two size
        self._update_memo: dict[float, float] = {}
        self._counts = dict(measured=0, disk_hits=0, shared=0, fallbacks=0, updates_measured=0,
                            estimated=0)
        self._deadline: float | None = None
        self._longest_s = 0.0  # the longest a measurement has taken (`_time_left`)
        self._progress: Callable[[str], None] | None = None
        self._ratios: dict[int, list[float]] = {}  # operator -> measured / analytic, per pair
        self._passes = update_passes(optimizer)
        self.update_reductions = update_reductions(optimizer)
        dims = update_whole_dims(optimizer, graph.abstract_params())
        self.update_whole = {leaf.path: d for leaf, d in zip(graph.params, dims.whole) if d}
        self.update_reads = {leaf.path for leaf, d, r in zip(graph.params, dims.whole,
                                                               dims.reads_params) if d and r}
        self._update_flops = {leaf.path: (f, leaf.dtype)
                              for leaf, f in zip(graph.params, dims.flops) if f}
        self._dtypes: dict[int, str] = {}
        self._kernels: dict[Any, Kernels] = {}

    def __repr__(self) -> str:
        return (f"CostModel({self.graph.name!r} on {self.topology.name!r}, source={self.source!r}, "
                f"{len(self._by_degrees)} shard programs priced)")

    @property
    def stats(self) -> CostStats:
        return CostStats(**self._counts)

    def measure_until(self, deadline: float | None,
                      progress: Callable[[str], None] | None = None) -> None:
        """Measures shard programs only until `deadline` (a `time.perf_counter()` reading;
        None: always, the default).

        A shard program neither in memory nor in the on-disk cache when the deadline has
        passed, or is nearer than the longest a measurement has taken so far (the next one
        would likely run past it), is not timed: it is priced ``"estimated"``, the roofline
        scaled by the median ratio measured/roofline of the same operator's measured shard
        programs (of every operator's, for one with none; the plain roofline before anything
        is measured). An optimizer update of a size not yet timed is then priced from the
        nearest size timed, in proportion to its bytes (the analytic update before any is).
        This is how `soapjax.search.find.find_plan` keeps its budget with measured costs: one
        shard program takes 0.3-2 s to compile and time on a CPU, and a search visits
        hundreds. `progress` is told of each measurement as it starts (a search would
        otherwise stand still on a line for minutes).
        """
        self._deadline, self._progress = deadline, progress

    def estimated_in(self, strategy: Any) -> list[str]:
        """The operators of a flat `strategy` whose shard program is priced ``"estimated"``
        (left unmeasured when the measuring deadline passed: `measure_until`): a plan's
        predicted step rests on their roofline estimates, and a simulation that measures them
        (`soapjax simulate` of the plan) can differ from it. Asked as the simulation asks (a
        microbatch's shard where there are microbatches), with the deadline past: nothing is
        measured here (a layer priced by its twin's program is estimated where the twin's
        was), and the deadline is None after."""
        m = strategy.microbatches
        self.measure_until(-math.inf)
        try:
            return [op.name for i, (op, config) in enumerate(zip(self.graph.operators,
                                                                 strategy.configs))
                    if (self.op_time(i, config) if m == 1 else self.shard_time(
                        i, microbatch_degrees(op, config.degrees(self.mesh), m))
                        ).source == "estimated"]
        finally:
            self.measure_until(None)

    # --- operators -------------------------------------------------------------------------------

    def op_time(self, op_index: int, config: Config) -> OpTime:
        """The forward and backward time of one device's shard of operator `op_index`.

        Args:
          op_index: the operator's position in `graph.operators`.
          config: its config; only the degrees it gives each iteration dim matter.

        Returns:
          The times, and where they came from.
        """
        memo = self._memo[op_index]  # per operator, keyed by the axes: no Config.__hash__ call
        hit = memo.get(config.axes)
        if hit is None:
            hit = memo[config.axes] = self.shard_time(op_index, config.degrees(self.mesh))
        return hit

    def shard_time(self, op_index: int, degrees: tuple[int, ...]) -> OpTime:
        """`op_time` by degrees per iteration dim instead of a config. An operator whose
        outputs the backward pass does not differentiate has no backward
        (`soapjax.graph._cotangents.has_backward`: a target network under ``stop_gradient``,
        the batch's augmentation): its backward time is 0."""
        key = (op_index, tuple(degrees))
        hit = self._by_degrees.get(key)
        if hit is None:  # (a transform XLA computes whole: at its whole degrees)
            hit = self._price(op_index, computed_degrees(self.graph, op_index, key[1]))
            if hit.backward_s and not has_backward(self.graph, op_index):
                hit = hit._replace(backward_s=0.0)
            self._by_degrees[key] = hit
        return hit

    def signature(self, op_index: int, degrees: tuple[int, ...]) -> str | None:
        """The cache key of a shard program (None when it cannot be built)."""
        key = (op_index, tuple(degrees))
        if key not in self._sig_of:
            try:
                fn, avals = self._program(op_index, key[1])
                self._sig_of[key] = _timing.signature("operator", str(jax.make_jaxpr(fn)(*avals)),
                                               _diff_mask(self.graph, op_index))
            except Exception as e:  # noqa: BLE001  an exotic equation: priced by a fallback
                # once an operator (its other degrees fail alike; the plan's header counts
                # every fallback)
                first = op_index not in self._unbuilt
                self._unbuilt.add(op_index)
                (log.warning if first else log.debug)(
                    "no shard program for %s at degrees %s (%s: %s); priced by a fallback%s",
                    self.graph.operators[op_index].name, list(degrees), type(e).__name__,
                    _first_line(e), " (its other degrees that fail: not said again)"
                    if first else "")
                self._sig_of[key] = None
        return self._sig_of[key]

    def _program(self, op_index: int, degrees: tuple[int, ...]):
        return operator_fn(self.graph, self.graph.operators[op_index].name, degrees,
                           rules="primal")

    def _analytic(self, op_index: int, degrees: tuple[int, ...]) -> OpTime:
        t = self._analytic_forward_and_backward(op_index, degrees)
        share = backward_share(self.graph, op_index)  # (a frozen weight: no weight gradient)
        return t if share == 1.0 else t._replace(backward_s=t.backward_s * share)

    def _analytic_forward_and_backward(self, op_index: int, degrees: tuple[int, ...]
                                       ) -> OpTime:
        if op_index not in self._dtypes:
            self._dtypes[op_index] = compute_dtype(self.graph, op_index)
        op, device = self.graph.operators[op_index], self.topology.device
        if device.kernels is None:
            return analytic_op_time(op, degrees, device, self._dtypes[op_index])
        # the GPU kernel model: the shard's kernels, shared by the layers of a repeated block
        # that compute the same (`Operator.computation`), so a price never depends on which
        # layer was priced first
        key = ((op.block_position, op.computation) if op.block_position else op_index,
               degrees)
        kernels = self._kernels.get(key)
        if kernels is None:
            kernels = self._kernels[key] = shard_kernels(self.graph, op, degrees)
        return kernel_op_time(kernels, op, degrees, device, self._dtypes[op_index])

    def _price(self, op_index: int, degrees: tuple[int, ...]) -> OpTime:
        if self.source == "analytic":
            return self._analytic(op_index, degrees)
        sig = self.signature(op_index, degrees)
        if sig is not None:
            t = self._measured(op_index, degrees, sig)
            if t is _DEFERRED:
                self._counts["estimated"] += 1
                return self._estimated(op_index, degrees)
            if t is not None:
                return t
        self._counts["fallbacks"] += 1
        shards = math.prod(degrees)
        if shards > 1:
            base = self.shard_time(op_index, (1,) * len(degrees))
            if base.source != "analytic":
                return OpTime(base.forward_s / shards, base.backward_s / shards, "scaled")
        return self._analytic(op_index, degrees)

    def _measured(self, op_index: int, degrees: tuple[int, ...], sig: str) -> OpTime | None:
        if sig in self._by_sig:
            self._counts["shared"] += 1
            return self._by_sig[sig]
        entry = self._cache.load(sig)
        if entry is not None:
            self._counts["disk_hits"] += 1
        else:
            left = self._time_left()
            if left is not None:
                if left <= 0:
                    return _DEFERRED
                if self._progress is not None:
                    self._progress(f"measuring shard program {self._counts['measured'] + 1}: "
                                   f"{self.graph.operators[op_index].name} at degrees "
                                   f"{list(degrees)} ({left:.0f} s left to measure)")
            t0 = time.perf_counter()
            entry = self._measure_op(op_index, degrees, sig)
            self._longest_s = max(self._longest_s, time.perf_counter() - t0)
            if entry is None:
                return None
        back = entry["backward"]
        t = OpTime(entry["forward"]["seconds"], back["seconds"] if back else 0.0, "measured")
        self._by_sig[sig] = t
        roof = self._analytic(op_index, degrees)
        if roof.forward_s + roof.backward_s > 0:
            self._ratios.setdefault(op_index, []).append(
                (t.forward_s + t.backward_s) / (roof.forward_s + roof.backward_s))
        return t

    def _time_left(self) -> float | None:
        """Seconds left to measure (`measure_until`), 0 where the next measurement would
        likely run past the deadline (it is nearer than the longest one so far); None
        without a deadline."""
        if self._deadline is None:
            return None
        left = self._deadline - time.perf_counter()
        return left if left > self._longest_s else 0.0

    def _estimated(self, op_index: int, degrees: tuple[int, ...]) -> OpTime:
        """The roofline scaled by the operator's median measured/roofline ratio (every
        operator's where it has none), for a shard program left unmeasured (`measure_until`)."""
        ratios = self._ratios.get(op_index) or [r for rs in self._ratios.values() for r in rs]
        scale = float(np.median(ratios)) if ratios else 1.0
        roof = self._analytic(op_index, degrees)
        return OpTime(roof.forward_s * scale, roof.backward_s * scale, "estimated")

    def _measure_op(self, op_index: int, degrees: tuple[int, ...], sig: str) -> dict | None:
        op = self.graph.operators[op_index]
        try:
            fn, avals = self._program(op_index, degrees)
            args = _timing.random_args(avals)
            fwd = _timing.time_forward(fn, args, self._options)
            diff = list(differentiated_operands(self.graph, op_index))
            bwd = _timing.time_backward(fn, args, diff, self._options) if any(diff) else None
        except Exception as e:  # noqa: BLE001  compile or run failure: priced by a fallback
            log.warning("timing %s at degrees %s failed (%s: %s); priced by a fallback",
                        op.name, list(degrees), type(e).__name__, _first_line(e))
            return None
        self._counts["measured"] += 1
        entry = self._cache.entry(sig, "operator", f"{self.graph.name}/{op.name} {list(degrees)}",
                                  fwd, bwd, shapes=[list(a.shape) for a in avals])
        self._cache.store(sig, entry)
        return entry

    # --- optimizer updates -----------------------------------------------------------------------

    def update_time(self, param_shard_bytes: float) -> float:
        """Seconds of the optimizer update of a parameter shard of this many bytes.

        Analytic: ``passes * bytes / memory_bandwidth`` plus one kernel overhead, where
        `passes` counts reads and writes of parameters, gradients and optimizer state (7 for
        Adam: read p, g, m, v, write p, m, v). Measured: the optimizer's update of a float32
        vector, timed at power-of-two byte sizes and interpolated linearly in between.
        """
        hit = self._update_memo.get(param_shard_bytes)
        if hit is None:
            hit = self._update_memo[param_shard_bytes] = self._update(param_shard_bytes)
        return hit

    def update_matmul_time(self, path: str) -> float:
        """Seconds of the matrix products the optimizer's update of parameter `path` runs on
        the whole parameter (Muon's Newton-Schulz iteration), at the device's matmul
        roofline; 0 for an update without them."""
        flops, dtype = self._update_flops.get(path, (0.0, "float32"))
        return roofline_time(flops, 0.0, dtype, self.topology.device) if flops else 0.0

    def _update(self, param_shard_bytes: float) -> float:
        if param_shard_bytes <= 0:
            return 0.0
        if self.source == "analytic":
            return self._analytic_update(param_shard_bytes)
        lo = max(_MIN_UPDATE_BUCKET, 2 ** int(math.floor(math.log2(max(param_shard_bytes, 1)))))
        if param_shard_bytes <= lo:  # a power of two, or below the smallest bucket
            return self._update_at(lo)
        hi = 2 * lo
        t_lo, t_hi = self._update_at(lo), self._update_at(hi)
        return t_lo + (t_hi - t_lo) * (param_shard_bytes - lo) / (hi - lo)

    def _analytic_update(self, param_shard_bytes: float) -> float:
        device = self.topology.device
        if device.kernels is not None:  # one fused kernel at the achieved bandwidth
            return fused_time(FusedKernel(self._passes * param_shard_bytes),
                              device.memory_bandwidth, device.kernels)
        return roofline_time(0.0, self._passes * param_shard_bytes, "float32", device)

    def _update_at(self, nbytes: int) -> float:
        if nbytes in self._updates:
            return self._updates[nbytes]
        n = max(1, nbytes // 4)
        try:
            step, avals, make_carry = _timing.update_loop(self._optimizer, n)
            sig = _timing.signature("update", str(jax.make_jaxpr(step)(avals)))
        except Exception as e:  # noqa: BLE001  it needs the parameters' own tree
            # (`optax.multi_transform`'s labels, a mask tree): priced, not timed, on a vector
            log.info("the optimizer's update cannot run on a lone vector (%s: %s); its time is "
                     "the analytic one", type(e).__name__, e)
            self._updates[nbytes] = self._analytic_update(nbytes)
            return self._updates[nbytes]
        entry = self._cache.load(sig)
        left = self._time_left()
        if entry is None and left is not None and left <= 0:  # estimated (`measure_until`)
            self._counts["estimated"] += 1
            if not self._updates:
                return self._analytic_update(nbytes)
            near = min(self._updates, key=lambda k: abs(math.log2(k / nbytes)))
            return self._updates[near] * nbytes / near
        if entry is None:
            t0 = time.perf_counter()
            t = _timing.time_loop(step, make_carry(), self._options)
            self._longest_s = max(self._longest_s, time.perf_counter() - t0)
            self._counts["updates_measured"] += 1
            entry = self._cache.entry(sig, "update", f"{nbytes} bytes", t, None)
            self._cache.store(sig, entry)
        self._updates[nbytes] = entry["forward"]["seconds"]
        return self._updates[nbytes]

    # --- filling the cache -----------------------------------------------------------------------

    def profile(self, *, limits: SpaceLimits = SpaceLimits(),
                progress: Callable[[ProfileProgress], None] | None = None) -> ProfileReport:
        """Prices every config of every operator on `mesh` (measuring what the cache lacks).

        Args:
          limits: the search space to cover.
          progress: called after each shard program with a `ProfileProgress`.

        Returns:
          How many (operator, config) pairs, distinct shard programs and signatures there
          were, how many were measured now, and how long it took.
        """
        t0 = time.perf_counter()
        measured0, fallbacks0 = self._counts["measured"], self._counts["fallbacks"]
        pairs = 0
        tasks: dict[tuple[int, tuple[int, ...]], None] = {}
        for i, op in enumerate(self.graph.operators):
            for c in configs(op, self.mesh, limits):
                pairs += 1
                tasks.setdefault((i, c.degrees(self.mesh)), None)
        sigs: set[str] = set()
        for done, (i, degrees) in enumerate(tasks, 1):
            self.shard_time(i, degrees)
            if self.source != "analytic":
                sigs.add(self.signature(i, degrees) or f"unbuildable/{i}/{degrees}")
            if progress is not None:
                progress(ProfileProgress(done, len(tasks), len(sigs) or done,
                                         self._counts["measured"] - measured0,
                                         time.perf_counter() - t0))
        return ProfileReport(pairs, len(tasks), len(sigs) if sigs else len(tasks),
                             self._counts["measured"] - measured0,
                             self._counts["fallbacks"] - fallbacks0, time.perf_counter() - t0)


def _diff_mask(graph: OpGraph, op_index: int) -> str:
    """Which operands a shard program's timed backward differentiates: those the step's
    backward computes a cotangent of (`soapjax.graph._cotangents`; none for an operator
    without a backward, whose backward is then not timed)."""
    return "".join("d" if d else "-" for d in differentiated_operands(graph, op_index))


def cost_model(graph: OpGraph, topology: Topology, *, mode: Mode = "auto",
               cache_dir: str | os.PathLike | None = None, mesh: MeshShape | None = None,
               optimizer: Any = None, options: TimingOptions | None = None,
               progress: Callable[[ProfileProgress], None] | None = None) -> CostModel:
    """The cost model of `graph` on `topology`.

    Args:
      graph: the traced operator graph.
      topology: the target cluster.
      mode: ``"measured"`` times shard programs on the local backend (which must be the
        topology's platform and, for accelerators, its device kind); ``"analytic"`` uses the
        roofline of the topology's device specs; ``"auto"`` measures when it can.
      cache_dir: where measurements are cached (default: `default_cache_dir()`).
      mesh: the mesh configs refer to (default: the topology's axes); give one to plan for a
        different shape of the same devices.
      optimizer: the optax optimizer of the training step, for `update_time` (default: Adam's
        arithmetic).
      options: timing trial length and count.
      progress: when given, every shard program of the search space is priced now (see
        `CostModel.profile`), reporting progress to this callback.

    Returns:
      The cost model.

    Raises:
      CostError: an unknown mode, or ``mode="measured"`` where the topology's devices are not
        the local ones.
    """
    if mode not in ("auto", "measured", "analytic"):
        raise CostError(f"mode must be 'auto', 'measured' or 'analytic', got {mode!r}")
    ok, why = local_backend_matches(topology)
    if mode == "measured" and not ok:
        raise CostError(f"cannot measure operator times: {why}; use mode='analytic' (roofline "
                        f"from the topology's device specs) or run on the target devices")
    source = "measured" if mode == "measured" or (mode == "auto" and ok) else "analytic"
    cache = DiskCache(None, {})
    if cache_dir is not None and Path(cache_dir).expanduser().exists() \
            and not Path(cache_dir).expanduser().is_dir():
        raise CostError(f"cache_dir {os.fspath(cache_dir)!r} is a file; expected a directory for "
                        "the cost cache (made if missing)")
    if source == "measured":
        root = cache_dir if cache_dir is not None else default_cache_dir()
        cache = DiskCache(root, _timing.backend_identity())
    model = CostModel(graph, topology, source=source, mesh=mesh or MeshShape.of(topology),
                      cache=cache, options=options or TimingOptions(), optimizer=optimizer)
    if progress is not None:
        model.profile(progress=progress)
    return model


# --- calibration ---------------------------------------------------------------------------------


class Calibration(NamedTuple):
    """A measured unsharded training step against the sum of its parts.

    Attributes:
      model: workload name; config: its config name.
      num_operators: operators in its graph.
      step_s: the measured step (jit of the whole train step, repeated in one program).
      step_spread: that measurement's spread over trials.
      forward_s, backward_s, update_s: sums of the operators' measured forward and backward
        times and of the optimizer updates of every parameter.
      sources: how many operators were priced by each source.
    """

    model: str
    config: str
    num_operators: int
    step_s: float
    step_spread: float
    forward_s: float
    backward_s: float
    update_s: float
    sources: Mapping[str, int]

    @property
    def predicted_s(self) -> float:
        return self.forward_s + self.backward_s + self.update_s

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return self.predicted_s / self.step_s - 1.0


def calibrate(workload: Any, *, topology: Topology | None = None,
              cache_dir: str | os.PathLike | None = None,
              options: TimingOptions | None = None) -> Calibration:
    """Measures `workload`'s unsharded step and the sum of its operators' measured times.

    Args:
      workload: a `models.Workload` (loss, parameters, batch, optimizer, train step).
      topology: a topology of the local devices (default: `local_topology()`).
      cache_dir: the measurement cache (default: `default_cache_dir()`).
      options: timing options.

    Returns:
      Both times and the parts of the sum.
    """
    topology = topology or local_topology()
    options = options or TimingOptions()
    g = trace(workload.loss_fn, workload.abstract_params(), workload.abstract_batch(),
              name=workload.name)
    costs = cost_model(g, topology, mode="measured", cache_dir=cache_dir,
                       optimizer=workload.optimizer, options=options)
    fwd = bwd = 0.0
    sources: dict[str, int] = {}
    for i, op in enumerate(g.operators):
        t = costs.shard_time(i, (1,) * len(op.iteration_sizes))
        fwd, bwd = fwd + t.forward_s, bwd + t.backward_s
        sources[t.source] = sources.get(t.source, 0) + 1
    upd = sum(costs.update_time(math.prod(p.shape) * itemsize(p.dtype))
              for p in g.params)
    step = _timing.time_train_step(workload, options)
    return Calibration(workload.name, workload.config, len(g.operators), step.seconds,
                       step.spread, fwd, bwd, upd, sources)
