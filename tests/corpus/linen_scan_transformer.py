"""A linen transformer whose blocks are scanned: `nn.scan` of an `nn.remat` block, or
`nn.remat_scan`.

The block is a pre-LayerNorm causal self-attention layer and a GELU feed-forward layer, with
`nn.Dropout` on both residual branches. ``nn.scan(nn.remat(Block), variable_axes={'params':
0}, split_rngs={'params': True, 'dropout': True}, length=L)`` stacks its parameters on a
leading layer dim and gives each layer its own dropout key; the block takes and returns
``(carry, None)`` as `nn.scan` wants. With ``use_remat_scan=True`` the same block (returning
its carry only) is applied by ``nn.remat_scan(Block, lengths=(2, 2))``: a scan of scans with
rematerialisation at both levels, parameters stacked on two leading dims.

The dropout key is a constant the loss closes over (``rngs={'dropout': key}``), so the loss is
a deterministic function of (params, batch).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class Block(nn.Module):
    d_model: int
    num_heads: int
    dropout: float
    param_dtype: jnp.dtype = jnp.float32
    scan_carry: bool = True  # nn.scan's (carry, xs) -> (carry, ys); remat_scan's x -> x

    @nn.compact
    def __call__(self, x: jax.Array, _xs=None):
        causal = nn.make_causal_mask(x[..., 0])
        h = nn.LayerNorm(param_dtype=self.param_dtype, name="ln_attn")(x)
        h = nn.MultiHeadDotProductAttention(self.num_heads, param_dtype=self.param_dtype,
                                            name="attn")(h, h, mask=causal)
        x = x + nn.Dropout(self.dropout, deterministic=False)(h)
        h = nn.LayerNorm(param_dtype=self.param_dtype, name="ln_mlp")(x)
        h = nn.gelu(nn.Dense(4 * self.d_model, param_dtype=self.param_dtype, name="fc1")(h))
        h = nn.Dense(self.d_model, param_dtype=self.param_dtype, name="fc2")(h)
        x = x + nn.Dropout(self.dropout, deterministic=False)(h)
        return (x, None) if self.scan_carry else x


class ScannedTransformer(nn.Module):
    vocab: int
    seq_len: int
    d_model: int
    num_heads: int
    num_layers: int
    dropout: float
    use_remat_scan: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.d_model, param_dtype=self.param_dtype, name="embed")
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model),
                         self.param_dtype)
        x = embed(tokens) + pos
        if self.use_remat_scan:
            assert self.num_layers == 4, "remat_scan uses lengths (2, 2)"
            blocks = nn.remat_scan(Block, lengths=(2, 2))(
                self.d_model, self.num_heads, self.dropout, self.param_dtype, scan_carry=False,
                name="blocks")
            x = blocks(x)
        else:
            stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True},
                            length=self.num_layers)
            x, _ = stack(self.d_model, self.num_heads, self.dropout, self.param_dtype,
                         name="blocks")(x, None)
        x = nn.LayerNorm(param_dtype=self.param_dtype, name="ln_f")(x)
        return nn.Dense(self.vocab, param_dtype=self.param_dtype, name="head")(x)


def make(*, dtype=jnp.float32, use_remat_scan: bool = False, batch_size: int = 8,
         seq_len: int = 8, vocab: int = 32, d_model: int = 16, num_heads: int = 4,
         num_layers: int | None = None, dropout: float = 0.1, seed: int = 0,
         compiler_options=None):
    """The scanned transformer's ``(loss_fn, params, batch)``: next-token cross-entropy.

    ``num_layers`` defaults to 2 (4 with ``use_remat_scan``: lengths (2, 2)).
    """
    num_layers = num_layers or (4 if use_remat_scan else 2)
    model = ScannedTransformer(vocab, seq_len, d_model, num_heads, num_layers, dropout,
                               use_remat_scan, dtype)
    k_init, k_drop, k_tok = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k_tok, (batch_size, seq_len + 1), 0, vocab)
    rngs = {"params": k_init, "dropout": k_drop}
    params = init_linen(model.init, rngs, tokens[:, :-1],
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"][:, :-1],
                             rngs={"dropout": k_drop})
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, params, {"tokens": tokens}
