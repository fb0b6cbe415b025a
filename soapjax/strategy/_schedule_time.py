"""Timing a pipeline schedule, the engine of `soapjax.strategy.pipeline.time_schedule`: the
stages' orders of actions put in dependency order once per pipeline (`compile_orders`), the
event loop over them (`stage_ends`), which skips a steady pipeline's repeating periods
(`_periodic`, `_jump`), and the loop again with every action's times recorded, for reports
(`recorded`).

The loop is the pipeline's whole cost in the search (GPT 530B's 35 stages x 3 virtual x 280
microbatches are 58,800 actions a step); `time_schedule` and `PipelineTimeline` are the
interface, in `soapjax.strategy.pipeline`, which this module does not import (an order is a
sequence of ``(kind, microbatch, chunk)`` actions; times are a ``ChunkTimes``).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["Compiled", "compile_orders", "holds", "recorded", "stage_ends"]


class Compiled(NamedTuple):
    """A pipeline's dependency structure, timed by `stage_ends` for any chunk times.

    `steps` are seven columns (arrays, 4 bytes an entry: a 786,432-action pipeline takes 22
    MB) with one entry per action, each action after every action whose output it needs:
    its position in `PipelineTimeline.tasks`, its stage, its index into
    ``ChunkTimes.durations(split)`` (F, B, W: ``c``, ``C + c``, ``2 C + c``), the arrival
    slot of its input from another stage (or -1), the link its output leaves on (``0 ..
    S-1``: activations from that stage, ``S + s``: gradients to stage s; or -1), its index
    into ``send_s``, and the arrival slot its send fills.

    `periodic` is where the steps repeat (`_Periodic`), or None. `split`: the orders hold W
    actions (the backward split in two); `held` then has, per stage, the pairs ``(forwards
    whose B has not run, B's whose W has not)`` the stage passes through that no other pair
    of it exceeds in both (`_held_pairs`).
    """

    steps: tuple[array.array, ...]
    in_flight: tuple[int, ...]
    periodic: _Periodic | None = None
    split: bool = False
    held: tuple[tuple[tuple[int, int], ...], ...] = ()


class _Periodic(NamedTuple):
    """A run of `Compiled.steps` that repeats: from step ``start``, ``periods`` periods of
    ``length`` steps, each the one before with its tasks ``tasks`` later in their stages'
    orders and its arrival slots ``slots`` later (the same microbatches' actions, ``p``
    microbatches on). What a period reads that an earlier one wrote is, at each period's
    start, ``pending`` (shifted by ``slots`` a period); it touches the stages ``stages`` and
    the links ``links``. `stage_ends` skips the periods once one ends exactly a constant later
    than the one before (`_jump`)."""

    start: int
    length: int
    periods: int
    slots: int
    stages: tuple[int, ...]
    links: tuple[int, ...]
    pending: tuple[int, ...]


def stage_ends(S: int, M: int, v: int, times, compiled: Compiled) -> list[float]:
    """When each stage's last action ends, timed with `times` (a ``ChunkTimes``): each stage
    runs its actions in order, an action starts when its stage is free and its input has
    arrived, each link sends one microbatch at a time (`time_schedule`'s rules)."""
    duration = times.durations(compiled.split)
    send = times.send_s
    free = [0.0] * S
    link_free = [0.0] * (2 * S)
    arrive = [0.0] * (2 * M * S * v)
    # The hot loop: a few list reads and comparisons per action; the actions' own times are
    # not kept (`recorded` keeps them, for the timeline's records).
    def run(lo: int, hi: int) -> None:
        for _, s, d, waits_for, link, boundary, delivers in zip(
                *(column[lo:hi] for column in compiled.steps)):
            t = free[s]
            if waits_for >= 0 and arrive[waits_for] > t:
                t = arrive[waits_for]
            e = free[s] = t + duration[d]
            if link >= 0:
                ts = link_free[link]
                if e > ts:  # noqa: PLR1730 (a comparison is 7x faster than a call to max)
                    ts = e
                link_free[link] = arrive[delivers] = ts + send[boundary]

    per = compiled.periodic
    if per is None:
        run(0, len(compiled.steps[0]))
    else:
        run(0, per.start)
        before = None
        k = 0
        while k < per.periods:
            at = per.start + k * per.length
            state = ([free[s] for s in per.stages] + [link_free[x] for x in per.links]
                     + [arrive[w + k * per.slots] for w in per.pending])
            if before is not None and k + 1 < per.periods:
                skip = _jump(before, state, per, k, free, link_free, arrive)
                if skip:
                    k += skip
                    continue
            before = state
            run(at, at + per.length)
            k += 1
        run(per.start + per.periods * per.length, len(compiled.steps[0]))
    return free


# How close a period's increments must be (relative to the times) to count as one constant.
_STEADY_TOLERANCE = 1e-12


def _jump(before: list[float], state: list[float], per: _Periodic, k: int, free: list[float],
          link_free: list[float], arrive: list[float]) -> int:
    """At the start of period `k` of `per`, where `state` (the stages' and links' free times
    and the pending arrivals) is `before` (period k - 1's start) plus one constant: the
    periods until the last are all the same constant later (each is a max-plus map of the
    one before, which commutes with adding a constant), so the state jumps there. Returns the
    periods skipped (0: the increments differ)."""
    lam = state[0] - before[0]
    scale = max(abs(state[0]), abs(state[-1]), 1e-300) * _STEADY_TOLERANCE
    for a, b in zip(before, state):
        if abs(b - a - lam) > scale:
            return 0
    skip = per.periods - 1 - k  # the last period and what follows run as they are
    if skip <= 0:
        return 0
    add = skip * lam
    for s in per.stages:
        free[s] += add
    for x in per.links:
        link_free[x] += add
    for w in per.pending:
        arrive[w + (k + skip) * per.slots] = arrive[w + k * per.slots] + add
    return skip


# The fewest steps a period of `_Periodic` spans: checking the state at each period's start
# costs a pass over it, a small share of a period this long.
_MIN_PERIOD_STEPS = 1024


def _periodic(columns: tuple[array.array, ...], S: int, M: int, v: int) -> _Periodic | None:
    """The longest run of the steps (`Compiled.steps`' `columns`) that repeats every ``p``
    microbatches (p = 1 and p = S tried, as many of them as make a period of
    `_MIN_PERIOD_STEPS` steps; each stage's forward and backward, or one of them), with what
    a period needs from the ones before it checked to be the same, shifted, at every
    period's start (`_Periodic`); None without three periods."""
    task, stage, dur, waits, link, boundary, delivers = (np.frombuffer(c, dtype=np.int32)
                                                          for c in columns)
    C, n = S * v, len(task)
    writer = np.full(2 * M * C, -1)  # per arrival slot, the step that fills it, and reads it
    reader = np.full(2 * M * C, -1)
    steps = np.arange(n)
    writer[delivers[delivers >= 0]] = steps[delivers >= 0]
    reader[waits[waits >= 0]] = steps[waits >= 0]
    best: _Periodic | None = None
    # a steady 1F1B stage runs a microbatch's 2v actions each period, GPipe's v (forwards,
    # then backwards); the interleaved schedule repeats every S microbatches
    per = n // (M * S)  # a stage's actions per microbatch: 2 v, or 3 v with W's
    for base, actions in ((1, per), (S, per), (1, v)):
        if M % base:
            continue
        steps_per = actions * base * S  # every stage's actions of `base` microbatches
        p = base * max(1, -(-_MIN_PERIOD_STEPS // steps_per))
        length, tasks, slots = actions * p * S, actions * p, p * C
        if 3 * length > n:
            continue
        # the longest run where each step is the one a period before, shifted
        a, b = slice(0, n - length), slice(length, n)
        same = ((task[b] == task[a] + tasks) & (stage[b] == stage[a]) & (dur[b] == dur[a])
                & (link[b] == link[a]) & (boundary[b] == boundary[a])
                & (waits[b] == np.where(waits[a] >= 0, waits[a] + slots, -1))
                & (delivers[b] == np.where(delivers[a] >= 0, delivers[a] + slots, -1)))
        edges = np.diff(np.concatenate(([0], same.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            continue
        longest = int(np.argmax(ends - starts))
        start, run_len = int(starts[longest]), int(ends[longest] - starts[longest])
        periods = (run_len + length) // length
        if periods < 3:
            continue
        # per period's start, the arrival slots written before it and read from it on
        at = []
        for k in range(periods):
            bound = start + k * length
            at.append(np.flatnonzero((writer >= 0) & (writer < bound) & (reader >= bound)))
        pending = at[0]
        if any(len(at[k]) != len(pending) or not np.array_equal(at[k], pending + k * slots)
               for k in range(1, periods)):
            continue
        found = _Periodic(start, length, periods, slots,
                          tuple(sorted(set(stage[start:start + length].tolist()))),
                          tuple(sorted(set(link[start:start + length].tolist()) - {-1})),
                          tuple(pending.tolist()))
        if best is None or found.periods * found.length > best.periods * best.length:
            best = found
    return best


def recorded(S: int, M: int, v: int, times, compiled: Compiled
             ) -> tuple[tuple[float, ...], ...]:
    """`stage_ends`' loop again, keeping every action's start and end and its send's:
    ``(start_s, end_s, send_start_s, send_end_s)`` (`PipelineTimeline`'s records)."""
    n = len(compiled.steps[0])
    duration = times.durations(compiled.split)
    send = times.send_s
    free = [0.0] * S
    link_free = [0.0] * (2 * S)
    arrive = [0.0] * (2 * M * S * v)
    start, end = [0.0] * n, [0.0] * n
    send_start, send_end = [0.0] * n, [0.0] * n
    for task, s, d, waits_for, link, boundary, delivers in zip(*compiled.steps):
        t = free[s]
        if waits_for >= 0 and arrive[waits_for] > t:
            t = arrive[waits_for]
        e = t + duration[d]
        start[task] = t
        free[s] = end[task] = e
        if link >= 0:
            ts = link_free[link]
            if e > ts:  # noqa: PLR1730
                ts = e
            te = ts + send[boundary]
            link_free[link] = arrive[delivers] = send_end[task] = te
            send_start[task] = ts
    return tuple(start), tuple(end), tuple(send_start), tuple(send_end)


def compile_orders(S: int, M: int, v: int, orders: Sequence[Sequence]) -> Compiled:
    """The stages' `orders` (``device_orders``) as `Compiled` steps, with their periodic run."""
    offset = [0] * S
    for s in range(1, S):
        offset[s] = offset[s - 1] + len(orders[s - 1])
    C = S * v
    steps = [_step(S, M, C, s, offset[s] + p, orders[s][p])
             for s, p in _dependency_order(orders, M, C)]
    columns = tuple(array.array("i", column) for column in zip(*steps))
    in_flight, split, held = holds(orders)
    return Compiled(columns, in_flight, _periodic(columns, S, M, v) if S > 1 else None, split,
                    held)


def holds(orders: Sequence[Sequence]) -> tuple[tuple[int, ...], bool,
                                               tuple[tuple[tuple[int, int], ...], ...]]:
    """What the stages' `orders` hold, as `Compiled` has it: per stage its peak in flight
    (`_peak_in_flight`), whether the orders split the backward (W actions), and then per
    stage its `_held_pairs` (else ``()``). From the orders alone: no dependency order."""
    split = any(a.kind == "W" for order in orders for a in order)
    return (tuple(_peak_in_flight(order, split) for order in orders), split,
            tuple(map(_held_pairs, orders)) if split else ())


def _step(S: int, M: int, C: int, s: int, task: int, a) -> tuple[int, ...]:
    """One of `Compiled.steps`. Arrival slots: ``m C + c`` for the activation into F(m, c),
    ``M C + m C + c`` for the gradient into B(m, c)."""
    k = a.microbatch * C + a.chunk
    if a.kind == "W":  # after its B, on the same stage: the order keeps it
        return (task, s, 2 * C + a.chunk, -1, -1, -1, -1)
    if S == 1:  # every chunk on one stage: its order alone keeps the dependencies
        return (task, s, a.chunk if a.kind == "F" else C + a.chunk, -1, -1, -1, -1)
    if a.kind == "F":
        waits = k if a.chunk > 0 else -1
        if a.chunk < C - 1:
            return (task, s, a.chunk, waits, s, a.chunk, k + 1)
        return (task, s, a.chunk, waits, -1, -1, -1)
    waits = M * C + k if a.chunk < C - 1 else -1
    if a.chunk > 0:  # the gradient crosses boundary c - 1, from stage s to stage s - 1
        return (task, s, C + a.chunk, waits, S + (s - 1) % S, a.chunk - 1, M * C + k - 1)
    return (task, s, C + a.chunk, waits, -1, -1, -1)


def _dependency_order(orders, M: int, C: int) -> list[tuple[int, int]]:
    """(stage, position) of every action, each after the actions whose outputs it needs,
    position by position where every action reads only actions at its position or before
    (the schedules of `device_orders` but for some that place W actions: then
    `_greedy_order`): round k runs each stage's action at position k, in sweeps over the
    stages until all have run. The steady part of a schedule is then the same rounds again
    and again (`_periodic`).

    Past a round's first sweep the sweeps are worked out rather than run (GPipe's
    backwards, each waiting for the next stage's, take S sweeps a round): an action left
    reads one other action (a forward the previous chunk's, a backward the next chunk's),
    so it runs in sweep 2 where that one ran in the first, else in that one's sweep where
    that one's stage comes first in a sweep, and in the sweep after where it comes later."""
    done = _Done(M, C)
    out: list[tuple[int, int]] = []
    longest = max(map(len, orders))
    for k in range(longest):
        left = []
        for s, order in enumerate(orders):
            if k < len(order):
                if done.take(order[k]):
                    out.append((s, k))
                else:
                    left.append(s)
        if left:
            later = _later_sweeps([orders[s][k] for s in left], left, done)
            if later is None:
                return _greedy_order(orders, M, C)
            out.extend((s, k) for s in later)
    return out


def _later_sweeps(actions: list, stages: list[int], done: _Done) -> list[int] | None:
    """`_dependency_order`'s sweeps of a round from its second: the `stages` of the
    `actions` its first sweep left, in the order the sweeps run them (each then marked
    done); None where one waits for an action of a later round."""
    C = done.C
    at = {}  # each left action -> its index in `actions`
    for i, (kind, m, c) in enumerate(actions):
        at[kind, m, c] = i
    sweep = [0] * len(actions)
    for i in range(len(actions)):
        chain = [i]  # follow what it reads down to one whose sweep is known
        prev, first = -1, 2
        while True:
            kind, m, c = actions[chain[-1]]
            need = (kind, m, c - 1) if kind == "F" else (kind, m, c + 1)
            j = at.get(need)
            if j is None:
                if need[2] < 0 or need[2] >= C or done.ran(need):
                    break
                return None
            if sweep[j]:
                prev, first = j, sweep[j]
                break
            chain.append(j)
        for a in reversed(chain):
            first += prev >= 0 and stages[prev] > stages[a]
            sweep[a] = first
            prev = a
    ranked = sorted(range(len(actions)), key=lambda i: (sweep[i], stages[i]))
    for i in ranked:
        done.take(actions[i])
    return [stages[i] for i in ranked]


def _greedy_order(orders, M: int, C: int) -> list[tuple[int, int]]:
    """`_dependency_order` where some action reads one at a later position of another
    stage: each stage runs as far as it can, in sweeps over the stages."""
    done = _Done(M, C)
    out: list[tuple[int, int]] = []
    pos = [0] * len(orders)
    while any(p < len(o) for p, o in zip(pos, orders)):
        moved = False
        for s, order in enumerate(orders):
            while pos[s] < len(order) and done.take(order[pos[s]]):
                out.append((s, pos[s]))
                pos[s] += 1
                moved = True
        assert moved, f"deadlock in the pipeline orders at positions {pos}"
    return out


class _Done:
    """Which forwards and backwards have run; `take` runs an action if what it needs has."""

    def __init__(self, M: int, C: int):
        self.C = C
        self.f, self.b = bytearray(M * C), bytearray(M * C)

    def take(self, action) -> bool:
        kind, m, c = action
        j = m * self.C + c
        if kind == "F":
            if c and not self.f[j - 1]:
                return False
            self.f[j] = 1
        elif kind == "B":
            if c < self.C - 1 and not self.b[j + 1]:
                return False
            self.b[j] = 1
        return True  # a W: after its B, on the same stage (the order keeps it)

    def ran(self, action) -> bool:
        """Whether the forward or backward `action` has run."""
        kind, m, c = action
        return bool((self.f if kind == "F" else self.b)[m * self.C + c])


def _held_pairs(order: Sequence) -> tuple[tuple[int, int], ...]:
    """The ``(forwards whose B has not run, B's whose W has not)`` counts a stage's `order`
    passes through, but those another exceeds in both: the peak of ``a x + b y`` over the
    order, for any ``a, b >= 0``, is at one of them."""
    seen = set()
    fb = bw = 0
    for a in order:
        if a.kind == "F":
            fb += 1
        elif a.kind == "B":
            fb, bw = fb - 1, bw + 1
        else:
            bw -= 1
        seen.add((fb, bw))
    return tuple(sorted(p for p in seen
                        if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in seen)))


def _peak_in_flight(order: Sequence, split: bool) -> int:
    """The most (microbatch, chunk) pairs whose forward has run and whose backward (its W,
    where `split`: what W reads is kept until then) has not."""
    done = "W" if split else "B"
    live = peak = 0
    for a in order:
        live += 1 if a.kind == "F" else -1 if a.kind == done else 0
        peak = max(peak, live)
    return peak
