"""A Fourier neural operator (Li et al., 2021) in linen, as the JAX ports of neuraloperator's
``FNO2d`` write it: **complex parameters**.

* the input field ``[B, X, Y, 1]`` with its grid coordinates (``jnp.linspace``, broadcast to
  the batch) concatenated as two more channels, lifted by a ``Dense``;
* spectral layers: ``jnp.fft.rfft2`` over the two space axes, the lowest ``modes`` frequencies
  of both signs of the first axis (two corners, ``x_ft[:, :m]`` and ``x_ft[:, -m:]``) mixed
  across channels by an ``einsum`` with **complex** weights (``complex64``, or ``complex128``
  beside float64 parameters, initialised as ``scale * (U + iU)``), written into a zero
  spectrum by ``.at[...].set``, ``jnp.fft.irfft2`` back to the grid; plus a 1x1 ``nn.Conv``
  of the field, then a GELU (not after the last layer);
* a two-layer projection and FNO's relative L2 loss (``jnp.linalg.norm`` per sample).

``jax.grad`` of a real loss by a complex parameter is the conjugate of the Wirtinger
derivative, and optax's Adam keeps complex moments: the imaginary parts are half of what a
sharded step must get right.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


def _complex_uniform(scale: float):
    def init(key: jax.Array, shape: tuple[int, ...], dtype=jnp.complex64) -> jax.Array:
        real = jnp.finfo(dtype).dtype  # complex64 -> float32
        kr, ki = jax.random.split(key)
        return (scale * (jax.random.uniform(kr, shape, real)
                         + 1j * jax.random.uniform(ki, shape, real))).astype(dtype)
    return init


class SpectralConv2d(nn.Module):
    out_channels: int
    modes: int
    complex_dtype: jnp.dtype = jnp.complex64

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        m, shape = self.modes, (c, self.out_channels, self.modes, self.modes)
        init = _complex_uniform(1.0 / (c * self.out_channels))
        w1 = self.param("weights1", init, shape, self.complex_dtype)
        w2 = self.param("weights2", init, shape, self.complex_dtype)
        x_ft = jnp.fft.rfft2(x, axes=(1, 2))
        out_ft = jnp.zeros((b, h, w // 2 + 1, self.out_channels), x_ft.dtype)
        out_ft = out_ft.at[:, :m, :m, :].set(
            jnp.einsum("bxyi,ioxy->bxyo", x_ft[:, :m, :m, :], w1))
        out_ft = out_ft.at[:, -m:, :m, :].set(
            jnp.einsum("bxyi,ioxy->bxyo", x_ft[:, -m:, :m, :], w2))
        return jnp.fft.irfft2(out_ft, s=(h, w), axes=(1, 2))


class FNO2d(nn.Module):
    width: int = 16
    modes: int = 3
    layers: int = 3
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, a: jax.Array) -> jax.Array:
        b, h, w, _ = a.shape
        cdtype = jnp.complex128 if self.param_dtype == jnp.float64 else jnp.complex64
        gx = jnp.broadcast_to(jnp.linspace(0, 1, h, dtype=a.dtype)[None, :, None, None],
                              (b, h, w, 1))
        gy = jnp.broadcast_to(jnp.linspace(0, 1, w, dtype=a.dtype)[None, None, :, None],
                              (b, h, w, 1))
        x = nn.Dense(self.width, param_dtype=self.param_dtype, name="lift")(
            jnp.concatenate([a, gx, gy], axis=-1))
        for i in range(self.layers):
            x1 = SpectralConv2d(self.width, self.modes, cdtype, name=f"spectral_{i}")(x)
            x2 = nn.Conv(self.width, (1, 1), param_dtype=self.param_dtype, name=f"w_{i}")(x)
            x = x1 + x2
            if i < self.layers - 1:
                x = nn.gelu(x)
        x = nn.gelu(nn.Dense(32, param_dtype=self.param_dtype, name="proj1")(x))
        return nn.Dense(1, param_dtype=self.param_dtype, name="proj2")(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, size: int = 12, seed: int = 0,
         compiler_options=None):
    """FNO's ``(loss_fn, params, batch)``: batch ``{"a": [B, X, Y, 1], "u": [B, X, Y, 1]}``,
    the input field and the solution."""
    model = FNO2d(param_dtype=dtype)
    k_init, k_a, k_u = jax.random.split(jax.random.key(seed), 3)
    batch = {"a": jax.random.normal(k_a, (batch_size, size, size, 1), dtype),
             "u": jax.random.normal(k_u, (batch_size, size, size, 1), dtype)}
    params = init_linen(model.init, k_init, batch["a"],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        pred = model.apply({"params": params}, batch["a"])
        n = pred.shape[0]
        error = jnp.linalg.norm((pred - batch["u"]).reshape(n, -1), axis=1)
        return jnp.mean(error / jnp.linalg.norm(batch["u"].reshape(n, -1), axis=1))

    return loss_fn, params, batch
