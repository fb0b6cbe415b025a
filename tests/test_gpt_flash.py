"""The zoo's GPT with flash attention (``GPTConfig.attention="flash"``; ``"cudnn"`` runs the same
operator, by cuDNN's kernel on a GPU): the same loss and gradients as its XLA attention on one
device, and exact float64 gradients on cpu8 under data, context (gathered and ring) and tensor
parallelism, as the tiny flash Llama's (tests/test_flash_attention.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest
from test_corpus import X64_TOL, float64_workload, relative_error, worst_leaf
from test_flash_attention import applied

from soapjax_zoo import gpt
from soapjax_zoo.workload import ModelConfigError

# the tiny GPT at the tiny flash Llama's length: 128 tokens in 4 blocks of 32 keys
CONFIG = dataclasses.replace(gpt.GPT_CONFIGS["tiny"], seq_len=128, batch_size=2,
                             attention="flash", attention_block=32, param_dtype="float64")


@functools.cache
def case():
    return float64_workload(gpt.build_gpt("gpt", "tiny-flash-x64", CONFIG, "linen"), "gpt")


def test_flash_attention_computes_what_xla_attention_does():
    graph, params, batch, want = case()
    assert [op.name for op in graph.operators if op.anchor == "attention"] == [
        "layers_0/attn", "layers_1/attn"]
    xla = gpt.build_gpt("gpt", "tiny-xla-x64", dataclasses.replace(CONFIG, attention="xla"),
                        "linen")
    with jax.enable_x64(True):
        got = jax.jit(jax.grad(xla.loss_fn))(params, batch)
    assert relative_error(got, want) <= X64_TOL, worst_leaf(got, want)


@pytest.mark.parametrize("kind", ["dp", "cp_model", "cp_data_tp_model", "ring_data_tp_model"])
def test_gradients_are_exact(kind):
    want = case()[3]
    got = applied(kind, case)[0]
    err = relative_error(got, want)
    assert err <= X64_TOL, f"{kind}: {err:.3g}; worst leaf {worst_leaf(got, want)}"


def test_flash_attention_wants_no_dropout():
    with pytest.raises(ModelConfigError, match="set dropout=0.0, or attention='xla'"):
        dataclasses.replace(gpt.GPT_SIZES["175b"], attention="cudnn")
    with pytest.raises(ModelConfigError, match="expected one of"):
        dataclasses.replace(CONFIG, attention="fast")
