"""GPT in Megatron-LM's shapes: the decoder family of the large-model papers, in linen.

A pre-LayerNorm decoder (Radford et al. 2019, as Megatron-LM trains it: Shoeybi et al. 2019,
Narayanan et al. 2021, Korthikanti et al. 2022): learned position embeddings (``wpe``),
``layers`` of causal self-attention (``attn/query``, ``attn/key``, ``attn/value``, ``attn/out``;
products in float16, softmax in float32) and a GELU MLP 4x wider (``mlp/fc1``, ``mlp/fc2``), a
final LayerNorm and the output projection tied to the token embedding (``wte.attend``). Mixed
precision as Megatron trains it: float32 master parameters, float16 (or bfloat16) arithmetic,
logits cast back to float32 for the loss. Dropout as Megatron-LM's defaults (``dropout=0.1``)
on the embeddings' sum, the attention probabilities and both residual branches; its masks are
hashes of a per-sequence ``dropout_seed`` batch leaf and the position
(`soapjax_zoo.workload.dropout`), the same under every sharding, microbatching and pipeline.
"tiny" has none (the tests' pinned numbers); "tiny-dropout" is tiny at 0.1.

The layers are one `nn.scan` over a block (parameters stacked on a leading layer dim):
soapjax unrolls it into ``layers_0`` .. ``layers_{L-1}`` and ties the layers' configs as
repeated blocks, so the search costs what one layer costs, and tracing is as fast for 128
layers as for 2 (one block body in the jaxpr).

Sizes: sequence 2048, vocabulary 51200 (GPT-2's 50257 padded to a multiple of 1024), hidden /
heads / layers of GPT-3 (Brown et al. 2020, Table 2.1: 1.3B .. 175B) and of Megatron-LM's runs
(22B: Korthikanti et al. 2022; every row of Narayanan et al. 2021, Table 1: 1.7B .. 1T, the
weak-scaling runs `scripts/bench_gpu_sim.py` simulates). Parameters
``12 L h^2 + 13 L h + (V + s + 2) h``: 1.3b has 1,317,654,528, 1.7b 1,652,230,656 (the
table's 1.7B), 175b 174,615,846,912, 1t 1,008,038,758,400. Every size traces in 1-5 s
(`tests/test_zoo_large.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from soapjax.base.attention import flash_attention
from soapjax_zoo.workload import (
    ATTENTION_KINDS,
    ModelConfigError,
    Workload,
    causal_attention,
    decoder_workload,
    dropout,
    mix32,
)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """GPT hyper-parameters; the default is GPT-3 XL (1.3B).

    Attributes:
      batch_size: sequences per step (Megatron's global batches are 512-3072: pass
        ``batch_size=`` to `soapjax_zoo.get` to plan those).
      seq_len: tokens per sequence, also the number of learned positions.
      dtype: what the layers compute in (``"float16"`` as Megatron-LM, or ``"bfloat16"``); None
        computes in the parameters' dtype (the tiny config: float64 tests compute in float64).
      param_dtype: what parameters are stored in (float32 master weights).
      dropout: Megatron-LM's ``--attention-dropout`` and ``--hidden-dropout`` (both 0.1 by
        default there and here): the probability of zeroing an attention probability, and an
        element of the attention's and the MLP's outputs before each residual add. Nonzero,
        the batch carries a ``dropout_seed`` per sequence (`soapjax_zoo.workload.dropout`).
      attention: ``"xla"`` (the scores and probabilities in memory, a softmax between two
        batched matmuls), ``"flash"`` (`soapjax.base.attention.flash_attention` over blocks of
        `attention_block` keys, nothing ``T x T`` kept) or ``"cudnn"`` (the same operator run
        by cuDNN's fused kernel on a GPU, as Transformer Engine's fused attention runs in
        NeMo and Megatron-LM; the blockwise one elsewhere). The last two keep no attention
        probabilities to drop out: they need ``dropout=0``.
      attention_block: keys per block of the flash attention.
    """

    batch_size: int = 8
    seq_len: int = 2048
    vocab_size: int = 51200
    num_layers: int = 24
    num_heads: int = 16
    d_model: int = 2048
    dtype: str | None = "float16"
    param_dtype: str = "float32"
    learning_rate: float = 2e-4
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    dropout: float = 0.1
    attention: str = "xla"
    attention_block: int = 512

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ModelConfigError(f"dropout {self.dropout} must be in [0, 1)")
        if self.attention not in ATTENTION_KINDS:
            raise ModelConfigError(f"GPTConfig.attention is {self.attention!r}; expected one of "
                                   f"{ATTENTION_KINDS}")
        if self.attention != "xla" and self.dropout:
            raise ModelConfigError(
                f"GPTConfig.attention={self.attention!r} keeps no attention probabilities to "
                f"drop out, and dropout is {self.dropout}; set dropout=0.0, or attention='xla'")
        if self.d_model % self.num_heads:
            raise ModelConfigError(
                f"d_model {self.d_model} must be divisible by num_heads {self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


_init = nn.initializers.normal(stddev=0.02)


class Attention(nn.Module):
    """Causal multi-head self-attention: ``query``, ``key``, ``value`` kernels shaped
    ``[d_model, heads, head_dim]`` (the head axis a parameter dim of its own), ``out``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, seeds: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        dense = functools.partial(nn.DenseGeneral, kernel_init=_init, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype)
        heads = (cfg.num_heads, cfg.head_dim)
        q, k, v = (dense(heads, name=n)(x) for n in ("query", "key", "value"))
        if cfg.attention in ("flash", "cudnn"):
            out = flash_attention(q, k, v, block=cfg.attention_block,
                                  implementation="cudnn" if cfg.attention == "cudnn" else "xla")
        else:
            drop = None if seeds is None else functools.partial(dropout, seeds=seeds,
                                                                rate=cfg.dropout)
            out = causal_attention(q, k, v, drop)
        return dense(cfg.d_model, axis=(-2, -1), name="out")(out)


class MLP(nn.Module):
    """The position-wise feed-forward layer: ``fc1`` (4x wider), GELU, ``fc2``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        kw = {"dtype": cfg.dtype, "param_dtype": cfg.param_dtype, "kernel_init": _init}
        x = nn.gelu(nn.Dense(4 * cfg.d_model, name="fc1", **kw)(x))
        return nn.Dense(cfg.d_model, name="fc2", **kw)(x)


class Block(nn.Module):
    """One pre-LayerNorm decoder layer; ``(x, None) -> (x, None)`` as `nn.scan` wants.

    With dropout the carry is ``(x, seeds)``: the layer salts its ``[B]`` seeds once per site
    (attention probabilities, attention output, MLP output) and hands the next layer seeds
    hashed once more, so every layer and site draws its own masks. The seeds ride in the carry
    as float32 holding 24-bit integers (exact; their gradient is zero): soapjax's pipelines
    send the carry and its gradient from stage to stage, so it must be floating point
    (`soapjax.apply._pipelined`)."""

    config: GPTConfig

    @nn.compact
    def __call__(self, carry: Any, _: None) -> tuple[Any, None]:
        cfg = self.config
        kw = {"dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        x, carried = carry if cfg.dropout else (carry, None)
        seeds = None if carried is None else carried.astype(jnp.uint32)

        def drop(y: jax.Array, site: int) -> jax.Array:
            return y if seeds is None else dropout(y, mix32(seeds, site), cfg.dropout)

        h = nn.LayerNorm(epsilon=1e-5, name="ln_1", **kw)(x)
        probs_seeds = None if seeds is None else mix32(seeds, _PROBS)
        x = x + drop(Attention(cfg, name="attn")(h, probs_seeds), _ATTN_OUT)
        h = nn.LayerNorm(epsilon=1e-5, name="ln_2", **kw)(x)
        x = x + drop(MLP(cfg, name="mlp")(h), _MLP_OUT)
        return ((x, _carried(mix32(seeds, _NEXT_LAYER))) if cfg.dropout else x), None


def _carried(seeds: jax.Array) -> jax.Array:
    """uint32 seeds as the float32 the layers' carry holds: their top 24 bits, exact."""
    return (seeds >> jnp.uint32(8)).astype(jnp.float32)


# Salts of the dropout sites' streams (any distinct words).
_PROBS, _ATTN_OUT, _MLP_OUT, _NEXT_LAYER, _EMBED, _LAYERS = (
    0x5EED0001, 0x5EED0002, 0x5EED0003, 0x5EED0004, 0x5EED0005, 0x5EED0006)


class GPT(nn.Module):
    """Token and position embeddings, scanned ``layers``, final LayerNorm, tied head."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, dropout_seed: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        kw = {"dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, name="wte", **kw)
        wpe = nn.Embed(cfg.seq_len, cfg.d_model, embedding_init=_init, name="wpe", **kw)
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[-1]))
        if cfg.dropout:  # Megatron-LM drops the embeddings' sum too (its hidden dropout)
            if dropout_seed is None:
                raise ModelConfigError(f"GPT with dropout {cfg.dropout} needs a dropout_seed "
                                       f"per sequence ([{tokens.shape[0]}] uint32); pass "
                                       f"dropout=0.0 for none")
            x = dropout(x, mix32(dropout_seed, _EMBED), cfg.dropout)
        layers = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True},
            length=cfg.num_layers,
        )
        carry = (x, _carried(mix32(dropout_seed, _LAYERS))) if cfg.dropout else x
        carry, _ = layers(cfg, name="layers")(carry, None)
        x = carry[0] if cfg.dropout else carry
        logits = wte.attend(nn.LayerNorm(epsilon=1e-5, name="ln_f", **kw)(x))
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


def _size(d_model: int, num_heads: int, num_layers: int) -> GPTConfig:
    return GPTConfig(d_model=d_model, num_heads=num_heads, num_layers=num_layers)


# name -> config; "default" is the smallest real size, "tiny" is for tests (float64 gradients
# in seconds on CPU: it computes in its parameters' dtype; every dim a multiple of 4, the model
# axis of the cpu8 mesh).
# GPT-3's sizes (Brown et al. 2020, Table 2.1), Korthikanti et al.'s 22B and every row of
# Narayanan et al. 2021, Table 1 (1.7b .. 1t, named by the table's parameter counts; 530b and 1t
# are its 529.6B and 1008B rows), in order of size.
GPT_SIZES = {
    "1.3b": _size(2048, 16, 24),
    "1.7b": _size(2304, 24, 24),
    "2.7b": _size(2560, 32, 32),
    "3.6b": _size(3072, 32, 30),
    "6.7b": _size(4096, 32, 32),
    "7.5b": _size(4096, 32, 36),
    "13b": _size(5120, 40, 40),
    "18.4b": _size(6144, 48, 40),
    "22b": _size(6144, 64, 48),
    "39.1b": _size(8192, 64, 48),
    "76.1b": _size(10240, 80, 60),
    "145.6b": _size(12288, 96, 80),
    "175b": _size(12288, 96, 96),
    "310.1b": _size(16384, 128, 96),
    "530b": _size(20480, 128, 105),
    "1t": _size(25600, 160, 128),
}
_TINY = GPTConfig(batch_size=8, seq_len=8, vocab_size=64, num_layers=2, num_heads=4,
                  d_model=32, dtype=None, dropout=0.0)
GPT_CONFIGS = {
    "default": GPT_SIZES["1.3b"],
    "tiny": _TINY,
    "tiny-dropout": dataclasses.replace(_TINY, dropout=0.1),
    **GPT_SIZES,
}


def build_gpt(name: str, config: str, cfg: GPTConfig, api: str) -> Workload:
    """The GPT workload: next-token prediction, AdamW (beta2 0.95) after clipping."""
    return decoder_workload(
        name, config, cfg, GPT(cfg),
        f"GPT ({cfg.num_layers} layers, {cfg.num_heads} heads, d_model {cfg.d_model}), "
        f"{cfg.seq_len} tokens, vocab {cfg.vocab_size}, {cfg.dtype or cfg.param_dtype} "
        f"over {cfg.param_dtype}",
    )
