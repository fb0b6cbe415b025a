"""A super-resolution network ported from PyTorch to nnx, its tensors kept in PyTorch's NCHW
layout (as ports that load torch weights write it).

* convolutions by ``jax.lax.conv_general_dilated`` with ``dimension_numbers=("NCHW", "OIHW",
  "NCHW")``, their kernels `nnx.Param`\\ s in torch's ``[out, in, kh, kw]`` order;
* ``ReflectionPad2d`` before each 3x3 convolution (``jnp.pad(mode="reflect")``: slices, a
  reversal and a concatenation along height and width);
* batch normalisation written by hand over axes ``(0, 2, 3)`` in train mode, its running mean
  and variance `nnx.BatchStat`\\ s updated in the forward pass (and discarded by the loss);
* a strided downsampling convolution, a 3x3 max pool by ``jax.lax.reduce_window`` over NCHW;
* upsampling by **PixelShuffle** (``depth_to_space``: ``[B, C r^2, H, W]`` reshaped to ``[B, C,
  r, r, H, W]``, transposed to ``[B, C, H, r, W, r]``, reshaped to ``[B, C, H r, W r]``): channels
  become pixels;
* an L1 reconstruction loss plus a small classification loss on globally pooled features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from corpus._jit import create_nnx

NCHW = ("NCHW", "OIHW", "NCHW")


class Conv2d(nnx.Module):
    """torch.nn.Conv2d: an OIHW kernel and a bias."""

    def __init__(self, cin: int, cout: int, k: int, *, stride: int = 1, param_dtype,
                 rngs: nnx.Rngs):
        scale = (cin * k * k) ** -0.5
        self.weight = nnx.Param(scale * jax.random.normal(rngs.params(), (cout, cin, k, k),
                                                          param_dtype))
        self.bias = nnx.Param(jnp.zeros((cout,), param_dtype))
        self.stride = stride

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(x, self.weight[...], (self.stride, self.stride),
                                         "VALID", dimension_numbers=NCHW)
        return y + self.bias[...][None, :, None, None]


class BatchNorm2d(nnx.Module):
    """torch.nn.BatchNorm2d in train mode, by hand."""

    def __init__(self, c: int, *, param_dtype, momentum: float = 0.1):
        self.weight = nnx.Param(jnp.ones((c,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((c,), param_dtype))
        self.running_mean = nnx.BatchStat(jnp.zeros((c,), param_dtype))
        self.running_var = nnx.BatchStat(jnp.ones((c,), param_dtype))
        self.momentum = momentum

    def __call__(self, x):
        mean = x.mean(axis=(0, 2, 3))
        var = x.var(axis=(0, 2, 3))
        m = self.momentum
        self.running_mean[...] = (1 - m) * self.running_mean[...] + m * mean
        self.running_var[...] = (1 - m) * self.running_var[...] + m * var
        y = (x - mean[None, :, None, None]) * jax.lax.rsqrt(var[None, :, None, None] + 1e-5)
        return y * self.weight[...][None, :, None, None] + self.bias[...][None, :, None, None]


def reflect_pad(x, p: int = 1):
    return jnp.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), mode="reflect")


def pixel_shuffle(x, r: int):
    b, c, h, w = x.shape
    x = x.reshape(b, c // (r * r), r, r, h, w)
    return x.transpose(0, 1, 4, 2, 5, 3).reshape(b, c // (r * r), h * r, w * r)


class ResBlock(nnx.Module):
    def __init__(self, c: int, *, param_dtype, rngs: nnx.Rngs):
        self.conv1 = Conv2d(c, c, 3, param_dtype=param_dtype, rngs=rngs)
        self.bn1 = BatchNorm2d(c, param_dtype=param_dtype)
        self.conv2 = Conv2d(c, c, 3, param_dtype=param_dtype, rngs=rngs)
        self.bn2 = BatchNorm2d(c, param_dtype=param_dtype)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(reflect_pad(x))))
        return x + self.bn2(self.conv2(reflect_pad(y)))


class SuperResolution(nnx.Module):
    def __init__(self, *, channels: int = 8, num_classes: int = 4, scale: int = 2, param_dtype,
                 rngs: nnx.Rngs):
        self.head = Conv2d(3, channels, 3, param_dtype=param_dtype, rngs=rngs)
        self.head_bn = BatchNorm2d(channels, param_dtype=param_dtype)
        self.body = nnx.List([ResBlock(channels, param_dtype=param_dtype, rngs=rngs)
                              for _ in range(2)])
        self.down = Conv2d(channels, 2 * channels, 2, stride=2, param_dtype=param_dtype,
                           rngs=rngs)
        self.classifier = nnx.Linear(2 * channels, num_classes, param_dtype=param_dtype,
                                     rngs=rngs)
        self.up = Conv2d(channels, 3 * scale * scale, 3, param_dtype=param_dtype, rngs=rngs)
        self.scale = scale

    def __call__(self, x):
        f = nnx.relu(self.head_bn(self.head(reflect_pad(x))))
        for block in self.body:
            f = block(f)
        d = nnx.relu(self.down(f))
        pooled = jax.lax.reduce_window(d, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 1, 1),
                                       ((0, 0), (0, 0), (1, 1), (1, 1)))
        logits = self.classifier(pooled.mean(axis=(2, 3)))
        return pixel_shuffle(self.up(reflect_pad(f)), self.scale), logits


def make(*, dtype=jnp.float32, batch_size: int = 8, image_size: int = 8, seed: int = 0,
         compiler_options=None, **config):
    """The network's ``(loss_fn, model, batch)``: L1 against the high-resolution image (twice
    the low one's size) plus 0.1 x the cross-entropy of the class."""
    model = create_nnx(lambda: SuperResolution(param_dtype=dtype, rngs=nnx.Rngs(seed), **config),
                       compiler_options=compiler_options)
    k_lo, k_hi, k_y = jax.random.split(jax.random.key(seed + 1), 3)
    low = jax.random.normal(k_lo, (batch_size, 3, image_size, image_size), dtype)
    high = jax.random.normal(k_hi, (batch_size, 3, 2 * image_size, 2 * image_size), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, model.classifier.out_features)

    def loss_fn(model, batch):
        image, logits = model(batch["low"])
        l1 = jnp.abs(image - batch["high"]).mean()
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return l1 + 0.1 * ce

    return loss_fn, model, {"low": low, "high": high, "label": labels}
