"""A Conformer encoder for speech (CTC), written the way ASR code writes it, in linen.

* a convolutional subsampling front end (two strided 2D convolutions over ``[B, T, F, 1]``
  log-mel frames, flattened to ``[B, T/4, C * F/4]`` by reshape) and a linear projection;
* Conformer blocks: **macaron feed-forward halves** (``x + 0.5 * FFN(x)`` before and after),
  multi-head self-attention with a key padding mask from the utterance lengths, and the
  **convolution module**: pointwise convolution to ``2 d``, **GLU** (``jnp.split`` of the
  channels, ``a * sigmoid(b)``), a **depthwise 1D convolution** (``feature_group_count = d``,
  kernel 7, SAME), BatchNorm (batch statistics, discarded), Swish, pointwise back;
* CTC loss (``optax.ctc_loss``) over the frames' padding, with label paddings.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen


class FeedForward(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.LayerNorm(param_dtype=self.param_dtype, name="norm")(x)
        h = nn.swish(nn.Dense(4 * d, param_dtype=self.param_dtype, name="fc1")(h))
        return nn.Dense(d, param_dtype=self.param_dtype, name="fc2")(h)


class ConvModule(nn.Module):
    kernel: int = 7
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, pad_mask):
        d = x.shape[-1]
        kw = dict(param_dtype=self.param_dtype)
        h = nn.LayerNorm(name="norm", **kw)(x)
        h = nn.Conv(2 * d, (1,), name="pointwise_1", **kw)(h)
        a, b = jnp.split(h, 2, axis=-1)
        h = (a * nn.sigmoid(b)) * pad_mask[..., None]
        h = nn.Conv(d, (self.kernel,), feature_group_count=d, padding="SAME", name="depthwise",
                    **kw)(h)
        h = nn.BatchNorm(use_running_average=False, name="bn", **kw)(h)
        h = nn.swish(h)
        return nn.Conv(d, (1,), name="pointwise_2", **kw)(h)


class ConformerBlock(nn.Module):
    heads: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, pad_mask):
        kw = dict(param_dtype=self.param_dtype)
        x = x + 0.5 * FeedForward(name="ff1", **kw)(x)
        h = nn.LayerNorm(name="attn_norm", **kw)(x)
        mask = nn.make_attention_mask(pad_mask, pad_mask, dtype=bool)
        x = x + nn.MultiHeadDotProductAttention(self.heads, name="attn", **kw)(h, h, mask=mask)
        x = x + ConvModule(name="conv", **kw)(x, pad_mask)
        x = x + 0.5 * FeedForward(name="ff2", **kw)(x)
        return nn.LayerNorm(name="final_norm", **kw)(x)


class Conformer(nn.Module):
    dim: int = 16
    heads: int = 4
    depth: int = 2
    vocab: int = 12
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, mels, frame_pad):  # [B, T, F], [B, T] (1 = padding, optax's convention)
        kw = dict(param_dtype=self.param_dtype)
        x = mels[..., None]
        x = nn.relu(nn.Conv(4, (3, 3), strides=(2, 2), name="subsample_0", **kw)(x))
        x = nn.relu(nn.Conv(4, (3, 3), strides=(2, 2), name="subsample_1", **kw)(x))
        b, t, f, c = x.shape
        x = nn.Dense(self.dim, name="input_proj", **kw)(x.reshape(b, t, f * c))
        pad = frame_pad[:, ::4]
        keep = 1.0 - pad
        for i in range(self.depth):
            x = ConformerBlock(self.heads, name=f"block_{i}", **kw)(x, keep)
        return nn.Dense(self.vocab, name="ctc_head", **kw)(x), pad


def make(*, dtype=jnp.float32, batch_size: int = 8, frames: int = 32, mels: int = 16,
         labels: int = 5, seed: int = 0, compiler_options=None, **config):
    """The Conformer's ``(loss_fn, params, batch)``: CTC over the subsampled frames."""
    model = Conformer(param_dtype=dtype, **config)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (batch_size, frames, mels), dtype)
    lengths = frames - 4 * (jnp.arange(batch_size) % 3)
    frame_pad = (jnp.arange(frames)[None] >= lengths[:, None]).astype(dtype)
    y = jax.random.randint(k_y, (batch_size, labels), 1, model.vocab)
    label_pad = (jnp.arange(labels)[None] >= (labels - jnp.arange(batch_size) % 2)[:, None])
    variables = init_linen(model.init, k_init, x, frame_pad, compiler_options=compiler_options)
    params = variables["params"]
    stats = variables["batch_stats"]

    def loss_fn(params, batch):
        (logits, pad), _ = model.apply({"params": params, "batch_stats": stats}, batch["mels"],
                                       batch["frame_pad"], mutable=["batch_stats"])
        return optax.ctc_loss(logits, pad, batch["labels"], batch["label_pad"]).mean()

    return loss_fn, params, {"mels": x, "frame_pad": frame_pad, "labels": y,
                             "label_pad": label_pad.astype(dtype)}
