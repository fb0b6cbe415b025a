"""Operator times: measured with XLA on the local backend, or a roofline from the device specs.

The simulator needs, for every operator and config, the time of the operator's forward and
backward task on one device (the paper's assumption A1: predictable, independent of the
values). A config fixes a degree per iteration dim, hence the shard shapes each device
computes on; `soapjax._local.operator_fn` gives that per-device program, which is what runs
here:

* **measured** (the local backend is the topology's: e.g. topology ``cpu8`` on this CPU): the
  shard program is compiled for ONE device and timed, the forward and the backward (the VJP
  w.r.t. its float activation and parameter operands, from saved residuals) separately, with
  many repetitions inside one compiled loop so the dispatch overhead cancels (see
  `soapjax._timing`). With ``--xla_force_host_platform_device_count=8`` the 8 virtual CPU
  devices share the host's cores, so the one-device time is what a real machine with one such
  device per slot would take, not what a sharded run on the virtual devices shows.
* **analytic** (the target devices are not attached: planning for 64 K80s from a laptop):
  ``max(flops / peak_flops(dtype), bytes / memory_bandwidth) + kernel overhead`` per shard;
  the backward as twice the forward's FLOPs, bytes and kernels (a matmul's backward is two
  matmuls of the forward's size: one for the input's gradient, one for the weight's). The
  dtype is the one the operator's matmul or convolution multiplies in (`compute_dtype`): a
  ``nn.Dense(dtype=float16, param_dtype=float32)`` reads a float32 kernel but casts it first,
  so it runs at the float16 peak (on an A100, 312 TFLOP/s, not 19.5). The peaks are the
  datasheet's, reached in full unless the topology file says otherwise: its optional
  ``[device.efficiency]`` gives measured fractions of the peak FLOP/s per dtype and of the
  memory bandwidth (e.g. ``peak_flops = { bfloat16 = 0.7 }``, ``memory_bandwidth = 0.85``).
* **scaled**: a shard program that cannot be built or compiled for a split config falls back
  to the measured unsplit time divided by the number of shards.

`StepFlops` (`FlopCounter`) counts the FLOPs one device computes in a training step as XLA
counts them, forward, backward, recomputation and the optimizer's update of its parameter
shards: what `soapjax check` holds against the compiled step (docs/checks.md). The analytic
times above still price ``Operator.flops`` (a backward twice the forward).

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

One module past ~600 lines, on purpose: the measured and the analytic times are one model
(`CostModel` falls back from one to the other per operator, under one memo and one cache key),
and the profile and calibration commands are thin loops over it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from soapjax import _timing
from soapjax._dims import Flops, xla_flops
from soapjax._dtypes import is_float, itemsize
from soapjax._local import CustomRuleError, operator_fn
from soapjax._timing import DiskCache, TimingOptions, default_cache_dir
from soapjax.errors import SoapjaxError, TopologyError
from soapjax.graph import Operator, OpGraph
from soapjax.memory import recomputes
from soapjax.space import Config, MeshShape, SpaceLimits, configs, param_specs
from soapjax.topology import DeviceSpec, Topology, list_topologies, load_topology

__all__ = ["ANALYTIC_KERNEL_OVERHEAD_S", "Calibration", "CostError", "CostModel", "CostStats",
           "FlopCounter", "OpTime", "ProfileProgress", "ProfileReport", "StepFlops",
           "TimingOptions", "analytic_op_time",
           "calibrate", "compute_dtype", "cost_model", "default_cache_dir",
           "local_backend_matches", "local_topology", "roofline_time", "step_flops"]

log = logging.getLogger(__name__)

Mode = Literal["auto", "measured", "analytic"]

# A fixed cost per kernel in the analytic model: a launch on a GPU costs 2-5 us before any work;
# a kernel that moves 4 bytes is not free. One forward is counted as one kernel, a backward as
# two (input gradient, weight gradient).
ANALYTIC_KERNEL_OVERHEAD_S = 5e-6
# Adam reads parameters, gradients and two moments and writes parameters and both moments:
# 7 passes over the parameter bytes (when the optimizer is not known).
_DEFAULT_UPDATE_PASSES = 7.0
# Optimizer updates are measured at sizes 2**k bytes and interpolated in between.
_MIN_UPDATE_BUCKET = 2**12


class CostError(SoapjaxError, ValueError):
    """A cost model that cannot be built as asked (e.g. measured mode without the devices)."""


class OpTime(NamedTuple):
    """The time of one operator's forward and backward task on one device.

    Attributes:
      forward_s: seconds of the forward pass of one shard.
      backward_s: seconds of its backward pass (gradients of activations and parameters).
      source: ``"measured"`` (timed on the local backend), ``"analytic"`` (roofline from the
        topology's device specs), ``"scaled"`` (the unsplit measurement divided by the
        number of shards, where the shard program could not be timed) or ``"estimated"`` (the
        roofline times the ratio measured/roofline of the operator's measured shard programs:
        a shard program left unmeasured when the planning budget ran out,
        `CostModel.measure_until`).
    """

    forward_s: float
    backward_s: float
    source: str


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


# --- the analytic model --------------------------------------------------------------------------


def roofline_time(flops: float, nbytes: float, dtype: Any, device: DeviceSpec, *,
                  kernels: int = 1) -> float:
    """``max(flops / peak_flops(dtype), nbytes / memory_bandwidth) + kernels * overhead``.

    The peaks are the device file's, each scaled by the measured fraction its optional
    ``[device.efficiency]`` table gives (1, the bare roofline, without one).

    Args:
      flops: floating point operations.
      nbytes: bytes read and written.
      dtype: the dtype the arithmetic runs in (its peak FLOP/s is used; a dtype the device
        file gives no figure for, such as an integer type, uses the float32 figure).
      device: the device's specs.
      kernels: how many kernels, each costing `ANALYTIC_KERNEL_OVERHEAD_S`.
    """
    try:
        peak = device.peak_flops_for(dtype)
    except TopologyError:
        dtype = "float32"
        peak = device.peak_flops_for(dtype)
    flops_fraction, memory_fraction = _efficiency(device, dtype)
    overhead = kernels * ANALYTIC_KERNEL_OVERHEAD_S
    return max(flops / (peak * flops_fraction),
               nbytes / (device.memory_bandwidth * memory_fraction)) + overhead


def _efficiency(device: DeviceSpec, dtype: Any) -> tuple[float, float]:
    """(fraction of the peak FLOP/s of `dtype`, fraction of the memory bandwidth) reached."""
    efficiency = getattr(device, "efficiency", None)  # a DeviceSpec-like object may lack one
    if efficiency is None:
        return 1.0, 1.0
    return efficiency.flops_fraction(dtype), efficiency.memory_bandwidth


def _shard_bytes(op: Operator, degrees: tuple[int, ...]) -> float:
    """Bytes of one shard's operands and outputs (each dim divided by its iteration degree)."""

    def size(t) -> float:
        div = math.prod(degrees[d] for d in t.dims if d is not None)
        return t.nbytes / div

    return sum(size(o) for o in op.inputs) + sum(size(t) for t in op.outputs)


# Primitives whose operands' dtype sets an operator's arithmetic rate.
_RATE_ANCHORS = ("dot_general", "conv_general_dilated")


def compute_dtype(graph: OpGraph, op: Operator | int) -> str:
    """The dtype an operator's arithmetic runs in: that of its matmul or convolution.

    The operands of the operator's first ``dot_general`` or ``conv_general_dilated`` (looked
    for inside remat and custom_jvp bodies too), as that equation reads them: after the casts
    folded into the operator. The widest float among them sets the rate; the accumulation type
    (``preferred_element_type``) does not, since tensor cores multiply float16 at the float16
    peak whatever they accumulate in. Operators without a matmul (norms, softmax, gathers;
    memory-bound anyway) take the widest float among their operands, else their output's dtype.

    Example: ``nn.Dense(256, dtype=jnp.float16, param_dtype=jnp.float32)`` reads a float32
    kernel, but its ``dot_general`` multiplies two float16 operands::

        compute_dtype(graph, graph.operator("dense"))   # 'float16'

    Args:
      graph: the traced graph the operator belongs to.
      op: the operator, or its index in ``graph.operators``.
    """
    op = graph.operators[op] if isinstance(op, int) else op
    local = graph.program.local.get(op.name)
    eqns = [graph.program.units[u].eqn for u in local.units] if local is not None else []
    anchor = _find_anchor(eqns)
    if anchor is not None:
        dtypes = [np.dtype(v.aval.dtype) for v in anchor.invars]
        floats = [d for d in dtypes if _timing.is_float(d)]
        return max(floats or dtypes, key=lambda d: d.itemsize).name
    floats = [np.dtype(o.dtype) for o in op.inputs if _timing.is_float(o.dtype)]
    if floats:
        return max(floats, key=lambda d: d.itemsize).name
    return op.dtype


def _find_anchor(eqns) -> Any:
    """The first matmul or convolution among `eqns`, depth first into nested jaxprs."""
    for eqn in eqns:
        if eqn.primitive.name in _RATE_ANCHORS:
            return eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            found = _find_anchor(sub.eqns)
            if found is not None:
                return found
    return None


def analytic_op_time(op: Operator, degrees: tuple[int, ...], device: DeviceSpec,
                     dtype: str) -> OpTime:
    """The roofline time of one shard of `op` (see the module docstring).

    Args:
      op: the operator.
      degrees: the split degree of each of its iteration dims.
      device: the device's specs.
      dtype: what its arithmetic runs in: `compute_dtype` of the operator.
    """
    shards = math.prod(degrees)
    flops, nbytes = op.flops / shards, _shard_bytes(op, degrees)
    fwd = roofline_time(flops, nbytes, dtype, device)
    bwd = roofline_time(2 * flops, 2 * nbytes, dtype, device, kernels=2)
    return OpTime(fwd, bwd, "analytic")


# --- FLOPs of a training step, as XLA counts them -----------------------------------------------


class StepFlops(NamedTuple):
    """FLOPs one device computes in a training step, counted as XLA counts them.

    Each operator's forward and VJP are counted as the HLO their equations lower to
    (`soapjax._dims.xla_flops`: a multiply-add is 2, other elementwise work 1 per element,
    transcendentals apart, a scan's body once per step), at the shard shapes its config gives
    one device (`FlopCounter.operator`): an operator whose config leaves mesh axes unused
    computes its whole shard on each of them. What XLA's compiler adds on its own (fusions
    recomputing elementwise work) is not here: docs/checks.md measures it.

    Attributes:
      forward: the operators' forward passes, with the residuals their backward passes read
        (a tanh's ``1 - y**2``), as JAX's ``value_and_grad`` puts them on the forward side.
      backward: the backward passes: cotangents of the operands that need them (activations
        that depend on parameters, float parameters; never the batch), and the sums of a
        parameter's gradients where several operators read it.
      recompute: forward passes run again in the backward pass (`Strategy.recompute`).
      update: the optimizer's update of the parameter shards the device stores (its storage
        spec, `soapjax.space.param_specs`): replicated parameters are updated whole on every
        device.
      transcendentals: exp, log, tanh, sqrt, ... in all four, which XLA counts apart.
    """

    forward: float
    backward: float
    recompute: float
    update: float
    transcendentals: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute + self.update


class _OperatorFlops(NamedTuple):
    forward: Flops  # the primal equations
    residuals: Flops  # what the forward side of the VJP adds for the backward pass
    backward: Flops  # the cotangents

    def split(self, shards: int, matmuls: _OperatorFlops | None) -> _OperatorFlops:
        """One device's part: everything over `shards`, but the matmuls as counted at the
        device's shard shapes (`matmuls`, where given)."""
        def part(whole: Flops, shard: Flops | None) -> Flops:
            if shard is None:
                return Flops(*(x / shards for x in whole))
            return Flops((whole.flops - whole.matmul) / shards + shard.matmul,
                         whole.transcendentals / shards, shard.matmul)
        return _OperatorFlops(*(part(w, m) for w, m in zip(self, matmuls or (None,) * 3)))


class FlopCounter:
    """`StepFlops` of strategies on one graph; each operator is traced once per split.

    Example::

        counter = FlopCounter(graph, optimizer=workload.optimizer)
        counter.step(strategy, MeshShape.of(topo)).total   # FLOPs per device
    """

    def __init__(self, graph: OpGraph, *, optimizer: Any = None, params: Any = None):
        """
        Args:
          graph: the traced graph.
          optimizer: the optax optimizer of the step (None: no update counted).
          params: the parameters or their shapes, as the step takes them (their tree is what
            the optimizer's masks see; default: a dict of `graph.params` by path).
        """
        self.graph = graph
        self.optimizer = optimizer
        self._treedef = jax.tree.structure(
            params if params is not None else {leaf.path: 0 for leaf in graph.params})
        self._whole: dict[int, _OperatorFlops] = {}
        self._shard: dict[tuple[int, tuple[int, ...]], _OperatorFlops] = {}
        self._updates: dict[tuple, float] = {}
        self._diff, self._wanted = _differentiated(graph)

    def operator(self, i: int, degrees: tuple[int, ...] | None = None) -> _OperatorFlops:
        """Operator `i`'s FLOPs on one device when split by `degrees` (None: unsplit).

        Counted at the device's shard shapes: a contraction split down to one element is a
        multiply to XLA, not a multiply-add, and parameter-sized work (a scan's sum of its
        weight gradients over the steps) does not shrink with the batch. Where a custom
        derivative rule (a ReLU's, a softmax's) cannot be traced at shard shapes, the unsplit
        count is divided over the shards, but for the matmuls, counted at shard shapes with
        the rules' primal bodies.
        """
        if degrees is None or math.prod(degrees) == 1:
            if i not in self._whole:
                fn, avals = operator_fn(self.graph, self.graph.operators[i].name)
                self._whole[i] = self._count(i, fn, avals)
            return self._whole[i]
        key = (i, tuple(degrees))
        if key not in self._shard:
            self._shard[key] = self._count_shard(i, tuple(degrees))
        return self._shard[key]

    def _count_shard(self, i: int, degrees: tuple[int, ...]) -> _OperatorFlops:
        name, shards = self.graph.operators[i].name, math.prod(degrees)
        try:
            return self._count(i, *operator_fn(self.graph, name, degrees))
        except CustomRuleError:
            matmuls = self._count(i, *operator_fn(self.graph, name, degrees, rules="primal"))
            return self.operator(i).split(shards, matmuls)
        except Exception as e:  # noqa: BLE001  an exotic equation: the unsplit count, divided
            log.info("no shard program for %s at degrees %s (%s: %s); its FLOPs are divided",
                     name, degrees, type(e).__name__, e)
            return self.operator(i).split(shards, None)

    def step(self, strategy: Any, mesh: MeshShape) -> StepFlops:
        """The FLOPs one device computes in a step of `strategy` (a `Strategy`) on `mesh`."""
        fwd = bwd = again = trans = 0.0
        for i, (op, config) in enumerate(zip(self.graph.operators, strategy.configs)):
            c = self.operator(i, config.degrees(mesh))
            fwd_side = c.forward.plus(c.residuals)
            if recomputes(op, strategy.recompute_of(i)):  # saved nothing: F, then F + R again
                fwd += c.forward.flops
                again += fwd_side.flops
                trans += c.forward.transcendentals
            else:
                fwd += fwd_side.flops
            bwd += c.backward.flops
            trans += fwd_side.transcendentals + c.backward.transcendentals
        shards = self._stored_shapes(strategy, mesh)
        bwd += self._gradient_sums({leaf.path: math.prod(shape) for leaf, shape
                                    in zip(self.graph.params, shards) if is_float(leaf.dtype)})
        return StepFlops(fwd, bwd, again, self._update(shards), trans)

    def _stored_shapes(self, strategy: Any, mesh: MeshShape) -> tuple[tuple[int, ...], ...]:
        """The shape of the shard of each parameter leaf one device stores (and updates)."""
        specs = param_specs(self.graph, strategy, mesh)
        return tuple(tuple(n // mesh.degree(axes) for n, axes in zip(leaf.shape, specs[leaf.path]))
                     for leaf in self.graph.params)

    def _update(self, shards: tuple[tuple[int, ...], ...]) -> float:
        """The optimizer's update and ``optax.apply_updates`` of parameter shards of these
        shapes (its masks see the parameters' tree; a global norm sums the device's shards)."""
        if self.optimizer is None:
            return 0.0
        if shards not in self._updates:
            leaves = [jax.ShapeDtypeStruct(shape, leaf.dtype)
                      for leaf, shape in zip(self.graph.params, shards)]
            params = jax.tree.unflatten(self._treedef, leaves)
            optimizer = self.optimizer

            def update(grads, state, params):
                updates, state = optimizer.update(grads, state, params)
                return jax.tree.map(jnp.add, params, updates), state

            state = jax.eval_shape(optimizer.init, params)
            self._updates[shards] = xla_flops(
                jax.make_jaxpr(update)(params, state, params).jaxpr).flops
        return self._updates[shards]

    def _gradient_sums(self, stored: Mapping[str, float]) -> float:
        """Adds of a parameter's gradient contributions, one per reader after the first."""
        readers: dict[str, int] = {}
        leaf_of: dict[str, str] = {}
        for op in self.graph.operators:
            for o in op.inputs:
                if o.kind == "param":
                    readers[o.source] = readers.get(o.source, 0) + 1
                    leaf_of[o.source] = o.leaf_path
        return sum((n - 1) * stored.get(leaf_of[s], 0.0) for s, n in readers.items() if n > 1)

    def _count(self, i: int, fn: Callable, avals: Sequence[Any]) -> _OperatorFlops:
        forward = xla_flops(jax.make_jaxpr(fn)(*avals).jaxpr)
        idx = [k for k, d in enumerate(self._diff[i]) if d]
        outs = [k for k in range(len(self.graph.operators[i].outputs)) if (i, k) in self._wanted]
        if not idx or not outs:
            return _OperatorFlops(forward, Flops(), Flops())

        def vjp(*args):
            def part(*d):
                full = list(args)
                for k, x in zip(idx, d):
                    full[k] = x
                res = fn(*full)
                return [res[k] for k in outs]

            return jax.vjp(part, *[args[k] for k in idx])

        def both(args, cts):
            return vjp(*args)[1](cts)

        out_avals = jax.eval_shape(fn, *avals)
        fwd_side = xla_flops(jax.make_jaxpr(vjp)(*avals).jaxpr)
        total = xla_flops(jax.make_jaxpr(both)(list(avals), [out_avals[k] for k in outs]).jaxpr)
        return _OperatorFlops(forward, _minus(fwd_side, forward), _minus(total, fwd_side))


def step_flops(graph: OpGraph, strategy: Any, mesh: MeshShape, *, optimizer: Any = None,
               params: Any = None) -> StepFlops:
    """The FLOPs one device computes in a step of `strategy` (`FlopCounter.step`): what
    `soapjax check` holds against the compiled step's."""
    return FlopCounter(graph, optimizer=optimizer, params=params).step(strategy, mesh)


_DEFERRED = OpTime(math.nan, math.nan, "deferred")  # `CostModel._measured`: past the deadline


def _first_line(e: BaseException, limit: int = 160) -> str:
    """An exception's first line, cut to `limit` characters: a lowering error carries ~2 KB
    of MLIR locations that would drown the progress output."""
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _minus(a: Flops, b: Flops) -> Flops:
    return Flops(*(max(x - y, 0.0) for x, y in zip(a, b)))


def _differentiated(graph: OpGraph) -> tuple[list[list[bool]], set[tuple[int, int]]]:
    """Which operands of each operator get cotangents (float parameters, and activations
    computed from parameters), and which outputs ``(operator, k)`` receive one (read by an
    operator that differentiates it, or the function's result)."""
    index = {op.name: i for i, op in enumerate(graph.operators)}
    needs: list[bool] = []
    diff: list[list[bool]] = []
    wanted: set[tuple[int, int]] = set()
    for op in graph.operators:
        d = [is_float(o.dtype) and (o.kind == "param" or (o.kind == "activation"
                                                          and needs[index[o.source]]))
             for o in op.inputs]
        diff.append(d)
        needs.append(any(d))
        wanted.update((index[o.source], o.index) for o, x in zip(op.inputs, d)
                      if x and o.kind == "activation")
    results = set(graph.program.outputs)
    wanted.update((i, k) for i, op in enumerate(graph.operators) if needs[i]
                  for k, t in enumerate(op.outputs) if t.value in results and is_float(t.dtype))
    return diff, wanted


# --- platform matching ---------------------------------------------------------------------------


# Words in device names that say how a chip is packaged, not which chip it is.
_FORM_FACTORS = ("SXM", "HBM", "PCIE", "GDDR", "NVL")


def _kinds_match(topology_kind: str, local_kind: str) -> bool:
    """Whether a topology's device kind names the local device (model numbers must agree).

    ``"H100 SXM5 80GB"`` matches jax's ``"NVIDIA H100 80GB HBM3"`` (both say H100);
    ``"Tesla P100-SXM2-16GB"`` does not match ``"Tesla V100-SXM2-16GB"``.
    """

    def models(kind: str) -> set[str]:
        words = "".join(c if c.isalnum() else " " for c in kind.upper()).split()
        return {w for w in words if any(c.isdigit() for c in w) and any(c.isalpha() for c in w)
                and not w.endswith("GB") and not w.startswith(_FORM_FACTORS)}

    a, b = models(topology_kind), models(local_kind)
    return bool(a & b) if a and b else topology_kind.strip().lower() == local_kind.strip().lower()


def local_backend_matches(topology: Topology) -> tuple[bool, str]:
    """Whether the local devices are the topology's, and why not."""
    local, dev = _timing.local_platform(), jax.devices()[0]
    if local != topology.platform:
        return False, (f"topology {topology.name!r} has {topology.platform} devices but the local "
                       f"backend is {local}")
    if local != "cpu" and not _kinds_match(topology.device.kind, dev.device_kind):
        return False, (f"topology {topology.name!r} has {topology.device.kind!r} devices but the "
                       f"local device is {dev.device_kind!r}")
    return True, ""


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
        self._updates: dict[int, float] = {}  # measured, per power-of-two size
        self._update_memo: dict[float, float] = {}
        self._counts = dict(measured=0, disk_hits=0, shared=0, fallbacks=0, updates_measured=0,
                            estimated=0)
        self._deadline: float | None = None
        self._progress: Callable[[str], None] | None = None
        self._ratios: dict[int, list[float]] = {}  # operator -> measured / analytic, per pair
        self._passes = _update_passes(optimizer)
        self.update_reductions = update_reductions(optimizer)
        self._dtypes: dict[int, str] = {}

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
        passed is not timed: it is priced ``"estimated"``, the roofline scaled by the median
        ratio measured/roofline of the same operator's measured shard programs (of every
        operator's, for one with none; the plain roofline before anything is measured).
        This is how `soapjax.search.find_plan` keeps its budget with measured costs: one
        shard program takes 0.3-2 s to compile and time on a CPU, and a search visits
        hundreds. `progress` is told of each measurement as it starts (a search would
        otherwise stand still on a line for minutes).
        """
        self._deadline, self._progress = deadline, progress

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
        """`op_time` by degrees per iteration dim instead of a config."""
        key = (op_index, tuple(degrees))
        hit = self._by_degrees.get(key)
        if hit is None:
            hit = self._by_degrees[key] = self._price(*key)
        return hit

    def signature(self, op_index: int, degrees: tuple[int, ...]) -> str | None:
        """The cache key of a shard program (None when it cannot be built)."""
        key = (op_index, tuple(degrees))
        if key not in self._sig_of:
            try:
                fn, avals = self._program(op_index, key[1])
                self._sig_of[key] = _timing.signature("operator", str(jax.make_jaxpr(fn)(*avals)),
                                               _diff_mask(self.graph.operators[op_index]))
            except Exception as e:  # noqa: BLE001  an exotic equation: priced by a fallback
                log.warning("no shard program for %s at degrees %s (%s: %s); priced by a "
                            "fallback", self.graph.operators[op_index].name, list(degrees),
                            type(e).__name__, _first_line(e))
                self._sig_of[key] = None
        return self._sig_of[key]

    def _program(self, op_index: int, degrees: tuple[int, ...]):
        return operator_fn(self.graph, self.graph.operators[op_index].name, degrees,
                           rules="primal")

    def _analytic(self, op_index: int, degrees: tuple[int, ...]) -> OpTime:
        if op_index not in self._dtypes:
            self._dtypes[op_index] = compute_dtype(self.graph, op_index)
        return analytic_op_time(self.graph.operators[op_index], degrees, self.topology.device,
                                self._dtypes[op_index])

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
            if self._deadline is not None:
                left = self._deadline - time.perf_counter()
                if left <= 0:
                    return _DEFERRED
                if self._progress is not None:
                    self._progress(f"measuring shard program {self._counts['measured'] + 1}: "
                                   f"{self.graph.operators[op_index].name} at degrees "
                                   f"{list(degrees)} ({left:.0f} s left to measure)")
            entry = self._measure_op(op_index, degrees, sig)
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
            diff = [o.kind in ("activation", "param") for o in op.inputs]
            bwd = _timing.time_backward(fn, args, diff, self._options)
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

    def _update(self, param_shard_bytes: float) -> float:
        if param_shard_bytes <= 0:
            return 0.0
        if self.source == "analytic":
            return roofline_time(0.0, self._passes * param_shard_bytes, "float32",
                                 self.topology.device)
        lo = max(_MIN_UPDATE_BUCKET, 2 ** int(math.floor(math.log2(max(param_shard_bytes, 1)))))
        if param_shard_bytes <= lo:  # a power of two, or below the smallest bucket
            return self._update_at(lo)
        hi = 2 * lo
        t_lo, t_hi = self._update_at(lo), self._update_at(hi)
        return t_lo + (t_hi - t_lo) * (param_shard_bytes - lo) / (hi - lo)

    def _update_at(self, nbytes: int) -> float:
        if nbytes in self._updates:
            return self._updates[nbytes]
        n = max(1, nbytes // 4)
        step, avals, make_carry = _timing.update_loop(self._optimizer, n)
        sig = _timing.signature("update", str(jax.make_jaxpr(step)(avals)))
        entry = self._cache.load(sig)
        if entry is None:
            t = _timing.time_loop(step, make_carry(), self._options)
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


def _diff_mask(op: Operator) -> str:
    return "".join("d" if o.kind in ("activation", "param") else "-" for o in op.inputs)


_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "argmax", "argmin", "dot_general"})


def update_reductions(optimizer: Any) -> int:
    """How many scalars the optimizer's update reduces each parameter (or its gradient) to.

    ``optax.clip_by_global_norm`` sums every gradient's squares into one norm: 1 per parameter;
    LAMB's trust ratios take two norms; Adam and SGD take none. Where a parameter is stored
    split over mesh axes, each such scalar is a partial result that XLA all-reduces over those
    axes before any update can use it (one scalar all-reduce per split parameter, combined into
    one all-reduce of many operands, which XLA:CPU runs as one rendezvous per operand), and the
    simulator prices it. Counted on the update's jaxpr for one float32 vector (as
    `_update_passes`): reductions of the vector to a scalar, nested jaxprs included. An
    optimizer that cannot update a lone vector counts 0.

    >>> import optax
    >>> update_reductions(optax.adam(1e-3)), update_reductions(
    ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    (0, 1)
    """
    if optimizer is None:
        return 0
    p = jax.ShapeDtypeStruct((1024,), jnp.float32)
    try:
        state = jax.eval_shape(optimizer.init, p)
        closed = jax.make_jaxpr(optimizer.update)(p, state, p)
    except Exception:  # noqa: BLE001  an optimizer that needs more than one array
        return 0

    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            if (eqn.primitive.name in _REDUCTIONS
                    and any(getattr(v.aval, "shape", None) == p.shape for v in eqn.invars)
                    and all(getattr(v.aval, "shape", None) == () for v in eqn.outvars)):
                n += 1
            n += sum(count(sub) for sub in jcore.jaxprs_in_params(eqn.params))
        return n

    return count(closed.jaxpr)


def _update_passes(optimizer: Any) -> float:
    """Passes over the parameter bytes one update makes: 3 (read p, g; write p) + 2 per state."""
    if optimizer is None:
        return _DEFAULT_UPDATE_PASSES
    try:
        p = jax.ShapeDtypeStruct((1024,), jnp.float32)
        state = jax.eval_shape(optimizer.init, p)
        size = sum(math.prod(x.shape) * itemsize(x.dtype)
                   for x in jax.tree.leaves(state) if hasattr(x, "shape"))
        return 3.0 + 2.0 * size / (1024 * 4)
    except Exception:  # noqa: BLE001  an optimizer that needs more than one array
        return _DEFAULT_UPDATE_PASSES


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


def local_topology() -> Topology:
    """A shipped topology whose devices are the local ones (``cpu8`` on a CPU).

    Raises:
      CostError: none of the shipped topologies has the local device kind.
    """
    for name in (["cpu8"] if _timing.local_platform() == "cpu" else []) + list(list_topologies()):
        t = load_topology(name)
        if local_backend_matches(t)[0]:
            return t
    dev = jax.devices()[0]
    raise CostError(f"no shipped topology has the local device ({dev.platform}, "
                    f"{dev.device_kind!r}); add one to meshes/ with that device kind")


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
    from soapjax.graph import trace

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
