"""The FLOPs of a compiled program, recounted from its HLO text by XLA's rules, loops unrolled.

XLA's `HloCostAnalysis` (what ``compiled.cost_analysis()["flops"]`` sums) counts a while loop's
body once, whatever its trip count, and one FLOP per element of every all-reduce (it assumes
two replicas). The simulator counts a loop once per step and prices an all-reduce as
communication. So `hlo_flops` recounts the compiled HLO by XLA's own rules (a multiply-add 2, an
elementwise op, compare, select or convert 1 per element, transcendentals apart, a reduction
(inputs - outputs) times its reducer, a pooling window (size - 1) per output, a convolution
its in-bounds taps, fusions and calls their bodies, layout and data movement nothing), with
each while body times its ``known_trip_count`` and the all-reduces apart. Counted with loops
once, this reproduces ``cost_analysis()`` on every zoo model and plan, to XLA's float32
rounding (`soapjax.check.compiled_flops` checks it).

`soapjax check` holds the count (`HloFlops.compute`) against the plan's (`soapjax.cost.flops`); the
text is read by `soapjax.measure._hlo_text`, and `soapjax.measure.hlo` re-exports `hlo_flops` and
`HloFlops`.

Example: ``tanh(c @ w) + 1`` on a ``[8, 16]`` carry and ``[16, 16]`` weights, scanned 10 times:
``cost_analysis()`` counts the loop body once, 4,226 FLOPs (the matmul's 4,096, the add's 128,
the loop counter's add and compare); `HloFlops.loop_extra` adds the other 9 trips
(tests/test_hlo.py).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from soapjax.base.collectives import HLO_OPCODES
from soapjax.measure import _hlo_text

__all__ = ["HloFlops", "hlo_flops"]

_TRANSCENDENTAL_OPS = frozenset({
    "acosh", "erf", "exponential", "log", "logistic", "power", "sqrt", "cbrt", "rsqrt", "tanh",
    "sine", "cosine", "exponential-minus-one", "log-plus-one", "atan2", "tan"})
# Collectives (`soapjax.base.collectives`' opcodes, with their async halves) count no FLOPs, but for
# the all-reduce XLA counts one per element (`_HloCounter.arithmetic`).
_COLLECTIVE_OPS = frozenset(f"{op}{half}" for op in HLO_OPCODES for half in ("", "-start", "-done"))
_FREE_OPS = frozenset({
    "parameter", "constant", "iota", "get-tuple-element", "tuple", "bitcast", "broadcast",
    "reshape", "transpose", "copy", "slice", "dynamic-slice", "dynamic-update-slice",
    "concatenate", "pad", "reverse", "gather", "partition-id", "replica-id",
    "after-all", "add-dependency", "opt-barrier", "copy-start", "copy-done", "send",
    "send-done", "recv", "recv-done", "domain", "rng-get-and-update-state",
    "get-dimension-size", "set-dimension-size", "async-update",
    "async-done", "dynamic-reshape", "batch-norm-training", "batch-norm-inference",
    "batch-norm-grad", "topk", "bitcast-convert"}) | (_COLLECTIVE_OPS - {"all-reduce",
                                                                         "all-reduce-start"})
_REDUCING_OPS = frozenset({"reduce", "reduce-window", "scatter", "map", "select-and-scatter",
                           "sort"})


class HloFlops(NamedTuple):
    """FLOPs per device of a compiled SPMD step, by XLA's rules over its HLO text.

    Attributes:
      flops, transcendentals: what ``cost_analysis()`` reports (loop bodies once).
      loop_extra: the FLOPs each while body adds run ``known_trip_count`` times, not once.
      all_reduce: XLA's one FLOP per element of each all-reduce, each loop trip counted.
      sliced_away: FLOPs XLA counts inside fusions for elements no output of the fusion
        needs (a fused multiply of 128 x 32 whose output slices 32 x 32: the kernel computes
        the 1,024 products it returns, XLA counts 4,096), each loop trip counted.
      parts: ``(phase, kind, flops)``, every trip counted: phase ``forward``, ``backward``
        (JAX's ``jvp`` and ``transpose(jvp)`` in the op names), ``update`` (other names: the
        optimizer) or ``unnamed`` (instructions XLA made without an op name, such as a
        contraction of one element rewritten as a multiply); kind ``matmul`` (dot,
        convolution), ``elementwise``, ``reduce``, ``all-reduce`` or ``loop`` (inside a while
        body).
    """

    flops: float
    transcendentals: float
    loop_extra: float
    all_reduce: float
    sliced_away: float
    duplicated: float
    parts: tuple[tuple[str, str, float], ...]

    @property
    def compute(self) -> float:
        """The step's arithmetic: every loop trip counted, all-reduces left to communication,
        fused work on elements nothing reads left out."""
        return self.flops + self.loop_extra - self.all_reduce - self.sliced_away


def hlo_flops(text: str) -> HloFlops:
    """Counts the FLOPs of compiled HLO text (``compiled.as_text()``) as described above."""
    return _HloCounter(text).count()


class _HloCounter:
    def __init__(self, text: str):
        self.module = _hlo_text.parse_module(text)
        self.types = {c: {i.name: i.type for i in insts}
                      for c, insts in self.module.computations.items()}
        self.parameter_number = _hlo_text.parameter_numbers(text)
        self.memo: dict[tuple[str, bool], dict[tuple[str, str], list[float]]] = {}
        self.runs = _hlo_text.executions(self.module)
        self.needed = {c: _needed_fraction(self.module.computations.get(c, []))
                       for insts in self.module.computations.values() for i in insts
                       if i.opcode == "fusion" for c in _fused(i)}

    def count(self) -> HloFlops:
        called = {c for insts in self.module.computations.values() for i in insts
                  for cs in _hlo_text.callees(i).values() for c in cs}
        roots = [c for c in self.module.computations if c and c not in called]
        once, every = {}, {}
        for r in roots:
            _merge(once, self.computation(r, False))
            _merge(every, self.computation(r, True))
        flops = sum(f for f, _ in once.values())
        unrolled = sum(f for f, _ in every.values())
        reduced = sum((f for (_, kind), (f, _) in every.items() if kind == "all-reduce"), 0.0)
        parts = tuple((phase, kind, f) for (phase, kind), (f, _) in sorted(every.items()))
        return HloFlops(flops, sum(t for _, t in once.values()), unrolled - flops, reduced,
                        self.sliced_away(), self.duplicated(), parts)

    def _flops(self, comp: str, inst) -> float:
        return sum(f for f, _ in self.instruction(comp, inst, False).values())

    def sliced_away(self) -> float:
        """FLOPs counted inside fusions for elements no fusion output needs, every run."""
        total = 0.0
        for comp, needed in self.needed.items():
            for inst in self.module.computations.get(comp, []):
                unread = 1.0 - needed.get(inst.name, 1.0)
                if unread > 0:
                    total += self._flops(comp, inst) * unread * self.runs.get(comp, 1)
        return total

    def duplicated(self) -> float:
        """FLOPs of fused instructions that compute what an earlier fusion of the same
        computation computed (the same operation on the same values), every run."""
        total = 0.0
        for comp, insts in self.module.computations.items():
            first: dict[Any, str] = {}
            for fusion in insts:
                for fused in _fused(fusion):
                    for inst, key in self._signatures(fusion, fused):
                        if first.setdefault(key, fusion.name) != fusion.name:
                            total += self._flops(fused, inst) * self.runs.get(comp, 1)
        return total

    def _signatures(self, fusion, fused: str):
        """``(instruction, signature)`` of the arithmetic a fusion computes on all of its
        elements: its parameters named by the caller's operands, constants by value."""
        sig: dict[str, Any] = {}
        needed = self.needed.get(fused, {})
        for inst in self.module.computations.get(fused, []):
            if inst.opcode == "parameter":
                k = self.parameter_number.get(inst.name, -1)
                sig[inst.name] = ("arg", fusion.operands[k] if 0 <= k < len(fusion.operands)
                                  else inst.name)
                continue
            sig[inst.name] = (inst.opcode, inst.type.split("{")[0],
                              _hlo_text.without_metadata(inst.attrs),
                              tuple(sig.get(o, o) for o in inst.operands))
            if inst.opcode not in _FREE_OPS and needed.get(inst.name, 1.0) == 1.0:
                yield inst, sig[inst.name]

    def computation(self, name: str, trips: bool) -> dict[tuple[str, str], list[float]]:
        """(phase, kind) -> [flops, transcendentals] of one computation."""
        key = (name, trips)
        if key not in self.memo:
            out: dict[tuple[str, str], list[float]] = {}
            for inst in self.module.computations.get(name, ()):
                _merge(out, self.instruction(name, inst, trips))
            self.memo[key] = out
        return self.memo[key]

    def instruction(self, comp: str, inst, trips: bool) -> dict:
        op = inst.opcode
        if op in _FREE_OPS:
            return {}
        callees = _hlo_text.callees(inst)
        if op in ("fusion", "call", "async-start"):
            out: dict = {}
            for c in callees.get("calls", []) + callees.get("to_apply", []):
                _merge(out, self.computation(c, trips))
            return out
        if op == "while":
            n = _hlo_text.trip_count(inst) if trips else 1
            out = {}
            for c in callees.get("body", []) + callees.get("condition", []):
                for (phase, _), (f, t) in self.computation(c, trips).items():
                    _merge(out, {(phase, "loop"): [f * n, t * n]})
            return out
        if op == "conditional":
            names = callees.get("branch_computations") or (
                callees.get("true_computation", []) + callees.get("false_computation", []))
            branches = [self.computation(c, trips) for c in names]
            return max(branches, key=lambda b: sum(f for f, _ in b.values()), default={})
        name = _hlo_text.op_name(inst)
        phase = ("backward" if "transpose(" in name else "forward" if "jvp(" in name
                 else "update" if name else "unnamed")
        flops, trans, kind = self.arithmetic(comp, inst, callees)
        return {(phase, kind): [flops, trans]}

    def arithmetic(self, comp: str, inst, callees) -> tuple[float, float, str]:
        op, types = inst.opcode, self.types[comp]
        out = _elements(inst.type)
        if op in _TRANSCENDENTAL_OPS:
            return 0.0, out, "elementwise"
        if op in ("rng", "rng-bit-generator"):
            return 0.0, out, "elementwise"
        if op in ("all-reduce", "all-reduce-start"):
            return out, 0.0, "all-reduce"
        if op == "custom-call":
            return -1.0, 0.0, "elementwise"  # XLA's "unknown"
        if op == "dot":
            lhs = _dims(types[inst.operands[0]])
            contracting = _hlo_text.attribute(inst, "lhs_contracting_dims")
            k = math.prod(lhs[int(x)] for x in (contracting or "").split(",") if x)
            return 2.0 * _first_elements(inst.type) * k, 0.0, "matmul"
        if op == "convolution":
            return _conv_flops(inst, types), 0.0, "matmul"
        if op in _REDUCING_OPS:
            return self.reducing(comp, inst, callees)
        return out, 0.0, "elementwise"

    def reducing(self, comp: str, inst, callees) -> tuple[float, float, str]:
        op, types = inst.opcode, self.types[comp]
        first = _first_elements(types[inst.operands[0]])
        if op == "sort":
            return (first * math.ceil(math.log2(first)) if first > 1 else 0.0), 0.0, "reduce"
        if op == "select-and-scatter":
            sel = self._applied(callees["select"][0])
            sca = self._applied(callees["scatter"][0])
            source = _first_elements(types[inst.operands[1]])
            steps = math.prod(_window(inst)["size"]) - 1
            return (sel[0] * source * steps + sca[0] * source,
                    sel[1] * source * steps + sca[1] * source, "reduce")
        f, t = self._applied(callees["to_apply"][0])
        if op == "reduce":
            n = first - _first_elements(inst.type)
        elif op == "reduce-window":
            n = _reduce_window_count(inst)
        elif op == "scatter":
            n = _first_elements(types[inst.operands[(len(inst.operands) - 1) // 2 + 1]])
        else:  # map
            n = _elements(inst.type)
        return f * n, t * n, "reduce"

    def _applied(self, name: str) -> tuple[float, float]:
        parts = self.computation(name, False).values()
        return sum(f for f, _ in parts), sum(t for _, t in parts)


_SLICING_OPS = frozenset({"slice", "dynamic-slice", "gather"})


def _needed_fraction(insts) -> dict[str, float]:
    """For each instruction of a fused computation, the fraction of its elements the
    fusion's outputs depend on: a slice needs its elements of its operand, other users the
    same fraction of it as is needed of them; the root (and a root tuple's operands) all."""
    users: dict[str, list] = {}
    for inst in insts:
        for operand in inst.operands:
            users.setdefault(operand, []).append(inst)
    size = {i.name: (None if i.type.startswith("(") else _elements(i.type)) for i in insts}
    fraction: dict[str, float] = {}
    for k, inst in enumerate(reversed(insts)):
        n = size[inst.name]
        if k == 0 or not n or not users.get(inst.name):
            fraction[inst.name] = 1.0
            continue
        need = 0.0
        for user in users[inst.name]:
            m = size[user.name]
            if not m or user.opcode == "tuple":
                need = n
                break
            need += fraction[user.name] * (m if user.opcode in _SLICING_OPS else n)
        fraction[inst.name] = min(need, n) / n
    return fraction


def _merge(into: dict, other: dict) -> None:
    for key, (f, t) in other.items():
        acc = into.setdefault(key, [0.0, 0.0])
        acc[0] += f
        acc[1] += t


def _elements(type_text: str) -> float:
    leaves = _hlo_text.type_leaves(_hlo_text.parse_type(type_text))
    return float(sum(math.prod(d) for _, d in leaves))


def _first_elements(type_text: str) -> float:
    return float(math.prod(_dims(type_text)))


def _dims(type_text: str) -> tuple[int, ...]:
    return _hlo_text.type_leaves(_hlo_text.parse_type(type_text))[0][1]


def _window(inst) -> dict[str, list]:
    out: dict[str, list] = {"size": [1]}
    for part in (_hlo_text.attribute(inst, "window") or "").split():
        key, value = part.split("=")
        out[key] = ([tuple(int(x) for x in p.split("_")) for p in value.split("x")]
                    if key == "pad" else [int(x) for x in value.split("x")])
    return out


def _reduce_window_count(inst) -> float:
    """Reductions of a reduce-window: (window - 1) per output, or, for a window that spans a
    padded dim whole (a cumulative sum), what XLA counts for it."""
    w = _window(inst)
    size = w["size"]
    pad = w.get("pad", [(0, 0)] * len(size))
    dims, out = _dims(inst.type), _first_elements(inst.type)
    reduced = [d for d, s in enumerate(size) if s != 1]
    padded = [d for d, p in enumerate(pad) if p != (0, 0)]
    if len(reduced) == 1 and len(padded) == 1:
        d = reduced[0]
        lo, hi = pad[d]
        if lo and lo == hi and size[d] == 2 * lo + 1 and lo == dims[d] - 1:
            return out // dims[d] + dims[d] - 1
    return (math.prod(size) - 1) * out


def _conv_flops(inst, types) -> float:
    """2 x the multiply-adds of a convolution whose taps land inside the (dilated) input."""
    lhs, rhs = _dims(types[inst.operands[0]]), _dims(types[inst.operands[1]])
    out = _dims(inst.type)
    operands, oi = _hlo_text.attribute(inst, "dim_labels").split("->")  # b01f_01io->b01f
    li, ki = operands.split("_")
    w = _window(inst)
    n = len(li) - 2
    valid = 1
    for s in range(n):
        d = str(s)
        n_in, n_k, n_out = lhs[li.index(d)], rhs[ki.index(d)], out[oi.index(d)]
        stride = w.get("stride", [1] * n)[s]
        lo = w.get("pad", [(0, 0)] * n)[s][0]
        base = w.get("lhs_dilate", [1] * n)[s]
        dil = w.get("rhs_dilate", [1] * n)[s]
        valid *= sum(1 for t in range(n_k) for o in range(n_out)
                     if (o * stride - lo + t * dil) % base == 0
                     and 0 <= (o * stride - lo + t * dil) // base < n_in)
    fg = int(_hlo_text.attribute(inst, "feature_group_count") or 1)
    bg = int(_hlo_text.attribute(inst, "batch_group_count") or 1)
    return (2.0 * (lhs[li.index("f")] // fg) * out[oi.index("f")] * (lhs[li.index("b")] // bg)
            * valid)


def _fused(inst) -> list[str]:
    """The computation a fusion instruction runs (none for other instructions)."""
    return _hlo_text.callees(inst).get("calls", []) if inst.opcode == "fusion" else []
