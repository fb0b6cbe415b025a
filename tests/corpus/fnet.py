"""An FNet-style encoder, in linen: token mixing by a Fourier transform instead of attention.

* a token projection (``Dense``) of float features;
* two blocks held in a list (``blocks_0``, ``blocks_1``), each mixing the tokens and the
  hidden features with ``jnp.fft.fft2`` over the last two axes and keeping the real part
  (FNet's mixing sublayer: no parameters), then a residual LayerNorm and a GELU MLP;
* a per-token classifier and the mean cross-entropy.

The FFT's transform dims (the tokens and the hidden features) are never split inside it:
XLA:CPU's FFT cannot run on the layout the partitioner gives a split one
(docs/xla-workarounds.md); the operators around it may split them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class Block(nn.Module):
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.LayerNorm(param_dtype=self.param_dtype, name="mix_norm")(
            x + jnp.fft.fft2(x, axes=(-2, -1)).real)
        h = nn.gelu(nn.Dense(self.hidden, param_dtype=self.param_dtype, name="fc1")(x))
        h = nn.Dense(x.shape[-1], param_dtype=self.param_dtype, name="fc2")(h)
        return nn.LayerNorm(param_dtype=self.param_dtype, name="mlp_norm")(x + h)


class FNet(nn.Module):
    width: int = 16
    hidden: int = 32
    classes: int = 5
    layers: int = 2
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embed = nn.Dense(self.width, param_dtype=self.param_dtype)
        self.blocks = [Block(self.hidden, self.param_dtype) for _ in range(self.layers)]
        self.head = nn.Dense(self.classes, param_dtype=self.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make(*, dtype=jnp.float32, batch_size: int = 8, tokens: int = 6, features: int = 12,
         seed: int = 0, compiler_options=None):
    """FNet's ``(loss_fn, params, batch)``: batch ``{"x": [B, T, F], "labels": [B, T]}``."""
    model = FNet(param_dtype=dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    batch = {"x": jax.random.normal(k_x, (batch_size, tokens, features), dtype),
             "labels": jax.random.randint(k_y, (batch_size, tokens), 0, model.classes)}
    params = init_linen(model.init, k_init, batch["x"],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss_fn, params, batch
