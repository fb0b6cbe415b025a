"""A bidirectional GRU sequence tagger over variable-length sequences, with Flax's own RNN API,
in linen.

* ``nn.Bidirectional(nn.RNN(nn.GRUCell), nn.RNN(nn.GRUCell))`` called with ``seq_lengths``: the
  forward RNN keeps each sample's carry past its length (a per-sample mask inside the scan),
  the backward one reverses each sample's real tokens in place (``flip_sequences``: a gather
  by per-sample indices built from the lengths) before and after its scan;
* two stacked bidirectional layers (the second reads the first's concatenated outputs), with
  ``return_carry=True`` on the second, its final carries concatenated into a sentence vector;
* a per-token tagging head and a per-sentence classifier; the loss is the masked mean of the
  tags' cross-entropies over real tokens plus the sentence loss.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


def _bigru(hidden: int, dtype, name: str, **kw) -> nn.Bidirectional:
    return nn.Bidirectional(nn.RNN(nn.GRUCell(hidden, param_dtype=dtype)),
                            nn.RNN(nn.GRUCell(hidden, param_dtype=dtype)), name=name, **kw)


class Tagger(nn.Module):
    vocab: int = 16
    dim: int = 8
    hidden: int = 8
    tags: int = 4
    classes: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, lengths: jax.Array):
        x = nn.Embed(self.vocab, self.dim, param_dtype=self.param_dtype, name="embed")(tokens)
        x = _bigru(self.hidden, self.param_dtype, "layer_0")(x, seq_lengths=lengths)
        carries, x = _bigru(self.hidden, self.param_dtype, "layer_1", return_carry=True)(
            x, seq_lengths=lengths)
        sentence = jnp.concatenate(carries, axis=-1)
        tags = nn.Dense(self.tags, param_dtype=self.param_dtype, name="tag_head")(x)
        cls = nn.Dense(self.classes, param_dtype=self.param_dtype, name="cls_head")(sentence)
        return tags, cls


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 6, seed: int = 0,
         compiler_options=None, **config):
    """The tagger's ``(loss_fn, params, batch)``: masked token cross-entropy plus the sentence
    class's."""
    model = Tagger(param_dtype=dtype, **config)
    k_init, k_tok, k_len, k_tag, k_cls = jax.random.split(jax.random.key(seed), 5)
    tokens = jax.random.randint(k_tok, (batch_size, seq_len), 0, model.vocab)
    lengths = jax.random.randint(k_len, (batch_size,), 2, seq_len + 1)
    tags = jax.random.randint(k_tag, (batch_size, seq_len), 0, model.tags)
    classes = jax.random.randint(k_cls, (batch_size,), 0, model.classes)
    params = init_linen(model.init, k_init, tokens, lengths,
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        tag_logits, cls_logits = model.apply({"params": params}, batch["tokens"],
                                             batch["lengths"])
        mask = jnp.arange(tokens.shape[1])[None, :] < batch["lengths"][:, None]
        ce = optax.softmax_cross_entropy_with_integer_labels(tag_logits, batch["tags"])
        token_loss = jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.sum(mask)
        cls_loss = optax.softmax_cross_entropy_with_integer_labels(cls_logits,
                                                                   batch["classes"]).mean()
        return token_loss + cls_loss

    return loss_fn, params, {"tokens": tokens, "lengths": lengths, "tags": tags,
                             "classes": classes}
