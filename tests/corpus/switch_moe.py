"""A Switch-Transformer-style encoder (top-1 routing with an expert capacity), in linen, written
the way Flaxformer and the Switch paper's pseudo-code write it.

* the router: a Dense to the experts' logits, softmax, ``argmax`` (top 1) and its probability;
* each token's position in its expert's buffer by ``jnp.cumsum`` of the one-hot choices over
  the group's tokens, tokens beyond the capacity dropped (a mask), the dispatch tensor
  ``[group, tokens, experts, capacity]`` built from one-hots, tokens dispatched and combined by
  ``jnp.einsum``;
* experts as stacked weights ``[experts, d_model, hidden]`` applied by ``einsum`` over the
  experts' dim, ReLU;
* the load-balancing loss (the fraction of tokens per expert times the mean router
  probability, scaled by the number of experts) added to the task loss;
* tokens grouped per sample (``[batch, tokens]`` is ``[groups, group size]``), pre-LN
  self-attention by ``nn.MultiHeadDotProductAttention``, a mean-pooled classifier.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class SwitchMLP(nn.Module):
    num_experts: int
    hidden: int
    capacity_factor: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        groups, tokens, d_model = x.shape
        capacity = int(self.capacity_factor * tokens / self.num_experts)
        logits = nn.Dense(self.num_experts, use_bias=False, param_dtype=self.param_dtype,
                          name="router")(x)
        probs = jax.nn.softmax(logits, axis=-1)  # [G, T, E]
        expert = jnp.argmax(probs, axis=-1)
        gate = jnp.max(probs, axis=-1)
        choice = jax.nn.one_hot(expert, self.num_experts, dtype=x.dtype)  # [G, T, E]
        position = jnp.cumsum(choice, axis=1) * choice - 1.0  # position in its expert's buffer
        kept = choice * (position < capacity)
        slot = jax.nn.one_hot(jnp.sum(position * kept, axis=-1).astype(jnp.int32), capacity,
                              dtype=x.dtype)  # [G, T, C]
        dispatch = kept[..., None] * slot[:, :, None, :]  # [G, T, E, C]
        combine = dispatch * gate[..., None, None]
        w_in = self.param("w_in", nn.initializers.lecun_normal(),
                          (self.num_experts, d_model, self.hidden), self.param_dtype)
        w_out = self.param("w_out", nn.initializers.lecun_normal(),
                           (self.num_experts, self.hidden, d_model), self.param_dtype)
        expert_in = jnp.einsum("gtec,gtd->egcd", dispatch, x)
        h = nn.relu(jnp.einsum("egcd,edh->egch", expert_in, w_in))
        expert_out = jnp.einsum("egch,ehd->egcd", h, w_out)
        y = jnp.einsum("gtec,egcd->gtd", combine, expert_out)
        fraction = jnp.mean(choice, axis=(0, 1))
        balance = self.num_experts * jnp.sum(fraction * jnp.mean(probs, axis=(0, 1)))
        return y, balance


class SwitchLayer(nn.Module):
    num_heads: int
    num_experts: int
    hidden: int
    capacity_factor: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        ln = lambda name: nn.LayerNorm(param_dtype=self.param_dtype, name=name)  # noqa: E731
        h = ln("ln_attn")(x)
        x = x + nn.MultiHeadDotProductAttention(self.num_heads, param_dtype=self.param_dtype,
                                                name="attn")(h, h)
        y, balance = SwitchMLP(self.num_experts, self.hidden, self.capacity_factor,
                               self.param_dtype, name="moe")(ln("ln_moe")(x))
        return x + y, balance


class SwitchEncoder(nn.Module):
    vocab: int = 64
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 4
    hidden: int = 64
    capacity_factor: float = 1.5
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = nn.Embed(self.vocab, self.d_model, param_dtype=self.param_dtype, name="embed")(tokens)
        balance = 0.0
        for i in range(self.num_layers):
            x, b = SwitchLayer(self.num_heads, self.num_experts, self.hidden,
                               self.capacity_factor, self.param_dtype, name=f"layer_{i}")(x)
            balance = balance + b
        x = nn.LayerNorm(param_dtype=self.param_dtype, name="ln_f")(x)
        return nn.Dense(self.num_classes, param_dtype=self.param_dtype,
                        name="head")(jnp.mean(x, axis=1)), balance


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, seed: int = 0,
         balance_weight: float = 0.01, compiler_options=None, **config):
    """The Switch encoder's ``(loss_fn, params, batch)``: cross-entropy plus the weighted
    load-balancing loss."""
    model = SwitchEncoder(param_dtype=dtype, **config)
    k_init, k_tok, k_lab = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k_tok, (batch_size, seq_len), 0, model.vocab)
    labels = jax.random.randint(k_lab, (batch_size,), 0, model.num_classes)
    params = init_linen(model.init, k_init, tokens, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits, balance = model.apply({"params": params}, batch["tokens"])
        task = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return task + balance_weight * balance

    return loss_fn, params, {"tokens": tokens, "label": labels}
