"""A small nnx convolutional classifier with `nnx.Dropout` keyed by the model's `nnx.Rngs`.

Two 3x3 convolutions (the second stride 2), dropout after each, a hidden Linear layer with
dropout, and a classifier. Every Dropout holds its own fork of the model's ``dropout`` stream
(key and count in the model state): calling the model advances the counts, but a loss
evaluated on the same state (``nnx.merge`` of a fixed split, as a functional training step
does) draws the same masks every time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from corpus._jit import create_nnx


class DropoutCNN(nnx.Module):
    def __init__(self, *, channels: int, image_size: int, hidden: int, num_classes: int,
                 rate: float, param_dtype, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, channels, (3, 3), param_dtype=param_dtype, rngs=rngs)
        self.conv2 = nnx.Conv(channels, 2 * channels, (3, 3), strides=2,
                              param_dtype=param_dtype, rngs=rngs)
        flat = 2 * channels * (image_size // 2) ** 2
        self.fc = nnx.Linear(flat, hidden, param_dtype=param_dtype, rngs=rngs)
        self.head = nnx.Linear(hidden, num_classes, param_dtype=param_dtype, rngs=rngs)
        self.drop_conv = nnx.Dropout(rate, broadcast_dims=(1, 2), rngs=rngs)  # channel dropout
        self.drop_fc = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.drop_conv(nnx.relu(self.conv1(x)))
        x = self.drop_conv(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        x = self.drop_fc(nnx.relu(self.fc(x)))
        return self.head(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, image_size: int = 8, channels: int = 4,
         hidden: int = 32, num_classes: int = 8, rate: float = 0.25, seed: int = 0,
         compiler_options=None):
    """The dropout CNN's ``(loss_fn, model, batch)``."""
    model = create_nnx(lambda: DropoutCNN(
        channels=channels, image_size=image_size, hidden=hidden, num_classes=num_classes,
        rate=rate, param_dtype=dtype, rngs=nnx.Rngs(params=seed, dropout=seed + 1)),
        compiler_options=compiler_options)
    k_x, k_y = jax.random.split(jax.random.key(seed + 2))
    images = jax.random.normal(k_x, (batch_size, image_size, image_size, 3), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, num_classes)

    def loss_fn(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, model, {"image": images, "label": labels}
