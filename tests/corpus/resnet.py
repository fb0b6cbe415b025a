"""ResNet-18 for 32x32 images, in linen, in the style of the common Flax training scripts.

Stem: 7x7 stride-2 convolution, BatchNorm, ReLU, 3x3 stride-2 max pool; then four stages of
two basic blocks (widths w, 2w, 4w, 8w; stride 2 entering stages 2-4) and global average
pooling into a classifier. Each block is ``relu(shortcut + bn2(conv2(relu(bn1(conv1(x))))))``,
its ``bn2`` scale zero-initialised (the block starts as the identity), the shortcut a 1x1
projection with BatchNorm where the shape changes. BatchNorm trains on batch statistics
(``use_running_average=False``); the loss applies the model with ``mutable=['batch_stats']``
and drops the updated running averages, which it closes over as constants.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen

STAGES = (2, 2, 2, 2)


class BasicBlock(nn.Module):
    features: int
    strides: int = 1
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, param_dtype=self.param_dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9,
                                 epsilon=1e-5, param_dtype=self.param_dtype)
        y = conv(self.features, (3, 3), (self.strides, self.strides), padding=1)(x)
        y = nn.relu(norm()(y))
        y = conv(self.features, (3, 3), padding=1)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        shortcut = x
        if x.shape != y.shape:
            shortcut = conv(self.features, (1, 1), (self.strides, self.strides),
                            name="proj_conv")(x)
            shortcut = norm(name="proj_bn")(shortcut)
        return nn.relu(shortcut + y)


class ResNet18(nn.Module):
    num_classes: int = 10
    width: int = 64
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                    param_dtype=self.param_dtype, name="stem_conv")(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5,
                         param_dtype=self.param_dtype, name="stem_bn")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for stage, blocks in enumerate(STAGES):
            for b in range(blocks):
                strides = 2 if stage > 0 and b == 0 else 1
                x = BasicBlock(self.width * 2**stage, strides, self.param_dtype,
                               name=f"stage{stage + 1}_block{b + 1}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype, name="head")(x)


def make(*, dtype=jnp.float32, width: int = 64, batch_size: int = 8, image_size: int = 32,
         num_classes: int = 10, seed: int = 0, compiler_options=None):
    """ResNet-18 ``(loss_fn, params, batch)``; ``width=64`` is the standard network."""
    model = ResNet18(num_classes=num_classes, width=width, param_dtype=dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    images = jax.random.normal(k_x, (batch_size, image_size, image_size, 3), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, num_classes)
    variables = init_linen(model.init, k_init, images,
                           compiler_options=compiler_options)
    params, batch_stats = variables["params"], variables["batch_stats"]

    def loss_fn(params, batch):
        logits, _updates = model.apply({"params": params, "batch_stats": batch_stats},
                                       batch["image"], mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"image": images, "label": labels}
