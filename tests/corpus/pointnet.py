"""A PointNet classifier (Qi et al., 2017), in linen, as point-cloud code writes it.

* an **input transform**: a T-Net (shared per-point MLP as ``nn.Conv`` with kernel size 1 over
  the points, BatchNorm with batch statistics, a max over the points, a fully connected head)
  predicts a 3 x 3 matrix per sample, initialised at the identity (zero last layer plus
  ``jnp.eye``), and the points are multiplied by it (``einsum('bnk,bkj->bnj')``: both operands
  activations);
* a **feature transform**: the same on the 16-dimensional point features, regularised towards
  an orthogonal matrix (``|A A^T - I|^2`` added to the loss);
* the shared MLP, a max over the points (the order-invariant pooling), a classifier with
  dropout (a fixed key) and the mean cross-entropy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class SharedMLP(nn.Module):
    """Per-point layers: a kernel-1 convolution over the points, BatchNorm, ReLU."""
    widths: tuple[int, ...]
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, w in enumerate(self.widths):
            x = nn.Conv(w, kernel_size=(1,), param_dtype=self.param_dtype, name=f"conv_{i}")(x)
            x = nn.BatchNorm(use_running_average=False, param_dtype=self.param_dtype,
                             name=f"bn_{i}")(x)
            x = nn.relu(x)
        return x


class TNet(nn.Module):
    k: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = SharedMLP((16, 32), self.param_dtype, name="mlp")(x).max(axis=1)
        h = nn.relu(nn.Dense(16, param_dtype=self.param_dtype, name="fc")(h))
        m = nn.Dense(self.k * self.k, kernel_init=nn.initializers.zeros,
                     param_dtype=self.param_dtype, name="out")(h)
        return m.reshape(-1, self.k, self.k) + jnp.eye(self.k, dtype=m.dtype)


class PointNet(nn.Module):
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, points: jax.Array) -> tuple[jax.Array, jax.Array]:
        t_in = TNet(3, self.param_dtype, name="input_transform")(points)
        x = jnp.einsum("bnk,bkj->bnj", points, t_in)
        x = SharedMLP((16,), self.param_dtype, name="mlp1")(x)
        t_feat = TNet(16, self.param_dtype, name="feature_transform")(x)
        x = jnp.einsum("bnk,bkj->bnj", x, t_feat)
        x = SharedMLP((16, 32), self.param_dtype, name="mlp2")(x).max(axis=1)
        x = nn.relu(nn.Dense(16, param_dtype=self.param_dtype, name="fc")(x))
        x = nn.Dropout(0.3, deterministic=False)(x, rng=jax.random.key(7))
        logits = nn.Dense(self.num_classes, param_dtype=self.param_dtype, name="head")(x)
        eye = jnp.eye(t_feat.shape[-1], dtype=t_feat.dtype)
        ortho = ((t_feat @ jnp.swapaxes(t_feat, 1, 2) - eye) ** 2).sum((1, 2)).mean()
        return logits, ortho


def make(*, dtype=jnp.float32, batch_size: int = 8, points: int = 16, num_classes: int = 8,
         seed: int = 0, compiler_options=None):
    """PointNet's ``(loss_fn, params, batch)``; batch statistics computed and discarded."""
    model = PointNet(num_classes, dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    pts = jax.random.normal(k_x, (batch_size, points, 3), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, num_classes)
    params = init_linen(model.init, k_init, pts, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        (logits, ortho), _ = model.apply({"params": params}, batch["points"],
                                         mutable=["batch_stats"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return ce + 1e-3 * ortho

    return loss_fn, params, {"points": pts, "label": labels}
