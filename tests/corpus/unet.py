"""A diffusion U-Net in linen, as diffusers-style Flax code writes it.

A sinusoidal timestep embedding (``jnp.exp`` of an ``arange``, cos and sin concatenated) through
a two-layer MLP; residual blocks of **GroupNorm** (4 groups: the channels reshaped into groups
and normalised over space and the group's channels), swish and 3x3 convolutions, the time
embedding added per channel (``[:, None, None, :]``), a 1x1 shortcut where the channels change;
a strided downsampling convolution, self-attention over the 4x4 positions of the low
resolution (``nn.MultiHeadDotProductAttention`` on the flattened map), a **transposed
convolution** upsampling by 2 (``nn.ConvTranspose``: a convolution with a dilated input), a
skip connection concatenated on the channels. The loss is the noise-prediction MSE at noise
levels gathered from a cosine schedule by each sample's timestep.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


def timestep_embedding(t, dim: int):
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t[:, None].astype(jnp.float32) * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class ResBlock(nn.Module):
    out: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, temb):
        norm = lambda: nn.GroupNorm(num_groups=4, param_dtype=self.param_dtype)  # noqa: E731
        h = nn.Conv(self.out, (3, 3), padding=1, param_dtype=self.param_dtype)(
            nn.swish(norm()(x)))
        h = h + nn.Dense(self.out, param_dtype=self.param_dtype)(
            nn.swish(temb))[:, None, None, :]
        h = nn.Conv(self.out, (3, 3), padding=1, param_dtype=self.param_dtype)(
            nn.swish(norm()(h)))
        if x.shape[-1] != self.out:
            x = nn.Conv(self.out, (1, 1), param_dtype=self.param_dtype, name="shortcut")(x)
        return x + h


class Attention(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        b, hh, ww, c = x.shape
        h = nn.GroupNorm(num_groups=4, param_dtype=self.param_dtype)(x).reshape(b, hh * ww, c)
        h = nn.MultiHeadDotProductAttention(num_heads=2, param_dtype=self.param_dtype)(h, h)
        return x + h.reshape(b, hh, ww, c)


class UNet(nn.Module):
    ch: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, t):
        pd = self.param_dtype
        temb = timestep_embedding(t, self.ch).astype(x.dtype)
        temb = nn.Dense(4 * self.ch, param_dtype=pd)(temb)
        temb = nn.Dense(4 * self.ch, param_dtype=pd)(nn.swish(temb))
        h0 = nn.Conv(self.ch, (3, 3), padding=1, param_dtype=pd, name="stem")(x)
        h1 = ResBlock(self.ch, pd)(h0, temb)
        down = nn.Conv(2 * self.ch, (3, 3), strides=(2, 2), padding=1, param_dtype=pd,
                       name="down")(h1)
        h2 = Attention(pd)(ResBlock(2 * self.ch, pd)(down, temb))
        mid = ResBlock(2 * self.ch, pd)(h2, temb)
        up = nn.ConvTranspose(self.ch, (2, 2), strides=(2, 2), param_dtype=pd, name="up")(mid)
        u = ResBlock(self.ch, pd)(jnp.concatenate([up, h1], axis=-1), temb)
        u = nn.swish(nn.GroupNorm(num_groups=4, param_dtype=pd)(u))
        return nn.Conv(x.shape[-1], (3, 3), padding=1, param_dtype=pd, name="out")(u)


def make(*, dtype=jnp.float32, batch_size: int = 8, image_size: int = 8, channels: int = 8,
         seed: int = 0, compiler_options=None):
    """The U-Net's ``(loss_fn, params, batch)``."""
    model = UNet(ch=channels, param_dtype=dtype)
    k_init, k_x, k_t, k_n = jax.random.split(jax.random.key(seed), 4)
    images = jax.random.normal(k_x, (batch_size, image_size, image_size, 3), dtype)
    steps = jax.random.randint(k_t, (batch_size,), 0, 1000)
    noise = jax.random.normal(k_n, images.shape, dtype)
    params = init_linen(model.init, k_init, images, steps,
                        compiler_options=compiler_options)["params"]
    alphas = (jnp.cos(jnp.linspace(0.0, 1.5, 1000)) ** 2).astype(dtype)

    def loss_fn(params, batch):
        a = alphas[batch["t"]][:, None, None, None]
        noisy = jnp.sqrt(a) * batch["image"] + jnp.sqrt(1.0 - a) * batch["noise"]
        predicted = model.apply({"params": params}, noisy, batch["t"])
        return jnp.mean((predicted - batch["noise"]) ** 2)

    return loss_fn, params, {"image": images, "t": steps, "noise": noise}
