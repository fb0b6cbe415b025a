"""A plain multilayer perceptron, in linen and in nnx with the same parameter paths.

The two twins name their layers alike (``fc1`` .. ``fcN``, ``head``), so linen's
``params["params"]["fc1"]["kernel"]`` and the nnx state's ``params["fc1"]["kernel"]`` are the
same module path, ``fc1``. Their initial values may differ; their shapes do not. The nnx twin
also opens a `jax.named_scope` per layer, so its traced operators carry the same names.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from soapjax_zoo.workload import Batch, Workload, linen_workload, nnx_workload, sgd_momentum


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Dense ReLU layers of ``hidden`` widths, then a classifier.

    Attributes:
      in_features: width of one input sample.
      hidden: the hidden layers' widths, named ``fc1``, ``fc2``, ...
      num_classes: width of the output layer, named ``head``.
    """

    batch_size: int = 256
    in_features: int = 1024
    hidden: tuple[int, ...] = (4096, 4096, 4096, 4096)
    num_classes: int = 1000
    learning_rate: float = 0.01
    weight_decay: float = 0.0


class MLP(nn.Module):
    """The linen MLP."""

    config: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, features in enumerate(self.config.hidden):
            x = nn.relu(nn.Dense(features, name=f"fc{i + 1}")(x))
        return nn.Dense(self.config.num_classes, name="head")(x)


class NnxMLP(nnx.Module):
    """The nnx MLP; attribute ``fc{i}`` is linen's ``name=f"fc{i}"``."""

    def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs) -> None:
        self.num_hidden = len(config.hidden)
        widths = (config.in_features, *config.hidden)
        for i in range(self.num_hidden):
            setattr(self, f"fc{i + 1}", nnx.Linear(widths[i], widths[i + 1], rngs=rngs))
        self.head = nnx.Linear(widths[-1], config.num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        # nnx, unlike linen, opens no `jax.named_scope` per module; these give the traced
        # operators linen's names (``fc1``, ...; linen adds its root, ``MLP/fc1``).
        for i in range(self.num_hidden):
            with jax.named_scope(f"fc{i + 1}"):
                x = nnx.relu(getattr(self, f"fc{i + 1}")(x))
        with jax.named_scope("head"):
            return self.head(x)


MLP_CONFIGS = {
    "default": MLPConfig(),
    "tiny": MLPConfig(batch_size=8, in_features=16, hidden=(32, 32), num_classes=10),
}


def build_mlp(name: str, config: str, cfg: MLPConfig, api: str) -> Workload:
    """The MLP workload on synthetic feature vectors, in linen or (``api="nnx"``) in nnx."""

    def make_batch(rng: jax.Array) -> Batch:
        k_x, k_label = jax.random.split(rng)
        return {
            "inputs": jax.random.normal(k_x, (cfg.batch_size, cfg.in_features), jnp.float32),
            "label": jax.random.randint(k_label, (cfg.batch_size,), 0, cfg.num_classes, jnp.int32),
        }

    widths = "x".join(str(h) for h in cfg.hidden)
    common = dict(
        name=name,
        config=config,
        family="mlp",
        description=f"MLP {cfg.in_features} -> {widths} -> {cfg.num_classes}, ReLU",
        make_batch=make_batch,
        inputs=("inputs",),
        label="label",
        optimizer=sgd_momentum(cfg.learning_rate, 0.9, cfg.weight_decay),
    )
    if api == "nnx":
        return nnx_workload(make_model=lambda rngs: NnxMLP(cfg, rngs=rngs), **common)
    return linen_workload(module=MLP(cfg), **common)
