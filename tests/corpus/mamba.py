"""A Mamba-style selective-state-space language model in linen.

Each layer is a pre-norm residual block around a mixer written the way the reference Mamba
ports write it:

* ``in_proj`` (Dense, no bias) to twice the inner width, split into ``x`` and the gate ``z``;
* a **causal depthwise conv1d** over time: the input padded by ``d_conv - 1`` steps on the left
  (``jnp.pad``), a `jax.lax.conv_general_dilated` with ``feature_group_count`` = the inner
  width, SiLU; the module also slices the padded input's last ``d_conv`` steps as the **conv
  state** a generation loop would carry, which the training loss never reads (a dead value
  inside the convolution's operator);
* ``x_proj`` to the step size's low-rank input and the input-dependent ``B`` and ``C``;
  ``dt_proj`` and a softplus give the per-channel step size;
* the **selective scan**, ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t . h_t``,
  by `jax.lax.scan` over time (time-major), plus the skip ``D x``; gated by ``silu(z)``;
* ``out_proj`` back to the model width.

An embedding, two layers held in a list (``layers_0``, ``layers_1``), a final RMSNorm and an
untied head; next-token cross-entropy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class RMSNorm(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class CausalConv1d(nn.Module):
    channels: int
    d_conv: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(),
                            (self.d_conv, 1, self.channels), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.channels,), self.param_dtype)
        x_padded = jnp.pad(x, ((0, 0), (self.d_conv - 1, 0), (0, 0)))
        y = jax.lax.conv_general_dilated(x_padded, kernel, (1,), "VALID",
                                         dimension_numbers=("NWC", "WIO", "NWC"),
                                         feature_group_count=self.channels)
        y = nn.silu(y + bias)
        conv_state = x_padded[:, -self.d_conv:, :]  # what generation would carry
        return y, conv_state


class MambaMixer(nn.Module):
    d_model: int
    d_state: int = 4
    d_conv: int = 4
    expand: int = 2
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden):
        d_inner = self.expand * self.d_model
        dt_rank = max(1, self.d_model // 4)
        dense = lambda n, bias=False, name=None: nn.Dense(  # noqa: E731
            n, use_bias=bias, param_dtype=self.param_dtype, name=name)
        xz = dense(2 * d_inner, name="in_proj")(hidden)
        x, z = jnp.split(xz, 2, axis=-1)
        x, _conv_state = CausalConv1d(d_inner, self.d_conv, self.param_dtype, name="conv1d")(x)
        x_dbl = dense(dt_rank + 2 * self.d_state, name="x_proj")(x)
        dt, b, c = jnp.split(x_dbl, [dt_rank, dt_rank + self.d_state], axis=-1)
        dt = jax.nn.softplus(dense(d_inner, True, name="dt_proj")(dt))
        a_log = self.param("A_log", lambda k, s, d: jnp.log(jnp.broadcast_to(
            jnp.arange(1, s[1] + 1, dtype=d), s)), (d_inner, self.d_state), self.param_dtype)
        d_skip = self.param("D", nn.initializers.ones, (d_inner,), self.param_dtype)
        a = -jnp.exp(a_log)
        d_a = jnp.exp(dt[..., None] * a)                       # (B, L, D, N)
        d_bx = dt[..., None] * b[:, :, None, :] * x[..., None]  # (B, L, D, N)

        def step(h, inputs):
            da_t, dbx_t, c_t = inputs
            h = da_t * h + dbx_t
            return h, jnp.einsum("bdn,bn->bd", h, c_t)

        h0 = jnp.zeros((hidden.shape[0], d_inner, self.d_state), hidden.dtype)
        _, y = jax.lax.scan(step, h0, (d_a.swapaxes(0, 1), d_bx.swapaxes(0, 1),
                                       c.swapaxes(0, 1)))
        y = y.swapaxes(0, 1) + x * d_skip
        return dense(self.d_model, name="out_proj")(y * nn.silu(z))


class MambaBlock(nn.Module):
    d_model: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        return x + MambaMixer(self.d_model, param_dtype=self.param_dtype, name="mixer")(
            RMSNorm(self.param_dtype, name="norm")(x))


class MambaLM(nn.Module):
    vocab_size: int
    d_model: int
    num_layers: int
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedding = nn.Embed(self.vocab_size, self.d_model, param_dtype=self.param_dtype)
        self.layers = [MambaBlock(self.d_model, self.param_dtype)
                       for _ in range(self.num_layers)]
        self.norm_f = RMSNorm(self.param_dtype)
        self.lm_head = nn.Dense(self.vocab_size, use_bias=False, param_dtype=self.param_dtype)

    def __call__(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, vocab_size: int = 32,
         d_model: int = 16, num_layers: int = 2, seed: int = 0, compiler_options=None):
    """The Mamba LM's ``(loss_fn, params, batch)``: next-token cross-entropy."""
    model = MambaLM(vocab_size, d_model, num_layers, dtype)
    k_init, k_tok = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_tok, (batch_size, seq_len + 1), 0, vocab_size, jnp.int32)
    params = init_linen(model.init, k_init, tokens[:, :-1],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, params, {"tokens": tokens}
