"""Slices, splits, concatenations and pads inside an operator along a dim its config may split.

The labels make a piece of a dim the same dim as the whole (`soapjax.graph._dims`: "a slice,
pad or split is the same dim"), so that splitting the whole splits each piece, each device
taking its fraction of each. XLA lays the whole out contiguously, though: with a fused
projection's ``2 F`` columns split over 4 devices (``gate, up = jnp.split(gate_up, 2, -1)``,
Phi-3's MLP, GPT-NeoX's fused QKV, Mamba's in-projection), devices 0-1 hold the gate and 2-3
the up, and a gate split over all four must move: device 1's quarter of the gate sits on
device 0, device 3's on device 1. XLA's SPMD partitioner moves such pieces with
collective-permutes, one per distance between the device holding an element and the device
needing it; the transposes in the backward (the cotangents concatenated, padded) move as much
back. A slice along a split dim whose shards stay put (a stride-2 slice of a dim split into
even blocks, patch merging's) moves nothing.

`inner_cuts` finds such equations in an operator's own equations (not the bodies of its loops,
as `soapjax.graph._inner`), and `moved_elements` says how many elements along the cut dim a
device receives when that dim is split `degree` ways: per distance between devices, the most
any device receives from the device that far away, summed over the distances (one
collective-permute each). XLA's halo exchange sends more where a piece's blocks straddle
several of the whole's, and less where it sends one block for several distances: how far
apart they are is measured in docs/checks.md ("Pieces of a split dim").

    >>> import jax.numpy as jnp
    >>> from soapjax.graph.opgraph import trace
    >>> def f(p, x):  # a fused projection, split in two
    ...     gate, up = jnp.split(x @ p["w"], 2, axis=-1)
    ...     return jnp.sum(gate * up)
    >>> g = trace(f, {"w": jnp.ones((8, 16))}, jnp.ones((4, 8)))
    >>> [(c.primitive, c.whole, c.pieces) for c in inner_cuts(g, 0)]
    [('split', 16, ((0, 8, 1), (8, 8, 1)))]
    >>> moved_elements(inner_cuts(g, 0)[0], 2)  # device 1 needs gate[4:8], held by device 0
    8.0
"""

from __future__ import annotations

import math
from typing import NamedTuple

from soapjax.graph._cotangents import values_from_params
from soapjax.graph.opgraph import OpGraph

_CUTS = frozenset({"slice", "split", "concatenate", "pad"})


class InnerCut(NamedTuple):
    """One equation that cuts a dim into pieces, or joins pieces into it (`inner_cuts`).

    Attributes:
      primitive: ``slice``, ``split``, ``concatenate`` or ``pad``.
      dim: the iteration dim the cut dim follows.
      whole: the whole's extent along it (the operand's for a slice or split, the result's
        for a concatenation or pad).
      pieces: per piece, ``(start, length, stride)`` in the whole's coordinates: a slice's or
        a split's results, a concatenation's operands, a pad's operand.
      joins: whether the pieces are joined into the whole (concatenate, pad) rather than cut
        from it.
      shape, dtype, dims: the whole's global shape, dtype, and per dim the iteration dim it
        follows (None: none), for its bytes.
      backward: whether the backward pass moves the pieces' cotangents back (the pieces are
        computed from the parameters, in a float type).
    """

    primitive: str
    dim: int
    whole: int
    pieces: tuple[tuple[int, int, int], ...]
    joins: bool
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]
    backward: bool


def inner_cuts(graph: OpGraph, j: int) -> tuple[InnerCut, ...]:
    """The equations of operator `j` that cut or join a dim one of its iteration dims follows."""
    return graph.memo(("inner_cuts", j), lambda: _find(graph, j))


def _pieces(name: str, params: dict, shapes: list[tuple[int, ...]], axis: int
            ) -> tuple[tuple[int, int, int], ...] | None:
    if name == "split":
        out, start = [], 0
        for size in params["sizes"]:
            out.append((start, int(size), 1))
            start += int(size)
        return tuple(out)
    if name == "concatenate":
        out, start = [], 0
        for shape in shapes:
            out.append((start, shape[axis], 1))
            start += shape[axis]
        return tuple(out)
    if name == "slice":
        strides = params.get("strides") or (1,) * len(shapes[0])
        step = int(strides[axis])
        first, limit = int(params["start_indices"][axis]), int(params["limit_indices"][axis])
        return ((first, max(0, -(-(limit - first) // step)), step),)
    lo, hi, interior = params["padding_config"][axis]  # pad
    if lo < 0 or hi < 0 or interior:
        return None
    return ((int(lo), shapes[0][axis], 1),)


def _find(graph: OpGraph, j: int) -> tuple[InnerCut, ...]:
    op = graph.operators[j]
    prog = graph.program
    loc = prog.local.get(op.name)
    if loc is None:
        return ()
    from_params = values_from_params(graph)

    out = []
    for i in loc.units:
        u = prog.units[i]
        name = u.eqn.primitive.name
        if name not in _CUTS or not u.ins or u.ins[0] not in loc.lab:
            continue
        joins = name in ("concatenate", "pad")
        whole = u.outs[0] if joins else u.ins[0]
        if whole is None or whole not in loc.lab:
            continue
        if name == "concatenate":
            axis, operands = u.eqn.params["dimension"], u.ins
        elif name == "pad":
            axis, operands = _pad_axis(u.eqn.params["padding_config"]), u.ins[:1]
        elif name == "split":
            axis, operands = u.eqn.params["axis"], u.ins[:1]
        else:
            axis, operands = _slice_axis(prog.shapes[u.ins[0]], u.eqn.params), u.ins[:1]
        if axis is None:
            continue
        dims = loc.dims_of(whole)
        dim = dims[axis] if dims[axis] is not None else major_dim(loc, loc.lab[whole][axis])
        if dim is None:
            continue
        pieces = _pieces(name, u.eqn.params, [tuple(prog.shapes[v]) for v in operands], axis)
        if not pieces:
            continue
        cut = [v for v in (u.ins if joins else u.outs) if v is not None]
        backward = ("float" in prog.dtypes[whole]
                    and any(v in from_params for v in cut))
        dims = dims[:axis] + (dim,) + dims[axis + 1:]  # split as its major part is
        out.append(InnerCut(name, dim, prog.shapes[whole][axis], pieces, joins,
                            tuple(prog.shapes[whole]), prog.dtypes[whole], dims, backward))
    return tuple(out)


def major_dim(loc, label: int) -> int | None:
    """The iteration dim of the major part a reshape splits `label` into, if any: the cut dim
    is then split into contiguous blocks as that part is (heads after a fused projection, cut
    into queries, keys and values before the reshape)."""
    parts = loc.labels.parts_of(label)
    return loc.labels.lookup(parts[0], loc.iter_of) if parts else None


def _pad_axis(config) -> int | None:
    """The one dim a pad changes, or None (none, or several: not priced)."""
    changed = [a for a, (lo, hi, interior) in enumerate(config) if lo or hi or interior]
    return changed[0] if len(changed) == 1 else None


def _slice_axis(shape, params) -> int | None:
    """The one dim a slice cuts, or None (none, or several: not priced)."""
    strides = params.get("strides") or (1,) * len(shape)
    changed = [a for a, n in enumerate(shape)
               if params["start_indices"][a] or params["limit_indices"][a] != n
               or strides[a] != 1]
    return changed[0] if len(changed) == 1 else None


def moved_elements(cut: InnerCut, degree: int) -> float:
    """Elements along `cut`'s dim a device receives with that dim split `degree` ways, the
    whole and every piece in even contiguous blocks: per distance between devices, the most
    any device receives from the device that far away, summed over the distances (see the
    module docstring). 0 for one device."""
    if degree <= 1:
        return 0.0
    held = cut.whole / degree
    total = 0.0
    for start, length, stride in cut.pieces:
        part = length / degree
        worst: dict[int, float] = {}
        for i in range(degree):
            # piece elements t in [i part, (i+1) part) sit at whole position start + stride t.
            # Cut from the whole: device i needs them, device k holds [k held, (k+1) held).
            # Joined: device i needs whole block i, device k holds piece block k.
            if cut.joins:
                t0, t1 = (i * held - start) / stride, ((i + 1) * held - start) / stride
                ks = range(max(0, math.floor(t0 / part)), min(degree, math.ceil(t1 / part)))
            else:
                x0, x1 = start + stride * i * part, start + stride * (i + 1) * part
                ks = range(max(0, math.floor(x0 / held)), min(degree, math.ceil(x1 / held)))
            for k in ks:
                if k == i:
                    continue
                if cut.joins:
                    got = _overlap(k * part, (k + 1) * part, t0, t1)
                else:
                    got = _overlap(i * part, (i + 1) * part,
                                   (k * held - start) / stride, ((k + 1) * held - start) / stride)
                if got > 0:
                    worst[k - i] = max(worst.get(k - i, 0.0), got)
        total += sum(worst.values())
    return total


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    """Integer points t in [a0, a1) and in [b0, b1) (both ends real)."""
    lo, hi = max(math.ceil(a0), math.ceil(b0)), min(math.ceil(a1), math.ceil(b1))
    return float(max(0, hi - lo))


# --- transforms XLA computes whole ------------------------------------------------------------


class FftGather(NamedTuple):
    """An ``fft`` whose operand XLA gathers whole (`fft_gathers`).

    Attributes:
      shape, dtype, dims: the gathered value's global shape, dtype, and per dim the
        iteration dim it follows (None: none): the transform's operand, or (backward) its
        result, whose cotangent is gathered.
      backward: whether it is the backward's gather (of the result's cotangent).
    """

    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]
    backward: bool


def fft_gathers(graph: OpGraph, j: int) -> tuple[FftGather, ...]:
    """The all-gathers XLA's partitioner makes around operator `j`'s ``fft`` equations: it has
    no rule that partitions a transform, so it gathers a split operand whole (every dim, the
    batch's too), computes the transform on every device and slices the result where a split
    reader needs it (`tests/test_exactness.py::test_xla_still_gathers_an_fft_split_along_its_
    batch`); the backward gathers the result's cotangent likewise. Each transform is an
    operator of its own (the grouping anchors one at an ``fft``) whose operands and outputs
    apply holds in its layout, so each gathers, forward and backward; whether a gather moves
    anything depends on the config (a dim it splits), whether the backward's runs on the
    operator having a backward (`soapjax.graph._cotangents`)."""
    return graph.memo(("fft_gathers", j), lambda: _fft_gathers(graph, j))


def _fft_gathers(graph: OpGraph, j: int) -> tuple[FftGather, ...]:
    op, prog = graph.operators[j], graph.program
    loc = prog.local.get(op.name)
    if loc is None:
        return ()

    def gather(v: int | None, backward: bool) -> list[FftGather]:
        if v is None or v not in loc.lab:
            return []
        return [FftGather(tuple(prog.shapes[v]), prog.dtypes[v], loc.dims_of(v), backward)]

    out: list[FftGather] = []
    for i in loc.units:
        u = prog.units[i]
        if u.eqn.primitive.name == "fft":
            out += gather(u.ins[0], False) + gather(u.outs[0], True)
    return tuple(out)


def computed_degrees(graph: OpGraph, j: int, degrees: tuple[int, ...]) -> tuple[int, ...]:
    """The degrees operator `j`'s compute is priced and counted at under `degrees`: all 1
    where it holds a transform and `degrees` split a dim the transform's operand or result
    follows (XLA computes it whole on every device, `fft_gathers`), else `degrees`."""
    split = {d for g in fft_gathers(graph, j) for d in g.dims if d is not None and degrees[d] > 1}
    return (1,) * len(degrees) if split else degrees
