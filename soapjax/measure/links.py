"""Measured collectives and shared compute: what the attached devices really cost.

A topology file's links are datasheet figures, and for 8 virtual XLA:CPU devices in one process
there is no datasheet: a "link" is a memcpy plus a rendezvous of 8 threads, and the 8 devices
share the host's cores. Priced by the hand-written ``cpu8`` file (5 GB/s, 5 us links, each device
computing alone), measured steps were 4-62x the simulated ones and the simulator did not order
plans (docs/results.md, before this module). So this module measures what the simulator prices,
on whatever is attached (`soapjax calibrate --links`):

* **Collectives.** Each kind XLA emits (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute) over each mesh axis (and over the whole mesh), at buffer sizes from
  256 bytes to 64 MB, timed as `soapjax.measure._timing` times operators: many repetitions inside
  one compiled program, inside one `shard_map`, so dispatch is amortised and nothing but the
  collective crosses devices. Short trials are taken 3 at a time in passes over every
  collective and size (a slow spell of the host holds one pass, not a whole size): 3 passes
  over all of them, 4 more over all but the longest (64 MB, most of a pass's time). Each pass
  keeps the median of its trials, not the least (a rendezvous of 8 device threads on 2 cores
  is fast in some trials and 1.5-2x slower in others, and a training step meets the typical
  case), and a size keeps the geometric mean of its passes (`across_passes`).
  Each (kind, axes) is modelled by its measured times, made non-decreasing in size, joined
  by straight lines: a piecewise
  ``latency + nbytes / bandwidth`` with a piece between each two measured sizes (XLA:CPU
  changes algorithm, and caches run out, at sizes that differ per collective and axis, which
  few least-squares segments did not follow). Sizes between the measured ones are held back
  and predicted, to check the model. On a GPU node the same code measures NCCL.
* **Shared compute.** The same chain of matmuls timed on one device alone and on every device
  at once: ``concurrent_devices = n * t_alone / t_all`` is how many devices compute at full
  speed together (on 8 virtual devices of a 2-core host, about 2); the simulator stretches
  every compute task by ``n / concurrent_devices``.
* **Compute beside collectives.** Independent chains of matmuls and all-reduces, timed apart
  and together in one program (`measure_overlap`): how much of a collective's time compute
  hides. On XLA:CPU none (the cores that compute also copy and reduce; together they take
  longer than the sum), so the simulator puts each collective on the compute stream too; on a
  GPU, NCCL's kernels run beside the compute kernels.
* **Calling a step.** A step-shaped program taking and returning n arrays (a few kernels per
  array, its devices synchronised by a chain of all-reduces), called one call at a time, less
  the same program timed in a loop: ``step_overhead + n * output_overhead``
  (`measure_call_overhead`), which the simulator adds to every step (a step returns its
  parameters and optimizer state). On XLA:CPU the kernels of a call's top-level program cost
  more than the same kernels in a loop body, where the operator timer measures them; this
  prices that too.

The results go into the topology file (`write_topology`) as ``[compute]`` and
``[[collectives]]`` tables, with the fit's residuals in comments; `soapjax.topology.cluster` reads
them. The fitting and writing are pure functions (`fit_collective`, `format_measured`), tested on
synthetic data.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from soapjax.base.collectives import XLA_COLLECTIVES
from soapjax.base.errors import TopologyError
from soapjax.measure._timing import (
    TimingOptions,
    compile_loop,
    kick,
    median_call,
    quiet_gc,
    time_compiled,
    time_loop,
)
from soapjax.topology.cluster import CollectiveModel, ComputeSharing, Topology, make_mesh

__all__ = ["FIT_SIZES", "HELD_SIZES", "MARKER", "MEASURED_KINDS", "SHORT_S", "Fit", "Sample",
           "across_passes", "axis_sets", "calibrate_links", "call_probe", "collective_loop",
           "fit_collective", "fit_samples", "format_measured", "measure_call_overhead",
           "measure_overlap", "measure_sharing", "monotone", "time_collective", "write_calibrated",
           "write_topology"]

MEASURED_KINDS: tuple[str, ...] = XLA_COLLECTIVES  # point_to_point is no XLA instruction
# Fitted sizes and held-back sizes between them (bytes of the buffer): 256 B .. 256 KiB in powers
# of 4, then steps of 1.5x and 1.33x to 16 MiB, where XLA:CPU changes algorithm and its caches
# and memory run out (on cpu8: all-to-all over `model` 0.5 ms at 512 KiB, 1.9 ms at 1 MiB; over
# the whole mesh 16 ms at 8 MiB, 54 ms at 16 MiB, 1.1 s at 64 MiB), and 64 MiB.
FIT_SIZES: tuple[int, ...] = tuple(sorted({*(2**k for k in (8, 10, 12, 14, 16, 18, 19, 20, 21, 22,
                                                            23, 24, 26)),
                                           *(3 * 2**k for k in range(17, 23))}))
HELD_SIZES: tuple[int, ...] = (3 * 2**10, 48 * 2**10, 640 * 2**10, 10 * 2**20)
MARKER = "# --- measured by `soapjax calibrate --links`"
# The median of many short trials: the time of a rendezvous of 8 threads on 2 cores depends on
# how the OS schedules them, moving between a fast and a 1.5-2x slower mode from one trial to
# the next; a step meets the typical case (`TimingOptions.statistic`).
_TIMING = TimingOptions(target_trial_s=0.004, trials=9, statistic="median")
SHORT_S = 0.05  # collectives shorter than this are timed in `short_passes` more passes


class Sample(NamedTuple):
    """One timed collective: buffer bytes (the `soapjax.base.collectives` convention), seconds."""

    nbytes: float
    seconds: float


class Fit(NamedTuple):
    """A fitted collective: the model, and its relative errors on fitted and held-back sizes."""

    model: CollectiveModel
    residuals: tuple[float, ...]  # (predicted - measured) / measured, fitted sizes
    held_out: tuple[tuple[float, float], ...]  # (nbytes, relative error), held-back sizes


# --- fitting (pure) ------------------------------------------------------------------------------


def across_passes(seconds: Sequence[float]) -> float:
    """One collective's time from its passes' times: their geometric mean.

    Not their median: a pass lands in the rendezvous' fast or slow mode (`_TIMING`), and with
    few passes the median jumps between the modes with the proportion of passes in each, while
    a step of many collectives pays a mix of both. Recombined from the passes of four cpu8
    calibrations, the held-back sizes came out 7.2-8.2% off on average and 30-69% at worst
    with the median of 3 passes, 5.4-7.4% and 20-41% with the geometric mean (small sizes
    timed in 9 passes: 5.3% and 17% with the median, 2.7% and 7% with the geometric mean;
    the arithmetic mean about as well as the geometric one: docs/accuracy.md).

    >>> round(across_passes([1e-5, 4e-5]) * 1e6, 3)
    20.0
    """
    if not seconds or min(seconds) <= 0:
        raise TopologyError(f"expected positive collective times, found {list(seconds)}")
    return float(np.exp(np.mean(np.log(seconds))))


def monotone(samples: Sequence[Sample]) -> list[Sample]:
    """`samples` sorted by size, their times made non-decreasing: where a larger buffer
    measured faster than a smaller one, both get the geometric mean of the run that breaks the
    order (pool-adjacent-violators on log seconds, the least-squares such fit).

    A larger buffer of the same collective does not take less time; where it measured so, that
    is the host's noise (on 2 cores, +-20% between trials a second apart), mostly among the
    latency-bound sizes, and pooling the run averages it out.

    >>> [round(x.seconds, 6) for x in monotone([Sample(1, 4e-6), Sample(2, 1e-6), Sample(4, 5e-6)])]
    [2e-06, 2e-06, 5e-06]
    """
    xs = sorted(samples)
    blocks: list[list[float]] = []  # [mean log seconds, count]
    for x in xs:
        blocks.append([math.log(x.seconds), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v2, n2), (v1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(v1 * n1 + v2 * n2) / (n1 + n2), n1 + n2])
    pooled = [None if n == 1 else math.exp(v) for v, n in blocks for _ in range(int(n))]
    return [x if t is None else Sample(x.nbytes, t) for x, t in zip(xs, pooled)]


def _errors(model: CollectiveModel, samples: Sequence[Sample]) -> tuple[float, ...]:
    return tuple(model.time(x.nbytes) / x.seconds - 1.0 for x in samples)


def fit_collective(kind: str, axes: Sequence[str], samples: Sequence[Sample]) -> CollectiveModel:
    """The measured `samples`, made `monotone`, joined by straight lines
    (`CollectiveModel.through`): a piecewise ``latency + nbytes / bandwidth`` with a piece
    between each two measured sizes.

    XLA:CPU's collectives change speed several times between 256 KB and 16 MB (algorithms
    change, caches run out) and where each change falls differs per collective and axis, so
    no few-segment line fits them. Refitted on the raw timings of four cpu8 calibrations, the
    sizes held back between the measured ones came out 9-11% off on average and 40-89% at
    worst with up to four least-squares segments (768 KB +35% to +63%: just past a cut),
    7-8% and 30-69% joined through the measured sizes (docs/accuracy.md). A line's samples
    stay one segment.

    >>> xs = [Sample(s, 1e-5 + s / 1e9) for s in (1e2, 1e4, 1e6, 1e8)]
    >>> m = fit_collective("all_reduce", ("model",), xs)
    >>> len(m.segments), round(m.segments[0][1] * 1e6, 3), round(m.segments[0][2] / 1e9, 3)
    (1, 10.0, 1.0)
    """
    if len(samples) < 2:
        raise TopologyError(f"fitting {kind} over {list(axes)}: expected 2 or more sizes, "
                            f"found {len(samples)}")
    return CollectiveModel.through(kind, axes, [tuple(x) for x in monotone(samples)])


def fit_samples(kind: str, axes: Sequence[str], fitted: Sequence[Sample],
                held: Sequence[Sample] = ()) -> Fit:
    """`fit_collective` on `fitted`, with its errors on `fitted` and on the `held` samples."""
    m = fit_collective(kind, axes, fitted)
    return Fit(m, _errors(m, sorted(fitted)),
               tuple((x.nbytes, e) for x, e in zip(held, _errors(m, held))))


# --- writing (pure) -------------------------------------------------------------------------------


def _si(x: float, units: Sequence[tuple[str, float]]) -> str:
    for name, scale in units:
        if abs(x) >= scale or scale == units[-1][1]:
            return f'"{x / scale:.4g} {name}"'
    raise AssertionError


def _bytes(x: float) -> str:
    return _si(x, [("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0)])


def _size(n: float) -> str:
    """Bytes exactly, in KiB or MiB where they divide it (`_bytes` rounds to 4 digits)."""
    for name, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and float(n) % scale == 0:
            return f'"{int(n) // scale} {name}"'
    return f'"{n:g} B"'


def _seconds(x: float) -> str:
    return _si(x, [("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)])


def _rate(x: float) -> str:
    return _si(x, [("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3), ("B/s", 1.0)])


def _pct(e: float) -> str:
    return f"{100 * e:+.0f}%"


def format_measured(fits: Sequence[Fit], compute: ComputeSharing | None, *, command: str,
                    notes: Sequence[str] = ()) -> str:
    """The ``[compute]`` and ``[[collectives]]`` tables of a topology file, with comments.

    The text starts with `MARKER`; `write_topology` replaces everything from it on.
    """
    lines = [MARKER, f"# Regenerate: {command}", *(f"# {n}" for n in notes), ""]
    if compute is not None:
        lines += ["[compute]",
                  f"concurrent_devices = {compute.concurrent_devices:.3g}",
                  f"kernel_overhead = {_seconds(compute.kernel_overhead)}",
                  f"step_overhead = {_seconds(compute.step_overhead)}",
                  f"output_overhead = {_seconds(compute.output_overhead)}",
                  f"comm_overlap = {compute.comm_overlap:.2f}", ""]
    for f in fits:
        res = [abs(e) for e in f.residuals]
        lines.append(f"# fit: {len(res)} sizes, |error| max {100 * max(res):.0f}% mean "
                     f"{100 * float(np.mean(res)):.0f}%" + (
                         "; held back: " + ", ".join(
                             f"{_bytes(s)[1:-1]} {_pct(e)}" for s, e in f.held_out)
                         if f.held_out else ""))
        lines += ["[[collectives]]", f'kind = "{f.model.kind}"',
                  "axes = [" + ", ".join(f'"{a}"' for a in f.model.axes) + "]"]
        if f.model.points:  # a model through measured points: the points, one per line
            lines += ["points = ["] + [f"  {{ size = {_size(n)}, time = {_seconds(t)} }},"
                                       for n, t in f.model.points] + ["]", ""]
        else:
            segs = ", ".join(f"{{ from = {_bytes(a)}, latency = {_seconds(lat)}, "
                             f"bandwidth = {_rate(bw)} }}" for a, lat, bw in f.model.segments)
            lines += [f"segments = [{segs}]", ""]
    return "\n".join(lines)


def write_topology(base_text: str, measured: str) -> str:
    """`base_text` (a topology file) with its measured part, if any, replaced by `measured`."""
    head = base_text.split(MARKER, 1)[0].rstrip("\n")
    return f"{head}\n\n{measured.rstrip()}\n"


# --- measuring (needs the devices) ---------------------------------------------------------------


# How each measured kind runs: ``(axis name or names, devices per group) -> per-device code on
# a 1-D local buffer`` (`shard_map` body code). One entry per kind XLA emits.
_PROGRAMS: dict[str, Callable[[Any, int], Callable[[jax.Array], jax.Array]]] = {
    "all_reduce": lambda name, n: lambda x: lax.psum(x, name),
    "all_gather": lambda name, n: lambda x: lax.all_gather(x, name, tiled=True),
    "reduce_scatter": lambda name, n: lambda x: lax.psum_scatter(x, name, tiled=True),
    "all_to_all": lambda name, n: lambda x: lax.all_to_all(x, name, 0, 0, tiled=True),
    "collective_permute": lambda name, n: lambda x: lax.ppermute(
        x, name, [(i, (i + 1) % n) for i in range(n)]),
}
assert tuple(_PROGRAMS) == MEASURED_KINDS, "a collective kind without a measuring program"


def _collective(kind: str, axes: tuple[str, ...], n: int) -> Callable[[jax.Array], jax.Array]:
    """The per-device collective on a 1-D local buffer, as `shard_map` body code."""
    if kind not in _PROGRAMS:
        raise TopologyError(f"collective {kind!r}: expected one of {', '.join(MEASURED_KINDS)}")
    return _PROGRAMS[kind](axes if len(axes) > 1 else axes[0], n)


def _input_elements(kind: str, nbytes: int, n: int) -> int:
    """float32 elements of each device's input for a buffer of `nbytes` (table convention)."""
    elems = max(n, nbytes // 4)
    elems -= elems % n
    return elems // n if kind == "all_gather" else elems


def collective_loop(mesh: jax.sharding.Mesh, kind: str, axes: tuple[str, ...], nbytes: int
                    ) -> tuple[Any, Callable[[], tuple[jax.Array, jax.Array]]]:
    """The compiled timing loop of one `kind` collective over mesh `axes` with every group at
    once, and a function making a fresh carry for it (`_timing.time_compiled`)."""
    n = math.prod(mesh.shape[a] for a in axes)
    local = _input_elements(kind, nbytes, n)
    all_axes = tuple(mesh.axis_names)
    coll = _collective(kind, axes, n)

    def body(x, out):
        out = coll(x)
        return kick(x, out[0]), out

    spec = P(all_axes)
    step_fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                            check_vma=False)
    out_local = local * n if kind == "all_gather" else local // n if kind == "reduce_scatter" \
        else local
    sharding = NamedSharding(mesh, spec)

    def carry() -> tuple[jax.Array, jax.Array]:
        return (jax.device_put(np.ones(local * mesh.size, np.float32), sharding),
                jax.device_put(np.zeros(out_local * mesh.size, np.float32), sharding))

    return compile_loop(lambda c: step_fn(*c), carry()), carry


def time_collective(mesh: jax.sharding.Mesh, kind: str, axes: tuple[str, ...], nbytes: int,
                    options: TimingOptions = _TIMING) -> float:
    """Seconds of one `kind` collective over mesh `axes` with every group at once."""
    compiled, carry = collective_loop(mesh, kind, axes, nbytes)
    return time_compiled(compiled, carry(), options).seconds


def _matmul_chain(x: jax.Array) -> jax.Array:
    for _ in range(4):
        x = jnp.tanh(x @ x) * 0.5
    return x


def measure_sharing(mesh: jax.sharding.Mesh, sizes: Sequence[int] = (128, 256, 384),
                    options: TimingOptions = _TIMING, sweeps: int = 3
                    ) -> tuple[float, list[tuple[int, float]]]:
    """How many devices compute at full speed at once: the median of ``n * t_alone / t_all``
    over matrix sizes and `sweeps` sweeps of them (one sweep alone moved cpu8's figure from
    1.25 to 1.75 once in five: a size's figure jumped from 1.1 to 1.75); also each figure,
    as ``(size, figure)`` in measuring order."""
    devices = mesh.devices.flatten()
    all_axes = tuple(mesh.axis_names)
    n = len(devices)
    each = []
    for k in [k for _ in range(sweeps) for k in sizes]:
        a = np.random.default_rng(0).uniform(-1, 1, (k, k)).astype(np.float32) / k
        alone = time_loop(lambda c: (kick(c[0], c[1][0, 0]), _matmul_chain(c[0])),
                          (jax.device_put(a, devices[0]), jax.device_put(a, devices[0])), options)

        def body(x, out):
            out = _matmul_chain(x)
            return kick(x, out[0, 0]), out

        spec = P(all_axes)
        step_fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                                check_vma=False)
        big = jax.device_put(np.concatenate([a] * n), NamedSharding(mesh, spec))
        together = time_loop(lambda c, f=step_fn: f(*c), (big, jnp.copy(big)), options)
        each.append((k, n * alone.seconds / together.seconds))
    return float(np.median([c for _, c in each])), each


def call_probe(mesh: jax.sharding.Mesh, n: int, *, sync: int = 8, rounds: int = 2,
               side: int = 32) -> tuple[Callable, list[jax.Array]]:
    """The step-shaped program `measure_call_overhead` calls, and its `n` arguments.

    It takes and returns `n` arrays of ``side * side`` float32 per device (4 KB: a small
    model's parameter), split over the whole mesh. The first goes through `sync` all-reduces
    over the whole mesh (they synchronise the devices as a step's collectives do); each other
    goes through `rounds` of a ``side x side`` matmul and a tanh and a final ``+ 1`` (with 2
    rounds, 4 kernels per array, as the zoo's steps launch 3-4.5 per array they return:
    `soapjax.measure._hlo_text.launched_kernels`).
    """
    spec = P(tuple(mesh.axis_names))
    sharding = NamedSharding(mesh, spec)
    axes = tuple(mesh.axis_names)
    per = side * side
    xs = [jax.device_put(np.full(per * mesh.size, 0.01 * i, np.float32), sharding)
          for i in range(n)]

    def body(*a):
        v = a[0]
        for _ in range(sync):
            v = lax.psum(v, axes) * (1.0 / mesh.size)
        out = [v]
        for x in a[1:]:
            for _ in range(rounds):
                m = x.reshape(side, side)
                x = jnp.tanh(m @ m * (1.0 / side)).reshape(per)
            out.append(x + 1.0)
        return out

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n, out_specs=[spec] * n,
                                 check_vma=False)), xs


def measure_call_overhead(mesh: jax.sharding.Mesh,
                          counts: Sequence[int] = (1, 4, 16, 64, 128), calls: int = 31, *,
                          sync: int = 8, rounds: int = 2, side: int = 32, sweeps: int = 3,
                          options: TimingOptions = _TIMING
                          ) -> tuple[float, float, list[tuple[int, float]]]:
    """What one call of a jitted step costs beyond what its kernels and collectives cost in a
    loop: ``(per call, per array, [(arrays, seconds)])``.

    The step-shaped `call_probe` of each of `counts` arrays is called `calls` times (median,
    warm, one call at a time, as a training loop calls its step), and the same program timed
    inside one compiled loop is taken off; each count keeps its median over `sweeps` whole
    sweeps (one sweep's 64-array point once came out at 0 on cpu8). A line ``per call + n x
    per array`` is fitted through them (least squares); the simulator counts a step's arrays
    by its outputs (parameters and optimizer state, which it also takes).

    On XLA:CPU a call costs more than its program in a loop: it hands each device its
    arguments in turn, and the top-level program dispatches its independent kernels to a thread
    pool that 8 devices share on 2 cores, which costs a kernel more than inside a loop body,
    where the operator timer measures it. On cpu8, 110 arrays: 1.5 ms with one kernel per array
    of 256 bytes and no collective (the probe before); with four kernels, the all-reduces and
    arrays of 256 bytes 1.4 ms, of 4 KB 3.5 ms, of 16 KB 2.3-3.6 ms; GPT-2 tiny's real steps
    (110 arrays of 0.1-16 KB) cost 1.2-5.5 ms more called than looped.
    """
    programs = [(n, *call_probe(mesh, n, sync=sync, rounds=rounds, side=side)) for n in counts]
    gaps: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(sweeps):  # whole sweeps, so that a slow spell of the host hits every count
        for n, step, xs in programs:
            work = time_loop(lambda c, f=step: tuple(f(*c)), tuple(jnp.copy(x) for x in xs),
                             options).seconds
            gaps[n].append(median_call(step, xs, calls) - work)
    points = [(n, max(0.0, float(np.median(g)))) for n, g in gaps.items()]
    ns = np.array([n for n, _ in points], float)
    ts = np.array([t for _, t in points])
    # Plain least squares: the many-array points, where a step's cost lies, set the slope (a
    # fit on relative error followed a few-array point that came out at 0).
    slope, intercept = np.polyfit(ns, ts, 1) if len(points) > 1 else (0.0, ts[0])
    return max(0.0, float(intercept)), max(0.0, float(slope)), points


def measure_overlap(mesh: jax.sharding.Mesh, *, size: int = 128, nbytes: int = 64 * 2**10,
                    repeats: int = 16, calls: int = 21) -> tuple[float, tuple[float, ...]]:
    """How much of a collective's time independent compute hides, from 0 to 1.

    Three programs on every device, called one call at a time (median of `calls`): `repeats`
    matmul-tanh steps of a ``size x size`` matrix; `repeats` all-reduces of `nbytes` over the
    whole mesh; both, the two chains independent, so a device that can run them at once
    does. ``(compute + collectives - both) / min(compute, collectives)``, each less the same
    program with neither, clipped to [0, 1]; also ``(compute, collectives, both)`` seconds.
    """
    spec = P(tuple(mesh.axis_names))
    sharding = NamedSharding(mesh, spec)
    axes = tuple(mesh.axis_names)

    def program(compute: bool, collective: bool):
        def body(x, v):
            for _ in range(repeats):
                x = jnp.tanh(x @ x) * 0.5 if compute else x
                v = lax.psum(v, axes) * (1.0 / mesh.size) if collective else v
            return x, v

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec),
                                     out_specs=(spec, spec), check_vma=False))

    a = np.random.default_rng(0).uniform(-1, 1, (size * mesh.size, size)) / size
    x = jax.device_put(a.astype(np.float32), sharding)
    v = jax.device_put(np.ones(max(1, nbytes // 4) * mesh.size, np.float32), sharding)

    base = median_call(program(False, False), (x, v), calls)
    comp, coll, both = (max(1e-9, median_call(program(c, k), (x, v), calls) - base)
                        for c, k in ((True, False), (False, True), (True, True)))
    hidden = (comp + coll - both) / min(comp, coll)
    return min(1.0, max(0.0, hidden)), (comp, coll, both)


def axis_sets(topology: Topology) -> list[tuple[str, ...]]:
    """Each mesh axis of more than one device, and the whole mesh where it has 2+ such axes."""
    single = [(a,) for a, s in zip(topology.axis_names, topology.axis_sizes) if s > 1]
    return single + ([tuple(a for (a,) in single)] if len(single) > 1 else [])


def calibrate_links(topology: Topology, *, kinds: Sequence[str] = MEASURED_KINDS,
                    sizes: Sequence[int] = FIT_SIZES, held: Sequence[int] = HELD_SIZES,
                    sharing: bool = True, passes: int = 3, short_passes: int = 4,
                    log: Callable[[str], None] = lambda s: None
                    ) -> tuple[list[Fit], ComputeSharing | None, float]:
    """Times and fits every collective of `kinds` over each of `axis_sets(topology)` on the
    attached devices (a mesh of the topology, `make_mesh`), and the shared compute.

    Every (collective, axes, size) is timed in each of `passes` passes over all of them, 9 /
    `passes` trials a pass (their median), and keeps the passes' `across_passes`: a slow spell
    of the host (on the 2-core machine, 1-10 s in which everything is 1.3-1.4x slower) then
    holds one pass of a size, not the whole of it (4 of cpu8's collectives, 16 held-back
    sizes: worst error 24-32% with 3 passes, 38-83% with one). A pass times each collective's
    sizes in order (up, then down in the next pass), held-back sizes among the fitted ones,
    with the garbage collector held off. Each loop is compiled once. Then `short_passes` more
    passes time the collectives under `SHORT_S` so far (all but the 64 MB ones, which take
    most of a pass's time): on cpu8 the small held-back sizes (3 and 48 KB) came out 9% off on
    average and 46% at worst with 3 passes, 6% and 17% with 7 (their median), and all 60
    held-back sizes 4% and 18% with the geometric mean of 7 (docs/accuracy.md).

    Returns:
      The fits, the compute sharing (None unless `sharing`), and the seconds it took.
    """
    start = time.perf_counter()
    mesh = make_mesh(topology)
    order = sorted({*sizes, *held})
    groups = [(axes, kind) for axes in axis_sets(topology) for kind in kinds]
    jobs = [(axes, kind, s) for axes, kind in groups for s in order]
    loops = {job: collective_loop(mesh, job[1], job[0], job[2]) for job in jobs}
    per_pass = dataclasses.replace(_TIMING, trials=max(1, math.ceil(_TIMING.trials / passes)))
    times: dict[tuple, list[float]] = {job: [] for job in jobs}
    wanted = set(jobs)  # every job in the first `passes` passes, then the short ones
    for p in range(passes + short_passes):
        if p == passes:
            wanted = {job for job in jobs if across_passes(times[job]) < SHORT_S}
        # Sizes in order, up then down: a held-back size is timed between its neighbours, in
        # the same spell of the host, and each size sits early in one pass and late in another.
        # The collector is held off for the whole pass (one collection, not one per timing).
        with quiet_gc():
            for axes, kind in groups:
                for s in (order if p % 2 == 0 else order[::-1]):
                    if (axes, kind, s) in wanted:
                        compiled, carry = loops[(axes, kind, s)]
                        times[(axes, kind, s)].append(
                            time_compiled(compiled, carry(), per_pass).seconds)
        what, n, of = (("collectives", p + 1, passes) if p < passes else
                       (f"collectives under {_seconds(SHORT_S)[1:-1]}", p + 1 - passes,
                        short_passes))
        log(f"{what}: pass {n} of {of} ({len(wanted)} timings), "
            f"{time.perf_counter() - start:.0f} s")
    fits = []
    for axes, kind in groups:
        fitted, back = ([Sample(s, across_passes(times[(axes, kind, s)])) for s in group]
                        for group in (sizes, held))
        fits.append(fit_samples(kind, axes, fitted, back))
        log(f"{kind} over {','.join(axes)}: " + ", ".join(
            f"{_bytes(n)[1:-1]} {_seconds(t)[1:-1]}" for n, t in fits[-1].model.points[::3])
            + ("; held back: " + ", ".join(f"{_bytes(n)[1:-1]} {_pct(e)}"
                                           for n, e in fits[-1].held_out)
               if fits[-1].held_out else ""))
    compute = None
    if sharing and topology.num_devices > 1:
        concurrent, each = measure_sharing(mesh)
        log("concurrent devices: " + ", ".join(f"{k}x{k} matmuls {c:.2f}" for k, c in each))
        per_call, per_output, points = measure_call_overhead(mesh)
        log(f"step call: {per_call * 1e6:.0f} us + {per_output * 1e6:.1f} us per output ("
            + ", ".join(f"{n} outputs {t * 1e6:.0f} us" for n, t in points) + ")")
        overlap, (comp, coll, both) = measure_overlap(mesh)
        log(f"compute beside collectives: {comp * 1e3:.2f} ms + {coll * 1e3:.2f} ms apart, "
            f"{both * 1e3:.2f} ms together: overlap {overlap:.2f}")
        compute = ComputeSharing(min(concurrent, float(topology.num_devices)),
                                 step_overhead=per_call, output_overhead=per_output,
                                 comm_overlap=overlap)
    return fits, compute, time.perf_counter() - start


def write_calibrated(path: str | Path, fits: Sequence[Fit], compute: ComputeSharing | None, *,
                     command: str, notes: Sequence[str] = ()) -> None:
    """Rewrites the topology file at `path` with its measured tables replaced."""
    p = Path(path)
    p.write_text(write_topology(p.read_text(), format_measured(fits, compute, command=command,
                                                                notes=notes)))
