"""A Linear Recurrent Unit network (Orvieto et al., 2023) in linen, as the paper's own JAX code
writes it: a complex diagonal recurrence run by ``jax.lax.associative_scan``.

* the LRU layer sees one sequence ``[L, H]``; ``nn.vmap`` over the batch with the parameters
  broadcast (``variable_axes={"params": None}``, ``split_rngs={"params": False}``), as the
  paper's ``BatchLRU``;
* its parameters are real: ``nu_log``, ``theta_log`` (the eigenvalues'
  ``exp(-exp(nu) + i exp(theta))``), ``gamma_log`` initialised from those two (an initialiser
  of other parameters' values, ``self.param("gamma_log", init, (nu, theta))``), the input
  and output matrices as real and imaginary parts (``B_re + 1j * B_im``), the skip ``D``;
* the recurrence ``h_k = lambda * h_{k-1} + B u_k`` in **complex** arithmetic: ``jnp.repeat`` of
  the eigenvalues along time, ``jax.vmap`` of ``B @ u``, the associative scan of the pairs
  ``(a_j a_i, a_j b_i + b_j)`` (strided slices, pads and concatenations of complex values),
  ``(C @ h).real + D * u``;
* pre-LayerNorm residual blocks held in a list (``layers_0``, ``layers_1``) with a GLU
  (``Dense(H) * sigmoid(Dense(H))``), mean pooling over time, a classifier, the mean
  cross-entropy.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


def _nu_init(key, shape, dtype=jnp.float32, r_min=0.4, r_max=0.9):
    u = jax.random.uniform(key, shape, dtype)
    return jnp.log(-0.5 * jnp.log(u * (r_max ** 2 - r_min ** 2) + r_min ** 2))


def _theta_init(key, shape, dtype=jnp.float32, max_phase=6.28):
    return jnp.log(max_phase * jax.random.uniform(key, shape, dtype))


def _gamma_log_init(key, lamb):
    nu, theta = lamb
    diag_lambda = jnp.exp(-jnp.exp(nu) + 1j * jnp.exp(theta))
    return jnp.log(jnp.sqrt(1 - jnp.abs(diag_lambda) ** 2))


def _matrix_init(key, shape, dtype=jnp.float32, normalization=1.0):
    return jax.random.normal(key, shape, dtype) / normalization


def _binary_operator_diag(element_i, element_j):
    a_i, bu_i = element_i
    a_j, bu_j = element_j
    return a_j * a_i, a_j * bu_i + bu_j


class LRU(nn.Module):
    d_hidden: int
    d_model: int
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        pd, n, h = self.param_dtype, self.d_hidden, self.d_model
        self.theta_log = self.param("theta_log", partial(_theta_init, dtype=pd), (n,))
        self.nu_log = self.param("nu_log", partial(_nu_init, dtype=pd), (n,))
        self.gamma_log = self.param("gamma_log", _gamma_log_init, (self.nu_log, self.theta_log))
        b_init = partial(_matrix_init, dtype=pd, normalization=jnp.sqrt(2 * h))
        self.B_re = self.param("B_re", b_init, (n, h))
        self.B_im = self.param("B_im", b_init, (n, h))
        c_init = partial(_matrix_init, dtype=pd, normalization=jnp.sqrt(n))
        self.C_re = self.param("C_re", c_init, (h, n))
        self.C_im = self.param("C_im", c_init, (h, n))
        self.D = self.param("D", partial(_matrix_init, dtype=pd), (h,))

    def __call__(self, inputs: jax.Array) -> jax.Array:  # one sequence [L, H]
        diag_lambda = jnp.exp(-jnp.exp(self.nu_log) + 1j * jnp.exp(self.theta_log))
        B_norm = (self.B_re + 1j * self.B_im) * jnp.expand_dims(jnp.exp(self.gamma_log), -1)
        C = self.C_re + 1j * self.C_im
        lambda_elements = jnp.repeat(diag_lambda[None, ...], inputs.shape[0], axis=0)
        bu_elements = jax.vmap(lambda u: B_norm @ u)(inputs)
        _, hidden = jax.lax.associative_scan(_binary_operator_diag,
                                             (lambda_elements, bu_elements))
        return jax.vmap(lambda h, x: (C @ h).real + self.D * x)(hidden, inputs)


BatchLRU = nn.vmap(LRU, in_axes=0, out_axes=0, variable_axes={"params": None},
                   split_rngs={"params": False})


class Block(nn.Module):
    d_hidden: int
    d_model: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pd = self.param_dtype
        h = nn.LayerNorm(param_dtype=pd, name="norm")(x)
        h = BatchLRU(self.d_hidden, self.d_model, pd, name="lru")(h)
        h = nn.gelu(h)
        h = nn.Dense(self.d_model, param_dtype=pd, name="out1")(h) * jax.nn.sigmoid(
            nn.Dense(self.d_model, param_dtype=pd, name="out2")(h))
        return x + h


class LRUClassifier(nn.Module):
    d_model: int = 16
    d_hidden: int = 24
    layers: int = 2
    classes: int = 5
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.encoder = nn.Dense(self.d_model, param_dtype=self.param_dtype)
        self.blocks = [Block(self.d_hidden, self.d_model, self.param_dtype)
                       for _ in range(self.layers)]
        self.decoder = nn.Dense(self.classes, param_dtype=self.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.encoder(x)
        for block in self.blocks:
            h = block(h)
        return self.decoder(jnp.mean(h, axis=1))


def make(*, dtype=jnp.float32, batch_size: int = 8, length: int = 12, features: int = 4,
         seed: int = 0, compiler_options=None):
    """The LRU classifier's ``(loss_fn, params, batch)``: batch ``{"x": [B, L, F], "labels":
    [B]}``."""
    model = LRUClassifier(param_dtype=dtype)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    batch = {"x": jax.random.normal(k_x, (batch_size, length, features), dtype),
             "labels": jax.random.randint(k_y, (batch_size,), 0, model.classes)}
    params = init_linen(model.init, k_init, batch["x"],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss_fn, params, batch
