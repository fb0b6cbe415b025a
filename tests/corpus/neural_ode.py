"""A neural ODE in linen: a learned vector field integrated by fixed-step RK4 in a
``jax.lax.fori_loop``, the loss on the final state.

As users write continuous-depth models without an ODE library: the vector field's weights
are ``self.param``s read by a pure function the loop body closes over (calling a linen
submodule inside ``fori_loop`` would create parameters inside the loop's trace), the time
enters the field as an input feature, and the loss (MSE against a target state) reads the
loop's result directly, so soapjax groups the loop with the loss: one operator whose batch
dim is summed inside it. An encoder ``Dense`` lifts the inputs into the state first.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


class NeuralODE(nn.Module):
    dim: int = 16
    hidden: int = 32
    steps: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        pd = self.param_dtype
        normal = nn.initializers.normal(0.3)
        w1 = self.param("w1", normal, (self.dim + 1, self.hidden), pd)
        b1 = self.param("b1", nn.initializers.zeros, (self.hidden,), pd)
        w2 = self.param("w2", normal, (self.hidden, self.dim), pd)
        h = nn.Dense(self.dim, param_dtype=pd, name="encoder")(x)
        dt = 1.0 / self.steps

        def field(t, y):
            ty = jnp.concatenate([y, jnp.full(y.shape[:-1] + (1,), t, y.dtype)], axis=-1)
            return jnp.tanh(ty @ w1 + b1) @ w2

        def rk4(i, y):
            t = i * dt
            k1 = field(t, y)
            k2 = field(t + dt / 2, y + dt / 2 * k1)
            k3 = field(t + dt / 2, y + dt / 2 * k2)
            k4 = field(t + dt, y + dt * k3)
            return y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)

        return jax.lax.fori_loop(0, self.steps, rk4, h)


def make(*, dtype=jnp.float32, batch_size: int = 8, features: int = 12, seed: int = 0,
         compiler_options=None):
    """The neural ODE's ``(loss_fn, params, batch)``."""
    k = jax.random.split(jax.random.key(seed), 3)
    model = NeuralODE(param_dtype=dtype)
    batch = {"x": jax.random.normal(k[0], (batch_size, features), dtype),
             "target": jax.random.normal(k[1], (batch_size, model.dim), dtype)}
    params = init_linen(model.init, k[2], batch["x"],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        final = model.apply({"params": params}, batch["x"])
        return jnp.mean((final - batch["target"]) ** 2)

    return loss_fn, params, batch
