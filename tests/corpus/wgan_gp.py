"""A WGAN-GP critic step, written as GAN code is, in linen.

* a convolutional critic (strided convolutions, LeakyReLU, **no batch norm**: the gradient
  penalty is per sample, so WGAN-GP uses LayerNorm or none) and a generator (Dense, reshape,
  ``nn.ConvTranspose``) in one parameter tree;
* the critic's loss: ``D(fake) - D(real)`` with the fakes from the generator under
  ``lax.stop_gradient`` (the critic's step), plus the **gradient penalty**: per sample, the
  norm of ``jax.grad`` of the critic with respect to its input at a random interpolation of real
  and fake, ``(|g| - 1)^2``, by ``jax.vmap`` of ``jax.grad`` (a second-order derivative in
  the step's backward), the interpolation weights drawn per sample;
* the generator's loss added (``-D(G(z))``) so both parameter sets get gradients, as a
  single-step training loop that alternates them by masks would.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


class Critic(nn.Module):
    width: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, 8, 8, 1] -> [B]
        kw = dict(param_dtype=self.param_dtype)
        h = nn.leaky_relu(nn.Conv(self.width, (3, 3), strides=2, name="conv_0", **kw)(x), 0.2)
        h = nn.leaky_relu(nn.Conv(2 * self.width, (3, 3), strides=2, name="conv_1", **kw)(h),
                          0.2)
        return nn.Dense(1, name="out", **kw)(h.reshape(h.shape[0], -1))[:, 0]


class Generator(nn.Module):
    width: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:  # [B, Z] -> [B, 8, 8, 1]
        kw = dict(param_dtype=self.param_dtype)
        h = nn.relu(nn.Dense(4 * 4 * self.width, name="fc", **kw)(z))
        h = h.reshape(z.shape[0], 4, 4, self.width)
        return jnp.tanh(nn.ConvTranspose(1, (3, 3), strides=(2, 2), name="deconv", **kw)(h))


class GAN(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.critic = Critic(param_dtype=self.param_dtype)
        self.generator = Generator(param_dtype=self.param_dtype)

    def __call__(self, z, x):
        return self.critic(x) + self.critic(self.generator(z))


def make(*, dtype=jnp.float32, batch_size: int = 8, latent: int = 16, gp_weight: float = 10.0,
         seed: int = 0, compiler_options=None):
    """The WGAN-GP's ``(loss_fn, params, batch)``: critic loss with gradient penalty, plus the
    generator's loss."""
    gan = GAN(param_dtype=dtype)
    k_init, k_x, k_z, k_e = jax.random.split(jax.random.key(seed), 4)
    real = jax.random.normal(k_x, (batch_size, 8, 8, 1), dtype)
    z = jax.random.normal(k_z, (batch_size, latent), dtype)
    eps = jax.random.uniform(k_e, (batch_size,), dtype)
    params = init_linen(gan.init, k_init, z, real, compiler_options=compiler_options)["params"]

    def critic(p, x):
        return gan.apply({"params": p}, x, method=lambda m, x: m.critic(x))

    def generator(p, z):
        return gan.apply({"params": p}, z, method=lambda m, z: m.generator(z))

    def loss_fn(params, batch):
        fake = generator(params, batch["z"])
        d_real = critic(params, batch["real"])
        d_fake = critic(params, jax.lax.stop_gradient(fake))
        e = batch["eps"][:, None, None, None]
        mixed = e * batch["real"] + (1 - e) * jax.lax.stop_gradient(fake)

        def one(x):  # the critic's gradient at one sample
            return jax.grad(lambda x: critic(params, x[None])[0])(x)

        g = jax.vmap(one)(mixed)
        norm = jnp.sqrt(jnp.sum(g ** 2, axis=(1, 2, 3)) + 1e-12)
        critic_loss = jnp.mean(d_fake - d_real) + gp_weight * jnp.mean((norm - 1.0) ** 2)
        gen_loss = -jnp.mean(critic(jax.lax.stop_gradient(params), fake))
        return critic_loss + gen_loss

    return loss_fn, params, {"real": real, "z": z, "eps": eps}
