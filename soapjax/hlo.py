"""The collectives in compiled (post-SPMD) HLO text, and the mesh axes they run over.

``jax.jit(f).lower(...).compile().as_text()`` is the program XLA runs on each device, after the
SPMD partitioner has inserted the communication. Each collective is one instruction line:

    %all-gather = f32[64,1024]{1,0} all-gather(%param), channel_id=1,
        replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, dimensions={0}, ...

`collectives` reads every such line into an `HloCollective`: its kind, its data buffers, the
bytes per device (in the convention of `soapjax.topology.Topology.collective_time`), its
device groups, and, given the mesh, the mesh axes the groups span:

    >>> from soapjax.space import MeshShape
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

Collectives are counted statically, one per instruction: one inside a loop body counts once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from soapjax.collectives import bytes_sent

KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

# Bytes per element of each HLO primitive type; sub-byte types count fractions of a byte.
_DTYPE_BYTES: dict[str, float] = {
    "pred": 1,
    "s2": 0.25,
    "u2": 0.25,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f4e2m1fn": 0.5,
    "f8e8m0fnu": 1,
    "f8e4m3": 1,
    "f8e4m3fn": 1,
    "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2": 1,
    "f8e5m2fnuz": 1,
    "f8e3m4": 1,
    "token": 0,
    "opaque": 0,
}


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
) -> list[HloCollective]:
    """The collectives of compiled HLO text, in text order.

    Args:
      hlo_text: ``compiled.as_text()`` (one or more computations; the module header line, if
        present, gives the device count that ``replica_groups={}`` stands for).
      mesh: the mesh the program was partitioned over: a `soapjax.space.MeshShape`, a
        `jax.sharding.Mesh` or anything with ``axis_names`` and ``axis_sizes``. Without it,
        ``axes`` is None.
      device_ids: the HLO device id at each mesh position, an array of the mesh's shape;
        default ``arange(num_devices)`` in row-major order, which is right for `jax.jit` HLO.
      reduce_scatter_from_slices: report an all-reduce whose only user dynamic-slices it to
        1/group_size of its elements (directly or as a fusion around a dynamic-slice) as one
        reduce-scatter of the same input. The GPU pipeline's ``ReduceScatterCreator`` pass
        makes this rewrite; the CPU pipeline does not, so CPU HLO shows the pair.

    Returns:
      One `HloCollective` per collective instruction (``-done`` halves skipped).
    """
    module = _parse_module(_strip_comments(hlo_text))
    coords = _coordinates(mesh, device_ids) if mesh is not None else None
    runs = _executions(module)
    out = []
    for comp_name, comp in module.computations.items():
        for inst in comp:
            base, suffix = _split_kind(inst.opcode)
            if base is None or suffix == "-done":
                continue
            leaves = _leaves(_data_node(base, suffix, inst.type))
            nbytes = sum(_leaf_bytes(leaf) for leaf in leaves)
            if base == "reduce-scatter" and (groups := _groups(inst, module.num_devices)):
                nbytes *= len(groups[0])  # the output is one member's part of the input
            slice_ = (
                _slicing_user(inst, module)
                if reduce_scatter_from_slices and base == "all-reduce" and not suffix
                else None
            )
            if slice_ is not None:  # its input is the all-reduce's buffer; its output the slice
                base, leaves = "reduce-scatter", _leaves(_parse_type(slice_.type))
            c = _collective(base, inst, leaves, nbytes, module.num_devices, coords)
            out.append(c._replace(executions=runs.get(comp_name, 1)))
    return out


def summarize(colls: Iterable[HloCollective | Any], *,
              executed: bool = False) -> dict[str, tuple[int, float]]:
    """Per kind, ``(count, total bytes per device)``; works on `reshard.Collective` too.

    With ``executed=True`` a collective inside loops counts once per execution (its
    ``executions``): what one run of the program sends, rather than what its text holds.

    >>> from soapjax.reshard import Collective
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


def parse_replica_groups(text: str, num_devices: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The groups of one ``replica_groups=`` value, in any of the three formats.

    >>> parse_replica_groups("[2,4]<=[4,2]T(1,0)")
    ((0, 2, 4, 6), (1, 3, 5, 7))
    >>> parse_replica_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}")
    ((0, 1, 2, 3), (4, 5, 6, 7))

    Args:
      text: the value, from its first character to the end of the format.
      num_devices: what ``{}`` (every device in one group) stands for; required for it.

    Raises:
      ValueError: text in none of the formats.
    """
    groups, _ = _parse_groups_at(text.strip(), 0, num_devices)
    return groups


# --- the module: computations of instructions ----------------------------------------------------


class _Inst(NamedTuple):
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


class _Module(NamedTuple):
    computations: dict[str, list[_Inst]]
    num_devices: int | None


_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INST = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_NUM_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_NUM_REPLICAS = re.compile(r"replica_count=(\d+)")


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text)


def _parse_module(text: str) -> _Module:
    comps: dict[str, list[_Inst]] = {}
    current: list[_Inst] = comps.setdefault("", [])
    num_devices = None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            parts = _NUM_PARTITIONS.search(line)
            reps = _NUM_REPLICAS.search(line)
            num_devices = (int(parts.group(1)) if parts else 1) * (
                int(reps.group(1)) if reps else 1
            )
            continue
        m = _INST.match(line)
        if m and not line.rstrip().endswith("{"):
            inst = _parse_inst(m.group(1), m.group(2))
            if inst is not None:
                current.append(inst)
            continue
        h = _HEADER.match(line)
        if h:
            current = comps.setdefault(h.group(1), [])
    return _Module(comps, num_devices)


_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation)="
    r"(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _executions(module: _Module) -> dict[str, int]:
    """Per computation, how many times one run of the entry computation executes it.

    A while loop's body and condition run ``known_trip_count`` times per execution of the
    loop (once when XLA did not record a count); other called computations (calls, fusions,
    conditional branches, reducers) once per execution of their caller. Computations reached
    along several paths add up.
    """
    calls: dict[str, list[tuple[str, int]]] = {}
    for caller, insts in module.computations.items():
        for inst in insts:
            trip = 1
            if inst.opcode == "while":
                m = _TRIP_COUNT.search(inst.attrs)
                trip = int(m.group(1)) if m else 1
            for attr, value in _CALLED.findall(inst.attrs):
                for callee in re.findall(r"%?([\w.\-]+)", value):
                    n = trip if attr in ("body", "condition") else 1
                    calls.setdefault(caller, []).append((callee, n))
    called = {c for edges in calls.values() for c, _ in edges}
    runs: dict[str, int] = {}

    def visit(comp: str, times: int, depth: int) -> None:
        if depth > len(module.computations):  # a cycle: HLO has none, but never loop forever
            return
        runs[comp] = runs.get(comp, 0) + times
        for callee, n in calls.get(comp, ()):
            visit(callee, times * n, depth + 1)

    for root in module.computations:
        if root not in called:
            visit(root, 1, 0)
    return runs


def ops_outside_loops(text: str, opcode: str) -> int:
    """How many `opcode` instructions of an HLO module run outside every while loop.

    Follows calls, fusions, reducers and branches from the entry computation, never into a
    while loop's body or condition: what it counts was hoisted out of the loops (the timing
    loop of `soapjax._timing` must keep its work inside).

    >>> ops_outside_loops('''HloModule m
    ... %body (p: f32[4]) -> f32[4] {
    ...   %p = f32[4] parameter(0)
    ...   ROOT %e = f32[4] exponential(%p)
    ... }
    ... ENTRY %main (x: f32[4]) -> f32[4] {
    ...   %x = f32[4] parameter(0)
    ...   %y = f32[4] exponential(%x)
    ...   ROOT %w = f32[4] while(%y), condition=%cond, body=%body
    ... }''', "exponential")
    1
    """
    module = _parse_module(_strip_comments(text))
    calls: dict[str, list[str]] = {}
    called: set[str] = set()
    for caller, insts in module.computations.items():
        for inst in insts:
            for _, value in _CALLED.findall(inst.attrs):
                callees = re.findall(r"%?([\w.\-]+)", value)
                called.update(callees)
                if inst.opcode != "while":
                    calls.setdefault(caller, []).extend(callees)
    todo = [c for c in module.computations if c not in called]
    seen: set[str] = set()
    count = 0
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in module.computations:
            continue
        seen.add(comp)
        count += sum(inst.opcode == opcode for inst in module.computations[comp])
        todo += calls.get(comp, ())
    return count


def _parse_inst(name: str, rest: str) -> _Inst | None:
    rest = rest.strip()
    type_end = _balanced_end(rest, 0) if rest.startswith("(") else rest.find(" ")
    if type_end <= 0:
        return None
    m = _OPCODE.match(rest, type_end)
    if not m:
        return None
    open_at = m.end() - 1
    close_at = _balanced_end(rest, open_at)
    operands = tuple(_OPERAND.findall(rest[open_at:close_at]))
    return _Inst(name, rest[:type_end].strip(), m.group(1), operands, rest[close_at:])


def _balanced_end(text: str, start: int) -> int:
    """Index just past the bracket group that opens at `start`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(
        f"unbalanced brackets in HLO text from column {start}: {text[start : start + 80]!r}"
    )


def _split_kind(opcode: str) -> tuple[str | None, str]:
    for suffix in ("-start", "-done", ""):
        if opcode.endswith(suffix):
            base = opcode[: len(opcode) - len(suffix)] if suffix else opcode
            if base in KINDS:
                return base, suffix
    return None, ""


# --- shapes and bytes ----------------------------------------------------------------------------

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _parse_type(text: str) -> Any:
    """An HLO type as a nested list of ``(dtype, dims)`` leaves."""
    node, _ = _parse_type_at(text.strip(), 0)
    return node


def _parse_type_at(text: str, i: int) -> tuple[Any, int]:
    if text.startswith("(", i):
        items = []
        i += 1
        while i < len(text) and text[i] != ")":
            if text[i] in ", ":
                i += 1
                continue
            item, i = _parse_type_at(text, i)
            items.append(item)
        return items, i + 1
    m = _ARRAY.match(text, i)
    if not m:
        raise ValueError(f"expected an HLO type like f32[16,32]{{1,0}}, found {text[i : i + 40]!r}")
    dims = tuple(int(d.replace("<=", "")) for d in m.group(2).split(",") if d.strip())
    j = m.end()
    if text.startswith("{", j):
        j = _balanced_end(text, j)
    return (m.group(1), dims), j


def _leaves(node: Any) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(node, tuple):
        return [node]
    return [leaf for item in node for leaf in _leaves(item)]


def _data_node(base: str, suffix: str, type_text: str) -> Any:
    """The part of a collective's result type that holds its data outputs."""
    node = _parse_type(type_text)
    if suffix == "-start" and base != "all-reduce" and isinstance(node, list) and len(node) >= 2:
        return node[1]  # (operands, outputs, context...)
    return node


def _shape_str(leaf: tuple[str, tuple[int, ...]]) -> str:
    return f"{leaf[0]}[{','.join(map(str, leaf[1]))}]"


def _leaf_bytes(leaf: tuple[str, tuple[int, ...]]) -> float:
    dtype, dims = leaf
    return _DTYPE_BYTES.get(dtype, 0) * math.prod(dims)


# --- device groups -------------------------------------------------------------------------------

_INTS = re.compile(r"\d+")
_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"mesh\[([^\]]*)\]")
_MESH_AXIS = re.compile(r"'([^']*)'=(\d+)")
_AXIS_REF = re.compile(r"'([^']*)'(?::\((\d+)\)(\d+))?")


def _ints(text: str) -> list[int]:
    return [int(x) for x in _INTS.findall(text)]


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape)).reshape(reshape)
    return arr.transpose(perm) if perm else arr


def _parse_groups_at(
    text: str, i: int, num_devices: int | None
) -> tuple[tuple[tuple[int, ...], ...], int]:
    if text.startswith("{", i):
        end = _balanced_end(text, i)
        inner = text[i + 1 : end - 1].strip()
        if not inner:
            if num_devices is None:
                raise ValueError(
                    "replica_groups={} means every device; the device count is "
                    "unknown (no HloModule header with num_partitions)"
                )
            return (tuple(range(num_devices)),), end
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", inner))
        return groups, end
    m = _IOTA.match(text, i)
    if m:
        shape = _ints(m.group(1))
        perm = _ints(m.group(3)) if m.group(3) else None
        arr = _iota(_ints(m.group(2)), perm).reshape(shape)
        return tuple(tuple(int(x) for x in row) for row in arr.reshape(shape[0], -1)), m.end()
    m = _MESH.match(text, i)
    if m:
        return _mesh_groups(text, m)
    raise ValueError(
        f"replica_groups in an unknown format: {text[i : i + 80]!r}; expected "
        "{{0,1},{2,3}}, [4,2]<=[8] or mesh['a'=4] {'a'}"
    )


def _mesh_groups(text: str, m: re.Match) -> tuple[tuple[tuple[int, ...], ...], int]:
    axes = _MESH_AXIS.findall(m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    n = math.prod(sizes)
    j = m.end()
    devices = np.arange(n)
    d = re.compile(r"\s*,\s*device_ids=\(").match(text, j)
    if d:
        end = _balanced_end(text, d.end() - 1)
        spec = text[d.end() : end - 1].strip()
        iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
        if iota:
            devices = _iota(_ints(iota.group(1)), _ints(iota.group(2)) if iota.group(2) else None)
        else:
            devices = np.array(_ints(spec))
        j = end
    devices = devices.reshape(sizes)
    b = re.compile(r"\s*\{").match(text, j)
    if not b:
        raise ValueError(
            f"mesh replica_groups without a {{axes}} list: {text[m.start() : j + 40]!r}"
        )
    end = _balanced_end(text, b.end() - 1)
    refs = [
        (names.index(a), int(pre) if pre else None, int(size) if size else None)
        for a, pre, size in _AXIS_REF.findall(text[b.end() : end - 1])
    ]
    return _groups_over_axes(devices, sizes, refs), end


def _groups_over_axes(
    devices: np.ndarray, sizes: Sequence[int], refs: Sequence[tuple[int, int | None, int | None]]
) -> tuple[tuple[int, ...], ...]:
    """Groups of the devices that differ only along `refs` (axis index, pre_size, size)."""
    # Split each referenced axis into factors so that every (sub-)axis is one array dim.
    factors: list[list[int]] = [[s] for s in sizes]
    by_axis: dict[int, list[tuple[int, int]]] = {}
    for k, (axis, pre, _size) in enumerate(refs):
        by_axis.setdefault(axis, []).append((k, pre))
    order: dict[int, tuple[int, int]] = {}  # ref -> (axis, factor index)
    for axis, items in by_axis.items():
        full = sizes[axis]
        if len(items) == 1 and items[0][1] is None:
            order[items[0][0]] = (axis, 0)
            continue
        subs = sorted(((refs[k][1], refs[k][2], k) for k, _ in items))
        dims, prefix = [], 1
        for pre, size, k in subs:
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            order[k] = (axis, len(dims))
            dims.append(size)
            prefix *= size
        if prefix != full:
            dims.append(full // prefix)
        factors[axis] = dims
    grouped_factor = [order[k] for k in range(len(refs))]
    offsets = np.cumsum([0] + [len(f) for f in factors])
    flat_dims = [d for f in factors for d in f]
    grouped = [int(offsets[a]) + f for a, f in grouped_factor]
    rest = [i for i in range(len(flat_dims)) if i not in grouped]
    arr = devices.reshape(flat_dims).transpose(rest + grouped)
    group_size = math.prod(flat_dims[i] for i in grouped)
    return tuple(tuple(int(x) for x in row) for row in arr.reshape(-1, group_size))


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


def _groups(inst: _Inst, num_devices: int | None) -> tuple[tuple[int, ...], ...]:
    m = re.search(r"replica_groups=", inst.attrs)
    if m:
        return _parse_groups_at(inst.attrs, m.end(), num_devices)[0]
    return (tuple(range(num_devices)),) if num_devices is not None else ()


def _collective(
    kind: str, inst: _Inst, leaves: list, nbytes: float, num_devices: int | None, coords
) -> HloCollective:
    groups: tuple[tuple[int, ...], ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()
    if kind == "collective-permute":
        m = re.search(r"source_target_pairs=", inst.attrs)
        if m:
            end = _balanced_end(inst.attrs, m.end())
            pairs = tuple(
                tuple(_ints(p)) for p in re.findall(r"\{(\d+,\d+)\}", inst.attrs[m.end() : end])
            )
    else:
        groups = _groups(inst, num_devices)
    axes = None
    if coords is not None:
        span = [p for p in pairs if p[0] != p[1]] if kind == "collective-permute" else groups
        axes = _axes_spanned(span, coords)
    op_name = re.search(r'op_name="([^"]*)"', inst.attrs)
    return HloCollective(
        kind,
        tuple(_shape_str(leaf) for leaf in leaves),
        nbytes,
        groups,
        axes,
        pairs,
        inst.name,
        op_name.group(1) if op_name else "",
    )


def _slicing_user(inst: _Inst, module: _Module) -> _Inst | None:
    """An all-reduce's only user, if it dynamic-slices 1/group_size of it (see `collectives`)."""
    users = [u for comp in module.computations.values() for u in comp if inst.name in u.operands]
    if len(users) != 1:
        return None
    user = users[0]
    if user.opcode == "fusion":
        called = re.search(r"calls=%?([\w.\-]+)", user.attrs)
        body = module.computations.get(called.group(1), []) if called else []
        if not any(i.opcode == "dynamic-slice" for i in body):
            return None
    elif user.opcode != "dynamic-slice":
        return None
    groups = _groups(inst, module.num_devices)
    try:
        ar, ds = _leaves(_parse_type(inst.type)), _leaves(_parse_type(user.type))
    except ValueError:
        return None
    if len(ar) != 1 or len(ds) != 1 or not groups or len(groups[0]) < 2:
        return None
    return user if math.prod(ar[0][1]) == math.prod(ds[0][1]) * len(groups[0]) else None
