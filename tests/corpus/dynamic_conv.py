"""An image classifier with weight-standardised and per-sample dynamic convolutions, in linen.

* BiT's **weight standardisation**: an ``nn.Conv`` subclass whose ``param`` hook returns the
  kernel normalised by its own mean and variance over the window and input channels (a
  computation on the parameter inside the model);
* a **dynamic depthwise convolution** (CondConv / dynamic-filter style): each sample's 3x3
  kernel predicted by a Dense from its pooled features, applied by ``jax.vmap`` over the batch
  of a convolution of one image with its own kernel (JAX batches it into one grouped
  convolution whose groups are samples times channels);
* a residual add, global mean pooling (the convolution's spatial dims summed inside its
  operator: reduction dims) and a classifier.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class StdConv(nn.Conv):
    """A convolution with a weight-standardised kernel (Big Transfer's ResNets)."""

    def param(self, name, *args, **kwargs):
        p = super().param(name, *args, **kwargs)
        if name == "kernel":
            mean = p.mean(axis=(0, 1, 2), keepdims=True)
            var = p.var(axis=(0, 1, 2), keepdims=True)
            p = (p - mean) * jax.lax.rsqrt(var + 1e-5)
        return p


class DynamicNet(nn.Module):
    channels: int = 8
    num_classes: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.channels
        x = nn.relu(StdConv(c, (3, 3), padding="SAME", param_dtype=self.param_dtype,
                            name="stdconv")(x))
        kernels = nn.Dense(9 * c, param_dtype=self.param_dtype, name="kernel_net")(
            x.mean(axis=(1, 2))).reshape(-1, 3, 3, 1, c)

        def one(image, kernel):
            return jax.lax.conv_general_dilated(
                image[None], kernel, (1, 1), "SAME",
                dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=c)[0]

        x = nn.relu(x + jax.vmap(one)(x, kernels))
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype,
                        name="head")(x.mean(axis=(1, 2)))


def make(*, dtype=jnp.float32, batch_size: int = 8, image_size: int = 8, seed: int = 0,
         compiler_options=None, **config):
    """The network's ``(loss_fn, params, batch)``: softmax cross-entropy."""
    model = DynamicNet(param_dtype=dtype, **config)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    images = jax.random.normal(k_x, (batch_size, image_size, image_size, 3), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, model.num_classes)
    params = init_linen(model.init, k_init, images, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"image": images, "label": labels}
