"""A Phi-3-style decoder whose projections are fused, written the way HuggingFace's Phi-3 is.

Follows the HuggingFace-transformers Phi-3 (``Phi3Attention``, ``Phi3MLP``), written from
scratch in Flax:

* one ``qkv_proj`` `nn.Dense` for the queries, keys and values, cut by slicing its columns at
  ``num_heads * head_dim`` and ``(num_heads + num_key_value_heads) * head_dim`` (unequal
  pieces: 4 query heads over 2 key/value heads), the heads made by ``reshape`` after it;
* one ``gate_up_proj`` `nn.Dense` of ``2 * intermediate_size`` columns, split by
  ``jnp.split(..., 2, axis=-1)`` into the gate and the up projection (SwiGLU);
* rotary position embeddings in the rotate-half form (``x[..., :half]``, ``x[..., half:]``,
  ``jnp.concatenate``); the key/value heads repeated by ``jnp.repeat``;
* a causal mask by ``jnp.tril`` and ``jnp.where`` with ``jnp.finfo(dtype).min``;
* RMSNorm, layers held in a Python list in ``setup``, an untied ``lm_head``, next-token
  cross-entropy on ``logits[:, :-1]`` against ``tokens[:, 1:]``.
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
class Phi3Config:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    param_dtype: jnp.dtype = jnp.float32


def _dense(c: Phi3Config, features: int, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=False, param_dtype=c.param_dtype, name=name,
                    kernel_init=nn.initializers.normal(c.initializer_range))


class Phi3RMSNorm(nn.Module):
    config: Phi3Config

    @nn.compact
    def __call__(self, hidden_states):
        c = self.config
        weight = self.param("weight", nn.initializers.ones, (c.hidden_size,), c.param_dtype)
        variance = jnp.mean(jnp.square(hidden_states), axis=-1, keepdims=True)
        return weight * (hidden_states * jax.lax.rsqrt(variance + c.rms_norm_eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def rotary(x, position_ids, theta: float):
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2) / dim))
    freqs = position_ids[..., None].astype(x.dtype) * jnp.asarray(inv_freq, x.dtype)
    emb = jnp.concatenate((freqs, freqs), axis=-1)[:, :, None, :]
    return x * jnp.cos(emb) + rotate_half(x) * jnp.sin(emb)


class Phi3Attention(nn.Module):
    config: Phi3Config

    def setup(self):
        c = self.config
        self.head_dim = c.hidden_size // c.num_attention_heads
        op_size = (c.num_attention_heads + 2 * c.num_key_value_heads) * self.head_dim
        self.qkv_proj = _dense(c, op_size, "qkv_proj")
        self.o_proj = _dense(c, c.hidden_size, "o_proj")

    def __call__(self, hidden_states, position_ids):
        c = self.config
        b, t, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        query_pos = c.num_attention_heads * self.head_dim
        kv_pos = query_pos + c.num_key_value_heads * self.head_dim
        query = qkv[..., :query_pos].reshape(b, t, c.num_attention_heads, self.head_dim)
        key = qkv[..., query_pos:kv_pos].reshape(b, t, c.num_key_value_heads, self.head_dim)
        value = qkv[..., kv_pos:].reshape(b, t, c.num_key_value_heads, self.head_dim)
        query = rotary(query, position_ids, c.rope_theta)
        key = rotary(key, position_ids, c.rope_theta)
        groups = c.num_attention_heads // c.num_key_value_heads
        key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, value).reshape(b, t, -1)
        return self.o_proj(out)


class Phi3MLP(nn.Module):
    config: Phi3Config

    def setup(self):
        c = self.config
        self.gate_up_proj = _dense(c, 2 * c.intermediate_size, "gate_up_proj")
        self.down_proj = _dense(c, c.hidden_size, "down_proj")

    def __call__(self, hidden_states):
        gate, up = jnp.split(self.gate_up_proj(hidden_states), 2, axis=-1)
        return self.down_proj(up * nn.silu(gate))


class Phi3DecoderLayer(nn.Module):
    config: Phi3Config

    def setup(self):
        self.input_layernorm = Phi3RMSNorm(self.config)
        self.self_attn = Phi3Attention(self.config)
        self.post_attention_layernorm = Phi3RMSNorm(self.config)
        self.mlp = Phi3MLP(self.config)

    def __call__(self, hidden_states, position_ids):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states),
                                                       position_ids)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Phi3ForCausalLM(nn.Module):
    config: Phi3Config

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, param_dtype=c.param_dtype,
                                     embedding_init=nn.initializers.normal(c.initializer_range))
        self.layers = [Phi3DecoderLayer(c) for _ in range(c.num_hidden_layers)]
        self.norm = Phi3RMSNorm(c)
        self.lm_head = _dense(c, c.vocab_size, "lm_head")

    def __call__(self, input_ids):
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_ids)
        return self.lm_head(self.norm(hidden_states))


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, seed: int = 0,
         compiler_options=None, **config):
    """The Phi-3 decoder's ``(loss_fn, params, batch)``: next-token cross-entropy."""
    cfg = Phi3Config(param_dtype=dtype, **config)
    model = Phi3ForCausalLM(cfg)
    k_init, k_tok = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_tok, (batch_size, seq_len), 0, cfg.vocab_size, jnp.int32)
    params = init_linen(model.init, k_init, tokens, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], batch["tokens"][:, 1:]).mean()

    return loss_fn, params, {"tokens": tokens}



class Phi3MLPStack(nn.Module):
    """Phi-3's pre-norm residual MLP blocks alone (no attention), over given embeddings."""

    config: Phi3Config

    def setup(self):
        n = self.config.num_hidden_layers
        self.norms = [Phi3RMSNorm(self.config) for _ in range(n)]
        self.mlps = [Phi3MLP(self.config) for _ in range(n)]

    def __call__(self, hidden_states):
        for norm, mlp in zip(self.norms, self.mlps):
            hidden_states = hidden_states + mlp(norm(hidden_states))
        return hidden_states


def make_mlp_stack(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 16,
                   seed: int = 0, compiler_options=None, **config):
    """`Phi3MLPStack`'s ``(loss_fn, params, batch)``: mean squared error to a target."""
    cfg = Phi3Config(param_dtype=dtype, **config)
    model = Phi3MLPStack(cfg)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    shape = (batch_size, seq_len, cfg.hidden_size)
    batch = {"x": jax.random.normal(k_x, shape, dtype), "y": jax.random.normal(k_y, shape, dtype)}
    params = init_linen(model.init, k_init, batch["x"],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return loss_fn, params, batch
