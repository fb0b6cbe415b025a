"""GPT-2: a decoder-only transformer language model (Radford et al. 2019), in linen.

Pre-LayerNorm blocks (``ln_1``, causal ``attn``, ``ln_2``, ``mlp/fc1`` GELU ``mlp/fc2``), learned
position embeddings (``wpe``), a final LayerNorm (``ln_f``), and the output projection tied to
the token embedding (``wte.attend``), as in the released GPT-2: GPT-2 small then has
124,439,808 parameters. Attention is `nn.MultiHeadDotProductAttention` (``attn/query``,
``attn/key``, ``attn/value``, ``attn/out``; kernels shaped ``[d_model, heads, head_dim]``, so
the head axis is a parameter dim of its own). No dropout, so the loss is pure.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from soapjax_zoo.workload import Batch, ModelConfigError, Workload, linen_workload


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 hyper-parameters; the default is GPT-2 small.

    Attributes:
      seq_len: tokens per sample, at most ``context``.
      context: number of learned positions.
    """

    batch_size: int = 8
    seq_len: int = 1024
    context: int = 1024
    vocab_size: int = 50257
    num_layers: int = 12
    num_heads: int = 12
    d_model: int = 768
    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ModelConfigError(
                f"d_model {self.d_model} must be divisible by num_heads {self.num_heads}"
            )
        if self.seq_len > self.context:
            raise ModelConfigError(f"seq_len {self.seq_len} exceeds the context of {self.context}")


_init = nn.initializers.normal(stddev=0.02)


class MLPBlock(nn.Module):
    """The position-wise feed-forward layer: ``fc1`` (4x wider), GELU, ``fc2``."""

    d_model: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.gelu(nn.Dense(4 * self.d_model, kernel_init=_init, name="fc1")(x))
        return nn.Dense(self.d_model, kernel_init=_init, name="fc2")(x)


class Block(nn.Module):
    """One pre-LayerNorm transformer block."""

    config: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.config
        attn = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads, kernel_init=_init, name="attn"
        )
        x = x + attn(nn.LayerNorm(epsilon=1e-5, name="ln_1")(x), mask=mask)
        return x + MLPBlock(cfg.d_model, name="mlp")(nn.LayerNorm(epsilon=1e-5, name="ln_2")(x))


class GPT2(nn.Module):
    """Token and position embeddings, ``layers_{i}`` blocks, final LayerNorm, tied head."""

    config: GPT2Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, name="wte")
        wpe = nn.Embed(
            cfg.context, cfg.d_model, embedding_init=nn.initializers.normal(0.01), name="wpe"
        )
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[-1]))
        mask = nn.make_causal_mask(tokens)
        for i in range(cfg.num_layers):
            x = Block(cfg, name=f"layers_{i}")(x, mask)
        return wte.attend(nn.LayerNorm(epsilon=1e-5, name="ln_f")(x))


GPT2_CONFIGS = {
    "default": GPT2Config(),
    "tiny": GPT2Config(
        batch_size=8, seq_len=8, context=16, vocab_size=128, num_layers=2, num_heads=2, d_model=32
    ),
}


def _decay_mask(params: object) -> object:
    """Weight decay on matrices (kernels, embeddings) only, not on biases or LayerNorm scales."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def build_gpt2(name: str, config: str, cfg: GPT2Config, api: str) -> Workload:
    """The GPT-2 workload: next-token prediction, AdamW (beta2 0.95) after clipping."""

    def make_batch(rng: jax.Array) -> Batch:
        stream = jax.random.randint(rng, (cfg.batch_size, cfg.seq_len + 1), 0, cfg.vocab_size)
        stream = stream.astype(jnp.int32)
        return {"inputs": stream[:, :-1], "targets": stream[:, 1:]}

    optimizer = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(
            cfg.learning_rate, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=_decay_mask
        ),
    )
    return linen_workload(
        name=name,
        config=config,
        family="transformer",
        description=(
            f"GPT-2 ({cfg.num_layers} layers, {cfg.num_heads} heads, d_model {cfg.d_model}), "
            f"{cfg.seq_len} tokens, vocab {cfg.vocab_size}, tied embeddings"
        ),
        module=GPT2(cfg),
        make_batch=make_batch,
        inputs=("inputs",),
        label="targets",
        optimizer=optimizer,
    )
