"""A Whisper-style speech encoder-decoder in linen: a convolutional front end, then attention.

Written the way the HuggingFace Flax Whisper is:

* the log-mel input [B, T, mels] through two 1-D convolutions (`nn.Conv` kernel 3, padding 1;
  the second with stride 2) with GELU, plus fixed sinusoidal positions (a numpy constant);
* pre-LN encoder layers: bidirectional self-attention (``q_proj`` with a bias, ``k_proj``
  without, as Whisper has them; heads by ``reshape``), a GELU MLP; a final LayerNorm;
* a decoder over the previous tokens: token and learned position embeddings, pre-LN layers
  with causal self-attention (mask by ``jnp.where`` of ``jnp.tril``), cross-attention to the
  encoder's output, and a GELU MLP; a final LayerNorm and logits tied to the token embedding
  (``embed.attend``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus._jit import init_linen


def sinusoids(length: int, channels: int) -> np.ndarray:
    inc = np.log(10000) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2))
    t = np.arange(length)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1)


class MultiHeadAttention(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, context=None, causal: bool = False):
        d = x.shape[-1]
        context = x if context is None else context
        split = lambda y: y.reshape(y.shape[:2] + (self.heads, d // self.heads))  # noqa: E731
        q = split(nn.Dense(d, param_dtype=self.param_dtype, name="q_proj")(x))
        k = split(nn.Dense(d, use_bias=False, param_dtype=self.param_dtype, name="k_proj")(context))
        v = split(nn.Dense(d, param_dtype=self.param_dtype, name="v_proj")(context))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        if causal:
            t = x.shape[1]
            scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return nn.Dense(d, param_dtype=self.param_dtype, name="out_proj")(
            out.reshape(out.shape[:2] + (d,)))


class MLP(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.gelu(nn.Dense(4 * d, param_dtype=self.param_dtype, name="fc1")(x))
        return nn.Dense(d, param_dtype=self.param_dtype, name="fc2")(h)


class EncoderLayer(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        ln = lambda name: nn.LayerNorm(param_dtype=self.param_dtype, name=name)  # noqa: E731
        x = x + MultiHeadAttention(self.heads, self.param_dtype, name="self_attn")(
            ln("self_attn_layer_norm")(x))
        return x + MLP(self.param_dtype, name="mlp")(ln("final_layer_norm")(x))


class DecoderLayer(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, enc):
        ln = lambda name: nn.LayerNorm(param_dtype=self.param_dtype, name=name)  # noqa: E731
        x = x + MultiHeadAttention(self.heads, self.param_dtype, name="self_attn")(
            ln("self_attn_layer_norm")(x), causal=True)
        x = x + MultiHeadAttention(self.heads, self.param_dtype, name="encoder_attn")(
            ln("encoder_attn_layer_norm")(x), context=enc)
        return x + MLP(self.param_dtype, name="mlp")(ln("final_layer_norm")(x))


class Whisper(nn.Module):
    vocab_size: int
    d_model: int
    heads: int
    layers: int
    max_target: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, features, tokens):
        pd = self.param_dtype
        x = nn.gelu(nn.Conv(self.d_model, (3,), padding=1, param_dtype=pd, name="conv1")(features))
        x = nn.gelu(nn.Conv(self.d_model, (3,), strides=2, padding=1, param_dtype=pd,
                            name="conv2")(x))
        x = x + jnp.asarray(sinusoids(x.shape[1], self.d_model), x.dtype)
        for k in range(self.layers):
            x = EncoderLayer(self.heads, pd, name=f"encoder_layers_{k}")(x)
        enc = nn.LayerNorm(param_dtype=pd, name="encoder_layer_norm")(x)
        embed = nn.Embed(self.vocab_size, self.d_model, param_dtype=pd, name="embed_tokens")
        pos = self.param("embed_positions", nn.initializers.normal(0.02),
                         (self.max_target, self.d_model), pd)
        y = embed(tokens) + pos[:tokens.shape[1]]
        for k in range(self.layers):
            y = DecoderLayer(self.heads, pd, name=f"decoder_layers_{k}")(y, enc)
        return embed.attend(nn.LayerNorm(param_dtype=pd, name="decoder_layer_norm")(y))


def make(*, dtype=jnp.float32, batch_size: int = 8, frames: int = 16, mels: int = 8,
         seq_len: int = 8, vocab_size: int = 32, d_model: int = 16, heads: int = 4,
         layers: int = 2, seed: int = 0, compiler_options=None):
    """The Whisper model's ``(loss_fn, params, batch)``: next-token cross-entropy."""
    model = Whisper(vocab_size, d_model, heads, layers, seq_len, dtype)
    k_init, k_f, k_t = jax.random.split(jax.random.key(seed), 3)
    features = jax.random.normal(k_f, (batch_size, frames, mels), dtype)
    tokens = jax.random.randint(k_t, (batch_size, seq_len + 1), 0, vocab_size, jnp.int32)
    params = init_linen(model.init, k_init, features, tokens[:, :-1],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["features"], batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, params, {"features": features, "tokens": tokens}
