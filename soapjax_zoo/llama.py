"""LLaMA: a decoder in the style of recent open models (Touvron et al. 2023), in linen.

Each layer: RMSNorm, grouped-query attention (``attn/q``, ``attn/k``, ``attn/v``, ``attn/o``, no
biases; each key/value head serves ``num_heads / num_kv_heads`` query heads) with rotary
position embeddings (rotate-half form, base 10000) on queries and keys and the softmax in
float32; RMSNorm, a SwiGLU MLP ``down(silu(gate(x)) * up(x))``. A final RMSNorm and an untied
output projection (``lm_head``). bfloat16 arithmetic over float32 parameters; logits cast back
to float32 for the loss.

The layers are one `nn.scan` over a block (parameters stacked on a leading layer dim), which
soapjax unrolls into ``layers_0`` .. ``layers_{L-1}`` and plans as repeated blocks.

Sizes (LLaMA 2, Touvron et al. 2023b, as its released configs give them): 7b is hidden 4096,
32 heads, 32 key/value heads (plain multi-head attention), 32 layers, MLP 11008, vocabulary
32000, sequence 4096: 6,738,415,616 parameters (6.7B in the first LLaMA paper's Table 2; the
name rounds up); 70b is hidden 8192, 64 heads, 8 key/value heads, 80 layers, MLP 28672:
68,976,648,192.

Long-context sizes (Llama 3, Grattafiori et al. 2024, as its released configs give them;
RoPE base 500000, vocabulary 128256, grouped-query attention with 8 key/value heads):
``8b-32k`` and ``8b-128k`` are hidden 4096, 32 heads, 32 layers, MLP 14336 (8,030,261,248
parameters), at 32768 and 131072 tokens; ``70b-32k`` and ``70b-128k`` are hidden 8192, 64
heads, 80 layers, MLP 28672 (70,553,706,496). Each step is 1M tokens (32 or 8 sequences), as
long-context recipes keep the global batch in tokens while the sequence grows (NeMo's
Llama 3 8B 16K/64K recipes: TP x CP x PP of 8 to 16 GPUs per sequence).
"""

from __future__ import annotations

import dataclasses
import functools

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
)


def check_heads(d_model: int, num_heads: int, num_kv_heads: int) -> None:
    """ModelConfigError unless the heads split `d_model` into even head dims (rotary embeddings
    rotate pairs) and the query heads group evenly over the key/value heads."""
    if d_model % num_heads or (d_model // num_heads) % 2:
        raise ModelConfigError(
            f"d_model {d_model} must be divisible by num_heads {num_heads} into an even head "
            f"dim (rotary embeddings rotate pairs)"
        )
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """LLaMA hyper-parameters; the default is LLaMA 2 7B.

    Attributes:
      num_kv_heads: key/value heads; each serves ``num_heads // num_kv_heads`` query heads.
      mlp_hidden: the SwiGLU MLP's inner width.
      dtype: what the layers compute in (None: the parameters' dtype, as the tiny config, so
        that float64 tests compute in float64); param_dtype: what parameters are stored in.
      attention: ``"xla"``, the scores, mask, softmax and ``probs v`` as plain equations (two
        operators of the graph, the ``T x T`` probabilities kept or recomputed);
        ``"flash"``, `soapjax.base.attention.flash_attention` (one attention operator, blocks of
        `attention_block` keys, nothing ``T x T`` kept), as long-context training runs it;
        ``"cudnn"``, the same operator run by cuDNN's fused kernel on a GPU where the
        sequence is whole (``implementation="cudnn"``; the blockwise one elsewhere).
    """

    batch_size: int = 8
    seq_len: int = 4096
    vocab_size: int = 32000
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    d_model: int = 4096
    mlp_hidden: int = 11008
    rope_base: float = 10000.0
    dtype: str | None = "bfloat16"
    param_dtype: str = "float32"
    learning_rate: float = 3e-4
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    attention: str = "xla"
    attention_block: int = 512

    def __post_init__(self) -> None:
        check_heads(self.d_model, self.num_heads, self.num_kv_heads)
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"LlamaConfig.attention is {self.attention!r}; expected one of "
                             f"{ATTENTION_KINDS}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


_init = nn.initializers.normal(stddev=0.02)


def rope(x: jax.Array, base: float) -> jax.Array:
    """Rotates pairs (i, i + H/2) of x [B, T, N, H] by angles ``t * base**(-i / (H/2))``
    (computed in float32, applied in x's dtype)."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs[None, :]  # [T, H/2]
    sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
    cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        proj = functools.partial(nn.DenseGeneral, use_bias=False, kernel_init=_init,
                                 dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        q = rope(proj((cfg.num_heads, cfg.head_dim), name="q")(x), cfg.rope_base)
        k = rope(proj((cfg.num_kv_heads, cfg.head_dim), name="k")(x), cfg.rope_base)
        v = proj((cfg.num_kv_heads, cfg.head_dim), name="v")(x)
        # (a mixture of experts' config, which shares this layer, keeps XLA's attention)
        kind = getattr(cfg, "attention", "xla")
        if kind in ("flash", "cudnn"):  # grouped-query heads, no repeat
            out = flash_attention(q, k, v, block=cfg.attention_block,
                                  implementation="cudnn" if kind == "cudnn" else "xla")
        else:
            group = cfg.num_heads // cfg.num_kv_heads
            k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            out = causal_attention(q, k, v)
        return proj(x.shape[-1], axis=(-2, -1), name="o")(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, of inner width `hidden` (default: the config's
    ``mlp_hidden``; a mixture of experts' shared expert gives its own)."""

    config: LlamaConfig
    hidden: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        hidden = self.hidden if self.hidden is not None else cfg.mlp_hidden
        dense = functools.partial(nn.Dense, use_bias=False, kernel_init=_init, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype)
        h = nn.silu(dense(hidden, name="gate")(x)) * dense(hidden, name="up")(x)
        return dense(cfg.d_model, name="down")(h)


class Block(nn.Module):
    """One pre-RMSNorm decoder layer; ``(x, None) -> (x, None)`` as `nn.scan` wants."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        cfg = self.config
        norm = functools.partial(nn.RMSNorm, epsilon=1e-5, dtype=cfg.dtype,
                                 param_dtype=cfg.param_dtype)
        x = x + Attention(cfg, name="attn")(norm(name="attn_norm")(x))
        return x + MLP(cfg, name="mlp")(norm(name="mlp_norm")(x)), None


class Llama(nn.Module):
    """Token embedding, scanned ``layers``, final RMSNorm, untied ``lm_head``."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        kw = {"dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        x = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, name="embed",
                     **kw)(tokens)
        layers = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True},
            length=cfg.num_layers,
        )
        x, _ = layers(cfg, name="layers")(x, None)
        x = nn.RMSNorm(epsilon=1e-5, name="final_norm", **kw)(x)
        logits = nn.Dense(cfg.vocab_size, use_bias=False, kernel_init=_init, name="lm_head",
                          **kw)(x)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


# name -> config; "default" is the smallest real size, "tiny" is for tests (float64 gradients
# in seconds on CPU: it computes in its parameters' dtype; every dim a multiple of 4, the model
# axis of the cpu8 mesh).
LLAMA_SIZES = {
    "7b": LlamaConfig(),
    "70b": LlamaConfig(num_layers=80, num_heads=64, num_kv_heads=8, d_model=8192,
                       mlp_hidden=28672),
}
_LLAMA3_8B = LlamaConfig(vocab_size=128256, num_kv_heads=8, mlp_hidden=14336, rope_base=500000.0)
_LLAMA3_70B = dataclasses.replace(_LLAMA3_8B, num_layers=80, num_heads=64, d_model=8192,
                                  mlp_hidden=28672)
# Llama 3 at its pre-training context (8K) and long context: 1M tokens a step (128 sequences
# of 8K, 32 of 32K, 8 of 128K), flash attention.
LONG_CONTEXT_SIZES = {
    f"{size}-{k}k": dataclasses.replace(base, seq_len=k * 1024, batch_size=2**20 // (k * 1024),
                                        attention="flash")
    for size, base in (("8b", _LLAMA3_8B), ("70b", _LLAMA3_70B)) for k in (8, 32, 128)
}
LLAMA_CONFIGS = {
    "default": LLAMA_SIZES["7b"],
    "tiny": LlamaConfig(batch_size=8, seq_len=8, vocab_size=64, num_layers=2, num_heads=8,
                        num_kv_heads=4, d_model=32, mlp_hidden=64, dtype=None),
    # a long sequence for its size, flash attention over 4 key blocks (context parallel tests)
    "tiny-flash": LlamaConfig(batch_size=2, seq_len=128, vocab_size=64, num_layers=2,
                              num_heads=8, num_kv_heads=4, d_model=32, mlp_hidden=64,
                              dtype=None, attention="flash", attention_block=32),
    # four layers: pipelines of 4 stages, or 2 with 2 virtual stages each (interleaved)
    "tiny-deep": LlamaConfig(batch_size=8, seq_len=8, vocab_size=64, num_layers=4, num_heads=8,
                             num_kv_heads=4, d_model=32, mlp_hidden=64, dtype=None),
    **LLAMA_SIZES,
    **LONG_CONTEXT_SIZES,
}


def build_llama(name: str, config: str, cfg: LlamaConfig, api: str) -> Workload:
    """The LLaMA workload: next-token prediction, AdamW (beta2 0.95) after clipping."""
    return decoder_workload(
        name, config, cfg, Llama(cfg),
        f"LLaMA ({cfg.num_layers} layers, {cfg.num_heads} heads / {cfg.num_kv_heads} kv, "
        f"d_model {cfg.d_model}, MLP {cfg.mlp_hidden}), {cfg.seq_len} tokens, vocab "
        f"{cfg.vocab_size}, {cfg.dtype or cfg.param_dtype} over {cfg.param_dtype}",
    )
