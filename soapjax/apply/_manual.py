"""Apply for equations XLA's partitioner gets wrong or runs whole: apply runs them in
`jax.shard_map` itself, each device on its own shard, as the simulator prices them.

**A top k over rows a config splits.** ``jax.lax.top_k`` takes the k largest along the last dim
of every row, so a device holding some rows can take their top k itself. XLA's SPMD
partitioner does not: its ``TopK`` custom call gathers the operand whole and runs on every row
on every device (XLA:CPU, docs/xla-workarounds.md; an MoE router's probabilities ``[B, T, E]``,
batch split over 8 devices, are all-gathered before the top k). The simulator prices the rows split
(`soapjax.graph._dims`: top_k's leading dims pass through). So each such equation runs with its
operand's rows split as the operator's config splits them, its last dim whole; nothing is
gathered, the results are the same (a row's top k is computed where the row is).

**A convolution.** XLA's SPMD partitioner (Shardy and GSPMD alike; docs/xla-workarounds.md) computes
the kernel gradient of a convolution wrongly under some shardings, silently, while the loss is exact
(`tests/test_exactness.py` keeps both as tests): a grouped or depthwise one
(``feature_group_count > 1``) whose input's batch is split over some mesh axes and replicated
over others gets its kernel gradient multiplied by the replicated axes' size (``P('data')`` on
a ``data=2, model=4`` mesh: 4x; ``P('model')``: 2x); and in a ResNet-18 whose later layers
were split batch over one axis and channels over the others, an earlier, unsplit convolution's
kernel gradient came out 2.6x its own scale off (found by the randomized suite,
`scripts/fuzz_exactness.py`). Run in `jax.shard_map` the same shards give the exact gradient.
So apply runs every convolution there: its input, kernel and output split as the operator's
config splits their dims (a grouped one's channels in whole groups, `soapjax.graph._dims`; each
device convolving its channels' groups, ``feature_group_count`` divided by the channels'
split), its input channels' partial sums reduced by a ``psum`` over the axes that split them.
A convolution split spatially (plans refuse those unless told otherwise) is left to XLA, which
exchanges the halo.

    >>> import jax, jax.numpy as jnp
    >>> from soapjax.graph.opgraph import trace
    >>> from soapjax.strategy.space import Config
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

from soapjax.graph._inner import convolutions, halo_split
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy.space import Config

__all__ = ["conv_units", "manual_calls", "split_top_k_units"]


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


def conv_units(graph: OpGraph, j: int, cfg: Config
               ) -> dict[int, tuple[PartitionSpec, PartitionSpec, PartitionSpec, tuple[str, ...]]]:
    """Operator `j`'s convolutions under `cfg`: program unit -> the specs of its input, kernel
    and output, and the mesh axes its partial sums are reduced over (its input channels'
    split). A convolution `cfg` splits spatially with a halo to exchange is left to XLA (plans
    refuse those: `soapjax.strategy.space.spatial_convolution`); one split at the edges of
    windows that do not overlap (a patch embedding's frames or rows) runs here like any other;
    one built from constants alone is computed whole, as XLA does (module doc)."""
    out: dict[int, tuple[PartitionSpec, PartitionSpec, PartitionSpec, tuple[str, ...]]] = {}
    sizes = graph.operators[j].iteration_sizes
    for conv in convolutions(graph, j):
        if halo_split(conv, cfg.axes, sizes) is not None:
            continue  # split spatially: XLA exchanges the halo
        lhs, rhs, res = (_axes_of(cfg, dims) for dims in (conv.lhs, conv.rhs, conv.out))
        dn = conv.eqn.params["dimension_numbers"]
        reduced = tuple(a for a in lhs[dn.lhs_spec[1]] if a not in res[dn.out_spec[1]])
        out[conv.unit] = (_spec(lhs), _spec(rhs), _spec(res), reduced)
    return out


def manual_calls(graph: OpGraph, configs: Sequence[Config], mesh: Mesh
                 ) -> dict[int, Callable[..., list]]:
    """Program unit -> its computation, for `OpGraph.evaluate`'s and
    `soapjax.graph._local.operator_fn`'s ``calls``: each ``top_k`` equation whose rows its
    operator's config splits, and each convolution, run in `jax.shard_map` (module doc)."""
    calls: dict[int, Callable[..., list]] = {}
    for j, cfg in enumerate(configs):
        for i, spec in split_top_k_units(graph, j, cfg).items():
            calls[i] = _local(graph.program.units[i].eqn, spec, mesh)
        for i, specs in conv_units(graph, j, cfg).items():
            calls[i] = _conv(graph.program.units[i].eqn, *specs, mesh)
    return calls


def _axes_of(cfg: Config, dims: tuple[int | None, ...]) -> list[tuple[str, ...]]:
    return [tuple(cfg.axes[d]) if d is not None else () for d in dims]


def _spec(axes: Sequence[tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*((a[0] if len(a) == 1 else a) if a else None for a in axes))


def _conv(eqn, lhs: PartitionSpec, rhs: PartitionSpec, out: PartitionSpec,
          reduced: tuple[str, ...], mesh: Mesh) -> Callable[..., list]:
    channel = eqn.params["dimension_numbers"].lhs_spec[1]
    full = eqn.invars[0].aval.shape[channel]

    p = eqn.params

    def local(x, w):
        # `jax.lax.conv_general_dilated`, not the primitive's bind: it casts a kernel replicated
        # over the batch's axes to varying, whose transpose sums its cotangent over them
        y = jax.lax.conv_general_dilated(
            x, w, p["window_strides"], p["padding"], p["lhs_dilation"], p["rhs_dilation"],
            p["dimension_numbers"],
            # whole groups per device (`soapjax.graph._dims`)
            feature_group_count=max(1, p["feature_group_count"] * x.shape[channel] // full),
            batch_group_count=p["batch_group_count"], precision=p["precision"],
            preferred_element_type=p["preferred_element_type"])
        return jax.lax.psum(y, reduced) if reduced else y  # the input channels' partial sums

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

