"""BatchNorm over a named batch axis, bound by `jax.vmap`, as data-parallel Flax code writes it.

The model is written per example: ``nn.BatchNorm(use_running_average=False,
axis_name='batch')`` averages its statistics over the ``batch`` axis with `jax.lax.pmean`, and
the loss maps a per-example loss over the batch with ``jax.vmap(..., axis_name='batch')``. The
traced jaxpr then holds ``psum`` equations over the mapped axis (positional ``axes=(0,)``),
where a model written for whole batches would hold ``reduce_sum``. The running averages are
updated (``mutable=['batch_stats']``) and discarded.

The network: Dense, BatchNorm, ReLU, Dense, BatchNorm, ReLU, classifier.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class PerExampleNet(nn.Module):
    hidden: int = 16
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        norm = functools.partial(nn.BatchNorm, use_running_average=False, axis_name="batch",
                                 momentum=0.9, param_dtype=self.param_dtype)
        x = nn.relu(norm(name="bn1")(nn.Dense(self.hidden, param_dtype=self.param_dtype,
                                              name="fc1")(x)))
        x = nn.relu(norm(name="bn2")(nn.Dense(self.hidden, param_dtype=self.param_dtype,
                                              name="fc2")(x)))
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype, name="head")(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, in_features: int = 12, seed: int = 0,
         compiler_options=None, **config):
    """The per-example network's ``(loss_fn, params, batch)``."""
    model = PerExampleNet(param_dtype=dtype, **config)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (batch_size, in_features), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, model.num_classes)
    init = jax.vmap(lambda xi: model.init(k_init, xi), axis_name="batch", axis_size=batch_size,
                    in_axes=0, out_axes=None)
    variables = init_linen(init, x, compiler_options=compiler_options)
    params, batch_stats = variables["params"], variables["batch_stats"]

    def loss_fn(params, batch):
        def example_loss(xi, label):
            logits, _updates = model.apply({"params": params, "batch_stats": batch_stats}, xi,
                                           mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, label)

        losses = jax.vmap(example_loss, axis_name="batch")(batch["x"], batch["label"])
        return losses.mean()

    return loss_fn, params, {"x": x, "label": labels}
