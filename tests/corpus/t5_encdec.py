"""A T5-like encoder-decoder, written the way HuggingFace's Flax T5 is.

Follows the HuggingFace-transformers Flax style (``FlaxT5ForConditionalGenerationModule``),
written from scratch:

* one ``shared`` `nn.Embed` for encoder and decoder tokens, and (tied) for the logits by
  ``shared.attend`` after scaling by ``d_model ** -0.5``;
* T5's LayerNorm: a scale ``weight``, no bias, no mean (``x * rsqrt(mean(x**2) + eps)``);
* attention with ``q``/``k``/``v``/``o`` `nn.Dense` without biases, heads by ``reshape``
  after the matmul, no ``1/sqrt(d)`` scaling; scores by ``jnp.einsum``;
* relative position buckets: ``jnp.log``, ``jnp.where`` and ``jnp.minimum`` over
  ``memory_position - context_position`` (bidirectional in the encoder, causal in the
  decoder), looked up in an ``nn.Embed(num_buckets, num_heads)`` that only the first layer of
  each stack has; the bias it computes is passed on to, and shared by, the later layers;
* an int encoder padding mask, turned into an additive bias by ``jax.lax.select`` of
  ``jnp.full`` arrays; decoder self-attention causal (``jnp.tril``), cross-attention from
  the decoder to the encoder output under the encoder mask;
* a ReLU feed-forward layer without biases (``wi``, ``wo``), pre-norm residuals;
* layers held in Python lists with numeric names: ``encoder/block/0/layer/0/SelfAttention``,
  ``decoder/block/1/layer/1/EncDecAttention``, ...;
* an LM loss whose decoder inputs are the labels shifted right (``.at[:, 1:].set``, decoder
  start token 0).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


@dataclasses.dataclass(frozen=True)
class T5Config:
    vocab_size: int = 64
    d_model: int = 32
    d_kv: int = 8
    d_ff: int = 64
    num_layers: int = 2
    num_decoder_layers: int = 2
    num_heads: int = 4
    relative_attention_num_buckets: int = 8
    relative_attention_max_distance: int = 16
    layer_norm_epsilon: float = 1e-6
    initializer_factor: float = 1.0
    decoder_start_token_id: int = 0
    param_dtype: jnp.dtype = jnp.float32


def _init(scale: float):
    return nn.initializers.normal(scale)


def _select_bias(mask: jax.Array, dtype) -> jax.Array:
    """0 where ``mask > 0``, the dtype's most negative number elsewhere."""
    return jax.lax.select(mask > 0, jnp.full(mask.shape, 0.0).astype(dtype),
                          jnp.full(mask.shape, jnp.finfo(dtype).min).astype(dtype))


class T5LayerNorm(nn.Module):
    hidden_size: int
    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden_states):
        weight = self.param("weight", nn.initializers.ones, (self.hidden_size,),
                            self.param_dtype)
        variance = jnp.power(hidden_states, 2).mean(axis=-1, keepdims=True)
        return weight * (hidden_states * jax.lax.rsqrt(variance + self.eps))


class T5DenseReluDense(nn.Module):
    config: T5Config

    def setup(self):
        c = self.config
        self.wi = nn.Dense(c.d_ff, use_bias=False, param_dtype=c.param_dtype,
                           kernel_init=_init(c.initializer_factor * c.d_model ** -0.5))
        self.wo = nn.Dense(c.d_model, use_bias=False, param_dtype=c.param_dtype,
                           kernel_init=_init(c.initializer_factor * c.d_ff ** -0.5))

    def __call__(self, hidden_states):
        return self.wo(nn.relu(self.wi(hidden_states)))


def relative_position_bucket(relative_position, bidirectional=True, num_buckets=32,
                             max_distance=128):
    """T5's bucket of each relative position (memory - context): exact below half the
    buckets, logarithmic up to ``max_distance``; the sign gets half the buckets if
    ``bidirectional``, else only non-positive distances (the past) are told apart."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).astype(jnp.int32) * num_buckets
        relative_position = jnp.abs(relative_position)
    else:
        relative_position = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        jnp.log(relative_position.astype(jnp.float32) / max_exact + jnp.finfo(jnp.float32).eps)
        / jnp.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    relative_position_if_large = jnp.minimum(relative_position_if_large, num_buckets - 1)
    return relative_buckets + jnp.where(is_small, relative_position, relative_position_if_large)


class T5Attention(nn.Module):
    config: T5Config
    has_relative_attention_bias: bool = False
    causal: bool = False

    def setup(self):
        c = self.config
        inner_dim = c.num_heads * c.d_kv
        dense = lambda features, std: nn.Dense(  # noqa: E731
            features, use_bias=False, kernel_init=_init(std), param_dtype=c.param_dtype)
        self.q = dense(inner_dim, c.initializer_factor * (inner_dim * c.d_kv) ** -0.5)
        self.k = dense(inner_dim, c.initializer_factor * inner_dim ** -0.5)
        self.v = dense(inner_dim, c.initializer_factor * inner_dim ** -0.5)
        self.o = dense(c.d_model, c.initializer_factor * inner_dim ** -0.5)
        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embed(
                c.relative_attention_num_buckets, c.num_heads,
                embedding_init=_init(c.initializer_factor * inner_dim ** -0.5),
                param_dtype=c.param_dtype)

    def compute_bias(self, query_length, key_length):
        """The relative position bias, [1, heads, query_length, key_length]."""
        context_position = jnp.arange(query_length, dtype=jnp.int32)[:, None]
        memory_position = jnp.arange(key_length, dtype=jnp.int32)[None, :]
        buckets = relative_position_bucket(
            memory_position - context_position, bidirectional=not self.causal,
            num_buckets=self.config.relative_attention_num_buckets,
            max_distance=self.config.relative_attention_max_distance)
        values = self.relative_attention_bias(buckets)  # [q, k, heads]
        return values.transpose((2, 0, 1))[None, :, :, :]

    def _split_heads(self, x):
        return x.reshape(x.shape[:2] + (self.config.num_heads, self.config.d_kv))

    def __call__(self, hidden_states, attention_mask, key_value_states=None,
                 position_bias=None):
        """Returns (output, position_bias); `attention_mask` is [B, 1, q or 1, k], 1 = keep."""
        batch_size, query_length = hidden_states.shape[:2]
        kv = hidden_states if key_value_states is None else key_value_states
        key_length = kv.shape[1]
        query_states = self._split_heads(self.q(hidden_states))
        key_states = self._split_heads(self.k(kv))
        value_states = self._split_heads(self.v(kv))

        dtype = hidden_states.dtype
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(query_length, key_length).astype(dtype)
            else:
                position_bias = jnp.zeros((1, self.config.num_heads, query_length, key_length),
                                          dtype)
        scores = jnp.einsum("...qhd,...khd->...hqk", query_states, key_states)
        scores = scores + position_bias + _select_bias(attention_mask, dtype)
        attn_weights = jax.nn.softmax(scores, axis=-1)
        attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, value_states)
        attn_output = attn_output.reshape(batch_size, query_length, -1)
        return self.o(attn_output), position_bias


class T5LayerSelfAttention(nn.Module):
    config: T5Config
    has_relative_attention_bias: bool = False
    causal: bool = False

    def setup(self):
        c = self.config
        self.SelfAttention = T5Attention(c, self.has_relative_attention_bias, self.causal)
        self.layer_norm = T5LayerNorm(c.d_model, c.layer_norm_epsilon, c.param_dtype)

    def __call__(self, hidden_states, attention_mask, position_bias=None):
        out, position_bias = self.SelfAttention(self.layer_norm(hidden_states), attention_mask,
                                                position_bias=position_bias)
        return hidden_states + out, position_bias


class T5LayerCrossAttention(nn.Module):
    config: T5Config

    def setup(self):
        c = self.config
        self.EncDecAttention = T5Attention(c)
        self.layer_norm = T5LayerNorm(c.d_model, c.layer_norm_epsilon, c.param_dtype)

    def __call__(self, hidden_states, key_value_states, attention_mask):
        out, _ = self.EncDecAttention(self.layer_norm(hidden_states), attention_mask,
                                      key_value_states=key_value_states)
        return hidden_states + out


class T5LayerFF(nn.Module):
    config: T5Config

    def setup(self):
        c = self.config
        self.DenseReluDense = T5DenseReluDense(c)
        self.layer_norm = T5LayerNorm(c.d_model, c.layer_norm_epsilon, c.param_dtype)

    def __call__(self, hidden_states):
        return hidden_states + self.DenseReluDense(self.layer_norm(hidden_states))


class T5Block(nn.Module):
    config: T5Config
    has_relative_attention_bias: bool = False
    is_decoder: bool = False

    def setup(self):
        c = self.config
        layer = [T5LayerSelfAttention(c, self.has_relative_attention_bias, self.is_decoder,
                                      name="0")]
        if self.is_decoder:
            layer.append(T5LayerCrossAttention(c, name="1"))
        layer.append(T5LayerFF(c, name=str(len(layer))))
        self.layer = layer

    def __call__(self, hidden_states, attention_mask, position_bias=None,
                 encoder_hidden_states=None, encoder_attention_mask=None):
        hidden_states, position_bias = self.layer[0](hidden_states, attention_mask,
                                                     position_bias)
        if self.is_decoder:
            hidden_states = self.layer[1](hidden_states, encoder_hidden_states,
                                          encoder_attention_mask)
        return self.layer[-1](hidden_states), position_bias


class T5LayerCollection(nn.Module):
    config: T5Config
    has_relative_attention_bias: bool = False
    is_decoder: bool = False

    def setup(self):
        self.layer = T5Block(self.config, self.has_relative_attention_bias, self.is_decoder)

    def __call__(self, *args):
        return self.layer(*args)


class T5BlockCollection(nn.Module):
    config: T5Config
    is_decoder: bool = False

    def setup(self):
        c = self.config
        n = c.num_decoder_layers if self.is_decoder else c.num_layers
        self.blocks = [T5LayerCollection(c, has_relative_attention_bias=i == 0,
                                         is_decoder=self.is_decoder, name=str(i))
                       for i in range(n)]

    def __call__(self, hidden_states, attention_mask, encoder_hidden_states=None,
                 encoder_attention_mask=None):
        position_bias = None  # computed by the first block, shared by the others
        for block in self.blocks:
            hidden_states, position_bias = block(hidden_states, attention_mask, position_bias,
                                                 encoder_hidden_states, encoder_attention_mask)
        return hidden_states


class T5Stack(nn.Module):
    config: T5Config
    embed_tokens: nn.Embed
    is_decoder: bool = False

    def setup(self):
        c = self.config
        self.block = T5BlockCollection(c, self.is_decoder)
        self.final_layer_norm = T5LayerNorm(c.d_model, c.layer_norm_epsilon, c.param_dtype)

    def __call__(self, input_ids, attention_mask, encoder_hidden_states=None,
                 encoder_attention_mask=None):
        hidden_states = self.embed_tokens(input_ids.astype("i4"))
        length = input_ids.shape[1]
        if self.is_decoder:
            causal = jnp.tril(jnp.ones((length, length), jnp.int32))
            self_mask = attention_mask[:, None, None, :] * causal[None, None]
            cross_mask = encoder_attention_mask[:, None, None, :]
        else:
            self_mask, cross_mask = attention_mask[:, None, None, :], None
        hidden_states = self.block(hidden_states, self_mask, encoder_hidden_states, cross_mask)
        return self.final_layer_norm(hidden_states)


class T5ForConditionalGeneration(nn.Module):
    config: T5Config

    def setup(self):
        c = self.config
        self.shared = nn.Embed(c.vocab_size, c.d_model, param_dtype=c.param_dtype,
                               embedding_init=_init(c.initializer_factor))
        self.encoder = T5Stack(c, self.shared)
        self.decoder = T5Stack(c, self.shared, is_decoder=True)

    def __call__(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask):
        encoder_outputs = self.encoder(input_ids, attention_mask)
        sequence_output = self.decoder(decoder_input_ids, decoder_attention_mask,
                                       encoder_outputs, attention_mask)
        sequence_output = sequence_output * (self.config.d_model ** -0.5)
        return self.shared.attend(sequence_output)


def shift_tokens_right(input_ids, pad_token_id: int, decoder_start_token_id: int):
    """The decoder's inputs: the labels one position later, the start token first."""
    shifted = jnp.zeros_like(input_ids)
    shifted = shifted.at[:, 1:].set(input_ids[:, :-1])
    shifted = shifted.at[:, 0].set(decoder_start_token_id)
    return jnp.where(shifted == -100, pad_token_id, shifted)


def make(*, dtype=jnp.float32, batch_size: int = 8, source_len: int = 8, target_len: int = 8,
         seed: int = 0, compiler_options=None, **config):
    """The T5's ``(loss_fn, params, batch)``: decoder cross-entropy over the labels.

    Sources have random lengths in [3, source_len] (the rest padding, id 0, masked out);
    labels are full length.
    """
    cfg = T5Config(param_dtype=dtype, **config)
    model = T5ForConditionalGeneration(cfg)
    k_init, k_src, k_len, k_tgt = jax.random.split(jax.random.key(seed), 4)
    input_ids = jax.random.randint(k_src, (batch_size, source_len), 1, cfg.vocab_size, jnp.int32)
    lengths = jax.random.randint(k_len, (batch_size, 1), 3, source_len + 1, jnp.int32)
    attention_mask = (jnp.arange(source_len)[None, :] < lengths).astype(jnp.int32)
    input_ids = input_ids * attention_mask
    labels = jax.random.randint(k_tgt, (batch_size, target_len), 1, cfg.vocab_size, jnp.int32)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def forward(params, batch):
        decoder_input_ids = shift_tokens_right(batch["labels"], 0, cfg.decoder_start_token_id)
        decoder_attention_mask = jnp.ones_like(decoder_input_ids)
        return model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                           decoder_input_ids, decoder_attention_mask)

    params = init_linen(lambda rng, b: model.init(rng, b["input_ids"], b["attention_mask"],
                                                  b["labels"], jnp.ones_like(b["labels"])),
                        k_init, batch, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = forward(params, batch)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss_fn, params, batch
