"""Deep kernel learning (Wilson et al., 2016), in linen: a Gaussian process regression whose
kernel reads features a network computes, trained on the exact marginal likelihood.

* an MLP maps each input to features (``Dense``, ``tanh``);
* the RBF kernel over the **batch's pairs of samples** (``[B, B]``: squared distances by
  ``|a|^2 + |b|^2 - 2 a.b``, a learned lengthscale and signal scale through ``softplus``),
  plus the noise on the diagonal (``jnp.eye``): every sample's loss depends on every other's;
* the negative log marginal likelihood by a **Cholesky factorisation** and two triangular
  solves (``jax.scipy.linalg.cho_factor`` / ``cho_solve``): ``y^T K^-1 y / 2 + sum(log
  diag L) + B log(2 pi) / 2``, divided by B.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from corpus._jit import init_linen


class DeepKernelGP(nn.Module):
    hidden: int = 16
    features: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array:
        pd = self.param_dtype
        h = jnp.tanh(nn.Dense(self.hidden, param_dtype=pd, name="fc1")(x))
        f = nn.Dense(self.features, param_dtype=pd, name="fc2")(h)
        log_ls = self.param("log_lengthscale", nn.initializers.zeros, (), pd)
        log_sf = self.param("log_signal", nn.initializers.zeros, (), pd)
        log_sn = self.param("log_noise", nn.initializers.constant(-1.0), (), pd)
        sq = (f ** 2).sum(-1)
        d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2 * f @ f.T, 0.0)
        k = (jax.nn.softplus(log_sf) * jnp.exp(-0.5 * d2 / jax.nn.softplus(log_ls) ** 2)
             + (jax.nn.softplus(log_sn) + 1e-4) * jnp.eye(x.shape[0], dtype=f.dtype))
        chol = jax.scipy.linalg.cho_factor(k, lower=True)
        alpha = jax.scipy.linalg.cho_solve(chol, y)
        n = x.shape[0]
        nll = (0.5 * y @ alpha + jnp.log(jnp.diag(chol[0])).sum()
               + 0.5 * n * np.log(2 * np.pi))
        return nll / n


def make(*, dtype=jnp.float32, batch_size: int = 8, in_features: int = 4, seed: int = 0,
         compiler_options=None):
    """The deep-kernel GP's ``(loss_fn, params, batch)``: a smooth target plus noise."""
    model = DeepKernelGP(param_dtype=dtype)
    k_init, k_x, k_n = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (batch_size, in_features), dtype)
    y = jnp.sin(x.sum(-1)) + 0.1 * jax.random.normal(k_n, (batch_size,), dtype)
    params = init_linen(model.init, k_init, x, y, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        return model.apply({"params": params}, batch["x"], batch["y"])

    return loss_fn, params, {"x": x, "y": y}
