"""A physics-informed network for the viscous Burgers equation, written as PINN code is, in linen.

* an MLP ``u(t, x)`` with tanh activations;
* the **PDE residual by automatic differentiation inside the loss**: ``u_t``, ``u_x`` by
  ``jax.grad`` of the network with respect to its scalar inputs, ``u_xx`` by ``jax.grad`` of
  ``u_x`` (second order), each ``jax.vmap``'d over the collocation points;
  ``u_t + u u_x - nu u_xx``;
* initial and boundary conditions by plain evaluation (``-sin(pi x)`` at t = 0, zero at x =
  +-1); the loss the sum of the three mean squares, weighted.

Dim 0 of every batch leaf is the batch: 8 groups of collocation, initial and boundary points.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


class MLP(nn.Module):
    width: int = 32
    depth: int = 3
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tx: jax.Array) -> jax.Array:  # [..., 2] -> [...]
        h = tx
        for i in range(self.depth):
            h = jnp.tanh(nn.Dense(self.width, param_dtype=self.param_dtype, name=f"dense_{i}")(h))
        return nn.Dense(1, param_dtype=self.param_dtype, name="out")(h)[..., 0]


def make(*, dtype=jnp.float32, batch_size: int = 8, points: int = 16, nu: float = 0.01 / jnp.pi,
         seed: int = 0, compiler_options=None, **config):
    """The PINN's ``(loss_fn, params, batch)``: PDE residual, initial and boundary losses."""
    model = MLP(param_dtype=dtype, **config)
    k_init, k_c, k_i, k_b = jax.random.split(jax.random.key(seed), 4)
    collocation = jax.random.uniform(k_c, (batch_size, points, 2), dtype, -1.0, 1.0)
    collocation = collocation.at[..., 0].set((collocation[..., 0] + 1) / 2)  # t in [0, 1]
    x0 = jax.random.uniform(k_i, (batch_size, points), dtype, -1.0, 1.0)
    tb = jax.random.uniform(k_b, (batch_size, points), dtype)
    params = init_linen(model.init, k_init, collocation,
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        def u(t, x):
            return model.apply({"params": params}, jnp.stack([t, x]))

        u_t = jax.grad(u, argnums=0)
        u_x = jax.grad(u, argnums=1)
        u_xx = jax.grad(u_x, argnums=1)

        def residual(tx):
            t, x = tx[0], tx[1]
            return u_t(t, x) + u(t, x) * u_x(t, x) - nu * u_xx(t, x)

        pts = batch["collocation"].reshape(-1, 2)
        r = jax.vmap(residual)(pts)
        x0 = batch["x0"]
        u0 = model.apply({"params": params}, jnp.stack([jnp.zeros_like(x0), x0], axis=-1))
        tb = batch["tb"]
        ub = model.apply({"params": params},
                         jnp.stack([jnp.concatenate([tb, tb], axis=1),
                                    jnp.concatenate([-jnp.ones_like(tb), jnp.ones_like(tb)],
                                                    axis=1)], axis=-1))
        return (jnp.mean(r ** 2) + 10.0 * jnp.mean((u0 + jnp.sin(jnp.pi * x0)) ** 2)
                + 10.0 * jnp.mean(ub ** 2))

    return loss_fn, params, {"collocation": collocation, "x0": x0, "tb": tb}
