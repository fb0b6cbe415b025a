"""A Soft MoE vision classifier (Puigcerver et al., 2024), in linen.

* patches by reshape of the images, a linear patch embedding and learned positions;
* the **Soft MoE layer**: slot parameters ``phi`` ``[d, experts * slots]``; logits
  ``x @ phi`` per sample ``[B, tokens, experts * slots]``; **dispatch weights**: a softmax over
  the *tokens* (each slot is a convex mix of all of a sample's tokens), **combine weights**: a
  softmax over the *slots* (each token a mix of all slots' outputs); the slots' inputs by
  ``einsum``, each expert an MLP over its slots with stacked weights ``[experts, d, h]``, the
  outputs combined back to the tokens; ``x`` and ``phi`` L2-normalised with a learned scale,
  as the paper does;
* a pre-norm self-attention block before it, mean pooling and a classifier.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class SoftMoE(nn.Module):
    experts: int = 4
    slots: int = 2
    hidden: int = 32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        B, N, d = x.shape
        E, S, pd = self.experts, self.slots, self.param_dtype
        phi = self.param("phi", nn.initializers.lecun_normal(), (d, E * S), pd)
        scale = self.param("scale", nn.initializers.ones, (), pd)
        xn = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        pn = phi / jnp.linalg.norm(phi, axis=0, keepdims=True)
        logits = scale * jnp.einsum("bnd,dm->bnm", xn, pn)               # [B, N, E * S]
        dispatch = jax.nn.softmax(logits, axis=1)                         # over the tokens
        combine = jax.nn.softmax(logits, axis=2)                          # over the slots
        slots = jnp.einsum("bnm,bnd->bmd", dispatch, x).reshape(B, E, S, d)
        w1 = self.param("w1", nn.initializers.lecun_normal(), (E, d, self.hidden), pd)
        w2 = self.param("w2", nn.initializers.lecun_normal(), (E, self.hidden, d), pd)
        h = nn.gelu(jnp.einsum("besd,edh->besh", slots, w1))
        out = jnp.einsum("besh,ehd->besd", h, w2).reshape(B, E * S, d)
        return jnp.einsum("bnm,bmd->bnd", combine, out)


class SoftMoEViT(nn.Module):
    patch: int = 4
    width: int = 32
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        B, H, W, C = images.shape
        p, pd = self.patch, self.param_dtype
        x = images.reshape(B, H // p, p, W // p, p, C).transpose(0, 1, 3, 2, 4, 5)
        x = nn.Dense(self.width, param_dtype=pd, name="embed")(x.reshape(B, -1, p * p * C))
        x = x + self.param("pos", nn.initializers.normal(0.02), x.shape[1:], pd)
        h = nn.LayerNorm(param_dtype=pd, name="norm_attn")(x)
        x = x + nn.MultiHeadDotProductAttention(4, param_dtype=pd, name="attn")(h, h)
        x = x + SoftMoE(param_dtype=pd, name="moe")(nn.LayerNorm(param_dtype=pd,
                                                                  name="norm_moe")(x))
        x = nn.LayerNorm(param_dtype=pd, name="norm_out")(x).mean(axis=1)
        return nn.Dense(self.num_classes, param_dtype=pd, name="head")(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 16, seed: int = 0,
         compiler_options=None):
    """The Soft MoE ViT's ``(loss_fn, params, batch)``."""
    model = SoftMoEViT(param_dtype=dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    images = jax.random.normal(k_x, (batch_size, size, size, 3), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, model.num_classes)
    params = init_linen(model.init, k_init, images, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["images"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"images": images, "label": labels}
