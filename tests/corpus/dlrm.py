"""A DLRM-style click-through-rate model (Naumov et al., 2019), in linen, the way recommender
code writes it.

* a bottom MLP over the dense features;
* categorical features as multi-hot **embedding bags**: each of three features holds up to
  ``bag`` ids per sample, padded and masked; the ids are hashed into their table by ``% vocab``
  (one table an `nn.Embed`, two `self.param` tables read by ``jnp.take``), the bag's rows
  averaged under the mask (an empty bag gives zeros, guarded by ``jnp.maximum``);
* **pairwise dot interactions**: the bottom MLP's output and the bags stacked
  ``[B, F + 1, E]``, every pair's dot product by an einsum of the stack with itself, the
  strictly upper triangle gathered by ``jnp.triu_indices`` (an advanced-index gather on two
  dims at once);
* a top MLP over the bottom output and the interactions, and the mean sigmoid binary
  cross-entropy against 0/1 labels.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from corpus._jit import init_linen

VOCABS = (40, 24, 16)  # rows per table; the ids are hashed into them


class DLRM(nn.Module):
    embed: int = 8
    bottom: int = 16
    top: int = 16
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, dense: jax.Array, ids: jax.Array, mask: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.bottom, param_dtype=self.param_dtype, name="bot_0")(dense))
        x = nn.relu(nn.Dense(self.embed, param_dtype=self.param_dtype, name="bot_1")(x))
        bags = []
        for f, vocab in enumerate(VOCABS):
            hashed = ids[:, f] % vocab
            if f == 0:
                rows = nn.Embed(vocab, self.embed, param_dtype=self.param_dtype,
                                name="emb_0")(hashed)
            else:
                table = self.param(f"emb_{f}", nn.initializers.normal(0.1),
                                   (vocab, self.embed), self.param_dtype)
                rows = jnp.take(table, hashed, axis=0)
            m = mask[:, f].astype(rows.dtype)
            bags.append((rows * m[..., None]).sum(1)
                        / jnp.maximum(m.sum(1, keepdims=True), 1.0))
        z = jnp.stack([x, *bags], axis=1)                      # [B, F + 1, E]
        pairs = jnp.einsum("bie,bje->bij", z, z)
        iu, ju = jnp.triu_indices(z.shape[1], k=1)
        h = jnp.concatenate([x, pairs[:, iu, ju]], axis=-1)
        h = nn.relu(nn.Dense(self.top, param_dtype=self.param_dtype, name="top_0")(h))
        return nn.Dense(1, param_dtype=self.param_dtype, name="top_1")(h)[:, 0]


def make(*, dtype=jnp.float32, batch_size: int = 8, dense_features: int = 12, bag: int = 4,
         seed: int = 0, compiler_options=None):
    """DLRM's ``(loss_fn, params, batch)``: ids up to 1,000 (hashed), bags 0 to `bag` long."""
    model = DLRM(param_dtype=dtype)
    k_init, k_x, k_ids, k_len, k_y = jax.random.split(jax.random.key(seed), 5)
    dense = jax.random.normal(k_x, (batch_size, dense_features), dtype)
    ids = jax.random.randint(k_ids, (batch_size, len(VOCABS), bag), 0, 1000)
    lengths = jax.random.randint(k_len, (batch_size, len(VOCABS), 1), 0, bag + 1)
    mask = jnp.arange(bag) < lengths                          # some bags empty
    labels = jax.random.bernoulli(k_y, 0.3, (batch_size,)).astype(dtype)
    params = init_linen(model.init, k_init, dense, ids, mask,
                        compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["dense"], batch["ids"], batch["mask"])
        return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()

    return loss_fn, params, {"dense": dense, "ids": ids, "mask": mask, "label": labels}
