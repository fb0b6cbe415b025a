"""Apply for equations XLA's partitioner gets wrong or runs whole: apply runs them in
`jax.shard_map` itself, each device on its own shard, as the simulator prices them.

**A top k over rows a config splits.** ``jax.lax.top_k`` takes the k largest along the last dim
of every row, so a device holding some rows can take their top k itself. XLA's SPMD
partitioner does not: its ``TopK`` custom call gathers the operand whole and runs on every row
on every device (jax 0.10, XLA:CPU; an MoE router's probabilities ``[B, T, E]``, batch split
over 8 devices, are all-gathered before the top k). The simulator prices the rows split
(`soapjax._dims`: top_k's leading dims pass through). So each such equation runs with its
operand's rows split as the operator's config splits them, its last dim whole; nothing is
gathered, the results are the same (a row's top k is computed where the row is).

**A grouped (or depthwise) convolution.** XLA's SPMD partitioner (jax 0.10.2, Shardy and
GSPMD alike) computes the kernel gradient of a convolution with ``feature_group_count > 1``
wrongly when its input's batch is split over some mesh axes and replicated over others: the
gradient comes out multiplied by the replicated axes' size (``P('data')`` on a ``data=2,
model=4`` mesh: 4x; ``P('model')``: 2x), silently, while the loss is exact
(`tests/test_exactness.py` keeps the canary). Run in `jax.shard_map` the same shards give the
exact gradient. So every grouped convolution whose config splits anything runs there: its
input, kernel and output split as the config splits their dims (the channels in whole groups,
`soapjax._dims`), each device convolving its channels' groups (``feature_group_count`` divided
by the channels' split).

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

__all__ = ["grouped_conv_units", "manual_calls", "split_top_k_units"]


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


def grouped_conv_units(graph: OpGraph, j: int, cfg: Config
                       ) -> dict[int, tuple[PartitionSpec, PartitionSpec, PartitionSpec]]:
    """Operator `j`'s grouped convolutions (``feature_group_count > 1``) when `cfg` splits
    anything: program unit -> the specs of its input, kernel and output (module doc)."""
    if not cfg.used_axes:
        return {}
    prog = graph.program
    loc = prog.local[graph.operators[j].name]
    out: dict[int, tuple[PartitionSpec, PartitionSpec, PartitionSpec]] = {}
    for i in loc.units:
        u = prog.units[i]
        if u.eqn.primitive.name != "conv_general_dilated" \
                or u.eqn.params["feature_group_count"] == 1:
            continue
        if any(v not in loc.lab for v in (*u.ins[:2], u.outs[0])):
            continue  # built from constants alone: computed whole, as XLA does

        def spec(v: int) -> PartitionSpec:
            dims = [loc.labels.lookup(x, loc.iter_of) for x in loc.lab[v]]
            return PartitionSpec(*(_axes(cfg.axes[d]) if d is not None else None
                                   for d in dims))

        out[i] = (spec(u.ins[0]), spec(u.ins[1]), spec(u.outs[0]))
    return out


def manual_calls(graph: OpGraph, configs: Sequence[Config], mesh: Mesh
                 ) -> dict[int, Callable[..., list]]:
    """Program unit -> its computation, for `OpGraph.evaluate`'s and
    `soapjax._local.operator_fn`'s ``calls``: each ``top_k`` equation whose rows its
    operator's config splits, and each grouped convolution its config splits, run in
    `jax.shard_map` (module doc)."""
    calls: dict[int, Callable[..., list]] = {}
    for j, cfg in enumerate(configs):
        for i, spec in split_top_k_units(graph, j, cfg).items():
            calls[i] = _local(graph.program.units[i].eqn, spec, mesh)
        for i, specs in grouped_conv_units(graph, j, cfg).items():
            calls[i] = _grouped_conv(graph.program.units[i].eqn, *specs, mesh)
    return calls


def _axes(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return (axes[0] if len(axes) == 1 else axes) if axes else None


def _grouped_conv(eqn, lhs: PartitionSpec, rhs: PartitionSpec, out: PartitionSpec,
                  mesh: Mesh) -> Callable[..., list]:
    channel = eqn.params["dimension_numbers"].lhs_spec[1]
    full = eqn.invars[0].aval.shape[channel]

    p = eqn.params

    def local(x, w):
        # `jax.lax.conv_general_dilated`, not the primitive's bind: it casts a kernel replicated
        # over the batch's axes to varying, whose transpose sums its cotangent over them
        return jax.lax.conv_general_dilated(
            x, w, p["window_strides"], p["padding"], p["lhs_dilation"], p["rhs_dilation"],
            p["dimension_numbers"],
            # whole groups per device (`soapjax._dims`)
            feature_group_count=p["feature_group_count"] * x.shape[channel] // full,
            batch_group_count=p["batch_group_count"], precision=p["precision"],
            preferred_element_type=p["preferred_element_type"])

    def run(x: jax.Array, w: jax.Array) -> list:
        return [jax.shard_map(local, mesh=mesh, in_specs=(lhs, rhs), out_specs=out)(x, w)]

    return run


def _local(eqn, spec: PartitionSpec, mesh: Mesh) -> Callable[..., list]:
    def run(x: jax.Array) -> list:
        outs = jax.shard_map(lambda r: tuple(eqn.primitive.bind(r, **eqn.params)), mesh=mesh,
                             in_specs=spec, out_specs=(spec,) * len(eqn.outvars),
                             check_vma=False)(x)
        return list(outs)
    return run

