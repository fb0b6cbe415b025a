"""An MLP that quantises its hidden activations, trained through a straight-through estimator.

``quantize(h) = round_ste(h * levels) / levels`` with ``round_ste`` a `jax.custom_vjp` around
`jnp.round` whose backward pass is the identity: the forward pass sees the rounded values, the
backward pass pretends rounding was not there (Bengio et al. 2013). Differentiating the primal
instead gives zero gradients to everything below the quantiser (``d round / dx = 0``).

The network: ``h = tanh(x @ fc1 + b1)``, ``q = quantize(h)``, ``logits = q @ head + b2``,
softmax cross-entropy; simple enough that `hand_grads` computes its gradient with numpy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus._jit import init_linen

LEVELS = 4.0  # quantisation steps per unit: h in [-1, 1] -> 9 values


@jax.custom_vjp
def round_ste(x: jax.Array) -> jax.Array:
    return jnp.round(x)


def _round_fwd(x):
    return jnp.round(x), None


def _round_bwd(_, g):
    return (g,)


round_ste.defvjp(_round_fwd, _round_bwd)


def quantize(h: jax.Array) -> jax.Array:
    return round_ste(h * LEVELS) / LEVELS


class QuantMLP(nn.Module):
    hidden: int = 32
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.tanh(nn.Dense(self.hidden, param_dtype=self.param_dtype, name="fc1")(x))
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype,
                        name="head")(quantize(h))


def make(*, dtype=jnp.float32, batch_size: int = 8, in_features: int = 16, hidden: int = 32,
         num_classes: int = 8, seed: int = 0, compiler_options=None):
    """The quantised MLP's ``(loss_fn, params, batch)``."""
    model = QuantMLP(hidden, num_classes, dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (batch_size, in_features), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, num_classes)
    params = init_linen(model.init, k_init, x, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"x": x, "label": labels}


def hand_grads(params, batch) -> dict:
    """The straight-through gradient of the loss, by hand in float64 numpy."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x, labels = np.asarray(batch["x"], np.float64), np.asarray(batch["label"])
    w1, b1, w2, b2 = p["fc1"]["kernel"], p["fc1"]["bias"], p["head"]["kernel"], p["head"]["bias"]
    h = np.tanh(x @ w1 + b1)
    q = np.round(h * LEVELS) / LEVELS
    logits = q @ w2 + b2
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    d_logits = e / e.sum(axis=1, keepdims=True)
    d_logits[np.arange(len(labels)), labels] -= 1.0
    d_logits /= len(labels)
    d_h = d_logits @ w2.T  # straight through: d q / d h = levels / levels = 1
    d_pre = d_h * (1.0 - h**2)
    return {"fc1": {"kernel": x.T @ d_pre, "bias": d_pre.sum(0)},
            "head": {"kernel": q.T @ d_logits, "bias": d_logits.sum(0)}}
