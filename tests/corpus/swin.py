"""A Swin Transformer image classifier, written the way its ports write it, in linen.

* **patch embedding by reshape and transpose** (no convolution): ``[B, H, W, C] ->
  [B, H/p, p, W/p, p, C] -> [B, H/p, W/p, p * p * C]`` and a Dense;
* **window attention**: the feature map partitioned into ``w x w`` windows by reshape and
  transpose, the windows folded into the batch, attention inside each window by
  ``jax.nn.dot_product_attention`` with a bias;
* a **relative position bias table** (``[(2w - 1)^2, heads]``) gathered by a precomputed index
  (a NumPy constant, as the original registers a buffer);
* **shifted windows** (every second block): the map rolled by ``jnp.roll`` before the
  partition and rolled back after, and an attention mask built from an image of region ids
  sliced into nine regions (``img_mask[h_slice, w_slice] = cnt``), windows compared pairwise,
  ``jnp.where(mask != 0, -100.0, 0.0)`` added to the bias;
* **patch merging** between stages: ``x[:, 0::2, 0::2]`` and its three neighbours
  concatenated on the channels, LayerNorm, a Dense halving them;
* mean pooling over the tokens, a linear head, cross-entropy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus._jit import init_linen


def relative_index(window: int) -> np.ndarray:
    """The ``[w*w, w*w]`` index into the relative position bias table (Swin's buffer)."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij"))
    flat = coords.reshape(2, -1)
    rel = (flat[:, :, None] - flat[:, None, :]).transpose(1, 2, 0) + (window - 1)
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


def shift_mask(size: int, window: int, shift: int) -> np.ndarray:
    """The ``[windows, w*w, w*w]`` mask of a shifted window's cross-region pairs (0 or -100)."""
    img = np.zeros((size, size))
    cnt = 0
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for hs in bounds:
        for ws in bounds:
            img[hs, ws] = cnt
            cnt += 1
    wins = partition(img[None, :, :, None], window)[..., 0]  # [nW, w*w]
    diff = wins[:, None, :] - wins[:, :, None]
    return np.where(diff != 0, -100.0, 0.0)


def partition(x, window: int):
    """``[B, H, W, C] -> [B * H/w * W/w, w * w, C]`` (NumPy or JAX arrays)."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // window, window, w // window, window, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def unpartition(windows: jax.Array, window: int, b: int, h: int, w: int) -> jax.Array:
    c = windows.shape[-1]
    x = windows.reshape(b, h // window, w // window, window, window, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


class WindowAttention(nn.Module):
    heads: int
    window: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: np.ndarray | None) -> jax.Array:  # [B*nW, N, C]
        bw, n, c = x.shape
        qkv = nn.Dense(3 * c, param_dtype=self.param_dtype, name="qkv")(x)
        qkv = qkv.reshape(bw, n, 3, self.heads, c // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        table = self.param("relative_position_bias_table", nn.initializers.normal(0.02),
                           ((2 * self.window - 1) ** 2, self.heads), self.param_dtype)
        bias = table[relative_index(self.window).reshape(-1)].reshape(n, n, self.heads)
        bias = bias.transpose(2, 0, 1)[None]  # [1, heads, N, N]
        if mask is not None:
            windows = mask.shape[0]
            bias = (bias.reshape(1, 1, self.heads, n, n)
                    + jnp.asarray(mask, x.dtype)[None, :, None]).reshape(-1, self.heads, n, n)
            bias = jnp.broadcast_to(bias.reshape(1, windows, self.heads, n, n),
                                    (bw // windows, windows, self.heads, n, n))
            bias = bias.reshape(bw, self.heads, n, n)
        o = jax.nn.dot_product_attention(q, k, v, bias=bias)
        return nn.Dense(c, param_dtype=self.param_dtype, name="proj")(o.reshape(bw, n, c))


class SwinBlock(nn.Module):
    heads: int
    window: int
    shift: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, H, W, C]
        b, h, w, c = x.shape
        y = nn.LayerNorm(param_dtype=self.param_dtype, name="norm1")(x)
        mask = None
        if self.shift:
            y = jnp.roll(y, (-self.shift, -self.shift), axis=(1, 2))
            mask = shift_mask(h, self.window, self.shift)
        y = WindowAttention(self.heads, self.window, self.param_dtype, name="attn")(
            partition(y, self.window), mask)
        y = unpartition(y, self.window, b, h, w)
        if self.shift:
            y = jnp.roll(y, (self.shift, self.shift), axis=(1, 2))
        x = x + y
        z = nn.LayerNorm(param_dtype=self.param_dtype, name="norm2")(x)
        z = nn.Dense(2 * c, param_dtype=self.param_dtype, name="fc1")(z)
        return x + nn.Dense(c, param_dtype=self.param_dtype, name="fc2")(nn.gelu(z))


class PatchMerging(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        x = jnp.concatenate([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2],
                             x[:, 1::2, 1::2]], axis=-1)
        x = nn.LayerNorm(param_dtype=self.param_dtype, name="norm")(x)
        return nn.Dense(2 * c, use_bias=False, param_dtype=self.param_dtype,
                        name="reduction")(x)


class Swin(nn.Module):
    dim: int = 16
    heads: tuple[int, ...] = (2, 4)
    window: int = 2
    patch: int = 2
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:  # [B, H, W, 3]
        b, h, w, c = images.shape
        p = self.patch
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        x = x.reshape(b, h // p, w // p, p * p * c)
        x = nn.Dense(self.dim, param_dtype=self.param_dtype, name="patch_embed")(x)
        x = nn.LayerNorm(param_dtype=self.param_dtype, name="patch_norm")(x)
        for s, heads in enumerate(self.heads):
            if s:
                x = PatchMerging(self.param_dtype, name=f"layers_{s}_merge")(x)
            for i in range(2):
                shift = self.window // 2 if i % 2 and x.shape[1] > self.window else 0
                x = SwinBlock(heads, self.window, shift, self.param_dtype,
                              name=f"layers_{s}_blocks_{i}")(x)
        x = nn.LayerNorm(param_dtype=self.param_dtype, name="norm")(x)
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype,
                        name="head")(x.mean(axis=(1, 2)))


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 16, seed: int = 0,
         compiler_options=None, **config):
    """The Swin's ``(loss_fn, params, batch)``: softmax cross-entropy of the image's class."""
    model = Swin(param_dtype=dtype, **config)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    images = jax.random.normal(k_x, (batch_size, size, size, 3), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, model.num_classes)
    params = init_linen(model.init, k_init, images, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"image": images, "label": labels}
