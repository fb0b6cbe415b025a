"""The pipeline dimension (the O of SOAP): stages, virtual stages and their schedules.

A pipelined plan cuts the model's repeated blocks (its layers) into ``S x v`` consecutive
*chunks*; device stage ``s`` (a position on the ``stage`` mesh axis) holds chunks ``s, s + S,
..., s + (v - 1) S`` (``v`` virtual stages per device, Megatron-LM's interleaving; ``v = 1``
is the plain pipeline). The global batch runs as ``M`` microbatches. A *schedule* fixes the
order in which each device stage runs the forward (F) and backward (B) of its chunks over the
microbatches:

* ``"gpipe"`` (Huang et al. 2019): every forward, then every backward. Each stage holds the
  activations of all M microbatches at once.
* ``"1f1b"`` (PipeDream-Flush, Narayanan et al. 2021): stage ``s`` runs ``S - s - 1`` warm-up
  forwards, then alternates one forward and one backward, then drains the backwards. Same
  bubble as GPipe, at most ``S - s`` microbatches in flight.
* ``"interleaved"`` (Megatron-LM's interleaved 1F1B, v >= 2 virtual stages): the 1F1B
  pattern over virtual microbatches ``(microbatch, chunk)`` taken in groups of S microbatches
  per chunk; the bubble shrinks by v at the price of v times more stage-to-stage transfers.
  It needs M to be a multiple of S.
* ``"zb-h1"`` (Qi et al. 2024, *Zero Bubble Pipeline Parallelism*, ZB-H1): 1F1B's order of
  forwards and backwards with the backward split in two: ``B``, the gradient of the chunk's
  input (what the previous stage waits for), and ``W``, the gradients of its layers'
  weights, which nothing waits for. Stage ``s`` runs ``W(m)`` right after ``B(m + s)`` (the
  last ``s`` after its last backward), so the gradients travel back at the pace of the B's
  alone and the W's fill the idle time they leave: the bubble falls from ``(S - 1)(f + b)``
  to ``(S - 1)(f + b - 2 w)`` (w the W part of b), exactly that for equal chunks and free
  sends. Every stage then holds up to S microbatches (forward run, W not yet), as 1F1B's
  first stage does.
* ``"zb-interleaved"``: the interleaved schedule's order with the same rule for its W's (a
  stage's W of its k-th backward after its (k + s)-th): the interleaved bubble, shortened
  the same way (GPT 530B's 35 stages x 3, equal chunks of f = 1, b = 2.2, w = 0.8 over
  280 microbatches: 914 against 932 time units), its stages holding no more than the
  interleaved schedule's do.

What a pending W holds is its *stash* (`soapjax.apply._deferred`): each weight matmul's
operand and its output's cotangent. Under these two names the stash keeps each value as the
stage holds it where that is smaller than the matmul uses it (under sequence parallelism the
norms' outputs split along the sequence, a row-parallel matmul's cotangent as its
reduce-scatter hands it back), and the W all-gathers it again: a stash no larger than the
residuals a forward keeps, so ZB-H1's stages hold no more than 1F1B's first one, its
promise. ``"zb-h1-gathered"`` and ``"zb-interleaved-gathered"`` run the same orders with the
stash kept as the matmuls use it: no gathers again, and up to three times the bytes held
under sequence parallelism (without it the two are the same).

`SCHEDULES` holds each schedule's rules (`Schedule`: virtual stages or not, whether M must be a
multiple of S) and its order; `device_orders` gives those orders as data, simulation
(`soapjax.simulate.front`) times them and apply (`soapjax.apply.step`) runs them, so both follow one
definition, and the search asks `pipeline_error` which microbatch counts a schedule takes.

`time_schedule` times the orders for given per-chunk forward, backward and send times
(`ChunkTimes`): an event simulation in which each stage runs its actions one at a time, each
waiting for its input, and each link between stages sends one microbatch at a time. Its
`PipelineTimeline` holds every action's and every send's times, the step, when each stage's
last backward ends (its gradient sync can start then), the bubble, and the activations each
stage holds at its peak; `soapjax.plot.pipeline_figure` draws it. With equal chunks and free
sends it reproduces the closed forms: ``(M + S - 1)(f + b)`` for GPipe and 1F1B, and
``(M + (S - 1) / v)(f + b)`` interleaved (Narayanan et al. 2021, section 2.2: the bubble
shrinks by v). Sends are where the schedules part: GPipe hides them behind compute once the
pipeline is full (while a send is no longer than a chunk's compute, it pays ``2 (S - 1)`` of
them in all), 1F1B cannot, as a stage soon waits for the gradient of a microbatch it has just
sent on (4 stages, 8 microbatches, f = 1, b = 2, sends of 0.25: GPipe 34.5, 1F1B 37). One
call costs one pass over the ``2 M S v`` actions: 45 ms for 64 stages x 1536 microbatches
(196,608 actions) and 5 ms for 16 stages x 256 microbatches x 4 virtual stages in CPython
3.11, after a first call per pipeline shape that orders the dependencies (0.5 to 0.7 s and
0.05 s; cached).

Example: 2 stages, 3 microbatches, 1F1B. Stage 0 warms up with one forward; stage 1 (the last)
alternates from the start.

>>> for stage in device_orders("1f1b", stages=2, microbatches=3):
...     print(" ".join(f"{a.kind}{a.microbatch}" for a in stage))
F0 F1 B0 F2 B1 B2
F0 B0 F1 B1 F2 B2
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

from soapjax.base.errors import PlanError
from soapjax.strategy._schedule_time import (
    Compiled,
    compile_orders,
    holds,
    recorded,
    stage_ends,
)

__all__ = ["Action", "ChunkTimes", "DEFAULT_SCHEDULE", "PipelineTimeline", "SCHEDULES", "Schedule",
           "ScheduleName", "StageHolds", "StageRoute", "TimedAction", "TimedSend",
           "check_pipeline", "check_stage_layers", "chunks_of", "device_orders",
           "pipeline_error", "stage_holds", "stage_routes", "forget_timelines", "time_schedule"]


class Action(NamedTuple):
    """One step of a device stage's order: the forward (``"F"``) or backward (``"B"``) of model
    chunk `chunk` (0 .. S*v - 1, in model order) on microbatch `microbatch`; under a schedule
    that splits the backward (`Schedule.splits_backward`), ``"B"`` is the gradient of the
    chunk's input and ``"W"`` the gradients of its layers' weights."""

    kind: str
    microbatch: int
    chunk: int


class Schedule(NamedTuple):
    """One pipeline schedule: its rules and its per-stage order (a row of `SCHEDULES`).

    Attributes:
      order: ``(s, S, M, v) -> actions``: the actions of device stage ``s`` of a pipeline of S
        stages, M microbatches and v virtual stages per device, in the order it runs them.
      virtual: whether it runs 2 or more virtual stages per device (else exactly 1).
      whole_rounds: whether M must be a multiple of S (microbatches go round in groups of S).
      splits_backward: whether its orders hold W actions, the backward split into the input's
        gradient (B) and the weights' (W).
      gathered_stash: with `splits_backward`, whether the stash a pending W holds is kept as
        the weight matmuls use it (gathered), rather than as the stage holds the values
        (split along the sequence under sequence parallelism), which W gathers again
        (module doc).
    """

    order: Callable[[int, int, int, int], tuple[Action, ...]]
    virtual: bool = False
    whole_rounds: bool = False
    splits_backward: bool = False
    gathered_stash: bool = False


def pipeline_error(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> str | None:
    """What is wrong with a pipeline's numbers (`check_pipeline`'s message), or None.

    >>> pipeline_error("1f1b", stages=4, microbatches=6) is None
    True
    >>> print(pipeline_error("1f1b", stages=4, microbatches=6, virtual=2))  # doctest: +ELLIPSIS
    2 virtual stages per device need a schedule of virtual stages ('interleaved', ...), not '1f1b'
    """
    if schedule not in SCHEDULES:
        return f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}"
    for name, value in (("stages", stages), ("microbatches", microbatches),
                        ("virtual stages", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"pipeline {name} must be an integer >= 1, got {value!r}"
    rules = SCHEDULES[schedule]
    if rules.virtual and virtual < 2:
        return (f"the {schedule} schedule needs 2 or more virtual stages per device, got "
                f"{virtual}")
    if rules.whole_rounds and microbatches % stages:
        return (f"the {schedule} schedule needs the microbatches ({microbatches}) to be a "
                f"multiple of the stages ({stages})")
    if not rules.virtual and virtual != 1:
        names = [repr(n) for n, r in SCHEDULES.items() if r.virtual]
        names = ", ".join(names[:-1]) + " or " + names[-1]
        return (f"{virtual} virtual stages per device need a schedule of virtual stages "
                f"({names}), not {schedule!r}")
    return None


def check_pipeline(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Raises `PlanError` saying what is wrong with a pipeline's numbers, if anything is.

    >>> check_pipeline("interleaved", stages=4, microbatches=6, virtual=2)
    Traceback (most recent call last):
    ...
    soapjax.base.errors.PlanError: the interleaved schedule needs the microbatches (6) to be a \
multiple of the stages (4)
    """
    error = pipeline_error(schedule, stages, microbatches, virtual)
    if error is not None:
        raise PlanError(error)


def check_stage_layers(stage_layers: tuple[int, ...], stages: int, virtual: int = 1,
                       num_layers: int | None = None) -> None:
    """PlanError unless `stage_layers` (layers per stage, first to last; () for equal
    stages) can cut a pipeline of `stages` stages (of `num_layers` layers, where given).

    Uneven stages are 1F1B's or GPipe's (one virtual stage), each stage at least one layer;
    their layers are kept between steps in the model's layout, ``L / S`` per stage, so the
    layers must divide by the stages (`stage_routes` moves the difference every step).

    >>> check_stage_layers((3, 5), stages=2, num_layers=8)
    >>> check_stage_layers((3, 4), stages=2, num_layers=8)
    Traceback (most recent call last):
    ...
    soapjax.base.errors.PlanError: stage layers (3, 4) add up to 7, but the model has 8 layers
    """
    if not stage_layers:
        return
    if not isinstance(stage_layers, tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in stage_layers):
        raise PlanError(f"stage layers must be a tuple of integers >= 1 (layers per stage, "
                        f"first to last), got {stage_layers!r}")
    if virtual != 1:
        raise PlanError(f"stage layers {stage_layers}: uneven stages are for one virtual stage "
                        f"per device (1F1B, GPipe), not {virtual}")
    if len(stage_layers) != stages:
        raise PlanError(f"stage layers {stage_layers} name {len(stage_layers)} stages, the "
                        f"pipeline has {stages}")
    if num_layers is not None:
        if sum(stage_layers) != num_layers:
            raise PlanError(f"stage layers {stage_layers} add up to {sum(stage_layers)}, but the "
                            f"model has {num_layers} layers")
        if num_layers % stages:
            raise PlanError(f"stage layers {stage_layers}: the model's {num_layers} layers are "
                            f"kept {num_layers} / {stages} per stage between steps, which "
                            "needs the stages to divide them")


class StageRoute(NamedTuple):
    """One shift of `stage_routes`: every stage ``s`` sends rows ``send[s]`` of its stored
    layers to stage ``s - delta``, which puts them at rows ``receive[s - delta]`` of its
    padded run of layers (``max(stage_layers)`` rows; the position ``max(stage_layers)``
    itself means "nowhere", for padding)."""

    delta: int
    send: tuple[tuple[int, ...], ...]
    receive: tuple[tuple[int, ...], ...]

    @property
    def rows(self) -> int:
        """Layers each stage sends (padded to the most any sends)."""
        return len(self.send[0])


def stage_routes(num_layers: int, stage_layers: tuple[int, ...]) -> tuple[StageRoute, ...]:
    """How uneven stages get their layers from the model's layout, where stage ``s`` keeps
    layers ``s L / S .. (s + 1) L / S`` and runs ``stage_layers[s]`` of them from
    ``sum(stage_layers[:s])``: one `StageRoute` per shift ``delta`` (the stage a layer is kept
    on, less the stage that runs it), the shift 0 (what a stage keeps and runs) included.
    Only ``delta != 0`` crosses stages: a point-to-point send of ``rows`` layers each way (the
    gradients go back the same way).

    Stage 0 keeps layers 0-3 and runs 0-2; stage 1 keeps 4-7 and runs 3-7, layer 3 sent by
    stage 0 (its row 3) to stage 1's position 0:

    >>> for r in stage_routes(8, (3, 5)):
    ...     print(r.delta, r.send, r.receive)
    0 ((0, 1, 2, 0), (0, 1, 2, 3)) ((0, 1, 2, 5), (1, 2, 3, 4))
    -1 ((3,), (0,)) ((5,), (0,))
    """
    check_stage_layers(stage_layers, len(stage_layers), num_layers=num_layers)
    S, longest = len(stage_layers), max(stage_layers)
    per = num_layers // S
    need: dict[int, dict[int, list[tuple[int, int]]]] = {}  # delta -> runner -> (row, position)
    start = 0
    for runner, count in enumerate(stage_layers):
        for k in range(count):
            layer = start + k
            need.setdefault(layer // per - runner, {}).setdefault(runner, []).append(
                (layer % per, k))
        start += count
    routes = []
    for delta in sorted(need, key=lambda d: (d != 0, abs(d), d)):
        rows = max(len(v) for v in need[delta].values())
        send = [[0] * rows for _ in range(S)]
        receive = [[longest] * rows for _ in range(S)]
        for runner, pairs in need[delta].items():
            for i, (row, position) in enumerate(pairs):
                send[runner + delta][i] = row
                receive[runner][i] = position
        routes.append(StageRoute(delta, tuple(map(tuple, send)), tuple(map(tuple, receive))))
    return tuple(routes)


def chunks_of(stage: int, stages: int, virtual: int = 1) -> tuple[int, ...]:
    """The model chunks device stage `stage` holds, in model order.

    >>> chunks_of(1, stages=4, virtual=2)
    (1, 5)
    """
    return tuple(j * stages + stage for j in range(virtual))


def device_orders(schedule: str, stages: int, microbatches: int,
                  virtual: int = 1) -> tuple[tuple[Action, ...], ...]:
    """The order of forward and backward actions on each device stage, stage 0 first.

    Every (microbatch, chunk) of a stage appears once as F and once as B, its F before its B
    (and, where the schedule splits the backward, once as W, after its B).

    Raises:
      PlanError: the numbers do not make a pipeline of that schedule (`check_pipeline`).
    """
    check_pipeline(schedule, stages, microbatches, virtual)
    order = SCHEDULES[schedule].order
    return tuple(order(s, stages, microbatches, virtual) for s in range(stages))


def _gpipe(s: int, S: int, M: int, v: int) -> tuple[Action, ...]:
    return (tuple(Action("F", m, s) for m in range(M))
            + tuple(Action("B", m, s) for m in range(M)))


def _1f1b(s: int, S: int, M: int, v: int) -> tuple[Action, ...]:
    return _warm_up_then_alternate(s, S, M, v, warmup=min(S - s - 1, M))


def _zb_h1(s: int, S: int, M: int, v: int) -> tuple[Action, ...]:
    return _weights_deferred(_1f1b(s, S, M, v), s)


def _zb_interleaved(s: int, S: int, M: int, v: int) -> tuple[Action, ...]:
    return _weights_deferred(_interleaved(s, S, M, v), s)


def _weights_deferred(order: tuple[Action, ...], s: int) -> tuple[Action, ...]:
    """`order` with each backward's W right after the backward `s` places later on the
    stage (the last `s` after the last backward): ZB-H1's rule (module doc)."""
    out: list[Action] = []
    done: list[Action] = []
    for a in order:
        out.append(a)
        if a.kind == "B":
            done.append(a)
            if len(done) > s:
                b = done[len(done) - 1 - s]
                out.append(Action("W", b.microbatch, b.chunk))
    out += [Action("W", b.microbatch, b.chunk) for b in done[max(len(done) - s, 0):]]
    return tuple(out)


def _interleaved(s: int, S: int, M: int, v: int) -> tuple[Action, ...]:
    # Megatron-LM's interleaved schedule (schedules.py, forward_backward_pipelining_...)
    total = M * v
    warmup = total if M == S else min((S - s - 1) * 2 + (v - 1) * S, total)
    return _warm_up_then_alternate(s, S, M, v, warmup)


def _warm_up_then_alternate(s: int, S: int, M: int, v: int, warmup: int) -> tuple[Action, ...]:
    """`warmup` forwards, then one forward and one backward in turn, then the backwards left."""
    total = M * v
    fwd = [_virtual(k, s, S, v, forward=True) for k in range(total)]
    bwd = [_virtual(k, s, S, v, forward=False) for k in range(total)]
    order = fwd[:warmup]
    for k in range(total - warmup):
        order += [fwd[warmup + k], bwd[k]]
    order += bwd[total - warmup:]
    return tuple(order)


# Every schedule by name (module doc). Adding one is an order function and a row here; the
# checks, the simulator, the search and apply read its rules from the row.
SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule(_gpipe),
    "1f1b": Schedule(_1f1b),
    "interleaved": Schedule(_interleaved, virtual=True, whole_rounds=True),
    "zb-h1": Schedule(_zb_h1, splits_backward=True),
    "zb-interleaved": Schedule(_zb_interleaved, virtual=True, whole_rounds=True,
                               splits_backward=True),
    "zb-h1-gathered": Schedule(_zb_h1, splits_backward=True, gathered_stash=True),
    "zb-interleaved-gathered": Schedule(_zb_interleaved, virtual=True, whole_rounds=True,
                                        splits_backward=True, gathered_stash=True),
}
# Per schedule, the first one of `SCHEDULES` with its order (a gathered stash's form: the
# lean one's), which its compiled order is cached under.
_SAME_ORDER = {name: next(n for n, r in SCHEDULES.items() if r.order is rules.order)
               for name, rules in SCHEDULES.items()}
# A schedule's name, as `Strategy.schedule` and the plan file hold it (a key of `SCHEDULES`).
ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-interleaved",
                       "zb-h1-gathered", "zb-interleaved-gathered"]
# The schedule of a strategy without stages, and of a plan file written before schedules.
DEFAULT_SCHEDULE: ScheduleName = "1f1b"


def _virtual(k: int, s: int, S: int, v: int, forward: bool) -> Action:
    """The k-th forward (or backward) virtual microbatch of device stage s: microbatches go in
    groups of S through chunk 0, then chunk 1, ... (backwards: from the last chunk)."""
    local = (k % (S * v)) // S
    if not forward:
        local = v - 1 - local
    microbatch = (k // (S * v)) * S + k % S
    return Action("F" if forward else "B", microbatch, local * S + s)


# --- timing -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChunkTimes:
    """What one microbatch costs in each model chunk, the input of `time_schedule`.

    Attributes:
      forward_s, backward_s: one time per chunk (``S * v`` of them, in model order): one
        microbatch's forward, or backward, of that chunk on its device stage.
      send_s: one time per boundary between consecutive chunks (``S * v - 1``): sending one
        microbatch's activation from chunk ``c`` to chunk ``c + 1``; its gradient goes back over
        the same boundary in the same time.
      weight_s: per chunk, the part of its backward that computes its layers' weight
        gradients, at most ``backward_s``: a schedule that splits the backward runs it as the
        chunk's W, the rest as its B (`Schedule.splits_backward`); others ignore it. Empty:
        zeros.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    send_s: tuple[float, ...]
    weight_s: tuple[float, ...] = ()

    def __post_init__(self):
        if not len(self.weight_s):
            object.__setattr__(self, "weight_s", (0.0,) * len(self.backward_s))
        for name in ("forward_s", "backward_s", "send_s", "weight_s"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))
        n = len(self.forward_s)
        if n == 0:
            raise PlanError("ChunkTimes needs a forward and a backward time per chunk, got none")
        if len(self.backward_s) != n:
            raise PlanError(f"ChunkTimes has {n} forward times but {len(self.backward_s)} "
                            "backward times; expected one of each per chunk")
        if len(self.send_s) != n - 1:
            raise PlanError(f"ChunkTimes of {n} chunks needs {n - 1} send times (one per "
                            f"boundary between consecutive chunks), got {len(self.send_s)}")
        if len(self.weight_s) != n:
            raise PlanError(f"ChunkTimes has {n} forward times but {len(self.weight_s)} "
                            "weight-gradient times; expected one per chunk")
        for c, (w, b) in enumerate(zip(self.weight_s, self.backward_s)):
            if w > b:
                raise PlanError(f"ChunkTimes.weight_s[{c}] is {w!r}, more than the chunk's "
                                f"whole backward ({b!r}); it is the part of it that computes "
                                "the weight gradients")

    @property
    def chunks(self) -> int:
        return len(self.forward_s)

    @classmethod
    def uniform(cls, chunks: int, forward_s: float, backward_s: float,
                send_s: float = 0.0, weight_s: float = 0.0) -> ChunkTimes:
        """The same times for every chunk and every boundary."""
        return cls((forward_s,) * chunks, (backward_s,) * chunks, (send_s,) * (chunks - 1),
                   (weight_s,) * chunks)

    def durations(self, split: bool) -> tuple[float, ...]:
        """The time of each kind of action, as `soapjax.strategy._schedule_time` indexes
        them: every chunk's forward, then its backward (its B alone where `split`), then its
        W (zero where not `split`)."""
        if not split:
            return self.forward_s + self.backward_s + (0.0,) * len(self.weight_s)
        return (self.forward_s + tuple(b - w for b, w in zip(self.backward_s, self.weight_s))
                + self.weight_s)


def _seconds(name: str, values) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in values)
    except (TypeError, ValueError):
        raise PlanError(f"ChunkTimes.{name} must be a sequence of times in seconds, got "
                        f"{values!r}") from None
    for i, x in enumerate(out):
        if not (0.0 <= x < math.inf):
            raise PlanError(f"ChunkTimes.{name}[{i}] is {x!r}; times must be finite and >= 0 "
                            "seconds")
    return out


class TimedAction(NamedTuple):
    """An action of a device stage's order, as `time_schedule` timed it."""

    stage: int
    action: Action
    start_s: float
    end_s: float


class TimedSend(NamedTuple):
    """One microbatch's activation (kind ``"F"``: chunk `boundary` to `boundary + 1`) or
    gradient (``"B"``: chunk `boundary + 1` to `boundary`) crossing from stage `sender` to stage
    `receiver`."""

    sender: int
    receiver: int
    microbatch: int
    boundary: int
    kind: str
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class PipelineTimeline:
    """One training step's pipeline, timed (`time_schedule`).

    Attributes:
      schedule, stages, microbatches, virtual: the pipeline.
      times: the chunk and send times it was timed with.
      start_s, end_s: when each action starts and ends, the stages' orders one after the other
        (stage 0's first); `tasks` pairs them with their actions (properties, timed again
        with their records when first read).
      send_start_s, send_end_s: likewise, when the send of each action's output to another stage
        starts and ends (0.0 for actions that send nothing); `sends` lists them.
      step_s: when the last action anywhere ends.
      stage_end_s: per stage, when its last backward ends: its gradient sync can start then.
      busy_s: per stage, the time it computes.
      bubble_fraction: ``1 - mean(busy_s) / step_s``, the share of the step stages sit idle.
      in_flight: per stage, the peak number of (microbatch, chunk) pairs whose forward has run
        and whose backward (its W, where the schedule splits it) has not: the activations the
        stage holds at once (`held`: less, where what waits for its W is less).
      held_pairs: where the schedule splits the backward, per stage, the counts of pairs
        waiting for their B and for their W it passes through (`held`).
    """

    schedule: str
    stages: int
    microbatches: int
    virtual: int
    times: ChunkTimes = dataclasses.field(repr=False)
    step_s: float
    stage_end_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    bubble_fraction: float
    in_flight: tuple[int, ...]
    held_pairs: tuple[tuple[tuple[int, int], ...], ...] = ()

    def held(self, stage: int, stash: float) -> float:
        """`StageHolds.held` of this timeline's schedule."""
        return StageHolds(self.in_flight, self.held_pairs).held(stage, stash)

    # Built on first use: the search reads the summaries above, and records for the 10^5
    # actions of a large pipeline cost ten times the timing itself (the actions' times are
    # timed again, recorded, when first asked for: `soapjax.strategy._schedule_time.recorded`).
    @functools.cached_property
    def _records(self) -> tuple[tuple[float, ...], ...]:
        return recorded(self.stages, self.microbatches, self.virtual, self.times,
                        _compile(_SAME_ORDER[self.schedule], self.stages, self.microbatches,
                                 self.virtual))

    @property
    def start_s(self) -> tuple[float, ...]:
        return self._records[0]

    @property
    def end_s(self) -> tuple[float, ...]:
        return self._records[1]

    @property
    def send_start_s(self) -> tuple[float, ...]:
        return self._records[2]

    @property
    def send_end_s(self) -> tuple[float, ...]:
        return self._records[3]

    @functools.cached_property
    def orders(self) -> tuple[tuple[Action, ...], ...]:
        """Each device stage's actions (`device_orders`)."""
        return device_orders(self.schedule, self.stages, self.microbatches, self.virtual)

    @functools.cached_property
    def tasks(self) -> tuple[TimedAction, ...]:
        """Every action with its times, stage 0's first, each stage's in its order."""
        stage_of = [s for s, order in enumerate(self.orders) for _ in order]
        actions = [a for order in self.orders for a in order]
        return tuple(map(TimedAction, stage_of, actions, self.start_s, self.end_s))

    @functools.cached_property
    def sends(self) -> tuple[TimedSend, ...]:
        """Every transfer between stages, ordered as the actions producing them (which is the
        order each link serves them in)."""
        S, last = self.stages, self.stages * self.virtual - 1
        if S == 1:
            return ()
        out = []
        for task, ts, te in zip(self.tasks, self.send_start_s, self.send_end_s):
            s, (kind, m, c) = task.stage, task.action
            if kind == "F" and c < last:
                out.append(TimedSend(s, (s + 1) % S, m, c, "F", ts, te))
            elif kind == "B" and c > 0:
                out.append(TimedSend(s, (s - 1) % S, m, c - 1, "B", ts, te))
        return tuple(out)


class StageHolds(NamedTuple):
    """What each stage of a pipeline holds at its peak, as `PipelineTimeline` has it
    (`in_flight`, `held_pairs`), from the schedule's orders alone (`stage_holds`)."""

    in_flight: tuple[int, ...]
    held_pairs: tuple[tuple[tuple[int, int], ...], ...] = ()

    def held(self, stage: int, stash: float) -> float:
        """What `stage` holds at its peak, in microbatches' activations, where a microbatch
        whose B has run and W has not holds `stash` of one (its weight matmuls' operands and
        cotangents, `soapjax.apply._deferred`; more than one where the forward keeps less,
        recomputing): `in_flight` for a schedule that does not split the backward."""
        if not self.held_pairs:
            return float(self.in_flight[stage])
        return max(fb + stash * bw for fb, bw in self.held_pairs[stage])


@functools.lru_cache(maxsize=96)
def stage_holds(schedule: str, stages: int, microbatches: int, virtual: int) -> StageHolds:
    """What each stage holds at its peak under `schedule` (`StageHolds`): the same as the
    timed pipeline's (`time_schedule`), without its dependency order, which takes seconds to
    compile at hundreds of thousands of actions; what a search reads to rule out a schedule
    that does not fit before it times it (`soapjax.search.stages.choose_schedule`).

    >>> stage_holds("1f1b", 4, 8, 1).in_flight, stage_holds("gpipe", 4, 8, 1).in_flight
    ((4, 3, 2, 1), (8, 8, 8, 8))

    Raises:
      PlanError: the numbers do not make a pipeline (`check_pipeline`).
    """
    check_pipeline(schedule, stages, microbatches, virtual)
    in_flight, _, held = holds(device_orders(_SAME_ORDER[schedule], stages, microbatches,
                                             virtual))
    return StageHolds(in_flight, held)


def time_schedule(schedule: str, stages: int, microbatches: int, virtual: int,
                  times: ChunkTimes) -> PipelineTimeline:
    """Times a pipeline schedule: an event simulation of `device_orders`.

    Each device stage runs its actions in its order, one at a time; an action starts when its
    stage is free and its input has arrived. ``F(m, c)`` needs ``F(m, c - 1)`` and its send to
    chunk ``c``; ``B(m, c)`` needs ``F(m, c)`` and (but for the last chunk) ``B(m, c + 1)`` and
    its send back. With one stage, consecutive chunks share it and nothing is sent. Each stage
    boundary (``s -> s + 1``, and the last stage to stage 0 when interleaving) has one link per
    direction (activations forward, gradients back) that sends one microbatch at a time, first
    come first served; its sends all come from one stage, so it serves them in that stage's
    order. The arithmetic is plain float sums and maxima: exact for times that are exact in
    binary.

    Cost (`soapjax.strategy._schedule_time`): one pass over the ``2 M S v`` actions, less
    the periods a steady pipeline repeats; the dependency order is computed once per
    (schedule, stages, microbatches, virtual) and cached, and the last `TIMELINES_KEPT`
    timelines are kept by their arguments (many of a search's proposals on a pipeline leave
    every chunk's time as another proposal had it: a change of the embedding's or the head's
    layout, or of memory alone; docs/vs-experts.md).

    Example: the 1F1B doctest of this module, forwards of 1 s and backwards of 2 s, no sends:
    ``(M + S - 1) (f + b) = 12 s``, of which each stage computes ``M (f + b) = 9 s``.

    >>> t = time_schedule("1f1b", 2, 3, 1, ChunkTimes.uniform(2, 1.0, 2.0))
    >>> t.step_s, t.stage_end_s, t.bubble_fraction, t.in_flight
    (12.0, (12.0, 10.0), 0.25, (2, 1))

    Raises:
      PlanError: the numbers do not make a pipeline (`check_pipeline`), or `times` has not one
        entry per chunk (``stages * virtual``).
    """
    check_pipeline(schedule, stages, microbatches, virtual)
    if not isinstance(times, ChunkTimes):
        raise PlanError(f"time_schedule needs a ChunkTimes, got {type(times).__name__}")
    if times.chunks != stages * virtual:
        raise PlanError(f"{stages} stages x {virtual} virtual stages make {stages * virtual} "
                        f"chunks, but the ChunkTimes has times for {times.chunks}")
    return _kept_timeline(schedule, stages, microbatches, virtual, times)


# The most timelines `time_schedule` keeps by their arguments.
TIMELINES_KEPT = 256


@functools.lru_cache(maxsize=TIMELINES_KEPT)
def _kept_timeline(schedule: str, S: int, M: int, v: int, times: ChunkTimes
                   ) -> PipelineTimeline:
    """The timeline of these arguments (a pure function of them; the timeline is immutable)."""
    compiled = _compile(_SAME_ORDER[schedule], S, M, v)
    free = stage_ends(S, M, v, times, compiled)
    busy = tuple(M * sum(times.forward_s[c] + times.backward_s[c] for c in chunks_of(s, S, v))
                 for s in range(S))
    step = max(free)
    bubble = 1.0 - sum(busy) / S / step if step > 0 else 0.0
    return PipelineTimeline(schedule, S, M, v, times, step, tuple(free), busy, bubble,
                            compiled.in_flight, compiled.held)


def forget_timelines() -> None:
    """Drops the timelines `time_schedule` keeps (a benchmark then times each again)."""
    _kept_timeline.cache_clear()


# A search's pipelines with their microbatch counts are dozens of compiled orders (up to
# 60 on the cases of docs/vs-experts.md), seconds each to compile again at hundreds of
# thousands of actions (28 bytes an action).
@functools.lru_cache(maxsize=96)
def _compile(schedule: str, S: int, M: int, v: int) -> Compiled:
    """The pipeline's actions in dependency order, compiled once per pipeline."""
    return compile_orders(S, M, v, device_orders(schedule, S, M, v))
