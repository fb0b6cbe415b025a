"""A deep ensemble of MLP regressors in one module, in linen, by Flax's lifted ``nn.vmap``.

* ``nn.vmap`` over a member MLP with ``variable_axes={"params": 0}`` and
  ``split_rngs={"params": True}``: every parameter gets a leading ensemble axis (4 members),
  the input is shared (``in_axes=None``) and the outputs stacked ``[E, B, 1]``;
* a Gaussian negative log-likelihood per member (a mean head and a ``softplus`` variance
  head), averaged over the members and the batch.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


class Member(nn.Module):
    hidden: int = 16
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        pd = self.param_dtype
        h = nn.relu(nn.Dense(self.hidden, param_dtype=pd, name="fc_0")(x))
        h = nn.relu(nn.Dense(self.hidden, param_dtype=pd, name="fc_1")(h))
        mean = nn.Dense(1, param_dtype=pd, name="mean")(h)
        var = nn.softplus(nn.Dense(1, param_dtype=pd, name="var")(h)) + 1e-3
        return mean, var


class Ensemble(nn.Module):
    members: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        vmapped = nn.vmap(Member, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=None, out_axes=0, axis_size=self.members)
        return vmapped(param_dtype=self.param_dtype, name="members")(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, features: int = 12, seed: int = 0,
         compiler_options=None):
    """The ensemble's ``(loss_fn, params, batch)``: batch ``{"x": [B, F], "y": [B, 1]}``."""
    model = Ensemble(param_dtype=dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    batch = {"x": jax.random.normal(k_x, (batch_size, features), dtype),
             "y": jax.random.normal(k_y, (batch_size, 1), dtype)}
    params = init_linen(model.init, k_init, batch["x"],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        mean, var = model.apply({"params": params}, batch["x"])
        nll = 0.5 * (jnp.log(var) + (batch["y"][None] - mean) ** 2 / var)
        return nll.mean()

    return loss_fn, params, batch
