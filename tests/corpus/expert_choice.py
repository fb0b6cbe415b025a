"""A decoder-free token classifier whose MLP is an **expert-choice** mixture of experts (Zhou
et al., 2022), in linen.

* a pre-norm self-attention block (``nn.MultiHeadDotProductAttention``);
* the expert-choice MLP: router probabilities ``softmax(x W_r)`` over ``[B * T, E]`` tokens;
  **each expert picks its top ``C`` tokens** by ``jax.lax.top_k`` over the transposed scores
  (``[E, B * T]``: along the tokens of the whole batch, so a token's routing depends on every
  other token's); the chosen tokens gathered by ``x[index]`` (``[E, C, d]``), the experts' MLPs
  as einsums over stacked weights ``[E, d, h]``, the outputs scaled by their gate and added
  back to their tokens with ``.at[index].add`` (a token no expert chose passes through
  unchanged, one chosen twice gets both);
* mean pooling and a classifier.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class ExpertChoiceMLP(nn.Module):
    experts: int
    hidden: int
    capacity_factor: float = 1.0
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        scores = jax.nn.softmax(nn.Dense(self.experts, use_bias=False,
                                         param_dtype=self.param_dtype, name="router")(tokens))
        capacity = int(self.capacity_factor * b * t / self.experts)
        gate, index = jax.lax.top_k(scores.T, capacity)  # [E, C]: each expert's tokens
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_in = self.param("w_in", init, (self.experts, d, self.hidden), self.param_dtype)
        w_out = self.param("w_out", init, (self.experts, self.hidden, d), self.param_dtype)
        chosen = tokens[index]  # [E, C, d]
        h = nn.gelu(jnp.einsum("ecd,edh->ech", chosen, w_in))
        y = jnp.einsum("ech,ehd->ecd", h, w_out) * gate[..., None]
        out = jnp.zeros_like(tokens).at[index.reshape(-1)].add(y.reshape(-1, d))
        return out.reshape(b, t, d)


class Classifier(nn.Module):
    vocab: int = 32
    dim: int = 16
    heads: int = 4
    experts: int = 4
    num_classes: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.dim, param_dtype=self.param_dtype, name="embed")(tokens)
        ln = lambda name: nn.LayerNorm(param_dtype=self.param_dtype, name=name)  # noqa: E731
        y = ln("ln_attn")(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads, param_dtype=self.param_dtype,
                                                name="attn")(y, y)
        x = x + ExpertChoiceMLP(self.experts, 2 * self.dim, param_dtype=self.param_dtype,
                                name="moe")(ln("ln_moe")(x))
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype,
                        name="head")(ln("ln_out")(x).mean(axis=1))


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, seed: int = 0,
         compiler_options=None, **config):
    """The classifier's ``(loss_fn, params, batch)``: softmax cross-entropy."""
    model = Classifier(param_dtype=dtype, **config)
    k_init, k_tok, k_lab = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k_tok, (batch_size, seq_len), 0, model.vocab)
    labels = jax.random.randint(k_lab, (batch_size,), 0, model.num_classes)
    params = init_linen(model.init, k_init, tokens, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"tokens": tokens, "label": labels}
