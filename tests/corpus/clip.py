"""A CLIP-style contrastive model, in linen: two towers and a loss over pairs of samples.

* an image tower and a text tower (``Dense``, GELU, ``Dense``), each output L2-normalised;
* a learned temperature ``logit_scale``, a weakly typed scalar parameter (made by
  ``jnp.array(2.0)``, as CLIP's reference code writes it), applied as ``exp``;
* logits ``img @ txt.T``: every sample's image against every sample's text, [B, B];
* the symmetric cross-entropy, the matching pair of each row and each column the label.

The samples interact: each sample's loss reads every other sample's embedding, so gradient
accumulation over microbatches would train another model (each microbatch contrasting only
within itself). `soapjax.trace` says so (`OpGraph.sample_coupling`), and plans keep one
microbatch.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class Tower(nn.Module):
    width: int
    out: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(self.width, param_dtype=self.param_dtype, name="fc1")(x))
        z = nn.Dense(self.out, param_dtype=self.param_dtype, name="fc2")(h)
        return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


class CLIP(nn.Module):
    width: int = 32
    out: int = 16
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, img: jax.Array, txt: jax.Array) -> jax.Array:
        i = Tower(self.width, self.out, self.param_dtype, name="image")(img)
        t = Tower(self.width, self.out, self.param_dtype, name="text")(txt)
        scale = self.param("logit_scale", lambda key: jnp.array(2.0, self.param_dtype))
        return jnp.exp(scale) * i @ t.T


def make(*, dtype=jnp.float32, batch_size: int = 8, image_features: int = 12,
         text_features: int = 20, seed: int = 0, compiler_options=None):
    """CLIP's ``(loss_fn, params, batch)``: batch ``{"image", "text"}`` of matching pairs."""
    model = CLIP(param_dtype=dtype)
    k_init, k_i, k_t = jax.random.split(jax.random.key(seed), 3)
    batch = {"image": jax.random.normal(k_i, (batch_size, image_features), dtype),
             "text": jax.random.normal(k_t, (batch_size, text_features), dtype)}
    params = init_linen(model.init, k_init, batch["image"], batch["text"],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["image"], batch["text"])
        labels = jnp.arange(logits.shape[0])
        return 0.5 * (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                      + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean())

    return loss_fn, params, batch
