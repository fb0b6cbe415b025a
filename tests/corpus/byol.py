"""A BYOL self-supervised step (Grill et al., 2020), in linen: an online network trained to
predict a target network's projection of another view of the same image.

* two augmented views made inside the loss from the batch's images (a flip by ``[:, :, ::-1]``
  and a brightness jitter per sample and view from the batch, ``[B, 2]``);
* the **online network**: a small CNN encoder (strided convolutions, GroupNorm, global mean
  pool), a projector MLP with BatchNorm and a predictor MLP; trained;
* the **target network**: the same encoder and projector with its own weights (an
  exponential moving average the training loop keeps), held beside the online ones in the
  parameters (``params["target"]``) and applied under ``jax.lax.stop_gradient``, so its
  gradient is exactly zero (a leaf a comparison holds to the floor);
* the symmetric loss: ``2 - 2 cos(p, sg(z'))`` both ways, normalised by ``jnp.linalg.norm``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


class Encoder(nn.Module):
    width: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pd = self.param_dtype
        for i, w in enumerate((self.width, 2 * self.width)):
            x = nn.Conv(w, (3, 3), strides=(2, 2), param_dtype=pd, name=f"conv_{i}")(x)
            x = nn.relu(nn.GroupNorm(num_groups=4, param_dtype=pd, name=f"gn_{i}")(x))
        return x.mean(axis=(1, 2))


class MLP(nn.Module):
    hidden: int
    out: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pd = self.param_dtype
        x = nn.Dense(self.hidden, param_dtype=pd, name="fc_0")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, param_dtype=pd, name="bn")(x))
        return nn.Dense(self.out, param_dtype=pd, name="fc_1")(x)


class Projected(nn.Module):
    """Encoder then projector: the part the target network copies."""
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return MLP(32, 16, self.param_dtype, name="projector")(
            Encoder(param_dtype=self.param_dtype, name="encoder")(x))


def _cosine_loss(p: jax.Array, z: jax.Array) -> jax.Array:
    p = p / jnp.linalg.norm(p, axis=-1, keepdims=True)
    z = z / jnp.linalg.norm(z, axis=-1, keepdims=True)
    return (2 - 2 * (p * z).sum(-1)).mean()


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 8, seed: int = 0,
         compiler_options=None):
    """BYOL's ``(loss_fn, params, batch)``: ``params`` holds the online network, its
    predictor and the target network (whose gradient is zero)."""
    online, predictor = Projected(dtype), MLP(32, 16, dtype)
    k_on, k_pred, k_tgt, k_x, k_j = jax.random.split(jax.random.key(seed), 5)
    images = jax.random.uniform(k_x, (batch_size, size, size, 3), dtype)
    jitter = jax.random.uniform(k_j, (batch_size, 2), dtype, 0.8, 1.2)

    def init(k_on, k_pred, x):
        v = online.init(k_on, x)
        return {"online": v["params"],
                "predictor": predictor.init(k_pred, online.apply(v, x, mutable=[
                    "batch_stats"])[0])["params"]}

    params = init_linen(init, k_on, k_pred, images, compiler_options=compiler_options)
    params["target"] = init_linen(lambda k, x: online.init(k, x)["params"], k_tgt, images,
                                  compiler_options=compiler_options)

    def project(p, x):
        return online.apply({"params": p}, x, mutable=["batch_stats"])[0]

    def loss_fn(params, batch):
        x = batch["images"]
        jitter = batch["jitter"][:, :, None, None, None]
        views = (x * jitter[:, 0], x[:, :, ::-1] * jitter[:, 1])
        preds = [predictor.apply({"params": params["predictor"]},
                                 project(params["online"], v), mutable=["batch_stats"])[0]
                 for v in views]
        targets = [jax.lax.stop_gradient(project(params["target"], v)) for v in views]
        return _cosine_loss(preds[0], targets[1]) + _cosine_loss(preds[1], targets[0])

    return loss_fn, params, {"images": images, "jitter": jitter}
