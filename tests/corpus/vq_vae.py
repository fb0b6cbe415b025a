"""A VQ-VAE (van den Oord et al., 2017), in linen: a convolutional autoencoder whose latents
are snapped to their nearest codebook vectors.

* an encoder of two stride-2 convolutions, ``[B, 8, 8, 3] -> [B, 2, 2, D]``;
* **vector quantisation**: squared distances to a ``[K, D]`` codebook (``|z|^2 - 2 z.c +
  |c|^2``), ``jnp.argmin`` over the codes, the chosen codes gathered by ``jnp.take``; the
  codebook loss ``|sg(z) - q|^2`` and the commitment loss ``beta |z - sg(q)|^2``
  (``jax.lax.stop_gradient``), and the **straight-through estimator** written the way the
  paper's code writes it, ``z + sg(q - z)``, so the decoder's gradient reaches the encoder;
* a decoder of two stride-2 ``nn.ConvTranspose`` layers, the mean squared reconstruction error.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen

BETA = 0.25


class VQVAE(nn.Module):
    codes: int = 16
    latent: int = 8
    width: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        conv = dict(kernel_size=(3, 3), strides=(2, 2), param_dtype=self.param_dtype)
        h = nn.relu(nn.Conv(self.width, name="enc_0", **conv)(images))
        z = nn.Conv(self.latent, name="enc_1", **conv)(h)                 # [B, 2, 2, D]
        codebook = self.param("codebook", nn.initializers.uniform(1.0 / self.codes),
                              (self.codes, self.latent), self.param_dtype)
        dist = ((z ** 2).sum(-1, keepdims=True) - 2 * z @ codebook.T
                + (codebook ** 2).sum(-1))
        q = jnp.take(codebook, jnp.argmin(dist, axis=-1), axis=0)
        sg = jax.lax.stop_gradient
        vq_loss = ((sg(z) - q) ** 2).mean() + BETA * ((z - sg(q)) ** 2).mean()
        q_st = z + sg(q - z)
        h = nn.relu(nn.ConvTranspose(self.width, name="dec_0", **conv)(q_st))
        out = nn.ConvTranspose(images.shape[-1], name="dec_1", **conv)(h)
        return out, vq_loss


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 8, seed: int = 0,
         compiler_options=None):
    """The VQ-VAE's ``(loss_fn, params, batch)``: reconstruction plus the codebook losses."""
    model = VQVAE(param_dtype=dtype)
    k_init, k_x = jax.random.split(jax.random.key(seed))
    images = jax.random.uniform(k_x, (batch_size, size, size, 3), dtype)
    params = init_linen(model.init, k_init, images, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        out, vq_loss = model.apply({"params": params}, batch["images"])
        return ((out - batch["images"]) ** 2).mean() + vq_loss

    return loss_fn, params, {"images": images}
