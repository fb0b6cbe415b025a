"""What a simulation returns: the step's timeline, memory and traffic, and its trace export.

`soapjax.simulate.front.Simulation.result` freezes its state into a `SimResult` (one `TaskRecord`
per task, in issue order, and a `MemoryBreakdown` of the peak); this module holds those records and
what is made from them alone: JSON, and the Chrome trace format that Perfetto and
chrome://tracing draw. Under one SPMD program every device runs the same compute timeline, so
the trace draws one compute track per device (at most 64, the rest are the same) and one track
per topology channel. A pipelined step's own result, `PipelineResult` (made by
`soapjax.simulate.pipesim`), is here too. `soapjax.simulate.front` re-exports everything here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from soapjax.strategy.pipeline import ChunkTimes, PipelineTimeline

# Task kinds (`TaskRecord.kind`).
FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
RESHARD, RESHARD_BWD, PARTIAL_SUM, PARAM_GATHER, GRAD_SYNC, UPDATE_REDUCE = (
    "reshard", "reshard_backward", "partial_sum", "param_gather", "grad_sync", "update_reduce")
INNER_REDUCE, INNER_REDUCE_BWD = "inner_reduce", "inner_reduce_backward"


class TaskRecord(NamedTuple):
    """One task of the simulated timeline.

    Attributes:
      name: e.g. ``"forward layers_0/mlp/fc1"``, ``"all_gather layers_0/ln_1 -> layers_0/attn/query
        over model"`` (a resharding; ``d(...)`` for its backward), ``"all_reduce grad
        ['params']['fc1']['kernel'] over data"`` or ``"all_reduce norm ['params']['fc1']['kernel']
        over model"`` (the optimizer's reduction of a split parameter: `OpCosts`).
      kind: forward, backward, update, reshard, reshard_backward, partial_sum, inner_reduce
        (the all-reduce of statistics an operator reduces over a split dim, ``"all_reduce
        layers_0/ln_1 (statistics) over model"``: `soapjax.graph._inner`), inner_reduce_backward
        (``d(... statistics)``), param_gather, grad_sync or update_reduce.
      resources: ``("compute",)`` or the topology channel ids it occupies.
      start_s, end_s: seconds from the start of the step.
      nbytes: a collective's per-device buffer (`Topology.collective_time`'s ``nbytes``); 0 for
        compute.
      sent: the bytes each device sends in it (`collectives.bytes_sent`); 0 for compute.
      runs: how many collectives of `nbytes` the task stands for: one per microbatch where
        the strategy has several (its duration and `sent` are all of them); 0 for compute.
      param: the parameter leaf (its source, as in the name) a param_gather, grad_sync or
        update_reduce task is for; None for the others.
    """

    name: str
    kind: str
    resources: tuple[str, ...]
    start_s: float
    end_s: float
    nbytes: int
    sent: float = 0.0
    runs: int = 1
    param: str | None = None

    @property
    def collectives(self) -> int:
        """How many collectives of `nbytes` the task stands for: one per microbatch it runs in
        (`runs`), and a ring attention's sends of one tensor are one task of cp - 1 sends
        (`soapjax.simulate._flatsim`) each microbatch; 0 for compute."""
        if self.kind in (FORWARD, BACKWARD, UPDATE):
            return 0
        runs = max(1, self.runs)
        if self.name.startswith("collective_permute") and self.nbytes:
            return runs * max(1, round(self.sent / runs / self.nbytes))
        return runs

    @property
    def collective_kind(self) -> str:
        """The collective a communication task runs (``all_gather``, ``all_reduce``, ...: its
        name's first word); its name's first word (``forward``, ...) for compute."""
        return self.name.split(" ", 1)[0]


class Kept(NamedTuple):
    """What a split backward's stash keeps of one value for a weight matmul's W, per device
    and microbatch (`Simulation.stash_io_by_operator`): `kept` bytes, the `used` bytes of
    the layout the matmul reads it in, and the mesh axes W all-gathers it over to get there
    (none where it is kept as used). `moved`: an operand of a selectively recomputed
    operator, whose unsplit backward gathers it again for the weight's gradient alone (W's
    gather replaces that one); else W's is one more."""

    kept: int
    used: int
    axes: tuple[str, ...]
    moved: bool = False


class MemoryBreakdown(NamedTuple):
    """Bytes per device at the peak (the same on every device under SPMD); `constants`: the
    arrays the loss closes over, whole on every device (`OpGraph.constant_bytes`)."""

    params: int
    grads: int
    opt_state: int
    activations: int
    comm_buffers: int
    constants: int = 0

    @property
    def total(self) -> int:
        return sum(self)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """The simulated training step of one strategy.

    Attributes:
      step_time_s: predicted iteration time.
      compute_s: busy time of the compute stream (forward, backward and update tasks), plus
        what calling the step costs where the topology measured it (`[compute]`), with the
        time compute lost beside running collectives (`contention_s`) included.
      exposed_comm_s: ``step_time_s - compute_s``: communication not hidden behind compute.
      bytes_moved: bytes each device sends over the whole step.
      bytes_by_link_class: the same, by the link class that limits each collective.
      peak_memory_bytes: peak bytes per device, one entry per device; all equal under SPMD
        symmetry (every device holds same-size shards).
      memory: what the peak is made of.
      memory_capacity_bytes: each device's memory (`Topology.device.memory_bytes`).
      fits_in_memory: whether the peak fits in it.
      cost_source: where compute times came from (``measured``, ``analytic``, ...).
      num_devices: devices in the mesh.
      tasks: every task, in issue order.
      channels: the topology channels, in trace order.
      pipeline: for a pipelined strategy, its `soapjax.simulate.pipesim.PipelineResult` (the rest is
        then one stage's work, with the pipeline's step time and fullest stage's memory).
      contention_s: seconds compute ran longer beside running collectives (a GPU's
        ``[device.kernels].overlap_slowdown``, `soapjax.simulate._taskgraph`); 0 without it.
    """

    step_time_s: float
    compute_s: float
    exposed_comm_s: float
    bytes_moved: float
    bytes_by_link_class: dict[str, float]
    peak_memory_bytes: tuple[int, ...]
    memory: MemoryBreakdown
    memory_capacity_bytes: int
    fits_in_memory: bool
    cost_source: str
    num_devices: int
    tasks: tuple[TaskRecord, ...] = dataclasses.field(repr=False)
    channels: tuple[str, ...] = dataclasses.field(repr=False, default=())
    pipeline: Any = dataclasses.field(repr=False, default=None)
    contention_s: float = 0.0

    def to_json(self, *, tasks: bool = False) -> dict[str, Any]:
        """The result as JSON-ready data; with ``tasks=True`` the whole timeline too. A
        pipelined step's is its pipeline's (`soapjax.simulate.pipesim.PipelineResult.to_json`)."""
        if self.pipeline is not None:
            return self.pipeline.to_json()
        out = {
            "step_time_s": self.step_time_s, "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s, "contention_s": self.contention_s,
            "bytes_moved": self.bytes_moved,
            "bytes_by_link_class": dict(self.bytes_by_link_class),
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "memory": self.memory._asdict(), "memory_capacity_bytes": self.memory_capacity_bytes,
            "fits_in_memory": self.fits_in_memory, "cost_source": self.cost_source,
            "num_devices": self.num_devices, "num_tasks": len(self.tasks),
        }
        if tasks:
            out["tasks"] = [t._asdict() | {"resources": list(t.resources)} for t in self.tasks]
        return out

    def to_chrome_trace(self, *, max_device_tracks: int = 64) -> dict[str, Any]:
        """The timeline in Chrome trace format (Perfetto, chrome://tracing).

        Process 1 has one track per device with the compute tasks (identical on every device
        under SPMD; at most `max_device_tracks` of them, the rest are the same); process 2 has
        one track per topology channel with the collectives on it. Times are microseconds.

        A pipelined step's tasks are the one-stage simulation's, every layer on one stage's
        devices (where the chunk times come from), not the step: process 3 has the pipeline
        itself, a track per stage with its forwards, backwards and weight gradients, and
        processes 1 and 2 say what they hold.
        """
        shown = min(self.num_devices, max_device_tracks)
        staged = "stage simulation (every layer on one stage's devices): " \
            if self.pipeline is not None else ""
        ev: list[dict[str, Any]] = [
            _meta("process_name", 1, None,
                  f"{staged}devices (SPMD: all {self.num_devices} identical)"),
            _meta("process_name", 2, None, f"{staged}links (topology channels)"),
        ]
        if self.pipeline is not None:
            tl = self.pipeline.timeline
            ev.append(_meta("process_name", 3, None,
                            f"pipeline: {tl.schedule}, {tl.stages} stages, {tl.microbatches} "
                            "microbatches"))
            ev += [_meta("thread_name", 3, s, f"stage {s}") for s in range(tl.stages)]
            ev += [{"name": f"{a.action[0]} {a.action[1]}", "cat": f"pipeline {a.action[0]}",
                    "ph": "X", "ts": a.start_s * 1e6, "dur": (a.end_s - a.start_s) * 1e6,
                    "pid": 3, "tid": a.stage,
                    "args": {"microbatch": a.action[1], "chunk": a.action[2]}}
                   for a in tl.tasks]
        for d in range(shown):
            ev.append(_meta("thread_name", 1, d, f"device:{d} compute"))
        tid = {c: i for i, c in enumerate(self.channels)}
        for c, i in tid.items():
            ev.append(_meta("thread_name", 2, i, c))
        for t in self.tasks:
            base = {"name": t.name, "cat": t.kind, "ph": "X", "ts": t.start_s * 1e6,
                    "dur": (t.end_s - t.start_s) * 1e6}
            if t.resources == ("compute",):
                ev.extend(base | {"pid": 1, "tid": d} for d in range(shown))
            else:
                args = {"nbytes": t.nbytes}
                ev.extend(base | {"pid": 2, "tid": tid[c], "args": args} for c in t.resources)
        other = {"step_time_s": self.step_time_s, "device_tracks": shown}
        if shown < self.num_devices:
            other["note"] = (f"{self.num_devices} devices run identical timelines; "
                             f"{shown} device tracks shown")
        return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": other}


def _meta(what: str, pid: int, tid: int | None, name: str) -> dict[str, Any]:
    ev = {"name": what, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        ev["tid"] = tid
    return ev


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """The simulated pipelined step.

    Attributes:
      step_time_s: predicted iteration time (the slowest stage's end, tail included).
      timeline: the schedule's timeline (`soapjax.strategy.pipeline.PipelineTimeline`).
      chunk_times: per-microbatch chunk and send times the schedule ran with.
      stage_memory: per stage, what its peak per device is made of.
      memory_capacity_bytes: each device's memory.
      fits_in_memory: whether the fullest stage fits.
      tail_s: per stage, its gradient synchronisation and update after its last backward.
      prologue_s: the part before the first layer (embedding) run SPMD on every device:
        (forward before the pipeline, backward after it).
      layout_move_s: the stacked layer parameters moved from the model's layout to the
        chunks' before the pipeline, and their gradients back after it (module doc, 4; 0
        where the layouts agree).
      collectives: the step's collectives as a device runs them, ``(kind, bytes per device,
        times)`` (`PipelinedSimulation.step_collectives`); empty unless asked for
        (`soapjax.simulate.front.simulate` asks).
      sent_bytes: the bytes each device sends in those (`collectives.bytes_sent` of each,
        over its group); 0 unless asked for, with `collectives`.
      stage_sums_s: the two all-reduces over the stage axis after the pipeline: the
        gradients of the parameters the prologue alone reads (after its backward), and of
        those the epilogue reads (after the stages' tails).
      stage_permutes: ``(operator, operand)`` of each read inside the stages that XLA may
        make with a collective-permute, ``(operator, -1)`` for a split dim the operator
        slices or pads (`PipelinedSimulation.stage_permutes`): apply refuses such a plan,
        whose step would hang; empty for a plan apply runs, and unless asked for
        (`soapjax.simulate.front.simulate` asks).
    """

    step_time_s: float
    timeline: PipelineTimeline
    chunk_times: ChunkTimes
    stage_memory: tuple[MemoryBreakdown, ...]
    memory_capacity_bytes: int
    fits_in_memory: bool
    tail_s: tuple[float, ...]
    prologue_s: tuple[float, float] = (0.0, 0.0)
    layout_move_s: tuple[float, float] = (0.0, 0.0)
    collectives: tuple[tuple[str, int, int], ...] = ()
    stage_sums_s: tuple[float, float] = (0.0, 0.0)
    sent_bytes: float = 0.0
    stage_permutes: tuple[tuple[str, int], ...] = ()

    @property
    def peak_memory_bytes(self) -> int:
        return max(m.total for m in self.stage_memory)

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction

    def to_json(self) -> dict:
        """JSON-ready summary (the plan file's ``predicted``): the keys a `SimResult` has that
        apply here, and the pipeline's own."""
        fullest = max(self.stage_memory, key=lambda m: m.total)
        return {
            "step_time_s": self.step_time_s, "fits_in_memory": self.fits_in_memory,
            "peak_memory_bytes": [m.total for m in self.stage_memory],
            "memory": fullest._asdict(), "memory_capacity_bytes": self.memory_capacity_bytes,
            "pipeline": {"bubble_fraction": self.bubble_fraction,
                         "in_flight": list(self.timeline.in_flight),
                         "stage_end_s": list(self.timeline.stage_end_s),
                         "tail_s": list(self.tail_s),
                         "prologue_s": list(self.prologue_s),
                         "layout_move_s": list(self.layout_move_s),
                         "chunk_forward_s": list(self.chunk_times.forward_s),
                         "chunk_backward_s": list(self.chunk_times.backward_s),
                         "chunk_weight_s": list(self.chunk_times.weight_s),
                         "send_s": list(self.chunk_times.send_s),
                         "stage_permutes": [list(r) for r in self.stage_permutes]},
        }


def as_step_result(pipelined: PipelineResult, stage: SimResult,
                   num_devices: int) -> SimResult:
    """The pipelined step as a `SimResult` for reports: step time, fits and memory of the
    pipeline (its fullest stage), the compute, bytes and tasks of one stage's work."""
    fullest = max(pipelined.stage_memory, key=lambda m: m.total)
    return dataclasses.replace(
        stage, step_time_s=pipelined.step_time_s,
        exposed_comm_s=max(0.0, pipelined.step_time_s - stage.compute_s),
        peak_memory_bytes=(fullest.total,) * num_devices, memory=fullest,
        fits_in_memory=pipelined.fits_in_memory, num_devices=num_devices, pipeline=pipelined)
