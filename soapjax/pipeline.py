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

`device_orders` gives those orders as data; simulation (`soapjax.simulate`) times them and apply
(`soapjax.apply`) runs them, so both follow one definition.

Example: 2 stages, 3 microbatches, 1F1B. Stage 0 warms up with one forward; stage 1 (the last)
alternates from the start.

>>> for stage in device_orders("1f1b", stages=2, microbatches=3):
...     print(" ".join(f"{a.kind}{a.microbatch}" for a in stage))
F0 F1 B0 F2 B1 B2
F0 B0 F1 B1 F2 B2
"""

from __future__ import annotations

from typing import NamedTuple

from soapjax.errors import PlanError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    """One step of a device stage's order: the forward (``"F"``) or backward (``"B"``) of model
    chunk `chunk` (0 .. S*v - 1, in model order) on microbatch `microbatch`."""

    kind: str
    microbatch: int
    chunk: int


def check_pipeline(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Raises `PlanError` saying what is wrong with a pipeline's numbers, if anything is.

    >>> check_pipeline("interleaved", stages=4, microbatches=6, virtual=2)
    Traceback (most recent call last):
    ...
    soapjax.errors.PlanError: the interleaved schedule needs the microbatches (6) to be a \
multiple of the stages (4)
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    for name, value in (("stages", stages), ("microbatches", microbatches),
                        ("virtual stages", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"pipeline {name} must be an integer >= 1, got {value!r}")
    if schedule == "interleaved":
        if virtual < 2:
            raise PlanError(f"the interleaved schedule needs 2 or more virtual stages per "
                            f"device, got {virtual}")
        if microbatches % stages:
            raise PlanError(f"the interleaved schedule needs the microbatches ({microbatches}) "
                            f"to be a multiple of the stages ({stages})")
    elif virtual != 1:
        raise PlanError(f"{virtual} virtual stages per device need the 'interleaved' schedule, "
                        f"not {schedule!r}")


def chunks_of(stage: int, stages: int, virtual: int = 1) -> tuple[int, ...]:
    """The model chunks device stage `stage` holds, in model order.

    >>> chunks_of(1, stages=4, virtual=2)
    (1, 5)
    """
    return tuple(j * stages + stage for j in range(virtual))


def device_orders(schedule: str, stages: int, microbatches: int,
                  virtual: int = 1) -> tuple[tuple[Action, ...], ...]:
    """The order of forward and backward actions on each device stage, stage 0 first.

    Every (microbatch, chunk) of a stage appears once as F and once as B, its F before its B.

    Raises:
      PlanError: the numbers do not make a pipeline of that schedule (`check_pipeline`).
    """
    check_pipeline(schedule, stages, microbatches, virtual)
    return tuple(_order(schedule, s, stages, microbatches, virtual) for s in range(stages))


def _order(schedule: str, s: int, S: int, M: int, v: int) -> tuple[Action, ...]:
    if schedule == "gpipe":
        return (tuple(Action("F", m, s) for m in range(M))
                + tuple(Action("B", m, s) for m in range(M)))
    total = M * v
    if schedule == "1f1b":
        warmup = min(S - s - 1, M)
    else:  # Megatron-LM's interleaved schedule (schedules.py, forward_backward_pipelining_...)
        warmup = total if M == S else min((S - s - 1) * 2 + (v - 1) * S, total)
    fwd = [_virtual(k, s, S, v, forward=True) for k in range(total)]
    bwd = [_virtual(k, s, S, v, forward=False) for k in range(total)]
    order = fwd[:warmup]
    for k in range(total - warmup):
        order += [fwd[warmup + k], bwd[k]]
    order += bwd[total - warmup:]
    return tuple(order)


def _virtual(k: int, s: int, S: int, v: int, forward: bool) -> Action:
    """The k-th forward (or backward) virtual microbatch of device stage s: microbatches go in
    groups of S through chunk 0, then chunk 1, ... (backwards: from the last chunk)."""
    local = (k % (S * v)) // S
    if not forward:
        local = v - 1 - local
    microbatch = (k // (S * v)) * S + k % S
    return Action("F" if forward else "B", microbatch, local * S + s)
