"""An nnx decoder that carries a key/value cache its training loss never reads.

Written the way nnx generation-ready decoders are: each attention layer holds `nnx.Cache`
variables (keys, values and a write index) and, on every call, writes the new keys and values
into them with ``jax.lax.dynamic_update_slice`` at the index and advances it, as decoding
does, then attends over the current call's keys (a causal mask built with ``jnp.full`` and
``jnp.where``). In training the cache writes are values computed and dropped: the loss reads
only the logits. Pre-LN blocks (`nnx.LayerNorm`), a GELU MLP, an `nnx.Embed` tied to the
output by ``embed.attend``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from corpus._jit import create_nnx


class CachedAttention(nnx.Module):
    def __init__(self, d_model: int, heads: int, max_len: int, batch_size: int, *, param_dtype,
                 rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, param_dtype=param_dtype, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, param_dtype=param_dtype, rngs=rngs)
        shape = (batch_size, max_len, heads, d_model // heads)
        self.cache_k = nnx.Cache(jnp.zeros(shape, param_dtype))
        self.cache_v = nnx.Cache(jnp.zeros(shape, param_dtype))
        self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads) for y in (q, k, v))
        i = self.cache_index[...]
        at = (jnp.zeros_like(i), i, jnp.zeros_like(i), jnp.zeros_like(i))
        self.cache_k[...] = jax.lax.dynamic_update_slice(self.cache_k[...], k, at)
        self.cache_v[...] = jax.lax.dynamic_update_slice(self.cache_v[...], v, at)
        self.cache_index[...] = i + t
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // self.heads) ** -0.5
        causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
        scores = jnp.where(causal, scores, jnp.full(scores.shape, -1e9, scores.dtype))
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.out(att.reshape(b, t, d))


class Block(nnx.Module):
    def __init__(self, d_model: int, heads: int, max_len: int, batch_size: int, *, param_dtype,
                 rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        self.attn = CachedAttention(d_model, heads, max_len, batch_size,
                                    param_dtype=param_dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        self.fc1 = nnx.Linear(d_model, 4 * d_model, param_dtype=param_dtype, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d_model, d_model, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class CachedDecoder(nnx.Module):
    def __init__(self, *, vocab_size: int, d_model: int, heads: int, num_layers: int,
                 max_len: int, batch_size: int, param_dtype, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, d_model, param_dtype=param_dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, heads, max_len, batch_size,
                                      param_dtype=param_dtype, rngs=rngs)
                                for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(d_model, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.ln_f(x))


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, vocab_size: int = 32,
         d_model: int = 16, heads: int = 4, num_layers: int = 2, seed: int = 0,
         compiler_options=None):
    """The cached decoder's ``(loss_fn, model, batch)``: next-token cross-entropy."""
    model = create_nnx(lambda: CachedDecoder(
        vocab_size=vocab_size, d_model=d_model, heads=heads, num_layers=num_layers,
        max_len=2 * seq_len, batch_size=batch_size, param_dtype=dtype, rngs=nnx.Rngs(seed)),
        compiler_options=compiler_options)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch_size, seq_len + 1), 0,
                                vocab_size, jnp.int32)

    def loss_fn(model, batch):
        logits = model(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, model, {"tokens": tokens}
