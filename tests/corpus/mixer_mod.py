"""A token classifier of MLP-Mixer blocks with a mixture-of-depths MLP and a latent readout, in
linen.

* MLP-Mixer blocks: token mixing by a Dense over the sequence (``jnp.swapaxes`` to put the
  tokens last, a Dense whose kernel is ``[tokens, hidden]``, and back), channel mixing by an
  MLP; one block's parameters applied twice (ALBERT-style sharing: a module called in a loop),
  under ``nn.remat`` with a checkpoint policy (``dots_with_no_batch_dims_saveable``);
* a mixture-of-depths MLP: a router scores every token, ``jax.lax.top_k`` keeps the best
  ``capacity`` per sample, ``jnp.take_along_axis`` gathers them, an MLP runs on them alone,
  scaled by their router weight, and ``.at[rows, idx].add`` scatters the result back;
* a Perceiver-style readout: a learned latent array broadcast over the batch
  (``jnp.broadcast_to``) cross-attends to the tokens, and ``nn.SpectralNorm`` (a power
  iteration on the classifier's kernel, its vector in the mutable ``batch_stats``, discarded)
  classifies the pooled latents.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class MixerBlock(nn.Module):
    tokens_hidden: int
    channels_hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda n, name: nn.Dense(n, param_dtype=self.param_dtype, name=name)  # noqa: E731
        y = jnp.swapaxes(nn.LayerNorm(param_dtype=self.param_dtype, name="ln_tokens")(x), 1, 2)
        y = dense(x.shape[1], "tokens_out")(nn.gelu(dense(self.tokens_hidden, "tokens_in")(y)))
        x = x + jnp.swapaxes(y, 1, 2)
        y = nn.LayerNorm(param_dtype=self.param_dtype, name="ln_channels")(x)
        y = dense(x.shape[-1], "channels_out")(
            nn.gelu(dense(self.channels_hidden, "channels_in")(y)))
        return x + y


class DepthRouter(nn.Module):
    capacity: int
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch = x.shape[0]
        scores = nn.Dense(1, use_bias=False, param_dtype=self.param_dtype,
                          name="router")(x)[..., 0]  # [B, T]
        weight, idx = jax.lax.top_k(scores, self.capacity)  # [B, C]
        chosen = jnp.take_along_axis(x, idx[..., None], axis=1)  # [B, C, D]
        h = nn.Dense(self.hidden, param_dtype=self.param_dtype, name="up")(chosen)
        h = nn.Dense(x.shape[-1], param_dtype=self.param_dtype, name="down")(nn.relu(h))
        rows = jnp.arange(batch)[:, None]
        return x.at[rows, idx].add(h * jax.nn.sigmoid(weight)[..., None])


class LatentReadout(nn.Module):
    num_latents: int
    num_heads: int
    num_classes: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, update_stats: bool) -> jax.Array:
        latents = self.param("latents", nn.initializers.normal(0.02),
                             (self.num_latents, x.shape[-1]), self.param_dtype)
        queries = jnp.broadcast_to(latents, (x.shape[0],) + latents.shape)
        attend = nn.MultiHeadDotProductAttention(self.num_heads, param_dtype=self.param_dtype,
                                                 name="cross")
        pooled = jnp.mean(attend(queries, x), axis=1)
        head = nn.SpectralNorm(nn.Dense(self.num_classes, param_dtype=self.param_dtype),
                               name="head")
        return head(pooled, update_stats=update_stats)


class MixerMoD(nn.Module):
    vocab: int = 64
    seq_len: int = 8
    d_model: int = 32
    repeats: int = 2
    capacity: int = 4
    num_classes: int = 8
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, *, update_stats: bool = False) -> jax.Array:
        x = nn.Embed(self.vocab, self.d_model, param_dtype=self.param_dtype, name="embed")(tokens)
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        block = nn.remat(MixerBlock, policy=policy)(2 * self.seq_len, 2 * self.d_model,
                                                    self.param_dtype, name="shared")
        for _ in range(self.repeats):  # one block's parameters, applied again
            x = block(x)
        x = DepthRouter(self.capacity, 2 * self.d_model, self.param_dtype, name="mod")(x)
        return LatentReadout(4, 4, self.num_classes, self.param_dtype, name="readout")(
            x, update_stats=update_stats)


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 8, seed: int = 0,
         compiler_options=None, **config):
    """The mixer's ``(loss_fn, params, batch)``: softmax cross-entropy over classes; the
    spectral norm's power-iteration state is updated and discarded inside the loss."""
    model = MixerMoD(seq_len=seq_len, param_dtype=dtype, **config)
    k_init, k_tok, k_lab = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k_tok, (batch_size, seq_len), 0, model.vocab)
    labels = jax.random.randint(k_lab, (batch_size,), 0, model.num_classes)
    variables = init_linen(model.init, k_init, tokens, compiler_options=compiler_options)
    params, stats = variables["params"], variables["batch_stats"]

    def loss_fn(params, batch):
        logits, _ = model.apply({"params": params, "batch_stats": stats}, batch["tokens"],
                                update_stats=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn, params, {"tokens": tokens, "label": labels}
