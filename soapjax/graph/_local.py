"""The per-device program of one operator at a shard shape.

When a config splits an operator's iteration dims by some degrees, each device runs the same
equations on smaller operands. Shapes are baked into a jaxpr (`broadcast_in_dim`'s `shape`,
`reshape`'s `new_sizes`, `iota`, gather slice sizes), so the equations are re-bound with those
parameters rewritten from the operator's own dim labels: every value's shard shape is its
global shape with each dim that follows a split iteration dim divided by that dim's degree.
Nested bodies (scan, while, cond, remat2) are re-expressed with `jax.lax` control flow around
the same rewriting interpreter. This is what XLA's SPMD partitioner runs per device, without
the collectives; the cost stage times it, and apply computes replaceable operators with it.

Custom derivative rules (`custom_jvp_call`, `custom_vjp_call`) are never silently dropped. An
equation whose operands keep their traced shapes is bound as traced, rules and all (this is how
apply evaluates an operator whole, so a straight-through estimator keeps its identity gradient).
The rules were traced at the global shapes, so at shard shapes they cannot be re-bound: there
``rules="exact"`` (the default) raises `CustomRuleError`, and ``rules="primal"`` (the cost
stage: a kernel's time does not depend on which derivative rule differentiates it) runs the
primal body instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import jax
import numpy as np
from jax.extend import core as jcore

from soapjax.base.attention import attention_call, bind_attention
from soapjax.base.errors import SoapjaxError
from soapjax.graph._dims import scan_counts
from soapjax.graph._program import OperatorLabels, bind_as_traced
from soapjax.graph.opgraph import OpGraph

Rules = Literal["exact", "primal"]
CUSTOM_RULE_PRIMITIVES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
                          "custom_lin", "custom_transpose_call")


class CustomRuleError(SoapjaxError, ValueError):
    """A custom derivative rule would have to be re-traced at a shard shape."""


def operator_fn(graph: OpGraph, name: str, degrees: Sequence[int] | None = None, *,
                rules: Rules = "exact", on_value: Callable | None = None,
                attention: Callable | None = None,
                calls: Mapping[int, Callable[..., Sequence]] | None = None
                ) -> tuple[Callable, list[jax.ShapeDtypeStruct]]:
    """The per-device forward program of operator `name` split by `degrees`.

    Args:
      graph: the traced graph.
      name: the operator's name.
      degrees: one degree per iteration dim (`Operator.iteration_sizes`); None for unsplit.
        Each must divide its dim.
      rules: what to do with a custom derivative rule whose operands are split: ``"exact"``
        raises `CustomRuleError`; ``"primal"`` differentiates its primal body (for timing).
      on_value: ``on_value(value id, value) -> value``, called on every value the operator's
        own equations make (not those inside nested bodies) as it is made: apply constrains
        a row-parallel matmul's result there (`soapjax.apply._flatstep`).
      attention: ``attention(call, q, k, v, q_pos, k_pos) -> out`` computes each
        `soapjax.base.attention.flash_attention` equation (`soapjax.base.attention.AttentionCall`)
        instead (context parallelism: the positions of this device's queries, the keys
        gathered); by default it is bound again at the shard's shapes
        (`soapjax.base.attention.bind_attention`: its rule is soapjax's, so it is re-traceable).
      calls: program unit -> a function of that equation's operands that returns its results
        (a list), computing one of the operator's own equations instead (apply's top k over
        split rows: `soapjax.apply._manual`).

    Returns:
      ``(fn, in_avals)``: ``fn(*operands)`` returns the operator's outputs (a list, in
      `Operator.outputs` order) at shard shapes; `in_avals` are the shard-shaped operands in
      `Operator.inputs` order.

    Raises:
      ValueError: a degree that does not divide its dim.
      CustomRuleError: with ``rules="exact"``, when called, a custom derivative rule whose
        operands are split.
    """
    op = graph.operator(name)
    loc = graph.program.local[name]
    prog = graph.program
    sizes = op.iteration_sizes
    degrees = tuple(degrees) if degrees is not None else (1,) * len(sizes)
    if len(degrees) != len(sizes) or any(s % d for s, d in zip(sizes, degrees)):
        raise ValueError(f"degrees {degrees} do not divide the iteration dims {sizes} of "
                         f"operator {name!r}")

    def shard(vid: int) -> tuple[int, ...]:
        return loc.shard_shape(loc.lab[vid], prog.shapes[vid], degrees)

    in_avals = [jax.ShapeDtypeStruct(shard(v), prog.jax_dtypes[v]) for v in loc.inputs]
    interp = _Interp(loc, degrees, rules, name, attention)
    whole = _input_free(prog, loc)

    def fn(*operands):
        env = {}
        for vid in loc.lab:
            if vid in prog.literals:
                env[vid] = prog.literals[vid]
            elif vid in prog.consts:
                env[vid] = prog.consts[vid]
        env.update(zip(loc.inputs, operands))
        for i in loc.units:
            u = prog.units[i]
            if all(v in whole for v in u.outs if v is not None):
                # Built from iotas and constants alone (positions, a mask): computed whole on
                # every device, as XLA does; each reader takes the part it needs.
                shapes = [prog.shapes[v] if v is not None else None for v in u.outs]
                args = [env[v] for v in u.ins]
            else:
                shapes = [shard(v) if v is not None else None for v in u.outs]
                keep = u.eqn.primitive.name == "broadcast_in_dim"  # crops to its own target
                args = [env[v] if keep and v in whole else _crop(env[v], shard(v))
                        for v in u.ins]
            outs = calls[i](*args) if calls and i in calls else interp.bind(u.eqn, args, shapes)
            env.update((v, _crop(o, s)) for v, o, s in zip(u.outs, outs, shapes) if v is not None)
            if on_value is not None:
                env.update((v, on_value(v, env[v])) for v in u.outs if v is not None)
        return [_crop(env[v], shard(v)) for v in loc.exports]

    return fn, in_avals


def _input_free(prog, loc: OperatorLabels) -> set[int]:
    """Values of the operator that depend on none of its operands (iotas, constants). A
    constant that is an operand (read by several operators) arrives at its shard shape."""
    inputs = set(loc.inputs)
    free = {v for v in loc.lab if (v in prog.literals or v in prog.consts) and v not in inputs}
    for i in loc.units:
        u = prog.units[i]
        if all(v in free for v in u.ins) and not u.eqn.effects:
            free.update(v for v in u.outs if v is not None)
    return free


def _shape_of(x) -> tuple[int, ...]:
    """The shape of an operand, also of a jaxpr literal: jax 0.10 binds a scalar constant
    (``jnp.full(shape, 0.0)``'s fill value) as a `TypedFloat` or `TypedInt`, a Python number
    subclass with no ``.shape``."""
    return tuple(np.shape(x))


def _crop(x, shape):
    """Device 0's shard of a value computed larger than its shard (an iota-built mask)."""
    if shape is None or not hasattr(x, "shape") or tuple(x.shape) == tuple(shape):
        return x
    if len(x.shape) != len(shape) or any(s > h for s, h in zip(shape, x.shape)):
        return x
    return x[tuple(slice(0, s) for s in shape)]


class _Interp:
    """Binds equations at shard shapes, following the operator's labels into nested bodies."""

    def __init__(self, loc: OperatorLabels, degrees: Sequence[int], rules: Rules = "exact",
                 name: str = "", attention: Callable | None = None):
        self.loc = loc
        self.degrees = degrees
        self.rules = rules
        self.name = name
        self.attention = attention

    def var_shape(self, v) -> tuple[int, ...] | None:
        labels = self.loc.env.get(v)
        full = tuple(int(d) for d in getattr(v.aval, "shape", ()))
        return full if labels is None else self.loc.shard_shape(labels, full, self.degrees)

    def run(self, jaxpr: jcore.Jaxpr, consts: Sequence, args: Sequence) -> list:
        env = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = _crop(c, self.var_shape(v))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            shapes = [None if isinstance(v, jcore.DropVar) else self.var_shape(v)
                      for v in eqn.outvars]
            ins = [read(v) if isinstance(v, jcore.Literal) else _crop(read(v), self.var_shape(v))
                   for v in eqn.invars]
            outs = self.bind(eqn, ins, shapes)
            env.update((v, _crop(o, s)) for v, o, s in zip(eqn.outvars, outs, shapes)
                       if not isinstance(v, jcore.DropVar))
        return [read(v) for v in jaxpr.outvars]

    def bind(self, eqn, args: list, out_shapes: list) -> list:
        name = eqn.primitive.name
        p = eqn.params
        call = attention_call(eqn)
        if call is not None and not p.get("num_consts"):
            if self.attention is not None:
                return [self.attention(call, *args)]
            if _traced_shapes(eqn, args):
                return bind_as_traced(eqn, args)
            return [bind_attention(call, *args)]
        if name in CUSTOM_RULE_PRIMITIVES:
            if _traced_shapes(eqn, args):
                return bind_as_traced(eqn, args)
            if self.rules == "exact":
                raise CustomRuleError(
                    f"operator {self.name!r}: its {name} (a custom derivative rule) would run "
                    f"on operands of shapes {[tuple(getattr(a, 'shape', ())) for a in args]}, "
                    f"but its rule was traced for {[tuple(v.aval.shape) for v in eqn.invars]}; "
                    "soapjax cannot re-trace a rule at another shape, so this operator must be "
                    "computed whole")
            sub = p.get("call_jaxpr", p.get("fun_jaxpr"))
            return self.run(*_open(sub), args)
        if name in ("jit", "pjit", "closed_call", "core_call"):
            sub = p.get("jaxpr", p.get("call_jaxpr"))
            return self.run(*_open(sub), args)
        if name in ("remat2", "checkpoint"):
            body = p["jaxpr"]
            fn = jax.checkpoint(lambda *a: self.run(*_open(body), a),
                                prevent_cse=p["prevent_cse"], policy=p["policy"])
            return list(fn(*args))
        if name == "scan":
            return self._scan(p, args)
        if name == "while":
            cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
            cn, bn = p["cond_nconsts"], p["body_nconsts"]
            cc, bc, carry = args[:cn], args[cn:cn + bn], args[cn + bn:]
            out = jax.lax.while_loop(lambda c: self.run(*_open(cj), [*cc, *c])[0],
                                     lambda c: tuple(self.run(*_open(bj), [*bc, *c])),
                                     tuple(carry))
            return list(out)
        if name == "cond":
            branches = [lambda *ops, b=b: tuple(self.run(*_open(b), ops)) for b in p["branches"]]
            return list(jax.lax.switch(args[0], branches, *args[1:]))
        params = dict(eqn.primitive.get_bind_params(p))
        _rewrite(eqn, name, params, args, out_shapes)
        with eqn.ctx.manager:
            ans = eqn.primitive.bind(*args, **params)
        return list(ans) if eqn.primitive.multiple_results else [ans]

    def _scan(self, p, args):
        body = p["jaxpr"]
        nc, nk = scan_counts(p)
        consts, carry, xs = args[:nc], args[nc:nc + nk], args[nc + nk:]

        def step(c, x):
            outs = self.run(*_open(body), [*consts, *c, *x])
            return tuple(outs[:nk]), tuple(outs[nk:])

        c, ys = jax.lax.scan(step, tuple(carry), tuple(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
        return [*c, *ys]


def _traced_shapes(eqn, args: Sequence) -> bool:
    """Whether every operand has the shape the equation was traced with."""
    return all(tuple(getattr(a, "shape", ())) == tuple(getattr(v.aval, "shape", ()))
               for a, v in zip(args, eqn.invars))


def has_custom_rules(graph: OpGraph, name: str) -> bool:
    """Whether operator `name` holds a custom derivative rule (at any depth)."""
    return _holds(graph, name, lambda prim: prim in CUSTOM_RULE_PRIMITIVES)


def draws_random_bits(graph: OpGraph, name: str) -> bool:
    """Whether operator `name` draws random bits (dropout), at any depth: its values depend on
    the shape it draws them at, so it must run at its traced shapes to compute the same."""
    return _holds(graph, name, lambda prim: prim in RANDOM_PRIMITIVES)


RANDOM_PRIMITIVES = frozenset({"random_bits", "random_split", "random_fold_in", "threefry2x32",
                               "rng_bit_generator", "rng_uniform"})


def _holds(graph: OpGraph, name: str, wanted: Callable[[str], bool]) -> bool:
    prog = graph.program
    return any(_holds_eqn(prog.units[i].eqn, wanted) for i in prog.local[name].units)


def _holds_eqn(eqn, wanted: Callable[[str], bool]) -> bool:
    if wanted(eqn.primitive.name):
        return True
    return any(_holds_eqn(e, wanted) for sub in jcore.jaxprs_in_params(eqn.params)
               for e in sub.eqns)


def _open(sub) -> tuple[jcore.Jaxpr, Sequence]:
    return (sub.jaxpr, sub.consts) if isinstance(sub, jcore.ClosedJaxpr) else (sub, ())


def _rewrite(eqn, name: str, params: dict, args: list, out_shapes: list) -> None:
    """Rewrites the shape parameters of one equation for shard-shaped operands."""
    out = out_shapes[0] if out_shapes else None
    if name == "broadcast_in_dim":
        params["shape"] = out
        # An operand built whole from iotas (an attention mask) broadcast into a split value:
        # device 0's part of it.
        want = tuple(out[b] for b in params["broadcast_dimensions"])
        have = _shape_of(args[0])
        if any(h != 1 and h != w for h, w in zip(have, want)):
            args[0] = _crop(args[0], tuple(h if h == 1 else min(h, w) for h, w in zip(have, want)))
    elif name == "reshape":
        # ``lax.reshape(x, sizes, dimensions)`` reads `x` transposed by `dimensions` first
        # (vmap's batching rules for a convolution with batched weights emit it): transpose
        # the shard, then reshape it to the shard's result.
        if params.get("dimensions") is not None:
            args[0] = jax.lax.transpose(args[0], tuple(params["dimensions"]))
        params["new_sizes"] = out
        params["dimensions"] = None
    elif name in ("iota", "random_bits", "rng_uniform") and "shape" in params:
        params["shape"] = out
    elif name in ("gather", "dynamic_slice"):
        full = params["slice_sizes"]
        operand = args[0]
        params["slice_sizes"] = tuple(min(s, _shape_of(operand)[d]) for d, s in enumerate(full))
    elif name == "slice":
        # A slice of a split dim takes the same fraction of the shard (an LSTM's gates), with
        # its stride (`jax.lax.associative_scan`'s even and odd elements); a dim not split
        # keeps its traced bounds.
        have, full = _shape_of(args[0]), eqn.invars[0].aval.shape
        strides = params.get("strides") or (1,) * len(have)
        starts = tuple(s * h // f for s, h, f in zip(params["start_indices"], have, full))
        params["start_indices"] = starts
        params["limit_indices"] = tuple(s + (o - 1) * k + 1 if o else s
                                        for s, o, k in zip(starts, out, strides))
    elif name == "conv_general_dilated" and params["feature_group_count"] > 1:
        # A grouped (depthwise) convolution split over channels holds whole groups
        # (`soapjax.graph._dims`): as many fewer groups as it has fewer input channels.
        channel = params["dimension_numbers"].lhs_spec[1]
        have, full = _shape_of(args[0])[channel], eqn.invars[0].aval.shape[channel]
        params["feature_group_count"] = params["feature_group_count"] * have // full
    elif name == "top_k":
        # the rows' dim a config splits (the batch a hard-example loss takes its top k of):
        # a shard takes at most its own length (XLA gathers the rows first; priced locally,
        # as a sort along a split dim is)
        params["k"] = min(params["k"], _shape_of(args[0])[params.get("axis", -1)])
    elif name == "split":
        total = sum(params["sizes"])
        have = _shape_of(args[0])[params["axis"]]
        if have != total and all(s * have % total == 0 for s in params["sizes"]):
            params["sizes"] = tuple(s * have // total for s in params["sizes"])
