"""soapjax's applied multi-GPU training steps compiled by XLA:GPU for a mocked 8- or 64-GPU
topology on one GPU, each set beside the simulator's prediction (issue 47, item 3).

    cd repo && PYTHONPATH=. python3 scripts/gpu_mock_compile.py --out /tmp/mock  # ~5 min, 1 GPU
    python scripts/gpu_mock_compile.py --quick --devices 8 --out /tmp/mock       # CPU (the test)

For each device count (``--devices``, default 8 and 64) and each case (``--cases``):

* ``fsdp``: the zoo's ``gpt`` (a 4-layer GPT of d_model 1024, 1024 tokens, bfloat16 over
  float32) under the ``fsdp`` baseline (ZeRO-3 over every axis);
* ``megatron-sp``: the same GPT under the ``megatron-sp`` baseline (tensor parallel over the
  node's axes with sequence parallelism, selective recomputation, data parallel across nodes);
* ``pipeline``: the same GPT under `soapjax.strategy.baselines.megatron_3d` with ``pp=2`` (1F1B, 4
  microbatches, tensor parallel over one stage's node axes);
* ``expert``: the zoo's ``moe`` (8 experts top-2, capacity dispatch) under the ``maxtext-moe``
  baseline (FSDP, the experts split over the node's axes: all-to-alls);
* ``context``: the zoo's ``llama`` at 8K tokens with soapjax's flash attention under
  `megatron_3d` with ``tp=4, cp=2`` (the sequence split: keys and values gathered).

(cases first, device counts inside, so that a run cut short has its first cases at every count)
the applied step (`soapjax.apply.step.sharded_train_step`, parameters and optimizer state donated)
is lowered from shapes alone and compiled for N devices, and its compiled HLO read: collectives
by kind, count and bytes per device (`soapjax.measure.hlo.collectives`, the parser `soapjax check`
reads XLA's collectives with; one inside a loop counted once per trip), which of them run
asynchronously (``-start``/``-done`` pairs, and ``async-start`` wrappers) and what the schedule
puts between start and done (GEMMs, other fusions, other collectives), and XLA's buffer
assignment (``compiled.memory_analysis()``: arguments, outputs, aliased, temporaries, peak).
Beside them, the simulator's prediction (`soapjax.simulate.front.simulate`, analytic costs, the
ideal resharding model: `soapjax.find_plan`'s defaults) of the same strategy on the same mesh of
H100s (``soapjax/topology/meshes/dgx-h100x8.toml``, ``dgx-h100x1024`` cut to N: ``node=N/8, data=2,
model=4``): its collective bytes per kind (counted as `soapjax.check` counts them), bytes sent, peak
memory per device, and the ratios predicted / XLA.

How N devices are had on one GPU (``--methods``, tried in order per device count by a probe
subprocess that compiles one sharded matmul, every method probed at the first count for the
record; the first that works compiles the cases, and a case that fails with it while setting up
devices, lowering or compiling is tried with the next that worked):

* ``topology``: a compile-only topology, ``jax.experimental.topologies.get_topology_desc(
  platform="cuda", topology="SxHxD", target_config=<the attached GPU's>)`` (the GPU plugin's
  topology options, as jax's tests/aot_test.py passes them): S slices (NVLink domains) of H hosts
  of D GPUs, here ``1x1x8`` and ``8x1x8``, eight GPUs a host as a DGX. The mesh is over those
  devices and ``.lower(...).compile()`` is ahead of time; from jax 0.10.2 on, jax hands such a
  compile to the attached GPU's real client (``compiler._get_cross_compile_backend``).
* ``mock``: the GPU client itself mocked, ``jax.config.update("jax_mock_gpu_topology",
  "SxHxD")`` before the backend starts (a ``Flag``: the ``JAX_MOCK_GPU_TOPOLOGY`` environment
  variable is not read, jax 0.10.2 and 0.11), with mock NCCL: ``jax.devices()`` are then N GPUs
  of N "processes", this one process 0. D must be the attached GPUs (1 here, with
  ``jax_cuda_visible_devices=0``), so the strings are ``1x8x1`` and ``8x8x1`` (eight one-GPU
  hosts to an NVLink slice). ``mock_num_gpu_processes=N`` (no ``jax_`` prefix) is the same
  without slices.
* ``deviceless``: the compile-only topology of ``topology`` in a process whose jax has no GPU
  backend (``JAX_PLATFORMS=cpu``; the plugin reads the GPU's target with a client of its own),
  so the compile-only client compiles it, as jax's ``test_deviceless_aot_compile`` does.
* ``cpu``: N virtual CPU devices (``--xla_force_host_platform_device_count=N``): XLA:CPU, the
  same code path with another compiler; what ``--quick`` uses.

Every probe and case runs in a subprocess with a deadline (``--budget-s``, default 300 s over
the whole run; a case gets at most ``--case-timeout-s``), so a compile that hangs costs its own
case; what a subprocess found is appended to a JSON-lines file as it goes (`gpu_kit.Parts`), so
a killed case keeps its prediction and the stage it reached. An error is recorded with its
case and the run goes on. ``OUT/mock-results.json`` and ``OUT/mock-section.md`` (a section for
docs/accuracy.md) are rewritten after every case, so a run cut short leaves what it had; each
compiled program's HLO text is kept as ``OUT/hlo-N-CASE.txt.gz``.

By default the GPU compiles run with ``--xla_gpu_autotune_level=0`` (no GEMM autotuning, to fit
the run in its budget; collectives and buffers are what is compared); ``--autotune`` keeps
XLA's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
CHILD_ENV = dict(os.environ)  # as given: the subprocesses see the accelerator
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# gpu_kit pins a process started without --worker to the CPU (this one only plans and reads
# results) and leaves a worker's platform alone; its Parts file, error line, buffer assignment
# and git version are reused here.
import gpu_kit  # noqa: E402
import jax  # noqa: E402
from _searched_row import strategy_words  # noqa: E402
from gpu_kit import Parts  # noqa: E402

from soapjax.apply import step as apply
from soapjax.check import simulated_collectives, simulated_sent_bytes  # noqa: E402
from soapjax.cost.operators import cost_model  # noqa: E402
from soapjax.graph.opgraph import trace  # noqa: E402
from soapjax.measure import hlo  # noqa: E402
from soapjax.simulate.front import opt_state_factor, simulate  # noqa: E402
from soapjax.strategy import baselines
from soapjax.strategy.space import MeshShape  # noqa: E402
from soapjax.topology.cluster import Topology, load_topology, make_mesh, stage_topology  # noqa: E402
from soapjax_zoo import gpt, llama, moe  # noqa: E402

METHODS = ("topology", "mock", "deviceless", "cpu")
COMPILERS = {"topology": "XLA:GPU (a compile-only topology)", "mock": "XLA:GPU (a mocked client)",
             "deviceless": "XLA:GPU (deviceless, a compile-only topology)",
             "cpu": "XLA:CPU (virtual devices)"}
GRACE_S = 30.0


def say(msg: str) -> None:
    print(f"[gpu_mock_compile {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the cases ----------------------------------------------------------------------------------


class ModelSpec(NamedTuple):
    """A zoo model at a size that compiles in seconds: a registry config with overrides; its
    batch is the larger of `batch` and N / `batch_per` devices (every data-parallel degree of
    the cases divides it)."""

    name: str
    config: str
    overrides: tuple[tuple[str, Any], ...]
    batch: int
    batch_per: int = 1


MODELS = {
    # GPT: 4 layers, d_model 1024, 16 heads, 1024 tokens, vocab 32768, bf16 over f32, no dropout
    # (a pipelined step draws no random bits); ~85M parameters
    "gpt": ModelSpec("gpt", "1.3b", (
        ("seq_len", 1024), ("vocab_size", 32768), ("num_layers", 4), ("num_heads", 16),
        ("d_model", 1024), ("dtype", "bfloat16"), ("dropout", 0.0)), 64),
    # Mixtral's layer at d_model 512: 2 layers, 8 experts top-2 of FFN 1024, 512 tokens
    "moe": ModelSpec("moe", "mixtral-8x7b", (
        ("seq_len", 512), ("vocab_size", 32768), ("num_layers", 2), ("num_heads", 8),
        ("num_kv_heads", 8), ("d_model", 512), ("expert_hidden", 1024)), 64),
    # Llama 3 8B's long-context form at d_model 512: 2 layers, 8K tokens, flash attention
    "llama": ModelSpec("llama", "8b-32k", (
        ("seq_len", 8192), ("vocab_size", 32768), ("num_layers", 2), ("num_heads", 8),
        ("num_kv_heads", 4), ("d_model", 512), ("mlp_hidden", 1536),
        ("attention_block", 1024)), 16, 8),
}
QUICK_MODELS = {  # tiny, float32: for the CPU test
    "gpt": ModelSpec("gpt", "tiny", (("seq_len", 16), ("vocab_size", 128), ("num_heads", 8),
                                     ("d_model", 64)), 16),
    "moe": ModelSpec("moe", "tiny", (), 8),
    "llama": ModelSpec("llama", "tiny-flash", (), 2, 8),
}


class Case(NamedTuple):
    name: str
    model: str
    what: str


CASES = (
    Case("fsdp", "gpt", "baseline fsdp (ZeRO-3 over every axis)"),
    Case("megatron-sp", "gpt", "baseline megatron-sp (TP over the node, sequence parallel, "
         "selective recompute)"),
    Case("pipeline", "gpt", "megatron_3d pp=2 (1F1B, 4 microbatches), TP over a stage's node"),
    Case("expert", "moe", "baseline maxtext-moe (FSDP, experts over the node's axes)"),
    Case("context", "llama", "megatron_3d tp=4 cp=2 (sequence split, flash attention)"),
)
CASE_NAMES = tuple(c.name for c in CASES)


_ZOO = {"gpt": (gpt.GPT_CONFIGS, gpt.build_gpt), "moe": (moe.MOE_CONFIGS, moe.build_moe),
        "llama": (llama.LLAMA_CONFIGS, llama.build_llama)}


def workload(case: Case, n: int, quick: bool):
    """The case's model at its size for `n` devices (`MODELS`, `QUICK_MODELS`)."""
    spec = (QUICK_MODELS if quick else MODELS)[case.model]
    table, build = _ZOO[spec.name]
    cfg = dataclasses.replace(table[spec.config], **dict(
        spec.overrides, batch_size=max(spec.batch, n // spec.batch_per)))
    return build(spec.name, f"{spec.config}-mock", cfg, "linen")


def sim_topology_name(n: int) -> str:
    """The shipped H100 cluster cut to `n` devices: one DGX (``data=2, model=4``) or part of
    one, else whole DGX nodes of the 1024-GPU cluster (``node=n/8, data=2, model=4``)."""
    if n == 8:
        return "dgx-h100x8"
    return f"dgx-h100x8-{n}" if n < 8 else f"dgx-h100x1024-{n}"


def strategy_for(case: Case, graph, topo: Topology, family: str | None):
    if case.name in ("fsdp", "megatron-sp"):
        return baselines.baselines(graph, topo, family)[case.name]
    if case.name == "expert":
        return baselines.baselines(graph, topo, family)["maxtext-moe"]
    if case.name == "pipeline":
        stage = stage_topology(topo, 2)
        tp = MeshShape.of(stage).degree(baselines.intra_node_axes(stage))
        dp = topo.num_devices // (2 * tp)
        return baselines.megatron_3d(graph, topo, tp=tp, pp=2,
                                     microbatch_size=graph.batch_size // dp // 4,
                                     recompute="none", sequence_parallel=tp > 1)
    if case.name == "context":
        return baselines.megatron_3d(graph, topo, tp=4, cp=2, recompute="none",
                                     sequence_parallel=True)
    raise ValueError(f"unknown case {case.name!r}")


# --- N devices on one GPU ------------------------------------------------------------------------


def topology_string(method: str, n: int) -> str:
    """``slices x hosts x devices`` (`jax_mock_gpu_topology`'s and the GPU plugin's
    ``topology=`` form). A compile-only topology takes DGX nodes as they are (8 GPUs a host, a
    host an NVLink slice); the mocked client needs D = the attached GPUs (1), so an NVLink
    slice there is 8 one-GPU hosts."""
    if method == "mock":
        return f"1x{n}x1" if n <= 8 else f"{n // 8}x8x1"
    if method == "cpu":
        return f"{n} CPU devices"
    return f"1x1x{n}" if n <= 8 else f"{n // 8}x1x8"


def setup_devices(method: str, n: int, notes: list[str]) -> list:
    """The N devices of `method` (module doc), in this worker process. ``mock`` must run before
    anything starts a backend."""
    if method == "mock":
        jax.config.update("jax_mock_gpu_topology", topology_string(method, n))
        jax.config.update("jax_cuda_visible_devices", "0")
        devices = jax.devices()
        if len(devices) != n or devices[0].platform == "cpu":
            raise RuntimeError(
                f"jax_mock_gpu_topology={topology_string(method, n)!r} gave "
                f"{len(devices)} {devices[0].platform} device(s), expected {n} mocked GPUs "
                f"(backend {jax.default_backend()}; the mock is an option of the GPU client)")
        return devices
    if method in ("topology", "deviceless"):
        from jax.experimental import topologies

        spec = topology_string(method, n)
        variants: list[dict[str, Any]] = []
        if method == "topology":
            try:  # the attached GPU's target, as jax's tests/aot_test.py passes it
                from jax._src.lib import xla_client as xc

                variants.append({"target_config": xc.get_topology_for_devices(
                    jax.devices()).target_config})
            except Exception as e:  # noqa: BLE001
                notes.append(f"no target_config from the attached devices: {gpu_kit._error(e)}")
        variants.append({})  # the plugin reads the GPU's target with a client of its own
        errors = []
        for extra in variants:
            for platform in ("cuda", "gpu"):
                try:
                    devices = list(topologies.get_topology_desc(
                        platform=platform, topology=spec, **extra).devices)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"platform={platform!r}{' with target_config' if extra else ''}"
                                  f": {gpu_kit._error(e)}")
                    continue
                if len(devices) != n:
                    raise RuntimeError(f"get_topology_desc(topology={spec!r}) gave "
                                       f"{len(devices)} devices, expected {n}")
                if errors:
                    notes.append("get_topology_desc failed first: " + "; ".join(errors))
                return devices
        raise RuntimeError("get_topology_desc failed: " + "; ".join(errors))
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise RuntimeError(f"{len(devices)} CPU devices, expected {n} (XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={n})")
    return devices[:n]


def device_record(devices: list) -> dict:
    import jaxlib

    d = devices[0]
    client = getattr(d, "client", None)
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(), "platform": d.platform,
            "device_kind": getattr(d, "device_kind", "?"), "devices": len(devices),
            "processes": len({getattr(x, "process_index", 0) for x in devices}),
            "runtime": getattr(client, "runtime_type", None),
            "attached": [f"{x.platform}:{getattr(x, 'device_kind', '?')}"
                         for x in jax.local_devices()[:2]]}


def mesh_for(topo: Topology, devices: list):
    """`soapjax.topology.cluster.make_mesh` of `topo` over `devices` (taken for the topology's GPUs
    whatever their platform: the simulator's mesh, XLA's devices)."""
    platform = "gpu" if devices[0].platform in ("cuda", "rocm", "gpu") else devices[0].platform
    if platform != topo.platform:
        topo = dataclasses.replace(topo, platform=platform)
    return make_mesh(topo, devices)


# --- what the compiled program holds -------------------------------------------------------------


def _norm(kind: str) -> str:
    return kind.replace("-", "_")


def xla_collectives(text: str, mesh: MeshShape) -> list:
    """`soapjax.measure.hlo.collectives` as `soapjax check` reads them (an all-reduce only sliced
    counted as the reduce-scatter XLA:GPU makes of it)."""
    return hlo.collectives(text, mesh, reduce_scatter_from_slices=True)


def tally(items) -> dict[str, dict[str, float]]:
    """``(kind, bytes, times)`` items -> per kind (``all_gather``), count and bytes."""
    out: dict[str, dict[str, float]] = {}
    for kind, nbytes, times in items:
        row = out.setdefault(_norm(kind), {"count": 0, "bytes": 0.0})
        row["count"] += times
        row["bytes"] += float(nbytes) * times
    return dict(sorted(out.items()))


def predicted_items(sim) -> list[tuple[str, float, int]]:
    """The simulator's communication tasks as ``(kind, bytes, times)``, counted as
    `soapjax.check.compare_on_devices` counts them (`soapjax.check.simulated_collectives`)."""
    return simulated_collectives(sim)


_COMPUTE = {"fusion", "custom-call", "dot", "convolution", "call", "while", "conditional"}


def _is_gemm(inst) -> bool:
    """A dot, a convolution, a cuBLAS call or a GEMM fusion (Triton's, cuBLAS's)."""
    if inst.opcode in ("dot", "convolution"):
        return True
    attrs = re.sub(r"metadata=\{[^}]*\}", "", inst.attrs).lower()  # not the op's JAX name
    return inst.opcode in ("custom-call", "fusion") and ("gemm" in attrs or "matmul" in attrs
                                                         or "cublas" in attrs)


def async_collectives(text: str, found: list) -> dict[str, Any]:
    """Which collectives of compiled HLO run asynchronously and what the schedule puts
    between each start and its done.

    A pair is an ``X-start`` of a collective kind and the ``X-done`` that takes it, or an
    ``async-start`` whose called computation holds a collective and its ``async-done``
    (XLA:GPU's wrapper for reduce-scatter and all-to-all). Between them, in the order the
    scheduled module lists its instructions: GEMMs (dots, convolutions, cuBLAS calls, GEMM
    fusions), other fusions and calls (compute), and other collectives started. Counts are per
    run of the program (a pair inside a loop, once per trip: `found`'s ``executions``).

    Returns per kind (``all_gather``): ``pairs``, ``overlapped`` (pairs with compute between),
    ``bytes`` and ``overlapped_bytes``, and ``gemms``, ``compute``, ``collectives`` between
    (summed over pairs); ``unmatched`` / ``unmatched_bytes``, starts whose done does not take
    them later in their computation (XLA's collective pipeliner: started in one loop trip,
    done in the next, through the loop's carry); ``sync`` / ``sync_bytes``, the kind's
    collectives run blocking; and ``"pairs"``: the first 40 pairs one by one.
    """
    module = hlo.parse_module(text)
    by_name = {c.name: c for c in found}
    kinds: dict[str, dict[str, float]] = {}
    pairs: list[dict[str, Any]] = []
    seen: set[str] = set()
    for comp in module.computations.values():
        for i, inst in enumerate(comp):
            coll = _started(inst, module, by_name)
            if coll is None:
                continue
            done = next((j for j in range(i + 1, len(comp))
                         if comp[j].opcode.endswith("-done") and inst.name in comp[j].operands),
                        None)
            seen.add(coll.name)
            k, runs = _norm(coll.kind), coll.executions
            row = kinds.setdefault(k, _empty_row())
            if done is None:  # its done takes it through a loop's carry: pipelined
                row["unmatched"] += runs
                row["unmatched_bytes"] += coll.nbytes * runs
                continue
            between = comp[i + 1:done]
            gemms = sum(1 for b in between if _is_gemm(b))
            compute = sum(1 for b in between if b.opcode in _COMPUTE)
            others = sum(1 for b in between if _started(b, module, by_name) is not None)
            row["pairs"] += runs
            row["bytes"] += coll.nbytes * runs
            row["gemms"] += gemms * runs
            row["compute"] += compute * runs
            row["collectives"] += others * runs
            if compute:
                row["overlapped"] += runs
                row["overlapped_bytes"] += coll.nbytes * runs
            if len(pairs) < 40:
                pairs.append({"kind": k, "name": inst.name, "bytes": coll.nbytes,
                              "executions": runs, "between": len(between), "gemms": gemms,
                              "compute": compute, "collectives": others})
    for c in found:
        if c.name not in seen:
            row = kinds.setdefault(_norm(c.kind), _empty_row())
            row["sync"] += c.executions
            row["sync_bytes"] += c.nbytes * c.executions
    return {"kinds": dict(sorted(kinds.items())), "pairs": pairs}


def _empty_row() -> dict[str, float]:
    return dict.fromkeys(("pairs", "overlapped", "bytes", "overlapped_bytes", "gemms", "compute",
                          "collectives", "unmatched", "unmatched_bytes", "sync", "sync_bytes"),
                         0)


def _started(inst, module, by_name: dict):
    """The collective an async start instruction starts (an `HloCollective` of `by_name`),
    else None."""
    if inst.opcode == "async-start":
        for callee in hlo.callees(inst).get("calls", []):
            for inner in module.computations.get(callee, []):
                if inner.name in by_name:
                    return by_name[inner.name]
        return None
    if inst.opcode.endswith("-start") and inst.opcode[:-6] in hlo.KINDS:
        return by_name.get(inst.name)
    return None


# --- the worker subprocesses ---------------------------------------------------------------------


def probe_worker(args: argparse.Namespace, parts: Parts) -> None:
    """One sharded matmul compiled for N devices of the method: does the method work here?"""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    notes: list[str] = []
    t0 = time.perf_counter()
    devices = setup_devices(args.method, args.devices, notes)
    parts.emit("devices", setup_s=time.perf_counter() - t0, notes=notes,
               topology_string=topology_string(args.method, args.devices),
               **device_record(devices))
    mesh = jax.sharding.Mesh(devices, ("x",))
    x = jax.ShapeDtypeStruct((8 * args.devices, 256), jnp.float32,
                             sharding=NamedSharding(mesh, P("x", None)))
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    t0 = time.perf_counter()
    compiled = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=0),
                       out_shardings=NamedSharding(mesh, P())).lower(x, w).compile()
    found = xla_collectives(compiled.as_text(), MeshShape(("x",), (args.devices,)))
    parts.emit("probe", compile_s=time.perf_counter() - t0,
               collectives=tally((c.kind, c.nbytes, c.executions) for c in found),
               memory=gpu_kit._buffer_assignment(compiled))
    say(f"probe {args.method} x{args.devices}: compiled; "
        f"{', '.join(sorted({c.kind for c in found})) or 'no collectives'}")


# A case's stages, each announced by a ``stage`` record, so a failed case says which it had
# reached: devices (first for the mock), planning, simulating, devices, lowering, compiling.
# Planning and simulating are the same whatever the devices: another method will not mend them.
METHOD_FREE = ("planning", "simulating")


def case_worker(args: argparse.Namespace, parts: Parts) -> None:
    """One case: traced, its strategy simulated, the applied step compiled for N devices."""
    case = next(c for c in CASES if c.name == args.case)
    n = args.devices
    notes: list[str] = []

    def devices_now() -> list:
        parts.emit("stage", stage="devices")
        t0 = time.perf_counter()
        devices = setup_devices(args.method, n, notes)
        parts.emit("devices", setup_s=time.perf_counter() - t0, notes=list(notes),
                   topology_string=topology_string(args.method, n), **device_record(devices))
        return devices

    if args.method == "mock":  # before anything can start a backend
        devices = devices_now()
    parts.emit("stage", stage="planning")
    w = workload(case, n, args.quick)
    params, batch = w.abstract_params(), w.abstract_batch()
    t0 = time.perf_counter()
    graph = trace(w.loss_fn, params, batch, name=w.name)
    topo = load_topology(sim_topology_name(n))
    mesh_shape = MeshShape.of(topo)
    strategy = strategy_for(case, graph, topo, w.family)
    parts.emit("case", model=w.name, model_description=w.description,
               batch_size=w.batch_size, operators=len(graph.operators), topology=topo.name,
               mesh={a: topo.mesh_shape[a] for a in topo.axis_names},
               strategy=strategy_words(strategy, topo), trace_s=time.perf_counter() - t0)
    parts.emit("stage", stage="simulating")
    t0 = time.perf_counter()
    sim = simulate(graph, topo, strategy,
                   cost_model=cost_model(graph, topo, mode="analytic", optimizer=w.optimizer),
                   opt_state_factor=opt_state_factor(w.optimizer, params))
    items = predicted_items(sim)
    parts.emit("predicted", simulate_s=time.perf_counter() - t0, step_time_s=sim.step_time_s,
               compute_s=sim.compute_s, exposed_comm_s=sim.exposed_comm_s,
               peak_bytes=max(sim.peak_memory_bytes), memory=sim.memory._asdict(),
               fits=sim.fits_in_memory, collectives=tally(items),
               bytes=sum(b * k for _, b, k in items),
               sent_bytes=simulated_sent_bytes(sim),
               pipelined=sim.pipeline is not None)
    say(f"{case.name} x{n}: predicted {sim.step_time_s * 1e3:.2f} ms, peak "
        f"{max(sim.peak_memory_bytes) / 1e9:.3g} GB")
    if args.method != "mock":
        devices = devices_now()
    parts.emit("stage", stage="lowering")
    mesh = mesh_for(topo, devices)
    options = ({"xla_backend_optimization_level": 0} if args.method == "cpu" and args.quick
               else None)  # XLA:CPU's codegen, faster; the same HLO passes
    step, sh = apply.sharded_train_step(graph, strategy, mesh, w.optimizer, params=params,
                                        batch=batch, mesh_shape=mesh_shape, donate=True,
                                        compiler_options=options)

    def placed(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, shardings)

    opt_state = jax.eval_shape(w.optimizer.init, params)
    t0 = time.perf_counter()
    # (an interleaved pipeline keeps its stacked layers in chunk order: the step's layout)
    lowered = step.lower(placed(apply.step_layout(params, sh.params), sh.params),
                         placed(apply.step_layout(opt_state, sh.opt_state), sh.opt_state),
                         placed(batch, sh.batch))
    lower_s = time.perf_counter() - t0
    parts.emit("lowered", lower_s=lower_s, partitioner=step.partitioner)
    parts.emit("stage", stage="compiling")
    say(f"{case.name} x{n}: lowered in {lower_s:.1f} s ({step.partitioner}); compiling")
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    hlo_file = Path(args.parts).parent / f"hlo-{n}-{case.name}.txt.gz"
    with gzip.open(hlo_file, "wt") as f:
        f.write(text)
    found = xla_collectives(text, mesh_shape)
    memory = gpu_kit._buffer_assignment(compiled)
    if not memory:  # gpu_kit's reader says nothing of why
        try:
            notes.append(f"memory_analysis() gave {compiled.memory_analysis()!r}")
        except Exception as e:  # noqa: BLE001
            notes.append(f"memory_analysis() failed: {gpu_kit._error(e)}")
    else:
        memory["xla_total_bytes"] = (memory["xla_argument_bytes"] + memory["xla_output_bytes"]
                                     - memory["xla_alias_bytes"] + memory["xla_temp_bytes"])
    parts.emit("compiled", compile_s=compile_s, hlo_file=hlo_file.name, hlo_chars=len(text),
               collectives=tally((c.kind, c.nbytes, c.executions) for c in found),
               bytes=sum(c.nbytes * c.executions for c in found),
               sent_bytes=sum(c.sent * c.executions for c in found),
               unplaced=sum(1 for c in found if c.axes is None),
               asynchronous=async_collectives(text, found), memory=memory, notes=notes)
    say(f"{case.name} x{n}: compiled in {compile_s:.1f} s, {len(found)} collectives")


def run_worker(what: list[str], parts: Parts, *, method: str, devices: int, quick: bool,
               timeout: float, autotune: bool) -> str | None:
    """Runs this script with ``--worker ...`` in the environment of `method`, until it ends or
    `timeout`; None, or why it failed."""
    parts.path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *what,
           "--method", method, "--devices", str(devices), "--parts", str(parts.path)]
    if quick:
        cmd.append("--quick")
    env = dict(CHILD_ENV, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), CHILD_ENV.get("PYTHONPATH"))
                                          if p))
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if method == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    elif method == "deviceless":  # no GPU backend: jax compiles with the compile-only client
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # compiles only
        if env.get("JAX_PLATFORMS") == "cpu":
            env.pop("JAX_PLATFORMS")
        if not autotune and not any(f.startswith("--xla_gpu_autotune_level") for f in flags):
            flags.append("--xla_gpu_autotune_level=0")
    env["XLA_FLAGS"] = " ".join(flags)
    try:
        rc = subprocess.run(cmd, env=env, timeout=max(5.0, timeout)).returncode
    except subprocess.TimeoutExpired:
        return f"killed after {timeout:.0f} s (its deadline)"
    return None if rc == 0 else f"exit status {rc}"


def _worker_main(args: argparse.Namespace) -> None:
    parts = Parts(Path(args.parts))
    try:
        {"probe": probe_worker, "case": case_worker}[args.worker](args, parts)
    except Exception as e:  # said in the parts file, for the report
        parts.emit("error", error=gpu_kit._error(e),
                   traceback=traceback.format_exc()[-3000:])
        raise


# --- the run -------------------------------------------------------------------------------------


def _ratio(pred: float | None, xla: float | None) -> float | None:
    if pred is None or xla is None or not xla:
        return None
    return pred / xla


def case_row(case: Case, n: int, records: list[dict], method: str) -> dict:
    """One case's records (a subprocess's Parts file) as a results row."""
    row: dict[str, Any] = {"case": case.name, "devices": n, "model": case.model,
                           "what": case.what, "method": method, "compiled": False}
    for r in records:
        kind = r.pop("type")
        if kind == "case":
            row.update(r)
        elif kind in ("predicted", "lowered"):
            row[kind] = r
        elif kind == "devices":
            row["device"] = r
        elif kind == "stage":
            row["stage"] = r["stage"]
        elif kind == "compiled":
            row["xla"] = r
            row["compiled"] = True
        elif kind == "error":
            row["error"] = r["error"]
            row["traceback"] = r.get("traceback")
    pred, xla = row.get("predicted"), row.get("xla")
    if pred and xla:
        kinds = sorted(set(pred["collectives"]) | set(xla["collectives"]))
        mem = xla.get("memory") or {}
        row["ratios"] = {
            "bytes": _ratio(pred["bytes"], xla["bytes"]),
            "sent_bytes": _ratio(pred["sent_bytes"], xla["sent_bytes"]),
            "by_kind": {k: _ratio(pred["collectives"].get(k, {}).get("bytes", 0.0),
                                  xla["collectives"].get(k, {}).get("bytes"))
                        for k in kinds},
            "peak_memory": _ratio(pred["peak_bytes"], mem.get("xla_total_bytes")),
            "peak_memory_xla_peak": _ratio(pred["peak_bytes"], mem.get("xla_peak_bytes")),
        }
    return row


def probe(method: str, n: int, out: Path, args: argparse.Namespace, end: float) -> dict:
    parts = Parts(out / f"probe-{n}-{method}.jsonl")
    timeout = min(args.probe_timeout_s, end + GRACE_S - time.time())
    say(f"probe: {method} for {n} devices ({topology_string(method, n)}; up to {timeout:.0f} s)")
    failed = run_worker(["probe"], parts, method=method, devices=n, quick=args.quick,
                        timeout=timeout, autotune=args.autotune)
    rec: dict[str, Any] = {"devices": n, "method": method,
                           "topology_string": topology_string(method, n)}
    for r in parts.read():
        kind = r.pop("type")
        if kind == "error":
            rec["error"] = r["error"]
        else:
            rec.update(r)
    rec["ok"] = "compile_s" in rec and not failed
    if not rec["ok"]:
        rec["error"] = "; ".join(x for x in (rec.get("error"), failed) if x) or "no result"
    say(f"probe {method} x{n}: " + ("works" if rec["ok"] else f"FAILED {rec['error'][:300]}"))
    return rec


def run_case(case: Case, n: int, methods: list[str], out: Path, args: argparse.Namespace,
             end: float) -> dict:
    """The case with the first working method, then the next where it failed to compile."""
    attempts = []
    row: dict[str, Any] = {}
    for method in methods:
        left = end - time.time()
        if attempts and left < (10 if args.quick else 45):
            break
        timeout = min(args.case_timeout_s, left + GRACE_S)
        parts = Parts(out / f"case-{n}-{case.name}.jsonl")
        say(f"case {case.name} x{n} by {method} (up to {timeout:.0f} s): {case.what}")
        failed = run_worker(["case", "--case", case.name], parts, method=method, devices=n,
                            quick=args.quick, timeout=timeout, autotune=args.autotune)
        row = case_row(case, n, parts.read(), method)
        if failed and not row.get("error"):
            row["error"] = failed
        elif failed:
            row["error"] += f" ({failed})"
        attempts.append({"method": method, "compiled": row["compiled"],
                         "error": row.get("error"), "stage": row.get("stage")})
        if row["compiled"]:
            row.pop("stage", None)
            break
        stage = row.pop("stage", "starting")
        row["failed_at"] = stage
        say(f"case {case.name} x{n} by {method}: FAILED while {stage}: "
            f"{(row.get('error') or '?')[:300]}")
        if stage in METHOD_FREE:  # not the method's doing: another will not help
            break
    row["attempts"] = attempts
    if row.get("compiled"):
        x, r = row["xla"], row.get("ratios") or {}
        say(f"case {case.name} x{n}: XLA {x['bytes'] / 1e6:.4g} MB of collectives, predicted "
            f"{row['predicted']['bytes'] / 1e6:.4g} MB (ratio {_fmt(r.get('bytes'))}); peak "
            f"memory predicted / XLA {_fmt(r.get('peak_memory'))}")
    return row


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}g}"


def _mb(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e9:.3g} GB" if x >= 1e9 else f"{x / 1e6:.3g} MB"


def render(results: dict) -> str:
    """The markdown section for docs/accuracy.md."""
    meta, probes, rows = results["meta"], results["probes"], results["cases"]
    head = next((p for p in probes if p.get("ok")), {})
    used = sorted({r["method"] for r in rows if r.get("compiled")}, key=METHODS.index)
    compilers = ", ".join(COMPILERS[m] for m in used) or "nothing (every case failed)"
    lines = [f"## Applied steps compiled for {' and '.join(map(str, meta['devices']))} devices "
             f"by {compilers}, against the simulator, {meta['date']}", "",
             f"Made by `{meta['command']}` in {meta.get('elapsed_s', 0):.0f} s (budget "
             f"{meta['budget_s']:.0f} s) at {meta.get('git') or '?'}: jax "
             f"{head.get('jax', '?')} ({head.get('backend', '?')}, attached "
             f"{', '.join(head.get('attached', [])) or '?'}); XLA flags for the GPU compiles: "
             f"{meta['gpu_xla_flags'] or 'none'}. Each applied step "
             "(`soapjax.apply.step.sharded_train_step`, parameters and optimizer state donated) is "
             "compiled from shapes for N devices; collectives are read by `soapjax.measure.hlo` as "
             "`soapjax check` reads them (bytes per device, a loop's counted per trip), memory "
             "is XLA's buffer assignment (`compiled.memory_analysis()`: arguments + outputs - "
             "aliased + temporaries, XLA:GPU's temporaries being one allocation; its own peak "
             "in the memory table where given). Predicted: "
             "`soapjax.simulate.front.simulate` of the same strategy (analytic costs, ideal "
             "resharding) on the H100 topology of N devices (`dgx-h100x8`, `dgx-h100x1024-N`).",
             "", "How N devices were had on one device:", ""]
    for p in probes:
        lines.append(f"- {p['method']} `{p['topology_string']}` x{p['devices']}: "
                     + ("works" + (f" ({p.get('device_kind')}, {p.get('runtime') or 'client'})"
                                   if p.get("device_kind") else "")
                        if p.get("ok") else f"failed: {(p.get('error') or '?')[:300]}"))
    lines += ["", "| N | case | model | strategy | compiled by | compile | XLA collectives "
              "(bytes/device) | predicted | pred / XLA | sent pred / XLA | async pairs "
              "(with compute inside) | XLA memory | predicted peak | pred / XLA |",
              "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = (f"| {r['devices']} | {r['case']} | {r['model']} (batch {r.get('batch_size', '-')})"
                f" | {r['what']} | {r['method']} |")
        pred = r.get("predicted") or {}
        if not r.get("compiled"):
            err = (r.get("error") or "?").replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"{head} failed ({r.get('failed_at', '?')}): {err} | - | "
                         f"{_mb(pred.get('bytes'))} | - | - | - | - | "
                         f"{_mb(pred.get('peak_bytes'))} | - |")
            continue
        x, ratios = r["xla"], r.get("ratios") or {}
        mem = x.get("memory") or {}
        kinds = x["asynchronous"]["kinds"]
        pairs = sum(v["pairs"] for v in kinds.values())
        overlapped = sum(v["overlapped"] for v in kinds.values())
        pipelined = sum(v["unmatched"] for v in kinds.values())
        across = f" (+{pipelined:.0f} across loop trips)" if pipelined else ""
        lines.append(f"{head} {x['compile_s']:.1f} s | {_mb(x['bytes'])} | "
                     f"{_mb(pred.get('bytes'))} | {_fmt(ratios.get('bytes'))} | "
                     f"{_fmt(ratios.get('sent_bytes'))} | {overlapped:.0f} / {pairs:.0f}{across} | "
                     f"{_mb(mem.get('xla_total_bytes'))} | "
                     f"{_mb(pred.get('peak_bytes'))} | {_fmt(ratios.get('peak_memory'))} |")
    compiled = [r for r in rows if r.get("compiled")]
    if compiled:
        lines += ["", "By kind (count / bytes per device; async: pairs with compute between "
                  "start and done / all pairs, (+ those started in one loop trip and done in "
                  "the next), and the GEMMs scheduled inside them):", "",
                  "| N | case | kind | XLA count | XLA bytes | predicted count | predicted bytes "
                  "| pred / XLA | async | GEMMs inside |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in compiled:
            xc, pc = r["xla"]["collectives"], r["predicted"]["collectives"]
            kinds = r["xla"]["asynchronous"]["kinds"]
            for k in sorted(set(xc) | set(pc)):
                a = kinds.get(k, {})
                across = f" (+{a['unmatched']:.0f})" if a.get("unmatched") else ""
                lines.append(
                    f"| {r['devices']} | {r['case']} | {k} | {xc.get(k, {}).get('count', 0):.0f}"
                    f" | {_mb(xc.get(k, {}).get('bytes', 0.0))} | "
                    f"{pc.get(k, {}).get('count', 0):.0f} | "
                    f"{_mb(pc.get(k, {}).get('bytes', 0.0))} | "
                    f"{_fmt(r['ratios']['by_kind'].get(k))} | "
                    f"{a.get('overlapped', 0):.0f} / {a.get('pairs', 0):.0f}{across} | "
                    f"{a.get('gemms', 0):.0f} |")
        lines += ["", "Memory per device (XLA's buffer assignment against the simulator's "
                  "peak and what it holds):", "",
                  "| N | case | XLA arguments | outputs | aliased | temporaries | XLA total | "
                  "XLA's peak | predicted: params | grads | optimizer | activations | comm "
                  "buffers | peak |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in compiled:
            m, p = r["xla"].get("memory") or {}, r["predicted"]["memory"]
            lines.append(f"| {r['devices']} | {r['case']} | {_mb(m.get('xla_argument_bytes'))} "
                         f"| {_mb(m.get('xla_output_bytes'))} | {_mb(m.get('xla_alias_bytes'))}"
                         f" | {_mb(m.get('xla_temp_bytes'))} | "
                         f"{_mb(m.get('xla_total_bytes'))} | {_mb(m.get('xla_peak_bytes'))} | "
                         f"{_mb(p['params'])} | {_mb(p['grads'])} | {_mb(p['opt_state'])} | "
                         f"{_mb(p['activations'])} | {_mb(p['comm_buffers'])} | "
                         f"{_mb(r['predicted']['peak_bytes'])} |")
    notes = list(results["notes"]) + [f"left out: {s}" for s in results["skipped"]]
    if not meta["quick"] and any(r.get("compiled") and r["method"] == "cpu" for r in rows):
        notes.append("XLA:CPU runs bfloat16 collectives in float32 (its reducers "
                     "`*_promoted`, operands converted), so its bytes of the bfloat16 models "
                     "are up to twice XLA:GPU's")
    if any((r.get("predicted") or {}).get("pipelined") for r in rows):
        notes.append("pipeline: the simulator's communication tasks are one stage's work "
                     "(`soapjax.simulate.front.simulate`), its stage-to-stage sends priced apart; "
                     "XLA's program holds every stage's")
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def summary_table(results: dict) -> str:
    lines = [f"{'N':>3} {'case':<12} {'method':<9} {'compile':>8} {'XLA coll':>10} "
             f"{'predicted':>10} {'ratio':>6} {'async':>9} {'XLA mem':>9} {'pred mem':>9} "
             f"{'ratio':>6}"]
    for r in results["cases"]:
        if not r.get("compiled"):
            lines.append(f"{r['devices']:>3} {r['case']:<12} {r['method']:<9} FAILED "
                         f"({r.get('failed_at', '?')}): {(r.get('error') or '?')[:80]}")
            continue
        x, p, q = r["xla"], r["predicted"], r.get("ratios") or {}
        kinds = x["asynchronous"]["kinds"]
        mem = x.get("memory") or {}
        lines.append(
            f"{r['devices']:>3} {r['case']:<12} {r['method']:<9} {x['compile_s']:>7.1f}s "
            f"{_mb(x['bytes']):>10} {_mb(p['bytes']):>10} {_fmt(q.get('bytes')):>6} "
            f"{sum(v['overlapped'] for v in kinds.values()):>4.0f}/"
            f"{sum(v['pairs'] for v in kinds.values()):<4.0f} "
            f"{_mb(mem.get('xla_total_bytes')):>9} "
            f"{_mb(p['peak_bytes']):>9} {_fmt(q.get('peak_memory')):>6}")
    return "\n".join(lines)


def write(results: dict, out: Path, start: float) -> None:
    results["meta"]["elapsed_s"] = time.time() - start
    (out / "mock-results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "mock-section.md").write_text(render(results))


def run(args: argparse.Namespace) -> dict:
    start = time.time()
    end = start + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = [int(x) for x in args.devices.split(",") if x.strip()]
    cases = [c for c in CASES if c.name in args.cases.split(",")]
    methods = args.methods.split(",") if args.methods else (
        ["cpu"] if args.quick else ["topology", "mock", "deviceless"])
    gpu_flags = [] if args.autotune else ["--xla_gpu_autotune_level=0"]
    results: dict[str, Any] = {
        "meta": {"date": datetime.date.today().isoformat(),
                 "command": ("python3 scripts/gpu_mock_compile.py "
                             + " ".join(sys.argv[1:])).strip(),
                 "budget_s": args.budget_s, "quick": args.quick, "git": gpu_kit._git(),
                 "planner_jax": jax.__version__, "devices": counts, "methods": methods,
                 "cases": [c.name for c in cases],
                 "gpu_xla_flags": " ".join(gpu_flags),
                 "models": {k: {"zoo": v.name, "config": v.config,
                                "overrides": dict(v.overrides)}
                            for k, v in (QUICK_MODELS if args.quick else MODELS).items()}},
        "probes": [], "cases": [], "skipped": [], "notes": []}
    say(f"{len(cases)} cases x {counts} devices by {methods}; budget {args.budget_s:.0f} s; "
        f"out {out}")
    working: dict[int, list[str]] = {}
    for n in counts:  # which methods give N devices here: every one at the first N (for the
        working[n] = []  # record), after that until one works
        for method in methods:
            if end - time.time() < (5 if args.quick else 20) or (working[n] and n != counts[0]):
                break
            rec = probe(method, n, out, args, end)
            results["probes"].append(rec)
            if rec["ok"]:
                working[n].append(method)
            write(results, out, start)
        if not working[n]:
            results["notes"].append(f"{n} devices: no method compiled the probe; its cases "
                                    "left out")
    for case in cases:  # case-major: a budget cut short still has each early case at every N
        for n in counts:
            if not working[n]:
                results["skipped"].append(f"{case.name} x{n} (no method)")
                continue
            if end - time.time() < (5 if args.quick else 30):
                results["skipped"].append(f"{case.name} x{n} (budget spent)")
                say(f"budget spent: {case.name} x{n} left out")
                continue
            try:
                row = run_case(case, n, working[n], out, args, end)
            except Exception as e:  # the run goes on
                traceback.print_exc()
                row = {"case": case.name, "devices": n, "model": case.model, "what": case.what,
                       "method": working[n][0], "compiled": False,
                       "error": gpu_kit._error(e)}
            results["cases"].append(row)
            write(results, out, start)
    write(results, out, start)
    say(f"done in {time.time() - start:.0f} s: {out / 'mock-results.json'}, "
        f"{out / 'mock-section.md'}")
    print(summary_table(results), flush=True)
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_mock_out", help="output folder (default gpu_mock_out/)")
    p.add_argument("--devices", default="8,64",
                   help="comma-separated device counts (default 8,64)")
    p.add_argument("--quick", action="store_true",
                   help="tiny models on N virtual CPU devices (the CPU test)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="no probe or case starts past this many seconds (default 300)")
    p.add_argument("--case-timeout-s", type=float, default=150.0,
                   help="a case's subprocess is killed after this (default 150)")
    p.add_argument("--probe-timeout-s", type=float, default=90.0,
                   help="a probe's subprocess is killed after this (default 90)")
    p.add_argument("--cases", default=",".join(CASE_NAMES),
                   help=f"comma-separated, of {', '.join(CASE_NAMES)} (default all)")
    p.add_argument("--methods", default=None,
                   help="comma-separated, tried in order, of topology, mock, deviceless, cpu "
                        "(default topology,mock,deviceless; --quick: cpu)")
    p.add_argument("--autotune", action="store_true",
                   help="keep XLA:GPU's GEMM autotuning (default: --xla_gpu_autotune_level=0)")
    p.add_argument("--worker", choices=("probe", "case"), help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--parts", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.devices = int(args.devices)
        _worker_main(args)
        return {}
    bad = [c for c in args.cases.split(",") if c not in CASE_NAMES]
    bad += [m for m in (args.methods or "").split(",") if m and m not in METHODS]
    if bad:
        p.error(f"unknown case or method {bad}; cases: {', '.join(CASE_NAMES)}; methods: "
                f"{', '.join(METHODS)}")
    return run(args)


if __name__ == "__main__":
    main()
