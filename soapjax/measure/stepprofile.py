"""Where a compiled step's device time goes: its kernels, read from a `jax.profiler` trace.

The GPU kit (``scripts/gpu_kit.py --profile``) times a training step whole and each of its
operators alone; on an H100 the operators summed to 17 ms less than LLaMA 0.9B's 96 ms step
(docs/accuracy.md). This module reads a profile of the step itself: every kernel the device
ran, which HLO instruction it ran for, and what kind of work that instruction is.

* `profile_calls` runs a compiled function under ``jax.profiler.trace`` and returns the trace
  file (``*.trace.json.gz``, Chrome trace events) and each call's wall time.
* `trace_kernels` reads the device's kernel events from it: on a GPU the events of the
  device's streams (``/device:GPU:0``, threads ``Stream #...``); on the CPU the XLA thunks the
  host's threads ran (events that name an ``hlo_op``).
* `classify` reads the compiled module's text (``compiled.as_text()``) and says, per HLO
  instruction, what its kernel does: ``gemm`` (a dot or convolution, fused or a cuBLAS call),
  ``attention`` (cuDNN's fused attention), ``reduction`` (a fusion that reduces: softmax, norm
  statistics, a loss, a gradient summed over the batch), ``elementwise`` (a loop fusion),
  ``copy`` (copies, transposes, slices, fusions of only layout ops), ``scatter``, ``collective``,
  ``other``; and where in the model it came from (the JAX op name XLA kept in its metadata).
* `summarize` turns the events into a `StepProfile` per call: time the device was busy (the
  union of the kernels' intervals), wall time it was not, and time and kernel count per class
  and per source; the optimizer's update apart (``update_classes``); and the bandwidth the
  large memory-bound kernels reach (``memory_bound``: each instruction's operands and result
  counted once, what `classify` records as its ``nbytes``).
* `loop_copies` reads the module alone: the slices and updates of stacked values (a scan over
  layers) that XLA runs as copies of their own.

Example (a trace needs a device; the classification does not):

>>> text = '''HloModule m
... %f (p: f32[8,8]) -> f32[8] {
...   %p = f32[8,8] parameter(0)
...   %z = f32[] constant(0)
...   ROOT %r = f32[8] reduce(%p, %z), dimensions={1}, to_apply=%add
... }
... ENTRY %main (x: f32[8,8]) -> f32[8] {
...   %x = f32[8,8] parameter(0)
...   %d = f32[8,8] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
...   ROOT %s = f32[8] fusion(%d), kind=kInput, calls=%f
... }'''
>>> {name: c.kind for name, c in classify(text).items()}
{'d': 'gemm', 's': 'reduction'}
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from soapjax.base.collectives import HLO_OPCODES
from soapjax.measure._hlo_text import (
    Inst,
    attribute,
    callees,
    executions,
    leaf_bytes,
    op_name,
    parse_module,
    parse_type,
    type_leaves,
)

__all__ = ["KERNEL_CLASSES", "KernelEvent", "Instruction", "StepProfile", "classify",
           "loop_copies", "profile_calls", "source_of", "summarize", "trace_kernels"]

KERNEL_CLASSES = ("gemm", "attention", "reduction", "elementwise", "copy", "scatter",
                  "collective", "other")
_MEMORY_BOUND = ("elementwise", "reduction", "copy")
LARGE_BYTES = 16 * 2**20  # a kernel moving this much or more runs long past its launch

# XLA's collective opcodes (`soapjax.base.collectives.HLO_OPCODES`) and the point-to-point ones
_COLLECTIVES = (*HLO_OPCODES, "collective-broadcast", "send", "recv")
_LAYOUT = frozenset({"parameter", "constant", "copy", "transpose", "bitcast", "reshape",
                     "broadcast", "tuple", "get-tuple-element", "slice", "concatenate", "pad",
                     "dynamic-slice", "dynamic-update-slice", "iota", "reverse"})
_NOT_KERNELS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                          "after-all", "while", "conditional", "call"})
# Name-stack parts a loop, a branch or a checkpoint adds (not module paths).
_CONTROL = frozenset({"while", "body", "cond", "eval_jaxpr", "scan", "checkpoint", "remat",
                      "rematted_computation", "checkpoint_name"})
_BRANCH = re.compile(r"branch_\d+_fun")
# Scalar index arithmetic a slice's fusion may hold (a reversed scan's ``n - 1 - i``).
_INDEX_MATH = frozenset({"add", "subtract", "multiply", "compare", "select", "clamp",
                         "convert", "maximum", "minimum"})
# Instructions that only move memory when they run alone.
_MEMORY = frozenset({"copy", "transpose", "copy-start", "copy-done", "gather", "dynamic-slice",
                     "dynamic-update-slice", "slice", "concatenate", "pad"})
# Events of a GPU trace that are not kernels: lines XProf derives from the kernels (they would
# count each kernel twice) and host-side lines.
_DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "Framework", "TensorFlow", "Launch")


class KernelEvent(NamedTuple):
    """One kernel (GPU) or thunk (CPU) the device ran."""

    name: str  # the kernel's name (GPU) or the thunk's (CPU)
    hlo_op: str  # the HLO instruction it ran ('' where the trace does not say)
    start_us: float
    duration_us: float
    line: str  # the stream or thread it ran on


class Instruction(NamedTuple):
    """What one HLO instruction's kernel does (`classify`)."""

    kind: str  # one of KERNEL_CLASSES
    opcode: str
    source: str  # the model path it came from (`source_of`), '' where XLA kept none
    # its operands' and result's bytes, once each: what it must move (0 where it slices or
    # updates in place, touching part of them)
    nbytes: float = 0.0


class StepProfile(NamedTuple):
    """A profiled call's device time, averaged over the calls profiled.

    ``classes`` and ``sources`` map a kernel class (or source) to ``(seconds, kernels)`` per
    call; ``busy_s`` is the union of the kernels' intervals per call, so ``wall_s - busy_s`` is
    time the device ran nothing (launches, host work, waits); ``kernels_s`` is the kernels'
    durations summed (more than ``busy_s`` where streams overlap).
    """

    calls: int
    wall_s: float
    busy_s: float
    kernels_s: float
    kernels: float
    classes: dict[str, tuple[float, float]]
    sources: dict[str, tuple[float, float]]
    top: list[tuple[str, str, float, float]]  # (hlo_op, class, seconds, kernels) per call
    unmatched: float  # kernels per call whose instruction the module does not name
    # the part of each class from the optimizer's update (source "(update)"), which a
    # simulator prices apart from the operators
    update_classes: dict[str, tuple[float, float]] = {}
    # per memory-bound class (elementwise, reduction, copy), over its kernels of at least
    # `LARGE_BYTES`: (bytes their instructions move, seconds, kernels) per call; bytes over
    # seconds is the bandwidth they reach
    memory_bound: dict[str, tuple[float, float, float]] = {}

    def as_dict(self) -> dict[str, Any]:
        return {**self._asdict(), "classes": {k: list(v) for k, v in self.classes.items()},
                "sources": {k: list(v) for k, v in self.sources.items()},
                "top": [list(t) for t in self.top],
                "update_classes": {k: list(v) for k, v in self.update_classes.items()},
                "memory_bound": {k: list(v) for k, v in self.memory_bound.items()}}


def profile_calls(fn: Callable[..., Any], args: Sequence[Any], *, calls: int = 3,
                  log_dir: str | Path | None = None,
                  advance: Callable[[Any, Sequence[Any]], Sequence[Any]] | None = None,
                  ) -> tuple[Path, list[float]]:
    """Runs ``fn(*args)`` `calls` times under ``jax.profiler.trace``, each call waited for.

    Args:
      fn: a compiled (or jitted) function, already warm.
      args: its arguments.
      calls: how many calls to profile.
      log_dir: where the profiler writes (a temporary folder when None; it is kept).
      advance: ``advance(out, args)`` gives the next call's arguments from a call's outputs
        (a training step whose parameters are donated); the same `args` when None.

    Returns:
      The trace file (``*.trace.json.gz``) and each call's wall seconds.
    """
    import jax

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="soapjax-profile-"))
    walls: list[float] = []
    with jax.profiler.trace(str(log_dir)):
        for _ in range(calls):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            walls.append(time.perf_counter() - t0)
            if advance is not None:
                args = advance(out, args)
    found = sorted(log_dir.glob("plugins/profile/*/*.trace.json.gz"),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"jax.profiler wrote no *.trace.json.gz under {log_dir}: "
                                "the profiler plugin of this jaxlib may be missing")
    return found[-1], walls


def trace_kernels(path: str | Path) -> list[KernelEvent]:
    """The device's kernel events in a Chrome trace (``.json`` or ``.json.gz``), by start.

    A GPU's: the complete events of its device processes (``/device:GPU:n``) on its streams,
    not the lines the profiler derives from them. Without a GPU process (a CPU run), the
    events that name an ``hlo_op`` on the host's threads, but the ``end: ...`` markers.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    devices = {pid for pid, name in processes.items()
               if name.startswith("/device:") and not name.startswith("/device:CPU")}
    streams = {key for key, name in threads.items() if key[0] in devices
               and not name.startswith(_DERIVED_LINES)}
    out = []
    for e in events:
        if e.get("ph") != "X" or not e.get("dur"):
            continue
        args = e.get("args") or {}
        key = (e.get("pid"), e.get("tid"))
        if devices:
            if key not in streams:
                continue
        elif "hlo_op" not in args or str(e.get("name", "")).startswith("end:"):
            continue
        out.append(KernelEvent(str(e.get("name", "")), str(args.get("hlo_op", "")),
                               float(e["ts"]), float(e["dur"]), threads.get(key, str(key))))
    return sorted(out, key=lambda k: k.start_us)


def source_of(name: str) -> str:
    """Where a JAX op name says an instruction came from: the model path (the name stack's
    parts that are not transformations), with ``(backward)`` under a transpose; outside the
    model's modules, ``(loops)`` in a loop's own work (a scan slicing its inputs and stacking
    its outputs), ``(outside the modules)`` inside the differentiated function (the loss)
    and ``(update)`` outside it (the optimizer's update); ``''`` for no name.

    >>> source_of("jit(step)/jit(main)/transpose(jvp(LLaMA))/layers_0/attn/q/dot_general")
    'layers_0/attn/q (backward)'
    >>> source_of("jit(step)/jvp(GPT2)/wte/jit(_take)/jit(_where)/select_n")
    'wte'
    >>> source_of("jit(step)/jvp(M)/while/body/eval_jaxpr/layers/attn/cond/branch_1_fun/exp")
    'layers/attn'
    >>> source_of("jit(step)/transpose(jvp(M))/while/body/dynamic_update_slice")
    '(loops) (backward)'
    >>> source_of("jit(step)/jvp()/reduce_sum"), source_of("jit(step)/mul")
    ('(outside the modules)', '(update)')
    """
    parts = [p for p in name.split("/") if p]
    if not parts:
        return ""
    if "[" in parts[0]:  # an argument's path: the value as passed in
        return "(arguments)"
    path = "/".join(p for p in parts[:-1] if "(" not in p and p not in _CONTROL
                    and not _BRANCH.fullmatch(p))
    backward = " (backward)" if "transpose(" in name else ""
    if path:
        return path + backward
    if "while" in parts[:-1]:  # a loop's own work: slicing its inputs, stacking its outputs
        return "(loops)" + backward
    if "jvp(" in name:
        return "(outside the modules)" + backward
    return "(update)"


def _fused_opcodes(comp: str, comps: dict[str, list[Inst]], seen: set[str]) -> set[str]:
    if comp in seen:
        return set()
    seen.add(comp)
    ops = set()
    for inst in comps.get(comp, ()):
        ops.add(inst.opcode)
        if inst.opcode == "custom-call":
            ops.add("custom-call:" + (attribute(inst, "custom_call_target") or "").strip('"'))
        for called in callees(inst).values():
            for c in called:
                ops |= _fused_opcodes(c, comps, seen)
    return ops


def _opcodes(inst: Inst, comps: dict[str, list[Inst]]) -> set[str]:
    """What an instruction's kernel runs: a fusion's (or an async fusion's) fused opcodes, a
    custom call's target as ``custom-call:<target>``, or the opcode itself."""
    if inst.opcode in ("fusion", "fusion-start"):
        return _fused_opcodes(next(iter(callees(inst).get("calls", [])), ""), comps, set())
    if inst.opcode == "custom-call":
        return {"custom-call",
                "custom-call:" + (attribute(inst, "custom_call_target") or "").strip('"')}
    return {inst.opcode}


def _nested(comps: dict[str, list[Inst]]) -> set[str]:
    """Computations that run inside another instruction's kernel, not as kernels of their
    own: fusion bodies (async ones too), and reducers and comparators (the ``to_apply`` of
    a reduce, scatter or sort)."""
    return {c for insts in comps.values() for inst in insts
            for c in ((callees(inst).get("calls", [])
                       if inst.opcode in ("fusion", "fusion-start") else [])
                      + (callees(inst).get("to_apply", []) if inst.opcode != "call" else []))}


def _kind(inst: Inst, ops: set[str]) -> str:
    """The class of an instruction whose kernel runs `ops` (`_opcodes`)."""
    op = inst.opcode
    base = op.removesuffix("-start").removesuffix("-done")
    if base in _COLLECTIVES:
        return "collective"
    if op in ("dot", "convolution"):
        return "gemm"
    targets = " ".join(o for o in ops if o.startswith("custom-call:")).lower()
    if "fmha" in targets or "cudnn$flash" in targets or "attention" in targets:
        return "attention"
    if ops & {"dot", "convolution"} or "gemm" in targets or "matmul" in targets \
            or "cublas" in targets:
        return "gemm"
    if "triton_gemm" in inst.attrs or "__triton_gemm" in inst.attrs:
        return "gemm"
    if ops & {"scatter", "select-and-scatter"}:
        return "scatter"
    if ops & {"reduce", "reduce-window"}:
        return "reduction"
    if op in _MEMORY or (base == "fusion" and ops <= _LAYOUT):
        return "copy"
    if base == "fusion" or op not in ("custom-call", "sort", "rng", "rng-bit-generator"):
        return "elementwise"  # a loop fusion, or one elementwise instruction left unfused
    return "other"


def classify(hlo_text: str) -> dict[str, Instruction]:
    """Per instruction of a compiled module's text that launches work (not parameters,
    constants, tuples, bitcasts, loops or calls themselves, and not the instructions inside a
    fusion, which run in their fusion's kernel), its `Instruction`."""
    module = parse_module(hlo_text)
    comps = module.computations
    nested = _nested(comps)
    types = {inst.name: inst.type for insts in comps.values() for inst in insts}
    out = {}
    for comp, insts in comps.items():
        if comp in nested:
            continue
        for inst in insts:
            if inst.opcode in _NOT_KERNELS or inst.opcode.endswith("-done"):
                continue  # an async op's "-done" waits for its "-start", the kernel
            ops = _opcodes(inst, comps)
            # what it must move, where that is its operands and result (one that slices or
            # updates in place touches part of them: not counted)
            sliced = ops & {"dynamic-slice", "dynamic-update-slice", "gather", "scatter"} or (
                inst.opcode.startswith("fusion") and "slice" in ops)
            moved = 0.0 if sliced else _bytes(inst.type) + sum(
                _bytes(types.get(o, "")) for o in inst.operands)
            out[inst.name] = Instruction(_kind(inst, ops), inst.opcode,
                                         source_of(op_name(inst)), moved)
    return out


def loop_copies(hlo_text: str) -> tuple[float, float]:
    """What a step's loops copy (a scan over stacked layers slicing its weights and saved
    activations out of their stacks, and writing results into them): per step, how many
    slices and updates run as copies of their own, and the bytes they read and write. Counted:
    in computations that run more than once a step, each ``dynamic-slice`` and
    ``dynamic-update-slice`` instruction that is not inside a fusion (twice its slice's
    bytes), and each async fusion (``fusion-start``, run on a copy engine) of only a dynamic
    slice and layout ops (twice its result's bytes). A slice XLA fuses into its consumer
    costs no copy and is not counted.

    Returns:
      ``(copies, bytes)`` per step.
    """
    module = parse_module(hlo_text)
    comps, runs = module.computations, executions(module)
    types = {inst.name: inst.type for insts in comps.values() for inst in insts}
    nested = _nested(comps)
    copies = nbytes = 0.0
    for comp, insts in comps.items():
        n = runs.get(comp, 0)
        if n <= 1 or comp in nested:  # once a step, or inside a fusion (no copy of its own)
            continue
        for inst in insts:
            if inst.opcode == "dynamic-slice":
                moved = _bytes(inst.type)
            elif inst.opcode == "dynamic-update-slice" and len(inst.operands) > 1:
                moved = _bytes(types.get(inst.operands[1], ""))
            elif inst.opcode == "fusion-start":
                moved = _async_copy_bytes(inst, comps)
                if moved is None:
                    continue
            else:
                continue
            copies += n
            nbytes += 2 * n * moved
    return copies, nbytes


def _async_copy_bytes(inst: Inst, comps: dict[str, list[Inst]]) -> float | None:
    """The slice an async fusion of only a dynamic slice (or update) and layout ops copies:
    its result (a slice), or its operands but the stack (an update); None for another.
    Its type is ``((operands...), result, context)``."""
    ops = _opcodes(inst, comps)
    if not ops & {"dynamic-slice", "dynamic-update-slice"} or not ops <= (
            _LAYOUT | _INDEX_MATH | {"dynamic-slice", "dynamic-update-slice"}):
        return None
    try:
        operands, result = parse_type(inst.type)[:2]
    except (ValueError, IndexError):
        return None
    if "dynamic-update-slice" in ops:
        leaves = type_leaves(operands)
        return sum(leaf_bytes(x) for x in leaves) - leaf_bytes(type_leaves(result)[0])
    return sum(leaf_bytes(x) for x in type_leaves(result))


def _bytes(type_text: str) -> float:
    try:
        return sum(leaf_bytes(leaf) for leaf in type_leaves(parse_type(type_text.strip())))
    except (ValueError, IndexError):
        return 0.0


def _union_us(events: Iterable[KernelEvent]) -> float:
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda k: k.start_us):
        stop = e.start_us + e.duration_us
        if stop <= end:
            continue
        total += stop - max(e.start_us, end)
        end = stop
    return total


def _kernel_name(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


def _library_kernel(name: str) -> tuple[str, str]:
    """The class and source of a kernel no instruction is named after: a library's GEMM
    (cuBLAS's ``nvjet_*``, ``sm90_xmma_gemm_*``, CUTLASS), cuDNN's attention, the driver's
    memory copies and sets (XLA's copies and slices inside a CUDA graph), a CUDA graph's
    branch selection (a loop's or a conditional's control)."""
    low = name.lower()
    if "fmha" in low or "flash" in low or "cudnn" in low:
        return "attention", "(library kernels)"
    if any(w in low for w in ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul")):
        return "gemm", "(library GEMMs)"
    if low.startswith(("memcpy", "memset")):
        return "copy", "(memory copies)"
    if "condition" in low:
        return "other", "(loop control)"
    return "other", "(unmatched)"


def summarize(events: Sequence[KernelEvent], classes: dict[str, Instruction], calls: int,
              walls: Sequence[float], *, top: int = 15) -> StepProfile:
    """The events of `calls` profiled calls as one call's `StepProfile` (times divided by
    `calls`; the wall time is the median of `walls`). An event is matched to its
    instruction by its ``hlo_op``, else by its kernel's name; one that matches neither is
    classed by its name (`_library_kernel`: cuBLAS's GEMMs, memory copies, ...) and counted
    in ``unmatched`` only where that says nothing either."""
    per_class: dict[str, list[float]] = {}
    per_source: dict[str, list[float]] = {}
    per_op: dict[tuple[str, str], list[float]] = {}
    per_update: dict[str, list[float]] = {}
    per_memory: dict[str, list[float]] = {}
    # A GPU kernel is named after its fusion ("loop_add_fusion_3" for "loop_add_fusion.3"); in
    # a CUDA graph (XLA's command buffers) the event's hlo_op is the command buffer's.
    by_kernel = {_kernel_name(name): inst for name, inst in classes.items()}
    unmatched = 0
    for e in events:
        inst = classes.get(e.hlo_op) or by_kernel.get(_kernel_name(e.name))
        if inst is None:
            kind, source = _library_kernel(e.name)
            unmatched += source == "(unmatched)"
        else:
            kind, source = inst.kind, inst.source or "(no name)"
        tables = [(per_class, kind), (per_source, source),
                  (per_op, (e.hlo_op if e.hlo_op in classes else e.name, kind))]
        if source == "(update)":
            tables.append((per_update, kind))
        if inst is not None and kind in _MEMORY_BOUND and inst.nbytes >= LARGE_BYTES:
            row = per_memory.setdefault(kind, [0.0, 0.0, 0.0])
            row[0] += inst.nbytes / calls
            row[1] += e.duration_us * 1e-6 / calls
            row[2] += 1 / calls
        for table, key in tables:
            row = table.setdefault(key, [0.0, 0.0])
            row[0] += e.duration_us * 1e-6 / calls
            row[1] += 1 / calls
    ranked = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:top]
    return StepProfile(
        calls=calls, wall_s=statistics.median(walls) if walls else 0.0,
        busy_s=_union_us(events) * 1e-6 / calls,
        kernels_s=sum(e.duration_us for e in events) * 1e-6 / calls,
        kernels=len(events) / calls,
        classes={k: (v[0], v[1]) for k, v in sorted(per_class.items(), key=lambda kv: -kv[1][0])},
        sources={k: (v[0], v[1]) for k, v in sorted(per_source.items(),
                                                    key=lambda kv: -kv[1][0])},
        top=[(op, kind, v[0], v[1]) for (op, kind), v in ranked], unmatched=unmatched / calls,
        update_classes={k: (v[0], v[1]) for k, v in per_update.items()},
        memory_bound={k: (v[0], v[1], v[2]) for k, v in per_memory.items()})
