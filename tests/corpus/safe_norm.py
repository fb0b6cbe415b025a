"""A cosine classifier over L2-normalised features, with a `jax.custom_jvp` safe norm.

``safe_norm(z) = sqrt(sum(z**2, -1))``; its JVP is ``<z, t> / |z|`` and, at the origin, 0 (the
norm has no derivative there, and the primal's autodiff gives 0 * inf = NaN). The batch is
padded: its last two rows are all zeros, so their features ``z = x @ embed`` (no bias) are
exactly zero whatever the parameters, and the custom rule is what keeps the gradient finite.
Differentiating the primal jaxpr instead of the rule turns every gradient into NaN.

The network: ``z = x @ embed``; ``u = z / (safe_norm(z) + eps)``; logits are ``scale *
u @ normalise(classes).T`` (classes normalised with the same norm); cross-entropy over the
real rows only.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen

EPS = 1e-6
PADDING_ROWS = 2


@jax.custom_jvp
def safe_norm(z: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(z * z, axis=-1, keepdims=True))


@safe_norm.defjvp
def _safe_norm_jvp(primals, tangents):
    (z,), (t,) = primals, tangents
    n = safe_norm(z)
    nonzero = n > 0
    dn = jnp.sum(z * t, axis=-1, keepdims=True) / jnp.where(nonzero, n, 1)
    return n, jnp.where(nonzero, dn, 0)


class CosineClassifier(nn.Module):
    features: int = 16
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        z = nn.Dense(self.features, use_bias=False, param_dtype=self.param_dtype,
                     name="embed")(x)
        u = z / (safe_norm(z) + EPS)
        classes = self.param("classes", nn.initializers.normal(1.0),
                             (self.num_classes, self.features), self.param_dtype)
        c = classes / safe_norm(classes)
        scale = self.param("scale", nn.initializers.constant(4.0), (), self.param_dtype)
        return scale * (u @ c.T)


def make(*, dtype=jnp.float32, batch_size: int = 8, in_features: int = 12, features: int = 16,
         num_classes: int = 8, seed: int = 0, compiler_options=None):
    """The cosine classifier's ``(loss_fn, params, batch)``; the last rows are padding."""
    model = CosineClassifier(features, num_classes, dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (batch_size, in_features), dtype)
    real = jnp.arange(batch_size) < batch_size - PADDING_ROWS
    x = jnp.where(real[:, None], x, 0)
    labels = jax.random.randint(k_y, (batch_size,), 0, num_classes)
    params = init_linen(model.init, k_init, x, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        mask = batch["mask"].astype(losses.dtype)
        return jnp.sum(losses * mask) / jnp.sum(mask)

    return loss_fn, params, {"x": x, "label": labels, "mask": real}
