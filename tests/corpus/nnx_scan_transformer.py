"""An nnx transformer whose layers are stacked by `nnx.vmap` and applied by `nnx.scan`.

As the flax 0.12 `nnx.scan` documentation builds a scan over layers: ``nnx.split_rngs`` splits
the ``Rngs`` per layer and ``nnx.vmap`` calls the block constructor once per layer, so every
parameter, batch statistic and rng stream of the blocks gains a leading layer dim; the forward
pass scans a function over (carry = activations, xs = the stacked blocks), and that function
is wrapped in `nnx.remat` so the backward pass recomputes each layer.

Each block: pre-LayerNorm causal self-attention (`nnx.MultiHeadAttention` with attention
dropout), then a feed-forward layer whose hidden activations are normalised by `nnx.BatchNorm`
over (batch, time) with batch statistics, and `nnx.Dropout` on both residual branches; every
dropout draws from the block's own ``dropout`` rng stream. The model's state holds the
streams' keys and counts, so a loss evaluated on the same state draws the same masks
(`nnx.merge` of a fixed state gives a fixed count).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from corpus._jit import create_nnx


class Block(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, *, dropout: float, param_dtype,
                 rngs: nnx.Rngs):
        self.ln_attn = nnx.LayerNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        # With a dropout rate, attention takes flax's own path (float64 stays float64);
        # without one it calls jax.nn.dot_product_attention, whose logits are float32.
        self.attn = nnx.MultiHeadAttention(num_heads, d_model, dropout_rate=dropout,
                                           deterministic=False, decode=False,
                                           param_dtype=param_dtype, rngs=rngs)
        self.ln_mlp = nnx.LayerNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        self.fc1 = nnx.Linear(d_model, 2 * d_model, param_dtype=param_dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(2 * d_model, momentum=0.9, param_dtype=param_dtype, rngs=rngs)
        self.fc2 = nnx.Linear(2 * d_model, d_model, param_dtype=param_dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        causal = nnx.make_causal_mask(x[..., 0])
        h = self.ln_attn(x)
        x = x + self.dropout(self.attn(h, mask=causal))
        h = nnx.gelu(self.bn(self.fc1(self.ln_mlp(x))))
        return x + self.dropout(self.fc2(h))


class ScanTransformer(nnx.Module):
    def __init__(self, *, vocab: int, seq_len: int, d_model: int, num_heads: int,
                 num_layers: int, dropout: float, param_dtype, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, param_dtype=param_dtype, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model),
                                                      param_dtype))

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(d_model, num_heads, dropout=dropout, param_dtype=param_dtype,
                         rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.ln_f = nnx.LayerNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[...]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def layer(x, block: Block):
            return block(x)

        x = layer(x, self.blocks)
        return self.head(self.ln_f(x))


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, vocab: int = 32,
         d_model: int = 16, num_heads: int = 4, num_layers: int = 2, dropout: float = 0.1,
         seed: int = 0, compiler_options=None):
    """The scanned nnx transformer's ``(loss_fn, model, batch)``: next-token cross-entropy."""
    model = create_nnx(lambda: ScanTransformer(
        vocab=vocab, seq_len=seq_len, d_model=d_model, num_heads=num_heads,
        num_layers=num_layers, dropout=dropout, param_dtype=dtype,
        rngs=nnx.Rngs(params=seed, dropout=seed + 1)), compiler_options=compiler_options)
    tokens = jax.random.randint(jax.random.key(seed + 2), (batch_size, seq_len + 1), 0, vocab)

    def loss_fn(model, batch):
        logits = model(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    return loss_fn, model, {"tokens": tokens}
