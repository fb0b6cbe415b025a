"""Apply for equations that XLA's partitioner runs whole: ``top_k`` over rows a config splits.

``jax.lax.top_k`` takes the k largest along the last dim of every row, so a device holding
some rows can take their top k itself. XLA's SPMD partitioner does not: its ``TopK`` custom
call gathers the operand whole and runs on every row on every device (jax 0.10, XLA:CPU; an
MoE router's probabilities ``[B, T, E]``, batch split over 8 devices, are all-gathered before
the top k). The simulator prices the rows split (`soapjax._dims`: top_k's leading dims pass
through). So apply runs each such equation in `jax.shard_map`, its operand's rows split as the
operator's config splits them, its last dim whole; nothing is gathered, the results are the
same (a row's top k is computed where the row is).

    >>> import jax, jax.numpy as jnp
    >>> from soapjax.graph import trace
    >>> from soapjax.space import Config
    >>> graph = trace(lambda w, x: jax.lax.top_k(x @ w, 2)[0].sum(), jnp.ones((4, 8)),
    ...               jnp.ones((16, 4)))
    >>> loss = graph.index("<lambda>")  # the top k of the 16 rows and the sum: dims (16,)
    >>> split_top_k_units(graph, loss, Config((("data",),)))  # program unit 1, rows split
    {1: P('data', None)}
    >>> split_top_k_units(graph, loss, Config(((),)))  # rows whole: XLA runs it as it is
    {}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

from soapjax.graph import OpGraph
from soapjax.space import Config

__all__ = ["rowwise_calls", "split_top_k_units"]


def split_top_k_units(graph: OpGraph, j: int, cfg: Config) -> dict[int, PartitionSpec]:
    """Operator `j`'s ``top_k`` equations whose rows `cfg` splits: program unit -> the spec of
    its operand (the rows' axes, the dim it takes the top k along whole)."""
    prog = graph.program
    loc = prog.local[graph.operators[j].name]
    out: dict[int, PartitionSpec] = {}
    for i in loc.units:
        u = prog.units[i]
        if u.eqn.primitive.name != "top_k" or u.ins[0] not in loc.lab:
            continue
        dims = [loc.labels.lookup(x, loc.iter_of) for x in loc.lab[u.ins[0]]]
        along = u.eqn.params.get("axis", -1) % len(dims)
        axes = [tuple(cfg.axes[d]) if d is not None and k != along else ()
                for k, d in enumerate(dims)]
        if any(axes):
            out[i] = PartitionSpec(*(a or None for a in axes))
    return out


def rowwise_calls(graph: OpGraph, configs: Sequence[Config], mesh: Mesh
                  ) -> dict[int, Callable[..., list]]:
    """Program unit -> its computation, for `OpGraph.evaluate`'s and
    `soapjax._local.operator_fn`'s ``calls``: each ``top_k`` equation whose rows its
    operator's config splits, run in `jax.shard_map` on those rows (module doc)."""
    calls: dict[int, Callable[..., list]] = {}
    for j, cfg in enumerate(configs):
        for i, spec in split_top_k_units(graph, j, cfg).items():
            calls[i] = _local(graph.program.units[i].eqn, spec, mesh)
    return calls


def _local(eqn, spec: PartitionSpec, mesh: Mesh) -> Callable[..., list]:
    def run(x: jax.Array) -> list:
        outs = jax.shard_map(lambda r: tuple(eqn.primitive.bind(r, **eqn.params)), mesh=mesh,
                             in_specs=spec, out_specs=(spec,) * len(eqn.outvars),
                             check_vma=False)(x)
        return list(outs)
    return run
