"""A masked autoencoder (He et al., 2022), in linen, as its reference code writes it.

* patches by ``reshape``/``transpose`` of the image, embedded by a ``Dense``, plus a learned
  position embedding;
* **random masking per sample**: uniform noise from a fixed key, ``jnp.argsort`` of it twice
  (the shuffle and its inverse), the kept quarter gathered by ``jnp.take_along_axis`` with
  per-sample indices broadcast over the features;
* a one-block pre-norm transformer encoder over the kept patches alone;
* the decoder: a learned mask token ``jnp.tile``'d to the dropped positions, the sequence
  unshuffled by ``take_along_axis`` with the inverse indices, a decoder block, a per-patch
  pixel head;
* the loss: per-patch normalised pixel targets (``norm_pix_loss``), the squared error averaged
  over the **masked patches only** (a 0/1 mask built by ``jnp.ones``/``.at[].set`` and unshuffled
  the same way).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


class Block(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pd = self.param_dtype
        h = nn.LayerNorm(param_dtype=pd, name="norm1")(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads, param_dtype=pd, name="attn")(h, h)
        h = nn.LayerNorm(param_dtype=pd, name="norm2")(x)
        h = nn.Dense(2 * x.shape[-1], param_dtype=pd, name="fc1")(h)
        return x + nn.Dense(x.shape[-1], param_dtype=pd, name="fc2")(nn.gelu(h))


class MAE(nn.Module):
    patch: int = 4
    width: int = 16
    decoder_width: int = 8
    heads: int = 4
    keep: float = 0.25
    param_dtype: jnp.dtype = jnp.float32

    def patchify(self, images: jax.Array) -> jax.Array:
        b, h, w, c = images.shape
        p = self.patch
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(b, (h // p) * (w // p), p * p * c)

    @nn.compact
    def __call__(self, images: jax.Array, noise: jax.Array) -> jax.Array:
        pd = self.param_dtype
        patches = self.patchify(images)
        b, n, d = patches.shape
        x = nn.Dense(self.width, param_dtype=pd, name="patch_embed")(patches)
        x = x + self.param("pos_embed", nn.initializers.normal(0.02), (1, n, self.width), pd)

        kept = int(n * self.keep)
        ids_shuffle = jnp.argsort(noise, axis=1)
        ids_restore = jnp.argsort(ids_shuffle, axis=1)
        ids_keep = ids_shuffle[:, :kept]
        x = jnp.take_along_axis(x, ids_keep[:, :, None].repeat(self.width, axis=2), axis=1)
        mask = jnp.ones((b, n), x.dtype).at[:, :kept].set(0)
        mask = jnp.take_along_axis(mask, ids_restore, axis=1)

        x = Block(self.heads, pd, name="encoder")(x)
        x = nn.LayerNorm(param_dtype=pd, name="encoder_norm")(x)

        x = nn.Dense(self.decoder_width, param_dtype=pd, name="decoder_embed")(x)
        token = self.param("mask_token", nn.initializers.normal(0.02),
                           (1, 1, self.decoder_width), pd)
        x = jnp.concatenate([x, jnp.tile(token, (b, n - kept, 1))], axis=1)
        x = jnp.take_along_axis(x, ids_restore[:, :, None].repeat(self.decoder_width, axis=2),
                                axis=1)
        x = x + self.param("decoder_pos_embed", nn.initializers.normal(0.02),
                           (1, n, self.decoder_width), pd)
        x = Block(self.heads, pd, name="decoder")(x)
        pred = nn.Dense(d, param_dtype=pd, name="decoder_pred")(
            nn.LayerNorm(param_dtype=pd, name="decoder_norm")(x))

        mean = patches.mean(axis=-1, keepdims=True)
        var = patches.var(axis=-1, keepdims=True)
        target = (patches - mean) / (var + 1e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(axis=-1)
        return (loss * mask).sum() / mask.sum()


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 16, seed: int = 0,
         compiler_options=None):
    """MAE's ``(loss_fn, params, batch)``: batch ``{"images": [B, H, W, 3], "noise": [B, N]}``
    (the masking noise is part of the batch, as a data loader's seeded draw)."""
    model = MAE(param_dtype=dtype)
    k_init, k_x, k_n = jax.random.split(jax.random.key(seed), 3)
    n = (size // model.patch) ** 2
    batch = {"images": jax.random.normal(k_x, (batch_size, size, size, 3), dtype),
             "noise": jax.random.uniform(k_n, (batch_size, n), dtype)}
    params = init_linen(model.init, k_init, batch["images"], batch["noise"],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        return model.apply({"params": params}, batch["images"], batch["noise"])

    return loss_fn, params, batch
