"""A spectrally normalised GAN discriminator step (Miyato et al., 2018), in linen, with Flax's
own wrappers: ``nn.SpectralNorm`` around the convolutions and ``nn.WeightNorm`` around the
head.

* ``nn.SpectralNorm``: one power iteration per call on the kernel reshaped to a matrix, its
  vector ``u`` and ``sigma`` kept in the ``batch_stats`` collection (mutable, updated by the
  call and discarded by the loss, as a training loop that does not carry them would), the
  kernel divided by ``sigma`` (the power iteration's vectors under ``stop_gradient``);
* ``nn.WeightNorm`` on the last ``Dense``: its kernel rescaled by a learned scale over its norm;
* leaky ReLUs, a global sum pool, and the hinge loss on real images (the batch) and fake
  ones (a fixed per-sample transform of them, standing in for a generator's output).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


class Discriminator(nn.Module):
    width: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pd = self.param_dtype
        for i, w in enumerate((self.width, 2 * self.width)):
            conv = nn.Conv(w, (3, 3), strides=(2, 2), param_dtype=pd, name=f"conv_{i}")
            x = nn.SpectralNorm(conv, name=f"sn_{i}")(x, update_stats=True)
            x = nn.leaky_relu(x, 0.1)
        x = x.sum(axis=(1, 2))
        return nn.WeightNorm(nn.Dense(1, param_dtype=pd, name="head"), name="wn")(x)[:, 0]


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 8, seed: int = 0,
         compiler_options=None):
    """The discriminator's ``(loss_fn, params, batch)``: batch ``{"images": [B, H, W, 3],
    "shift": [B, 1, 1, 3]}`` (fake images are ``tanh(images + shift)``)."""
    model = Discriminator(param_dtype=dtype)
    k_init, k_x, k_s = jax.random.split(jax.random.key(seed), 3)
    batch = {"images": jax.random.normal(k_x, (batch_size, size, size, 3), dtype),
             "shift": jax.random.normal(k_s, (batch_size, 1, 1, 3), dtype)}
    variables = init_linen(model.init, k_init, batch["images"],
                           compiler_options=compiler_options)
    params, stats = variables["params"], variables["batch_stats"]

    def loss_fn(params, batch):
        def score(x):
            out, _ = model.apply({"params": params, "batch_stats": stats}, x,
                                 mutable=["batch_stats"])
            return out
        real = score(batch["images"])
        fake = score(jnp.tanh(batch["images"] + batch["shift"]))
        return jax.nn.relu(1.0 - real).mean() + jax.nn.relu(1.0 + fake).mean()

    return loss_fn, params, batch
