"""Layers whose weights are shared across depth, as ALBERT and the Universal Transformer write
them, in linen.

* ALBERT's **factorised embedding** (a small embedding, then a Dense up to the hidden size);
* **one encoder layer applied three times in a Python loop** (the same submodule called
  repeatedly: every call reads the same parameters, whose gradient sums the three);
* then a **Universal-Transformer-style recurrence by ``nn.scan``** with
  ``variable_broadcast="params"`` (one set of weights read by every step of the scan, a
  timestep embedding added per step), ``split_rngs={"params": False}``;
* a sentence-order head on the first token and a masked-token head tied to the factorised
  embedding (``embed.attend`` after projecting back down), both losses summed.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class EncoderLayer(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, mask):
        kw = dict(param_dtype=self.param_dtype)
        d = x.shape[-1]
        h = nn.MultiHeadDotProductAttention(self.heads, name="attn", **kw)(x, x, mask=mask)
        x = nn.LayerNorm(name="ln_1", **kw)(x + h)
        h = nn.Dense(d, name="fc2", **kw)(nn.gelu(nn.Dense(2 * d, name="fc1", **kw)(x)))
        return nn.LayerNorm(name="ln_2", **kw)(x + h)


class RecurrentStep(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, carry, t):
        x, mask = carry
        step = self.param("step_embedding", nn.initializers.normal(0.02), (4, x.shape[-1]),
                          self.param_dtype)
        x = EncoderLayer(self.heads, self.param_dtype, name="layer")(x + step[t], mask)
        return (x, mask), None


class SharedEncoder(nn.Module):
    vocab: int = 64
    embed: int = 8
    dim: int = 16
    heads: int = 4
    repeats: int = 3
    steps: int = 2
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens, attention_mask):
        kw = dict(param_dtype=self.param_dtype)
        emb = nn.Embed(self.vocab, self.embed, name="word_embeddings", **kw)
        x = nn.Dense(self.dim, name="embedding_projection", **kw)(emb(tokens))
        mask = nn.make_attention_mask(attention_mask, attention_mask, dtype=bool)
        shared = EncoderLayer(self.heads, self.param_dtype, name="shared_layer")
        for _ in range(self.repeats):
            x = shared(x, mask)
        scan = nn.scan(RecurrentStep, variable_broadcast="params", split_rngs={"params": False},
                       length=self.steps)
        (x, _), _ = scan(self.heads, self.param_dtype, name="recurrence")(
            (x, mask), jnp.arange(self.steps))
        order = nn.Dense(2, name="sop_head", **kw)(jnp.tanh(x[:, 0]))
        down = nn.Dense(self.embed, name="mlm_down", **kw)(x)
        return emb.attend(down), order


def make(*, dtype=jnp.float32, batch_size: int = 8, seq: int = 12, seed: int = 0,
         compiler_options=None, **config):
    """The shared encoder's ``(loss_fn, params, batch)``: masked-token plus sentence-order
    cross-entropy."""
    model = SharedEncoder(param_dtype=dtype, **config)
    k_init, k_t, k_m, k_o = jax.random.split(jax.random.key(seed), 4)
    tokens = jax.random.randint(k_t, (batch_size, seq), 1, model.vocab)
    lengths = seq - jnp.arange(batch_size) % 4
    attention_mask = (jnp.arange(seq)[None] < lengths[:, None]).astype(jnp.int32)
    masked = jax.random.bernoulli(k_m, 0.3, (batch_size, seq)) & (attention_mask == 1)
    order = jax.random.randint(k_o, (batch_size,), 0, 2)
    params = init_linen(model.init, k_init, tokens, attention_mask,
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        inputs = jnp.where(batch["masked"], 0, batch["tokens"])
        logits, sop = model.apply({"params": params}, inputs, batch["attention_mask"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"])
        w = batch["masked"].astype(ce.dtype)
        mlm = (ce * w).sum() / jnp.maximum(w.sum(), 1.0)
        return mlm + optax.softmax_cross_entropy_with_integer_labels(sop, batch["order"]).mean()

    return loss_fn, params, {"tokens": tokens, "attention_mask": attention_mask,
                             "masked": masked, "order": order}
