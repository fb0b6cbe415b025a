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
reduction work 1 per element; a scan body counts `length` times).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from jax.extend import core as jcore

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
        self._root_marks: dict[int, set[str]] | None = None
        self.weak: set[int] = set()

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
        if not out - {"seq"} and a in self.derived_from:
            out |= self.marks(self.derived_from[a]) - {"seq"}
        return out

    def chain(self, a: int) -> list[int]:
        """`a`'s class, then the classes it derives from (a merged or strided dim's sources)."""
        out: list[int] = []
        while True:
            r = self.find(a)
            if r in out:
                return out
            out.append(r)
            nxt = self.derived_from.get(a, self.derived_from.get(r))
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
    if name == "conv_general_dilated":
        dn = params["dimension_numbers"]
        rhs = in_shapes[1]
        per_out = math.prod(rhs[d] for d in dn.rhs_spec[1:])  # in-features/group x window
        return 2.0 * _numel(out_shapes[0]) * per_out
    if name.startswith("reduce_window"):
        return float(_numel(out_shapes[0]) * math.prod(params["window_dimensions"]))
    if name.startswith(("reduce_", "argm", "cum")):
        return float(_numel(in_shapes[0]))
    if name in ("gather", "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims",
                "convert_element_type", "iota", "slice", "dynamic_slice", "concatenate", "pad",
                "copy", "copy_p", "stop_gradient", "split", "select_n", "rev", "stack"):
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
    if name == "conv_general_dilated":
        dn = p["dimension_numbers"]
        lhs = ins[0] or ls.fresh_many(in_shapes[0])
        rhs = ins[1] or ls.fresh_many(in_shapes[1])
        out = list(ls.fresh_many(out_shapes[0]))
        ls.union(out[dn.out_spec[0]], lhs[dn.lhs_spec[0]])
        ls.union(out[dn.out_spec[1]], rhs[dn.rhs_spec[0]])
        if p["feature_group_count"] == 1 and p["batch_group_count"] == 1:
            ls.union(lhs[dn.lhs_spec[1]], rhs[dn.rhs_spec[1]])
            reduced.append(lhs[dn.lhs_spec[1]])
        elif p["feature_group_count"] == in_shapes[0][dn.lhs_spec[1]]:  # depthwise
            ls.derive(out[dn.out_spec[1]], lhs[dn.lhs_spec[1]])
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
        win, strides = p.get("window_dimensions"), p.get("window_strides")
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
        src = ins[0] or ls.fresh_many(in_shapes[0])
        return EqnInfo([_reshape_map(ls, src, in_shapes[0], out_shapes[0])], reduced, flops, prims)
    if name == "transpose":
        src = ins[0] or ls.fresh_many(in_shapes[0])
        return EqnInfo([tuple(src[d] for d in p["permutation"])], reduced, flops, prims)
    if name == "gather":
        return EqnInfo([_gather(ls, p, ins, in_shapes, out_shapes)], reduced, flops, prims)
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
    if name == "iota":
        return EqnInfo([ls.fresh_many(s, weak=True) for s in out_shapes], reduced, flops, prims)
    if name == "rng_bit_generator" or name.startswith("random_") or name == "threefry2x32":
        return EqnInfo([ls.fresh_many(s) for s in out_shapes], reduced, flops, prims)
    return EqnInfo(_elementwise(ls, ins, in_shapes, out_shapes), reduced, flops, prims)


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
    # indices' batching dims, split alike.
    for od, idx_d in zip(getattr(dn, "operand_batching_dims", ()),
                         getattr(dn, "start_indices_batching_dims", ())):
        ls.union(operand[od], indices[idx_d])
    return tuple(out)


def _higher_order(ls, eqn, ins, in_shapes, out_shapes, env) -> EqnInfo:
    name = eqn.primitive.name
    p = eqn.params
    ins = [lb if lb is not None else ls.fresh_many(s) for lb, s in zip(ins, in_shapes)]
    if name in ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                "custom_vjp_call_jaxpr", "remat2", "checkpoint"):
        key = "jaxpr" if "jaxpr" in p else ("call_jaxpr" if "call_jaxpr" in p else "fun_jaxpr")
        jaxpr, _ = _sub(p, key)
        outs, reduced, flops, prims = propagate(ls, jaxpr, ins, env)
        return EqnInfo(outs, reduced, flops, prims | {name})
    if name == "scan":
        jaxpr, _ = _sub(p, "jaxpr")
        nc, nk, length = p["num_consts"], p["num_carry"], int(p["length"])
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
