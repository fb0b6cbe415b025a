"""An LSTM tagger with dropout inside its recurrent cell, scanned over time with `nn.scan`.

The cell drops out its input at every step (a fresh mask per step: ``split_rngs={'dropout':
True}``) before an `nn.OptimizedLSTMCell`; ``nn.scan(..., variable_broadcast='params',
in_axes=1, out_axes=1)`` runs it over the time axis with one set of weights, as custom
recurrent cells are written in linen. The carry starts at zeros of the input's dtype. Each
step's hidden state is classified (a tag per token); the dropout key is a constant the loss
closes over, so the loss is a deterministic function of (params, batch).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class DropoutLSTMCell(nn.Module):
    hidden: int
    rate: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, carry, x):
        x = nn.Dropout(self.rate, deterministic=False)(x)
        return nn.OptimizedLSTMCell(self.hidden, param_dtype=self.param_dtype, name="lstm")(
            carry, x)


class LSTMTagger(nn.Module):
    vocab: int = 16
    d_model: int = 16
    hidden: int = 16
    num_tags: int = 8
    rate: float = 0.2
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d_model, param_dtype=self.param_dtype, name="embed")(tokens)
        scan = nn.scan(DropoutLSTMCell, variable_broadcast="params",
                       split_rngs={"params": False, "dropout": True}, in_axes=1, out_axes=1)
        zeros = jnp.zeros((tokens.shape[0], self.hidden), x.dtype)
        _, h = scan(self.hidden, self.rate, self.param_dtype, name="rnn")((zeros, zeros), x)
        return nn.Dense(self.num_tags, param_dtype=self.param_dtype, name="head")(h)


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 6, seed: int = 0,
         compiler_options=None, **config):
    """The LSTM tagger's ``(loss_fn, params, batch)``: a tag per token, cross-entropy."""
    model = LSTMTagger(param_dtype=dtype, **config)
    k_init, k_drop, k_tok, k_tag = jax.random.split(jax.random.key(seed), 4)
    tokens = jax.random.randint(k_tok, (batch_size, seq_len), 0, model.vocab)
    tags = jax.random.randint(k_tag, (batch_size, seq_len), 0, model.num_tags)
    params = init_linen(model.init, {"params": k_init, "dropout": k_drop}, tokens,
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"], rngs={"dropout": k_drop})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tags"]).mean()

    return loss_fn, params, {"tokens": tokens, "tags": tags}
