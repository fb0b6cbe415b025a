"""`soapjax check`: a plan applied on the attached devices, against the unsharded step and the
simulator.

Four questions, each with numbers:

1. **Same numbers?** First the loss and every gradient leaf, each against its own scale
   (`soapjax.exactness.first_step`: a gradient scaled by a constant fails here, where one step
   of Adam would hide it), naming the worst leaf and the operator that reads it; then the
   step: the planned, sharded step and the unsharded step (one device) start from the same
   parameters, optimizer state and batch, and the largest absolute difference over the loss,
   the updated parameters and the optimizer state is reported.
2. **Same collectives?** The collectives XLA put in the compiled sharded step (kind, count,
   bytes per device, parsed by `soapjax.measure.hlo`; one inside a loop counts once per iteration)
   against the communication tasks the simulator predicted for the plan (same kinds, same
   byte convention).
3. **Same time?** The measured step time (median of repeated runs) against the simulated one.
   On virtual CPU devices all devices share the host's cores, so the measured time is not a
   per-device time and this comparison only means something on real accelerators.
4. **Same work?** The FLOPs one device computes in the compiled step
   (`soapjax.measure.hlo.hlo_flops`: XLA's cost analysis with every loop trip counted) against
   `soapjax.cost.flops.FlopCounter`'s count of the plan; docs/checks.md has the table and what is
   left between them (fusions recomputing elementwise work, reported apart).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import optax

from soapjax.apply import step as apply
from soapjax.cost.flops import step_flops
from soapjax.cost.operators import cost_model
from soapjax.cost.reshard import DEFAULT_MODE, Resharder
from soapjax.cost.updates import freeze
from soapjax.exactness import (
    NUMBERS_TOLERANCE,
    GradientComparison,
    first_step,
    reference_inputs,
    reference_value_and_grad,
    step_difference,
    widened,
)
from soapjax.graph.opgraph import trace
from soapjax.measure import hlo
from soapjax.measure._timing import median_call
from soapjax.measure.hlo import HloFlops, hlo_flops
from soapjax.search.find import checked_finalist
from soapjax.simulate.front import SimResult, opt_state_factor, simulate
from soapjax.strategy.plan import Plan, untied_warning
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import Topology, make_mesh

__all__ = ["BYTES_TOLERANCE", "NUMBERS_TOLERANCE", "CheckResult", "TrainWorkload",
           "compare_on_devices", "compiled_flops", "plan_reshard_mode", "simulated_collectives",
           "simulated_sent_bytes"]

_COMPUTE = ("forward", "backward", "update")

# The bars `CheckResult.verdict` holds a check to: the gradients' and the step's are
# `soapjax.exactness`'s (`NUMBERS_TOLERANCE`, re-exported); collective bytes: the simulator's
# goal for them, met by 52 of the 54 plans of docs/checks.md.
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
      predicted_flops: the same counted from the plan (`soapjax.cost.flops.step_flops`: forward,
        backward, recomputation and the optimizer's update of the stored shards).
      reported_flops: ``cost_analysis()["flops"]`` as XLA reports it.
      duplicated_flops: the part of `hlo_flops` XLA's fusions recompute (`HloFlops`), which
        the simulator does not model.
      gradients: the loss and each gradient leaf against the unsharded ones
        (`soapjax.exactness.GradientComparison`), None where not compared.
      warnings: what the prediction leaves out for this plan (a scan's layers read in other
        layouts: `soapjax.strategy.plan.untied_warning`), shown above the bars.
      stages: the plan's pipeline stages; with more than one, the collectives and bytes on
        both sides are every stage's actions summed, as the compiled program holds them
        (`soapjax.apply.collectives_as_run`), not one device's.
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
    gradients: GradientComparison | None = None
    warnings: tuple[str, ...] = ()
    stages: int = 1

    @property
    def flops_ratio(self) -> float:
        """XLA's FLOPs per device over the simulator's (1 where both are 0)."""
        if not self.predicted_flops:
            return 1.0 if not self.hlo_flops else float("inf")
        return self.hlo_flops / self.predicted_flops

    @property
    def _summed(self) -> str:
        return (f" (the {self.stages} stages' actions summed, as the program holds them)"
                if self.stages > 1 else "")

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
            "gradients": self.gradients.to_json() if self.gradients is not None else None,
            "warnings": list(self.warnings),
        }

    def verdict(self, *, tolerance: float = NUMBERS_TOLERANCE,
                bytes_tolerance: float = BYTES_TOLERANCE,
                gradient_tolerance: float | None = None) -> tuple[bool, list[str]]:
        """(passed, one line per bar): the loss and every gradient leaf equal the unsharded
        ones to rounding (each leaf relative to its own scale, within `gradient_tolerance`,
        default the comparison's own bar), the sharded step computes the unsharded one (loss,
        parameters and optimizer state within `tolerance`, absolute), and the predicted
        collective bytes are XLA's within `bytes_tolerance` (relative). Each line says by how
        much its bar passed or failed. Step times are not a bar: virtual CPU devices share the
        host's cores (module doc)."""
        lines, passed = [], True
        if self.gradients is not None:
            g = self.gradients
            if gradient_tolerance is not None:
                g = dataclasses.replace(g, tolerance=gradient_tolerance)
            lines.append(g.describe())
            passed = g.passed
        numbers = self.max_abs_diff <= tolerance and not math.isnan(self.reference_loss)
        xla, pred = self.hlo_collective_bytes, self.predicted_collective_bytes
        ratio = pred / xla if xla else (1.0 if not pred else math.inf)
        collectives = abs(ratio - 1.0) <= bytes_tolerance
        lines += [
            ("FAIL step: the unsharded step's own loss is NaN, so there is nothing to compare "
             "against; check the model and its inputs first" if math.isnan(self.reference_loss)
             else f"{'PASS' if numbers else 'FAIL'} step: largest difference from the "
             f"unsharded step {self.max_abs_diff:.3g} (bar {tolerance:g}, absolute)"),
            (f"{'PASS' if collectives else 'FAIL'} collectives: predicted / XLA bytes "
             f"{ratio:.3f} (bar 1 \u00b1 {bytes_tolerance:g}; off by "
             f"{abs(ratio - 1.0):.1%})"),
        ]
        return passed and numbers and collectives, lines

    def table(self, *, tolerance: float = NUMBERS_TOLERANCE,
              bytes_tolerance: float = BYTES_TOLERANCE,
              gradient_tolerance: float | None = None) -> str:
        passed, bars = self.verdict(tolerance=tolerance, bytes_tolerance=bytes_tolerance,
                                    gradient_tolerance=gradient_tolerance)
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
                  f"bytes sent per device{self._summed}: XLA {self.hlo_sent_bytes:,.0f}, "
                  f"predicted {self.predicted_sent_bytes:,.0f} (ratio {sent:.3f})",
                  (f"FLOPs per device: XLA {self.hlo_flops:,.0f} (fusions recompute "
                   f"{self.duplicated_flops:,.0f}), predicted {self.predicted_flops:,.0f} "
                   f"(ratio {self.flops_ratio:.3f})"),
                  f"step time: measured {self.measured_step_s * 1e3:.3f} ms, predicted "
                  f"{self.predicted_step_s * 1e3:.3f} ms (not a bar)", ""]
        lines += [*self.warnings, *([""] if self.warnings else []), *bars,
                  f"verdict: {'PASS' if passed else 'FAIL'}"]
        return "\n".join(lines)


def _norm(kind: str) -> str:
    return kind.replace("-", "_")


def simulated_collectives(sim: SimResult) -> list[tuple[str, int, int]]:
    """The collectives a simulated step runs on a device, as ``(kind, bytes per device,
    times)``: a flat step's communication tasks (`soapjax.simulate.TaskRecord`), kind from
    the name, each as many collectives as it stands for (`TaskRecord.collectives`: one per
    microbatch, a ring attention's cp - 1 sends); a pipelined step's as the pipeline runs them
    (`soapjax.simulate.pipesim.PipelineResult.collectives`: every stage's branches summed,
    as `soapjax.apply.collectives_as_run` counts the compiled step's)."""
    if sim.pipeline is not None and sim.pipeline.collectives:
        return list(sim.pipeline.collectives)
    return [(t.collective_kind, t.nbytes, t.collectives) for t in sim.tasks
            if t.kind not in _COMPUTE]


def simulated_sent_bytes(sim: SimResult) -> float:
    """The bytes each device sends over a simulated step: its communication tasks' (a flat
    step's), or a pipelined step's collectives as the pipeline runs them
    (`soapjax.simulate.pipesim.PipelineResult.sent_bytes`)."""
    if sim.pipeline is not None and sim.pipeline.collectives:
        return sim.pipeline.sent_bytes
    return sum(t.sent for t in sim.tasks if t.kind not in _COMPUTE)


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


def plan_reshard_mode(plan: Plan) -> str:
    """The resharding model `plan`'s prediction was priced with: ``"xla"`` where `find_plan`
    checked the plan's reshardings against XLA (`soapjax.search.find.check_reshardings`), else
    the search's (``plan.search["reshard"]``; the default for a plan without one)."""
    info = dict(plan.search)
    return "xla" if checked_finalist(info) is not None else info.get("reshard", DEFAULT_MODE)


def _noise_note(gradients: GradientComparison) -> str:
    """What the step's bar leaves out: the parameters whose true gradient is zero, and the
    elements of others whose gradient the bar lets either side hold with the other sign."""
    paths = [gradients.leaves[k].path for k in gradients.noise_leaves]
    open_ = [e for e in gradients.leaves if e.unsettled is not None]
    out = []
    if paths:
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        what = ("whose true gradient is zero (float64: under float32's resolution of the "
                "largest; rounding noise on both sides" if gradients.float64 else
                "whose true gradient is zero (the step widened to float32: under the model's "
                "2-byte float resolution of the largest; rounding noise on both sides"
                if gradients.widened else
                "whose gradient is under the model-wide floor (zero, or too small to tell from "
                "float32 rounding without a float64 run of the loss; rounding noise on both "
                "sides")
        out.append(f"{len(paths)} parameter(s) {what}, which one Adam step follows by its "
                   f"learning rate, either way): {shown}")
    if open_:
        n = sum(int(e.unsettled.sum()) for e in open_)
        out.append(f"{n:,} element(s) of {len(open_)} other parameter(s) whose reference "
                   f"gradient is within the gradient bar of zero (either sign passes it, and "
                   f"Adam's first step follows the sign)")
    if not out:
        return ""
    return ("the step's bar leaves out " + "; and ".join(out)
            + "; their gradients are held to the gradient bar")


def compare_on_devices(plan: Plan, workload: TrainWorkload, *, repeats: int = 5, seed: int = 0,
                       costs: str = "auto", reshard: str | None = None,
                       topology: Topology | None = None) -> CheckResult:
    """Applies `plan` to `workload` on the attached devices and compares (see the module doc).

    What `soapjax check` runs; the command line rebuilds the workload from the plan
    (`soapjax_zoo.for_plan`: a zoo model by name and config, or the user code the plan
    records). The prediction uses the same defaults as `soapjax.search.find.find_plan`, so it is the
    plan's own predicted step unless `costs` or `reshard` say otherwise (`reshard` None: the
    plan's own, `plan_reshard_mode`).

    `topology` is the plan's own (`Plan.topology_used`: its file, else the shipped one of its
    name) unless given.

    Raises:
      PlanError: the plan was made for another model or topology, or its topology cannot be
        found or built from the attached devices.
    """
    w = workload
    graph = freeze(trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name,
                         has_aux=getattr(w, "has_aux", False)), w.optimizer)
    topo = topology if topology is not None else plan.topology_used()
    strategy = plan.strategy(graph, topo)
    mesh = make_mesh(topo)

    params = w.init_params(jax.random.key(seed))
    batch = w.make_batch(jax.random.key(seed + 1))
    opt_state = w.optimizer.init(params)
    value_and_grad = reference_value_and_grad(w.loss_fn, graph, strategy)

    def unsharded(params, opt_state, batch):
        loss, grads = value_and_grad(params, batch)
        updates, opt_state = w.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ref = jax.jit(unsharded)(*reference_inputs((params, opt_state, batch)))

    step, sh = apply.sharded_train_step(graph, strategy, mesh, w.optimizer, params=params,
                                        batch=batch, mesh_shape=plan.mesh, donate=False)
    gradients = first_step(graph, strategy, mesh, w.loss_fn, params, batch,
                           sharded=(step.value_and_grad, sh))
    args = (apply.device_put_global(params, sh.params),
            apply.device_put_global(opt_state, sh.opt_state),
            apply.device_put_global(batch, sh.batch))
    compiled = step.lower(*args).compile()
    out = apply.model_layout(step(*args))  # (stacked layers kept in chunk order: back)
    if gradients.widened:  # the unsharded step's own 2-byte rounding is off: its widened run
        try:
            ref = widened(unsharded)(params, opt_state, batch)
        except Exception:  # noqa: BLE001  (the widening cannot follow the optimizer: as run)
            pass
    diff = step_difference(out, ref, gradients=gradients)

    found = hlo.collectives(compiled.as_text(), MeshShape.of(topo),
                            reduce_scatter_from_slices=True, narrow_as_sent=True)
    found = apply.collectives_as_run(found, strategy)
    cm = cost_model(graph, topo, mode=costs, optimizer=w.optimizer)
    mode = plan_reshard_mode(plan) if reshard is None else reshard
    with Resharder(MeshShape.of(topo), mode=mode) as resharder:
        sim = simulate(graph, topo, strategy, cost_model=cm, resharder=resharder,
                       opt_state_factor=opt_state_factor(w.optimizer, params))
    predicted = simulated_collectives(sim)
    kinds = {d.device_kind for d in mesh.devices.flat}
    reported = _reported_flops(compiled)
    counted = hlo_flops(compiled.as_text())
    return CheckResult(
        max_abs_diff=diff, loss=float(graph.loss_and_aux(out[2])[0]),
        reference_loss=float(graph.loss_and_aux(ref[2])[0]),
        hlo_collectives=_tally((c.kind, c.nbytes, c.executions) for c in found),
        predicted_collectives=_tally(predicted), measured_step_s=median_call(step, args, repeats),
        predicted_step_s=sim.step_time_s, partitioner=getattr(step, "partitioner", "shardy"),
        devices=f"{mesh.devices.size} x {', '.join(sorted(kinds))}",
        hlo_sent_bytes=sum(c.sent * c.executions for c in found),
        predicted_sent_bytes=simulated_sent_bytes(sim),
        hlo_flops=reported + counted.loop_extra - counted.all_reduce - counted.sliced_away,
        duplicated_flops=counted.duplicated,
        predicted_flops=step_flops(graph, strategy, MeshShape.of(topo), optimizer=w.optimizer,
                                   params=params, stored=_stored_shapes(graph, sh)).total,
        reported_flops=reported, gradients=gradients,
        warnings=tuple(w for w in [untied_warning(graph, strategy), _noise_note(gradients)]
                       if w),
        stages=strategy.stages)


def _stored_shapes(graph: Any, shardings: Any) -> list[tuple[int, ...]]:
    """Each parameter leaf's shard shape as the applied step stores it (its sharding's)."""
    return [tuple(s.shard_shape(leaf.shape))
            for s, leaf in zip(jax.tree.leaves(shardings.params), graph.params)]


def _reported_flops(compiled: Any) -> float:
    """``cost_analysis()["flops"]`` of a compiled SPMD program (0 where XLA does not say)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


# --- the compiled step's FLOPs -------------------------------------------------------------------


def compiled_flops(graph: Any, strategy: Any, mesh: Any, workload: TrainWorkload, *,
                   mesh_shape: MeshShape | None = None,
                   compiler_options: dict[str, Any] | None = None) -> HloFlops:
    """`hlo_flops` of the sharded training step of `strategy` on `mesh`, compiled from the
    shapes of `workload`'s parameters, optimizer state and batch (nothing runs).

    Raises:
      AssertionError: the count with loop bodies once is not ``cost_analysis()``'s, to XLA's
        float32 rounding (an HLO instruction `soapjax.measure.hlo.hlo_flops` prices otherwise than
        XLA).
    """
    params, batch = workload.abstract_params(), workload.abstract_batch()
    step, sh = apply.sharded_train_step(graph, strategy, mesh, workload.optimizer,
                                        params=params, batch=batch, mesh_shape=mesh_shape,
                                        donate=False, compiler_options=compiler_options)

    def placed(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, shardings)

    opt_state = jax.eval_shape(workload.optimizer.init, params)
    compiled = step.lower(placed(apply.step_layout(params, sh.params), sh.params),
                          placed(apply.step_layout(opt_state, sh.opt_state), sh.opt_state),
                          placed(batch, sh.batch)).compile()
    counted, reported = hlo_flops(compiled.as_text()), _reported_flops(compiled)
    # XLA sums in float32: equal to about 1e-7 of the total
    assert abs(counted.flops - reported) <= 1e-5 * max(reported, 1.0), (counted.flops, reported)
    return counted
