"""A TabNet-style tabular classifier with sparsemax feature selection (Arik and Pfister, 2021;
Martins and Astudillo, 2016), in linen.

* **sparsemax**, written as its papers' code writes it: the scores sorted in descending order
  along the features (``jnp.sort`` of the negation), their cumulative sums (``jnp.cumsum``),
  the support size found by a comparison with ``1 + k z_k``, the threshold ``tau`` read off
  by ``jnp.take_along_axis`` at it, and ``max(z - tau, 0)``: a projection onto the simplex
  with exact zeros, differentiated through the sort by JAX;
* three decision steps: each an attentive transformer (a Dense of the previous step's
  features, BatchNorm with batch statistics, scaled by the prior ``prod (gamma - mask)``,
  then sparsemax) choosing a sparse mask over the input features, a feature transformer
  (GLU blocks: a Dense to twice the width, one half gating the other by a sigmoid) on the
  masked features, the ReLU'd decisions summed over the steps;
* the sparsity regulariser (the masks' mean entropy), a classifier, the cross-entropy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen

GAMMA = 1.3


def sparsemax(z: jax.Array) -> jax.Array:
    """Sparsemax over the last axis."""
    k = jnp.arange(1, z.shape[-1] + 1, dtype=z.dtype)
    z_sorted = -jnp.sort(-z, axis=-1)
    cumulative = jnp.cumsum(z_sorted, axis=-1)
    support = (1 + k * z_sorted > cumulative).astype(jnp.int32)
    size = support.sum(axis=-1, keepdims=True)
    tau = (jnp.take_along_axis(cumulative, size - 1, axis=-1) - 1) / size.astype(z.dtype)
    return jnp.maximum(z - tau, 0.0)


class GLU(nn.Module):
    width: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        a, b = jnp.split(nn.Dense(2 * self.width, param_dtype=self.param_dtype, name="fc")(x),
                         2, axis=-1)
        return a * jax.nn.sigmoid(b)


class TabNet(nn.Module):
    steps: int = 3
    width: int = 16
    num_classes: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        pd = self.param_dtype
        x = nn.BatchNorm(use_running_average=False, param_dtype=pd, name="input_bn")(x)
        prior = jnp.ones_like(x)
        features = GLU(self.width, pd, name="initial")(x)
        decision, entropy = 0.0, 0.0
        for s in range(self.steps):
            a = nn.Dense(x.shape[-1], param_dtype=pd, name=f"attentive_{s}")(features)
            a = nn.BatchNorm(use_running_average=False, param_dtype=pd, name=f"att_bn_{s}")(a)
            mask = sparsemax(a * prior)
            prior = prior * (GAMMA - mask)
            entropy = entropy + (-mask * jnp.log(mask + 1e-10)).sum(-1).mean()
            h = GLU(self.width, pd, name=f"shared_{s}")(mask * x)
            features = (h + GLU(self.width, pd, name=f"step_{s}")(h)) * jnp.sqrt(0.5)
            decision = decision + nn.relu(features)
        logits = nn.Dense(self.num_classes, param_dtype=pd, name="head")(decision)
        return logits, entropy / self.steps


def make(*, dtype=jnp.float32, batch_size: int = 8, features: int = 12, seed: int = 0,
         compiler_options=None):
    """TabNet's ``(loss_fn, params, batch)``; batch statistics computed and discarded."""
    model = TabNet(param_dtype=dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (batch_size, features), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, model.num_classes)
    params = init_linen(model.init, k_init, x, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        (logits, entropy), _ = model.apply({"params": params}, batch["x"],
                                           mutable=["batch_stats"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return ce + 1e-3 * entropy

    return loss_fn, params, {"x": x, "label": labels}
