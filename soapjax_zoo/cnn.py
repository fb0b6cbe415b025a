"""Convolutional workloads: AlexNet, Inception-v3, ResNet-101 and LeNet (linen; LeNet also nnx).

The full-size configs are those of the FlexFlow paper (section 8.1): ImageNet-sized inputs,
1000 classes, batch 256 for AlexNet and 64 for the others, SGD with momentum. Inception-v3 and
ResNet-101 use BatchNorm in training mode: each layer normalises with the statistics of the
current batch, and the running averages are computed inside the loss and dropped (see
`soapjax_zoo.workload.linen_workload`), so the parameters are the trained ones only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from soapjax_zoo.workload import (
    Batch,
    ModelConfigError,
    Workload,
    linen_workload,
    nnx_workload,
    sgd_momentum,
)


def image_batch(
    batch_size: int, image_size: int, channels: int, num_classes: int
) -> Callable[[jax.Array], Batch]:
    """``make_batch`` for NHWC float32 images with int32 class labels."""

    def make_batch(rng: jax.Array) -> Batch:
        k_image, k_label = jax.random.split(rng)
        shape = (batch_size, image_size, image_size, channels)
        return {
            "image": jax.random.normal(k_image, shape, jnp.float32),
            "label": jax.random.randint(k_label, (batch_size,), 0, num_classes, jnp.int32),
        }

    return make_batch


def _max_pool(
    x: jax.Array, window: int, stride: int, padding: str | Sequence[tuple[int, int]] = "VALID"
) -> jax.Array:
    return nn.max_pool(x, (window, window), strides=(stride, stride), padding=padding)


# AlexNet ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AlexNetConfig:
    """AlexNet as in FlexFlow's and torchvision's (64-192-384-256-256 convs, 2 x 4096 FCs)."""

    batch_size: int = 256
    image_size: int = 224
    num_classes: int = 1000
    conv_features: tuple[int, int, int, int, int] = (64, 192, 384, 256, 256)
    fc_features: int = 4096
    learning_rate: float = 0.01
    weight_decay: float = 5e-4

    def __post_init__(self) -> None:
        if self.image_size < 63:  # conv1 and three stride-2 pools must leave at least 1x1
            raise ModelConfigError(f"AlexNet needs image_size >= 63, got {self.image_size}")


class AlexNet(nn.Module):
    """AlexNet without local response normalisation or dropout; 61.1M parameters at 224x224."""

    config: AlexNetConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        f1, f2, f3, f4, f5 = self.config.conv_features
        x = nn.Conv(f1, (11, 11), strides=(4, 4), padding=((2, 2), (2, 2)), name="conv1")(x)
        x = nn.relu(x)
        x = _max_pool(x, 3, 2)
        x = nn.relu(nn.Conv(f2, (5, 5), padding=((2, 2), (2, 2)), name="conv2")(x))
        x = _max_pool(x, 3, 2)
        x = nn.relu(nn.Conv(f3, (3, 3), padding=((1, 1), (1, 1)), name="conv3")(x))
        x = nn.relu(nn.Conv(f4, (3, 3), padding=((1, 1), (1, 1)), name="conv4")(x))
        x = nn.relu(nn.Conv(f5, (3, 3), padding=((1, 1), (1, 1)), name="conv5")(x))
        x = _max_pool(x, 3, 2)
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(self.config.fc_features, name="fc6")(x))
        x = nn.relu(nn.Dense(self.config.fc_features, name="fc7")(x))
        return nn.Dense(self.config.num_classes, name="fc8")(x)


ALEXNET_CONFIGS = {
    "default": AlexNetConfig(),
    "tiny": AlexNetConfig(
        batch_size=8,
        image_size=64,
        num_classes=10,
        conv_features=(8, 16, 16, 16, 16),
        fc_features=32,
    ),
}


def build_alexnet(name: str, config: str, cfg: AlexNetConfig, api: str) -> Workload:
    """The AlexNet workload (synthetic images, as the paper benchmarked it)."""
    return linen_workload(
        name=name,
        config=config,
        family="cnn",
        description=(
            f"AlexNet, {cfg.image_size}x{cfg.image_size}x3 images, {cfg.num_classes} classes"
        ),
        module=AlexNet(cfg),
        make_batch=image_batch(cfg.batch_size, cfg.image_size, 3, cfg.num_classes),
        inputs=("image",),
        label="label",
        optimizer=sgd_momentum(cfg.learning_rate, 0.9, cfg.weight_decay),
    )


# Inception-v3 ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InceptionV3Config:
    """Inception-v3 (Szegedy et al. 2016) without the auxiliary head; torchvision's layout.

    Attributes:
      width: multiplies every channel count (1.0 is the paper's network).
      a_pool_features: one Inception-A block (mixed_5*) per entry, its pool-branch width.
      c_channels_7x7: one Inception-C block (mixed_6b..) per entry, its 7x7-branch width.
      e_blocks: number of Inception-E blocks (mixed_7b..).
    """

    batch_size: int = 64
    image_size: int = 299
    num_classes: int = 1000
    width: float = 1.0
    a_pool_features: tuple[int, ...] = (32, 64, 64)
    c_channels_7x7: tuple[int, ...] = (128, 160, 160, 192)
    e_blocks: int = 2
    learning_rate: float = 0.045
    weight_decay: float = 1e-4

    def __post_init__(self) -> None:
        if self.image_size < 75:  # five stride-2 VALID stages must leave at least 1x1
            raise ModelConfigError(f"Inception-v3 needs image_size >= 75, got {self.image_size}")


class ConvBN(nn.Module):
    """Convolution without bias, BatchNorm on batch statistics, ReLU (torchvision's BasicConv2d)."""

    features: int
    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    padding: str = "SAME"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(
            self.features,
            self.kernel,
            self.strides,
            padding=self.padding,
            use_bias=False,
            name="conv",
        )(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-3, name="bn")(x)
        return nn.relu(x)


def _avg_pool_same(x: jax.Array) -> jax.Array:
    return nn.avg_pool(x, (3, 3), strides=(1, 1), padding="SAME")


class InceptionA(nn.Module):
    """35x35 block: 1x1, 5x5, double 3x3 and pool branches."""

    pool_features: int
    width: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = functools.partial(_scaled, self.width)
        b1 = ConvBN(c(64), (1, 1), name="branch1x1")(x)
        b5 = ConvBN(c(48), (1, 1), name="branch5x5_1")(x)
        b5 = ConvBN(c(64), (5, 5), name="branch5x5_2")(b5)
        b3 = ConvBN(c(64), (1, 1), name="branch3x3dbl_1")(x)
        b3 = ConvBN(c(96), (3, 3), name="branch3x3dbl_2")(b3)
        b3 = ConvBN(c(96), (3, 3), name="branch3x3dbl_3")(b3)
        bp = ConvBN(c(self.pool_features), (1, 1), name="branch_pool")(_avg_pool_same(x))
        return jnp.concatenate([b1, b5, b3, bp], axis=-1)


class InceptionB(nn.Module):
    """Grid reduction 35x35 -> 17x17."""

    width: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = functools.partial(_scaled, self.width)
        b3 = ConvBN(c(384), (3, 3), (2, 2), "VALID", name="branch3x3")(x)
        bd = ConvBN(c(64), (1, 1), name="branch3x3dbl_1")(x)
        bd = ConvBN(c(96), (3, 3), name="branch3x3dbl_2")(bd)
        bd = ConvBN(c(96), (3, 3), (2, 2), "VALID", name="branch3x3dbl_3")(bd)
        return jnp.concatenate([b3, bd, _max_pool(x, 3, 2)], axis=-1)


class InceptionC(nn.Module):
    """17x17 block with factorised 7x7 convolutions (1x7 then 7x1)."""

    channels_7x7: int
    width: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = functools.partial(_scaled, self.width)
        c7 = c(self.channels_7x7)
        b1 = ConvBN(c(192), (1, 1), name="branch1x1")(x)
        b7 = ConvBN(c7, (1, 1), name="branch7x7_1")(x)
        b7 = ConvBN(c7, (1, 7), name="branch7x7_2")(b7)
        b7 = ConvBN(c(192), (7, 1), name="branch7x7_3")(b7)
        bd = ConvBN(c7, (1, 1), name="branch7x7dbl_1")(x)
        bd = ConvBN(c7, (7, 1), name="branch7x7dbl_2")(bd)
        bd = ConvBN(c7, (1, 7), name="branch7x7dbl_3")(bd)
        bd = ConvBN(c7, (7, 1), name="branch7x7dbl_4")(bd)
        bd = ConvBN(c(192), (1, 7), name="branch7x7dbl_5")(bd)
        bp = ConvBN(c(192), (1, 1), name="branch_pool")(_avg_pool_same(x))
        return jnp.concatenate([b1, b7, bd, bp], axis=-1)


class InceptionD(nn.Module):
    """Grid reduction 17x17 -> 8x8."""

    width: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = functools.partial(_scaled, self.width)
        b3 = ConvBN(c(192), (1, 1), name="branch3x3_1")(x)
        b3 = ConvBN(c(320), (3, 3), (2, 2), "VALID", name="branch3x3_2")(b3)
        b7 = ConvBN(c(192), (1, 1), name="branch7x7x3_1")(x)
        b7 = ConvBN(c(192), (1, 7), name="branch7x7x3_2")(b7)
        b7 = ConvBN(c(192), (7, 1), name="branch7x7x3_3")(b7)
        b7 = ConvBN(c(192), (3, 3), (2, 2), "VALID", name="branch7x7x3_4")(b7)
        return jnp.concatenate([b3, b7, _max_pool(x, 3, 2)], axis=-1)


class InceptionE(nn.Module):
    """8x8 block with expanded filter banks (1x3 and 3x1 side by side)."""

    width: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = functools.partial(_scaled, self.width)
        b1 = ConvBN(c(320), (1, 1), name="branch1x1")(x)
        b3 = ConvBN(c(384), (1, 1), name="branch3x3_1")(x)
        b3 = jnp.concatenate(
            [
                ConvBN(c(384), (1, 3), name="branch3x3_2a")(b3),
                ConvBN(c(384), (3, 1), name="branch3x3_2b")(b3),
            ],
            axis=-1,
        )
        bd = ConvBN(c(448), (1, 1), name="branch3x3dbl_1")(x)
        bd = ConvBN(c(384), (3, 3), name="branch3x3dbl_2")(bd)
        bd = jnp.concatenate(
            [
                ConvBN(c(384), (1, 3), name="branch3x3dbl_3a")(bd),
                ConvBN(c(384), (3, 1), name="branch3x3dbl_3b")(bd),
            ],
            axis=-1,
        )
        bp = ConvBN(c(192), (1, 1), name="branch_pool")(_avg_pool_same(x))
        return jnp.concatenate([b1, b3, bd, bp], axis=-1)


def _scaled(width: float, channels: int) -> int:
    return max(1, round(channels * width))


class InceptionV3(nn.Module):
    """Inception-v3: stem, A x3, B, C x4, D, E x2, global average pool, classifier."""

    config: InceptionV3Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        c = functools.partial(_scaled, cfg.width)
        x = ConvBN(c(32), (3, 3), (2, 2), "VALID", name="conv2d_1a_3x3")(x)
        x = ConvBN(c(32), (3, 3), padding="VALID", name="conv2d_2a_3x3")(x)
        x = ConvBN(c(64), (3, 3), name="conv2d_2b_3x3")(x)
        x = _max_pool(x, 3, 2)
        x = ConvBN(c(80), (1, 1), padding="VALID", name="conv2d_3b_1x1")(x)
        x = ConvBN(c(192), (3, 3), padding="VALID", name="conv2d_4a_3x3")(x)
        x = _max_pool(x, 3, 2)
        for i, pool_features in enumerate(cfg.a_pool_features):
            x = InceptionA(pool_features, cfg.width, name=f"mixed_5{_letter(i + 1)}")(x)
        x = InceptionB(cfg.width, name="mixed_6a")(x)
        for i, channels_7x7 in enumerate(cfg.c_channels_7x7):
            x = InceptionC(channels_7x7, cfg.width, name=f"mixed_6{_letter(i + 1)}")(x)
        x = InceptionD(cfg.width, name="mixed_7a")(x)
        for i in range(cfg.e_blocks):
            x = InceptionE(cfg.width, name=f"mixed_7{_letter(i + 1)}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.num_classes, name="fc")(x)


def _letter(i: int) -> str:
    return "abcdefghijklmnopqrstuvwxyz"[i]


INCEPTION_V3_CONFIGS = {
    "default": InceptionV3Config(),
    # 75x75 is the smallest input the stride-2 VALID convolutions accept (8x8 -> 1x1 at the end).
    "tiny": InceptionV3Config(
        batch_size=8,
        image_size=75,
        num_classes=10,
        width=0.125,
        a_pool_features=(32,),
        c_channels_7x7=(128,),
        e_blocks=1,
    ),
}


def build_inception_v3(name: str, config: str, cfg: InceptionV3Config, api: str) -> Workload:
    """The Inception-v3 workload (no auxiliary classifier)."""
    return linen_workload(
        name=name,
        config=config,
        family="cnn",
        description=(
            f"Inception-v3 without aux head, {cfg.image_size}x{cfg.image_size}x3 images, "
            f"{cfg.num_classes} classes, BatchNorm on batch statistics"
        ),
        module=InceptionV3(cfg),
        make_batch=image_batch(cfg.batch_size, cfg.image_size, 3, cfg.num_classes),
        inputs=("image",),
        label="label",
        optimizer=sgd_momentum(cfg.learning_rate, 0.9, cfg.weight_decay),
        batch_stats=True,
    )


# ResNet-101 ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """ResNet with bottleneck blocks (He et al. 2016), stride on the 3x3 conv (torchvision's v1.5).

    Attributes:
      stage_sizes: bottleneck blocks per stage; (3, 4, 23, 3) is ResNet-101.
      width: channels of the stem and of the first stage's 3x3 convs (64 in the paper).
    """

    batch_size: int = 64
    image_size: int = 224
    num_classes: int = 1000
    stage_sizes: tuple[int, ...] = (3, 4, 23, 3)
    width: int = 64
    learning_rate: float = 0.1
    weight_decay: float = 1e-4


def _bn(name: str) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5, name=name)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a projection shortcut where the shape changes."""

    features: int
    strides: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = (self.strides, self.strides)
        y = nn.relu(_bn("bn1")(nn.Conv(self.features, (1, 1), use_bias=False, name="conv1")(x)))
        y = nn.Conv(
            self.features, (3, 3), s, padding=((1, 1), (1, 1)), use_bias=False, name="conv2"
        )(y)
        y = nn.relu(_bn("bn2")(y))
        y = _bn("bn3")(nn.Conv(4 * self.features, (1, 1), use_bias=False, name="conv3")(y))
        if x.shape[-1] != 4 * self.features or self.strides != 1:
            x = nn.Conv(4 * self.features, (1, 1), s, use_bias=False, name="downsample_conv")(x)
            x = _bn("downsample_bn")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """ResNet: 7x7 stem, four stages of bottlenecks named ``layer{stage}_{block}``, classifier."""

    config: ResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = nn.Conv(
            cfg.width, (7, 7), (2, 2), padding=((3, 3), (3, 3)), use_bias=False, name="conv1"
        )(x)
        x = nn.relu(_bn("bn1")(x))
        x = _max_pool(x, 3, 2, padding=((1, 1), (1, 1)))
        for stage, blocks in enumerate(cfg.stage_sizes):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = Bottleneck(
                    cfg.width * 2**stage, strides, name=f"layer{stage + 1}_{block}"
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.num_classes, name="fc")(x)


RESNET101_CONFIGS = {
    "default": ResNetConfig(),
    "tiny": ResNetConfig(
        batch_size=8, image_size=32, num_classes=10, stage_sizes=(1, 1, 1, 1), width=8
    ),
}


def build_resnet101(name: str, config: str, cfg: ResNetConfig, api: str) -> Workload:
    """The ResNet-101 workload."""
    depth = 3 * sum(cfg.stage_sizes) + 2
    return linen_workload(
        name=name,
        config=config,
        family="cnn",
        description=(
            f"ResNet-{depth} (bottleneck {list(cfg.stage_sizes)}), "
            f"{cfg.image_size}x{cfg.image_size}x3 images, {cfg.num_classes} classes, "
            "BatchNorm on batch statistics"
        ),
        module=ResNet(cfg),
        make_batch=image_batch(cfg.batch_size, cfg.image_size, 3, cfg.num_classes),
        inputs=("image",),
        label="label",
        optimizer=sgd_momentum(cfg.learning_rate, 0.9, cfg.weight_decay),
        batch_stats=True,
    )


# LeNet -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeNetConfig:
    """Caffe's MNIST LeNet, the paper's 6-layer CNN: conv-pool-conv-pool-fc-fc (20/50/500/10)."""

    batch_size: int = 64
    image_size: int = 28
    num_classes: int = 10
    conv_features: tuple[int, int] = (20, 50)
    fc_features: int = 500
    learning_rate: float = 0.01
    weight_decay: float = 5e-4


class LeNet(nn.Module):
    """LeNet on 28x28x1 images, VALID 5x5 convolutions, 2x2 max pools, ReLUs."""

    config: LeNetConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        f1, f2 = self.config.conv_features
        x = _max_pool(nn.relu(nn.Conv(f1, (5, 5), padding="VALID", name="conv1")(x)), 2, 2)
        x = _max_pool(nn.relu(nn.Conv(f2, (5, 5), padding="VALID", name="conv2")(x)), 2, 2)
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(self.config.fc_features, name="fc1")(x))
        return nn.Dense(self.config.num_classes, name="fc2")(x)


class NnxLeNet(nnx.Module):
    """The nnx twin of `LeNet`: same attribute names, so the same parameter paths."""

    def __init__(self, config: LeNetConfig, *, rngs: nnx.Rngs) -> None:
        f1, f2 = config.conv_features
        side = ((config.image_size - 4) // 2 - 4) // 2
        self.conv1 = nnx.Conv(1, f1, (5, 5), padding="VALID", rngs=rngs)
        self.conv2 = nnx.Conv(f1, f2, (5, 5), padding="VALID", rngs=rngs)
        self.fc1 = nnx.Linear(side * side * f2, config.fc_features, rngs=rngs)
        self.fc2 = nnx.Linear(config.fc_features, config.num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        # Named scopes give the traced operators linen's module names (nnx opens none itself).
        with jax.named_scope("conv1"):
            x = _max_pool(nnx.relu(self.conv1(x)), 2, 2)
        with jax.named_scope("conv2"):
            x = _max_pool(nnx.relu(self.conv2(x)), 2, 2)
        x = x.reshape((x.shape[0], -1))
        with jax.named_scope("fc1"):
            x = nnx.relu(self.fc1(x))
        with jax.named_scope("fc2"):
            return self.fc2(x)


LENET_CONFIGS = {
    "default": LeNetConfig(),
    "tiny": LeNetConfig(batch_size=8, conv_features=(4, 8), fc_features=32),
}


def build_lenet(name: str, config: str, cfg: LeNetConfig, api: str) -> Workload:
    """The LeNet workload, in linen or (``api="nnx"``) in nnx."""
    make_batch = image_batch(cfg.batch_size, cfg.image_size, 1, cfg.num_classes)
    description = f"LeNet (Caffe MNIST layout), {cfg.image_size}x{cfg.image_size}x1 images"
    optimizer = sgd_momentum(cfg.learning_rate, 0.9, cfg.weight_decay)
    if api == "nnx":
        return nnx_workload(
            name=name,
            config=config,
            family="cnn",
            description=description,
            make_model=lambda rngs: NnxLeNet(cfg, rngs=rngs),
            make_batch=make_batch,
            inputs=("image",),
            label="label",
            optimizer=optimizer,
        )
    return linen_workload(
        name=name,
        config=config,
        family="cnn",
        description=description,
        module=LeNet(cfg),
        make_batch=make_batch,
        inputs=("image",),
        label="label",
        optimizer=optimizer,
    )

