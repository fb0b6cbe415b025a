"""A language model over right-padded batches, written the way HF's OPT and BLOOM are, in linen.

* positions from the padding mask: ``cumsum(mask) * mask - 1`` (OPT's learned positions, offset
  by 2, gathered from a table), so a padded sample's positions restart at its first token;
* ALiBi attention (BLOOM): no position embedding in the attention, a per-head slope times the
  key's position (from the same cumsum of the mask) added to the scores, a causal mask and the
  padding mask joined by ``jnp.where`` with the float type's minimum;
* a linear recurrent block between the attention layers: a per-channel decay ``a = sigmoid(nu)``
  and ``h_t = a * h_{t-1} + (1 - a) * x_t`` computed by ``jax.lax.associative_scan`` over time
  (as S5 and LRU implementations do), gated by ``silu``;
* an MLP whose up projection is ``nn.WeightNorm(nn.Dense(...))`` (the kernel divided by its
  column norms, times a learned scale), layer scale, and stochastic depth (a per-sample
  Bernoulli keep mask from the ``dropout`` rng, a constant key here) on every residual branch;
* the loss: label-smoothed cross-entropy (``optax.smooth_labels``) averaged over the real
  tokens only (``sum(loss * mask) / sum(mask)``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen

OFFSET = 2  # OPT's learned positions start at 2


def padded_positions(mask: jax.Array) -> jax.Array:
    """[B, T] int: 0, 1, ... over each sample's real tokens, -1 on its padding (OPT)."""
    return (jnp.cumsum(mask, axis=1) * mask - 1).astype(jnp.int32)


def alibi_slopes(num_heads: int) -> jax.Array:
    """BLOOM's slopes for a power-of-two head count: 2^(-8 i / n), i = 1..n."""
    return 2.0 ** (-8.0 * jnp.arange(1, num_heads + 1) / num_heads)


class AlibiAttention(nn.Module):
    num_heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        batch, length, d_model = x.shape
        head_dim = d_model // self.num_heads
        qkv = nn.Dense(3 * d_model, param_dtype=self.param_dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.num_heads, head_dim), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(x.dtype)
        key_pos = ((jnp.cumsum(mask, axis=-1) - 1) * mask)[:, None, None, :].astype(x.dtype)
        slopes = alibi_slopes(self.num_heads).astype(x.dtype)[None, :, None, None]
        scores = scores + slopes * key_pos
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        allowed = causal[None, None] & (mask[:, None, None, :] > 0)
        scores = jnp.where(allowed, scores, jnp.finfo(x.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, d_model)
        return nn.Dense(d_model, param_dtype=self.param_dtype, name="out")(out)


class LinearRecurrence(nn.Module):
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        u = nn.Dense(self.hidden, param_dtype=self.param_dtype, name="in")(x)
        gate = nn.Dense(self.hidden, param_dtype=self.param_dtype, name="gate")(x)
        nu = self.param("nu", nn.initializers.uniform(2.0), (self.hidden,), self.param_dtype)
        a = jax.nn.sigmoid(nu + 1.0)
        decay = jnp.broadcast_to(a, u.shape)

        def combine(left, right):
            a_l, b_l = left
            a_r, b_r = right
            return a_l * a_r, a_r * b_l + b_r

        _, h = jax.lax.associative_scan(combine, (decay, (1.0 - a) * u), axis=1)
        return nn.Dense(x.shape[-1], param_dtype=self.param_dtype, name="out")(
            h * nn.silu(gate))


class Block(nn.Module):
    num_heads: int
    hidden: int
    drop_path: float
    param_dtype: jnp.dtype = jnp.float32

    def _branch(self, x: jax.Array, out: jax.Array, name: str) -> jax.Array:
        scale = self.param(f"{name}_scale", nn.initializers.constant(0.5), (x.shape[-1],),
                           self.param_dtype)
        keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - self.drop_path,
                                    (x.shape[0], 1, 1))
        return x + jnp.where(keep, scale * out / (1.0 - self.drop_path), 0.0)

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        ln = lambda name: nn.LayerNorm(param_dtype=self.param_dtype, name=name)  # noqa: E731
        x = self._branch(x, AlibiAttention(self.num_heads, self.param_dtype, name="attn")(
            ln("ln_attn")(x), mask), "attn")
        x = self._branch(x, LinearRecurrence(self.hidden, self.param_dtype, name="lru")(
            ln("ln_lru")(x)), "lru")
        up = nn.WeightNorm(nn.Dense(self.hidden, param_dtype=self.param_dtype), name="up")
        h = nn.gelu(up(ln("ln_mlp")(x)))
        return self._branch(x, nn.Dense(x.shape[-1], param_dtype=self.param_dtype,
                                        name="down")(h), "mlp")


class PaddedLM(nn.Module):
    vocab: int = 64
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 4
    hidden: int = 64
    max_len: int = 16
    drop_path: float = 0.25
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.d_model, param_dtype=self.param_dtype, name="embed")
        positions = nn.Embed(self.max_len + OFFSET, self.d_model, param_dtype=self.param_dtype,
                             name="positions")
        x = embed(tokens) + positions(padded_positions(mask) + OFFSET)
        for i in range(self.num_layers):
            x = Block(self.num_heads, self.hidden, self.drop_path, self.param_dtype,
                      name=str(i))(x, mask)
        x = nn.LayerNorm(param_dtype=self.param_dtype, name="ln_f")(x)
        return nn.Dense(self.vocab, use_bias=False, param_dtype=self.param_dtype,
                        name="lm_head")(x)


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, seed: int = 0,
         smoothing: float = 0.1, compiler_options=None, **config):
    """The padded LM's ``(loss_fn, params, batch)``: each sample's real length drawn from
    2..seq_len, the rest padding (token 0, mask 0)."""
    model = PaddedLM(param_dtype=dtype, **config)
    k_init, k_tok, k_len = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k_tok, (batch_size, seq_len + 1), 1, model.vocab)
    lengths = jax.random.randint(k_len, (batch_size, 1), 2, seq_len + 2)
    mask = (jnp.arange(seq_len + 1)[None, :] < lengths).astype(jnp.int32)
    tokens = tokens * mask
    rngs = {"params": k_init, "dropout": jax.random.key(seed + 1)}
    params = init_linen(model.init, rngs, tokens[:, :-1], mask[:, :-1],
                        compiler_options=compiler_options)["params"]
    drop_key = jax.random.key(seed + 2)

    def loss_fn(params, batch):
        inputs, in_mask = batch["tokens"][:, :-1], batch["mask"][:, :-1]
        logits = model.apply({"params": params}, inputs, in_mask, rngs={"dropout": drop_key})
        labels = optax.smooth_labels(jax.nn.one_hot(batch["tokens"][:, 1:], model.vocab,
                                                    dtype=logits.dtype), smoothing)
        weight = batch["mask"][:, 1:].astype(logits.dtype)
        return jnp.sum(optax.softmax_cross_entropy(logits, labels) * weight) / jnp.sum(weight)

    return loss_fn, params, {"tokens": tokens, "mask": mask}
