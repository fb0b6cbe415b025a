"""A BERT-like encoder and sequence classifier, written the way HuggingFace's Flax BERT is.

Follows the HuggingFace-transformers Flax style (``FlaxBertModule`` and its parts), written
from scratch:

* a frozen config object passed to every module, modules built in ``setup``;
* embeddings: word + learned absolute position (``position_ids`` = ``jnp.broadcast_to`` of an
  ``arange``) + token-type, then LayerNorm (``epsilon=1e-12``);
* self-attention as ``query``/``key``/``value`` `nn.Dense` layers, each output reshaped to
  ``(batch, seq, heads, head_dim)`` after the matmul;
* the int ``attention_mask`` of the batch (padded positions 0) expanded to ``(B, 1, 1, S)`` and
  turned into an additive bias by ``jax.lax.select(mask > 0, jnp.full(shape, 0.0),
  jnp.full(shape, jnp.finfo(dtype).min))``; weights by `nn.dot_product_attention_weights`,
  context by ``jnp.einsum('...hqk,...khd->...qhd')``;
* post-LayerNorm residual blocks (``LayerNorm(x + dense(h))``), exact (erf) GELU MLP;
* layers held in a Python list in ``setup``, named ``"0"``, ``"1"`` (``name=str(i)``, as
  ``FlaxBertLayerCollection`` does): parameters under ``encoder/layer/0/...``;
* a pooler (Dense + tanh on the [CLS] token) and a classifier, cross-entropy over labels.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 64
    max_position_embeddings: int = 16
    type_vocab_size: int = 2
    num_labels: int = 4
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    param_dtype: jnp.dtype = jnp.float32


def _dense(config: BertConfig, features: int, name: str | None = None) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.normal(config.initializer_range),
                    param_dtype=config.param_dtype, name=name)


def _layer_norm(config: BertConfig, name: str = "LayerNorm") -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=config.layer_norm_eps, param_dtype=config.param_dtype,
                        name=name)


class BertEmbeddings(nn.Module):
    config: BertConfig

    def setup(self):
        c = self.config
        embed = lambda n: nn.Embed(  # noqa: E731
            n, c.hidden_size, embedding_init=nn.initializers.normal(c.initializer_range),
            param_dtype=c.param_dtype)
        self.word_embeddings = embed(c.vocab_size)
        self.position_embeddings = embed(c.max_position_embeddings)
        self.token_type_embeddings = embed(c.type_vocab_size)
        self.LayerNorm = _layer_norm(c)

    def __call__(self, input_ids, token_type_ids, position_ids):
        inputs_embeds = self.word_embeddings(input_ids.astype("i4"))
        position_embeds = self.position_embeddings(position_ids.astype("i4"))
        token_type_embeds = self.token_type_embeddings(token_type_ids.astype("i4"))
        return self.LayerNorm(inputs_embeds + token_type_embeds + position_embeds)


class BertSelfAttention(nn.Module):
    config: BertConfig

    def setup(self):
        c = self.config
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.query = _dense(c, c.hidden_size)
        self.key = _dense(c, c.hidden_size)
        self.value = _dense(c, c.hidden_size)

    def _split_heads(self, x):
        return x.reshape(x.shape[:2] + (self.config.num_attention_heads, self.head_dim))

    def __call__(self, hidden_states, attention_mask):
        query_states = self._split_heads(self.query(hidden_states))
        key_states = self._split_heads(self.key(hidden_states))
        value_states = self._split_heads(self.value(hidden_states))

        dtype = hidden_states.dtype
        attention_mask = jnp.expand_dims(attention_mask, axis=(-3, -2))
        attention_bias = jax.lax.select(
            attention_mask > 0,
            jnp.full(attention_mask.shape, 0.0).astype(dtype),
            jnp.full(attention_mask.shape, jnp.finfo(dtype).min).astype(dtype),
        )
        attn_weights = nn.dot_product_attention_weights(
            query_states, key_states, bias=attention_bias, deterministic=True, dtype=dtype)
        attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, value_states)
        return attn_output.reshape(attn_output.shape[:2] + (-1,))


class BertSelfOutput(nn.Module):
    config: BertConfig

    def setup(self):
        self.dense = _dense(self.config, self.config.hidden_size)
        self.LayerNorm = _layer_norm(self.config)

    def __call__(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertAttention(nn.Module):
    config: BertConfig

    def setup(self):
        self.self = BertSelfAttention(self.config)
        self.output = BertSelfOutput(self.config)

    def __call__(self, hidden_states, attention_mask):
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class BertIntermediate(nn.Module):
    config: BertConfig

    def setup(self):
        self.dense = _dense(self.config, self.config.intermediate_size)

    def __call__(self, hidden_states):
        return nn.gelu(self.dense(hidden_states), approximate=False)


class BertOutput(nn.Module):
    config: BertConfig

    def setup(self):
        self.dense = _dense(self.config, self.config.hidden_size)
        self.LayerNorm = _layer_norm(self.config)

    def __call__(self, hidden_states, attention_output):
        return self.LayerNorm(self.dense(hidden_states) + attention_output)


class BertLayer(nn.Module):
    config: BertConfig

    def setup(self):
        self.attention = BertAttention(self.config)
        self.intermediate = BertIntermediate(self.config)
        self.output = BertOutput(self.config)

    def __call__(self, hidden_states, attention_mask):
        attention_output = self.attention(hidden_states, attention_mask)
        return self.output(self.intermediate(attention_output), attention_output)


class BertLayerCollection(nn.Module):
    config: BertConfig

    def setup(self):
        self.layers = [BertLayer(self.config, name=str(i))
                       for i in range(self.config.num_hidden_layers)]

    def __call__(self, hidden_states, attention_mask):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return hidden_states


class BertEncoder(nn.Module):
    config: BertConfig

    def setup(self):
        self.layer = BertLayerCollection(self.config)

    def __call__(self, hidden_states, attention_mask):
        return self.layer(hidden_states, attention_mask)


class BertPooler(nn.Module):
    config: BertConfig

    def setup(self):
        self.dense = _dense(self.config, self.config.hidden_size)

    def __call__(self, hidden_states):
        return nn.tanh(self.dense(hidden_states[:, 0]))


class BertForSequenceClassification(nn.Module):
    config: BertConfig

    def setup(self):
        self.embeddings = BertEmbeddings(self.config)
        self.encoder = BertEncoder(self.config)
        self.pooler = BertPooler(self.config)
        self.classifier = _dense(self.config, self.config.num_labels)

    def __call__(self, input_ids, attention_mask, token_type_ids):
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        hidden_states = self.embeddings(input_ids, token_type_ids, position_ids)
        hidden_states = self.encoder(hidden_states, attention_mask)
        return self.classifier(self.pooler(hidden_states))


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, seed: int = 0,
         compiler_options=None, **config):
    """The BERT classifier's ``(loss_fn, params, batch)``: cross-entropy on [CLS].

    Each sequence has a random length in [3, seq_len] (the rest is padding, masked out), two
    segments (token types 0 then 1) and a random label.
    """
    cfg = BertConfig(param_dtype=dtype, **config)
    model = BertForSequenceClassification(cfg)
    k_init, k_ids, k_len, k_seg, k_y = jax.random.split(jax.random.key(seed), 5)
    input_ids = jax.random.randint(k_ids, (batch_size, seq_len), 1, cfg.vocab_size, jnp.int32)
    lengths = jax.random.randint(k_len, (batch_size, 1), 3, seq_len + 1, jnp.int32)
    positions = jnp.arange(seq_len)[None, :]
    attention_mask = (positions < lengths).astype(jnp.int32)
    input_ids = input_ids * attention_mask  # pad id 0
    split = jax.random.randint(k_seg, (batch_size, 1), 1, 3, jnp.int32)
    token_type_ids = ((positions >= split) & (attention_mask > 0)).astype(jnp.int32)
    labels = jax.random.randint(k_y, (batch_size,), 0, cfg.num_labels, jnp.int32)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "token_type_ids": token_type_ids, "labels": labels}
    params = init_linen(model.init, k_init, input_ids, attention_mask, token_type_ids,
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                             batch["token_type_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss_fn, params, batch
