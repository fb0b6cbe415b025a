"""A Vision Transformer classifier, written the way HuggingFace's Flax ViT is.

Follows the HuggingFace-transformers Flax style (``FlaxViTForImageClassificationModule``),
written from scratch:

* patch embedding by ``nn.Conv(hidden, kernel_size=(p, p), strides=(p, p), padding='VALID')``
  on NHWC images, flattened to tokens by ``reshape``;
* a learned class token (a ``(1, 1, hidden)`` parameter) prepended by ``jnp.broadcast_to`` and
  ``jnp.concatenate``, then a learned position embedding (a ``(1, patches + 1, hidden)``
  parameter) added; 16 patches + 1 = 17 tokens, a length no mesh axis divides;
* self-attention as ``query``/``key``/``value`` `nn.Dense` layers with heads by ``reshape``,
  weights by `nn.dot_product_attention_weights`;
* pre-LayerNorm layers (``layernorm_before``, ``layernorm_after``), exact (erf) GELU MLP,
  held in a Python list named ``"0"``, ``"1"``;
* a final LayerNorm and a classifier on the class token, cross-entropy over labels.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    image_size: int = 16
    patch_size: int = 4
    num_channels: int = 3
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 64
    num_labels: int = 8
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    param_dtype: jnp.dtype = jnp.float32


def _dense(config: ViTConfig, features: int) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.normal(config.initializer_range),
                    param_dtype=config.param_dtype)


def _layer_norm(config: ViTConfig) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=config.layer_norm_eps, param_dtype=config.param_dtype)


class ViTPatchEmbeddings(nn.Module):
    config: ViTConfig

    def setup(self):
        c = self.config
        self.num_patches = (c.image_size // c.patch_size) ** 2
        self.projection = nn.Conv(
            c.hidden_size, kernel_size=(c.patch_size, c.patch_size),
            strides=(c.patch_size, c.patch_size), padding="VALID",
            kernel_init=nn.initializers.normal(c.initializer_range),
            param_dtype=c.param_dtype)

    def __call__(self, pixel_values):
        embeddings = self.projection(pixel_values)
        batch_size, _, _, channels = embeddings.shape
        return jnp.reshape(embeddings, (batch_size, -1, channels))


class ViTEmbeddings(nn.Module):
    config: ViTConfig

    def setup(self):
        c = self.config
        init = nn.initializers.normal(c.initializer_range)
        self.cls_token = self.param("cls_token", init, (1, 1, c.hidden_size), c.param_dtype)
        self.patch_embeddings = ViTPatchEmbeddings(c)
        num_patches = (c.image_size // c.patch_size) ** 2
        self.position_embeddings = self.param(
            "position_embeddings", init, (1, num_patches + 1, c.hidden_size), c.param_dtype)

    def __call__(self, pixel_values):
        batch_size = pixel_values.shape[0]
        embeddings = self.patch_embeddings(pixel_values)
        cls_tokens = jnp.broadcast_to(self.cls_token, (batch_size, 1, self.config.hidden_size))
        embeddings = jnp.concatenate((cls_tokens, embeddings), axis=1)
        return embeddings + self.position_embeddings


class ViTSelfAttention(nn.Module):
    config: ViTConfig

    def setup(self):
        c = self.config
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.query = _dense(c, c.hidden_size)
        self.key = _dense(c, c.hidden_size)
        self.value = _dense(c, c.hidden_size)

    def _split_heads(self, x):
        return x.reshape(x.shape[:2] + (self.config.num_attention_heads, self.head_dim))

    def __call__(self, hidden_states):
        query_states = self._split_heads(self.query(hidden_states))
        key_states = self._split_heads(self.key(hidden_states))
        value_states = self._split_heads(self.value(hidden_states))
        attn_weights = nn.dot_product_attention_weights(
            query_states, key_states, deterministic=True, dtype=hidden_states.dtype)
        attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, value_states)
        return attn_output.reshape(attn_output.shape[:2] + (-1,))


class ViTAttention(nn.Module):
    config: ViTConfig

    def setup(self):
        self.attention = ViTSelfAttention(self.config)
        self.output = _dense(self.config, self.config.hidden_size)

    def __call__(self, hidden_states):
        return self.output(self.attention(hidden_states))


class ViTLayer(nn.Module):
    config: ViTConfig

    def setup(self):
        c = self.config
        self.layernorm_before = _layer_norm(c)
        self.attention = ViTAttention(c)
        self.layernorm_after = _layer_norm(c)
        self.intermediate = _dense(c, c.intermediate_size)
        self.output = _dense(c, c.hidden_size)

    def __call__(self, hidden_states):
        hidden_states = hidden_states + self.attention(self.layernorm_before(hidden_states))
        h = nn.gelu(self.intermediate(self.layernorm_after(hidden_states)), approximate=False)
        return hidden_states + self.output(h)


class ViTEncoder(nn.Module):
    config: ViTConfig

    def setup(self):
        self.layer = [ViTLayer(self.config, name=str(i))
                      for i in range(self.config.num_hidden_layers)]

    def __call__(self, hidden_states):
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class ViTForImageClassification(nn.Module):
    config: ViTConfig

    def setup(self):
        c = self.config
        self.embeddings = ViTEmbeddings(c)
        self.encoder = ViTEncoder(c)
        self.layernorm = _layer_norm(c)
        self.classifier = _dense(c, c.num_labels)

    def __call__(self, pixel_values):
        hidden_states = self.encoder(self.embeddings(pixel_values))
        hidden_states = self.layernorm(hidden_states)
        return self.classifier(hidden_states[:, 0, :])


def make(*, dtype=jnp.float32, batch_size: int = 8, seed: int = 0, compiler_options=None,
         **config):
    """The ViT's ``(loss_fn, params, batch)``: cross-entropy over labels."""
    cfg = ViTConfig(param_dtype=dtype, **config)
    model = ViTForImageClassification(cfg)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    pixel_values = jax.random.normal(
        k_x, (batch_size, cfg.image_size, cfg.image_size, cfg.num_channels), dtype)
    labels = jax.random.randint(k_y, (batch_size,), 0, cfg.num_labels, jnp.int32)
    params = init_linen(model.init, k_init, pixel_values,
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["pixel_values"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss_fn, params, {"pixel_values": pixel_values, "labels": labels}
