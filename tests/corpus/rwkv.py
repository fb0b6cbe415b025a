"""An RWKV-4-style language model (Peng et al., 2023), in linen, the way its JAX ports write it.

* **token shift**: each block mixes every token with the one before it (``jnp.pad`` of the
  time axis by one, sliced back), by learned per-channel ratios;
* **time mixing**: receptance, key and value projections, and the WKV recurrence as a
  ``jax.lax.scan`` over time carrying a numerically stable state (numerator, denominator and
  the running maximum exponent), with a learned per-channel decay ``-exp(w)`` and a bonus
  ``u`` for the current token; the output gated by ``sigmoid(r)``;
* **channel mixing**: a squared-ReLU MLP gated by a sigmoid receptance;
* residuals around both, LayerNorms, the blocks in a list (``blocks_0``, ``blocks_1``), the
  projections' results named by ``checkpoint_name`` and each block under ``nn.remat`` with
  ``save_only_these_names`` (MaxText's way of choosing what to keep), tied logits
  (``embed.attend``), the mean next-token cross-entropy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from corpus._jit import init_linen


def _shift(x: jax.Array) -> jax.Array:
    """Each token's predecessor (zeros before the first): ``[B, T, C]``."""
    return jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def _wkv(w: jax.Array, u: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The WKV recurrence over time, in log space (``[B, T, C]`` in and out)."""
    def step(carry, kv):
        num, den, big = carry
        kt, vt = kv
        q = jnp.maximum(big, u + kt)
        e1, e2 = jnp.exp(big - q), jnp.exp(u + kt - q)
        out = (e1 * num + e2 * vt) / (e1 * den + e2)
        q = jnp.maximum(big + w, kt)
        e1, e2 = jnp.exp(big + w - q), jnp.exp(kt - q)
        return (e1 * num + e2 * vt, e1 * den + e2, q), out

    B, _, C = k.shape
    init = (jnp.zeros((B, C), k.dtype), jnp.zeros((B, C), k.dtype),
            jnp.full((B, C), -1e30, k.dtype))
    _, out = jax.lax.scan(step, init, (jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)))
    return jnp.swapaxes(out, 0, 1)


class Block(nn.Module):
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        C, pd = x.shape[-1], self.param_dtype
        dense = lambda n, f: nn.Dense(f, use_bias=False, param_dtype=pd, name=n)  # noqa: E731
        ratio = lambda n: self.param(n, nn.initializers.uniform(1.0), (C,), pd)  # noqa: E731
        h = nn.LayerNorm(param_dtype=pd, name="ln1")(x)
        prev = _shift(h)
        mix = lambda m: h * m + prev * (1 - m)  # noqa: E731
        r = checkpoint_name(dense("receptance", C)(mix(ratio("mix_r"))), "proj")
        k = checkpoint_name(dense("key", C)(mix(ratio("mix_k"))), "proj")
        v = checkpoint_name(dense("value", C)(mix(ratio("mix_v"))), "proj")
        w = -jnp.exp(self.param("decay", nn.initializers.normal(0.5), (C,), pd))
        u = self.param("bonus", nn.initializers.normal(0.5), (C,), pd)
        x = x + dense("output", C)(jax.nn.sigmoid(r) * _wkv(w, u, k, v))
        h = nn.LayerNorm(param_dtype=pd, name="ln2")(x)
        prev = _shift(h)
        mix = lambda m: h * m + prev * (1 - m)  # noqa: E731
        kk = jnp.square(nn.relu(dense("ffn_key", self.hidden)(mix(ratio("ffn_mix_k")))))
        rr = jax.nn.sigmoid(dense("ffn_receptance", C)(mix(ratio("ffn_mix_r"))))
        return x + rr * dense("ffn_value", C)(kk)


class RWKV(nn.Module):
    vocab: int = 32
    width: int = 16
    hidden: int = 32
    layers: int = 2
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.width, param_dtype=self.param_dtype, name="embed")
        x = nn.LayerNorm(param_dtype=self.param_dtype, name="ln0")(embed(tokens))
        policy = jax.checkpoint_policies.save_only_these_names("proj")
        block = nn.remat(Block, policy=policy)
        for i in range(self.layers):
            x = block(self.hidden, self.param_dtype, name=f"blocks_{i}")(x)
        return embed.attend(nn.LayerNorm(param_dtype=self.param_dtype, name="ln_out")(x))


def make(*, dtype=jnp.float32, batch_size: int = 8, length: int = 12, seed: int = 0,
         compiler_options=None):
    """The RWKV LM's ``(loss_fn, params, batch)``: tokens ``[B, T + 1]``, next-token loss."""
    model = RWKV(param_dtype=dtype)
    k_init, k_tok = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_tok, (batch_size, length + 1), 0, model.vocab)
    params = init_linen(model.init, k_init, tokens[:, :-1],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, params, {"tokens": tokens}
