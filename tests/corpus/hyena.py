"""A Hyena-style long-convolution language model (Poli et al., 2023), in linen.

* an input projection to three streams (``jnp.split`` of one Dense), a short depthwise causal
  convolution over time (``nn.Conv`` with ``feature_group_count`` = channels, left padding);
* an **implicit long filter**: a small MLP over sinusoidal features of the positions makes one
  filter per channel as long as the sequence, shaped by an exponential decay window;
* the **long convolution by FFT**: ``jnp.fft.rfft`` of the signal and the filter, both padded
  to twice the length (``n=2 * T``), multiplied, ``jnp.fft.irfft`` back and cut to the causal
  part, plus a learned per-channel skip; gated by the third stream;
* residual blocks with LayerNorms held in a list (``blocks_0``, ``blocks_1``), a head and the
  mean next-token cross-entropy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


def _fft_conv(u: jax.Array, k: jax.Array, skip: jax.Array) -> jax.Array:
    """Causal convolution of ``u`` ``[B, T, C]`` with per-channel filters ``k`` ``[T, C]``."""
    T = u.shape[1]
    uf = jnp.fft.rfft(u, n=2 * T, axis=1)
    kf = jnp.fft.rfft(k, n=2 * T, axis=0)
    y = jnp.fft.irfft(uf * kf[None], n=2 * T, axis=1)[:, :T]
    return y + u * skip


class HyenaOperator(nn.Module):
    width: int
    filter_hidden: int = 16
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        T, C, pd = x.shape[1], self.width, self.param_dtype
        z = nn.Dense(3 * C, param_dtype=pd, name="in_proj")(x)
        z = nn.Conv(3 * C, kernel_size=(3,), padding=((2, 0),), feature_group_count=3 * C,
                    param_dtype=pd, name="short_conv")(z)
        v, gate, u = jnp.split(z, 3, axis=-1)
        t = jnp.arange(T, dtype=x.dtype)[:, None] / T
        freqs = jnp.arange(1, 5, dtype=x.dtype)[None, :]
        pos = jnp.concatenate([t, jnp.sin(2 * jnp.pi * freqs * t),
                               jnp.cos(2 * jnp.pi * freqs * t)], axis=-1)      # [T, 9]
        h = jnp.sin(nn.Dense(self.filter_hidden, param_dtype=pd, name="filter_0")(pos))
        k = nn.Dense(C, param_dtype=pd, name="filter_1")(h)                    # [T, C]
        decay = jnp.exp(-t * jnp.abs(self.param("decay", nn.initializers.constant(2.0),
                                                 (C,), pd)))
        skip = self.param("skip", nn.initializers.ones, (C,), pd)
        y = _fft_conv(u * v, k * decay, skip) * gate
        return nn.Dense(C, param_dtype=pd, name="out_proj")(y)


class HyenaLM(nn.Module):
    vocab: int = 32
    width: int = 16
    layers: int = 2
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        pd = self.param_dtype
        x = nn.Embed(self.vocab, self.width, param_dtype=pd, name="embed")(tokens)
        for i in range(self.layers):
            h = nn.LayerNorm(param_dtype=pd, name=f"norm_{i}")(x)
            x = x + HyenaOperator(self.width, param_dtype=pd, name=f"blocks_{i}")(h)
        x = nn.LayerNorm(param_dtype=pd, name="norm_out")(x)
        return nn.Dense(self.vocab, param_dtype=pd, name="head")(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, length: int = 16, seed: int = 0,
         compiler_options=None):
    """The Hyena LM's ``(loss_fn, params, batch)``: tokens ``[B, T + 1]``, next-token loss."""
    model = HyenaLM(param_dtype=dtype)
    k_init, k_tok = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_tok, (batch_size, length + 1), 0, model.vocab)
    params = init_linen(model.init, k_init, tokens[:, :-1],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, params, {"tokens": tokens}
