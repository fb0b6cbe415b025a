"""The backward of a pipelined layer split in two, for a schedule that defers the weights'
gradients (`soapjax.strategy.pipeline`'s ``"zb-h1"`` and ``"zb-interleaved"``): B, the
gradient of the layer's input, which the previous stage waits for, and W, the gradients of
its weights, which nothing waits for and the schedule runs later.

Each matmul of a layer that reads one of the layer's parameters (a *weight matmul*: a
``dot_general`` with a parameter slice for an operand, or its cast to the compute dtype)
runs as `deferred_dot`: its forward is the matmul; its backward returns the gradient of its
other operand and, for the weight, zero; and it hands on the two values the weight's
gradient is made of, the operand ``x`` and the output's cotangent ``dy``, as the cotangents
of two *stash* inputs the matmul takes and does not read (zeros of their shapes stacked
``[layers, ...]``, scanned with the layers; an operand several matmuls read is stashed by
the first alone). So ``jax.vjp`` of a chunk, run in the B action, computes everything of the
backward but the weights' matmul gradients, and returns the stash; the W action
(`weight_grads`) computes each weight's gradient from it: the same transpose of the same
matmul ``jax.vjp`` would have run, then the cast back to the parameter's dtype, summed over
the matmuls that read it. This is what zero-bubble implementations do with their linear
layers (Qi et al. 2024, section 3; Megatron-LM's ``--defer-embedding-wgrad-compute`` and the
like keep ``x`` and ``dy`` for later the same way). Values are the unsplit backward's to
rounding: the same products, added in another order (float64 tests:
tests/test__pipelined.py, tests/test_apply_pipelined.py).

What a pending W holds is its stash: per weight matmul of each of the chunk's layers, its
operand (once for the matmuls that read the same one: attention's q, k and v) and its
output's cotangent (`stash_shapes`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from soapjax.graph._program import LayerScan, Program, bind_as_traced

__all__ = ["DEFERRED_NAME", "WeightMatmul", "deferred_dot", "stash_of", "stash_shapes",
           "weight_grads", "weight_matmuls"]

# The name a weight matmul's output carries, so a selectively recomputed layer saves it as
# it saves the matmuls' outputs (`soapjax.apply._pipelined._chunk_fn`).
DEFERRED_NAME = "soapjax_deferred_dot"


class WeightMatmul(NamedTuple):
    """One weight matmul of the layer program (`weight_matmuls`).

    Attributes:
      unit: its unit in the program.
      weight: which operand (0 or 1) is the weight.
      param: the position of the weight's parameter in the layer's slices
        (`LayerScan.slices`), the chunk's parameter list.
      cast: the parameter's dtype where the matmul reads it cast (bf16 compute over float32
        parameters), else None.
      stash_x: the index into the stash (`stash_shapes`) of its other operand, which an
        earlier weight matmul reading the same value (attention's q, k and v) stashes once for
        all of them, and `stash_dy` of its output's cotangent.
      own_x: whether this matmul stashes its operand (the first to read it), else it reads
        the earlier one's.
    """

    unit: int
    weight: int
    param: int
    cast: Any = None
    stash_x: int = 0
    stash_dy: int = 1
    own_x: bool = True


def weight_matmuls(program: Program, scan: LayerScan, layer: Sequence[int]
                   ) -> tuple[WeightMatmul, ...]:
    """The layer's weight matmuls: each ``dot_general`` among units `layer` whose one operand
    is a parameter slice of layer 0 (or a ``convert_element_type`` of one) and whose other
    is a float value that is none."""
    slices = {v: k for k, v in enumerate(scan.slices[0])}
    maker = {o: i for i in layer for o in program.units[i].outs if o is not None}
    inexact = functools.partial(_is_inexact, program)
    out = []
    stashed: dict[int, int] = {}  # operand value id -> its stash index
    size = 0
    for i in layer:
        unit = program.units[i]
        if unit.eqn.primitive.name != "dot_general" or len(unit.ins) != 2:
            continue
        found = [_param_of(program, maker, slices, v) for v in unit.ins]
        if sum(f is not None for f in found) != 1 or not all(map(inexact, unit.ins)):
            continue
        weight = 0 if found[0] is not None else 1
        param, cast = found[weight]
        x = unit.ins[1 - weight]
        own = x not in stashed
        if own:
            stashed[x], size = size, size + 1
        out.append(WeightMatmul(i, weight, param, cast, stashed[x], size, own))
        size += 1
    return tuple(out)


def _is_inexact(program: Program, v: int) -> bool:
    return bool(jnp.issubdtype(program.jax_dtypes[v], jnp.inexact))


def _param_of(program: Program, maker: dict[int, int], slices: dict[int, int], v: int
              ) -> tuple[int, Any] | None:
    """``(slice position, cast from dtype or None)`` where `v` is a parameter slice or its
    cast, else None."""
    if v in slices:
        return slices[v], None
    i = maker.get(v)
    if i is None:
        return None
    unit = program.units[i]
    if unit.eqn.primitive.name == "convert_element_type" and unit.ins[0] in slices:
        return slices[unit.ins[0]], program.jax_dtypes[unit.ins[0]]
    return None


def stash_shapes(program: Program, matmuls: Sequence[WeightMatmul]
                 ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of one layer's stash, in the matmuls' order: each weight matmul's other
    operand (where it is the first to read it: `WeightMatmul.own_x`), then its output (the
    cotangent's)."""
    out = []
    for m in matmuls:
        unit = program.units[m.unit]
        for v in (unit.ins[1 - m.weight],) * m.own_x + (unit.outs[0],):
            out.append(jax.ShapeDtypeStruct(program.shapes[v], program.jax_dtypes[v]))
    return tuple(out)


def stash_of(m: WeightMatmul, stash: Sequence[Any]) -> list[Any]:
    """What weight matmul `m` takes of a layer's `stash`: its operand's entry (where it owns
    it) and its cotangent's."""
    return [stash[m.stash_x]] * m.own_x + [stash[m.stash_dy]]


def _bind(eqn: Any, weight: int, x: Any, w: Any) -> Any:
    return bind_as_traced(eqn, [w, x] if weight == 0 else [x, w])[0]


def deferred_dot(eqn: Any, weight: int, hold_x: Callable[[Any], Any] | None = None,
                 hold_dy: Callable[[Any], Any] | None = None, own_x: bool = True,
                 keep_x: Callable[[Any], Any] | None = None,
                 keep_dy: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
    """``(x, w, stash_x, stash_dy) -> y`` (without ``stash_x`` where not `own_x`: an earlier
    matmul stashes the same operand): the matmul `eqn` (its weight operand at `weight`),
    whose backward gives ``x`` its gradient, ``w`` zero, and the stash inputs ``x`` and the
    output's cotangent (module doc). `hold_x`, `hold_dy`: applied to ``x`` and to the
    cotangent before they are used (a stage holds them in the layouts the matmul reads and
    makes them in: under sequence parallelism gathered, as the unsplit backward uses them).

    `keep_x`, `keep_dy`: where given, the stash takes the value these hold instead, a
    smaller layout than the matmul's (a *lean* stash, which W gathers again: under sequence
    parallelism the operand split along the sequence, as the stage held it before the
    matmul gathered it, and a row-parallel matmul's cotangent as its reduce-scatter
    handed it back). With `keep_x` the function takes ``(x, w, raw, *stash)``: ``raw`` is
    the operand before the caller gathered it (what is stashed, and what the backward
    saves in place of ``x``, which it does not need); its gradient is zero (``x``'s carries
    the whole)."""
    lean = keep_x is not None

    @jax.custom_vjp
    def dot(x, w, *rest):
        return _bind(eqn, weight, x, w)

    def forward(x, w, *rest):
        return _bind(eqn, weight, x, w), ((rest[0] if lean else x), w)

    def backward(saved, dy):
        kept, w = saved  # the operand (lean: as the caller held it before gathering) and w
        dy_kept = None if keep_dy is None else keep_dy(dy)  # before the matmul's layout
        dy = dy if hold_dy is None else hold_dy(dy)
        dy_kept = dy if dy_kept is None else dy_kept
        if lean:
            dx = _operand_grad(eqn, weight, w, dy)
            return (dx, jnp.zeros_like(w), jnp.zeros_like(kept), *(keep_x(kept),) * own_x,
                    dy_kept)
        (dx,) = jax.vjp(lambda a: _bind(eqn, weight, a, w), kept)[1](dy)
        stash_x = (kept if hold_x is None else hold_x(kept),) * own_x
        return (dx, jnp.zeros_like(w), *stash_x, dy_kept)

    dot.defvjp(forward, backward)
    return dot


def _operand_grad(eqn: Any, weight: int, w: Any, dy: Any) -> Any:
    """The gradient of the matmul's other operand from its output's cotangent `dy` (the
    transpose ``jax.vjp`` runs; it reads the operand's shape only)."""
    x = eqn.invars[1 - weight].aval
    like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.linear_transpose(lambda a: _bind(eqn, weight, a, w), like)(dy)[0]


def weight_grads(program: Program, matmuls: Sequence[WeightMatmul], params: Sequence[Any],
                 stash: Sequence[Any]) -> list[Any | None]:
    """The gradients of the chunk's `params` (``[layers, ...]`` each) from its `stash` (the
    weight matmuls' ``x`` and ``dy`` stacked over the layers: `stash_shapes`): each matmul's
    transpose for its weight, per layer, cast back to the parameter's dtype, summed per
    parameter; None for parameters no weight matmul reads."""
    grads: list[Any] = [None] * len(params)
    for m in matmuls:
        eqn = program.units[m.unit].eqn
        xs, dys = stash[m.stash_x], stash[m.stash_dy]
        w = params[m.param]
        w = w if m.cast is None else w.astype(program.jax_dtypes[program.units[m.unit]
                                                                 .ins[m.weight]])

        def one(x, dy, w_, eqn=eqn, weight=m.weight):
            return jax.vjp(lambda a: _bind(eqn, weight, x, a), w_)[1](dy)[0]

        d = jax.vmap(one)(xs, dys, w)
        d = d if m.cast is None else d.astype(m.cast)
        grads[m.param] = d if grads[m.param] is None else grads[m.param] + d
    return grads
