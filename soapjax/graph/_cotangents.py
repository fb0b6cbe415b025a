"""Which values of the traced program the backward pass differentiates, and which operators
therefore have a backward at all.

``jax.grad`` of the loss with respect to the parameters computes a cotangent for a value only
where both hold: the value depends on a trained parameter through floating-point values (not
through ``stop_gradient``, not through a comparison's booleans or an argmax's indices), and the
loss depends on it through floating-point values not cut by ``stop_gradient``. A parameter the
optimizer freezes (`OpGraph.frozen`: ``optax.set_to_zero`` under ``optax.multi_transform``) is
not trained: the step's optimizer never reads its gradient, so XLA computes none. Everything
else is a constant to the backward pass, and XLA runs nothing for it: a BYOL target network
applied under ``stop_gradient`` (its parameters' gradients are zeros XLA makes, without
collectives), the batch's augmentation, an aux metric the loss never reads, a LoRA's base
model below its first adapter. The simulator prices no backward task, no cotangent moves and
no gradient synchronisation for them, and the memory rule keeps nothing for their backward
(`soapjax.strategy.memory.residuals`).

Loops, custom derivatives and other equations with bodies are taken whole: every
floating-point operand of one whose outputs are differentiated counts as differentiated (a
custom VJP that ignores an operand is priced as if it read it).

    >>> import jax, jax.numpy as jnp
    >>> from soapjax.graph.opgraph import trace
    >>> def loss(p, x):  # a target network of two layers, the second one grouped into the loss
    ...     online = jnp.tanh(x @ p["online"])
    ...     target = jax.lax.stop_gradient(jnp.tanh(jnp.tanh(x @ p["t1"]) @ p["t2"]))
    ...     return jnp.mean(online * target)
    >>> w = jnp.ones((4, 4))
    >>> g = trace(loss, {"online": w, "t1": w, "t2": w}, jnp.ones((2, 4)))
    >>> [(op.name, has_backward(g, j)) for j, op in enumerate(g.operators)]
    [('dot_general', True), ('dot_general_1', False), ('loss', True)]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from soapjax.base._dtypes import is_float

if TYPE_CHECKING:
    from soapjax.graph.opgraph import OpGraph

__all__: list[str] = ["differentiated_operands", "differentiated_values", "has_backward",
                      "trained_values", "values_from_params"]


def trained_values(graph: OpGraph) -> frozenset[int]:
    """The program's values of the trained parameters: every parameter leaf and its layers'
    slices, but those `OpGraph.frozen` names."""
    def find() -> frozenset[int]:
        prog = graph.program
        if not graph.frozen:
            return frozenset(prog.param_like)
        paths = set(graph.frozen)
        frozen = {leaf.value for leaf in graph.params if leaf.path in paths}
        return frozenset(v for v in prog.param_like
                         if v not in frozen and prog.slice_of.get(v, (v,))[0] not in frozen)
    return graph.memo("trained_values", find)


def values_from_params(graph: OpGraph) -> frozenset[int]:
    """The program's float values computed from the trained parameters (`trained_values`),
    through float values and not through ``stop_gradient``: the ones a tangent reaches (a
    one-hot of an argmax, through a comparison's booleans, has none)."""
    def reach() -> frozenset[int]:
        prog = graph.program
        reached = set(trained_values(graph))
        for u in prog.units:
            if u.eqn.primitive.name != "stop_gradient" and reached.intersection(u.ins):
                reached.update(v for v in u.outs
                               if v is not None and is_float(prog.dtypes[v]))
        return frozenset(reached)
    return graph.memo("values_from_params", reach)


def differentiated_values(graph: OpGraph) -> frozenset[int]:
    """The values the backward pass computes a cotangent of: from the parameters
    (`values_from_params`) and read by the loss (the program's first output) through float
    values not cut by ``stop_gradient``."""
    def reach() -> frozenset[int]:
        prog = graph.program
        needed = {prog.outputs[0]}
        for u in reversed(prog.units):
            if u.eqn.primitive.name == "stop_gradient" or not needed.intersection(u.outs):
                continue
            needed.update(v for v in u.ins if v is not None and is_float(prog.dtypes[v]))
        return frozenset(needed & values_from_params(graph))
    return graph.memo("differentiated_values", reach)


def has_backward(graph: OpGraph, j: int) -> bool:
    """Whether operator `j` runs a backward: one of its outputs is differentiated (else its
    operands get no cotangent from it and its parameters no gradient)."""
    diff = differentiated_values(graph)
    return any(t.value in diff for t in graph.operators[j].outputs)


def differentiated_operands(graph: OpGraph, j: int) -> tuple[bool, ...]:
    """Per operand of operator `j`, whether its backward computes the operand's cotangent:
    the operand is differentiated and one of the operator's differentiated outputs reads it
    through float values not cut by ``stop_gradient`` (a loss reading a target network's
    projection under ``stop_gradient`` sends no cotangent back to it)."""
    def find() -> tuple[bool, ...]:
        op, prog = graph.operators[j], graph.program
        diff = differentiated_values(graph)
        loc = prog.local.get(op.name)
        if not has_backward(graph, j):
            return (False,) * len(op.inputs)
        if loc is None:
            return tuple(x.value in diff for x in op.inputs)
        needed = {t.value for t in op.outputs if t.value in diff}
        for i in reversed(loc.units):
            u = prog.units[i]
            if u.eqn.primitive.name == "stop_gradient" or not needed.intersection(u.outs):
                continue
            needed.update(v for v in u.ins if v is not None and is_float(prog.dtypes[v]))
        # by the operator's own reads (`loc.inputs`, in operand order): a folded stage's graph
        # rewires an operand to another layer's value (`soapjax.simulate._pipe_fold`)
        return tuple(v in diff and v in needed for v in loc.inputs)
    return graph.memo(("differentiated_operands", j), find)
