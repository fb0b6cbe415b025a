"""A Gemma-3-style decoder in linen: sliding-window and global layers, q/k norms, GeGLU.

Written the way the Gemma ports write it:

* token embeddings scaled by ``sqrt(d_model)``, tied to the output (``embed.attend``), with the
  final logits soft-capped (``cap * tanh(logits / cap)``);
* RMSNorm with a ``(1 + scale)`` weight (zero-initialised scale), before *and after* attention
  and the MLP (four norms per layer);
* grouped-query attention (4 query heads over 2 key/value heads, by ``jnp.repeat``), query and
  key RMSNorms over the head dim, rotary embeddings with a base of 10,000 on local layers and
  1,000,000 on global ones;
* layers alternating **local** (a sliding window of 4 positions: the causal mask ``jnp.where``'d
  with a band built from two ``arange``s) and **global** (causal) attention; the masks are
  additive biases from ``jnp.full(..., -1e30)``;
* a GeGLU MLP (``gelu(gate, approximate=True) * up``), layers held in a list.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class GemmaRMSNorm(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


def rope(x, positions, base: float):
    """Rotary embedding of x [B, T, H, D] (half-split form)."""
    half = x.shape[-1] // 2
    freq = 1.0 / base ** (jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, :, None, None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle).astype(x.dtype), jnp.cos(angle).astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    local: bool
    window: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions):
        b, t, _ = x.shape
        dense = lambda n, name: nn.Dense(n, use_bias=False, param_dtype=self.param_dtype,  # noqa: E731
                                         name=name)
        q = dense(self.num_heads * self.head_dim, "q_proj")(x).reshape(b, t, self.num_heads, -1)
        k = dense(self.num_kv_heads * self.head_dim, "k_proj")(x).reshape(b, t,
                                                                           self.num_kv_heads, -1)
        v = dense(self.num_kv_heads * self.head_dim, "v_proj")(x).reshape(b, t,
                                                                           self.num_kv_heads, -1)
        q = GemmaRMSNorm(self.param_dtype, name="q_norm")(q)
        k = GemmaRMSNorm(self.param_dtype, name="k_norm")(k)
        base = 10_000.0 if self.local else 1_000_000.0
        q, k = rope(q, positions, base), rope(k, positions, base)
        groups = self.num_heads // self.num_kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * self.head_dim ** -0.5
        i = jnp.arange(t)[:, None]
        j = jnp.arange(t)[None, :]
        allowed = j <= i
        if self.local:
            allowed = jnp.where(i - j < self.window, allowed, False)
        bias = jnp.where(allowed, jnp.zeros((t, t), scores.dtype),
                         jnp.full((t, t), -1e30, scores.dtype))
        probs = jax.nn.softmax(scores + bias, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1)
        return dense(x.shape[-1], "o_proj")(out)


class Block(nn.Module):
    d_model: int
    hidden: int
    local: bool
    window: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions):
        norm = lambda name: GemmaRMSNorm(self.param_dtype, name=name)  # noqa: E731
        h = Attention(4, 2, self.d_model // 4, self.local, self.window, self.param_dtype,
                      name="attn")(norm("pre_attention_norm")(x), positions)
        x = x + norm("post_attention_norm")(h)
        y = norm("pre_ffw_norm")(x)
        dense = lambda n, name: nn.Dense(n, use_bias=False, param_dtype=self.param_dtype,  # noqa: E731
                                         name=name)
        y = dense(self.d_model, "down")(jax.nn.gelu(dense(self.hidden, "gate")(y),
                                                    approximate=True) * dense(self.hidden, "up")(y))
        return x + norm("post_ffw_norm")(y)


class Gemma3(nn.Module):
    vocab_size: int
    d_model: int
    hidden: int
    pattern: tuple[bool, ...]  # True: a local (sliding-window) layer
    softcap: float = 30.0
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedder = nn.Embed(self.vocab_size, self.d_model, param_dtype=self.param_dtype)
        self.layers = [Block(self.d_model, self.hidden, local, param_dtype=self.param_dtype)
                       for local in self.pattern]
        self.final_norm = GemmaRMSNorm(self.param_dtype)

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embedder(tokens) * math.sqrt(self.d_model)
        for layer in self.layers:
            x = layer(x, positions)
        logits = self.embedder.attend(self.final_norm(x))
        return self.softcap * jnp.tanh(logits / self.softcap)


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, vocab_size: int = 32,
         d_model: int = 32, hidden: int = 64, pattern: tuple[bool, ...] = (True, False),
         seed: int = 0, compiler_options=None):
    """The Gemma-3-style decoder's ``(loss_fn, params, batch)``: next-token cross-entropy."""
    model = Gemma3(vocab_size, d_model, hidden, pattern, param_dtype=dtype)
    k_init, k_tok = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_tok, (batch_size, seq_len + 1), 0, vocab_size, jnp.int32)
    params = init_linen(model.init, k_init, tokens[:, :-1],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, params, {"tokens": tokens}
