"""The GPU kernel model: one operator's shard as the kernels XLA:GPU runs for it, each priced.

A roofline per operator (`soapjax.cost.roofline`) prices an attention's score operator, a matmul
followed by a mask and a softmax, as the larger of its FLOPs and the bytes of its inputs and
outputs. A GPU runs it as two kernels: the GEMM writes the ``s x s`` scores to memory, then a
fused kernel reads them back, masks, normalises and writes the probabilities; their times add,
and the fused kernel moves twice the bytes the operator's outputs weigh. Where the topology's
device has a ``[device.kernels]`` table (`soapjax.topology.cluster.KernelSpec`), the analytic cost
model prices shards this way (`kernel_op_time`):

* **Kernels.** The shard program's equations (`soapjax.graph._local.operator_fn`, at shard shapes)
  are cut at every matmul and convolution: each is a GEMM kernel; the other equations join
  into fused kernels, one per connected group (XLA's loop and input fusions), cut again after
  every reduction, whose result must be in memory before its consumers run: a softmax is
  three kernels (max; exp and sum; normalise), a layer norm two (the statistics; normalise).
  A fused kernel reads what it takes from outside the group and writes what leaves it; a
  later kernel recomputes an elementwise value from its sources rather than reading it
  (XLA duplicates cheap producers into their consumers' fusions), so a softmax over float16
  scores reads them three times and writes its probabilities once (with the score GEMM's
  write and the next GEMM's read, the ~12 bytes per score element XLA:GPU's own attention
  moved on an H100, docs/accuracy.md); a group of only reshapes, transposes and broadcasts
  is folded into its neighbours' layouts (free).
  A gather reads only the rows it takes (an embedding lookup does not read its table). A
  group that reads only parameters (the cast of float32 master weights to float16) is left
  out: it runs once per step, not once per microbatch (XLA hoists it out of the microbatch
  loop; Megatron-LM keeps float16 copies of its weights), one pass over the weights where
  the optimizer's update makes seven.
* **GEMM time** ``max(compute, bytes / (B x memory_efficiency)) + launch``, with
  ``compute = waves x sms x 2 x tile_rows x tile_cols x k / (peak x gemm_efficiency)``: the
  ``batch x ceil(m / rows) x ceil(n / cols)`` output tiles run ``sms`` at a time, so a GEMM of
  1.05 waves costs two (tile and wave quantisation). Its dtype's peak is the datasheet's; a
  float32 matmul runs at ``float32_matmul`` where given (TF32 tensor cores: XLA's default
  precision on Ampere and later).
* **Fused kernel time** ``bytes / (B x memory_efficiency) + launch``: elementwise and
  reduction work on a GPU waits on memory.
* **Backward.** A GEMM's backward is the two GEMMs of its transposes (``m x k`` from
  ``m x n`` by ``n x k``: the input's gradient; ``k x n`` summed over ``m``: the weight's),
  priced the same way; a fused kernel's backward reads its saved inputs and the incoming
  gradient and writes the input gradients: twice its bytes, one kernel.

* **Flash attention** (`soapjax.base.attention.flash_attention`: the attention equation of an
  ``attention`` operator) is one kernel, `FlashKernel`: its two products' FLOPs (``4 B N T S H``,
  of which a causal mask leaves the ``(n + 1) / 2n`` of ``n x n`` 128-key tiles that it does
  not hide whole, work balanced over a context-parallel ring as Megatron-Core's and Llama 3's
  layouts balance it) at ``attention_efficiency`` of the peak, or its inputs' and output's
  bytes, whichever is slower; no ``T x S`` array reaches memory. Its backward recomputes the
  scores and makes three more products: 2.5 times the FLOPs, twice the bytes. An attention
  written with ``implementation="cudnn"`` whose shard keeps the whole sequence runs cuDNN's
  fused kernel: the same kernel at ``cudnn_attention_efficiency`` (`shard_kernels`).

An operator whose shard program holds a loop (scan, while) or a branch keeps the roofline:
the model does not look inside them.

Example: a ``[4096, 1024] @ [1024, 1024]`` float16 matmul on an A100 (108 SMs, 128 x 128
tiles) makes 32 x 8 = 256 tiles: 3 waves where 2.37 would do, so it costs 3 / 2.37 of its
FLOPs at the GEMM efficiency:

>>> spec = KernelSpec(gemm_efficiency=0.8, memory_efficiency=0.9, launch=3e-6, sms=108)
>>> g = Gemm(1, 4096, 1024, 1024, "float16", 2 * (4096 * 1024 + 1024 * 1024 + 4096 * 1024))
>>> round(gemm_time(g, 312e12, 2039e9, spec) * 1e6, 1)  # 34.4 us of FLOPs at 80%: 43.6 + 3
46.6
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from soapjax.base._dtypes import is_float
from soapjax.base.attention import attention_call, cudnn_eligible
from soapjax.base.errors import TopologyError
from soapjax.cost.roofline import OpTime, analytic_op_time
from soapjax.graph._inner import attention_call_of
from soapjax.graph._local import operator_fn
from soapjax.graph.opgraph import Operator, OpGraph
from soapjax.topology.cluster import DeviceSpec, KernelSpec

__all__ = ["FlashKernel", "FusedKernel", "Gemm", "Kernels", "causal_tiles", "flash_time",
           "fused_time", "kernel_classes",
           "gemm_time", "kernel_op_time",
           "kernels_time", "op_kernels", "shard_kernels"]

_GEMMS = ("dot_general", "conv_general_dilated")
# Equations that only relabel memory: a group of nothing else is folded into the layouts of
# the kernels around it.
_LAYOUT = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
                     "iota", "stop_gradient", "copy", "name"})
_SLICES = frozenset({"gather", "dynamic_slice", "slice"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "argmax", "argmin", "reduce_precision_sum", "cumsum",
                         "cummax", "cumlogsumexp", "reduce"})
# Equations whose sub-programs are inlined (calls); any other equation with a sub-program
# (scan, while, cond) makes the operator fall back to the roofline.
_CALL_PARAMS = {"pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
                "remat": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
                "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}


class Gemm(NamedTuple):
    """One matmul kernel: ``batch`` products of ``[m, k] @ [k, n]`` in `dtype`, moving
    `nbytes` (operands and result)."""

    batch: int
    m: int
    n: int
    k: int
    dtype: str
    nbytes: float

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    def transposes(self) -> tuple[Gemm, Gemm]:
        """The backward's two GEMMs: the input gradient (``m x k``, summed over ``n``) and the
        weight gradient (``k x n``, summed over ``m``)."""
        return (self._replace(n=self.k, k=self.n), self._replace(m=self.k, k=self.m))


class FusedKernel(NamedTuple):
    """One fused elementwise/reduction kernel moving `nbytes`; `reduces` where it holds a
    reduction (its result is what a later kernel reads)."""

    nbytes: float
    reduces: bool = False


class FlashKernel(NamedTuple):
    """One flash attention kernel: ``batch`` (sequences x query heads) attentions of `t`
    queries to `s` keys, head dims `h` (scores) and `hv` (values), in `dtype`, reading and
    writing `nbytes` (queries, keys, values, output), `causal` or not."""

    batch: int
    t: int
    s: int
    h: int
    hv: int
    dtype: str
    nbytes: float
    causal: bool
    implementation: str = "xla"  # "cudnn": cuDNN's fused kernel (its own efficiency)

    @property
    def flops(self) -> float:
        """The two products' FLOPs over the score tiles computed (module docstring)."""
        full = 2.0 * self.batch * self.t * self.s * (self.h + self.hv)
        return full * causal_tiles(self.s) if self.causal else full


_FLASH_TILE = 128  # keys per tile of a flash kernel (FlashAttention-2/3, cuDNN)


def causal_tiles(keys: int) -> float:
    """The fraction of a causal attention's ``n x n`` 128-key tiles that a flash kernel
    computes, those a causal mask does not hide whole: ``(n + 1) / 2n``.

    >>> causal_tiles(1024)
    0.5625
    """
    n = max(1, math.ceil(keys / _FLASH_TILE))
    return (n + 1) / (2 * n)
_FLASH_BACKWARD_FLOPS = 2.5  # recomputed q k^T, then dV, dP, dQ, dK: 5 products against 2


class Kernels(NamedTuple):
    """The kernels of one shard's forward, or None where the model does not apply (`why`)."""

    forward: tuple[Gemm | FusedKernel | FlashKernel, ...] | None
    why: str = ""


def _nbytes(aval: Any) -> float:
    return float(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _flat_eqns(jaxpr: jcore.Jaxpr, names: dict[Any, int],
               fresh: Iterator[int]) -> Iterator[tuple[Any, list[int | None], list[int]]]:
    """``(eqn, input value ids, output value ids)`` of `jaxpr`, calls inlined; `names` maps the
    jaxpr's input variables to value ids (literals read as None)."""

    def vid(v: Any) -> int | None:
        if isinstance(v, jcore.Literal):
            return None
        if v not in names:
            names[v] = next(fresh)
        return names[v]

    for eqn in jaxpr.eqns:
        key = _CALL_PARAMS.get(eqn.primitive.name)
        sub = eqn.params.get(key) if key and attention_call(eqn) is None else None
        if sub is not None:
            inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            inner_names = {iv: vid(ov) for iv, ov in zip(inner.invars, eqn.invars)}
            inner_names = {k: v for k, v in inner_names.items() if v is not None}
            yield from _flat_eqns(inner, inner_names, fresh)
            for ov, iv in zip(eqn.outvars, inner.outvars):
                if isinstance(iv, jcore.Literal):
                    names[ov] = next(fresh)
                else:
                    names[ov] = inner_names.setdefault(iv, next(fresh))
            continue
        yield eqn, [vid(v) for v in eqn.invars], [vid(v) for v in eqn.outvars]


def _gemm(eqn: Any) -> Gemm:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    dtypes = [np.dtype(a.dtype) for a in (lhs, rhs)]
    floats = [d for d in dtypes if is_float(d)] or dtypes
    dtype = max(floats, key=lambda d: d.itemsize).name
    nbytes = _nbytes(lhs) + _nbytes(rhs) + _nbytes(out)
    if eqn.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        batch = math.prod(lhs.shape[d] for d in lb)
        k = math.prod(lhs.shape[d] for d in lc)
        m = math.prod(s for d, s in enumerate(lhs.shape) if d not in lc and d not in lb)
        n = math.prod(s for d, s in enumerate(rhs.shape) if d not in rc and d not in rb)
        return Gemm(batch, m, n, k, dtype, nbytes)
    # A convolution as the implicit GEMM cuDNN runs: m = output positions x batch, n = output
    # features, k = what each output sums over.
    dn = eqn.params["dimension_numbers"]
    features = out.shape[dn.out_spec[1]]
    out_size = math.prod(out.shape)
    k = math.prod(rhs.shape) // max(features, 1) // max(eqn.params["feature_group_count"], 1)
    return Gemm(1, out_size // max(features, 1), features, max(k, 1), dtype, nbytes)


def _flash(eqn: Any) -> FlashKernel:
    """The flash kernel of an attention equation: queries ``[B, T, N, H]``, keys and values
    ``[B, S, K, H]``."""
    q, k, v = (x.aval for x in eqn.invars[:3])
    out = eqn.outvars[0].aval
    b, t, n, h = q.shape
    return FlashKernel(b * n, t, k.shape[1], h, v.shape[3], np.dtype(q.dtype).name,
                       sum(_nbytes(a) for a in (q, k, v, out)), attention_call(eqn).causal)


def flash_time(k: FlashKernel, peak: float, bandwidth: float, spec: KernelSpec, *,
               backward: bool = False) -> float:
    """Seconds of one flash attention kernel, or of its backward (module docstring)."""
    flops = k.flops * (_FLASH_BACKWARD_FLOPS if backward else 1.0)
    nbytes = k.nbytes * (2.0 if backward else 1.0)
    efficiency = spec.attention_efficiency or spec.gemm_efficiency
    if k.implementation == "cudnn":
        efficiency = spec.cudnn_attention_efficiency or efficiency
    compute = flops / (peak * efficiency)
    return max(compute, nbytes / (bandwidth * spec.memory_efficiency)) + spec.launch


def op_kernels(closed: jcore.ClosedJaxpr, params: Sequence[bool] = ()) -> Kernels:
    """The forward kernels of one shard program (see the module docstring).

    Args:
      closed: the shard program.
      params: per input, whether it is a parameter (`Operator.inputs` kind ``"param"``): a
        fused kernel that reads nothing else (the cast of float32 weights to the compute
        dtype) is left out.
    """
    jaxpr = closed.jaxpr
    names: dict[Any, int] = {}
    fresh = iter(range(10**9))
    for v in jaxpr.invars:
        names[v] = next(fresh)
    param_ids = {names[v] for v, p in zip(jaxpr.invars, params) if p}
    eqns = list(_flat_eqns(jaxpr, names, fresh))
    for eqn, _, _ in eqns:
        if (list(jcore.jaxprs_in_params(eqn.params)) and eqn.primitive.name not in _GEMMS
                and attention_call(eqn) is None):
            return Kernels(None, f"holds a {eqn.primitive.name}")
    outputs = {names[v] for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    size: dict[int, float] = {}
    for v, i in names.items():
        if hasattr(v, "aval"):
            size[i] = _nbytes(v.aval)
    # union-find over the non-GEMM equations joined by the values they pass each other
    parent = list(range(len(eqns)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer: dict[int, int] = {}
    gemm = [e.primitive.name in _GEMMS or attention_call(e) is not None for e, _, _ in eqns]
    for j, (_, _, outs) in enumerate(eqns):
        for o in outs:
            producer[o] = j
    # A reduction's result is in memory before anything uses it: its consumers run one
    # kernel later (a softmax is three kernels: max, exp-sum, normalise; a layer norm two).
    level = [0] * len(eqns)
    for j, (eqn, ins, _) in enumerate(eqns):
        if gemm[j]:
            continue
        for i in ins:
            p = producer.get(i) if i is not None else None
            if p is not None and not gemm[p]:
                level[j] = max(level[j], level[p] + (eqns[p][0].primitive.name in _REDUCTIONS))
    for j, (_, ins, _) in enumerate(eqns):
        if gemm[j]:
            continue
        for i in ins:
            p = producer.get(i) if i is not None else None
            if p is not None and not gemm[p] and level[p] == level[j]:
                parent[find(j)] = find(p)
    consumers: dict[int, set[int]] = {}
    for j, (_, ins, _) in enumerate(eqns):
        for i in ins:
            if i is not None:
                consumers.setdefault(i, set()).add(j)
    groups: dict[int, list[int]] = {}
    for j in range(len(eqns)):
        if not gemm[j]:
            groups.setdefault(find(j), []).append(j)
    kernels: list[tuple[int, Gemm | FusedKernel | FlashKernel]] = []
    for j in range(len(eqns)):
        if gemm[j]:
            eqn = eqns[j][0]  # a matmul, else an attention equation
            kernels.append((j, _gemm(eqn) if eqn.primitive.name in _GEMMS else _flash(eqn)))

    def recomputed(i: int) -> bool:  # an elementwise value of another fused kernel
        p = producer.get(i)
        return p is not None and not gemm[p] and eqns[p][0].primitive.name not in _REDUCTIONS

    def sources(i: int, seen: set[int]) -> set[int]:
        """What recomputing value `i` in a later kernel reads: back through elementwise
        producers to operator inputs, GEMM results and reduction results."""
        if i in seen:  # reached again through another path (x ^ (x >> 16)): counted once
            return set()
        if not recomputed(i):
            return {i}
        seen.add(i)
        return set().union(*(sources(x, seen) for x in eqns[producer[i]][1]
                             if x is not None)) if eqns[producer[i]][1] else set()

    for root, members in groups.items():
        if all(eqns[j][0].primitive.name in _LAYOUT for j in members):
            continue
        inside = set(members)
        outside = {i for j in members for i in eqns[j][1] if i is not None
                   and (producer.get(i) not in inside)}
        read = set().union(*(sources(i, set()) for i in outside)) if outside else set()
        if read and read <= param_ids:
            continue  # a weight cast: once per step, hoisted out of any microbatch loop
        # written: what a GEMM, the operator's outputs or a later kernel reads (a later fused
        # kernel recomputes an elementwise value from its sources instead: XLA duplicates
        # cheap producers into their consumers' fusions)
        written = {o for j in members for o in eqns[j][2]
                   if o in outputs or any(gemm[c] or (c not in inside and not recomputed(o))
                                          for c in consumers.get(o, ()))}
        nbytes = (sum(_read_bytes(i, eqns, consumers, size) for i in read)
                  + sum(size.get(o, 0.0) for o in written))
        if nbytes:
            reduces = any(eqns[j][0].primitive.name in _REDUCTIONS for j in members)
            kernels.append((min(members), FusedKernel(nbytes, reduces)))
    return Kernels(tuple(k for _, k in sorted(kernels, key=lambda x: x[0])))


def _read_bytes(value: int, eqns: Sequence[tuple[Any, list, list]],
                consumers: dict[int, set[int]], size: dict[int, float]) -> float:
    """Bytes a fused kernel reads of `value`: all of it, unless it only reaches (through
    casts and layout changes) the table operand of gathers and slices, which read only the
    rows they take (an embedding lookup reads its tokens' rows, not the table)."""
    taken, frontier, seen = 0.0, [value], set()
    while frontier:
        v = frontier.pop()
        for j in consumers.get(v, ()):
            if j in seen:
                continue
            seen.add(j)
            eqn, ins, outs = eqns[j]
            name = eqn.primitive.name
            if name in _SLICES and ins and ins[0] == v:
                taken += sum(size.get(o, 0.0) for o in outs)
            elif name in _LAYOUT or name == "convert_element_type":
                frontier.extend(outs)
            else:
                return size.get(value, 0.0)
    return min(taken, size.get(value, 0.0)) if seen else size.get(value, 0.0)


def gemm_time(g: Gemm, peak: float, bandwidth: float, spec: KernelSpec) -> float:
    """Seconds of one GEMM kernel (module docstring): quantised FLOPs or bytes, plus launch."""
    rows, cols = spec.tile
    tiles = g.batch * math.ceil(g.m / rows) * math.ceil(g.n / cols)
    waves = math.ceil(tiles / spec.sms)
    compute = waves * spec.sms * 2.0 * rows * cols * g.k / (peak * spec.gemm_efficiency)
    return max(compute, g.nbytes / (bandwidth * spec.memory_efficiency)) + spec.launch


def fused_time(k: FusedKernel, bandwidth: float, spec: KernelSpec) -> float:
    """Seconds of one fused memory-bound kernel."""
    return k.nbytes / (bandwidth * spec.memory_efficiency) + spec.launch


def _peak(device: DeviceSpec, spec: KernelSpec, dtype: str) -> float:
    if dtype == "float32" and spec.float32_matmul:
        return spec.float32_matmul
    try:
        return device.peak_flops_for(dtype)
    except TopologyError:  # an integer matmul the file gives no figure for: the float32 one
        return device.peak_flops_for("float32")


def kernels_time(kernels: Iterable[Gemm | FusedKernel | FlashKernel], device: DeviceSpec,
                 spec: KernelSpec, *, backward: bool = False) -> float:
    """Seconds of a shard's forward kernels, or (`backward`) of the backward they imply."""
    bw, total = device.memory_bandwidth, 0.0
    for k in kernels:
        if isinstance(k, FlashKernel):
            total += flash_time(k, _peak(device, spec, k.dtype), bw, spec, backward=backward)
        elif isinstance(k, Gemm):
            peak = _peak(device, spec, k.dtype)
            parts: Sequence[Gemm] = k.transposes() if backward else (k,)
            total += sum(gemm_time(g, peak, bw, spec) for g in parts)
        else:
            total += fused_time(k._replace(nbytes=2 * k.nbytes) if backward else k, bw, spec)
    return total


def kernel_classes(kernels: Kernels, device: DeviceSpec) -> dict[str, tuple[float, int]]:
    """One shard's kernels, forward and backward, as ``(seconds, kernels)`` per class, in the
    words of `soapjax.measure.stepprofile` (``gemm``, ``attention``: a flash kernel, ``reduction``,
    ``elementwise``), so a profile of the step compares class by class. Empty where the
    model does not apply (`Kernels.forward` is None) or the device has no kernel table."""
    spec, out = device.kernels, {}
    if spec is None or kernels.forward is None:
        return {}
    for k in kernels.forward:
        kind = ("attention" if isinstance(k, FlashKernel) else "gemm" if isinstance(k, Gemm)
                else "reduction" if k.reduces else "elementwise")
        seconds = (kernels_time([k], device, spec)
                   + kernels_time([k], device, spec, backward=True))
        count = 3 if isinstance(k, Gemm) else 2
        s, n = out.get(kind, (0.0, 0))
        out[kind] = (s + seconds, n + count)
    return out


def kernel_op_time(kernels: Kernels, op: Operator, degrees: tuple[int, ...],
                   device: DeviceSpec, dtype: str) -> OpTime:
    """One shard's forward and backward time from its kernels (`op_kernels`); the roofline
    (`soapjax.cost.roofline.analytic_op_time`) where the model does not apply."""
    spec = device.kernels
    if spec is None or kernels.forward is None:
        return analytic_op_time(op, degrees, device, dtype)
    return OpTime(kernels_time(kernels.forward, device, spec),
                  kernels_time(kernels.forward, device, spec, backward=True), "analytic")


def shard_kernels(graph: OpGraph, op: Operator, degrees: tuple[int, ...]) -> Kernels:
    """`op_kernels` of operator `op`'s shard program at `degrees` (traced: milliseconds). An
    attention operator written with ``implementation="cudnn"`` whose query sequence is whole
    (``degrees[1] == 1``) runs cuDNN's kernel where it can
    (`soapjax.base.attention.cudnn_eligible`): its flash kernel says so (the shard program,
    re-bound, is the blockwise one)."""
    try:
        fn, avals = operator_fn(graph, op.name, degrees, rules="primal")
        kernels = op_kernels(jax.make_jaxpr(fn)(*avals), [x.kind == "param" for x in op.inputs])
    except Exception as e:  # noqa: BLE001  an exotic equation: the roofline prices it
        return Kernels(None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    call = attention_call_of(graph, graph.index(op.name)) if op.anchor == "attention" else None
    if call is not None and call.implementation == "cudnn" and kernels.forward and (
            degrees[1] == 1):
        kernels = kernels._replace(forward=tuple(
            k._replace(implementation="cudnn") if isinstance(k, FlashKernel) and cudnn_eligible(
                (k.batch, k.t, 1, k.h), (k.batch, k.s, 1, k.h), k.dtype) else k
            for k in kernels.forward))
    return kernels

