"""A message-passing graph network in linen over a batch of graphs, each padded to one size.

The batch holds per graph its node features ``[G, N, F]``, edge features ``[G, E, F']`` and the
edges' sender and receiver indices ``[G, E]``, local to the graph (so dim 0 is the batch, as
soapjax needs; jraph's packed ``GraphsTuple`` concatenates graphs instead). Each layer gathers
the two ends of every edge (``jax.vmap`` of ``x[senders]``: a batched gather), an edge MLP makes
messages, ``jax.ops.segment_sum`` (vmapped: a scatter-add with a batch dim) sums them per
receiver and divides by the in-degree (a second segment sum), a node MLP updates the nodes
with a residual and LayerNorm, and the messages become the next layer's edge features. Three
layers named "0".."2", node sum pooling, a scalar readout per graph, MSE.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from corpus._jit import init_linen


def _gather(x, index):
    return jax.vmap(lambda xs, i: xs[i])(x, index)


def _segment_sum(data, segments, count: int):
    return jax.vmap(lambda d, s: jax.ops.segment_sum(d, s, num_segments=count))(data, segments)


class MessagePassing(nn.Module):
    dim: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, nodes, edges, senders, receivers):
        pd = self.param_dtype
        inputs = jnp.concatenate([_gather(nodes, senders), _gather(nodes, receivers), edges],
                                 axis=-1)
        messages = nn.relu(nn.Dense(self.dim, param_dtype=pd, name="edge_mlp")(inputs))
        count = nodes.shape[1]
        summed = _segment_sum(messages, receivers, count)
        degree = _segment_sum(jnp.ones(receivers.shape, nodes.dtype), receivers, count)
        mean = summed / jnp.maximum(degree, 1.0)[..., None]
        update = nn.Dense(self.dim, param_dtype=pd, name="node_mlp")(
            jnp.concatenate([nodes, mean], axis=-1))
        return nn.LayerNorm(param_dtype=pd)(nodes + nn.relu(update)), messages


class GraphNetwork(nn.Module):
    dim: int = 16
    layers: int = 3
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, nodes, edges, senders, receivers):
        pd = self.param_dtype
        h = nn.Dense(self.dim, param_dtype=pd, name="embed")(nodes)
        e = nn.Dense(self.dim, param_dtype=pd, name="edge_embed")(edges)
        for i in range(self.layers):
            h, e = MessagePassing(self.dim, pd, name=str(i))(h, e, senders, receivers)
        return nn.Dense(1, param_dtype=pd, name="readout")(h.sum(axis=1))[:, 0]


def make(*, dtype=jnp.float32, batch_size: int = 8, nodes: int = 12, edges: int = 32,
         seed: int = 0, compiler_options=None):
    """The graph network's ``(loss_fn, params, batch)``."""
    k = jax.random.split(jax.random.key(seed), 6)
    batch = {"nodes": jax.random.normal(k[0], (batch_size, nodes, 8), dtype),
             "edges": jax.random.normal(k[1], (batch_size, edges, 4), dtype),
             "senders": jax.random.randint(k[2], (batch_size, edges), 0, nodes),
             "receivers": jax.random.randint(k[3], (batch_size, edges), 0, nodes),
             "target": jax.random.normal(k[4], (batch_size,), dtype)}
    model = GraphNetwork(param_dtype=dtype)
    params = init_linen(model.init, k[5], batch["nodes"], batch["edges"], batch["senders"],
                        batch["receivers"], compiler_options=compiler_options)["params"]

    def loss_fn(params, batch):
        predicted = model.apply({"params": params}, batch["nodes"], batch["edges"],
                                batch["senders"], batch["receivers"])
        return jnp.mean((predicted - batch["target"]) ** 2)

    return loss_fn, params, batch
