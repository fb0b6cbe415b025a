"""The collectives in compiled (post-SPMD) HLO text, and the mesh axes they run over.

``jax.jit(f).lower(...).compile().as_text()`` is the program XLA runs on each device, after the
SPMD partitioner has inserted the communication. Each collective is one instruction line:

    %all-gather = f32[64,1024]{1,0} all-gather(%param), channel_id=1,
        replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, dimensions={0}, ...

`collectives` reads every such line into an `HloCollective`: its kind, its data buffers, the
bytes per device (in the convention of `soapjax.topology.cluster.Topology.collective_time`), its
device groups, and, given the mesh, the mesh axes the groups span:

    >>> from soapjax.strategy.space import MeshShape
    >>> hlo_text = '''HloModule m, num_partitions=8
    ... ENTRY %main (p: f32[32,1024]) -> f32[64,1024] {
    ...   %p = f32[32,1024]{1,0} parameter(0)
    ...   %ag = f32[64,1024] all-gather(%p), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
    ... }'''
    >>> cs = collectives(hlo_text, MeshShape(("data", "model"), (2, 4)))
    >>> cs[0].kind, cs[0].nbytes, cs[0].replica_groups, cs[0].axes
    ('all-gather', 262144, ((0, 4), (1, 5), (2, 6), (3, 7)), ('data',))

What is read, and how:

* Kinds: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute. An async pair
  (``all-gather-start`` / ``all-gather-done``) counts once, at its ``-start``, under the base
  kind. An async op whose wrapped computation is printed out (``async-start``, ``calls=``) is
  found as the plain instruction inside that computation, so it also counts once.
* Bytes, per device: all-reduce, all-to-all and collective-permute: the buffer (a tuple's
  elements summed: all-to-all results are one tuple element per peer); all-gather: the gathered
  OUTPUT; reduce-scatter: the INPUT (output times group size). An async ``-start`` result is a
  tuple (operands, outputs, context...): the outputs are taken (all-reduce-start's result is its
  output already).
* Device groups, in the three ``replica_groups`` formats: an explicit list ``{{0,1},{2,3}}``
  (``{}``: all devices in one group); iota ``[G,S]<=[dims]T(perm)`` (``iota(prod(dims))``
  reshaped to dims, transposed by perm, cut into G groups of S); and the mesh form
  ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0':(2)2}`` (XLA's own mesh
  over the device ids, optionally permuted; the group is the listed axes, a sub-axis
  ``'a':(pre)size`` being the middle factor of axis ``a`` split as ``[pre, size, rest]``).
  collective-permute has ``source_target_pairs`` instead.
* Mesh axes: the ids in compiled HLO are positions in the program's device assignment, which for
  `jax.jit` over a `jax.sharding.Mesh` is ``mesh.devices.flat`` order. So by default the id at
  mesh coordinates ``(i, j, ...)`` is the row-major index of those coordinates; pass
  `device_ids` (an array of the mesh's shape) when the HLO numbers devices otherwise. A group's
  axes are the mesh axes along which its members' coordinates differ (for a collective-permute,
  along which any source and its target differ). A group may span only part of an axis (two of
  the four devices of ``model``): `HloCollective.group_size` then is smaller than the product
  of the axes' sizes.

Collectives are counted statically, one per instruction: one inside a loop body counts once
(`HloCollective.executions` says how many times one run of the program runs it).

The text itself (computations, types, the three group formats) is read by
`soapjax.measure._hlo_text`; this module makes collectives of it. The program's FLOPs, every loop
trip counted, are `hlo_flops` (`soapjax.measure._hlo_flops`, re-exported here), and the kernels one
run launches are `launched_kernels` (`soapjax.measure._hlo_text`, re-exported here).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from soapjax.base.collectives import HLO_OPCODES, bytes_sent
from soapjax.measure._hlo_flops import HloFlops as HloFlops, hlo_flops as hlo_flops
from soapjax.measure._hlo_text import (
    Inst,
    Module,
    balanced_end,
    callees,
    executions,
    ints,
    launched_kernels as launched_kernels,
    leaf_bytes,
    op_name,
    ops_outside_loops,
    parse_groups_at,
    parse_module,
    parse_replica_groups,
    parse_type,
    shape_str,
    type_leaves,
)

__all__ = ["KINDS", "HloCollective", "HloFlops", "collectives", "hlo_flops", "launched_kernels",
           "ops_outside_loops", "parse_replica_groups", "summarize"]

# The collectives' HLO opcodes (`soapjax.base.collectives`' table), async -start/-done halves aside.
KINDS: tuple[str, ...] = tuple(HLO_OPCODES)


class HloCollective(NamedTuple):
    """One collective instruction of compiled HLO.

    Attributes:
      kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` or
        ``"collective-permute"`` (async ``-start`` forms under their base kind).
      shapes: the data buffers the bytes are counted from, e.g. ``("f32[16,1,256]",) * 4``.
      nbytes: bytes per device, in the `Topology.collective_time` convention (module doc).
      replica_groups: the device groups (empty for collective-permute).
      axes: the mesh axes the groups span, in mesh order; None without a mesh, or where a device
        id is not on the mesh.
      source_target_pairs: collective-permute's (source, target) pairs, else empty.
      name: the instruction's name, e.g. ``"all-to-all.1"``.
      op_name: the ``metadata`` op_name (jax's name stack), or "".
      executions: how many times one run of the program executes it: the product of the
        ``known_trip_count`` of every while loop around it (1 outside loops; a loop without a
        known trip count counts once, a conditional's branches once each).
    """

    kind: str
    shapes: tuple[str, ...]
    nbytes: float
    replica_groups: tuple[tuple[int, ...], ...]
    axes: tuple[str, ...] | None
    source_target_pairs: tuple[tuple[int, int], ...] = ()
    name: str = ""
    op_name: str = ""
    executions: int = 1

    @property
    def sent(self) -> float:
        """Bytes each device sends in one execution (ring algorithm; `collectives.bytes_sent`)."""
        return bytes_sent(self.kind, self.nbytes, self.group_size)

    @property
    def group_size(self) -> int:
        """Devices per group (2 for a collective-permute: a source and its target)."""
        if self.source_target_pairs:
            return 2
        return len(self.replica_groups[0]) if self.replica_groups else 1


def collectives(
    hlo_text: str,
    mesh: Any = None,
    device_ids: Any = None,
    *,
    reduce_scatter_from_slices: bool = False,
    narrow_as_sent: bool = False,
) -> list[HloCollective]:
    """The collectives of compiled HLO text, in text order.

    Args:
      hlo_text: ``compiled.as_text()`` (one or more computations; the module header line, if
        present, gives the device count that ``replica_groups={}`` stands for).
      mesh: the mesh the program was partitioned over: a `soapjax.strategy.space.MeshShape`, a
        `jax.sharding.Mesh` or anything with ``axis_names`` and ``axis_sizes``. Without it,
        ``axes`` is None.
      device_ids: the HLO device id at each mesh position, an array of the mesh's shape;
        default ``arange(num_devices)`` in row-major order, which is right for `jax.jit` HLO.
      reduce_scatter_from_slices: report an all-reduce whose only user dynamic-slices it to
        1/group_size of its elements (directly or as a fusion around a dynamic-slice) as one
        reduce-scatter of the same input. The GPU pipeline's ``ReduceScatterCreator`` pass
        makes this rewrite; the CPU pipeline does not, so CPU HLO shows the pair.
      narrow_as_sent: report each float32 buffer of a collective that XLA:CPU widened from a
        2-byte float (bfloat16, float16) at that type, as the program's own types and a GPU
        send it: XLA:CPU's float normalization sends such collectives in float32, twice the
        bytes. Such a buffer: any of an all-reduce whose reduction its promotion pass renamed
        ``..._promoted``; else one that is a 2-byte value widened (a ``convert``, or a
        ``reduce`` of one, alone or as a fusion's root) and that every use narrows again
        (`_widened_from_narrow`).

    Returns:
      One `HloCollective` per collective instruction (``-done`` halves skipped).
    """
    module = parse_module(hlo_text)
    coords = _coordinates(mesh, device_ids) if mesh is not None else None
    runs = executions(module)
    out = []
    for comp_name, comp in module.computations.items():
        for inst in comp:
            base, suffix = _split_kind(inst.opcode)
            if base is None or suffix == "-done":
                continue
            leaves = type_leaves(_data_node(base, suffix, inst.type))
            if narrow_as_sent:
                leaves = _as_sent(leaves, _widened_from_narrow(inst, base, comp, module))
            nbytes = sum(leaf_bytes(leaf) for leaf in leaves)
            if base == "reduce-scatter" and (groups := _groups(inst, module.num_devices)):
                nbytes *= len(groups[0])  # the output is one member's part of the input
            slice_ = (
                _slicing_user(inst, module)
                if reduce_scatter_from_slices and base == "all-reduce" and not suffix
                else None
            )
            if slice_ is not None:  # its input is the all-reduce's buffer; its output the slice
                base, leaves = "reduce-scatter", type_leaves(parse_type(slice_.type))
            sliced = (_sliced_elements(inst, module)
                      if reduce_scatter_from_slices and base == "all-reduce" and not suffix
                      and len(leaves) > 1 else {})
            if sliced:  # a combined all-reduce: the buffers only sliced are reduce-scatters
                rest = [x for i, x in enumerate(leaves) if i not in sliced]
                parts = [type_leaves(parse_type(u.type))[0] for u in sliced.values()]
                whole = sum(leaf_bytes(leaves[i]) for i in sliced)
                c = _collective("reduce-scatter", inst, parts, whole, module.num_devices, coords)
                out.append(c._replace(executions=runs.get(comp_name, 1)))
                if not rest:
                    continue
                leaves, nbytes = rest, nbytes - whole
            c = _collective(base, inst, leaves, nbytes, module.num_devices, coords)
            out.append(c._replace(executions=runs.get(comp_name, 1)))
    return out


def summarize(colls: Iterable[HloCollective | Any], *,
              executed: bool = False) -> dict[str, tuple[int, float]]:
    """Per kind, ``(count, total bytes per device)``; works on `reshard.Collective` too.

    With ``executed=True`` a collective inside loops counts once per execution (its
    ``executions``): what one run of the program sends, rather than what its text holds.

    >>> from soapjax.cost.reshard import Collective
    >>> summarize([Collective("all_gather", 1024.0, ("data",)),
    ...            Collective("all_gather", 512.0, ("model",))])
    {'all_gather': (2, 1536.0)}
    """
    out: dict[str, tuple[int, float]] = {}
    for c in colls:
        k = getattr(c, "executions", 1) if executed else 1
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + k, b + k * c.nbytes)
    return out


def _split_kind(opcode: str) -> tuple[str | None, str]:
    for suffix in ("-start", "-done", ""):
        if opcode.endswith(suffix):
            base = opcode[: len(opcode) - len(suffix)] if suffix else opcode
            if base in KINDS:
                return base, suffix
    return None, ""


def _data_node(base: str, suffix: str, type_text: str) -> Any:
    """The part of a collective's result type that holds its data outputs."""
    node = parse_type(type_text)
    if suffix == "-start" and base != "all-reduce" and isinstance(node, list) and len(node) >= 2:
        return node[1]  # (operands, outputs, context...)
    return node


# --- mesh axes -----------------------------------------------------------------------------------


def _mesh_names_sizes(mesh: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    names = tuple(mesh.axis_names)
    sizes = getattr(mesh, "axis_sizes", None)
    if sizes is None:
        sizes = tuple(mesh.shape[n] for n in names)
    return names, tuple(int(s) for s in sizes)


def _coordinates(mesh: Any, device_ids: Any) -> tuple[tuple[str, ...], dict[int, tuple[int, ...]]]:
    names, sizes = _mesh_names_sizes(mesh)
    ids = np.arange(math.prod(sizes)) if device_ids is None else np.asarray(device_ids)
    ids = ids.reshape(sizes)
    return names, {int(ids[c]): c for c in np.ndindex(*sizes)}


def _axes_spanned(groups: Iterable[Sequence[int]], coords) -> tuple[str, ...] | None:
    names, where = coords
    spanned = [False] * len(names)
    for group in groups:
        if any(g not in where for g in group):
            return None
        first = where[group[0]]
        for g in group[1:]:
            for k, (a, b) in enumerate(zip(first, where[g])):
                spanned[k] |= a != b
    return tuple(n for n, s in zip(names, spanned) if s)


# --- one collective ------------------------------------------------------------------------------


def _groups(inst: Inst, num_devices: int | None) -> tuple[tuple[int, ...], ...]:
    m = re.search(r"replica_groups=", inst.attrs)
    if m:
        return parse_groups_at(inst.attrs, m.end(), num_devices)[0]
    return (tuple(range(num_devices)),) if num_devices is not None else ()


_NARROW = ("bf16", "f16")


def _widened_from_narrow(inst: Inst, base: str, comp: list[Inst], module: Module
                         ) -> list[str | None]:
    """Per operand of a collective of XLA:CPU's, the 2-byte float type (``"bf16"`` or
    ``"f16"``) its float32 buffer was in the program before XLA's float normalization widened
    it, else None (see `collectives`): every operand of an all-reduce whose reduction is named
    ``..._promoted`` (the type named as the module's other 2-byte floats are: both are 2
    bytes); else an operand that is a ``convert`` of a 2-byte float value, or a ``reduce`` of
    one (a 2-byte sum XLA:CPU accumulates in float32), alone or as the root of a fusion (a
    combined all-reduce of gradients holds both kinds and float32 ones)."""
    if base == "all-reduce" and any(c.endswith("_promoted")
                                    for c in callees(inst).get("to_apply", [])):
        narrow = "bf16" if any("bf16" in i.type for c in module.computations.values()
                               for i in c) else "f16"
        return [narrow] * len(inst.operands)
    local = {i.name: i for i in comp}
    out: list[str | None] = []
    for k, name in enumerate(inst.operands):
        if not _narrowed_after(inst, k, len(inst.operands), comp, module):
            out.append(None)  # the program used the float32 sum as float32: it sent float32
            continue
        source, scope = local.get(name), local
        if source is not None and source.opcode == "fusion":
            called = callees(source).get("calls", [])
            body = module.computations.get(called[0], []) if called else []
            source, scope = (body[-1], {i.name: i for i in body}) if body else (None, {})
        if source is not None and source.opcode == "reduce" and source.operands:
            source = scope.get(source.operands[0])  # a 2-byte reduce XLA:CPU ran in float32
        widened = (scope.get(source.operands[0]) if source is not None
                   and source.opcode == "convert" and source.operands else None)
        dtype = widened.type.split("[", 1)[0] if widened is not None else ""
        out.append(dtype if dtype in _NARROW else None)
    return out


def _narrowed_after(inst: Inst, k: int, n: int, comp: list[Inst], module: Module) -> bool:
    """Whether every use of a collective's `k`-th result (of `n`; a tuple's through its
    ``get-tuple-element``) converts it to a 2-byte float, directly or first thing inside a
    fusion (its parameters of that result's type read by such converts alone): the float32
    buffer is the normalization's, not the program's (a float32 gradient of a float32
    parameter, computed in bfloat16 and widened before its all-reduce, stays float32)."""
    names = {inst.name}
    if n > 1 or inst.type.startswith("("):
        names = {i.name for i in comp if i.opcode == "get-tuple-element"
                 and i.operands == (inst.name,) and re.search(rf"index={k}\b", i.attrs)}
    users = [(i, name) for i in comp for name in names if name in i.operands]
    if not users:
        return False
    for user, name in users:
        if user.opcode == "convert":
            if user.type.split("[", 1)[0] not in _NARROW:
                return False
            continue
        if user.opcode != "fusion":
            return False
        called = callees(user).get("calls", [])
        body = module.computations.get(called[0], []) if called else []
        kind = next((i.type for i in comp if i.name == name), "").split("{", 1)[0]
        params = {i.name for i in body if i.opcode == "parameter"
                  and i.type.split("{", 1)[0] == kind}
        reads = [i for i in body if params.intersection(i.operands)]
        if not params or not reads or any(i.opcode != "convert" or i.type.split("[", 1)[0]
                                          not in _NARROW for i in reads):
            return False
    return True


def _as_sent(leaves: list, narrow: list[str | None]) -> list:
    """`leaves` with each float32 buffer whose operand `narrow` names a 2-byte type at that
    type; where the buffers are not one per operand, only if every operand is narrow."""
    if len(narrow) != len(leaves):
        if not narrow or None in narrow:
            return leaves
        narrow = [narrow[0]] * len(leaves)
    return [(n, dims) if n and dtype == "f32" else (dtype, dims)
            for (dtype, dims), n in zip(leaves, narrow)]


def _collective(
    kind: str, inst: Inst, leaves: list, nbytes: float, num_devices: int | None, coords
) -> HloCollective:
    groups: tuple[tuple[int, ...], ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()
    if kind == "collective-permute":
        m = re.search(r"source_target_pairs=", inst.attrs)
        if m:
            end = balanced_end(inst.attrs, m.end())
            pairs = tuple(
                tuple(ints(p)) for p in re.findall(r"\{(\d+,\d+)\}", inst.attrs[m.end() : end])
            )
    else:
        groups = _groups(inst, num_devices)
    axes = None
    if coords is not None:
        span = [p for p in pairs if p[0] != p[1]] if kind == "collective-permute" else groups
        axes = _axes_spanned(span, coords)
    return HloCollective(
        kind,
        tuple(shape_str(leaf) for leaf in leaves),
        nbytes,
        groups,
        axes,
        pairs,
        inst.name,
        op_name(inst),
    )


def _slicing_user(inst: Inst, module: Module) -> Inst | None:
    """A dynamic-slice of 1/group_size of an all-reduce's result, if every use of the result is
    one (see `collectives`), else None.

    Uses are followed through layout-only instructions (copy, bitcast) and into the fusions
    that read the result; any other use (an elementwise add before the slice, a return) means
    XLA computes on the whole reduced buffer, and the all-reduce stays one. This is the
    pattern the GPU pipeline's ``ReduceScatterCreator`` rewrites (all-reduce, then a
    dynamic-slice), read after XLA:CPU's fusion pass has copied the slice into each of the
    result's consumers.
    """
    groups = _groups(inst, module.num_devices)
    try:
        ar = type_leaves(parse_type(inst.type))
    except ValueError:
        return None
    if len(ar) != 1 or not groups or len(groups[0]) < 2:
        return None
    slices: list[Inst] = []
    comp = next(c for c in module.computations.values() if inst in c)
    whole = math.prod(ar[0][1])
    if not _only_sliced(inst.name, comp, whole // len(groups[0]), module, slices, 0):
        return None
    return slices[0] if slices and whole % len(groups[0]) == 0 else None


def _sliced_elements(inst: Inst, module: Module) -> dict[int, Inst]:
    """Of an all-reduce of several buffers (XLA's combiner merged them), the buffers whose
    every use (through their ``get-tuple-element``) is a 1/group_size dynamic-slice, by index,
    each with one of its slices (see `_slicing_user`)."""
    groups = _groups(inst, module.num_devices)
    try:
        ar = type_leaves(parse_type(inst.type))
    except ValueError:
        return {}
    if len(ar) < 2 or not groups or len(groups[0]) < 2:
        return {}
    comp = next(c for c in module.computations.values() if inst in c)
    by_index: dict[int, list[Inst]] = {}
    for u in comp:
        if inst.name in u.operands:
            m = re.search(r"index=(\d+)", u.attrs)
            if u.opcode != "get-tuple-element" or m is None:
                return {}
            by_index.setdefault(int(m.group(1)), []).append(u)
    out = {}
    for i, gtes in by_index.items():
        whole = math.prod(ar[i][1])
        slices: list[Inst] = []
        if whole % len(groups[0]) == 0 and all(
                _only_sliced(g.name, comp, whole // len(groups[0]), module, slices, 0)
                for g in gtes) and slices:
            out[i] = slices[0]
    return out


_LAYOUT_ONLY = ("copy", "bitcast")


def _only_sliced(name: str, comp: list[Inst], part: int, module: Module, slices: list[Inst],
                 depth: int) -> bool:
    """Whether every use of value `name` in `comp` is a dynamic-slice of `part` elements of it
    (through layout-only instructions and fusion parameters); the slices go into `slices`."""
    users = [u for u in comp if name in u.operands]
    if not users or depth > 8:
        return False
    for u in users:
        if u.opcode == "dynamic-slice" and u.operands[0] == name:
            try:
                leaves = type_leaves(parse_type(u.type))
            except ValueError:
                return False
            if len(leaves) != 1 or math.prod(leaves[0][1]) != part:
                return False
            slices.append(u)
        elif u.opcode in _LAYOUT_ONLY:
            if not _only_sliced(u.name, comp, part, module, slices, depth + 1):
                return False
        elif u.opcode == "fusion":
            called = callees(u).get("calls", [])
            body = module.computations.get(called[0], []) if called else []
            params = {int(m.group(1)): i.name for i in body if i.opcode == "parameter"
                      and (m := re.match(r"param_(\d+)", i.name))}
            for k, operand in enumerate(u.operands):
                if operand == name and (k not in params or not _only_sliced(
                        params[k], body, part, module, slices, depth + 1)):
                    return False
        else:
            return False
    return True
