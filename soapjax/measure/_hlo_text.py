"""HLO text as data: computations of instructions, how often each runs, types, device groups.

What `soapjax.measure.hlo` reads collectives from, `soapjax.measure._hlo_flops` counts FLOPs with,
and `soapjax.measure._timing` counts hoisted work with (`ops_outside_loops`): `parse_module` splits
``compiled.as_text()`` into computations of instructions (name, result type, opcode, operands,
the attributes after them); `callees`, `trip_count`, `op_name` and `attribute` read an
instruction's attributes; `executions` says how many times one run of the entry computation
runs each computation (a while body ``known_trip_count`` times); `parse_type` reads a result
type as nested ``(dtype, dims)`` leaves and `leaf_bytes` prices one (sub-byte types as
fractions); `parse_replica_groups` reads ``replica_groups=`` in its three formats (explicit
list, iota, mesh). `soapjax.measure.hlo`'s docstring describes the formats; it re-exports
`ops_outside_loops` and `parse_replica_groups`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

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


# --- the module: computations of instructions ----------------------------------------------------


class Inst(NamedTuple):
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


class Module(NamedTuple):
    computations: dict[str, list[Inst]]
    num_devices: int | None


_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INST = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_NUM_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_NUM_REPLICAS = re.compile(r"replica_count=(\d+)")


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text)


def parse_module(text: str) -> Module:
    """The computations of an HLO module's text, each a list of its instructions (comments
    dropped), and the device count its header gives (None without one)."""
    text = _strip_comments(text)
    comps: dict[str, list[Inst]] = {}
    current: list[Inst] = comps.setdefault("", [])
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
    return Module(comps, num_devices)


# --- attributes: called computations, loop trips, op names, windows ----------------------------

_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation"
    r"|select|scatter)=(\{[^}]*\}|%?[\w.\-]+)")
_NAME = re.compile(r"%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")
_PARAMETER = re.compile(r"%([\w.\-]+) = \S+ parameter\((\d+)\)")


def callees(inst: Inst) -> dict[str, list[str]]:
    """The computations an instruction calls, by attribute: a while loop's ``body`` and
    ``condition``, a fusion's or call's ``calls``/``to_apply``, a reducer's ``to_apply``, a
    conditional's ``branch_computations`` (or ``true_computation``/``false_computation``), a
    select-and-scatter's ``select`` and ``scatter``.

    >>> inst = Inst("w", "f32[4]", "while", ("y",), ", condition=%c, body=%b")
    >>> callees(inst)
    {'condition': ['c'], 'body': ['b']}
    """
    return {attr: _NAME.findall(value) for attr, value in _CALLED.findall(inst.attrs)}


def trip_count(inst: Inst) -> int:
    """How many times a while loop runs its body: XLA's ``known_trip_count``, 1 without one."""
    m = _TRIP_COUNT.search(inst.attrs)
    return int(m.group(1)) if m else 1


def op_name(inst: Inst) -> str:
    """The JAX op name XLA kept in the instruction's metadata ('' without one)."""
    m = _OP_NAME.search(inst.attrs)
    return m.group(1) if m else ""


def without_metadata(attrs: str) -> str:
    """An instruction's attributes without its ``metadata={...}`` (op name, source line)."""
    return _METADATA.sub("", attrs)


def attribute(inst: Inst, key: str) -> str | None:
    """The value of attribute `key` (``dim_labels=b01f_01io->b01f``, the inside of a braced one:
    ``window={size=2x2}`` is ``size=2x2``), None where the instruction has none."""
    m = re.search(rf"\b{re.escape(key)}=(?:\{{([^}}]*)\}}|([^,\s]+))", inst.attrs)
    if not m:
        return None
    return m.group(1) if m.group(1) is not None else m.group(2)


def parameter_numbers(text: str) -> dict[str, int]:
    """Per ``parameter(k)`` instruction of an HLO module's text, its number `k` (the position
    of the caller's operand it stands for)."""
    return {m.group(1): int(m.group(2)) for m in _PARAMETER.finditer(text)}


# --- how often each computation runs -------------------------------------------------------------


def executions(module: Module) -> dict[str, int]:
    """Per computation, how many times one run of the entry computation executes it.

    A while loop's body and condition run ``known_trip_count`` times per execution of the
    loop (once when XLA did not record a count); other called computations (calls, fusions,
    conditional branches, reducers) once per execution of their caller. Computations reached
    along several paths add up.
    """
    calls: dict[str, list[tuple[str, int]]] = {}
    for caller, insts in module.computations.items():
        for inst in insts:
            trip = trip_count(inst) if inst.opcode == "while" else 1
            for attr, names in callees(inst).items():
                for callee in names:
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


_NOT_KERNELS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                          "after-all"})


def launched_kernels(text: str) -> int:
    """How many kernels (XLA:CPU thunks, GPU kernel launches) one run of a compiled module
    launches: each instruction of the entry computation but parameters, constants, tuples,
    bitcasts and tokens counts once (a fusion is one kernel); a while loop counts its body and
    condition `known_trip_count` times (once without one), a call its callee, a conditional
    its costliest branch.

    >>> launched_kernels('''HloModule m
    ... %b (p: f32[4]) -> f32[4] {
    ...   %p = f32[4] parameter(0)
    ...   %e = f32[4] exponential(%p)
    ...   ROOT %f = f32[4] negate(%e)
    ... }
    ... %c (p: f32[4]) -> pred[] {
    ...   %p = f32[4] parameter(0)
    ...   ROOT %t = pred[] constant(true)
    ... }
    ... ENTRY %main (x: f32[4]) -> f32[4] {
    ...   %x = f32[4] parameter(0)
    ...   %y = f32[4] exponential(%x)
    ... %w = f32[4] while(%y), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"3"}}
    ... }''')
    7
    """
    module = parse_module(text)
    entry = re.search(r"^\s*ENTRY\s+%?([\w.\-]+)", _strip_comments(text), re.MULTILINE)
    memo: dict[str, int] = {}

    def count(comp: str, depth: int) -> int:
        if comp in memo or depth > len(module.computations):
            return memo.get(comp, 0)
        total = 0
        for inst in module.computations.get(comp, ()):
            if inst.opcode in _NOT_KERNELS:
                continue
            called = callees(inst)
            if inst.opcode == "while":
                total += trip_count(inst) * sum(
                    count(c, depth + 1) for a in ("body", "condition") for c in called.get(a, ()))
            elif inst.opcode == "call":
                total += sum(count(c, depth + 1) for c in called.get("to_apply", ()))
            elif inst.opcode == "conditional":
                branches = [count(c, depth + 1) for a, cs in called.items() for c in cs]
                total += 1 + max(branches, default=0)
            else:
                total += 1
        memo[comp] = total
        return total

    return count(entry.group(1), 0) if entry else 0


def ops_outside_loops(text: str, opcode: str) -> int:
    """How many `opcode` instructions of an HLO module run outside every while loop.

    Follows calls, fusions, reducers and branches from the entry computation, never into a
    while loop's body or condition: what it counts was hoisted out of the loops (the timing
    loop of `soapjax.measure._timing` must keep its work inside).

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
    module = parse_module(text)
    calls: dict[str, list[str]] = {}
    called: set[str] = set()
    for caller, insts in module.computations.items():
        for inst in insts:
            for names in callees(inst).values():
                called.update(names)
                if inst.opcode != "while":
                    calls.setdefault(caller, []).extend(names)
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


def _parse_inst(name: str, rest: str) -> Inst | None:
    rest = rest.strip()
    type_end = balanced_end(rest, 0) if rest.startswith("(") else rest.find(" ")
    if type_end <= 0:
        return None
    m = _OPCODE.match(rest, type_end)
    if not m:
        return None
    open_at = m.end() - 1
    close_at = balanced_end(rest, open_at)
    operands = tuple(_OPERAND.findall(rest[open_at:close_at]))
    return Inst(name, rest[:type_end].strip(), m.group(1), operands, rest[close_at:])


def balanced_end(text: str, start: int) -> int:
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


# --- shapes and bytes ----------------------------------------------------------------------------

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def parse_type(text: str) -> Any:
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
        j = balanced_end(text, j)
    return (m.group(1), dims), j


def type_leaves(node: Any) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(node, tuple):
        return [node]
    return [leaf for item in node for leaf in type_leaves(item)]


def shape_str(leaf: tuple[str, tuple[int, ...]]) -> str:
    return f"{leaf[0]}[{','.join(map(str, leaf[1]))}]"


def leaf_bytes(leaf: tuple[str, tuple[int, ...]]) -> float:
    dtype, dims = leaf
    return _DTYPE_BYTES.get(dtype, 0) * math.prod(dims)


# --- device groups -------------------------------------------------------------------------------

_INTS = re.compile(r"\d+")
_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"mesh\[([^\]]*)\]")
_MESH_AXIS = re.compile(r"'([^']*)'=(\d+)")
_AXIS_REF = re.compile(r"'([^']*)'(?::\((\d+)\)(\d+))?")


def ints(text: str) -> list[int]:
    return [int(x) for x in _INTS.findall(text)]


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape)).reshape(reshape)
    return arr.transpose(perm) if perm else arr


def parse_groups_at(
    text: str, i: int, num_devices: int | None
) -> tuple[tuple[tuple[int, ...], ...], int]:
    if text.startswith("{", i):
        end = balanced_end(text, i)
        inner = text[i + 1 : end - 1].strip()
        if not inner:
            if num_devices is None:
                raise ValueError(
                    "replica_groups={} means every device; the device count is "
                    "unknown (no HloModule header with num_partitions)"
                )
            return (tuple(range(num_devices)),), end
        groups = tuple(tuple(ints(g)) for g in re.findall(r"\{([^{}]*)\}", inner))
        return groups, end
    m = _IOTA.match(text, i)
    if m:
        shape = ints(m.group(1))
        perm = ints(m.group(3)) if m.group(3) else None
        arr = _iota(ints(m.group(2)), perm).reshape(shape)
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
        end = balanced_end(text, d.end() - 1)
        spec = text[d.end() : end - 1].strip()
        iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
        if iota:
            devices = _iota(ints(iota.group(1)), ints(iota.group(2)) if iota.group(2) else None)
        else:
            devices = np.array(ints(spec))
        j = end
    devices = devices.reshape(sizes)
    b = re.compile(r"\s*\{").match(text, j)
    if not b:
        raise ValueError(
            f"mesh replica_groups without a {{axes}} list: {text[m.start() : j + 40]!r}"
        )
    end = balanced_end(text, b.end() - 1)
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
    groups, _ = parse_groups_at(text.strip(), 0, num_devices)
    return groups
