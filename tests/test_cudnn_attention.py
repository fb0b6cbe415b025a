"""`flash_attention(..., implementation="cudnn")`: cuDNN's fused attention kernel on a GPU, the
blockwise attention elsewhere, one attention operator of the graph either way.

* On the CPU (every test but the last) it is the blockwise attention: the tiny llama written
  with ``attention="cudnn"`` has the flash model's float64 gradients exactly, unsharded and
  applied on cpu8 data parallel and under context parallelism (gathered and as a ring: the
  shards re-bind the blockwise attention, which takes their positions).
* Its attention operator says how it was written (`AttentionCall.implementation`), and the
  kernel model prices a whole-sequence shard at the topology's `cudnn_attention_efficiency`
  and a sequence-split shard (context parallelism, which runs the blockwise attention) at
  `attention_efficiency`.
* On a GPU (``-m gpu``), cuDNN's kernel runs, and its bfloat16 gradients match the blockwise
  attention's (`scripts/check_cudnn_attention.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from test_corpus import X64_TOL, float64_workload, relative_error, worst_leaf
from test_flash_attention import applied, case

import soapjax_zoo
from soapjax.base.attention import AttentionCall, attention_call, flash_attention
from soapjax.base.errors import TopologyError
from soapjax.cost.kernels import FlashKernel, flash_time, shard_kernels
from soapjax.graph.opgraph import trace
from soapjax.topology.cluster import KernelSpec, load_topology
from soapjax_zoo import llama

CHECK = Path(__file__).resolve().parent.parent / "scripts" / "check_cudnn_attention.py"
CONFIG = dataclasses.replace(llama.LLAMA_CONFIGS["tiny-flash"], param_dtype="float64",
                             attention="cudnn")


@functools.cache
def cudnn_case():
    w = llama.build_llama("llama", "tiny-cudnn-x64", CONFIG, "linen")
    return float64_workload(w, "llama")


def test_the_attention_operator_says_it_was_written_for_cudnn():
    graph = cudnn_case()[0]
    prog = graph.program
    calls = [attention_call(u.eqn) for u in prog.units if attention_call(u.eqn) is not None]
    assert set(calls) == {AttentionCall(True, 32, "cudnn")}
    flash = case()[0]
    assert [op.name for op in graph.operators] == [op.name for op in flash.operators]
    assert [op.anchor for op in graph.operators].count("attention") == CONFIG.num_layers


def test_on_the_cpu_its_gradients_are_the_blockwise_attentions():
    _, params, batch, grads = cudnn_case()
    _, params_flash, _, grads_flash = case()
    assert relative_error(params, params_flash) == 0.0
    assert relative_error(grads, grads_flash) <= 1e-13


@pytest.mark.parametrize("kind", ["dp", "cp_model", "ring_data_tp_model"])
def test_applied_on_cpu8_its_gradients_are_exact(kind):
    want = cudnn_case()[3]
    got = applied(kind, cudnn_case)[0]
    err = relative_error(got, want)
    assert err <= X64_TOL, f"{kind}: {err:.3g}; worst leaf {worst_leaf(got, want)}"


def test_a_whole_sequence_is_priced_as_cudnn_runs_it_a_split_one_as_blockwise():
    """Llama 3 8B at 128K tokens written with cuDNN's attention, on an H100 whose kernel table
    gives both efficiencies: a whole-sequence shard's flash kernel at cuDNN's, a
    context-parallel shard's (the blockwise attention, `bind_attention`) at the blockwise."""
    base = soapjax_zoo.get("llama", "8b-128k")
    cfg = dataclasses.replace(llama.LONG_CONTEXT_SIZES["8b-128k"], attention="cudnn")
    w = llama.build_llama("llama", "8b-128k-cudnn", cfg, "linen")
    graph = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="llama")
    op = graph.operator("layers_0/attn")
    device = load_topology("dgx-h100x8").device
    spec = dataclasses.replace(device.kernels, cudnn_attention_efficiency=0.5)
    whole = [k for k in shard_kernels(graph, op, (1,) * 6).forward if isinstance(k, FlashKernel)]
    split = [k for k in shard_kernels(graph, op, (1, 8, 1, 1, 1, 1)).forward
             if isinstance(k, FlashKernel)]
    assert [k.implementation for k in whole] == ["cudnn"]
    assert [k.implementation for k in split] == ["xla"]
    peak, bw = 989e12, device.memory_bandwidth
    assert flash_time(whole[0], peak, bw, spec) == pytest.approx(
        whole[0].flops / (peak * 0.5) + spec.launch)
    assert flash_time(split[0], peak, bw, spec) == pytest.approx(
        split[0].flops / (peak * spec.attention_efficiency) + spec.launch)
    # the same model written for the blockwise attention is priced the blockwise way whole
    plain = trace(base.loss_fn, base.abstract_params(), base.abstract_batch(), name="llama")
    (k,) = [k for k in shard_kernels(plain, plain.operator("layers_0/attn"), (1,) * 6).forward
            if isinstance(k, FlashKernel)]
    assert k.implementation == "xla"


def test_the_kernel_table_reads_and_checks_the_cudnn_efficiency():
    with pytest.raises(TopologyError, match=r"cudnn_attention_efficiency: expected a fraction "
                                            r"in \[0, 1\] \(0: attention_efficiency\)"):
        KernelSpec(0.8, 0.5, 3e-6, 132, cudnn_attention_efficiency=1.5)
    # the H100 files give it (measured); 0 (absent) falls back to attention_efficiency
    spec = load_topology("dgx-h100x8").device.kernels
    assert spec.cudnn_attention_efficiency > 5 * spec.attention_efficiency
    k = FlashKernel(8, 4096, 4096, 128, 128, "bfloat16", 0.0, True, "cudnn")
    bare = dataclasses.replace(spec, cudnn_attention_efficiency=0.0)
    assert flash_time(k, 989e12, 3.35e12, bare) == pytest.approx(
        k.flops / (989e12 * spec.attention_efficiency) + spec.launch)


def test_an_unknown_implementation_is_refused():
    q = jnp.ones((1, 8, 2, 4))
    with pytest.raises(ValueError, match=r"implementation is 'fast'; expected one of "
                                         r"\('xla', 'cudnn'\)"):
        flash_attention(q, q, q, implementation="fast")


@pytest.mark.gpu  # skipped without a GPU (tests/conftest.py)
def test_on_a_gpu_cudnn_runs_and_its_gradients_match_the_blockwise_attention():
    proc = subprocess.run([sys.executable, str(CHECK), "--shape", "2", "1024", "8", "2", "64"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["checked"] and found["cudnn_in_hlo"]


def test_without_a_gpu_the_check_says_it_checked_nothing():
    proc = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"backend": "cpu", "checked": False,
                     "why": "no GPU: cuDNN's kernel does not run here"}
