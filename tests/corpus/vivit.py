"""A ViViT-style video classifier with factorised space-time attention, in linen.

* **tubelet embedding by a 3D convolution** (``nn.Conv`` with a ``(2, 4, 4)`` kernel and
  stride over ``[B, T, H, W, C]`` clips);
* a learned spatial position embedding and a separate temporal one, broadcast over the other;
* factorised blocks (ViViT's model 3): **spatial attention over the patches of each frame**,
  the frames folded into the batch (``[B, T, N, D] -> [B * T, N, D]``), then **temporal
  attention over the frames at each patch**, the patches folded into the batch after a
  transpose (``[B, T, N, D] -> [B, N, T, D] -> [B * N, T, D]``), then an MLP; heads by
  ``reshape`` after fused Dense projections, ``nn.dot_product_attention``;
* a class token prepended by ``jnp.concatenate`` of a ``jnp.tile``\\ d parameter for the
  classification readout, after mean pooling over frames.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class Attention(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, d = x.shape
        qkv = nn.Dense(3 * d, param_dtype=self.param_dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(b, n, 3, self.heads, d // self.heads), 3, axis=2)
        o = nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0])
        return nn.Dense(d, param_dtype=self.param_dtype, name="proj")(o.reshape(b, n, d))


class FactorisedBlock(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, N, D]
        b, t, n, d = x.shape
        ln = lambda name: nn.LayerNorm(param_dtype=self.param_dtype, name=name)  # noqa: E731
        y = Attention(self.heads, self.param_dtype, name="spatial")(
            ln("ln_s")(x).reshape(b * t, n, d))
        x = x + y.reshape(b, t, n, d)
        y = ln("ln_t")(x).transpose(0, 2, 1, 3).reshape(b * n, t, d)
        y = Attention(self.heads, self.param_dtype, name="temporal")(y)
        x = x + y.reshape(b, n, t, d).transpose(0, 2, 1, 3)
        h = nn.gelu(nn.Dense(2 * d, param_dtype=self.param_dtype, name="fc1")(ln("ln_m")(x)))
        return x + nn.Dense(d, param_dtype=self.param_dtype, name="fc2")(h)


class ViViT(nn.Module):
    dim: int = 16
    heads: int = 4
    depth: int = 2
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, video: jax.Array) -> jax.Array:  # [B, T, H, W, 3]
        x = nn.Conv(self.dim, (2, 4, 4), strides=(2, 4, 4), padding="VALID",
                    param_dtype=self.param_dtype, name="tubelets")(video)
        b, t, h, w, d = x.shape
        x = x.reshape(b, t, h * w, d)
        pos_s = self.param("pos_spatial", nn.initializers.normal(0.02), (h * w, d),
                           self.param_dtype)
        pos_t = self.param("pos_temporal", nn.initializers.normal(0.02), (t, d),
                           self.param_dtype)
        x = x + pos_s[None, None] + pos_t[None, :, None]
        for i in range(self.depth):
            x = FactorisedBlock(self.heads, self.param_dtype, name=f"block_{i}")(x)
        frames = x.mean(axis=1)  # [B, N, D]
        cls = self.param("cls", nn.initializers.zeros, (1, 1, d), self.param_dtype)
        x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)), frames], axis=1)
        x = Attention(self.heads, self.param_dtype, name="readout")(
            nn.LayerNorm(param_dtype=self.param_dtype, name="ln_out")(x))
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype, name="head")(x[:, 0])


def make(*, dtype=jnp.float32, batch_size: int = 8, frames: int = 8, size: int = 8,
         seed: int = 0, compiler_options=None, **config):
    """The ViViT's ``(loss_fn, params, batch)``: softmax cross-entropy of the clip's class."""
    model = ViViT(param_dtype=dtype, **config)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    video = jax.random.normal(k_x, (batch_size, frames, size, size, 3), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, model.num_classes)
    params = init_linen(model.init, k_init, video, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["video"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"video": video, "label": labels}
