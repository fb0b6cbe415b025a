"""A DeepSeek-V2-style decoder with multi-head latent attention over packed sequences, in linen.

* **packed sequences**: several documents per row, told apart by ``segment_ids`` (0 is
  padding); positions restart at each document, computed in the model from the segment ids
  (``lax.cummax`` of each document's first index); the attention mask is the same-document,
  causal, not-padding mask, passed to ``jax.nn.dot_product_attention`` (JAX's own attention)
  with an explicit ``scale``;
* **multi-head latent attention**: queries through a low-rank bottleneck (``q_a``, RMSNorm,
  ``q_b``), keys and values from one compressed latent (``kv_a`` gives the latent and a shared
  rotary key, split by ``jnp.split`` at an index; RMSNorm; ``kv_b`` expands the latent into
  per-head keys and values, split again; the value padded to the key's head dim for
  ``jax.nn.dot_product_attention`` and the output sliced back, as MaxText does), the rotary
  key computed once per token and broadcast to every head (``jnp.broadcast_to``), query and
  key each the concatenation of a rotary part and a position-free part;
* **rotary embedding by complex numbers**, as DeepSeek's reference code does it
  (``view_as_complex``): adjacent pairs made complex by ``lax.complex``, multiplied by
  ``exp(i * theta)`` (``jnp.exp`` of an imaginary array), back by ``real`` and ``imag``;
* SwiGLU MLP, RMSNorm written by hand, untied head; the loss: next-token cross-entropy over
  the pairs inside one document, averaged over them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from corpus._jit import init_linen


class RMSNorm(nn.Module):
    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return w * x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)


def positions_of(segment_ids: jax.Array) -> jax.Array:
    """Each token's position inside its document: its index less its document's first."""
    idx = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    starts = jnp.where(segment_ids != prev, idx, 0)
    return idx - lax.cummax(starts, axis=1)


def rotate(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """RoPE on the last dim by complex multiplication; ``x``: [B, S, ..., d], positions [B, S]."""
    d = x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=x.dtype) / d)
    angles = positions[..., None].astype(x.dtype) * freqs  # [B, S, d/2]
    rot = jnp.exp(1j * angles.astype(jnp.result_type(x.dtype, jnp.complex64)))
    rot = rot.reshape(rot.shape[:2] + (1,) * (x.ndim - 3) + rot.shape[-1:])
    pairs = x.reshape(x.shape[:-1] + (d // 2, 2))
    z = lax.complex(pairs[..., 0], pairs[..., 1]) * rot
    return jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1).reshape(x.shape)


class MLA(nn.Module):
    heads: int
    q_rank: int
    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        b, s, d = x.shape
        h, qk = self.heads, self.nope_dim + self.rope_dim
        dense = lambda n, name: nn.Dense(n, use_bias=False, param_dtype=self.param_dtype,  # noqa: E731
                                         name=name)
        q = dense(h * qk, "q_b")(RMSNorm(param_dtype=self.param_dtype, name="q_norm")(
            dense(self.q_rank, "q_a")(x))).reshape(b, s, h, qk)
        q_nope, q_rope = jnp.split(q, [self.nope_dim], axis=-1)
        kv = dense(self.kv_rank + self.rope_dim, "kv_a")(x)
        latent, k_rope = jnp.split(kv, [self.kv_rank], axis=-1)
        kv = dense(h * (self.nope_dim + self.v_dim), "kv_b")(
            RMSNorm(param_dtype=self.param_dtype, name="kv_norm")(latent))
        k_nope, v = jnp.split(kv.reshape(b, s, h, self.nope_dim + self.v_dim),
                              [self.nope_dim], axis=-1)
        k_rope = jnp.broadcast_to(rotate(k_rope, positions)[:, :, None],
                                  (b, s, h, self.rope_dim))
        q = jnp.concatenate([q_nope, rotate(q_rope, positions)], axis=-1)
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        # JAX's attention wants the value's head dim equal to the key's: pad it, then slice
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qk - self.v_dim)))
        o = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=qk ** -0.5)
        o = o[..., :self.v_dim]
        return dense(d, "o_proj")(o.reshape(b, s, h * self.v_dim))


class Layer(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, mask):
        d = x.shape[-1]
        x = x + MLA(self.heads, q_rank=d // 2, kv_rank=d // 2, nope_dim=8, rope_dim=4,
                    v_dim=4, param_dtype=self.param_dtype, name="self_attn")(
            RMSNorm(param_dtype=self.param_dtype, name="input_layernorm")(x), positions, mask)
        y = RMSNorm(param_dtype=self.param_dtype, name="post_attention_layernorm")(x)
        dense = lambda n, name: nn.Dense(n, use_bias=False, param_dtype=self.param_dtype,  # noqa: E731
                                         name=name)
        y = nn.silu(dense(2 * d, "gate_proj")(y)) * dense(2 * d, "up_proj")(y)
        return x + dense(d, "down_proj")(y)


class Decoder(nn.Module):
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    depth: int = 2
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
        positions = positions_of(segment_ids)
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
        mask = same & causal[None] & (segment_ids != 0)[:, :, None]
        x = nn.Embed(self.vocab, self.dim, param_dtype=self.param_dtype,
                     name="embed_tokens")(tokens)
        for i in range(self.depth):
            x = Layer(self.heads, self.param_dtype, name=f"layers_{i}")(x, positions, mask)
        x = RMSNorm(param_dtype=self.param_dtype, name="norm")(x)
        return nn.Dense(self.vocab, use_bias=False, param_dtype=self.param_dtype,
                        name="lm_head")(x)


def pack(key: jax.Array, batch_size: int, seq: int, vocab: int):
    """Rows of documents of random lengths (3 to 8 tokens), the tail of each row padding."""
    tokens = jax.random.randint(key, (batch_size, seq), 1, vocab)
    segments = []
    for r in range(batch_size):
        row, doc, lengths = [], 1, jax.random.randint(jax.random.fold_in(key, r), (seq,), 3, 9)
        for n in map(int, lengths):
            if len(row) + n > seq - r % 3:
                break
            row += [doc] * n
            doc += 1
        segments.append(row + [0] * (seq - len(row)))
    return tokens, jnp.asarray(segments, jnp.int32)


def make(*, dtype=jnp.float32, batch_size: int = 8, seq: int = 16, seed: int = 0,
         compiler_options=None, **config):
    """The decoder's ``(loss_fn, params, batch)``: next-token cross-entropy inside documents."""
    model = Decoder(param_dtype=dtype, **config)
    k_init, k_data = jax.random.split(jax.random.key(seed))
    tokens, segments = pack(k_data, batch_size, seq, model.vocab)
    params = init_linen(model.init, k_init, tokens, segments,
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        tokens, seg = batch["tokens"], batch["segment_ids"]
        logits = model.apply({"params": params}, tokens, seg)[:, :-1]
        keep = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)).astype(logits.dtype)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return (ce * keep).sum() / keep.sum()

    return loss_fn, params, {"tokens": tokens, "segment_ids": segments}
