"""A Llama-style decoder with grouped-query attention, written the way HuggingFace's Flax
Llama is.

Follows the HuggingFace-transformers Flax style (``FlaxLlamaForCausalLMModule``), written from
scratch:

* ``q_proj``/``k_proj``/``v_proj``/``o_proj`` as plain `nn.Dense` with ``use_bias=False``, the
  heads made by ``reshape`` after the matmul: 8 query heads over 4 key/value heads
  (``num_key_value_groups = 2``), the key/value heads repeated by ``jnp.repeat(..., axis=2)``;
* rotary position embeddings in the rotate-half form, from a sin/cos table built with numpy
  and gathered by ``position_ids`` (``jnp.broadcast_to`` of an ``arange``);
* a causal mask by ``jnp.tril``, applied by ``jnp.where(mask, scores,
  jnp.finfo(dtype).min)``; weights by ``jax.nn.softmax``;
* RMSNorm (a ``weight``, ``x * rsqrt(mean(x**2) + eps)``) before attention, before the MLP
  and at the end;
* a SwiGLU MLP ``down_proj(silu(gate_proj(x)) * up_proj(x))``;
* layers held in a Python list in ``setup`` (flax names them ``layers_0``, ``layers_1``);
* an untied ``lm_head``, next-token cross-entropy.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus._jit import init_linen


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    param_dtype: jnp.dtype = jnp.float32


def create_sinusoidal_positions(num_pos: int, dim: int, theta: float) -> np.ndarray:
    """[num_pos, 2 * dim]: sin then cos of each position's angles, each angle twice."""
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2) / dim))
    freqs = np.einsum("i,j->ij", np.arange(num_pos), inv_freq)
    emb = np.concatenate((freqs, freqs), axis=-1)
    return np.concatenate((np.sin(emb), np.cos(emb)), axis=-1)


def rotate_half(tensor):
    half = tensor.shape[-1] // 2
    return jnp.concatenate((-tensor[..., half:], tensor[..., :half]), axis=-1)


def apply_rotary_pos_emb(tensor, sin_pos, cos_pos):
    return tensor * cos_pos + rotate_half(tensor) * sin_pos


class LlamaRMSNorm(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, hidden_states):
        c = self.config
        weight = self.param("weight", nn.initializers.ones, (c.hidden_size,), c.param_dtype)
        variance = jnp.mean(jnp.square(hidden_states), axis=-1, keepdims=True)
        return weight * (hidden_states * jax.lax.rsqrt(variance + c.rms_norm_eps))


class LlamaRotaryEmbedding(nn.Module):
    config: LlamaConfig

    def setup(self):
        c = self.config
        head_dim = c.hidden_size // c.num_attention_heads
        self.sincos = create_sinusoidal_positions(c.max_position_embeddings, head_dim,
                                                  c.rope_theta)

    def __call__(self, key, query, position_ids):
        sincos = jnp.asarray(self.sincos, query.dtype)[position_ids][:, :, None, :]
        sin_pos, cos_pos = jnp.split(sincos, 2, axis=-1)
        return (apply_rotary_pos_emb(key, sin_pos, cos_pos),
                apply_rotary_pos_emb(query, sin_pos, cos_pos))


class LlamaAttention(nn.Module):
    config: LlamaConfig

    def setup(self):
        c = self.config
        self.num_heads = c.num_attention_heads
        self.num_key_value_heads = c.num_key_value_heads
        self.num_key_value_groups = c.num_attention_heads // c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        dense = lambda features: nn.Dense(  # noqa: E731
            features, use_bias=False, param_dtype=c.param_dtype,
            kernel_init=nn.initializers.normal(c.initializer_range))
        self.q_proj = dense(self.num_heads * self.head_dim)
        self.k_proj = dense(self.num_key_value_heads * self.head_dim)
        self.v_proj = dense(self.num_key_value_heads * self.head_dim)
        self.o_proj = dense(c.hidden_size)
        self.rotary_emb = LlamaRotaryEmbedding(c)

    def _split_heads(self, hidden_states, num_heads):
        return hidden_states.reshape(hidden_states.shape[:2] + (num_heads, self.head_dim))

    def __call__(self, hidden_states, position_ids):
        query = self._split_heads(self.q_proj(hidden_states), self.num_heads)
        key = self._split_heads(self.k_proj(hidden_states), self.num_key_value_heads)
        value = self._split_heads(self.v_proj(hidden_states), self.num_key_value_heads)
        key, query = self.rotary_emb(key, query, position_ids)
        key = jnp.repeat(key, self.num_key_value_groups, axis=2)
        value = jnp.repeat(value, self.num_key_value_groups, axis=2)

        length = hidden_states.shape[1]
        causal_mask = jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]
        scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(self.head_dim)
        scores = jnp.where(causal_mask, scores, jnp.finfo(scores.dtype).min)
        attn_weights = jax.nn.softmax(scores, axis=-1)
        attn_output = jnp.einsum("bhqk,bkhd->bqhd", attn_weights, value)
        attn_output = attn_output.reshape(attn_output.shape[:2] + (-1,))
        return self.o_proj(attn_output)


class LlamaMLP(nn.Module):
    config: LlamaConfig

    def setup(self):
        c = self.config
        dense = lambda features: nn.Dense(  # noqa: E731
            features, use_bias=False, param_dtype=c.param_dtype,
            kernel_init=nn.initializers.normal(c.initializer_range))
        self.gate_proj = dense(c.intermediate_size)
        self.down_proj = dense(c.hidden_size)
        self.up_proj = dense(c.intermediate_size)

    def __call__(self, hidden_states):
        return self.down_proj(nn.silu(self.gate_proj(hidden_states))
                              * self.up_proj(hidden_states))


class LlamaDecoderLayer(nn.Module):
    config: LlamaConfig

    def setup(self):
        self.input_layernorm = LlamaRMSNorm(self.config)
        self.self_attn = LlamaAttention(self.config)
        self.post_attention_layernorm = LlamaRMSNorm(self.config)
        self.mlp = LlamaMLP(self.config)

    def __call__(self, hidden_states, position_ids):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states),
                                                       position_ids)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaForCausalLM(nn.Module):
    config: LlamaConfig

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, param_dtype=c.param_dtype,
                                     embedding_init=nn.initializers.normal(c.initializer_range))
        self.layers = [LlamaDecoderLayer(c) for _ in range(c.num_hidden_layers)]
        self.norm = LlamaRMSNorm(c)
        self.lm_head = nn.Dense(c.vocab_size, use_bias=False, param_dtype=c.param_dtype,
                                kernel_init=nn.initializers.normal(c.initializer_range))

    def __call__(self, input_ids):
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        hidden_states = self.embed_tokens(input_ids.astype("i4"))
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_ids)
        return self.lm_head(self.norm(hidden_states))


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, seed: int = 0,
         compiler_options=None, **config):
    """The Llama decoder's ``(loss_fn, params, batch)``: next-token cross-entropy."""
    cfg = LlamaConfig(param_dtype=dtype, **config)
    model = LlamaForCausalLM(cfg)
    k_init, k_tok = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_tok, (batch_size, seq_len + 1), 0, cfg.vocab_size, jnp.int32)
    params = init_linen(model.init, k_init, tokens[:, :-1],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, params, {"tokens": tokens}
