"""soapjax.measure.stepprofile: a real step profiled on the CPU, its kernels classified from its
HLO."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import XLA_DEFAULT_EMITTERS

import soapjax_zoo as zoo
from soapjax.measure import stepprofile as sp


@pytest.fixture(scope="module")
def gpt2_step():
    w = zoo.get("gpt2", "tiny")
    params = jax.jit(w.init_params)(jax.random.key(0))
    opt_state = jax.jit(w.optimizer.init)(params)
    batch = w.make_batch(jax.random.key(1))
    compiled = jax.jit(w.train_step(), donate_argnums=(0, 1)).lower(
        params, opt_state, batch).compile(XLA_DEFAULT_EMITTERS)  # XLA:CPU's own kernels
    params, opt_state, _ = jax.block_until_ready(compiled(params, opt_state, batch))
    return compiled, (params, opt_state, batch)


def test_a_profiled_step_accounts_for_every_kernel_of_its_module(gpt2_step, tmp_path):
    compiled, args = gpt2_step
    path, walls = sp.profile_calls(compiled, args, calls=2, log_dir=tmp_path,
                                   advance=lambda out, a: (out[0], out[1], a[2]))
    assert len(walls) == 2 and all(w > 0 for w in walls)
    events = sp.trace_kernels(path)
    classes = sp.classify(compiled.as_text())
    prof = sp.summarize(events, classes, 2, walls)
    # every event ran an instruction of the step's module, every instruction ran once a call
    assert prof.unmatched == 0 and {e.hlo_op for e in events} <= set(classes)
    assert prof.kernels == len(classes)
    assert sum(n for _, n in prof.classes.values()) == pytest.approx(prof.kernels)
    assert sum(s for s, _ in prof.classes.values()) == pytest.approx(prof.kernels_s)
    assert 0 < prof.busy_s <= prof.kernels_s + 1e-12
    assert {"gemm", "reduction", "elementwise"} <= set(prof.classes)
    # GPT-2 tiny: 2 blocks of 4 projections and 2 MLP matmuls, their backwards, the head
    assert prof.classes["gemm"][1] >= 3 * (2 * 6 + 1)
    assert "layers_0/mlp/fc1" in prof.sources and "layers_0/mlp/fc1 (backward)" in prof.sources
    assert "(update)" in prof.sources
    # the optimizer's update kernels, class by class, add up to the "(update)" source
    update = prof.update_classes
    assert sum(n for _, n in update.values()) == pytest.approx(prof.sources["(update)"][1])
    assert sum(t for t, _ in update.values()) == pytest.approx(prof.sources["(update)"][0])
    json.dumps(prof.as_dict())


def test_instructions_are_classified_by_what_their_fusion_holds():
    def f(x, w):
        y = jnp.tanh(x @ w)  # a GEMM, an elementwise fusion
        return jax.nn.softmax(y, axis=-1).T.copy()  # reductions, a transpose

    text = jax.jit(f).lower(jnp.ones((64, 32)), jnp.ones((32, 16))).compile().as_text()
    kinds = sorted(c.kind for c in sp.classify(text).values())
    assert "gemm" in kinds and "reduction" in kinds, kinds
    assert set(kinds) <= set(sp.KERNEL_CLASSES)


def test_a_gpu_trace_counts_its_streams_not_the_lines_derived_from_them(tmp_path):
    # The Chrome trace format XLA's profiler writes for a GPU: a device process with a
    # stream line and an "XLA Ops" line that repeats each kernel; host threads beside it.
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name",
         "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 0.0, "dur": 10.0, "name": "sm90_gemm",
         "args": {"hlo_op": "d"}},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 15.0, "dur": 5.0, "name": "input_reduce_fusion",
         "args": {"hlo_op": "s"}},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 25.0, "dur": 1.0, "name": "Memcpy DtoD"},
        {"ph": "X", "pid": 1, "tid": 9, "ts": 0.0, "dur": 10.0, "name": "d",
         "args": {"hlo_op": "d"}},
        {"ph": "X", "pid": 2, "tid": 3, "ts": 0.0, "dur": 30.0, "name": "Thunk",
         "args": {"hlo_op": "d"}},
    ]
    path = tmp_path / "gpu.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = sp.trace_kernels(path)
    assert [e.name for e in got] == ["sm90_gemm", "input_reduce_fusion", "Memcpy DtoD"]
    classes = {"d": sp.Instruction("gemm", "dot", "mlp"),
               "s": sp.Instruction("reduction", "fusion", "mlp (backward)")}
    prof = sp.summarize(got, classes, 1, [40e-6])
    assert prof.classes == {"gemm": (pytest.approx(10e-6), 1),
                            "reduction": (pytest.approx(5e-6), 1),
                            "copy": (pytest.approx(1e-6), 1)}
    assert prof.busy_s == pytest.approx(16e-6) and prof.unmatched == 0


def test_kernels_of_a_cuda_graph_match_their_fusions_by_name():
    # In a CUDA graph every kernel's hlo_op is its command buffer's; the kernel is named after
    # its fusion, dots as underscores. cuBLAS's and the driver's kernels are classed by name.
    def event(name, dur):
        return sp.KernelEvent(name, "command_buffer_3", 0.0, dur, "Stream #14")

    classes = {"loop_add_fusion.3": sp.Instruction("elementwise", "fusion", "mlp"),
               "input_reduce_fusion": sp.Instruction("reduction", "fusion", "norm")}
    events = [event("loop_add_fusion_3", 2.0), event("input_reduce_fusion", 3.0),
              event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 5.0),
              event("memcpy128", 1.0), event("set_case_condition", 0.5), event("mystery", 0.25)]
    prof = sp.summarize(events, classes, 1, [20e-6])
    assert {k: n for k, (_, n) in prof.classes.items()} == {
        "gemm": 1, "reduction": 1, "elementwise": 1, "copy": 1, "other": 2}
    assert set(prof.sources) == {"mlp", "norm", "(library GEMMs)", "(memory copies)",
                                 "(loop control)", "(unmatched)"}
    assert prof.unmatched == 1  # only "mystery": the rest are known by name


GPU_RUN = Path(__file__).resolve().parent.parent / "docs" / "results" / "gpu-kit-h100-2026-11-27c"


def test_an_h100_steps_module_and_trace_are_read_as_the_kit_read_them():
    """The 0.9B LLaMA with cuDNN's attention, compiled and profiled on an H100 (the kit's
    fourth run, kept in docs/results): its cuDNN calls are attention, its cuBLAS calls GEMMs,
    every kernel of the trace is accounted for, and its layer scan's slice copies are
    counted (async dynamic-slice fusions on the copy engine, unfused updates)."""
    with gzip.open(GPU_RUN / "hlo-llama-1b-cudnn.txt.gz", "rt") as f:
        text = f.read()
    classes = sp.classify(text)
    by_opcode = {}
    for inst in classes.values():
        by_opcode.setdefault(inst.opcode, set()).add(inst.kind)
    assert by_opcode["custom-call"] >= {"attention", "gemm"}
    assert "fusion-done" not in by_opcode  # the wait, not a kernel
    events = sp.trace_kernels(GPU_RUN / "trace-llama-1b-cudnn.json.gz")
    prof = sp.summarize(events, classes, 3, [0.0764])
    assert prof.unmatched == 0 and round(prof.kernels) == 2076
    assert prof.classes["attention"][0] == pytest.approx(9.68e-3, rel=0.01)
    copies, nbytes = sp.loop_copies(text)
    assert copies == 448 and nbytes == pytest.approx(12.98e9, rel=0.01)
    # its large memory-bound kernels move their bytes at 0.75-0.95 of the H100's 3.35 TB/s
    for kind in ("elementwise", "reduction"):
        moved, seconds, kernels = prof.memory_bound[kind]
        assert kernels >= 40 and 0.75 <= moved / seconds / 3.35e12 <= 0.95, kind
