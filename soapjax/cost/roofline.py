"""The analytic operator time: a roofline from the device's datasheet, for devices not attached.

Planning for 64 K80s from a laptop cannot time anything on a K80, so `soapjax.cost.operators` prices
each shard program as ``max(flops / peak_flops(dtype), bytes / memory_bandwidth) + kernel
overhead`` (`roofline_time`), and the backward as twice the forward's FLOPs, bytes and kernels
(a matmul's backward is two matmuls of the forward's size: one for the input's gradient, one
for the weight's; `analytic_op_time`). The dtype is the one the operator's matmul or
convolution multiplies in (`compute_dtype`): a ``nn.Dense(dtype=float16, param_dtype=float32)``
reads a float32 kernel but casts it first, so it runs at the float16 peak (on an A100, 312
TFLOP/s, not 19.5). The peaks are the datasheet's, reached in full unless the topology file
says otherwise: its optional ``[device.efficiency]`` gives measured fractions of the peak
FLOP/s per dtype and of the memory bandwidth (e.g. ``peak_flops = { bfloat16 = 0.7 }``,
``memory_bandwidth = 0.85``; `soapjax.cost.devicefit` fits them: an H100 reaches 0.09-0.81 of its
bf16 peak on GEMMs by shape, docs/accuracy.md).

Example: one shard of a ``[4, 64] @ [64, 64]`` matmul in float32 on an H100 is bound by its
bytes (18.7 KB over 3.35 TB/s: 5.6 ns, its 32.8 KFLOP take 0.5 ns at 67 TFLOP/s), and both are
nothing next to the 5 us a kernel launch costs:

>>> from soapjax.topology.cluster import load_topology
>>> h100 = load_topology("dgx-h100x8").device
>>> round(roofline_time(2 * 4 * 64 * 64, 18_688, "float32", h100) * 1e6, 4)
5.0056
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from jax.extend import core as jcore

from soapjax.base._dtypes import is_float
from soapjax.base.errors import TopologyError
from soapjax.graph._cotangents import differentiated_operands
from soapjax.graph.opgraph import Operator, OpGraph
from soapjax.topology.cluster import DeviceSpec

__all__ = ["ANALYTIC_KERNEL_OVERHEAD_S", "OpTime", "analytic_op_time", "backward_share",
           "compute_dtype", "roofline_time"]

# A fixed cost per kernel in the analytic model: a launch on a GPU costs 2-5 us before any work;
# a kernel that moves 4 bytes is not free. One forward is counted as one kernel, a backward as
# two (input gradient, weight gradient).
ANALYTIC_KERNEL_OVERHEAD_S = 5e-6


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
        `soapjax.cost.operators.CostModel.measure_until`).
    """

    forward_s: float
    backward_s: float
    source: str


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
        floats = [d for d in dtypes if is_float(d)]
        return max(floats or dtypes, key=lambda d: d.itemsize).name
    floats = [np.dtype(o.dtype) for o in op.inputs if is_float(o.dtype)]
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


def backward_share(graph: OpGraph, j: int) -> float:
    """The part of operator `j`'s analytic backward (twice its forward: a matmul's input and
    weight gradients) the step computes. Where the operator's matmul or convolution reads
    parameters, its weight gradient is half and the gradient of what it reads beside them
    the other half; a side nothing differentiates is left out (`soapjax.graph._cotangents`):
    a frozen weight (`OpGraph.frozen`: a LoRA's base matmuls compute their input gradient
    alone), or a first layer's batch input (its weight gradient alone). 1 otherwise."""
    def share() -> float:
        op = graph.operators[j]
        local = graph.program.local.get(op.name)
        if local is None or _find_anchor([graph.program.units[u].eqn
                                          for u in local.units]) is None:
            return 1.0
        diff = differentiated_operands(graph, j)
        params = [d for x, d in zip(op.inputs, diff) if x.kind == "param"]
        rest = [d for x, d in zip(op.inputs, diff) if x.kind != "param"]
        if not params or not any(diff):
            return 1.0
        return (any(params) + any(rest)) / 2
    return graph.memo(("backward_share", j), share)


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
