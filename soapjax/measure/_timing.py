"""Timing compiled programs on the local backend, with the dispatch overhead amortised.

A kernel of a few microseconds cannot be timed with one Python call per run: a jitted call costs
~10-20 us on XLA:CPU and ~150 us on an H100 before the kernel starts. So the program runs `n`
times inside ONE compiled program, a `lax.fori_loop` with a *runtime* trip count (one compile
serves every `n`), and the time of one repetition is

    (T(n) - T(0)) / n

with ``T(k)`` the wall time of one call running `k` repetitions: dispatch, argument handling and
the loop's start-up cancel out.

XLA must not be allowed to run the body once and reuse it. The loop carries the program's
arguments and its outputs; every iteration runs the program, then "kicks" each argument,
rewriting its first element with ``where(s > 3e38, bumped, first)``, where ``s`` is a scalar
read from this iteration's outputs, so the next iteration's inputs depend on this one. The
condition is never true for finite data, so the values never change, but XLA cannot know
that: no argument is loop-invariant, so while-loop-invariant code motion cannot hoist the
body, CSE cannot merge iterations, and constant folding sees no constants (the arguments are
parameters of the program, never closed-over values). A kick is a one-element
dynamic-update-slice, in place on a loop-carried buffer: O(1) work. Kicking *after* the
program has read the arguments matters: kicked first, XLA fuses the kick into the program's
own fusions, which then copy every argument each iteration (30x slower for an elementwise
operator on CPU). The carry is donated, so no call copies its arguments either. The outputs
are loop-carried and returned, so none of them is dead code. `loop_hlo` gives the compiled
text for checking all this (`soapjax.measure.hlo.ops_outside_loops` counts what was hoisted).

Also here: the loops of an optimizer update and of a whole training step, and `DiskCache`,
the on-disk store of measurements that `soapjax.cost.operators` reads and writes.

One module past ~600 lines, on purpose: the loop, the programs timed in it and the store of
their timings share one schema (`signature`'s `_SCHEMA`, the stored `Timing` fields).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from soapjax.base._cache import cache_root
from soapjax.base._dtypes import is_float, is_key

log = logging.getLogger("soapjax.cost.operators")

# Larger than any value a timing program computes from finite random data, smaller than inf.
_NEVER = 3e38


class Timing(NamedTuple):
    """The time of one repetition of a program.

    Attributes:
      seconds: per repetition: the minimum (or median: `TimingOptions.statistic`) over
        trials, dispatch overhead removed.
      spread: (max - min) / min of the per-repetition times over the trials.
      reps: repetitions per trial (inside one call).
      trials: how many trials were taken.
      overhead_s: T(0), what one call costs beyond its repetitions (dispatch).
    """

    seconds: float
    spread: float
    reps: int
    trials: int
    overhead_s: float


@dataclasses.dataclass(frozen=True)
class TimingOptions:
    """How long and how often to time.

    Attributes:
      target_trial_s: aim for trials of about this long (the repetition count adapts).
      trials: trials per measurement. While their spread exceeds 25% (other processes
        competing for the cores), up to three times as many are taken.
      max_reps: at most this many repetitions per trial.
      long_s: a program whose single call takes longer is timed with two single calls only.
      statistic: which trial is kept: ``"min"`` (the default), the least disturbed one, for a
        kernel that runs alone; ``"median"``, the typical one, for work whose time depends on
        how the OS schedules many device threads on few cores (collectives of virtual CPU
        devices: a rendezvous of 8 threads on 2 cores is fast in some trials and 1.5-2x slower
        in others, and a training step meets the typical case, not the best).
    """

    target_trial_s: float = 0.025
    trials: int = 5
    max_reps: int = 100_000
    long_s: float = 0.5
    statistic: str = "min"

    def __post_init__(self):
        if self.target_trial_s <= 0 or self.trials < 1 or self.max_reps < 1 or self.long_s <= 0:
            raise ValueError(f"timing options must be positive, got {self}")
        if self.statistic not in ("min", "median"):
            raise ValueError(f"timing statistic: expected 'min' or 'median', got "
                             f"{self.statistic!r}")


# --- the loop harness ----------------------------------------------------------------------------


def kick(x: jax.Array, s: jax.Array) -> jax.Array:
    """`x` with its first element rewritten to a value that depends on the scalar `s`.

    At run time the value is unchanged (``s`` is never above 3e38), but XLA cannot know that.
    """
    if x.size == 0:
        return x
    if is_key(x.dtype):  # a typed PRNG key: kick its raw words
        return jax.random.wrap_key_data(kick(jax.random.key_data(x), s),
                                        impl=jax.random.key_impl(x))
    idx = (0,) * x.ndim
    first = x[idx] if x.ndim else x
    if x.dtype == jnp.bool_:
        bumped = jnp.logical_not(first)
    else:
        bumped = first + jnp.ones((), x.dtype)
    new = jnp.where(s > _NEVER, bumped, first)
    if x.ndim == 0:
        return new
    return lax.dynamic_update_slice(x, new.reshape((1,) * x.ndim), idx)


def probe(values: Sequence[jax.Array]) -> jax.Array:
    """A float32 scalar that depends on every value (the sum of their first elements)."""
    s = jnp.zeros((), jnp.float32)
    for v in values:
        if v.size:
            if is_key(v.dtype):
                v = jax.random.key_data(v)
            first = v[(0,) * v.ndim] if v.ndim else v
            if jnp.iscomplexobj(first):
                first = jnp.real(first)
            s = s + first.astype(jnp.float32)
    return s


def chained(fn: Callable[..., Sequence[jax.Array]]) -> Callable[[tuple], tuple]:
    """The loop body for timing ``fn(*args) -> outputs``: carry ``(args, outputs)``."""

    def step(carry: tuple) -> tuple:
        args, _ = carry
        outs = list(fn(*args))
        # Kick after `fn` has read the arguments, so the next iteration depends on this one.
        # (Kicking first would let XLA fuse the kick into `fn`'s own fusions, which then copy
        # every argument and lose vectorisation: 30x slower for an elementwise op.)
        s = probe(outs)
        return [kick(a, s) for a in args], outs

    return step


def _looped(step: Callable[[Any], Any]) -> Callable[[Any, jax.Array], Any]:
    def run(carry, n):
        return lax.fori_loop(0, n, lambda i, c: step(c), carry)

    return run


def compile_loop(step: Callable[[Any], Any], carry: Any) -> Any:
    """AOT-compiles ``run(carry, n) -> carry``: `step` applied `n` times (`n` a runtime int32).

    The carry is donated, so the loop updates it in place: a call costs dispatch plus its
    repetitions, with no copy of the arguments (which for an elementwise operator would be as
    large as a repetition).
    """
    n = jax.ShapeDtypeStruct((), jnp.int32)
    return jax.jit(_looped(step), donate_argnums=0).lower(carry, n).compile()


def loop_hlo(step: Callable[[Any], Any], carry: Any) -> str:
    """The optimised HLO text of the timing loop (to check that nothing was hoisted)."""
    return compile_loop(step, carry).as_text()


# --- timing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_gc(collect: bool = True) -> Iterator[None]:
    """Python's garbage collector held off while timing, as `timeit` does, its young
    generations collected first (unless not `collect`): each call of a jitted step makes Python
    objects (an array per output), and in a process that holds many (traced graphs, compiled
    plans: 200,000 in bench_accuracy) the collections they trigger cost milliseconds. Measured:
    RNNLM tiny's steps on cpu8 took 7.0-11.0 ms with it on in such a process, 5.2-7.8 ms with it
    held off. Restores the collector as it found it.

    Only the young generations (0 and 1), where the garbage of the programs just compiled and
    run sits: a full collection walks every object of the process, 56 ms in calibrate's (more
    than a short collective's whole timing) and more in a test session's, and the collector is
    off while timing either way. Inside another `quiet_gc` (the collector already held off) it
    does not collect at all (`soapjax calibrate --links` holds it off for each pass over its
    collectives)."""
    was = gc.isenabled()
    if collect and was:
        gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def median_call(fn: Callable, args: Sequence, calls: int) -> float:
    """Median seconds of one call of ``fn(*args)`` (warm, one call at a time, as a training
    loop calls its step), over `calls` calls, with the collector held off (`quiet_gc`)."""
    jax.block_until_ready(fn(*args))
    times = []
    with quiet_gc():
        for _ in range(max(1, calls)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def time_loop(step: Callable[[Any], Any], carry: Any, options: TimingOptions = TimingOptions()
              ) -> Timing:
    """Times one application of `step` (``carry -> carry``), amortising dispatch.

    The repetition count adapts so a trial lasts about `options.target_trial_s`: a
    few-microsecond kernel runs thousands of times per call, a 100 ms one once or twice.

    Args:
      step: the loop body; everything it computes must feed the next carry.
      carry: the initial carry (device arrays); it is donated (consumed).
      options: trial length and count.

    Returns:
      The per-repetition time, its spread over trials and the repetition count used.
    """
    return time_compiled(compile_loop(step, carry), carry, options)


def time_compiled(compiled: Any, carry: Any, options: TimingOptions = TimingOptions()
                  ) -> Timing:
    """`time_loop` of a loop `compile_loop` already compiled, on a fresh `carry` (donated):
    one compiled loop can be timed again later, without recompiling.

    The loop's own cost per repetition (`loop_floor`) is taken off: on a GPU each iteration
    of an XLA while loop waits for its predicate on the host, 18-24 us on an H100 that a
    training step's kernels, issued back to back, never pay. (A tenth of the time is kept
    at the least: a program never takes no time.)"""
    counts: dict[int, jax.Array] = {}
    state = [carry]
    del carry
    floor = loop_floor()
    with quiet_gc():
        t = _time_compiled(compiled, state, counts, options)
    return t._replace(seconds=max(t.seconds - floor, 0.1 * t.seconds))


_FLOORS: dict[str, float] = {}


def loop_floor() -> float:
    """Seconds of one iteration of the timing loop around a one-element add on the default
    backend: what the harness itself costs per repetition (measured once per process; some
    nanoseconds on a CPU, 18-24 us on an H100)."""
    key = local_platform()
    if key not in _FLOORS:
        _FLOORS[key] = 0.0  # the floor's own loop is timed without a floor
        args = [jnp.zeros((1,), jnp.float32)]
        step = chained(lambda x: [x + 1])
        carry = (args, [jnp.zeros((1,), jnp.float32)])
        _FLOORS[key] = time_compiled(compile_loop(step, carry), carry,
                                     TimingOptions(target_trial_s=0.01, trials=5)).seconds
    return _FLOORS[key]


def _time_compiled(compiled: Any, state: list, counts: dict[int, jax.Array],
                   options: TimingOptions) -> Timing:

    def call(n: int) -> float:
        if n not in counts:
            counts[n] = jnp.asarray(n, jnp.int32)
        t = time.perf_counter()
        state[0] = compiled(state[0], counts[n])
        jax.block_until_ready(state[0])
        return time.perf_counter() - t

    first = call(1)  # warm-up: first touch of buffers, thread pool start-up
    # T(0) is dispatch alone; its minimum keeps improving as every trial samples it again.
    t0 = min(call(0) for _ in range(3))
    if first - t0 > options.long_s:
        ts = [first, call(1)]
        return Timing(_positive([t - t0 for t in ts], ts, options.statistic), _spread(ts), 1,
                      len(ts), t0)
    n = 1
    # A first call of 4 targets or more needs no more repetitions (warm-up does not make a call
    # 4x longer), and growing n would cost two more such calls (a 64 MB collective: 0.1-0.8 s).
    growing = 10 if first - t0 < 4 * options.target_trial_s else 0
    for _ in range(growing):  # grow n geometrically until a call lasts about the target
        # The least of two calls: one disturbed call must not stop the growth early.
        work = min(call(n), call(n)) - t0
        if work >= 0.5 * options.target_trial_s or n >= options.max_reps:
            break
        grow = options.target_trial_s / max(work, 1e-7)
        n = min(options.max_reps, math.ceil(n * min(max(grow, 2.0), 100.0)))
    for _ in range(3):
        tns = []
        while len(tns) < options.trials or (
                _spread([t - t0 for t in tns]) > 0.25 and len(tns) < 3 * options.trials):
            # Other processes on the same cores only ever add time: while the trials disagree,
            # more of them give the minimum more chances to be an undisturbed one.
            t0 = min(t0, call(0))
            tns.append(call(n))
        per = [(t - t0) / n for t in tns]
        if min(per) > 0 or n >= options.max_reps:
            break
        n = min(options.max_reps, 4 * n)  # the work drowned in the noise of T(0): more of it
    return Timing(_positive(per, [t / n for t in tns], options.statistic),
                  _spread([max(p, 0.0) for p in per]), n, len(per), t0)


def _positive(per: list[float], raw: list[float], statistic: str = "min") -> float:
    """The least (or median) per-repetition time above zero. A trial can come in under the
    dispatch floor T(0) when the machine is noisy; a measured operator never takes no time, so
    if every trial does, the time with dispatch included (an upper bound) is what was measured."""
    above = [p for p in per if p > 0]
    pick = min if statistic == "min" else statistics.median
    return pick(above) if above else pick(raw)


def _spread(ts: Sequence[float]) -> float:
    lo = min(ts)
    return (max(ts) - lo) / lo if lo > 0 else 0.0


# --- programs: forward, backward ---------------------------------------------------------------


def random_args(avals: Sequence[jax.ShapeDtypeStruct], seed: int = 0,
                index_bound: int | None = None) -> list[jax.Array]:
    """Arguments of the given shapes: floats uniform in [-1, 1), ints uniform in
    ``[0, index_bound)``, random bools.

    Integers stay below `index_bound` (default `index_arg_bound` of `avals`, the largest bound
    valid for them) so that they are valid indices (token ids, labels) of any gather. Few
    distinct ids misprice a gather's backward: its scatter-add then sends every token to the
    same few rows, and a GPU's atomic adds serialise on them (an embedding's backward over
    4096 tokens into 2 rows took 14 ms on an H100; spread over 2048 rows, 0.2 ms).
    Made with numpy and put on the default device: no compilation per shape.
    """
    rng = np.random.default_rng(seed)
    if index_bound is None:
        index_bound = index_arg_bound(avals)
    out = []
    for a in avals:
        if is_key(a.dtype):  # a dropout stream's typed key: any valid keys will do
            keys = jax.random.split(jax.random.key(seed), max(1, int(np.prod(a.shape))))
            out.append(keys.reshape(tuple(a.shape)))
            continue
        dt, shape = jnp.dtype(a.dtype), tuple(a.shape)
        if jnp.issubdtype(dt, jnp.inexact):
            x = rng.random(shape, dtype=np.float32) * 2 - 1
            if jnp.issubdtype(dt, jnp.complexfloating):
                x = x + 1j * x
        elif dt == jnp.bool_:
            x = rng.integers(0, 2, shape).astype(bool)
        else:
            x = rng.integers(0, max(1, index_bound), shape)
        out.append(jax.device_put(np.asarray(x).astype(dt)))
    return out




def index_arg_bound(avals: Sequence[jax.ShapeDtypeStruct]) -> int:
    """The least size of any dim of the float arguments (at least 2): integers below it index
    any axis of them (an embedding's table, a loss's logits) validly."""
    sizes = [d for a in avals if is_float(a.dtype) for d in a.shape if d > 0]
    return max(2, min(sizes)) if sizes else 2


def time_forward(fn: Callable[..., Sequence[jax.Array]], args: Sequence[jax.Array],
                 options: TimingOptions = TimingOptions()) -> Timing:
    """Times ``fn(*args)`` (returning a list of arrays)."""
    outs = [jnp.zeros(o.shape, o.dtype) for o in jax.eval_shape(lambda *a: list(fn(*a)), *args)]
    return time_loop(chained(fn), ([jnp.array(a, copy=True) for a in args], outs), options)


def backward_loop(fn: Callable[..., Sequence[jax.Array]], args: Sequence[jax.Array],
                  diff: Sequence[bool]) -> tuple[Callable, tuple] | None:
    """The timing loop of the backward pass of `fn` alone, from saved residuals.

    ``jax.vjp`` runs once (compiled) to produce the residuals; each loop iteration then maps
    ``(residuals, cotangents)`` to the gradients of the float arguments marked in `diff`:
    exactly the work the backward pass of a training step does for this operator. Only float
    outputs carry cotangents.

    Returns:
      ``(step, carry)`` for `time_loop`, or None when nothing is differentiated (no float
      argument marked, or no float output).
    """
    idx = [i for i, d in enumerate(diff) if d and is_float(args[i].dtype)]
    out_avals = jax.eval_shape(lambda *a: list(fn(*a)), *args)
    float_out = [k for k, o in enumerate(out_avals) if is_float(o.dtype)]
    if not idx or not float_out:
        return None

    def forward(*all_args):
        def g(*d):
            merged = list(all_args)
            for i, v in zip(idx, d):
                merged[i] = v
            outs = list(fn(*merged))
            return [outs[k] for k in float_out]

        return jax.vjp(g, *[all_args[i] for i in idx])[1]

    residuals, tree = jax.tree.flatten(jax.jit(forward)(*args))
    # Residuals may be the arguments themselves; the loop donates its carry, so copy.
    residuals = [jnp.array(r, copy=True) for r in residuals]

    def step(carry):
        residuals, cts, _ = carry
        grads = list(jax.tree.unflatten(tree, residuals)(cts))
        s = probe(grads)
        return [kick(r, s) for r in residuals], [kick(c, s) for c in cts], grads

    cts = random_args([out_avals[k] for k in float_out], seed=1)
    grads = [jnp.zeros(args[i].shape, args[i].dtype) for i in idx]
    return step, (residuals, cts, grads)


def time_backward(fn: Callable[..., Sequence[jax.Array]], args: Sequence[jax.Array],
                  diff: Sequence[bool], options: TimingOptions = TimingOptions()
                  ) -> Timing | None:
    """Times the backward pass of ``fn`` w.r.t. the float arguments marked in `diff`."""
    loop = backward_loop(fn, args, diff)
    if loop is None:
        return None
    return time_loop(*loop, options)


# --- optimizer updates and whole steps ---------------------------------------------------------


def update_loop(optimizer: Any, n: int) -> tuple[Callable, Any, Callable[[], tuple]]:
    """The timing loop of one optimizer update of an `n`-element float32 parameter.

    Args:
      optimizer: an optax ``GradientTransformation``, or None for Adam's arithmetic.
      n: parameter elements.

    Returns:
      ``(step, avals, make_carry)``: the loop body for `time_loop`, the carry's abstract
      values (to sign the program without allocating it) and a function that allocates the
      carry. The carry is ``(params, state, grads)``; the gradients are kicked from the
      parameters so that work on them alone (a gradient norm for clipping) is not hoisted.
    """
    p_aval = jax.ShapeDtypeStruct((n,), jnp.float32)
    if optimizer is None:
        def init(p):
            return jnp.zeros_like(p), jnp.zeros_like(p)

        def apply(g, state, p):
            m = 0.9 * state[0] + 0.1 * g
            v = 0.999 * state[1] + 0.001 * g * g
            return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), (m, v)
    else:
        import optax

        init = optimizer.init

        def apply(g, state, p):
            updates, state = optimizer.update(g, state, p)
            return optax.apply_updates(p, updates), state

    def step(carry):
        p, state, g = carry
        p, state = apply(g, state, p)
        return p, state, kick(g, probe([p]))

    def make_carry():
        p, g = random_args([p_aval] * 2, seed=2)
        return p, init(p), g * 1e-3

    return step, (p_aval, jax.eval_shape(init, p_aval), p_aval), make_carry


def time_train_step(workload: Any, options: TimingOptions = TimingOptions()) -> Timing:
    """Times a workload's whole jitted training step (``workload.train_step()``) on one device.

    The loop carries parameters, optimizer state, the loss and the batch; the batch is an
    argument (never a constant folded into the program) and is kicked from the loss.
    """
    params = workload.init_params(jax.random.key(0))
    opt_state = workload.optimizer.init(params)
    batch = workload.make_batch(jax.random.key(1))
    train = workload.train_step()

    def step(carry):
        params, opt_state, _, batch = carry
        params, opt_state, loss = train(params, opt_state, batch)
        return params, opt_state, loss, jax.tree.map(lambda x: kick(x, loss), batch)

    loss0 = jnp.zeros((), jnp.float32)
    return time_loop(step, (params, opt_state, loss0, batch), options)


# --- the on-disk store -------------------------------------------------------------------------

_SCHEMA = 2  # 2: integer arguments spread over index_arg_bound, not {0, 1}; loop floor taken off


def default_cache_dir() -> Path:
    """Where measurements are cached: ``costs/`` under the soapjax cache root (`_cache`)."""
    return cache_root() / "costs"


def local_platform() -> str:
    """The local backend's platform in topology terms: ``cpu``, ``gpu`` or ``tpu``."""
    p = jax.devices()[0].platform.lower()
    return "gpu" if p in ("cuda", "rocm", "gpu") else p


def backend_identity() -> dict[str, Any]:
    """What a measurement depends on besides the program: backend, device kind, versions, host."""
    import jaxlib

    dev = jax.devices()[0]
    ident = {"schema": _SCHEMA, "backend": local_platform(), "device_kind": dev.device_kind,
             "jax": jax.__version__, "jaxlib": jaxlib.__version__}
    if ident["backend"] == "cpu":
        ident["host"] = f"{_cpu_model()} x{os.cpu_count()}"
    return ident


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def signature(kind: str, program_text: str, extra: str = "") -> str:
    """The cache key of a program: sha256 of its kind, schema and text.

    Object addresses (``<function f at 0x7f...>`` in a custom_jvp's parameters) are dropped:
    they differ between processes, the program does not.
    """
    program_text = re.sub(r" at 0x[0-9a-fA-F]+", "", program_text)
    text = f"soapjax-cost/{_SCHEMA}/{kind}/{extra}\n{program_text}"
    return hashlib.sha256(text.encode()).hexdigest()


class DiskCache:
    """One JSON file per measurement, under a folder per backend identity.

    Writes go to a temporary file in the same folder, then `os.replace` it into place, which
    is atomic: concurrent writers (threads or processes) of the same entry leave one whole
    entry, never a mix. An unreadable, corrupt or mismatching file is a miss (and is
    overwritten by the next measurement).

    Attributes:
      identity: `backend_identity()`, stored in and checked against every entry.
      folder: where the entries live (None: a cache that stores nothing).
    """

    def __init__(self, root: str | os.PathLike | None, identity: dict[str, Any]):
        self.identity = identity
        if root is None:
            self.folder = None
            return
        tag = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
        slug = "".join(c if c.isalnum() else "-" for c in identity["device_kind"]).strip("-")
        self.folder = Path(root) / f"{identity['backend']}-{slug[:40]}-jax{identity['jax']}-{tag}"

    def path(self, sig: str) -> Path | None:
        return None if self.folder is None else self.folder / sig[:2] / f"{sig}.json"

    def load(self, sig: str) -> dict[str, Any] | None:
        """The entry for `sig`, or None (missing, unreadable, corrupt or stale)."""
        path = self.path(sig)
        if path is None:
            return None
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("cost cache entry %s is unreadable (%s); measuring again", path, e)
            return None
        if not _valid_entry(entry, sig, self.identity):
            log.warning("cost cache entry %s is corrupt or stale; measuring again", path)
            return None
        return entry

    def store(self, sig: str, entry: dict[str, Any]) -> None:
        """Writes `entry` for `sig` atomically; a failure to write is logged, not raised."""
        path = self.path(sig)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{sig[:8]}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entry, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:  # a read-only or full disk costs re-measuring, not the run
            log.warning("cannot write cost cache entry %s: %s", path, e)

    def entry(self, sig: str, what: str, example: str, forward: Timing,
              backward: Timing | None, **extra: Any) -> dict[str, Any]:
        """A new entry (not yet stored)."""
        return {"signature": sig, "identity": self.identity, "what": what, "example": example,
                "forward": forward._asdict(),
                "backward": None if backward is None else backward._asdict(),
                "created": time.time(), **extra}


def _valid_entry(entry: Any, sig: str, identity: dict[str, Any]) -> bool:
    if not isinstance(entry, dict) or entry.get("signature") != sig:
        return False
    if entry.get("identity") != identity:
        return False
    for part in ("forward", "backward"):
        if part not in entry:  # the cost model reads both (backward None: not timed)
            return False
        t = entry[part]
        if t is None and part == "backward":
            continue
        if not isinstance(t, dict):
            return False
        s = t.get("seconds")
        if not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            return False
    return True
