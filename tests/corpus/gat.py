"""A graph attention network (GAT) over a batch of small graphs, as jraph-style code writes it,
in linen.

* each sample one graph: ``[nodes, features]``, edges as ``senders`` and ``receivers`` index
  arrays (self loops included), the per-sample code ``jax.vmap``'d over the batch;
* multi-head attention over edges: per-head projections, edge logits from the sender's and
  receiver's halves (``leaky_relu``), a **segment softmax**: ``jax.ops.segment_max`` of the
  logits per receiver (a scatter-max), subtracted, ``exp``, ``jax.ops.segment_sum`` (a
  scatter-add) of the weights, the weights gathered back and divided;
* messages weighted and summed per receiver; heads concatenated in the first layer and
  averaged in the last; ELU between layers;
* node classification: cross-entropy over the labelled nodes (a mask), averaged.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus._jit import init_linen


def segment_softmax(logits, segments, count):
    """Softmax of edge logits over the edges of each receiver (jraph's ``segment_softmax``)."""
    peak = jax.ops.segment_max(logits, segments, num_segments=count)
    e = jnp.exp(logits - jax.lax.stop_gradient(peak)[segments])
    total = jax.ops.segment_sum(e, segments, num_segments=count)
    return e / total[segments]


class GATLayer(nn.Module):
    features: int
    heads: int
    concat: bool
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, nodes, senders, receivers):  # one graph: [N, F], [E], [E]
        n = nodes.shape[0]
        h = nn.DenseGeneral((self.heads, self.features), use_bias=False,
                            param_dtype=self.param_dtype, name="proj")(nodes)  # [N, H, F]
        a_src = self.param("att_src", nn.initializers.glorot_uniform(),
                           (self.heads, self.features), self.param_dtype)
        a_dst = self.param("att_dst", nn.initializers.glorot_uniform(),
                           (self.heads, self.features), self.param_dtype)
        logits = nn.leaky_relu((h[senders] * a_src).sum(-1) + (h[receivers] * a_dst).sum(-1),
                               0.2)  # [E, H]
        alpha = segment_softmax(logits, receivers, n)
        out = jax.ops.segment_sum(h[senders] * alpha[..., None], receivers, num_segments=n)
        bias = self.param("bias", nn.initializers.zeros,
                          (self.heads * self.features if self.concat else self.features,),
                          self.param_dtype)
        out = out.reshape(n, -1) if self.concat else out.mean(axis=1)
        return out + bias


class GAT(nn.Module):
    hidden: int = 8
    heads: int = 4
    classes: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, nodes, senders, receivers):
        h = nn.elu(GATLayer(self.hidden, self.heads, True, self.param_dtype, name="gat_0")(
            nodes, senders, receivers))
        return GATLayer(self.classes, self.heads, False, self.param_dtype, name="gat_1")(
            h, senders, receivers)


def random_graphs(rng: np.random.Generator, batch: int, nodes: int, degree: int):
    senders, receivers = [], []
    for _ in range(batch):
        s = np.concatenate([np.arange(nodes), rng.integers(0, nodes, nodes * degree)])
        r = np.concatenate([np.arange(nodes), rng.integers(0, nodes, nodes * degree)])
        senders.append(s)
        receivers.append(r)
    return np.stack(senders).astype(np.int32), np.stack(receivers).astype(np.int32)


def make(*, dtype=jnp.float32, batch_size: int = 8, nodes: int = 12, features: int = 16,
         degree: int = 3, seed: int = 0, compiler_options=None, **config):
    """The GAT's ``(loss_fn, params, batch)``: masked node-classification cross-entropy."""
    model = GAT(param_dtype=dtype, **config)
    rng = np.random.default_rng(seed)
    senders, receivers = random_graphs(rng, batch_size, nodes, degree)
    k_init, k_x = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k_x, (batch_size, nodes, features), dtype)
    labels = jnp.asarray(rng.integers(0, model.classes, (batch_size, nodes)), jnp.int32)
    mask = jnp.asarray(rng.random((batch_size, nodes)) < 0.5)
    params = init_linen(lambda k, *a: model.init(k, *a), k_init, x[0], senders[0],
                        receivers[0], compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        logits = jax.vmap(lambda x, s, r: model.apply({"params": params}, x, s, r))(
            batch["nodes"], batch["senders"], batch["receivers"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        m = batch["mask"].astype(ce.dtype)
        return (ce * m).sum() / m.sum()

    return loss_fn, params, {"nodes": x, "senders": jnp.asarray(senders),
                             "receivers": jnp.asarray(receivers), "labels": labels,
                             "mask": mask}
