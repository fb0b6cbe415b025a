"""The model's own remat regions (`jax.checkpoint`, `nn.remat`, `nnx.remat`, a scan's
``remat``): which operators they recompute in the backward, and which outputs a recomputation
needs again.

Apply evaluates the model's regions under `jax.checkpoint` with their traced policy
(`soapjax.graph._program.Program`), so XLA recomputes their forward in the backward, with the
collectives inside (``rematted_computation`` in the compiled HLO). The simulator and the FLOP
count treat an operator `remat_recomputes` names as recomputing, as a plan's ``"full"``
recomputation would (`soapjax.strategy.memory.recomputes`), with two differences measured
against XLA (docs/checks.md, "A model's own remat regions"): a parameter gathered outside the
region is not gathered again, and partial sums are all-reduced again only where
`remat_rereads` says the region's backward reads the output.

    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> from soapjax.graph.opgraph import trace
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(8, name="fc2")(nn.gelu(nn.Dense(8, name="fc1")(x)))
    >>> class Net(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(8, name="head")(nn.remat(Block)(name="b")(x))
    >>> x = jnp.ones((4, 8))
    >>> params = Net().init(jax.random.key(0), x)
    >>> g = trace(lambda p, x: jnp.mean(Net().apply(p, x) ** 2), params, x)
    >>> [(op.name, remat_recomputes(g, j), remat_rereads(g, j))
    ...  for j, op in enumerate(g.operators) if op.name != g.name]
    [('b/fc1', True, True), ('b/fc2', True, False), ('head', False, False)]
"""

from __future__ import annotations

from soapjax.graph.opgraph import OpGraph


def remat_recomputes(graph: OpGraph, j: int) -> bool:
    """Whether operator `j`'s forward runs again in the backward because the model itself
    wraps it in a remat region whose policy keeps none of its outputs: every equation of it
    inside such a region. Policies that save nothing (the default) keep none;
    ``everything_saveable`` keeps all; the dot policies (``dots_saveable``,
    ``dots_with_no_batch_dims_saveable``) keep a matmul's result, so an operator built around
    a matmul is counted as kept (its elementwise tail, recomputed, is not counted), but for an
    attention core's matmuls of two activations under ``dots_with_no_batch_dims_saveable``.
    Other policies (names saved by ``checkpoint_name``, offloading) are counted as saving
    nothing."""
    return graph.memo(("remat_recomputes", j), lambda: _recomputes(graph, j))


def remat_rereads(graph: OpGraph, j: int) -> bool:
    """Whether the recomputation of a `remat_recomputes` operator `j` in the backward needs
    its first output again: another operator in the same remat region (one call of it: each
    layer of a scan its own) reads it, and recomputes with it. XLA computes again only what a
    backward inside the region reads: a matmul whose output leaves the region (the layer's
    last projection, summed into the residual stream the next layer reads) is not run again,
    nor the all-reduce of its partial sums."""
    return graph.memo(("remat_rereads", j), lambda: _rereads(graph, j))


def _rereads(graph: OpGraph, j: int) -> bool:
    region = _region_of(graph, j)
    if region is None or not remat_recomputes(graph, j):
        return False
    name = graph.operators[j].name
    return any(_region_of(graph, r) == region and remat_recomputes(graph, r)
               for r, op in enumerate(graph.operators) if r != j and any(
                   x.kind == "activation" and x.source == name and x.index == 0
                   for x in op.inputs))


def _units(graph: OpGraph, j: int) -> tuple[int, ...]:
    local = graph.program.local.get(graph.operators[j].name)
    return tuple(local.units) if local is not None else ()


def _region_of(graph: OpGraph, j: int) -> int | None:
    """The innermost remat region all of operator `j`'s equations lie in, if one."""
    units = graph.program.units
    regions = {units[u].region[-1] if units[u].region else None for u in _units(graph, j)}
    return regions.pop() if len(regions) == 1 else None


def _recomputes(graph: OpGraph, j: int) -> bool:
    prog = graph.program
    op = graph.operators[j]
    units = _units(graph, j)
    if not units or not all(prog.units[u].region for u in units):
        return False
    matmul = op.anchor == "dot_general"
    batched = matmul and sum(x.kind == "activation" for x in op.inputs) > 1  # attention's
    for u in units:
        policy = prog.regions[prog.units[u].region[-1]].get("policy")
        if policy is None:
            continue  # nothing saved
        name = getattr(policy, "__name__", None) or type(policy).__name__
        if name == "everything_saveable":
            return False
        if name in ("DotsSaveable", "dots_saveable", "checkpoint_dots") and matmul and not (
                batched and getattr(policy, "only_if_no_batch_dims", False)):
            return False
    return True
