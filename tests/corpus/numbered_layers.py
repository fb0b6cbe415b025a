"""Layers named by number: the same linen block applied under the names "0", "1", "2", "3".

Libraries that port PyTorch models keep PyTorch's ``nn.ModuleList`` naming, so a layer's
parameters live under ``"0"``, ``"1"``, ... (HuggingFace's Flax layer collections create
``Layer(name=str(i))``). Each ``Block`` is ``x + fc(ln(x))`` (a LayerNorm ``"ln"``, then a
Dense ``"fc"``), applied in a compact loop over ``("0", "1", "2", "3")``, followed by a Dense
head and a mean squared error against a float target. Its operators must be named by the full
module path with the numeric component kept: ``0/ln``, ``0/fc``, ``1/ln``, ... (not ``ln``,
``ln_1``, or ``fc_3``).

Idioms: ``name=str(i)`` submodules in ``@nn.compact``, LayerNorm, Dense, residuals, MSE loss.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen

LAYER_NAMES = ("0", "1", "2", "3")


class Block(nn.Module):
    features: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm(param_dtype=self.param_dtype, name="ln")(x)
        return x + nn.Dense(self.features, param_dtype=self.param_dtype, name="fc")(h)


class NumberedLayers(nn.Module):
    features: int = 32
    out_features: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(self.features, param_dtype=self.param_dtype, name="embed")(x)
        for name in LAYER_NAMES:
            x = Block(self.features, self.param_dtype, name=name)(x)
        return nn.Dense(self.out_features, param_dtype=self.param_dtype, name="head")(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, in_features: int = 16, seed: int = 0,
         compiler_options=None, **config):
    """The numbered-layer MLP's ``(loss_fn, params, batch)``: mean squared error."""
    model = NumberedLayers(param_dtype=dtype, **config)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (batch_size, in_features), dtype)
    y = jax.random.normal(k_y, (batch_size, model.out_features), dtype)
    params = init_linen(model.init, k_init, x, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        pred = model.apply({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    return loss_fn, params, {"x": x, "y": y}
