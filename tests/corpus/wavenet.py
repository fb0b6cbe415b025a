"""A WaveNet-style autoregressive audio model with an ensemble of output heads, in linen.

* mu-law sample classes embedded, then a causal convolution (``nn.Conv(padding="CAUSAL")``);
* a stack of residual blocks, each a **dilated causal convolution** (``kernel_dilation`` 1, 2, 4
  and 8: the receptive field doubles every block) into a gated activation (``tanh`` times
  ``sigmoid`` of the two halves), ``nn.GroupNorm`` over the gate's channels, a 1x1 residual
  convolution and a 1x1 skip convolution whose outputs are summed over the blocks;
* an ensemble of output heads by ``nn.vmap`` over the parameters (``variable_axes={"params":
  0}``, one head's weights per member, the input broadcast), each predicting the next sample's
  class; the loss averages the members' cross-entropies;
* a masked mean guarded by ``jax.lax.cond`` (the mean of the padded steps' losses, zero when a
  batch has none), as users write it to avoid a division by zero.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class ResidualBlock(nn.Module):
    channels: int
    dilation: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = nn.Conv(2 * self.channels, (2,), kernel_dilation=(self.dilation,), padding="CAUSAL",
                    param_dtype=self.param_dtype, name="dilated")(x)
        filt, gate = jnp.split(h, 2, axis=-1)
        z = jnp.tanh(filt) * jax.nn.sigmoid(gate)
        z = nn.GroupNorm(num_groups=2, param_dtype=self.param_dtype, name="norm")(z)
        residual = nn.Conv(self.channels, (1,), param_dtype=self.param_dtype, name="res")(z)
        skip = nn.Conv(self.channels, (1,), param_dtype=self.param_dtype, name="skip")(z)
        return x + residual, skip


class Head(nn.Module):
    classes: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, skip: jax.Array) -> jax.Array:
        h = nn.relu(nn.Conv(skip.shape[-1], (1,), param_dtype=self.param_dtype, name="mix")(skip))
        return nn.Conv(self.classes, (1,), param_dtype=self.param_dtype, name="logits")(h)


class WaveNet(nn.Module):
    classes: int = 16
    channels: int = 8
    dilations: tuple[int, ...] = (1, 2, 4, 8)
    members: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, samples: jax.Array) -> jax.Array:
        x = nn.Embed(self.classes, self.channels, param_dtype=self.param_dtype,
                     name="embed")(samples)
        x = nn.Conv(self.channels, (2,), padding="CAUSAL", param_dtype=self.param_dtype,
                    name="causal")(x)
        skips = []
        for i, d in enumerate(self.dilations):
            x, s = ResidualBlock(self.channels, d, self.param_dtype, name=f"block_{i}")(x)
            skips.append(s)
        skip = nn.relu(sum(skips))
        heads = nn.vmap(Head, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=None, out_axes=0, axis_size=self.members)
        return heads(self.classes, self.param_dtype, name="heads")(skip)  # [members, B, T, C]


def make(*, dtype=jnp.float32, batch_size: int = 8, seq_len: int = 16, seed: int = 0,
         compiler_options=None, **config):
    """The WaveNet's ``(loss_fn, params, batch)``: each ensemble member predicts sample t+1
    from samples up to t; the loss is the members' mean cross-entropy over the real steps, plus
    a guarded mean over the padded ones (``lax.cond``)."""
    model = WaveNet(param_dtype=dtype, **config)
    k_init, k_x, k_len = jax.random.split(jax.random.key(seed), 3)
    samples = jax.random.randint(k_x, (batch_size, seq_len), 0, model.classes)
    lengths = jax.random.randint(k_len, (batch_size,), seq_len // 2, seq_len + 1)
    mask = (jnp.arange(seq_len)[None, :] < lengths[:, None]).astype(dtype)
    params = init_linen(model.init, k_init, samples, compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["samples"])[:, :, :-1]
        targets = batch["samples"][:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.broadcast_to(targets, logits.shape[:-1])).mean(axis=0)
        real = batch["mask"][:, 1:]
        main = (ce * real).sum() / real.sum()
        padded = 1.0 - real
        n_padded = padded.sum()
        extra = jax.lax.cond(n_padded > 0, lambda: (ce * padded).sum() / n_padded,
                             lambda: jnp.zeros((), ce.dtype))
        return main + 0.01 * extra

    return loss_fn, params, {"samples": samples, "mask": mask}
