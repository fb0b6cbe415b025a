"""A MobileNetV2-style depthwise-separable CNN in linen, with a grouped convolution.

A 3x3 stride-2 stem (BatchNorm, ReLU6), then inverted-residual blocks: a 1x1 expansion
convolution, a 3x3 **depthwise** convolution (``feature_group_count`` = its channels; the
second block's with stride 2, the third's with a **channel multiplier** of 2: twice as many
output channels as groups), a 1x1 projection, BatchNorm after each (batch statistics,
discarded); a residual where the shapes agree. A **grouped** 3x3 convolution (4 groups, not
depthwise, as ShuffleNet and ResNeXt have them) ends the features; global average pooling and
a Dense classifier.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


def relu6(x):
    return jnp.minimum(jax.nn.relu(x), 6.0)


class InvertedResidual(nn.Module):
    out: int
    expand: int = 4
    strides: int = 1
    multiplier: int = 1
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False, param_dtype=self.param_dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9,
                                 param_dtype=self.param_dtype)
        hidden = x.shape[-1] * self.expand
        y = relu6(norm()(conv(hidden, (1, 1), name="expand")(x)))
        y = conv(hidden * self.multiplier, (3, 3), (self.strides, self.strides), padding=1,
                 feature_group_count=hidden, name="depthwise")(y)
        y = relu6(norm()(y))
        y = norm()(conv(self.out, (1, 1), name="project")(y))
        return x + y if y.shape == x.shape else y


class MobileNet(nn.Module):
    num_classes: int
    width: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.width
        x = nn.Conv(w, (3, 3), (2, 2), padding=1, use_bias=False,
                    param_dtype=self.param_dtype, name="stem")(x)
        x = relu6(nn.BatchNorm(use_running_average=False, param_dtype=self.param_dtype)(x))
        x = InvertedResidual(w, param_dtype=self.param_dtype)(x)
        x = InvertedResidual(2 * w, strides=2, param_dtype=self.param_dtype)(x)
        x = InvertedResidual(2 * w, expand=2, multiplier=2, param_dtype=self.param_dtype)(x)
        x = nn.Conv(4 * w, (3, 3), padding=1, feature_group_count=4,
                    param_dtype=self.param_dtype, name="grouped")(x)
        x = relu6(x).mean(axis=(1, 2))
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype, name="classifier")(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, image_size: int = 16, width: int = 8,
         num_classes: int = 8, seed: int = 0, compiler_options=None):
    """The MobileNet's ``(loss_fn, params, batch)``."""
    model = MobileNet(num_classes=num_classes, width=width, param_dtype=dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    images = jax.random.normal(k_x, (batch_size, image_size, image_size, 3), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, num_classes)
    variables = init_linen(model.init, k_init, images, compiler_options=compiler_options)
    params, batch_stats = variables["params"], variables["batch_stats"]

    def loss_fn(params, batch):
        logits, _ = model.apply({"params": params, "batch_stats": batch_stats},
                                batch["image"], mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"image": images, "label": labels}
