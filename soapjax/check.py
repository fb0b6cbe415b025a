"""`soapjax check`: a plan applied on the attached devices, against the unsharded step and the
simulator.

Four questions, each with numbers:

1. **Same numbers?** The planned, sharded step and the unsharded step (one device) start from
   the same parameters, optimizer state and batch; the largest absolute difference over the
   loss, the updated parameters and the optimizer state is reported.
2. **Same collectives?** The collectives XLA put in the compiled sharded step (kind, count,
   bytes per device, parsed by `soapjax.hlo`; one inside a loop counts once per iteration)
   against the communication tasks the simulator predicted for the plan (same kinds, same
   byte convention).
3. **Same time?** The measured step time (median of repeated runs) against the simulated one.
   On virtual CPU devices all devices share the host's cores, so the measured time is not a
   per-device time and this comparison only means something on real accelerators.
4. **Same work?** The FLOPs one device computes in the compiled step (`hlo_flops`: XLA's cost
   analysis with every loop trip counted) against `soapjax.cost.FlopCounter`'s count of the
   plan; docs/checks.md has the table and what is left between them (fusions recomputing
   elementwise work, reported apart).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from soapjax import _hlo_text, apply, hlo
from soapjax._timing import median_call
from soapjax.cost import cost_model, step_flops
from soapjax.graph import trace
from soapjax.plan import Plan
from soapjax.reshard import DEFAULT_MODE, Resharder
from soapjax.simulate import opt_state_factor, simulate
from soapjax.space import MeshShape
from soapjax.topology import load_topology, make_mesh

_COMPUTE = ("forward", "backward", "update")

# The bars `CheckResult.verdict` holds a check to. Numbers: float32 sharded against unsharded
# steps of the tiny zoo differ by 1e-7 to 2.2e-4 (inception_v3's deep convolutions; the table
# of docs/checks.md); a wrong sharding differs by the size of the values themselves. Collective
# bytes: the simulator's goal for them (issue 7), met by 52 of the 54 plans there.
NUMBERS_TOLERANCE = 1e-3
BYTES_TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What `compare_on_devices` found.

    Attributes:
      max_abs_diff: largest |sharded - unsharded| over loss, parameters and optimizer state.
      loss, reference_loss: the two losses.
      hlo_collectives: kind -> (count, bytes per device) in the compiled sharded step.
      predicted_collectives: kind -> (count, bytes per device) the simulator predicted.
      hlo_sent_bytes, predicted_sent_bytes: the bytes each device sends over the step (ring
        algorithms). Collective bytes count each collective's buffer, so an all-reduce that XLA
        splits into a reduce-scatter and an all-gather (with an elementwise op between) counts
        twice there but sends the same; bytes sent compare what the links carry.
      measured_step_s, predicted_step_s: the step times.
      partitioner: the SPMD partitioner the step was compiled with.
      devices: how many devices, and their kind.
      hlo_flops: FLOPs per device of the compiled sharded step: XLA's ``cost_analysis``
        with every while-loop trip counted (XLA counts a loop body once) and its one FLOP
        per all-reduced element left out (communication); see `hlo_flops`.
      predicted_flops: the same counted from the plan (`soapjax.cost.step_flops`: forward,
        backward, recomputation and the optimizer's update of the stored shards).
      reported_flops: ``cost_analysis()["flops"]`` as XLA reports it.
      duplicated_flops: the part of `hlo_flops` XLA's fusions recompute (`HloFlops`), which
        the simulator does not model.
    """

    max_abs_diff: float
    loss: float
    reference_loss: float
    hlo_collectives: tuple[tuple[str, int, float], ...]
    predicted_collectives: tuple[tuple[str, int, float], ...]
    measured_step_s: float
    predicted_step_s: float
    partitioner: str
    devices: str
    hlo_sent_bytes: float = 0.0
    predicted_sent_bytes: float = 0.0
    hlo_flops: float = 0.0
    predicted_flops: float = 0.0
    reported_flops: float = 0.0
    duplicated_flops: float = 0.0

    @property
    def flops_ratio(self) -> float:
        """XLA's FLOPs per device over the simulator's (1 where both are 0)."""
        if not self.predicted_flops:
            return 1.0 if not self.hlo_flops else float("inf")
        return self.hlo_flops / self.predicted_flops

    @property
    def hlo_collective_bytes(self) -> float:
        return sum(b for _, _, b in self.hlo_collectives)

    @property
    def predicted_collective_bytes(self) -> float:
        return sum(b for _, _, b in self.predicted_collectives)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_abs_diff": self.max_abs_diff, "loss": self.loss,
            "reference_loss": self.reference_loss,
            "hlo_collective_bytes": self.hlo_collective_bytes,
            "predicted_collective_bytes": self.predicted_collective_bytes,
            "hlo_collectives": {k: {"count": n, "bytes": b} for k, n, b in self.hlo_collectives},
            "predicted_collectives": {k: {"count": n, "bytes": b}
                                      for k, n, b in self.predicted_collectives},
            "hlo_sent_bytes": self.hlo_sent_bytes,
            "predicted_sent_bytes": self.predicted_sent_bytes,
            "measured_step_s": self.measured_step_s, "predicted_step_s": self.predicted_step_s,
            "partitioner": self.partitioner, "devices": self.devices,
            "hlo_flops": self.hlo_flops, "predicted_flops": self.predicted_flops,
            "reported_flops": self.reported_flops, "flops_ratio": self.flops_ratio,
            "duplicated_flops": self.duplicated_flops,
        }

    def verdict(self, *, tolerance: float = NUMBERS_TOLERANCE,
                bytes_tolerance: float = BYTES_TOLERANCE) -> tuple[bool, list[str]]:
        """(passed, one line per bar): the sharded step computes the unsharded one (loss,
        parameters and optimizer state within `tolerance`, absolute), and the predicted
        collective bytes are XLA's within `bytes_tolerance` (relative). Step times are not a
        bar: virtual CPU devices share the host's cores (module doc)."""
        numbers = self.max_abs_diff <= tolerance
        xla, pred = self.hlo_collective_bytes, self.predicted_collective_bytes
        ratio = pred / xla if xla else (1.0 if not pred else math.inf)
        collectives = abs(ratio - 1.0) <= bytes_tolerance
        lines = [
            (f"{'PASS' if numbers else 'FAIL'} numbers: largest difference from the unsharded "
             f"step {self.max_abs_diff:.3g} (bar {tolerance:g})"),
            (f"{'PASS' if collectives else 'FAIL'} collectives: predicted / XLA bytes "
             f"{ratio:.3f} (bar 1 \u00b1 {bytes_tolerance:g})"),
        ]
        return numbers and collectives, lines

    def table(self, *, tolerance: float = NUMBERS_TOLERANCE,
              bytes_tolerance: float = BYTES_TOLERANCE) -> str:
        passed, bars = self.verdict(tolerance=tolerance, bytes_tolerance=bytes_tolerance)
        lines = [f"devices: {self.devices}; SPMD partitioner: {self.partitioner}",
                 f"loss {self.loss:.6f} (unsharded {self.reference_loss:.6f}); largest difference "
                 f"over loss, parameters and optimizer state: {self.max_abs_diff:.3g}", "",
                 f"{'collective':<20}{'XLA count':>10}{'XLA bytes':>14}"
                 f"{'predicted':>11}{'pred. bytes':>14}"]
        hlo = {k: (n, b) for k, n, b in self.hlo_collectives}
        pred = {k: (n, b) for k, n, b in self.predicted_collectives}
        for k in sorted(set(hlo) | set(pred)):
            hn, hb = hlo.get(k, (0, 0.0))
            pn, pb = pred.get(k, (0, 0.0))
            lines.append(f"{k:<20}{hn:>10}{hb:>14,.0f}{pn:>11}{pb:>14,.0f}")
        lines.append(f"{'total':<20}{'':>10}{self.hlo_collective_bytes:>14,.0f}{'':>11}"
                     f"{self.predicted_collective_bytes:>14,.0f}")
        ratio = (self.predicted_collective_bytes / self.hlo_collective_bytes
                 if self.hlo_collective_bytes else float("nan"))
        sent = (self.predicted_sent_bytes / self.hlo_sent_bytes if self.hlo_sent_bytes
                else float("nan"))
        lines += ["", f"predicted / XLA collective bytes: {ratio:.3f}",
                  f"bytes sent per device: XLA {self.hlo_sent_bytes:,.0f}, predicted "
                  f"{self.predicted_sent_bytes:,.0f} (ratio {sent:.3f})",
                  (f"FLOPs per device: XLA {self.hlo_flops:,.0f} (fusions recompute "
                   f"{self.duplicated_flops:,.0f}), predicted {self.predicted_flops:,.0f} "
                   f"(ratio {self.flops_ratio:.3f})"),
                  f"step time: measured {self.measured_step_s * 1e3:.3f} ms, predicted "
                  f"{self.predicted_step_s * 1e3:.3f} ms (not a bar)", ""]
        lines += bars + [f"verdict: {'PASS' if passed else 'FAIL'}"]
        return "\n".join(lines)


def _norm(kind: str) -> str:
    return kind.replace("-", "_")


def _tally(items) -> tuple[tuple[str, int, float], ...]:
    """Per kind, (count, bytes) of ``(kind, nbytes, times)`` items."""
    out: dict[str, list] = {}
    for kind, nbytes, times in items:
        entry = out.setdefault(_norm(kind), [0, 0.0])
        entry[0] += times
        entry[1] += float(nbytes) * times
    return tuple((k, n, b) for k, (n, b) in sorted(out.items()))


class TrainWorkload(Protocol):
    """What `compare_on_devices` needs of a model: a `soapjax_zoo.Workload` is one."""

    name: str
    optimizer: Any

    def loss_fn(self, params: Any, batch: Any) -> Any: ...
    def abstract_params(self) -> Any: ...
    def abstract_batch(self) -> Any: ...
    def init_params(self, key: jax.Array) -> Any: ...
    def make_batch(self, key: jax.Array) -> Any: ...
    def train_step(self) -> Callable[..., Any]: ...


def compare_on_devices(plan: Plan, workload: TrainWorkload, *, repeats: int = 5, seed: int = 0,
                       costs: str = "auto", reshard: str = DEFAULT_MODE) -> CheckResult:
    """Applies `plan` to `workload` on the attached devices and compares (see the module doc).

    What `soapjax check` runs; the command line rebuilds the workload from the plan
    (`soapjax_zoo.for_plan`: a zoo model by name and config, or the user code the plan
    records). The prediction uses the same defaults as `soapjax.search.find_plan`, so it is the
    plan's own predicted step unless `costs` or `reshard` say otherwise.

    Raises:
      PlanError: the plan was made for another model, or its topology cannot be built from the
        attached devices.
    """
    w = workload
    graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    topo = load_topology(plan.topology)
    strategy = plan.strategy(graph, topo)
    mesh = make_mesh(topo)

    params = w.init_params(jax.random.key(seed))
    batch = w.make_batch(jax.random.key(seed + 1))
    opt_state = w.optimizer.init(params)
    ref = jax.jit(w.train_step())(params, opt_state, batch)

    step, sh = apply.sharded_train_step(graph, strategy, mesh, w.optimizer, params=params,
                                        batch=batch, mesh_shape=plan.mesh, donate=False)
    args = (apply.device_put_global(params, sh.params),
            apply.device_put_global(opt_state, sh.opt_state),
            apply.device_put_global(batch, sh.batch))
    compiled = step.lower(*args).compile()
    out = step(*args)
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)) if np.size(a))

    found = hlo.collectives(compiled.as_text(), MeshShape.of(topo),
                            reduce_scatter_from_slices=True)
    cm = cost_model(graph, topo, mode=costs, optimizer=w.optimizer)
    with Resharder(MeshShape.of(topo), mode=reshard) as resharder:
        sim = simulate(graph, topo, strategy, cost_model=cm, resharder=resharder,
                       opt_state_factor=opt_state_factor(w.optimizer, params))
    predicted = [(t.name.split(" ", 1)[0], t.nbytes, 1) for t in sim.tasks
                 if t.kind not in _COMPUTE]
    kinds = {d.device_kind for d in mesh.devices.flat}
    reported = _reported_flops(compiled)
    counted = hlo_flops(compiled.as_text())
    return CheckResult(
        max_abs_diff=diff, loss=float(out[2]), reference_loss=float(ref[2]),
        hlo_collectives=_tally((c.kind, c.nbytes, c.executions) for c in found),
        predicted_collectives=_tally(predicted), measured_step_s=median_call(step, args, repeats),
        predicted_step_s=sim.step_time_s, partitioner=getattr(step, "partitioner", "shardy"),
        devices=f"{mesh.devices.size} x {', '.join(sorted(kinds))}",
        hlo_sent_bytes=sum(c.sent * c.executions for c in found),
        predicted_sent_bytes=sum(t.sent for t in sim.tasks if t.kind not in _COMPUTE),
        hlo_flops=reported + counted.loop_extra - counted.all_reduce - counted.sliced_away,
        duplicated_flops=counted.duplicated,
        predicted_flops=step_flops(graph, strategy, MeshShape.of(topo), optimizer=w.optimizer,
                                   params=params).total,
        reported_flops=reported)


def _reported_flops(compiled: Any) -> float:
    """``cost_analysis()["flops"]`` of a compiled SPMD program (0 where XLA does not say)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


# --- the compiled step's FLOPs -------------------------------------------------------------------
#
# XLA's `HloCostAnalysis` (what ``compiled.cost_analysis()["flops"]`` sums) counts a while loop's
# body once, whatever its trip count, and one FLOP per element of every all-reduce (it assumes
# two replicas). The simulator counts a loop once per step and prices an all-reduce as
# communication. So the check recounts the compiled HLO by XLA's own rules (a multiply-add 2, an
# elementwise op, compare, select or convert 1 per element, transcendentals apart, a reduction
# (inputs - outputs) times its reducer, a pooling window (size - 1) per output, a convolution
# its in-bounds taps, fusions and calls their bodies, layout and data movement nothing), with
# each while body times its ``known_trip_count`` and the all-reduces apart. Counted with loops
# once, this reproduces ``cost_analysis()`` on every zoo model and plan, to XLA's float32
# rounding (`compiled_flops` checks it).

_TRANSCENDENTAL_OPS = frozenset({
    "acosh", "erf", "exponential", "log", "logistic", "power", "sqrt", "cbrt", "rsqrt", "tanh",
    "sine", "cosine", "exponential-minus-one", "log-plus-one", "atan2", "tan"})
_FREE_OPS = frozenset({
    "parameter", "constant", "iota", "get-tuple-element", "tuple", "bitcast", "broadcast",
    "reshape", "transpose", "copy", "slice", "dynamic-slice", "dynamic-update-slice",
    "concatenate", "pad", "reverse", "gather", "all-gather", "all-gather-start",
    "all-gather-done", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-permute-start", "collective-permute-done", "partition-id", "replica-id",
    "after-all", "add-dependency", "opt-barrier", "copy-start", "copy-done", "send",
    "send-done", "recv", "recv-done", "domain", "rng-get-and-update-state",
    "get-dimension-size", "set-dimension-size", "all-reduce-done", "async-update",
    "async-done", "dynamic-reshape", "batch-norm-training", "batch-norm-inference",
    "batch-norm-grad", "topk", "bitcast-convert"})
_REDUCING_OPS = frozenset({"reduce", "reduce-window", "scatter", "map", "select-and-scatter",
                           "sort"})
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|select|scatter)="
                    r"(\{[^}]*\}|%?[\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")
_FUSED = re.compile(r"calls=%?([\w.\-]+)")
_PARAMETER = re.compile(r"%([\w.\-]+) = \S+ parameter\((\d+)\)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


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


def compiled_flops(graph: Any, strategy: Any, mesh: Any, workload: TrainWorkload, *,
                   mesh_shape: MeshShape | None = None,
                   compiler_options: dict[str, Any] | None = None) -> HloFlops:
    """`hlo_flops` of the sharded training step of `strategy` on `mesh`, compiled from the
    shapes of `workload`'s parameters, optimizer state and batch (nothing runs).

    Raises:
      AssertionError: the count with loop bodies once is not ``cost_analysis()``'s, to XLA's
        float32 rounding (an HLO instruction this module prices otherwise than XLA).
    """
    params, batch = workload.abstract_params(), workload.abstract_batch()
    step, sh = apply.sharded_train_step(graph, strategy, mesh, workload.optimizer,
                                        params=params, batch=batch, mesh_shape=mesh_shape,
                                        donate=False, compiler_options=compiler_options)

    def placed(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, shardings)

    opt_state = jax.eval_shape(workload.optimizer.init, params)
    compiled = step.lower(placed(params, sh.params), placed(opt_state, sh.opt_state),
                          placed(batch, sh.batch)).compile()
    counted, reported = hlo_flops(compiled.as_text()), _reported_flops(compiled)
    # XLA sums in float32: equal to about 1e-7 of the total
    assert abs(counted.flops - reported) <= 1e-5 * max(reported, 1.0), (counted.flops, reported)
    return counted


class _HloCounter:
    def __init__(self, text: str):
        self.module = _hlo_text.parse_module(text)
        self.types = {c: {i.name: i.type for i in insts}
                      for c, insts in self.module.computations.items()}
        self.parameter_number = {m.group(1): int(m.group(2)) for m in _PARAMETER.finditer(text)}
        self.memo: dict[tuple[str, bool], dict[tuple[str, str], list[float]]] = {}
        self.runs = _hlo_text.executions(self.module)
        self.needed = {c: _needed_fraction(self.module.computations.get(c, []))
                       for insts in self.module.computations.values() for i in insts
                       if i.opcode == "fusion" for c in _FUSED.findall(i.attrs)}

    def count(self) -> HloFlops:
        called = {c for insts in self.module.computations.values() for i in insts
                  for _, v in _CALLS.findall(i.attrs) for c in re.findall(r"%?([\w.\-]+)", v)}
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
                for fused in _FUSED.findall(fusion.attrs) if fusion.opcode == "fusion" else ():
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
            sig[inst.name] = (inst.opcode, inst.type.split("{")[0], _METADATA.sub("", inst.attrs),
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
        callees = {k: re.findall(r"%?([\w.\-]+)", v) for k, v in _CALLS.findall(inst.attrs)}
        if op in ("fusion", "call", "async-start"):
            out: dict = {}
            for c in callees.get("calls", []) + callees.get("to_apply", []):
                _merge(out, self.computation(c, trips))
            return out
        if op == "while":
            m = _hlo_text._TRIP_COUNT.search(inst.attrs)
            n = int(m.group(1)) if m and trips else 1
            out = {}
            for c in callees.get("body", []) + callees.get("condition", []):
                for (phase, _), (f, t) in self.computation(c, trips).items():
                    _merge(out, {(phase, "loop"): [f * n, t * n]})
            return out
        if op == "conditional":
            branches = [self.computation(c, trips) for c in callees.get("branch_computations", [])]
            return max(branches, key=lambda b: sum(f for f, _ in b.values()), default={})
        m = _OP_NAME.search(inst.attrs)
        name = m.group(1) if m else ""
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
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
            k = math.prod(lhs[int(x)] for x in m.group(1).split(",") if x) if m else 1
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
            steps = math.prod(_window(inst.attrs)["size"]) - 1
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


def _window(attrs: str) -> dict[str, list]:
    m = _WINDOW.search(attrs)
    out: dict[str, list] = {"size": [1]}
    for part in (m.group(1).split() if m else ()):
        key, value = part.split("=")
        out[key] = ([tuple(int(x) for x in p.split("_")) for p in value.split("x")]
                    if key == "pad" else [int(x) for x in value.split("x")])
    return out


def _reduce_window_count(inst) -> float:
    """Reductions of a reduce-window: (window - 1) per output, or, for a window that spans a
    padded dim whole (a cumulative sum), what XLA counts for it."""
    w = _window(inst.attrs)
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
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", inst.attrs)
    li, ki, oi = labels.groups()
    groups = re.search(r"feature_group_count=(\d+)", inst.attrs)
    batch_groups = re.search(r"batch_group_count=(\d+)", inst.attrs)
    w = _window(inst.attrs)
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
    fg = int(groups.group(1)) if groups else 1
    bg = int(batch_groups.group(1)) if batch_groups else 1
    return (2.0 * (lhs[li.index("f")] // fg) * out[oi.index("f")] * (lhs[li.index("b")] // bg)
            * valid)
