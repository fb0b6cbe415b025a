"""A ConvNeXt-style classifier in nnx, written the way the timm/Flax ports write it.

A 4x4 stride-4 patchify stem (`nnx.Conv`) with a LayerNorm, then blocks of

* a 7x7 **depthwise** convolution (``feature_group_count = channels``, ``padding=3``),
* a LayerNorm over channels,
* an inverted-bottleneck MLP (`nnx.Linear` to 4 x channels, GELU, back),
* a learned layer scale (``gamma``, an `nnx.Param` of ones x 1e-1), a residual add,

a 2x2 stride-2 downsampling convolution between two stages, global average pooling, a final
LayerNorm and a linear head. The depthwise convolution with its channels split is where XLA's
SPMD partitioner computes a wrong kernel gradient when the input arrives replicated over the
channels (`tests/test_trust.py`), so soapjax splits its input channels with its output's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from corpus._jit import create_nnx


class Block(nnx.Module):
    def __init__(self, channels: int, *, param_dtype, rngs: nnx.Rngs):
        self.dwconv = nnx.Conv(channels, channels, (7, 7), padding=3,
                               feature_group_count=channels, param_dtype=param_dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(channels, epsilon=1e-6, param_dtype=param_dtype, rngs=rngs)
        self.pwconv1 = nnx.Linear(channels, 4 * channels, param_dtype=param_dtype, rngs=rngs)
        self.pwconv2 = nnx.Linear(4 * channels, channels, param_dtype=param_dtype, rngs=rngs)
        self.gamma = nnx.Param(jnp.full((channels,), 0.1, param_dtype))

    def __call__(self, x):
        y = self.dwconv(x)
        y = self.norm(y)
        y = self.pwconv2(nnx.gelu(self.pwconv1(y)))
        return x + self.gamma[...] * y


class ConvNeXt(nnx.Module):
    def __init__(self, *, widths: tuple[int, ...], num_classes: int, param_dtype,
                 rngs: nnx.Rngs):
        c0 = widths[0]
        self.stem = nnx.Conv(3, c0, (4, 4), strides=4, padding="VALID",
                             param_dtype=param_dtype, rngs=rngs)
        self.stem_norm = nnx.LayerNorm(c0, epsilon=1e-6, param_dtype=param_dtype, rngs=rngs)
        self.stages = nnx.List([Block(c, param_dtype=param_dtype, rngs=rngs) for c in widths])
        self.downsample = nnx.List([
            nnx.Conv(a, b, (2, 2), strides=2, padding="VALID", param_dtype=param_dtype,
                     rngs=rngs) for a, b in zip(widths, widths[1:])])
        self.head_norm = nnx.LayerNorm(widths[-1], epsilon=1e-6, param_dtype=param_dtype,
                                       rngs=rngs)
        self.head = nnx.Linear(widths[-1], num_classes, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        x = self.stem_norm(self.stem(x))
        for k, block in enumerate(self.stages):
            if k:
                x = self.downsample[k - 1](x)
            x = block(x)
        return self.head(self.head_norm(x.mean(axis=(1, 2))))


def make(*, dtype=jnp.float32, batch_size: int = 8, image_size: int = 16,
         widths: tuple[int, ...] = (8, 16), num_classes: int = 8, seed: int = 0,
         compiler_options=None):
    """The ConvNeXt's ``(loss_fn, model, batch)``."""
    model = create_nnx(lambda: ConvNeXt(widths=widths, num_classes=num_classes,
                                        param_dtype=dtype, rngs=nnx.Rngs(seed)),
                       compiler_options=compiler_options)
    k_x, k_y = jax.random.split(jax.random.key(seed + 1))
    images = jax.random.normal(k_x, (batch_size, image_size, image_size, 3), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, num_classes)

    def loss_fn(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, model, {"image": images, "label": labels}
