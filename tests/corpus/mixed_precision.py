"""A linen transformer block computing in bfloat16 over float32 parameters.

Every layer takes ``dtype=jnp.bfloat16`` (computation) and ``param_dtype`` (storage: float32,
or float64 in float64 tests), as mixed-precision Flax code does: parameters are cast to
bfloat16 where they are used, activations flow in bfloat16, and the logits are cast back to
float32 (or the parameters' type) for the loss, whose gradients come back in the parameters'
type. Dense input projection, LayerNorm, `nn.MultiHeadDotProductAttention`, a GELU MLP, mean
pooling over time and a classifier.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen

COMPUTE = jnp.bfloat16


class MixedBlockClassifier(nn.Module):
    d_model: int = 32
    num_heads: int = 4
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=COMPUTE, param_dtype=self.param_dtype)
        dense = functools.partial(nn.Dense, **kw)
        x = dense(self.d_model, name="in_proj")(x)
        h = nn.LayerNorm(name="ln_attn", **kw)(x)
        x = x + nn.MultiHeadDotProductAttention(self.num_heads, name="attn", **kw)(h, h)
        h = nn.LayerNorm(name="ln_mlp", **kw)(x)
        x = x + dense(self.d_model, name="fc2")(nn.gelu(dense(2 * self.d_model, name="fc1")(h)))
        x = nn.LayerNorm(name="ln_f", **kw)(x).mean(axis=1)
        return dense(self.num_classes, name="head")(x).astype(jnp.float32)


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, in_features: int = 12,
         seed: int = 0, compiler_options=None, **config):
    """The mixed-precision classifier's ``(loss_fn, params, batch)``."""
    model = MixedBlockClassifier(param_dtype=dtype, **config)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (batch_size, seq_len, in_features), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, model.num_classes)
    params = init_linen(model.init, k_init, x, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"x": x, "label": labels}
