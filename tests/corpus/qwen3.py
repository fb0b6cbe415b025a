"""A Qwen-3-style decoder in nnx: q/k RMSNorms per head, grouped-query attention, SwiGLU.

Written the way nnx ports of Qwen3 write it: `nnx.Embed`, layers in an `nnx.List` (so their
paths are ``layers/0``, ``layers/1``), each a pre-norm attention block (``q_proj``, ``k_proj``,
``v_proj`` without biases; `nnx.RMSNorm` over the head dim on the queries and keys *before*
rotary embeddings; 4 query heads over 2 key/value heads; a causal mask by ``jnp.tril`` and
``jnp.where``; ``o_proj``) and a SwiGLU MLP; a final norm and an untied ``lm_head``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from corpus._jit import create_nnx


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)


class Qwen3Attention(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, *, param_dtype,
                 rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        lin = lambda a, b: nnx.Linear(a, b, use_bias=False, param_dtype=param_dtype,  # noqa: E731
                                      rngs=rngs)
        self.q_proj = lin(d_model, num_heads * self.head_dim)
        self.k_proj = lin(d_model, num_kv_heads * self.head_dim)
        self.v_proj = lin(d_model, num_kv_heads * self.head_dim)
        self.o_proj = lin(num_heads * self.head_dim, d_model)
        self.q_norm = nnx.RMSNorm(self.head_dim, epsilon=1e-6, param_dtype=param_dtype,
                                  rngs=rngs)
        self.k_norm = nnx.RMSNorm(self.head_dim, epsilon=1e-6, param_dtype=param_dtype,
                                  rngs=rngs)

    def __call__(self, x, sin, cos):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.num_heads // self.num_kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.o_proj(out.reshape(b, t, -1))


class Qwen3MLP(nnx.Module):
    def __init__(self, d_model: int, hidden: int, *, param_dtype, rngs: nnx.Rngs):
        lin = lambda a, b: nnx.Linear(a, b, use_bias=False, param_dtype=param_dtype,  # noqa: E731
                                      rngs=rngs)
        self.gate_proj, self.up_proj = lin(d_model, hidden), lin(d_model, hidden)
        self.down_proj = lin(hidden, d_model)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Layer(nnx.Module):
    def __init__(self, d_model: int, hidden: int, *, param_dtype, rngs: nnx.Rngs):
        norm = lambda: nnx.RMSNorm(d_model, epsilon=1e-6, param_dtype=param_dtype,  # noqa: E731
                                   rngs=rngs)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.self_attn = Qwen3Attention(d_model, 4, 2, param_dtype=param_dtype, rngs=rngs)
        self.mlp = Qwen3MLP(d_model, hidden, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, sin, cos):
        x = x + self.self_attn(self.input_layernorm(x), sin, cos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nnx.Module):
    def __init__(self, *, vocab_size: int, d_model: int, hidden: int, num_layers: int,
                 theta: float = 1_000_000.0, param_dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(vocab_size, d_model, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([Qwen3Layer(d_model, hidden, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(num_layers)])
        self.norm = nnx.RMSNorm(d_model, epsilon=1e-6, param_dtype=param_dtype, rngs=rngs)
        self.lm_head = nnx.Linear(d_model, vocab_size, use_bias=False, param_dtype=param_dtype,
                                  rngs=rngs)
        self.head_dim, self.theta = d_model // 4, theta

    def __call__(self, tokens):
        t = tokens.shape[1]
        x = self.embed_tokens(tokens)
        inv = 1.0 / self.theta ** (jnp.arange(0, self.head_dim, 2) / self.head_dim)
        freqs = jnp.outer(jnp.arange(t), inv)
        emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :].astype(x.dtype)
        sin, cos = jnp.sin(emb), jnp.cos(emb)
        for layer in self.layers:
            x = layer(x, sin, cos)
        return self.lm_head(self.norm(x))


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, vocab_size: int = 32,
         d_model: int = 32, hidden: int = 64, num_layers: int = 2, seed: int = 0,
         compiler_options=None):
    """The Qwen-3-style decoder's ``(loss_fn, model, batch)``: next-token cross-entropy."""
    model = create_nnx(lambda: Qwen3(vocab_size=vocab_size, d_model=d_model, hidden=hidden,
                                     num_layers=num_layers, param_dtype=dtype,
                                     rngs=nnx.Rngs(seed)),
                       compiler_options=compiler_options)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch_size, seq_len + 1), 0,
                                vocab_size, jnp.int32)

    def loss_fn(model, batch):
        logits = model(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, model, {"tokens": tokens}
