"""A capsule network with dynamic routing (Sabour et al., 2017), in linen.

* a convolution and a primary-capsule convolution whose channels are cut into 8-dimensional
  capsules (``reshape``), squashed (``|s|^2 / (1 + |s|^2) * s / |s|``, with an epsilon);
* per (input capsule, class capsule) pair a learned ``8 x 8`` transform: the predictions
  ``u_hat`` by an einsum over a 4-D parameter;
* **routing by agreement**: three iterations, each a softmax of the routing logits over the
  class capsules, a weighted sum, a squash and the agreement added back; the first two in a
  ``jax.lax.fori_loop`` (static bounds: a scan in the jaxpr) over the predictions under
  ``stop_gradient``, the last outside it on the predictions themselves (as the paper's
  reference code does);
* the margin loss on the class capsules' lengths.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen

CAPSULE = 8
ROUTING = 3


def squash(s: jax.Array, axis: int = -1) -> jax.Array:
    n2 = (s ** 2).sum(axis, keepdims=True)
    return n2 / (1 + n2) * s / jnp.sqrt(n2 + 1e-8)


class CapsNet(nn.Module):
    num_classes: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        pd = self.param_dtype
        h = nn.relu(nn.Conv(16, (3, 3), padding="VALID", param_dtype=pd, name="conv")(images))
        p = nn.Conv(2 * CAPSULE, (3, 3), strides=(2, 2), padding="VALID", param_dtype=pd,
                    name="primary")(h)
        B = p.shape[0]
        u = squash(p.reshape(B, -1, CAPSULE))                        # [B, I, 8]
        inputs = u.shape[1]
        W = self.param("routing_weights", nn.initializers.normal(0.1),
                       (inputs, self.num_classes, CAPSULE, CAPSULE), pd)
        u_hat = jnp.einsum("bid,ijdk->bijk", u, W)                   # [B, I, J, 8]
        detached = jax.lax.stop_gradient(u_hat)

        def route(i, logits):
            c = jax.nn.softmax(logits, axis=-1)
            v = squash(jnp.einsum("bij,bijk->bjk", c, detached))
            return logits + jnp.einsum("bijk,bjk->bij", detached, v)

        logits = jax.lax.fori_loop(0, ROUTING - 1, route,
                                   jnp.zeros(u_hat.shape[:3], u_hat.dtype))
        c = jax.nn.softmax(logits, axis=-1)
        v = squash(jnp.einsum("bij,bijk->bjk", c, u_hat))            # [B, J, 8]
        return jnp.sqrt((v ** 2).sum(-1) + 1e-8)


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 9, num_classes: int = 4,
         seed: int = 0, compiler_options=None):
    """The capsule network's ``(loss_fn, params, batch)``: the margin loss (m+ 0.9, m- 0.1)."""
    model = CapsNet(num_classes, dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    images = jax.random.normal(k_x, (batch_size, size, size, 1), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, num_classes)
    params = init_linen(model.init, k_init, images, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        lengths = model.apply({"params": params}, batch["images"])
        t = jax.nn.one_hot(batch["label"], lengths.shape[-1], dtype=lengths.dtype)
        loss = (t * jnp.maximum(0.0, 0.9 - lengths) ** 2
                + 0.5 * (1 - t) * jnp.maximum(0.0, lengths - 0.1) ** 2)
        return loss.sum(-1).mean()

    return loss_fn, params, {"images": images, "label": labels}
