"""A Glow normalizing flow, written the way flow code writes it, in linen.

* **squeeze** ``[B, H, W, C] -> [B, H/2, W/2, 4C]`` by reshape and transpose;
* flow steps: **ActNorm** (per-channel scale and bias; log-determinant ``H W sum log|s|``),
  an **invertible 1x1 convolution** (a ``C x C`` matrix applied by ``jnp.einsum``, its
  log-determinant ``H W`` times ``jnp.linalg.slogdet`` of the matrix: an LU factorisation in
  the step), an **affine coupling** (``jnp.split`` of the channels, a small convolutional
  network on one half whose zero-initialised last convolution gives shift and raw scale,
  split again; ``sigmoid(raw + 2)`` as the scale, the log-determinant its log summed);
* the loss: negative log-likelihood in bits per dimension of dequantised inputs (uniform
  noise added), the standard normal prior's log density plus the summed log-determinants.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


def squeeze(x):
    b, h, w, c = x.shape
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h // 2, w // 2, 4 * c)


class ActNorm(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        log_scale = self.param("log_scale", nn.initializers.normal(0.05), (c,), self.param_dtype)
        bias = self.param("bias", nn.initializers.normal(0.05), (c,), self.param_dtype)
        logdet = x.shape[1] * x.shape[2] * jnp.sum(log_scale)
        return (x + bias) * jnp.exp(log_scale), jnp.broadcast_to(logdet, x.shape[:1])


class InvConv1x1(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        w = self.param("weight", lambda k, s, d: jnp.linalg.qr(
            jax.random.normal(k, s, d))[0], (c, c), self.param_dtype)
        _, logabsdet = jnp.linalg.slogdet(w)
        y = jnp.einsum("bhwc,dc->bhwd", x, w)
        return y, jnp.broadcast_to(x.shape[1] * x.shape[2] * logabsdet, x.shape[:1])


class Coupling(nn.Module):
    hidden: int = 16
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        kw = dict(param_dtype=self.param_dtype)
        x1, x2 = jnp.split(x, 2, axis=-1)
        h = nn.relu(nn.Conv(self.hidden, (3, 3), name="conv_in", **kw)(x1))
        h = nn.Conv(c, (3, 3), kernel_init=nn.initializers.zeros, name="conv_out", **kw)(h)
        shift, raw = jnp.split(h, 2, axis=-1)
        scale = nn.sigmoid(raw + 2.0)
        y2 = (x2 + shift) * scale
        return (jnp.concatenate([x1, y2], axis=-1),
                jnp.sum(jnp.log(scale), axis=(1, 2, 3)))


class Glow(nn.Module):
    steps: int = 2
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = squeeze(x)
        total = jnp.zeros(x.shape[:1], x.dtype)
        for i in range(self.steps):
            for layer in (ActNorm(self.param_dtype, name=f"step_{i}_actnorm"),
                          InvConv1x1(self.param_dtype, name=f"step_{i}_invconv"),
                          Coupling(param_dtype=self.param_dtype, name=f"step_{i}_coupling")):
                x, logdet = layer(x)
                total = total + logdet
        return x, total


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 8, channels: int = 2,
         seed: int = 0, compiler_options=None, **config):
    """Glow's ``(loss_fn, params, batch)``: bits per dimension of dequantised images."""
    model = Glow(param_dtype=dtype, **config)
    k_init, k_x, k_u = jax.random.split(jax.random.key(seed), 3)
    pixels = jax.random.randint(k_x, (batch_size, size, size, channels), 0, 256)
    noise = jax.random.uniform(k_u, pixels.shape, dtype)
    params = init_linen(model.init, k_init, jnp.zeros(pixels.shape, dtype),
                        compiler_options=compiler_options)["params"]
    dims = size * size * channels

    def loss_fn(params, batch):
        x = (batch["pixels"].astype(batch["noise"].dtype) + batch["noise"]) / 256.0 - 0.5
        z, logdet = model.apply({"params": params}, x)
        log_pz = -0.5 * jnp.sum(z ** 2 + math.log(2 * math.pi), axis=(1, 2, 3))
        nll = -(log_pz + logdet) + dims * math.log(256.0)
        return jnp.mean(nll) / (dims * math.log(2.0))

    return loss_fn, params, {"pixels": pixels, "noise": noise}
