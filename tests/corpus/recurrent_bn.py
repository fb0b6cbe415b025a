"""A sequence classifier with a batch-normalised recurrent cell and hard-example mining, in
linen.

* an LSTM cell **with recurrent batch normalisation** (Cooijmans et al., 2016): its input and
  hidden pre-activations normalised over the batch at every time step, by statistics computed
  inside the cell (``mean`` and ``var`` over axis 0), the cell scanned over time by
  ``nn.scan`` (parameters broadcast, ``variable_broadcast="params"``);
* mean and max pooling over time, a classifier;
* **online hard-example mining**: the loss is the mean of the ``k`` largest per-sample
  cross-entropies of the batch (``jax.lax.top_k`` along the batch), plus a small mean over all.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


def _batch_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = x.mean(axis=0, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=0, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale


class BNLSTMCell(nn.Module):
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, carry, x):
        c, h = carry
        wx = nn.Dense(4 * self.hidden, use_bias=False, param_dtype=self.param_dtype, name="wx")
        wh = nn.Dense(4 * self.hidden, param_dtype=self.param_dtype, name="wh")
        gx = self.param("gamma_x", nn.initializers.constant(0.1), (4 * self.hidden,),
                        self.param_dtype)
        gh = self.param("gamma_h", nn.initializers.constant(0.1), (4 * self.hidden,),
                        self.param_dtype)
        z = _batch_norm(wx(x), gx) + _batch_norm(wh(h), gh)
        i, f, g, o = jnp.split(z, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h


class Classifier(nn.Module):
    vocab: int = 16
    dim: int = 8
    hidden: int = 8
    num_classes: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.dim, param_dtype=self.param_dtype, name="embed")(tokens)
        b = x.shape[0]
        carry = (jnp.zeros((b, self.hidden), x.dtype), jnp.zeros((b, self.hidden), x.dtype))
        scan = nn.scan(BNLSTMCell, variable_broadcast="params", split_rngs={"params": False},
                       in_axes=1, out_axes=1)
        _, hs = scan(self.hidden, self.param_dtype, name="lstm")(carry, x)
        pooled = jnp.concatenate([hs.mean(axis=1), hs.max(axis=1)], axis=-1)
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype, name="head")(pooled)


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 6, seed: int = 0,
         hard: int = 4, compiler_options=None, **config):
    """The classifier's ``(loss_fn, params, batch)``: the mean of the `hard` largest
    per-sample cross-entropies plus 0.1 x the batch mean."""
    model = Classifier(param_dtype=dtype, **config)
    k_init, k_tok, k_lab = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k_tok, (batch_size, seq_len), 0, model.vocab)
    labels = jax.random.randint(k_lab, (batch_size,), 0, model.num_classes)
    params = init_linen(model.init, k_init, tokens, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        hardest, _ = jax.lax.top_k(ce, hard)
        return hardest.mean() + 0.1 * ce.mean()

    return loss_fn, params, {"tokens": tokens, "label": labels}
