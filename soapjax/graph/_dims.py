"""Dimension labels through a jaxpr: which dims of which values must be split alike.

Every dim of every value gets an integer *label*. Equations relate labels: an elementwise add
makes the dims of its operands and its result the same label (splitting one splits the others
for free); a slice, a concatenation or a pooling window keeps its dim's label at another extent
(each device takes its fraction); a matmul's contracting dims become the same label and are
*reduced* by it; a reshape
that merges `(B, T) -> (B*T,)` *derives* the merged label from its major part `B` (splitting the
merged dim by a degree that divides `B` is splitting `B`). The graph stage runs this engine once
over the whole forward pass, to learn the role of every dim (sample, parameter, attribute), and
once inside every operator, to learn how each operand dim lines up with the operator's own dims.

Nested jaxprs (`jit`, `custom_jvp_call`, `custom_vjp_call`, `remat2`, `scan`, `while`, `cond`,
`closed_call`) are followed into their bodies; a scan's iteration axis is marked *sequential*,
since no SPMD program can split it.

The same pass counts forward FLOPs per equation (a multiply-add is 2 FLOPs; elementwise and
reduction work 1 per element; a scan body counts `length` times): `Operator.flops`, what the
analytic costs price. `xla_flops` counts any jaxpr as XLA's cost analysis counts the HLO it
lowers to (transcendentals apart, casts and selects counted, folded constants free): what
`soapjax check` holds against the compiled step.

One module past ~600 lines, on purpose: the dim rules and both FLOP counts are one table of
the same primitives, walked the same way into nested jaxprs (`xla_flops` falls back to the
rules' per-equation count for what XLA prices alike).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from jax.extend import core as jcore

from soapjax.base.attention import analysis_jaxpr, attention_call

Labels = tuple[int, ...]

# Primitives whose only effect on labels is to pass them through unchanged, dim for dim.
# Anything unlisted and not handled below falls back to the same rule (dims of equal size at
# equal positions in same-rank operands and results are unified), which is right for every
# shape-preserving primitive and harmless for the rest.
_HIGHER_ORDER = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                 "custom_vjp_call_jaxpr", "remat2", "checkpoint", "scan", "while", "cond"}


class LabelSet:
    """A union-find over dim labels, with sizes, derivations and marks.

    Marks are the facts the roles are computed from: `"S"` for the sample dim of a batch input,
    `"P"` for a parameter dim, `"seq"` for a scan's iteration axis.
    """

    def __init__(self) -> None:
        self._parent: list[int] = []
        self.size: list[int] = []
        self._marks: dict[int, set[str]] = {}
        self.derived_from: dict[int, int] = {}
        # A dim a reshape splits into several, `(B, T, H*D) -> (B, T, H, D)`: the split dims,
        # major first. Splitting H by h and D by d splits H*D by h*d (`LabelSet.parts_of`).
        self.parts: dict[int, tuple[int, ...]] = {}
        # The reverse: dims a reshape merges into one, `(B, T, H, D) -> (B, T, H*D)`.
        self.merged: dict[int, tuple[int, ...]] = {}
        self._root_marks: dict[int, set[str]] | None = None
        self._root_derived: dict[int, int] | None = None
        self.weak: set[int] = set()
        # label -> a size every split of its class must divide (`LabelSet.grain`)
        self.grains: dict[int, int] = {}

    def fresh(self, size: int, *, weak: bool = False) -> int:
        """A new label; a *weak* one (an iota's) never joins another.

        One `arange(T)` broadcast into both dims of a causal mask would otherwise make the
        query and key sequence dims one label.
        """
        self._parent.append(len(self._parent))
        self.size.append(int(size))
        if weak:
            self.weak.add(len(self._parent) - 1)
        return len(self._parent) - 1

    def fresh_many(self, shape: Sequence[int], *, weak: bool = False) -> Labels:
        return tuple(self.fresh(s, weak=weak) for s in shape)

    def find(self, a: int) -> int:
        root = a
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[a] != root:  # path compression
            self._parent[a], a = root, self._parent[a]
        return root

    def union(self, a: int, b: int) -> None:
        """Makes `a` and `b` one label: they are split together.

        Labels of one class may differ in extent: a slice, pad or window of a dim splits with
        it (each device takes its fraction). Dims of size 1 are never joined.
        """
        if self.size[a] <= 1 or self.size[b] <= 1 or a in self.weak or b in self.weak:
            return
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self._parent[max(ra, rb)] = min(ra, rb)
            self._root_marks = None
            self._root_derived = None

    def link(self, a: int, out: int) -> None:
        """Relates operand dim `a` to result dim `out`: one label, or, for a weak `a`, `a`
        split whenever `out` is (a mask or index array is cut as what it is applied to)."""
        if a in self.weak:
            self.derive(a, out)
        else:
            self.union(a, out)

    def derive(self, new: int, src: int) -> None:
        """Records that `new` (a merged or strided dim) is split whenever `src` is."""
        if new != src and self.size[new] > 1 and self.size[src] > 1:
            self.derived_from.setdefault(new, src)
            self._root_derived = None

    def source(self, a: int) -> int | None:
        """The label `a`'s class derives from, if any (recorded on any member of the class:
        a later union may make another label the class's root)."""
        if a in self.derived_from:
            return self.derived_from[a]
        if self._root_derived is None:
            self._root_derived = {}
            for new, src in self.derived_from.items():
                self._root_derived.setdefault(self.find(new), src)
        return self._root_derived.get(self.find(a))

    def grain(self, a: int, size: int) -> None:
        """Records that a split of `a`'s class must divide `size` (a grouped convolution's
        channels split into whole groups; 1: never split)."""
        self.grains[a] = math.gcd(self.grains.get(a, size), size)

    def split_into(self, whole: int, parts: Sequence[int]) -> None:
        """Records that a reshape splits dim `whole` into dims `parts` (major first)."""
        parts = tuple(p for p in parts if self.size[p] > 1)
        if len(parts) > 1 or (parts and parts[0] != whole):
            self.parts.setdefault(whole, parts)

    def merge_into(self, whole: int, parts: Sequence[int]) -> None:
        """Records that a reshape merges dims `parts` (major first) into dim `whole`."""
        parts = tuple(p for p in parts if self.size[p] > 1)
        if len(parts) > 1:
            self.merged.setdefault(whole, parts)

    def merged_into(self, a: int) -> list[tuple[int, tuple[int, ...]]]:
        """The ``(whole, parts)`` merges whose parts include `a`'s class."""
        r = self.find(a)
        return [(w, ps) for w, ps in self.merged.items() if any(self.find(p) == r for p in ps)]

    def parts_of(self, a: int) -> tuple[int, ...]:
        """The dims a reshape split `a` into, looked up on `a` and on its class's root."""
        got = self.parts.get(a)
        if got is None:
            r = self.find(a)
            got = next((p for lbl, p in self.parts.items() if self.find(lbl) == r), ())
        return got

    def mark(self, a: int, what: str) -> None:
        self._marks.setdefault(a, set()).add(what)
        self._root_marks = None

    def marks(self, a: int) -> set[str]:
        """Every mark on `a`'s class, following derivations when the class has none.

        Call after all unions: the marks per class are gathered once and cached.
        """
        if self._root_marks is None:
            self._root_marks = {}
            for lbl, ms in self._marks.items():
                self._root_marks.setdefault(self.find(lbl), set()).update(ms)
        out = set(self._root_marks.get(self.find(a), ()))
        seen = {self.find(a)}
        while not out - {"seq"} and (src := self.source(a)) is not None \
                and self.find(src) not in seen:  # derivations can form a cycle of classes
            seen.add(self.find(src))
            out |= set(self._root_marks.get(self.find(src), ())) - {"seq"}
            a = src
        return out

    def chain(self, a: int) -> list[int]:
        """`a`'s class, then the classes it derives from (a merged or strided dim's sources)."""
        out: list[int] = []
        while True:
            r = self.find(a)
            if r in out:
                return out
            out.append(r)
            nxt = self.source(a)
            if nxt is None:
                return out
            a = nxt

    def lookup(self, a: int, table: dict[int, int]) -> int | None:
        """The first class on `a`'s chain that `table` knows, mapped through it."""
        for r in self.chain(a):
            if r in table:
                return table[r]
        return None


class EqnInfo(NamedTuple):
    """What one equation does to labels."""

    outs: list[Labels]  # labels of its results
    reduced: list[int]  # labels it reduces: contracting dims, reduced axes (nested bodies too)
    flops: float  # forward FLOPs (a scan body counts `length` times)
    primitives: set[str]  # primitives it contains, itself included


def scan_counts(params) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan equation: jax 0.10 names them in its params; jax
    0.11 describes its operands by a flat tree ``ft_in`` of (consts, carry, xs) instead."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def shape_of(v) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(v.aval, "shape", ()))


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def _unify_all(ls: LabelSet, a: Labels, b: Labels) -> None:
    for x, y in zip(a, b):
        ls.union(x, y)


def _reshape_map(ls: LabelSet, src: Labels, src_shape, dst_shape) -> Labels:
    """Labels of a reshape's result: 1:1 dims unify, merged or split dims derive from the major."""
    out = list(ls.fresh_many(dst_shape))
    i = j = 0
    n, m = len(src_shape), len(dst_shape)
    while i < n and j < m:
        if src_shape[i] == 1 and dst_shape[j] != 1:
            i += 1
            continue
        if dst_shape[j] == 1 and src_shape[i] != 1:
            j += 1
            continue
        i0, j0 = i, j
        pi, pj = src_shape[i], dst_shape[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj and i < n:
                pi *= src_shape[i]
                i += 1
            elif pj < pi and j < m:
                pj *= dst_shape[j]
                j += 1
            else:
                return tuple(out)
        if i - i0 == 1 and j - j0 == 1:
            ls.link(src[i0], out[j0])
        else:
            major = next((k for k in range(i0, i) if src_shape[k] > 1), i0)
            for k in range(j0, j):
                if dst_shape[k] > 1:
                    ls.derive(out[k], src[major])
                    break
            if i - i0 == 1:  # one dim split into several (heads after a fused projection)
                ls.split_into(src[i0], out[j0:j])
            elif j - j0 == 1:  # several merged into one (heads back into the hidden dim)
                ls.merge_into(out[j0], src[i0:i])
    return tuple(out)


def _elementwise(ls: LabelSet, ins: list[Labels | None], in_shapes, out_shapes) -> list[Labels]:
    outs = []
    for oshape in out_shapes:
        lab = None
        for lb, sh in zip(ins, in_shapes):
            if lb is not None and sh == oshape and not ls.weak.intersection(lb):
                lab = lb
                break
        lab = lab if lab is not None else ls.fresh_many(oshape)
        for lb, sh in zip(ins, in_shapes):
            if lb is not None and len(sh) == len(oshape):
                for d in range(len(oshape)):  # a slice, pad or split is the same dim
                    ls.link(lb[d], lab[d])
        outs.append(lab)
    return outs


def _flops(name: str, params, in_shapes, out_shapes) -> float:
    if name == "dot_general":
        (lc, _), _ = params["dimension_numbers"]
        k = math.prod(in_shapes[0][d] for d in lc) if lc else 1
        return 2.0 * _numel(out_shapes[0]) * k
    if name == "ragged_dot_general":  # every lhs element meets its one group's rhs columns
        rdn = params["ragged_dot_dimension_numbers"]
        (_, rc), (_, rb) = rdn.dot_dimension_numbers
        skip = set(rc) | set(rb) | set(rdn.rhs_group_dimensions)
        n = math.prod(s for d, s in enumerate(in_shapes[1]) if d not in skip)
        return 2.0 * _numel(in_shapes[0]) * n
    if name == "conv_general_dilated":
        dn = params["dimension_numbers"]
        rhs = in_shapes[1]
        per_out = math.prod(rhs[d] for d in dn.rhs_spec[1:])  # in-features/group x window
        return 2.0 * _numel(out_shapes[0]) * per_out
    if name.startswith("reduce_window"):
        return float(_numel(out_shapes[0]) * math.prod(params["window_dimensions"]))
    if name == "fft":  # Cooley-Tukey: 5 n log2 n per transform of n complex points
        n = math.prod(params["fft_lengths"])
        complex_side = max(_numel(in_shapes[0]), _numel(out_shapes[0]))
        return 5.0 * complex_side * math.log2(n) if n > 1 else 0.0
    if name.startswith(("reduce_", "argm", "cum")):
        return float(_numel(in_shapes[0]))
    if name in ("gather", "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims",
                "convert_element_type", "iota", "slice", "dynamic_slice", "concatenate", "pad",
                "copy", "copy_p", "stop_gradient", "split", "select_n", "rev", "stack",
                "unstack", "name"):
        return 0.0
    return float(sum(_numel(s) for s in out_shapes))


def _labels_of(env, v, ls: LabelSet) -> Labels | None:
    if isinstance(v, jcore.Literal):
        return None
    if v not in env:  # an outer var not seen (should not happen); give it fresh labels
        env[v] = ls.fresh_many(shape_of(v))
    return env[v]


def _sub(params, key):
    sj = params[key]
    return (sj.jaxpr, sj.consts) if isinstance(sj, jcore.ClosedJaxpr) else (sj, ())


def propagate(ls: LabelSet, jaxpr: jcore.Jaxpr, in_labels: Sequence[Labels | None],
              env: dict | None = None) -> EqnInfo:
    """Propagates labels through `jaxpr` whose invars carry `in_labels`.

    Args:
      ls: the label set to extend.
      jaxpr: an open jaxpr; its constvars get fresh labels.
      in_labels: labels of `jaxpr.invars` (None for a literal argument: fresh labels).
      env: where the labels of every var seen are recorded (inner vars of nested jaxprs too).

    Returns:
      The labels of `jaxpr.outvars`, with the totals of all its equations.
    """
    env = {} if env is None else env
    for v in jaxpr.constvars:
        env[v] = ls.fresh_many(shape_of(v))
    for v, lb in zip(jaxpr.invars, in_labels):
        env[v] = lb if lb is not None else ls.fresh_many(shape_of(v))
    reduced: list[int] = []
    flops = 0.0
    prims: set[str] = set()
    for eqn in jaxpr.eqns:
        info = eqn_labels(ls, eqn, [_labels_of(env, v, ls) for v in eqn.invars], env)
        for v, lb in zip(eqn.outvars, info.outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = lb
        reduced += info.reduced
        flops += info.flops
        prims |= info.primitives
    outs = [_labels_of(env, v, ls) or ls.fresh_many(shape_of(v)) for v in jaxpr.outvars]
    return EqnInfo(outs, reduced, flops, prims)


def eqn_labels(ls: LabelSet, eqn, ins: Sequence[Labels | None], env: dict) -> EqnInfo:
    """Labels of one equation's results given its operands' labels (None for a literal)."""
    name = eqn.primitive.name
    p = eqn.params
    ins = list(ins)
    in_shapes = [shape_of(v) for v in eqn.invars]
    out_shapes = [shape_of(v) for v in eqn.outvars]
    prims = {name}
    if name in _HIGHER_ORDER:
        return _higher_order(ls, eqn, ins, in_shapes, out_shapes, env)
    info = _first_order(ls, name, p, ins, in_shapes, out_shapes, prims)
    given = [lb for lb in ins if lb]
    if given and all(ls.weak.issuperset(lb) for lb in given):  # index arithmetic, masks
        for lb in info.outs:
            ls.weak.update(lb)
    return info


def _first_order(ls: LabelSet, name: str, p, ins, in_shapes, out_shapes, prims) -> EqnInfo:
    flops = _flops(name, p, in_shapes, out_shapes)
    reduced: list[int] = []
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        lhs = ins[0] or ls.fresh_many(in_shapes[0])
        rhs = ins[1] or ls.fresh_many(in_shapes[1])
        for a, b in zip(lc, rc):
            ls.union(lhs[a], rhs[b])
            reduced.append(lhs[a])
        for a, b in zip(lb, rb):
            ls.union(lhs[a], rhs[b])
        lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
        rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
        out = tuple([lhs[d] for d in lb] + [lhs[d] for d in lfree] + [rhs[d] for d in rfree])
        return EqnInfo([out], reduced, flops, prims)
    if name == "ragged_dot_general":
        return _ragged_dot(ls, p, ins, in_shapes, out_shapes, flops, prims)
    if name == "sort":  # along `dimension`: a shard's order is not the order of the whole
        # The operands' other dims are one dim each; an operand built from an iota (argsort's
        # positions, weak) is cut as the keys are, and the results follow the keys.
        srcs = [x or ls.fresh_many(shape) for x, shape in zip(ins, in_shapes)]
        axis = p["dimension"]
        base = next((s for s in srcs
                     if not ls.weak.intersection(s[:axis] + s[axis + 1:])), srcs[0])
        for other in srcs:
            for d, (a, b) in enumerate(zip(base, other)):
                if d != axis and other is not base:
                    ls.link(b, a)
        new = ls.fresh(in_shapes[0][axis])
        ls.mark(new, "seq")
        out = (*base[:axis], new, *base[axis + 1:])
        return EqnInfo([out] * len(out_shapes), reduced, flops, prims)
    if name == "conv_general_dilated":
        dn = p["dimension_numbers"]
        lhs = ins[0] or ls.fresh_many(in_shapes[0])
        rhs = ins[1] or ls.fresh_many(in_shapes[1])
        out = list(ls.fresh_many(out_shapes[0]))
        if p["batch_group_count"] == 1:
            ls.union(out[dn.out_spec[0]], lhs[dn.lhs_spec[0]])
        ls.union(out[dn.out_spec[1]], rhs[dn.rhs_spec[0]])
        groups, batch_groups = p["feature_group_count"], p["batch_group_count"]
        if groups == 1 and batch_groups == 1:
            ls.union(lhs[dn.lhs_spec[1]], rhs[dn.rhs_spec[1]])
            reduced.append(lhs[dn.lhs_spec[1]])
        elif batch_groups == 1:
            # Grouped and depthwise: output channel group g reads input channel group g only,
            # so the input channels split with the output's, and only into whole groups (a
            # device's output channels must find their groups' input channels on it).
            ls.union(out[dn.out_spec[1]], lhs[dn.lhs_spec[1]])
            ls.grain(out[dn.out_spec[1]], groups)
        else:
            # batch_group_count: output feature group g is computed from the lhs batch rows
            # of group g, so neither the output batch nor its features split (a grain of 1).
            ls.grain(out[dn.out_spec[0]], 1)
            ls.grain(out[dn.out_spec[1]], 1)
        for ls_d, os_d in zip(dn.lhs_spec[2:], dn.out_spec[2:]):  # halo ignored
            ls.union(out[os_d], lhs[ls_d])
        return EqnInfo([tuple(out)], reduced, flops, prims)
    if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                "reduce_or", "reduce_xor", "argmax", "argmin"):
        axes = set(p["axes"])
        src = ins[0] or ls.fresh_many(in_shapes[0])
        reduced = [src[d] for d in sorted(axes) if in_shapes[0][d] > 1]
        out = tuple(src[d] for d in range(len(src)) if d not in axes)
        return EqnInfo([out], reduced, flops, prims)
    if name == "psum" and all(isinstance(a, int) for a in p["axes"]):
        # What vmap leaves of a named-axis sum (`BatchNorm(axis_name='batch')` under the
        # user's `jax.vmap(..., axis_name='batch')`): a sum over positional axes, per operand.
        axes = set(p["axes"])
        srcs = [x or ls.fresh_many(shape) for x, shape in zip(ins, in_shapes)]
        for other in srcs[1:]:
            for d in axes:
                ls.union(srcs[0][d], other[d])
        reduced = [srcs[0][d] for d in sorted(axes) if in_shapes[0][d] > 1]
        outs = [tuple(x[d] for d in range(len(x)) if d not in axes) for x in srcs]
        return EqnInfo(outs, reduced, flops, prims)
    if name.startswith("reduce_window") or name in ("select_and_gather_add",):
        src = ins[0] or ls.fresh_many(in_shapes[0])
        out = list(ls.fresh_many(out_shapes[0]))
        for d in range(len(out)):  # a pooled dim splits with its input (halo ignored)
            ls.union(out[d], src[d])
        return EqnInfo([tuple(out)], reduced, flops, prims)
    if name == "broadcast_in_dim":
        out = list(ls.fresh_many(out_shapes[0]))
        if ins[0] is not None:
            for i, d in enumerate(p["broadcast_dimensions"]):
                ls.link(ins[0][i], out[d])
        return EqnInfo([tuple(out)], reduced, flops, prims)
    if name in ("reshape", "squeeze", "expand_dims"):
        src, shape = ins[0] or ls.fresh_many(in_shapes[0]), in_shapes[0]
        if name == "reshape" and p.get("dimensions") is not None:  # transposed, then reshaped
            src = tuple(src[d] for d in p["dimensions"])
            shape = tuple(shape[d] for d in p["dimensions"])
        return EqnInfo([_reshape_map(ls, src, shape, out_shapes[0])], reduced, flops, prims)
    if name == "transpose":
        src = ins[0] or ls.fresh_many(in_shapes[0])
        return EqnInfo([tuple(src[d] for d in p["permutation"])], reduced, flops, prims)
    if name == "gather":
        return EqnInfo([_gather(ls, p, ins, in_shapes, out_shapes)], reduced, flops, prims)
    if name.startswith("scatter") and len(ins) == 3:
        return EqnInfo([_scatter(ls, p, ins, in_shapes)], reduced, flops, prims)
    if name == "concatenate":
        out = list(ls.fresh_many(out_shapes[0]))
        for lb in ins:
            if lb is not None:
                for d in range(len(out)):  # along the concat dim each input takes its share
                    ls.link(lb[d], out[d])
        return EqnInfo([tuple(out)], reduced, flops, prims)
    if name == "stack":  # jnp.stack: a new dim at `axis`, the inputs' dims around it
        axis = p["axis"]
        srcs = [x or ls.fresh_many(shape) for x, shape in zip(ins, in_shapes)]
        for other in srcs[1:]:
            for a, b in zip(srcs[0], other):
                ls.union(a, b)
        new = ls.fresh_many((out_shapes[0][axis],))
        return EqnInfo([tuple(srcs[0][:axis]) + new + tuple(srcs[0][axis:])], reduced, flops,
                       prims)
    if name == "unstack":  # jnp.unstack (a function's inputs unpacked: a PINN's t and x):
        axis = p["axis"]  # stack's inverse; the unpacked dim is never split (each result one
        src = ins[0] or ls.fresh_many(in_shapes[0])  # of its entries)
        ls.grain(src[axis], 1)
        out = tuple(src[:axis]) + tuple(src[axis + 1:])
        return EqnInfo([out] * len(out_shapes), reduced, flops, prims)
    if name == "top_k":  # the k largest along the last dim: the leading dims pass through,
        # the k dim is new and never split (a shard's top k are not the top k of the row)
        src = ins[0] or ls.fresh_many(in_shapes[0])
        outs = []
        for shape in out_shapes:
            lab = (*src[:-1], ls.fresh(shape[-1]))
            ls.mark(lab[-1], "seq")
            outs.append(lab)
        return EqnInfo(outs, reduced, flops, prims)
    if name == "iota":
        return EqnInfo([ls.fresh_many(s, weak=True) for s in out_shapes], reduced, flops, prims)
    if name == "rng_bit_generator" or name.startswith("random_") or name == "threefry2x32":
        return EqnInfo([ls.fresh_many(s) for s in out_shapes], reduced, flops, prims)
    return EqnInfo(_elementwise(ls, ins, in_shapes, out_shapes), reduced, flops, prims)


def _ragged_dot(ls: LabelSet, p, ins, in_shapes, out_shapes, flops, prims) -> EqnInfo:
    """A grouped matmul (`jax.lax.ragged_dot_general`): a dot_general whose lhs ragged dim is
    cut into consecutive groups by ``group_sizes``, group g multiplied by slice g of the rhs
    group dim (the experts' stacked weights ``[E, d, f]`` over tokens sorted by expert).

    Neither the ragged dim nor the group dim is ever split (both are marked like a scan's
    iteration axis). A device holding a slice of the ragged rows would need the offsets of its
    groups inside that slice, which the traced ``group_sizes`` (counted over all rows) do not
    give; a device holding some groups of the rhs (expert parallelism) would need exactly its
    groups' rows, a ragged all-to-all that depends on the router's counts, which no sharding
    of the operands expresses (MaxText does it by hand inside ``shard_map``). So the group dim
    is neither an output nor a reduced dim: the rhs is whole in the operator (its other dims,
    the contracting dim and the free dims, split as a dot_general's). Modes: ragged
    non-contracting (``[m, k] x [g, k, n] -> [m, n]``, the forward), ragged contracting
    (``[m, k] x [m, n] -> [g, k, n]`` contracting the rows: the weight gradient, a new group
    dim in front), ragged batch (as a dot_general).
    """
    rdn = p["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    lhs = ins[0] or ls.fresh_many(in_shapes[0])
    rhs = ins[1] or ls.fresh_many(in_shapes[1])
    ragged = rdn.lhs_ragged_dimensions[0]
    groups = tuple(rdn.rhs_group_dimensions)
    reduced: list[int] = []
    for a, b in zip(lc, rc):
        ls.union(lhs[a], rhs[b])
        if a != ragged:
            reduced.append(lhs[a])
    for a, b in zip(lb, rb):
        ls.union(lhs[a], rhs[b])
    ls.mark(lhs[ragged], "seq")
    for g in groups:
        ls.mark(rhs[g], "seq")
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb and d not in groups]
    out = tuple([lhs[d] for d in lb] + [lhs[d] for d in lfree] + [rhs[d] for d in rfree])
    if ragged in lc:  # ragged contracting: one result per group
        new = ls.fresh(out_shapes[0][0])
        ls.mark(new, "seq")
        out = (new, *out)
    return EqnInfo([out], reduced, flops, prims)


def _gather(ls: LabelSet, p, ins, in_shapes, out_shapes) -> Labels:
    dn = p["dimension_numbers"]
    operand = ins[0] or ls.fresh_many(in_shapes[0])
    indices = ins[1] or ls.fresh_many(in_shapes[1])
    out = list(ls.fresh_many(out_shapes[0]))
    offset_dims = tuple(dn.offset_dims)
    skip = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()))
    operand_dims = [d for d in range(len(operand)) if d not in skip]
    for od, opd in zip(offset_dims, operand_dims):
        ls.union(out[od], operand[opd])
    batch_out = [d for d in range(len(out)) if d not in offset_dims]
    for od, idx_d in zip(batch_out, range(len(indices) - 1)):
        ls.union(out[od], indices[idx_d])
    # Batched gathers (take_along_axis, vmap of an index): the operand's batching dims are the
    # indices' batching dims, split alike; indices built from iotas (CLIP's ``arange(B)``
    # labels, weak) are cut as the operand is.
    for od, idx_d in zip(getattr(dn, "operand_batching_dims", ()),
                         getattr(dn, "start_indices_batching_dims", ())):
        ls.link(indices[idx_d], operand[od])
    return tuple(out)


def _scatter(ls: LabelSet, p, ins, in_shapes) -> Labels:
    """A scatter's result is its operand, dim for dim; the updates' window dims are the
    operand's dims (those it does not insert), its other dims the indices' leading dims.
    (``x.at[:, 0].set(0)`` on a split batch: the updates, a broadcast constant, are split with
    the batch, where they kept its whole extent.) The operand dims its indices point into are
    never split (a grain of 1): XLA's partitioners (both; docs/xla-workarounds.md) write a shifted
    window wrongly across a split there (``x.at[:, 1:].set(y[:, :-1])`` with the sequence split in
    two: the second half's first column lost; T5's labels shifted right, found by
    `scripts/fuzz_exactness.py`)."""
    dn = p["dimension_numbers"]
    operand, indices, updates = (x or ls.fresh_many(s) for x, s in zip(ins, in_shapes))
    skip = set(dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()))
    operand_dims = [d for d in range(len(operand)) if d not in skip]
    window = tuple(dn.update_window_dims)
    for ud, od in zip(window, operand_dims):
        ls.link(updates[ud], operand[od])
    scatter_dims = [d for d in range(len(updates)) if d not in window]
    for ud, idx_d in zip(scatter_dims, range(max(len(indices) - 1, 0))):
        ls.link(updates[ud], indices[idx_d])
    for od, idx_d in zip(getattr(dn, "operand_batching_dims", ()),
                         getattr(dn, "scatter_indices_batching_dims", ())):
        ls.union(operand[od], indices[idx_d])
    for od in dn.scatter_dims_to_operand_dims:  # where the indices point: never split
        ls.grain(operand[od], 1)
    return tuple(operand)


def _higher_order(ls, eqn, ins, in_shapes, out_shapes, env) -> EqnInfo:
    name = eqn.primitive.name
    p = eqn.params
    ins = [lb if lb is not None else ls.fresh_many(s) for lb, s in zip(ins, in_shapes)]
    if name in ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                "custom_vjp_call_jaxpr", "remat2", "checkpoint"):
        key = "jaxpr" if "jaxpr" in p else ("call_jaxpr" if "call_jaxpr" in p else "fun_jaxpr")
        jaxpr, _ = _sub(p, key)
        if attention_call(eqn) is not None:  # flash attention: read as written whole
            jaxpr = analysis_jaxpr(eqn).jaxpr
        outs, reduced, flops, prims = propagate(ls, jaxpr, ins, env)
        return EqnInfo(outs, reduced, flops, prims | {name})
    if name == "scan":
        jaxpr, _ = _sub(p, "jaxpr")
        (nc, nk), length = scan_counts(p), int(p["length"])
        seq = ls.fresh(length)
        ls.mark(seq, "seq")
        xs = ins[nc + nk:]
        for lb, s in zip(xs, in_shapes[nc + nk:]):
            if s and s[0] == length:
                ls.union(lb[0], seq)
        body_in = ins[:nc + nk] + [lb[1:] for lb in xs]
        outs, reduced, flops, prims = propagate(ls, jaxpr, body_in, env)
        carry = ins[nc:nc + nk]
        _unify_each(ls, outs[:nk], carry)
        ys = [(seq, *lb) for lb in outs[nk:]]
        return EqnInfo(list(carry) + ys, reduced, flops * length, prims | {name})
    if name == "while":
        cj, _ = _sub(p, "cond_jaxpr")
        bj, _ = _sub(p, "body_jaxpr")
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        carry = ins[cn + bn:]
        propagate(ls, cj, ins[:cn] + carry, env)
        outs, reduced, flops, prims = propagate(ls, bj, ins[cn:cn + bn] + carry, env)
        _unify_each(ls, outs, carry)
        return EqnInfo(list(carry), reduced, flops, prims | {name})
    if name == "cond":
        results = [propagate(ls, br.jaxpr, ins[1:], env) for br in p["branches"]]
        outs = results[0][0]
        for other in results[1:]:
            _unify_each(ls, outs, other[0])
        reduced = [r for b in results for r in b[1]]
        flops = max(b[2] for b in results)
        prims = set().union(*(b[3] for b in results)) | {name}
        return EqnInfo(outs, reduced, flops, prims)
    raise AssertionError(name)


def _unify_each(ls: LabelSet, a: Sequence[Labels], b: Sequence[Labels]) -> None:
    for x, y in zip(a, b):
        _unify_all(ls, x, y)


# --- FLOPs as XLA counts them --------------------------------------------------------------------
#
# `_flops` above prices an operator's time (a transcendental is one FLOP, a cast none). What
# `soapjax check` holds against the compiled step must be counted as XLA's `HloCostAnalysis`
# counts the HLO each primitive lowers to: a multiply-add is 2 FLOPs (a contraction over one
# element is a multiply to XLA: 1); every other elementwise op, compare, select and dtype
# conversion 1 per element; exp, log, tanh, sqrt, rsqrt, pow, sin, cos, ... are
# *transcendentals*, a separate count (a sigmoid is 1 / (1 + exp(-x)): 3 FLOPs and one); a
# reduction (inputs - outputs) times its reducer; a pooling window (size - 1) per output, its
# gradient as XLA:CPU expands it; layout, indexing and gathers nothing; a convolution only its
# in-bounds taps; an FFT 8 per operand element times the product of its lengths' floor(log2).
# What the lowering folds (constants, `x * 1`) is free. Unlike XLA, a scan counts its body
# `length` times (XLA's cost analysis counts a while loop's body once, whatever its trip
# count); a `while` whose trip count the jaxpr does not fix counts once, as XLA's does.
# Checked against ``compiled.cost_analysis()`` primitive by primitive in tests/test_flops.py.


class Flops(NamedTuple):
    """FLOPs and transcendentals, as XLA's ``cost_analysis()`` reports them; `matmul` is the
    part of `flops` in matmuls and convolutions."""

    flops: float = 0.0
    transcendentals: float = 0.0
    matmul: float = 0.0

    def plus(self, other: Flops, times: float = 1.0) -> Flops:
        return Flops(*(a + times * b for a, b in zip(self, other)))


_XLA_FREE = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "iota", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "copy", "copy_p",
    "stop_gradient", "split", "rev", "gather", "sharding_constraint", "optimization_barrier",
    "device_put", "stack", "unstack", "mesh_cast", "reshard", "pvary", "bitcast_convert_type",
    "name"})
_XLA_TRANSCENDENTAL = frozenset({
    "exp", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt",
    "cbrt", "pow", "atan2", "erf", "acosh"})


def xla_flops(jaxpr: jcore.Jaxpr, constants: Sequence[Any] = ()) -> Flops:
    """The FLOPs of `jaxpr` as XLA counts the HLO it lowers to (see above), scans unrolled.

    What the lowering folds away costs nothing: equations on constants only (a literal, or a
    broadcast of one), a multiply by one, an add or subtract of zero, a divide by one.
    `constants`: per invar of `jaxpr`, its one value where the caller passes a constant (a
    literal into a call's body), else None.

    >>> import jax, jax.numpy as jnp
    >>> f = lambda x, w: jnp.tanh(x @ w) * 1.0 + 1.0
    >>> x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    >>> xla_flops(jax.make_jaxpr(f)(x, w).jaxpr)   # 2*8*4*16 + 8*4 adds; 8*4 tanh
    Flops(flops=1056.0, transcendentals=32.0, matmul=1024.0)
    """
    splat: dict[Any, Any] = {v: c for v, c in zip(jaxpr.invars, constants) if c is not None}
    # ^ vars known to hold one value everywhere: that value

    def value(v) -> Any:
        if isinstance(v, jcore.Literal):
            return np.asarray(v.val) if np.ndim(v.val) == 0 else None
        return splat.get(v)

    total = Flops()
    for eqn in jaxpr.eqns:
        vals = [value(v) for v in eqn.invars]
        if eqn.invars and all(x is not None for x in vals):  # folded by the lowering
            folded = _fold(eqn.primitive.name, eqn.params, vals)
            if folded is not None and len(eqn.outvars) == 1:
                splat[eqn.outvars[0]] = folded
                continue
        if _is_identity(eqn.primitive.name, vals):
            continue
        total = total.plus(_xla_eqn(eqn, vals))
    return total


_FOLD = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
         "max": np.maximum, "min": np.minimum, "neg": np.negative, "square": np.square,
         "sqrt": np.sqrt, "exp": np.exp, "log": np.log, "abs": np.abs}


def _fold(name: str, params, vals: list) -> Any:
    """The value of an equation on constants, where it is one value everywhere."""
    if name in ("broadcast_in_dim", "convert_element_type", "reshape", "squeeze",
                "expand_dims", "copy", "copy_p", "name"):
        return vals[0]
    if name == "integer_pow":
        return vals[0] ** params["y"]
    fn = _FOLD.get(name)
    if fn is None:
        return None
    with np.errstate(all="ignore"):
        return fn(*vals)


def _is_identity(name: str, vals: list) -> bool:
    """``x * 1``, ``1 * x``, ``x + 0``, ``0 + x``, ``x - 0``, ``x / 1``: no HLO left."""
    def eq(x, c):
        return x is not None and np.ndim(x) == 0 and x == c
    if len(vals) != 2:
        return False
    if name in ("mul",):
        return eq(vals[0], 1) or eq(vals[1], 1)
    if name in ("add", "add_any"):
        return eq(vals[0], 0) or eq(vals[1], 0)
    if name in ("sub", "div"):
        return eq(vals[1], 0 if name == "sub" else 1)
    return False


def _xla_eqn(eqn, vals: list) -> Flops:
    name, p = eqn.primitive.name, eqn.params
    if name == "scan":
        return Flops().plus(xla_flops(p["jaxpr"].jaxpr), float(p["length"]))
    if name == "while":
        return xla_flops(p["body_jaxpr"].jaxpr).plus(xla_flops(p["cond_jaxpr"].jaxpr))
    if name == "cond":
        return max((xla_flops(b.jaxpr) for b in p["branches"]), key=lambda f: f.flops)
    if attention_call(eqn) is not None:  # flash attention: its FLOPs written whole
        return xla_flops(analysis_jaxpr(eqn).jaxpr)
    subs = list(jcore.jaxprs_in_params(p))
    if subs:  # calls, custom derivative rules, remat: the primal body
        return xla_flops(subs[0], vals if len(subs[0].invars) == len(vals) else ())
    if name in _XLA_FREE:
        return Flops()
    in_shapes = [shape_of(v) for v in eqn.invars]
    out_shapes = [shape_of(v) for v in eqn.outvars]
    out = float(_numel(out_shapes[0])) if out_shapes else 0.0
    if name == "logistic":  # XLA expands it: 1 / (1 + exp(-x))
        return Flops(3.0 * out, out)
    if name in _XLA_TRANSCENDENTAL:
        return Flops(0.0, out)
    if name == "dot_general":
        (lc, _), _ = p["dimension_numbers"]
        if math.prod(in_shapes[0][d] for d in lc) == 1:  # XLA rewrites it as a multiply
            return Flops(out, 0.0, out)
        f = _flops(name, p, in_shapes, out_shapes)
        return Flops(f, 0.0, f)
    if name == "ragged_dot_general":
        # jax's lowering off TPU (docs/xla-workarounds.md): each of the g groups masks its rows out
        # of the operands (two compares, an and, a select per element: the lhs, and in the ragged
        # contracting mode the rhs too) and multiplies them densely; the group offsets are a
        # cumsum, g (g - 1). Measured against XLA:CPU's cost analysis in tests/test_moe.py.
        g = in_shapes[2][-1]
        matmul = g * _flops(name, p, in_shapes, out_shapes)
        masked = _numel(in_shapes[0])
        if not p["ragged_dot_dimension_numbers"].rhs_group_dimensions:
            masked += _numel(in_shapes[1])
        return Flops(matmul + 4.0 * g * masked + g * (g - 1), 0.0, matmul)
    if name == "conv_general_dilated":
        f = _conv_flops(p, in_shapes, out_shapes)
        return Flops(f, 0.0, f)
    if name == "fft":  # 4 complex multiply-adds per operand element per log2 of each length
        logs = math.prod(int(n).bit_length() - 1 for n in p["fft_lengths"])
        return Flops(8.0 * logs * _numel(in_shapes[0]))
    if name.startswith(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "reduce_xor", "argmax", "argmin")):
        per = 6.0 if name.startswith("arg") else 1.0  # a variadic reducer: compares, selects
        return Flops(per * (_numel(in_shapes[0]) - out))
    if name.startswith("reduce_window"):
        return Flops((math.prod(p["window_dimensions"]) - 1) * out)
    if name == "select_and_scatter_add":
        # XLA:CPU expands it (SelectAndScatterExpander): a reduce-window carrying the value and
        # one index per dim, rank + 7 FLOPs a step, then a scatter-add; measured at ranks 3-5.
        steps = math.prod(p["window_dimensions"]) - 1
        return Flops(_numel(in_shapes[0]) * (steps * (len(in_shapes[0]) + 7) + 1.0))
    if name.startswith("scatter"):  # the updates, combined one by one (a plain scatter: none)
        return Flops(0.0 if name == "scatter" else float(_numel(in_shapes[2])))
    if name == "integer_pow":  # square-and-multiply, then a divide for a negative power
        y = abs(p["y"])
        return Flops(out * (max(y.bit_length() - 1 + y.bit_count() - 1, 0) + (p["y"] < 0)))
    if name == "convert_element_type":
        same = eqn.invars[0].aval.dtype == p["new_dtype"]
        return Flops(0.0 if same else out)
    if name == "select_n":
        return Flops(out * (len(eqn.invars) - 2))
    if name in ("random_bits", "random_seed", "random_split", "random_fold_in", "random_wrap",
                "random_unwrap", "threefry2x32"):
        return Flops()  # key plumbing (an LSTM's carry initializer): a few integer ops
    return Flops(float(sum(_numel(s) for s in out_shapes)))


def _conv_flops(p, in_shapes, out_shapes) -> float:
    """2 x the multiply-adds of a convolution that land inside the (dilated) input."""
    dn = p["dimension_numbers"]
    lhs, rhs, out = in_shapes[0], in_shapes[1], out_shapes[0]
    valid = 1
    for k, (ld, rd, od) in enumerate(zip(dn.lhs_spec[2:], dn.rhs_spec[2:], dn.out_spec[2:])):
        n_in, n_k, n_out = lhs[ld], rhs[rd], out[od]
        stride = p["window_strides"][k]
        lo, _ = p["padding"][k]
        base = p["lhs_dilation"][k] if p.get("lhs_dilation") else 1
        dil = p["rhs_dilation"][k] if p.get("rhs_dilation") else 1
        valid *= sum(1 for t in range(n_k) for o in range(n_out)
                     if _tap_in_bounds(o * stride - lo + t * dil, base, n_in))
    in_features = lhs[dn.lhs_spec[1]] // p["feature_group_count"]
    batch = lhs[dn.lhs_spec[0]] // p["batch_group_count"]
    return 2.0 * in_features * out[dn.out_spec[1]] * batch * valid


def _tap_in_bounds(index: int, base_dilation: int, size: int) -> bool:
    if index % base_dilation:
        return False
    return 0 <= index // base_dilation < size
