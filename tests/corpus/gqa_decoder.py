"""A decoder-only language model in the style of recent open models, in linen.

* grouped-query attention: 4 query heads share 2 key/value heads (each kv head repeated for
  its group of 2), scores by ``jnp.einsum('BTNH,BSNH->BNTS')``;
* rotary position embeddings on queries and keys (rotate-half form, base 10000);
* a causal mask limited to a sliding window of the last ``window`` positions;
* RMSNorm before attention, before the MLP and at the end;
* a SwiGLU MLP: ``down(silu(gate(x)) * up(x))``;
* tied embeddings: the output logits are ``embed.attend(h)``;
* layers unrolled (a Python loop), no biases.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


def rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotates pairs (i, i + H/2) of x [B, T, N, H] by position-dependent angles."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=x.dtype) / half)
    angles = positions[:, None].astype(x.dtype) * freqs[None, :]  # [T, H/2]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def sliding_window_mask(length: int, window: int) -> jax.Array:
    """[T, S] True where query t may attend key s: s <= t and t - s < window."""
    t = jnp.arange(length)[:, None]
    s = jnp.arange(length)[None, :]
    return (s <= t) & (t - s < window)


class GQAttention(nn.Module):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        _, length, d_model = x.shape
        proj = lambda heads, name: nn.DenseGeneral(  # noqa: E731
            (heads, self.head_dim), use_bias=False, param_dtype=self.param_dtype, name=name)
        q = proj(self.num_heads, "q")(x)
        k = proj(self.num_kv_heads, "k")(x)
        v = proj(self.num_kv_heads, "v")(x)
        positions = jnp.arange(length)
        q, k = rope(q, positions), rope(k, positions)
        group = self.num_heads // self.num_kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(self.head_dim).astype(q.dtype)
        mask = sliding_window_mask(length, self.window)
        scores = jnp.where(mask[None, None], scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
        return nn.DenseGeneral(d_model, axis=(-2, -1), use_bias=False,
                               param_dtype=self.param_dtype, name="o")(out)


class SwiGLU(nn.Module):
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = functools.partial(nn.Dense, use_bias=False, param_dtype=self.param_dtype)
        h = nn.silu(dense(self.hidden, name="gate")(x)) * dense(self.hidden, name="up")(x)
        return dense(x.shape[-1], name="down")(h)


class DecoderLayer(nn.Module):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_hidden: int
    window: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        norm = lambda name: nn.RMSNorm(param_dtype=self.param_dtype, name=name)  # noqa: E731
        x = x + GQAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.window,
                            self.param_dtype, name="attn")(norm("attn_norm")(x))
        return x + SwiGLU(self.mlp_hidden, self.param_dtype, name="mlp")(norm("mlp_norm")(x))


class GQADecoder(nn.Module):
    vocab: int = 64
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    mlp_hidden: int = 64
    window: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.d_model, param_dtype=self.param_dtype, name="embed")
        x = embed(tokens)
        x = x * jnp.sqrt(self.d_model).astype(x.dtype)
        for i in range(self.num_layers):
            x = DecoderLayer(self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_hidden,
                             self.window, self.param_dtype, name=f"layer_{i}")(x)
        x = nn.RMSNorm(param_dtype=self.param_dtype, name="final_norm")(x)
        return embed.attend(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, seed: int = 0,
         compiler_options=None, **config):
    """The GQA decoder's ``(loss_fn, params, batch)``: next-token cross-entropy."""
    model = GQADecoder(param_dtype=dtype, **config)
    k_init, k_tok = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_tok, (batch_size, seq_len + 1), 0, model.vocab)
    params = init_linen(model.init, k_init, tokens[:, :-1],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, params, {"tokens": tokens}
