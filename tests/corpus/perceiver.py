"""A Perceiver IO-style classifier (Jaegle et al., 2021), in linen.

* a learned latent array ``[N, D]`` (a parameter with no batch dim) ``jnp.broadcast_to`` the
  batch;
* one cross-attention from the latents (queries) to the inputs (keys and values: a Dense
  embedding of the features plus Fourier position features built by ``jnp.linspace``,
  ``jnp.sin``/``jnp.cos`` and concatenated), with a padding mask from the batch's lengths by
  ``jnp.arange`` < length;
* two latent self-attention blocks sharing one module's weights (Perceiver's weight sharing:
  the same ``Block`` instance called twice);
* a decoder query (a learned ``[1, D]``) cross-attending to the latents, and a classifier.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class Block(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, q: jax.Array, kv: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        pd = self.param_dtype
        h = nn.LayerNorm(param_dtype=pd, name="norm_q")(q)
        kv = nn.LayerNorm(param_dtype=pd, name="norm_kv")(kv)
        q = q + nn.MultiHeadDotProductAttention(self.heads, param_dtype=pd, name="attn")(
            h, kv, mask=mask)
        h = nn.LayerNorm(param_dtype=pd, name="norm_mlp")(q)
        h = nn.Dense(2 * q.shape[-1], param_dtype=pd, name="fc1")(h)
        return q + nn.Dense(q.shape[-1], param_dtype=pd, name="fc2")(nn.gelu(h))


class Perceiver(nn.Module):
    latents: int = 8
    width: int = 16
    heads: int = 4
    bands: int = 4
    classes: int = 5
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        pd = self.param_dtype
        b, t, _ = x.shape
        pos = jnp.linspace(-1.0, 1.0, t, dtype=x.dtype)[:, None] * jnp.arange(
            1, self.bands + 1, dtype=x.dtype) * jnp.pi
        fourier = jnp.concatenate([jnp.sin(pos), jnp.cos(pos)], axis=-1)
        x = jnp.concatenate([x, jnp.broadcast_to(fourier, (b, t, 2 * self.bands))], axis=-1)
        inputs = nn.Dense(self.width, param_dtype=pd, name="embed")(x)

        latent = self.param("latents", nn.initializers.normal(0.02),
                            (self.latents, self.width), pd)
        z = jnp.broadcast_to(latent, (b, self.latents, self.width))
        valid = jnp.arange(t)[None, :] < lengths[:, None]
        mask = nn.make_attention_mask(jnp.ones((b, self.latents), bool), valid)
        z = Block(self.heads, pd, name="cross")(z, inputs, mask)
        latent_block = Block(self.heads, pd, name="latent")
        for _ in range(2):
            z = latent_block(z, z)
        query = self.param("query", nn.initializers.normal(0.02), (1, self.width), pd)
        out = Block(self.heads, pd, name="decode")(
            jnp.broadcast_to(query, (b, 1, self.width)), z)
        return nn.Dense(self.classes, param_dtype=pd, name="head")(out[:, 0])


def make(*, dtype=jnp.float32, batch_size: int = 8, tokens: int = 12, features: int = 4,
         seed: int = 0, compiler_options=None):
    """Perceiver's ``(loss_fn, params, batch)``: batch ``{"x": [B, T, F], "lengths": [B],
    "labels": [B]}``."""
    model = Perceiver(param_dtype=dtype)
    k_init, k_x, k_l, k_y = jax.random.split(jax.random.key(seed), 4)
    batch = {"x": jax.random.normal(k_x, (batch_size, tokens, features), dtype),
             "lengths": jax.random.randint(k_l, (batch_size,), tokens // 2, tokens + 1),
             "labels": jax.random.randint(k_y, (batch_size,), 0, model.classes)}
    params = init_linen(model.init, k_init, batch["x"], batch["lengths"],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"], batch["lengths"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss_fn, params, batch
