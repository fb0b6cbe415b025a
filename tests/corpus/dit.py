"""A diffusion transformer (DiT) trained to predict noise, written the way its ports write it,
in nnx.

* **patchify by reshape and transpose** of the noisy latents, a linear patch embedding, a fixed
  2D sine-cosine position embedding (a NumPy constant);
* the **timestep** embedded by sinusoids (``jnp.exp(-log(10000) * arange / half)``, cos and
  sin concatenated) and an MLP with SiLU; the **class label** embedded by ``nnx.Embed`` with a
  null class, **classifier-free guidance's label dropout** by ``jnp.where`` of a Bernoulli
  draw from the model's ``nnx.Rngs``;
* **adaLN-Zero** blocks: the conditioning through SiLU and one Dense into six modulations,
  ``jnp.split`` into shift, scale and gate for the attention and the MLP, LayerNorms without
  parameters, ``x * (1 + scale[:, None]) + shift[:, None]``, gated residuals, the modulation
  Dense initialised to zero (a zero-initialised leaf: its first gradient is the only signal);
* the **final layer** modulated the same way, unpatchified back to ``[B, H, W, 2C]`` and
  split into the predicted noise and the learned variance's interpolation (``jnp.split``), the
  loss the MSE of the noise plus a small penalty on the variance output;
* the forward diffusion inside the loss: ``sqrt(abar_t) x0 + sqrt(1 - abar_t) eps`` with the
  cumulative product of a linear beta schedule (``jnp.cumprod``) gathered at each sample's t.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from corpus._jit import create_nnx


def sincos_2d(dim: int, grid: int) -> np.ndarray:
    """DiT's fixed ``[grid * grid, dim]`` position embedding."""
    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    gh, gw = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))
    return np.concatenate([one_d(dim // 2, gh), one_d(dim // 2, gw)], axis=1)


def timestep_embedding(t: jax.Array, dim: int, dtype) -> jax.Array:
    half = dim // 2
    freqs = jnp.exp(-math.log(10000) * jnp.arange(half, dtype=dtype) / half)
    args = t[:, None].astype(dtype) * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    return x * (1 + scale[:, None]) + shift[:, None]


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, *, dtype, rngs: nnx.Rngs):
        kw = dict(param_dtype=dtype, rngs=rngs)
        self.norm1 = nnx.LayerNorm(dim, use_scale=False, use_bias=False, epsilon=1e-6, **kw)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, **kw)
        self.norm2 = nnx.LayerNorm(dim, use_scale=False, use_bias=False, epsilon=1e-6, **kw)
        self.fc1 = nnx.Linear(dim, 4 * dim, **kw)
        self.fc2 = nnx.Linear(4 * dim, dim, **kw)
        self.adaLN_modulation = nnx.Linear(dim, 6 * dim, kernel_init=nnx.initializers.zeros,
                                           **kw)

    def __call__(self, x: jax.Array, c: jax.Array) -> jax.Array:
        mods = self.adaLN_modulation(nnx.silu(c))
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = jnp.split(mods, 6, axis=-1)
        h = modulate(self.norm1(x), shift_a, scale_a)
        x = x + gate_a[:, None] * self.attn(h)
        h = modulate(self.norm2(x), shift_m, scale_m)
        return x + gate_m[:, None] * self.fc2(nnx.gelu(self.fc1(h), approximate=True))


class DiT(nnx.Module):
    def __init__(self, *, size: int = 8, channels: int = 4, patch: int = 2, dim: int = 16,
                 heads: int = 4, depth: int = 2, num_classes: int = 8, class_dropout=0.25,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(param_dtype=dtype, rngs=rngs)
        self.patch, self.channels, self.dim = patch, channels, dim
        self.num_classes, self.class_dropout = num_classes, class_dropout
        self.grid = size // patch
        self.x_embedder = nnx.Linear(patch * patch * channels, dim, **kw)
        self.t_fc1 = nnx.Linear(dim, dim, **kw)
        self.t_fc2 = nnx.Linear(dim, dim, **kw)
        self.y_embedder = nnx.Embed(num_classes + 1, dim, **kw)
        self.blocks = nnx.List([Block(dim, heads, dtype=dtype, rngs=rngs)
                                for _ in range(depth)])
        self.final_norm = nnx.LayerNorm(dim, use_scale=False, use_bias=False, **kw)
        self.final_modulation = nnx.Linear(dim, 2 * dim, **kw)
        self.final_linear = nnx.Linear(dim, patch * patch * 2 * channels, **kw)
        self.pos = nnx.Variable(jnp.asarray(sincos_2d(dim, self.grid), dtype))
        self.dropout_rngs = nnx.Rngs(label_dropout=7)

    def __call__(self, x: jax.Array, t: jax.Array, y: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        p, g = self.patch, self.grid
        x = x.reshape(b, g, p, g, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, g * g, p * p * c)
        x = self.x_embedder(x) + self.pos[...][None]
        temb = timestep_embedding(t, self.dim, x.dtype)
        temb = self.t_fc2(nnx.silu(self.t_fc1(temb)))
        drop = jax.random.bernoulli(self.dropout_rngs.label_dropout(), self.class_dropout,
                                    y.shape)
        yemb = self.y_embedder(jnp.where(drop, self.num_classes, y))
        cond = temb + yemb
        for block in self.blocks:
            x = block(x, cond)
        shift, scale = jnp.split(self.final_modulation(nnx.silu(cond)), 2, axis=-1)
        x = self.final_linear(modulate(self.final_norm(x), shift, scale))
        x = x.reshape(b, g, g, p, p, 2 * c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(b, h, w, 2 * c)


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 8, channels: int = 4,
         steps: int = 100, seed: int = 0, compiler_options=None, **config):
    """The DiT's ``(loss_fn, model, batch)``: the noise-prediction MSE (and a small penalty on
    the variance output) at each sample's random timestep."""
    model = create_nnx(lambda: DiT(size=size, channels=channels, dtype=dtype,
                                   rngs=nnx.Rngs(seed), **config),
                       compiler_options=compiler_options)
    k_x, k_t, k_y, k_e = jax.random.split(jax.random.key(seed + 1), 4)
    batch = {
        "latents": jax.random.normal(k_x, (batch_size, size, size, channels), dtype),
        "t": jax.random.randint(k_t, (batch_size,), 0, steps),
        "label": jax.random.randint(k_y, (batch_size,), 0, 8),
        "noise": jax.random.normal(k_e, (batch_size, size, size, channels), dtype),
    }

    def loss_fn(model, batch):
        x0, t, eps = batch["latents"], batch["t"], batch["noise"]
        betas = jnp.linspace(1e-4, 0.02, steps, dtype=x0.dtype)
        abar = jnp.cumprod(1.0 - betas)[t][:, None, None, None]
        xt = jnp.sqrt(abar) * x0 + jnp.sqrt(1.0 - abar) * eps
        out = model(xt, t, batch["label"])
        pred, var = jnp.split(out, 2, axis=-1)
        return jnp.mean((pred - eps) ** 2) + 1e-3 * jnp.mean(var ** 2)

    return loss_fn, model, batch
