"""The GPU kit (issue 31, item 6): the attached device's kernels measured, its efficiency table
fitted, and one-device training steps of zoo models timed against the simulator.

    cd repo && PYTHONPATH=. python3 scripts/gpu_kit.py --profile --out /tmp/kit  # ~6-8 min, H100
    python scripts/gpu_kit.py --quick --out /tmp/kit                     # tiny, on CPU (the test)

In order:

1. A header: jax version, backend, device kind and count; what one jitted call of almost
   nothing costs (dispatch and launch), and one iteration of the timing loop.
2. Kernels on the default device (`soapjax.cost.devicefit`, each timed in one compiled loop):
   GEMMs in bfloat16 and float32 (float16 and float32 at ``highest`` precision for a few)
   over square and Transformer-like shapes, streaming ``x * a + b`` from 64 MiB to 1 GiB,
   a softmax and a layer norm, and causal attention (``jax.nn.dot_product_attention``, XLA's
   and cuDNN's) forward and forward+backward: achieved TFLOP/s or GB/s and the fraction of the
   datasheet figure (the topology of the device kind: ``soapjax/topology/meshes/dgx-h100x8.toml``
   cut to one device for an H100; an H200 gets that file's device with the H200's memory).
3. The fitted ``[device.efficiency]`` table (`soapjax.cost.devicefit.fit_efficiency`), as TOML.
4. One-device training steps (forward, backward, the zoo's AdamW update; jitted, parameters
   donated, the median of up to 10 calls after two warm-up calls) of GPT-2 small (float32),
   a 0.9B LLaMA (bfloat16) and GPT 1.3B (float16), against the simulator's unsharded step on
   the one-device topology with analytic costs: at the datasheet peaks, and with the fitted
   table. Also the model's FLOPs per second and its utilisation of the bfloat16 peak (MFU;
   FLOPs: three times the operators' forward FLOPs, as the analytic model counts them), and
   XLA's buffer assignment of each compiled step (``compiled.memory_analysis()``) beside the
   simulator's peak memory per device.
5. Each model's operators timed one by one on the device (`soapjax.cost.operators`'s measured costs,
   the unsharded shard program of each, forward and backward; operators with the same program
   share one measurement), and the simulator's step with those measured costs: the
   simulator's structure on a GPU, apart from its kernel model. Each operator's measured time
   stands beside the kernel model's (the topology file's ``[device.kernels]``), so the
   operators the kernel model misprices are named.
6. With ``--profile``: each step profiled (`soapjax.measure.stepprofile`, three more calls): its
   kernels by class (GEMM, reduction, elementwise, copy, ...) and by source in the model,
   beside the kernel model's kernels of each class (`model_classes`), and the device's idle
   time; the trace and the compiled HLO are kept in OUT, and ``--render-from OUT`` reads them
   again and renders the section, running nothing.
7. ``OUT/results.json`` (everything), ``OUT/efficiency.toml`` and ``OUT/accuracy-section.md``
   (a section for docs/accuracy.md); ``--write-docs`` appends that section to the doc.

Every measurement runs in a subprocess with a deadline (``--budget-s``, default 420 s: no new
kernel or model starts past it, and a subprocess that outlives it by 45 s is killed), so a
kernel or compile that hangs costs its own result, not the kit's; the first process only
traces and simulates, on the CPU, and never holds the GPU's memory. A kernel or model that
fails is reported and the kit goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
CHILD_ENV = dict(os.environ)  # as given: the measuring subprocesses see the accelerator
WORKER = "--worker" in sys.argv
if WORKER:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
else:
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process only traces and simulates
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

import soapjax_zoo as zoo  # noqa: E402
from soapjax.cost import devicefit
from soapjax.cost.kernels import kernel_classes, shard_kernels  # noqa: E402
from soapjax.cost.operators import TimingOptions, cost_model  # noqa: E402
from soapjax.graph.opgraph import trace  # noqa: E402
from soapjax.measure import (
    quiet_gc,  # noqa: E402
    stepprofile,  # noqa: E402
)
from soapjax.measure.devices import local_topology  # noqa: E402
from soapjax.simulate.front import opt_state_factor, simulate  # noqa: E402
from soapjax.strategy.space import MeshShape, Strategy, configs  # noqa: E402
from soapjax.topology.cluster import Efficiency, Topology, scaled_topology  # noqa: E402
from soapjax_zoo import gpt, gpt2, llama  # noqa: E402

GRACE_S = 45.0  # past the budget, a subprocess still running is killed
STEP_CALLS = 10
PROFILE_CALLS = 3


def say(msg: str) -> None:
    print(f"[gpu_kit {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- what is measured ---------------------------------------------------------------------------

SQUARE = (1024, 2048, 4096, 8192, 16384)
TRANSFORMER = (
    (8192, 2304, 768), (8192, 3072, 768), (8192, 768, 3072),  # GPT-2 small, 8 x 1024 tokens
    (4096, 6144, 2048), (4096, 8192, 2048), (4096, 2048, 8192),  # GPT 1.3B, 2 x 2048 tokens
    (16384, 4096, 4096), (512, 16384, 4096), (8192, 32000, 2048),  # many tokens; few; a vocab
)
ATTENTION = ((8, 1024, 12, 64), (4, 2048, 16, 128), (2, 4096, 32, 128))


def kernel_plan(quick: bool, gpu: bool) -> list[devicefit.Kernel]:
    """The kernels to time, most wanted first (the budget may cut the tail)."""
    d = devicefit
    if quick:
        return [d.gemm(64, 64, 64, "bfloat16"), d.gemm(128, 256, 128, "bfloat16"),
                d.gemm(128, 128, 128, "float32"), d.streaming(2**18, "float32"),
                d.streaming(2**20, "float32"), d.softmax(128, 256, "float32"),
                d.attention(2, 32, 2, 16, "float32", implementation="xla", backward=True),
                d.attention(2, 32, 2, 16, "float32", implementation="soapjax", backward=True),
                d.embedding_grad(512, 64, 256, "float32")]
    shapes = [(s, s, s) for s in SQUARE] + list(TRANSFORMER)
    f32_first = [(4096, 4096, 4096), (8192, 8192, 8192), *TRANSFORMER[:3]]
    # soapjax: the flash attention plans run (its rate: the topology's attention_efficiency)
    impls = ("xla", "cudnn", "soapjax") if gpu else ("xla", "soapjax")
    return [
        *(d.gemm(*s, "bfloat16") for s in shapes),
        *(d.streaming(nbytes // size, dtype) for dtype, size in (("float32", 4), ("bfloat16", 2))
          for nbytes in (2**26, 2**28, 2**30)),
        d.softmax(32768, 4096, "bfloat16"), d.layer_norm(32768, 4096, "bfloat16"),
        *(d.gemm(*s, "float32") for s in f32_first),
        *(d.attention(*a, "bfloat16", implementation=i, backward=b)
          for a in ATTENTION for i in impls for b in (False, True)),
        *(d.gemm(*s, "float32") for s in shapes if s not in f32_first),
        *(d.gemm(*s, "float16") for s in [(4096,) * 3, (8192,) * 3, *TRANSFORMER[3:5]]),
        *(d.gemm(s, s, s, "float32", precision="highest") for s in (4096, 8192)),
        # the flash attention's block size, and the backward of an embedding lookup (LLaMA's
        # 32000 x 2048 table, 4 x 1024 tokens) as XLA runs it and two other ways
        *(d.attention(*ATTENTION[-1], "bfloat16", implementation="soapjax", backward=True,
                      block=b) for b in (1024, 2048, 4096)),
        *(d.embedding_grad(32000, 2048, 4096, dtype, variant=v)
          for dtype in ("float32", "bfloat16") for v in ("gather", "sorted", "onehot")),
    ]


class ModelSpec(NamedTuple):
    """A zoo model at a size for one device: a registry config, or one derived from `base`."""

    name: str
    config: str
    batch_size: int | None = None
    base: str | None = None
    overrides: tuple[tuple[str, Any], ...] = ()


_BUILDERS = {"gpt2": (gpt2.GPT2_CONFIGS, gpt2.build_gpt2), "gpt": (gpt.GPT_CONFIGS, gpt.build_gpt),
             "llama": (llama.LLAMA_CONFIGS, llama.build_llama)}
KIT_MODELS = {
    "gpt2": ModelSpec("gpt2", "default", 8),  # GPT-2 small, float32, 8 x 1024 tokens
    # 0.9B parameters: LLaMA 2's layer at half width, 16 layers, grouped-query attention.
    "llama-1b": ModelSpec("llama", "1b", 4, "7b", (
        ("d_model", 2048), ("num_heads", 16), ("num_kv_heads", 8), ("num_layers", 16),
        ("mlp_hidden", 5632), ("seq_len", 1024))),
    "gpt-1.3b": ModelSpec("gpt", "1.3b", 2),  # float16 over float32, 2 x 2048 tokens
    # the same LLaMA at 4K tokens with soapjax's flash attention, as long-context plans run it
    "llama-1b-flash": ModelSpec("llama", "1b-flash", 1, "7b", (
        ("d_model", 2048), ("num_heads", 16), ("num_kv_heads", 8), ("num_layers", 16),
        ("mlp_hidden", 5632), ("seq_len", 4096), ("attention", "flash"))),
    # and with cuDNN's fused attention kernel (`flash_attention(..., implementation="cudnn")`)
    "llama-1b-cudnn": ModelSpec("llama", "1b-cudnn", 1, "7b", (
        ("d_model", 2048), ("num_heads", 16), ("num_kv_heads", 8), ("num_layers", 16),
        ("mlp_hidden", 5632), ("seq_len", 4096), ("attention", "cudnn"))),
    # the same two in float32 (no cast: the elementwise fusions of another dtype)
    "llama-1b-f32": ModelSpec("llama", "1b-f32", 4, "7b", (
        ("d_model", 2048), ("num_heads", 16), ("num_kv_heads", 8), ("num_layers", 16),
        ("mlp_hidden", 5632), ("seq_len", 1024), ("dtype", None))),
    "gpt-1.3b-f32": ModelSpec("gpt", "1.3b-f32", 2, "1.3b", (("dtype", None),)),
    "gpt2-tiny": ModelSpec("gpt2", "tiny"),
    "llama-tiny": ModelSpec("llama", "tiny"),
    "gpt-tiny": ModelSpec("gpt", "tiny"),
}
DEFAULT_MODELS = ("gpt2", "llama-1b", "gpt-1.3b", "llama-1b-flash", "llama-1b-cudnn")
QUICK_MODELS = ("gpt2-tiny", "llama-tiny")


def model_spec(text: str) -> ModelSpec:
    """A `KIT_MODELS` key, or ``name:config[:batch]`` of the zoo."""
    if text in KIT_MODELS:
        return KIT_MODELS[text]
    name, config, *batch = text.split(":")
    return ModelSpec(name, config, int(batch[0]) if batch else None)


def workload(spec: ModelSpec):
    if spec.base is None:
        return zoo.get(spec.name, spec.config, batch_size=spec.batch_size)
    table, build = _BUILDERS[spec.name]
    cfg = dataclasses.replace(table[spec.base], **dict(spec.overrides))
    if spec.batch_size is not None:
        cfg = dataclasses.replace(cfg, batch_size=spec.batch_size)
    return build(spec.name, spec.config, cfg, "linen")


@functools.cache
def traced(spec: ModelSpec):
    """The spec's workload and its graph, traced once per process (the step's prediction and
    its operators' kernel-model times read the same graph)."""
    w = workload(spec)
    return w, trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)


# --- the measuring subprocesses ------------------------------------------------------------------


class Parts:
    """A JSON-lines file a subprocess appends to, so what it measured outlives it."""

    def __init__(self, path: Path):
        self.path = path

    def emit(self, record: str, /, **data: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"type": record, **data}) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut short by a kill
                pass
        return out


def device_header() -> dict:
    import jaxlib

    dev = jax.devices()[0]
    stats = getattr(dev, "memory_stats", lambda: None)() or {}
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
            "platform": dev.platform, "device_kind": dev.device_kind,
            "device_count": jax.device_count(), "memory_limit_bytes": stats.get("bytes_limit"),
            "python": platform.python_version(), "host": platform.node()}


def kernels_worker(args: argparse.Namespace, parts: Parts) -> None:
    header = device_header()
    parts.emit("header", **header)
    say(f"device: {header['device_kind']} x{header['device_count']} ({header['backend']}), "
        f"jax {header['jax']}")
    options = (TimingOptions(target_trial_s=0.002, trials=3) if args.quick
               else TimingOptions(target_trial_s=0.02, trials=5))
    launch, floor = devicefit.launch_overhead(), devicefit.loop_floor()
    parts.emit("overhead", launch_s=launch, loop_floor_s=floor)
    say(f"one jitted call: {launch * 1e6:.1f} us; one timing-loop iteration: {floor * 1e6:.2f} us")
    plan = kernel_plan(args.quick, header["platform"] != "cpu")
    if args.kernels:  # name filters: a kernel is kept when its name holds one of them
        plan = [k for k in plan if any(f in k.name for f in args.kernels.split(","))]
    for i, kernel in enumerate(plan):
        if time.time() > args.deadline:
            parts.emit("skipped", names=[k.name for k in plan[i:]], why="budget")
            say(f"budget spent: {len(plan) - i} kernels left out")
            break
        try:
            t = devicefit.measure(kernel, options)
        except Exception as e:  # one kernel's failure (a missing cuDNN, memory) is a result
            parts.emit("error", name=kernel.name, error=_error(e))
            say(f"kernel {i + 1}/{len(plan)} {kernel.name}: FAILED {_error(e)}")
            continue
        parts.emit("kernel", **t._asdict())
        rate = (f"{t.flop_rate / 1e12:.1f} TFLOP/s" if t.kind in ("gemm", "attention")
                else f"{t.byte_rate / 1e9:.0f} GB/s")
        say(f"kernel {i + 1}/{len(plan)} {kernel.name}: {t.seconds * 1e3:.3f} ms, {rate}")


def _model_arg(args: argparse.Namespace) -> ModelSpec:
    """The `ModelSpec` a worker was given as JSON (its overrides back to hashable tuples)."""
    spec = ModelSpec(*json.loads(args.model))
    return spec._replace(overrides=tuple(tuple(o) for o in spec.overrides))


def step_worker(args: argparse.Namespace, parts: Parts) -> None:
    spec = _model_arg(args)
    w = workload(spec)
    params = jax.jit(w.init_params)(jax.random.key(0))
    opt_state = jax.jit(w.optimizer.init)(params)
    batch = w.make_batch(jax.random.key(1))
    t0 = time.perf_counter()
    compiled = jax.jit(w.train_step(), donate_argnums=(0, 1)).lower(
        params, opt_state, batch).compile()
    compile_s = time.perf_counter() - t0
    say(f"{spec.name} {spec.config}: compiled in {compile_s:.1f} s")
    for _ in range(2):  # warm-up
        params, opt_state, loss = compiled(params, opt_state, batch)
    jax.block_until_ready((params, opt_state, loss))
    times: list[float] = []
    with quiet_gc():
        while len(times) < args.steps and (len(times) < 3 or time.time() < args.deadline):
            t0 = time.perf_counter()
            params, opt_state, loss = compiled(params, opt_state, batch)
            jax.block_until_ready((params, opt_state, loss))
            times.append(time.perf_counter() - t0)
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    parts.emit("step", median_s=statistics.median(times), min_s=min(times), max_s=max(times),
               calls=len(times), compile_s=compile_s, loss=float(loss),
               xla_flops=_xla_flops(compiled), peak_bytes=stats.get("peak_bytes_in_use"),
               **_buffer_assignment(compiled))
    say(f"{spec.name} {spec.config}: median {statistics.median(times) * 1e3:.2f} ms over "
        f"{len(times)} calls")
    if args.profile:
        try:
            profile_step(spec, compiled, (params, opt_state, batch), Path(args.parts).parent,
                         parts)
        except Exception as e:  # the step's time stands without its profile
            traceback.print_exc()
            parts.emit("profile_error", error=_error(e))


def profile_step(spec: ModelSpec, compiled: Any, args: tuple, out: Path, parts: Parts) -> None:
    """Three more calls under the profiler (`soapjax.measure.stepprofile`): the step's kernels by
    class and by source. The trace and the compiled module's text are kept beside the parts file,
    so the classification can be redone without the device."""
    import shutil

    stem = f"{spec.name}-{spec.config}"
    text = compiled.as_text()
    with gzip.open(out / f"hlo-{stem}.txt.gz", "wt") as f:
        f.write(text)
    path, walls = stepprofile.profile_calls(
        compiled, args, calls=PROFILE_CALLS, log_dir=out / f"profile-{stem}",
        advance=lambda o, a: (o[0], o[1], a[2]))
    shutil.copy(path, out / f"trace-{stem}.json.gz")
    prof = profile_record(path, text, PROFILE_CALLS, walls)
    parts.emit("profile", **prof)
    say(f"{stem}: profiled {PROFILE_CALLS} calls: {prof['kernels']:.0f} kernels per call, busy "
        f"{prof['busy_s'] * 1e3:.2f} ms of {prof['wall_s'] * 1e3:.2f} ms; "
        + ", ".join(f"{k} {v[0] * 1e3:.2f} ms" for k, v in prof["classes"].items()))


def profile_record(trace_file: Path, hlo_text: str, calls: int, walls: list[float]) -> dict:
    """A profiled step as the results keep it: `soapjax.measure.stepprofile`'s summary of the trace,
    classified from the compiled module's text, with the module's loop copies."""
    prof = stepprofile.summarize(stepprofile.trace_kernels(trace_file),
                                 stepprofile.classify(hlo_text), calls, walls)
    return {**prof.as_dict(), "loop_copies": stepprofile.loop_copies(hlo_text)}


def ops_worker(args: argparse.Namespace, parts: Parts) -> None:
    """Each operator's unsharded shard program timed on the device, and the simulated step
    with those times (`soapjax.cost.operators`'s measured costs)."""
    spec = _model_arg(args)
    w, g = traced(spec)
    header = device_header()
    topo, _ = device_topology(header["device_kind"], header["platform"])
    costs = cost_model(g, topo, mode="measured", optimizer=w.optimizer,
                       cache_dir=Path(args.parts).parent / "cost-cache")
    # past the deadline a program is priced from the ones measured ("estimated"), not timed
    costs.measure_until(time.perf_counter() + args.deadline - time.time())
    t0 = time.perf_counter()
    for i, op in enumerate(g.operators):
        t = costs.shard_time(i, (1,) * len(op.iteration_sizes))
        parts.emit("op", index=i, name=op.name, forward_s=t.forward_s, backward_s=t.backward_s,
                   source=t.source)
    say(f"{spec.name} {spec.config}: {len(g.operators)} operators priced in "
        f"{time.perf_counter() - t0:.0f} s ({costs.stats})")
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    r = simulate(g, topo, replicated(g, topo), cost_model=costs, opt_state_factor=factor)
    parts.emit("simulated", step_s=r.step_time_s, stats=costs.stats._asdict())
    say(f"{spec.name} {spec.config}: simulated with measured operator times "
        f"{r.step_time_s * 1e3:.2f} ms")


def replicated(g, topo: Topology) -> Strategy:
    """The unsharded strategy: every operator's first config (all its dims whole)."""
    mesh = MeshShape.of(topo)
    return Strategy(tuple(configs(op, mesh)[0] for op in g.operators))


def _buffer_assignment(compiled: Any) -> dict[str, int]:
    """XLA's own account of the compiled step's memory (`compiled.memory_analysis()`): its
    arguments, outputs, aliased (donated) bytes, temporaries and, where the runtime gives it,
    its peak. The allocator's ``peak_bytes_in_use`` also counts what compiling and
    autotuning held."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  a backend without it
        return {}
    if m is None:
        return {}
    keys = ("argument", "output", "alias", "temp")
    out = {f"xla_{k}_bytes": int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in keys}
    peak = getattr(m, "peak_memory_in_bytes", 0)
    if peak:
        out["xla_peak_bytes"] = int(peak)
    return out


def _xla_flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"])
    except Exception:  # cost analysis is optional on some backends
        return None


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) < 600 else text[:600] + " ..."


def run_worker(what: list[str], parts: Parts, *, deadline: float, hard_end: float,
               quick: bool) -> str | None:
    """Runs ``gpu_kit.py --worker ...`` until it ends or `hard_end`; None, or why it failed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *what,
           "--deadline", repr(deadline), "--parts", str(parts.path)]
    if quick:
        cmd.append("--quick")
    env = dict(CHILD_ENV, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), CHILD_ENV.get("PYTHONPATH"))
                                          if p))
    timeout = max(5.0, hard_end - time.time())
    try:
        rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return f"killed after {timeout:.0f} s (the budget's end)"
    return None if rc == 0 else f"exit status {rc}"


# --- the simulator's side ------------------------------------------------------------------------


def device_topology(kind: str, platform_name: str) -> tuple[Topology, str]:
    """A one-device topology of the measured device kind, and where its figures come from."""
    if platform_name == "cpu":
        return scaled_topology(local_topology(), 1), (
            "the CPU's rough figures of soapjax/topology/meshes/cpu8.toml, one device")
    h100 = scaled_topology("dgx-h100x8", 1)
    if "h200" in kind.lower():
        device = dataclasses.replace(h100.device, kind="H200 SXM 141GB",
                                     memory_bytes=141 * 10**9, memory_bandwidth=4.8e12)
        return (dataclasses.replace(h100, name="h200-1", device=device),
                "no shipped H200 topology: the H100 SXM device of "
                "soapjax/topology/meshes/dgx-h100x8.toml with "
                "the H200 datasheet's memory (141 GB at 4.8 TB/s); the same compute peaks")
    if "h100" in kind.lower() and "pcie" not in kind.lower():
        return h100, "soapjax/topology/meshes/dgx-h100x8.toml (H100 SXM5) cut to one device"
    return h100, (f"no shipped topology for {kind!r}: the H100 SXM5 figures of "
                  "soapjax/topology/meshes/dgx-h100x8.toml, so fractions are of an H100's peaks")


class Predicted(NamedTuple):
    operators: int
    model_flops: float
    datasheet_s: float
    fitted_s: float | None
    peak_bytes: int
    fits: bool


def predict(spec: ModelSpec, topo: Topology, fitted: Efficiency | None) -> Predicted:
    """The simulated unsharded step at the datasheet peaks and with the fitted table."""
    w, g = traced(spec)
    strategy = replicated(g, topo)
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    times, peak, fits = {}, 0, True
    for key, eff in (("datasheet", Efficiency()), ("fitted", fitted)):
        if eff is None:
            continue
        t = devicefit.with_efficiency(topo, eff)
        r = simulate(g, t, strategy, cost_model=cost_model(g, t, mode="analytic",
                                                           optimizer=w.optimizer),
                     opt_state_factor=factor)
        times[key], peak, fits = r.step_time_s, max(r.peak_memory_bytes), r.fits_in_memory
    return Predicted(len(g.operators), 3 * sum(op.flops for op in g.operators),
                     times["datasheet"], times.get("fitted"), peak, fits)


def _run_step(spec: ModelSpec, out: Path, *, deadline: float, hard_end: float,
              args: argparse.Namespace) -> tuple[list[dict], str]:
    """The step subprocess's measurements, and why it failed (``""`` if it did not)."""
    parts = Parts(out / f"step-{spec.name}-{spec.config}.jsonl")
    parts.path.unlink(missing_ok=True)
    what = ["step", "--model", json.dumps(spec), "--steps", str(args.steps)]
    failed = run_worker(what + (["--profile"] if args.profile else []), parts,
                        deadline=deadline, hard_end=hard_end, quick=args.quick)
    records = parts.read()
    why = [r["error"] for r in records if r["type"] == "error"] + ([failed] if failed else [])
    return [r for r in records if r["type"] in ("step", "profile", "profile_error")], \
        "; ".join(why)


def step_row(spec: ModelSpec, topo: Topology, fitted: Efficiency | None, out: Path, *,
             deadline: float, hard_end: float, args: argparse.Namespace) -> dict:
    """One model: predicted (shrinking the batch until it fits), measured, compared."""
    pred = predict(spec, topo, fitted)
    while not pred.fits and workload(spec).batch_size > 1:
        spec = spec._replace(batch_size=workload(spec).batch_size // 2)
        say(f"{spec.name} {spec.config}: predicted not to fit; batch {spec.batch_size}")
        pred = predict(spec, topo, fitted)
    w = workload(spec)
    row: dict[str, Any] = {"model": spec.name, "config": spec.config,
                           "batch_size": w.batch_size, "description": w.description,
                           "operators": pred.operators, "model_flops": pred.model_flops,
                           "predicted_datasheet_s": pred.datasheet_s,
                           "predicted_fitted_s": pred.fitted_s,
                           "predicted_peak_bytes": pred.peak_bytes}
    say(f"{spec.name} {spec.config} (batch {w.batch_size}): predicted "
        f"{pred.datasheet_s * 1e3:.2f} ms at the datasheet peaks"
        + (f", {pred.fitted_s * 1e3:.2f} ms with the fitted table" if pred.fitted_s else ""))
    records, failed = _run_step(spec, out, deadline=deadline, hard_end=hard_end, args=args)
    measured = [r for r in records if r["type"] == "step"]
    if not measured and "memory" in failed.lower() and w.batch_size > 1 and (
            deadline - time.time() > 30):
        spec = spec._replace(batch_size=w.batch_size // 2)
        say(f"{spec.name} {spec.config}: out of memory; again at batch {spec.batch_size}")
        return step_row(spec, topo, fitted, out, deadline=deadline, hard_end=hard_end, args=args)
    if not measured:
        row["error"] = failed
        return row
    if args.ops:
        row.update(op_rows(spec, topo, out, deadline=deadline, hard_end=hard_end, args=args))
    profiles = [r for r in records if r["type"] == "profile"]
    if profiles:
        row["profile"] = {k: v for k, v in profiles[-1].items() if k != "type"}
        row["profile"]["model"] = model_classes(spec, topo)
    else:
        row.update({"profile_error": r["error"] for r in records
                    if r["type"] == "profile_error"})
    m = measured[-1]
    peak = topo.device.peak_flops_for("bfloat16")
    row.update({k: v for k, v in m.items() if k != "type"})
    row["measured_s"] = m["median_s"]
    row["error_datasheet"] = pred.datasheet_s / m["median_s"] - 1
    if pred.fitted_s is not None:
        row["error_fitted"] = pred.fitted_s / m["median_s"] - 1
    if row.get("simulated_measured_ops_s"):
        row["error_measured_ops"] = row["simulated_measured_ops_s"] / m["median_s"] - 1
    row["model_flop_rate"] = pred.model_flops / m["median_s"]
    row["mfu_bfloat16"] = row["model_flop_rate"] / peak
    return row


def op_rows(spec: ModelSpec, topo: Topology, out: Path, *, deadline: float, hard_end: float,
            args: argparse.Namespace) -> dict:
    """The model's operators timed on the device (`ops_worker`) beside the kernel model's
    times, and the step simulated with the measured ones."""
    parts = Parts(out / f"ops-{spec.name}-{spec.config}.jsonl")
    parts.path.unlink(missing_ok=True)
    say(f"{spec.name} {spec.config}: timing its operators (until +{deadline - time.time():.0f} s "
        "from now)")
    failed = run_worker(["ops", "--model", json.dumps(spec)], parts, deadline=deadline,
                        hard_end=hard_end, quick=args.quick)
    records = parts.read()
    ops = [r for r in records if r["type"] == "op"]
    sim = [r for r in records if r["type"] == "simulated"]
    errors = [r["error"] for r in records if r["type"] == "error"] + ([failed] if failed else [])
    w, g = traced(spec)
    model = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    for r in ops:
        t = model.shard_time(r["index"], (1,) * len(g.operators[r["index"]].iteration_sizes))
        r.pop("type")
        r.update(kernel_forward_s=t.forward_s, kernel_backward_s=t.backward_s,
                 flops=g.operators[r["index"]].flops)
    found: dict[str, Any] = {"ops": ops}
    if sim:
        found["simulated_measured_ops_s"] = sim[-1]["step_s"]
        found["op_stats"] = sim[-1]["stats"]
    if errors:
        found["ops_error"] = "; ".join(errors)
    return found


def model_classes(spec: ModelSpec, topo: Topology) -> dict[str, list[float]]:
    """The kernel model's unsharded step as ``[seconds, kernels]`` per class, the classes of
    `soapjax.measure.stepprofile`: each operator's kernels forward and backward
    (`soapjax.cost.kernels.kernel_classes`), operators it does not apply to as ``roofline``, and
    the rest of the simulated step (the optimizer's update) as ``update``."""
    w, g = traced(spec)
    model = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    out: dict[str, list[float]] = {}
    ops_s = 0.0
    for i, op in enumerate(g.operators):
        degrees = (1,) * len(op.iteration_sizes)
        t = model.shard_time(i, degrees)
        ops_s += t.forward_s + t.backward_s
        classes = kernel_classes(shard_kernels(g, op, degrees), topo.device)
        for kind, (seconds, n) in (classes or {"roofline": (t.forward_s + t.backward_s, 0)}
                                   ).items():
            row = out.setdefault(kind, [0.0, 0])
            row[0] += seconds
            row[1] += n
    factor = opt_state_factor(w.optimizer, w.abstract_params())
    r = simulate(g, topo, replicated(g, topo), cost_model=model, opt_state_factor=factor)
    out["update"] = [max(r.step_time_s - ops_s, 0.0), 0]
    return out


# --- the report ----------------------------------------------------------------------------------


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def render(results: dict) -> str:
    """The markdown section for docs/accuracy.md."""
    h, meta = results.get("device") or {}, results["meta"]
    peaks = results["topology"]
    lines = [f"## GPU kit: {h.get('device_kind', 'no device')}, {meta['date']}", "",
             f"Made by `{meta['command']}` in {meta['elapsed_s']:.0f} s (budget "
             f"{meta['budget_s']:.0f} s) at {meta.get('git', '?')}: jax {h.get('jax', '?')} "
             f"({h.get('backend', '?')}), {h.get('device_count', '?')} device(s). Datasheet "
             f"figures: {peaks['source']} ({peaks['bfloat16_tflops']:.4g} TFLOP/s bfloat16, "
             f"{peaks['float32_tflops']:.4g} float32, {peaks['memory_GBps']:.4g} GB/s)."
             + (f" Profiles read again and rendered by `{meta['rendered']}`."
                if meta.get("rendered") else "")]
    if results.get("overhead"):
        o = results["overhead"]
        lines += ["", f"One jitted call of a one-element add, waited for: {_ms(o['launch_s'])}; "
                  f"one iteration of the timing loop (`soapjax.measure._timing`): "
                  f"{_ms(o['loop_floor_s'])}. Kernels (and operators) are timed inside that "
                  "loop, dispatch amortised and that iteration's cost taken off; kernels under "
                  "10 iterations' worth are left out of the fit."]
    lines += _kernel_tables(results["kernels"])
    if results.get("efficiency"):
        e = results["efficiency"]
        lines += ["", f"The fitted table ({e['rule']}):", "", "```toml", e["toml"].rstrip(), "```"]
    if results.get("attention_efficiency") is not None:
        lines += ["", "soapjax's own flash attention "
                  "(`soapjax.base.attention.flash_attention`, what apply runs), forward and "
                  "backward, reached "
                  f"`attention_efficiency = {results['attention_efficiency']:.3f}` of the bf16 "
                  "peak as the kernel model counts its FLOPs (`devicefit."
                  "fit_attention_efficiency`): the figure for the topology's `[device.kernels]`."]
    if results.get("cudnn_attention_efficiency") is not None:
        lines += ["", "cuDNN's fused attention (`jax.nn.dot_product_attention`'s \"cudnn\", what "
                  "`flash_attention(..., implementation=\"cudnn\")` runs where the sequence is "
                  "whole), forward and backward, reached `cudnn_attention_efficiency = "
                  f"{results['cudnn_attention_efficiency']:.3f}` the same way."]
    lines += _step_table(results["steps"])
    lines += _memory_table(results["steps"])
    lines += _ops_tables(results["steps"])
    lines += _profile_tables(results["steps"],
                             memory_GBps=(results.get("topology") or {}).get("memory_GBps"))
    notes = list(results["notes"]) + [f"{e['name']}: {e['error']}" for e in results["errors"]]
    if results["skipped"]:
        notes.append(f"left out for the budget: {', '.join(results['skipped'])}")
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def _kernel_tables(kernels: list[dict]) -> list[str]:
    def tflops(t: dict) -> str:
        return f"{t['flops'] / t['seconds'] / 1e12:.4g}"

    lines = []
    gemms = [t for t in kernels if t["kind"] == "gemm"]
    if gemms:
        lines += ["", "| GEMM (m x n x k) | dtype | time | TFLOP/s | of peak |",
                  "|---|---|---:|---:|---:|"]
        lines += [f"| {'x'.join(map(str, t['shape']))} | {t['dtype']} {t['variant']} | "
                  f"{_ms(t['seconds'])} | {tflops(t)} | {t['fraction']:.2f} |" for t in gemms]
    mem = [t for t in kernels if t["kind"] in ("stream", "reduce", "scatter")]
    if mem:
        lines += ["", "| memory-bound kernel | time | GB/s | of bandwidth |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {t['name']} | {_ms(t['seconds'])} | "
                  f"{t['nbytes'] / t['seconds'] / 1e9:.0f} | {t['fraction']:.2f} |" for t in mem]
    att = [t for t in kernels if t["kind"] == "attention"]
    if att:
        lines += ["", "| attention (causal; FLOPs: the causal half, a backward twice its forward) "
                  "| time | TFLOP/s | of peak |", "|---|---:|---:|---:|"]
        lines += [f"| {t['name']} | {_ms(t['seconds'])} | {tflops(t)} | {t['fraction']:.2f} |"
                  for t in att]
    return lines


def _step_table(steps: list[dict]) -> list[str]:
    if not steps:
        return []
    lines = ["", "One-device training steps (the median of the calls after two warm-up calls) "
             "against the simulator's unsharded step: analytic costs from the topology file as "
             "shipped (its `[device.kernels]` model where it has one, no efficiency table), "
             "the same with the fitted efficiency table, and the device's own operator times "
             "(each operator timed alone, then simulated):", "",
             "| model | batch | measured | predicted (as shipped) | error | predicted (fitted) "
             "| error | simulated, measured operators | error | model TFLOP/s | MFU (bf16) "
             "| compile |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in steps:
        head = f"| {s['model']} {s['config']} | {s.get('batch_size', '-')} |"
        if "measured_s" not in s:
            lines.append(f"{head} failed: {s.get('error', '?')[:120]} | "
                         f"{_ms(s.get('predicted_datasheet_s'))} | - | "
                         f"{_ms(s.get('predicted_fitted_s'))} | - | - | - | - | - | - |")
            continue
        lines.append(f"{head} {_ms(s['measured_s'])} | {_ms(s['predicted_datasheet_s'])} | "
                     f"{_pct(s['error_datasheet'])} | {_ms(s.get('predicted_fitted_s'))} | "
                     f"{_pct(s.get('error_fitted'))} | {_ms(s.get('simulated_measured_ops_s'))} "
                     f"| {_pct(s.get('error_measured_ops'))} | "
                     f"{s['model_flop_rate'] / 1e12:.3g} | "
                     f"{s['mfu_bfloat16'] * 100:.0f}% | {s['compile_s']:.0f} s |")
    return lines


def _memory_table(steps: list[dict]) -> list[str]:
    rows = [s for s in steps if s.get("xla_temp_bytes") is not None]
    if not rows:
        return []
    lines = ["", "Memory per step against the simulator's peak per device "
             "(`predicted_peak_bytes`): XLA's buffer assignment of the compiled step "
             "(`compiled.memory_analysis()`: arguments + outputs - aliased + temporaries, "
             "and its own peak where the runtime gives one) and the allocator's peak (which "
             "also holds what compiling and autotuning took):", "",
             "| model | batch | simulator | XLA: arguments | outputs | aliased | temporaries "
             "| XLA peak | allocator peak |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def gb(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e9:.2f} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB"

    for s in rows:
        lines.append(f"| {s['model']} {s['config']} | {s.get('batch_size', '-')} | "
                     f"{gb(s.get('predicted_peak_bytes'))} | {gb(s['xla_argument_bytes'])} | "
                     f"{gb(s['xla_output_bytes'])} | {gb(s['xla_alias_bytes'])} | "
                     f"{gb(s['xla_temp_bytes'])} | {gb(s.get('xla_peak_bytes'))} | "
                     f"{gb(s.get('peak_bytes'))} |")
    return lines


def op_group(name: str) -> str:
    """An operator's name with its layer numbers taken out: the layers' operators add up."""
    return "/".join("*" if part.split("_")[-1].isdigit() and part.startswith(
        ("layers_", "h_", "blocks_", "block_", "layer_")) or part.isdigit() else part
        for part in name.split("/"))


def _steps_with(steps: list[dict], key: str, lines: list[str], failed: str):
    """(step, its `key` record) for each step that has one; for a step whose ``key_error``
    says why it has none, a line in `lines` (``failed``: what did not happen)."""
    for s in steps:
        if s.get(key):
            yield s, s[key]
        elif s.get(f"{key}_error"):
            lines += ["", f"{s['model']} {s['config']}: {failed}: {s[f'{key}_error'][:300]}"]


def _ops_tables(steps: list[dict], top: int = 12) -> list[str]:
    lines: list[str] = []
    for s, ops in _steps_with(steps, "ops", lines, "operators not timed"):
        groups: dict[str, list[float]] = {}
        for r in ops:
            g = groups.setdefault(op_group(r["name"]), [0, 0.0, 0.0, 0.0, 0.0, 0.0])
            g[0] += 1
            g[1] += r["forward_s"]
            g[2] += r["backward_s"]
            g[3] += r["kernel_forward_s"]
            g[4] += r["kernel_backward_s"]
            g[5] += r["flops"]
        measured = sum(g[1] + g[2] for g in groups.values())
        kernel = sum(g[3] + g[4] for g in groups.values())
        sources = sorted({r["source"] for r in ops})
        lines += ["", f"{s['model']} {s['config']} (batch {s.get('batch_size')}): its "
                  f"{len(ops)} operators timed alone sum to {_ms(measured)} (forward and "
                  f"backward; {', '.join(sources)}), the kernel model's to {_ms(kernel)}; the "
                  f"{min(top, len(groups))} largest groups (layers added up):", "",
                  "| operators | n | measured fwd | bwd | kernel model fwd | bwd | "
                  "model / measured | TFLOP/s measured |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, g in sorted(groups.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:top]:
            both = g[1] + g[2]
            ratio = (g[3] + g[4]) / both if both > 0 else float("nan")
            rate = 3 * g[5] / both / 1e12 if both > 0 else 0.0
            lines.append(f"| `{name}` | {g[0]} | {_ms(g[1])} | {_ms(g[2])} | {_ms(g[3])} | "
                         f"{_ms(g[4])} | {ratio:.2f} | {rate:.3g} |")
    return lines


def _profile_tables(steps: list[dict], top: int = 10, memory_GBps: float | None = None
                    ) -> list[str]:
    lines: list[str] = []
    for s, p in _steps_with(steps, "profile", lines, "not profiled"):
        model = p.get("model", {})
        idle = p["wall_s"] - p["busy_s"]
        lines += ["", f"{s['model']} {s['config']}, profiled (`soapjax.measure.stepprofile`, "
                  f"{p['calls']} calls): {p['kernels']:.0f} kernels per step; the device was "
                  f"busy {_ms(p['busy_s'])} of the step's {_ms(p['wall_s'])} (idle "
                  f"{_ms(idle)}, {idle / p['wall_s'] * 100:.0f}%); kernel time by class (the "
                  "optimizer's update in its own row), beside the kernel model's "
                  "(`model_classes`):", "",
                  "| class | kernels | device time | share | kernel model | its kernels |",
                  "|---|---:|---:|---:|---:|---:|"]
        # the optimizer's update kernels in their own row, as the model prices them apart
        update = p.get("update_classes") or {}
        measured = {k: (v[0] - update.get(k, (0.0, 0))[0], v[1] - update.get(k, (0.0, 0))[1])
                    for k, v in p["classes"].items()}
        if update:
            measured["update"] = (sum(v[0] for v in update.values()),
                                  sum(v[1] for v in update.values()))
        kinds = list(measured) + [k for k in model if k not in measured]
        for kind in kinds:
            if kind == "update" and "update_classes" not in p:  # a run before the split
                lines.append(f"| update | - | (in the classes above) | - | "
                             f"{_ms(model[kind][0])} | - |")
                continue
            sec, n = measured.get(kind, (0.0, 0))
            msec, mn = model.get(kind, (None, None))
            lines.append(f"| {kind} | {n:.0f} | {_ms(sec)} | "
                         f"{sec / p['kernels_s'] * 100:.0f}% | {_ms(msec)} | "
                         f"{'-' if mn is None else f'{mn:.0f}'} |")
        groups: dict[str, list[float]] = {}
        for src, (sec, n) in p["sources"].items():
            g = groups.setdefault(op_group(src), [0.0, 0.0])
            g[0] += sec
            g[1] += n
        lines += ["", f"Its {min(top, len(groups))} largest sources (the model path in each "
                  "kernel's JAX op name, layers added up):", "",
                  "| source | kernels | device time |", "|---|---:|---:|"]
        lines += [f"| `{k}` | {v[1]:.0f} | {_ms(v[0])} |"
                  for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]]
        if p.get("unmatched"):
            lines.append(f"\n{p['unmatched']:.0f} kernels per step ran for no instruction "
                         "of the step's module.")
        large = p.get("memory_bound") or {}
        if large:
            parts = [f"{kind} {v[0] / 1e9:.3g} GB in {_ms(v[1])} ({v[2]:.0f} kernels): "
                     f"{v[0] / v[1] / 1e12:.2f} TB/s"
                     + (f", {v[0] / v[1] / (memory_GBps * 1e9):.2f} of the bandwidth"
                        if memory_GBps else "")
                     for kind, v in sorted(large.items()) if v[1] > 0]
            lines.append(f"\nIts memory-bound kernels of {stepprofile.LARGE_BYTES // 2**20} MiB "
                         "or more (bytes: each instruction's operands and result once; those "
                         "that slice or update in place left out): " + "; ".join(parts) + ".")
        copies, nbytes = p.get("loop_copies") or (0, 0.0)
        if copies:
            memcpy = p["sources"].get("(memory copies)", (0.0, 0))[0]
            lines.append(f"\nIts loops' slice copies (`stepprofile.loop_copies`: dynamic "
                         f"slices and updates of stacked values that XLA runs as copies of "
                         f"their own): {copies:.0f} a step, {nbytes / 1e9:.3g} GB read and "
                         "written" + (f"; over the driver's memory copies' {_ms(memcpy)}, "
                                      f"{nbytes / memcpy / 1e12:.2f} TB/s" if memcpy else "")
                         + ".")
    return lines


# --- the run -------------------------------------------------------------------------------------


def _git() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def measure_kernels(results: dict, out: Path, args: argparse.Namespace, start: float) -> None:
    parts = Parts(out / "kernels.jsonl")
    parts.path.unlink(missing_ok=True)
    deadline = start + args.kernel_share * args.budget_s
    say(f"kernels (until +{deadline - start:.0f} s)")
    what = ["kernels"] + (["--kernels", args.kernels] if args.kernels else [])
    failed = run_worker(what, parts, deadline=deadline, quick=args.quick,
                        hard_end=min(deadline + GRACE_S, start + args.budget_s + GRACE_S))
    for r in parts.read():
        kind = r.pop("type")
        if kind == "header":
            results["device"] = r
        elif kind == "overhead":
            results["overhead"] = r
        elif kind == "kernel":
            results["kernels"].append(r)
        elif kind == "error":
            results["errors"].append(r)
        elif kind == "skipped":
            results["skipped"] += r["names"]
    if failed:
        results["errors"].append({"name": "kernels", "error": failed})


def fit(results: dict, topo: Topology, args: argparse.Namespace) -> Efficiency | None:
    timings = [devicefit.KernelTiming(**{**t, "shape": tuple(t["shape"])})
               for t in results["kernels"]]
    device = topo.device
    for t, row in zip(timings, results["kernels"]):
        if t.kind in ("gemm", "attention"):
            row["fraction"] = t.flop_rate / device.peak_flops_for(t.dtype)
        else:
            row["fraction"] = t.byte_rate / device.memory_bandwidth
    attention = devicefit.fit_attention_efficiency(timings, device)
    if attention is not None:
        results["attention_efficiency"] = attention
        say(f"soapjax's flash attention: attention_efficiency = {attention:.3f}")
    cudnn = devicefit.fit_attention_efficiency(timings, device, variant="cudnn")
    if cudnn is not None:
        results["cudnn_attention_efficiency"] = cudnn
        say(f"cuDNN's fused attention: cudnn_attention_efficiency = {cudnn:.3f}")
    if not any(t.kind in ("gemm", "stream") for t in timings):
        results["notes"].append("no GEMM or streaming kernel was measured: no table fitted")
        return None
    floor = (results.get("overhead") or {}).get("loop_floor_s", 0.0)
    f = devicefit.fit_efficiency(timings, device, floor_s=floor)
    h = results.get("device") or {}
    rule = ("per dtype, the median fraction of the datasheet peak over the larger half (by "
            "FLOPs) of the default-precision GEMMs; the memory bandwidth, the median over the "
            "larger half (by bytes) of the x*a+b kernels")
    comment = "\n".join([f"measured by scripts/gpu_kit.py on {h.get('device_kind', '?')}, jax "
                         f"{h.get('jax', '?')}, {results['meta']['date']}",
                         *textwrap.wrap(rule, 94)])
    text = devicefit.format_efficiency(f, comment=comment)
    results["efficiency"] = {"peak_flops": dict(f.efficiency.peak_flops),
                             "memory_bandwidth": f.efficiency.memory_bandwidth,
                             "raw": {"peak_flops": f.flops, "memory_bandwidth": f.memory},
                             "notes": list(f.notes), "rule": rule, "toml": text}
    (Path(args.out) / "efficiency.toml").write_text(text)
    say("fitted:\n" + text)
    return f.efficiency


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_kit_out", help="output folder (default gpu_kit_out/)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and tiny models (CPU test)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="no kernel or model starts past this many seconds (default 420)")
    p.add_argument("--kernel-share", type=float, default=0.45,
                   help="the budget's share for kernels (default 0.45)")
    p.add_argument("--models", nargs="*", default=None,
                   help=f"{', '.join(KIT_MODELS)} or zoo name:config[:batch] "
                        f"(default {' '.join(DEFAULT_MODELS)}; --quick: {' '.join(QUICK_MODELS)})")
    p.add_argument("--steps", type=int, default=None, help="timed calls per model (default 10)")
    p.add_argument("--kernels", default="", metavar="NAMES",
                   help="time only the kernels whose names hold one of these comma-separated "
                        "parts (e.g. 'attention,gemm 8192'; default: every kernel)")
    p.add_argument("--no-ops", dest="ops", action="store_false",
                   help="do not time each model's operators one by one (item 5)")
    p.add_argument("--profile", action="store_true",
                   help="profile each model's step (jax.profiler, 3 more calls): its kernels "
                        "by class and source beside the kernel model's; the traces and HLO "
                        "are kept in OUT")
    p.add_argument("--render-from", metavar="DIR",
                   help="run nothing: read DIR/results.json of an earlier run, read its profiles "
                        "again from the traces and HLO kept in DIR (the classification of "
                        "this checkout), and write the section again")
    p.add_argument("--write-docs", action="store_true", help="append the section to "
                   "docs/accuracy.md")
    p.add_argument("--worker", choices=("kernels", "step", "ops"), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--parts", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else STEP_CALLS)
    if args.render_from:
        return render_again(Path(args.render_from), Path(args.out), write_docs=args.write_docs)
    if args.worker:
        parts = Parts(Path(args.parts))
        try:
            {"kernels": kernels_worker, "step": step_worker, "ops": ops_worker}[args.worker](
                args, parts)
        except Exception as e:  # said in the parts file, for the report
            parts.emit("error", name=args.worker, error=_error(e))
            raise
        return {}
    return run(args)


def measure_steps(results: dict, topo: Topology, fitted: Efficiency | None, out: Path,
                  args: argparse.Namespace, start: float) -> None:
    """Each model's step, measured and predicted, sharing what is left of the budget."""
    names = args.models if args.models is not None else (
        QUICK_MODELS if args.quick else DEFAULT_MODELS)
    hard_end = start + args.budget_s + GRACE_S
    for i, name in enumerate(names):
        now = time.time()
        share = (start + args.budget_s - now) / (len(names) - i)
        if share < (5 if args.quick else 30):
            results["skipped"].append(f"model {name}")
            say(f"budget spent: model {name} left out")
            continue
        say(f"model {i + 1}/{len(names)}: {name} (until +{now + share - start:.0f} s)")
        try:
            row = step_row(model_spec(name), topo, fitted, out, deadline=now + share,
                           hard_end=hard_end, args=args)
        except Exception as e:
            traceback.print_exc()
            row = {"model": name, "config": "", "error": _error(e)}
        results["steps"].append(row)
        say(f"{name}: " + (f"measured {_ms(row['measured_s'])}, error "
                           f"{_pct(row['error_datasheet'])} (datasheet), "
                           f"{_pct(row.get('error_fitted'))} (fitted)"
                           if "measured_s" in row else f"FAILED {row.get('error')}"))


def reprofile(folder: Path, row: dict) -> None:
    """A step row's profile read again from the trace and HLO its run kept in `folder`."""
    stem = f"{row['model']}-{row['config']}"
    trace_file, hlo = folder / f"trace-{stem}.json.gz", folder / f"hlo-{stem}.txt.gz"
    if not (trace_file.exists() and hlo.exists() and row.get("profile")):
        return
    with gzip.open(hlo, "rt") as f:
        text = f.read()
    old = row["profile"]
    row["profile"] = {**profile_record(trace_file, text, old["calls"], [old["wall_s"]]),
                      "model": old.get("model", {})}


def render_again(folder: Path, out: Path, *, write_docs: bool) -> dict:
    """`--render-from`: an earlier run's results, its profiles read again, rendered."""
    results = json.loads((folder / "results.json").read_text())
    for row in results["steps"]:
        reprofile(folder, row)
    results["meta"]["rendered"] = ("python3 scripts/gpu_kit.py " + " ".join(sys.argv[1:])).strip()
    out.mkdir(parents=True, exist_ok=True)
    section = render(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "accuracy-section.md").write_text(section)
    if write_docs:
        with (ROOT / "docs" / "accuracy.md").open("a") as f:
            f.write("\n" + section)
    print(section, flush=True)
    return results


def run(args: argparse.Namespace) -> dict:
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python3 scripts/gpu_kit.py " + " ".join(sys.argv[1:])
    results: dict[str, Any] = {
        "meta": {"date": datetime.date.today().isoformat(), "command": command.strip(),
                 "budget_s": args.budget_s, "quick": args.quick, "git": _git(),
                 "planner_jax": jax.__version__},
        "device": None, "overhead": None, "topology": None, "kernels": [], "errors": [],
        "skipped": [], "efficiency": None, "attention_efficiency": None,
        "cudnn_attention_efficiency": None, "steps": [],
        "notes": []}
    say(f"planning with jax {jax.__version__} on {jax.default_backend()}; budget "
        f"{args.budget_s:.0f} s; out {out}")
    measure_kernels(results, out, args, start)
    h = results["device"] or {}
    if not h:
        results["notes"].append("the kernel subprocess wrote no header: the device is unknown; "
                                "the H100 SXM5 figures stand in")
    topo, source = device_topology(h.get("device_kind", ""), h.get("platform", "gpu"))
    dev = topo.device
    results["topology"] = {"name": topo.name, "device": dev.kind, "source": source,
                           "bfloat16_tflops": dev.peak_flops_for("bfloat16") / 1e12,
                           "float32_tflops": dev.peak_flops_for("float32") / 1e12,
                           "memory_GBps": dev.memory_bandwidth / 1e9}
    fitted = None
    try:
        fitted = fit(results, topo, args)
    except Exception as e:
        results["errors"].append({"name": "fit", "error": _error(e)})
        traceback.print_exc()
    measure_steps(results, topo, fitted, out, args, start)
    results["meta"]["elapsed_s"] = time.time() - start
    section = render(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "accuracy-section.md").write_text(section)
    if args.write_docs:
        with (ROOT / "docs" / "accuracy.md").open("a") as f:
            f.write("\n" + section)
    say(f"done in {time.time() - start:.0f} s: {out / 'results.json'}, "
        f"{out / 'accuracy-section.md'}")
    print(section, flush=True)
    return results


if __name__ == "__main__":
    main()
