"""The optimizer's update, read from its jaxpr: the bytes it moves and the scalars it reduces.

The simulator prices each parameter shard's update and `soapjax.cost.operators` times it; both need
two numbers about the optax optimizer that only its update's arithmetic says, so each is read from
the update's jaxpr on one float32 vector of 1,024 elements (nothing runs):

* `update_passes`: passes over the parameter bytes: 3 (read the parameter and its gradient,
  write the parameter) plus 2 per parameter's worth of optimizer state (read and write it).
  Adam keeps two moments (and a step count): 7 passes, an analytic update time of
  ``7 * bytes / bandwidth``.
* `update_reductions`: scalars the update reduces each parameter to (a global-norm clip: 1),
  each an all-reduce over the axes a split parameter is stored on.

A third, `update_whole_dims`, is read from the update of the model's own parameters: the dims
of each parameter its update contracts (Muon's Newton-Schulz iteration multiplies each
matrix's momentum by its transpose; GaLore factors each gradient by an SVD). Such an update
needs the whole matrix on a device: apply gathers the gradient whole along those dims and keeps
that parameter's optimizer state so, split over the ZeRO and distributed optimizer axes on its
other dims (`whole_update_spec`; `soapjax.apply._shardings.train_shardings`), as distributed
Muon does (gather, orthogonalise, keep the shard), and the simulator prices the gather, the
state's memory and the update's matrix products. `optimizer_problem` says why an optimizer
cannot be a step's at all (one whose update needs the loss itself).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from soapjax.base._dtypes import itemsize
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy.space import MeshShape, storage_spec

__all__ = ["DEFAULT_UPDATE_PASSES", "UpdateDims", "freeze", "frozen_leaves",
           "optimizer_problem", "update_passes", "update_reductions", "update_signature",
           "update_whole_dims", "whole_along", "whole_update_spec"]

# Adam reads parameters, gradients and two moments and writes parameters and both moments:
# 7 passes over the parameter bytes (when the optimizer is not known).
DEFAULT_UPDATE_PASSES = 7.0

_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "argmax", "argmin", "dot_general"})
_VECTOR = jax.ShapeDtypeStruct((1024,), jnp.float32)


def update_reductions(optimizer: Any) -> int:
    """How many scalars the optimizer's update reduces each parameter (or its gradient) to.

    ``optax.clip_by_global_norm`` sums every gradient's squares into one norm: 1 per parameter;
    LAMB's trust ratios take two norms; Adam and SGD take none. Where a parameter is stored
    split over mesh axes, each such scalar is a partial result that XLA all-reduces over those
    axes before any update can use it (one scalar all-reduce per split parameter, combined into
    one all-reduce of many operands, which XLA:CPU runs as one rendezvous per operand), and the
    simulator prices it. Counted on the update's jaxpr for one float32 vector (as
    `update_passes`): reductions of the vector to a scalar, nested jaxprs included. An
    optimizer that cannot update a lone vector counts 0.

    >>> import optax
    >>> update_reductions(optax.adam(1e-3)), update_reductions(
    ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    (0, 1)
    """
    if optimizer is None:
        return 0
    p = _VECTOR
    try:
        state = jax.eval_shape(optimizer.init, p)
        closed = jax.make_jaxpr(optimizer.update)(p, state, p)
    except Exception:  # noqa: BLE001  an optimizer that needs more than one array
        return 0

    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            if (eqn.primitive.name in _REDUCTIONS
                    and any(getattr(v.aval, "shape", None) == p.shape for v in eqn.invars)
                    and all(getattr(v.aval, "shape", None) == () for v in eqn.outvars)):
                n += 1
            n += sum(count(sub) for sub in jcore.jaxprs_in_params(eqn.params))
        return n

    return count(closed.jaxpr)


def update_passes(optimizer: Any) -> float:
    """Passes over the parameter bytes one update makes: 3 (read p, g; write p) + 2 per state
    (`DEFAULT_UPDATE_PASSES`, Adam's, for None or an optimizer that needs more than one array).

    >>> import optax
    >>> update_passes(optax.sgd(0.1)), update_passes(optax.adam(1e-3))
    (3.0, 7.001953125)
    """
    if optimizer is None:
        return DEFAULT_UPDATE_PASSES
    try:
        state = jax.eval_shape(optimizer.init, _VECTOR)
        size = sum(math.prod(x.shape) * itemsize(x.dtype)
                   for x in jax.tree.leaves(state) if hasattr(x, "shape"))
        return 3.0 + 2.0 * size / (1024 * 4)
    except Exception:  # noqa: BLE001  an optimizer that needs more than one array
        return DEFAULT_UPDATE_PASSES


def optimizer_problem(optimizer: Any, params: Any) -> str | None:
    """Why `optimizer` cannot be the step's, or None: the step calls ``optimizer.init(params)``
    and ``optimizer.update(grads, opt_state, params)`` as a plain optax loop does, and
    `update_whole_dims` traces both on the parameters' shapes (nothing runs). An optimizer
    whose update needs the loss itself (``optax.lbfgs``'s line search: ``value``, ``grad``,
    ``value_fn``) or parameters of another structure (``optax.lookahead``'s
    `LookaheadParams`) says so here, not in a traceback from inside the search or the step.

    >>> import jax, optax
    >>> p = {"w": jax.ShapeDtypeStruct((4, 4), "float32")}
    >>> optimizer_problem(optax.adam(1e-3), p) is None
    True
    >>> "its update needs the loss itself" in optimizer_problem(optax.lbfgs(), p)
    True
    """
    return update_whole_dims(optimizer, params).problem


def _problem(call: str, e: Exception) -> str:
    said = f"{call} raised {type(e).__name__}: {e}"
    if "value_fn" in str(e) or "'value'" in str(e):
        said += ("; its update needs the loss itself (a line search: value, grad, value_fn), "
                 "which a step that hands it the gradients alone cannot give: use a "
                 "first-order optimizer (optax.adam, optax.contrib.muon, ...)")
    elif "fast" in str(e):
        said += ("; optax.lookahead updates optax.LookaheadParams (fast and slow parameters), "
                 "where the step hands it your loss's parameters as they are")
    return said


class UpdateDims(NamedTuple):
    """What the optimizer's update does across a parameter's dims (`update_whole_dims`).

    Attributes:
      whole: per parameter leaf (flattening order), the dims its update contracts: () for an
        update that is elementwise in the parameter (Adam, SGD, Adafactor's factored means,
        global norms: partial sums, not contractions).
      flops: per parameter leaf, the FLOPs of its update's matrix products at the whole
        parameter's shape (0 where there are none).
      reads_params: per parameter leaf, whether its update reads the parameter itself
        (weight decay), not only its gradient and state.
      problem: why the optimizer cannot update these parameters at all (`optimizer_problem`),
        or None.
      frozen: per parameter leaf, whether the optimizer freezes it (`frozen_leaves`).
    """

    whole: tuple[tuple[int, ...], ...]
    flops: tuple[float, ...]
    reads_params: tuple[bool, ...] = ()
    problem: str | None = None
    frozen: tuple[bool, ...] = ()


def update_whole_dims(optimizer: Any, params: Any) -> UpdateDims:
    """The dims of each parameter the optimizer's update contracts, read from the update's
    jaxpr at the parameters' shapes (nothing runs): each value's dims carry the parameter dims
    they come from (through elementwise arithmetic, broadcasts, transposes, reshapes, vmap's
    batched products, loops and nested calls), and a ``dot_general`` that contracts a dim
    into a matrix makes the parameter dims it came from whole (one to a scalar, as
    D-Adaptation's and Prodigy's ``vdot``, is a sum of partial sums, as a norm is), as does
    a factorisation (GaLore's SVD) of the matrix it factors. An optimizer whose update cannot
    be traced on the parameters' shapes reads as elementwise, with the reason in
    `UpdateDims.problem`.

    >>> import jax, optax
    >>> p = {"b": jax.ShapeDtypeStruct((8,), "float32"), "w": jax.ShapeDtypeStruct((8, 16),
    ...      "float32")}
    >>> update_whole_dims(optax.adam(1e-3), p).whole, update_whole_dims(
    ...     optax.contrib.muon(1e-3), p).whole
    (((), ()), ((), (0, 1)))
    """
    leaves = jax.tree.leaves(params)
    none = UpdateDims(((),) * len(leaves), (0.0,) * len(leaves), (False,) * len(leaves))
    if optimizer is None or not leaves:
        return none
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    try:
        state = jax.eval_shape(optimizer.init, abstract)
    except Exception as e:  # noqa: BLE001  whatever the optimizer raises, said plainly
        return none._replace(problem=_problem("optimizer.init(params)", e))
    try:
        closed = jax.make_jaxpr(optimizer.update)(abstract, state, abstract)
    except Exception as e:  # noqa: BLE001
        return none._replace(problem=_problem("optimizer.update(grads, opt_state, params)", e))
    n, n_state = len(leaves), len(jax.tree.leaves(state))
    # the gradients' dims are tagged by leaf, the parameters' by leaf + n
    ins: list[_Origins] = [_fresh(i, x.shape) for i, x in enumerate(leaves)]
    ins += [None] * n_state + [_fresh(n + i, x.shape) for i, x in enumerate(leaves)]
    walk = _Walk()
    outs = walk.run(closed.jaxpr, ins)
    whole = tuple(tuple(sorted({d for j, d in walk.whole if j % n == i
                                and leaves[i].shape[d] > 1})) for i in range(n))
    read = {j - n for o in outs if o is not None for dim in o for j, _ in dim if j >= n}
    flops = tuple(walk.flops.get(i, 0.0) + walk.flops.get(n + i, 0.0) for i in range(n))
    return UpdateDims(whole, flops, tuple(i in read for i in range(n)),
                      frozen=_frozen(closed.jaxpr, n))


def frozen_leaves(optimizer: Any, params: Any) -> tuple[bool, ...]:
    """Per parameter leaf (flattening order), whether `optimizer` freezes it: its update is a
    constant (zeros) and nothing the update returns reads its gradient. ``optax.set_to_zero()``
    under ``optax.multi_transform``, Flax's way to fine-tune part of a model (a LoRA's base
    weights, a frozen backbone), does so. XLA then computes no such gradient (dead code in the
    step): no weight-gradient product, no synchronisation, no gradient buffer, no update; the
    graph marks them (`soapjax.graph.opgraph.OpGraph.with_frozen`) and the simulator, the
    memory rule and the FLOP count leave that work out. A gradient that feeds anything
    else, a global norm's clip over every leaf, is not frozen: XLA computes it.

    >>> import jax, optax
    >>> p = {"base": jax.ShapeDtypeStruct((8, 8), "float32"),
    ...      "head": jax.ShapeDtypeStruct((8, 2), "float32")}
    >>> labels = {"base": "frozen", "head": "train"}
    >>> frozen_leaves(optax.multi_transform({"train": optax.adam(1e-3),
    ...                                      "frozen": optax.set_to_zero()}, labels), p)
    (True, False)
    """
    dims = update_whole_dims(optimizer, params)
    return dims.frozen or (False,) * len(jax.tree.leaves(params))


def freeze(graph: OpGraph, optimizer: Any) -> OpGraph:
    """`graph` with the parameters `optimizer` freezes marked (`frozen_leaves`,
    `OpGraph.with_frozen`); `graph` itself where it freezes none or is None. What the command
    line, `soapjax check`, `soapjax.training.shard_training` and `find_plan` plan a model's
    graph with, so its plans are priced as it trains (the fingerprint is the same; the plan
    cache's key names the frozen leaves: `update_signature`)."""
    if optimizer is None or not graph.params:
        return graph
    return graph.with_frozen(frozen_leaves(optimizer, graph.abstract_params()))


def _frozen(jaxpr: jcore.Jaxpr, n: int) -> tuple[bool, ...]:
    """`frozen_leaves` of an update's jaxpr ``(grads[n], state, params[n]) -> (updates[n],
    state)``: each value's inputs as a bit set, equations with bodies read as depending on
    all their operands."""
    bits: dict[Any, int] = {v: 1 << i for i, v in enumerate(jaxpr.invars)}

    def of(v: Any) -> int:
        return 0 if isinstance(v, jcore.Literal) else bits.get(v, 0)

    for eqn in jaxpr.eqns:
        mask = 0
        for v in eqn.invars:
            mask |= of(v)
        for v in eqn.outvars:
            bits[v] = mask
    read = 0
    for v in jaxpr.outvars:
        read |= of(v)
    return tuple(of(jaxpr.outvars[i]) == 0 and not read >> i & 1 for i in range(n))


def update_signature(optimizer: Any, params: Any) -> dict[str, list]:
    """What of the update a plan depends on beyond its state's size, for a plan cache's key:
    the dims it multiplies whole and whether it reads each parameter, and the leaves it
    freezes (`frozen_leaves`); {} for an update that multiplies none and freezes none (Adam's
    key stays as it was). SGD with momentum and Muon keep one moment per matrix alike; their
    plans differ.

    >>> import jax, optax
    >>> p = {"w": jax.ShapeDtypeStruct((4, 8), "float32")}
    >>> update_signature(optax.adam(1e-3), p), update_signature(optax.contrib.muon(1e-3), p)
    ({}, {'update_whole': [[0, 1]], 'update_reads': [False]})
    """
    dims = update_whole_dims(optimizer, params)
    out: dict[str, list] = {}
    if any(dims.whole):
        out.update(update_whole=[list(d) for d in dims.whole],
                   update_reads=list(dims.reads_params))
    if any(dims.frozen):
        out["frozen"] = [i for i, f in enumerate(dims.frozen) if f]
    return out


def whole_along(spec: Sequence[tuple[str, ...]], dims: Sequence[int]
                ) -> tuple[tuple[str, ...], ...]:
    """`spec` (mesh axes per dim) with `dims` whole: the layout an update that contracts
    those dims reads its gradient and keeps its state in.

    >>> whole_along((("data",), ("model",)), (1,))
    (('data',), ())
    """
    return tuple(() if d in dims else tuple(a) for d, a in enumerate(spec))


def whole_update_spec(spec: Sequence[tuple[str, ...]], shape: Sequence[int],
                      dims: Sequence[int], axes: Sequence[str], mesh: MeshShape
                      ) -> tuple[tuple[str, ...], ...]:
    """The layout an update that contracts `dims` reads its gradient and keeps its state in:
    the parameter's `spec` whole along `dims`, then split over the ZeRO and distributed
    optimizer `axes` it no longer uses, on its other dims (each on the largest that stays
    divisible): a stacked layer dim so split has each device update its share of the layers'
    matrices, as a ZeRO-1 distributed Muon does.

    >>> from soapjax.strategy.space import MeshShape
    >>> mesh = MeshShape(("data", "model"), (2, 4))
    >>> whole_update_spec(((), (), ("model",)), (4, 32, 64), (1, 2), ("data",), mesh)
    (('data',), (), ())
    """
    out = whole_along(spec, dims)
    used = {a for d in out for a in d}
    return storage_spec(out, shape, [a for a in axes if a not in used], mesh, avoid=dims)


# Linear algebra that reads a whole matrix (the last two dims of its operands).
_FACTORISATIONS = frozenset({"svd", "eigh", "eig", "qr", "householder_product", "lu",
                             "cholesky", "triangular_solve", "schur", "hessenberg", "tridiagonal"})

# Per value, per dim: the (parameter leaf, dim) pairs it comes from; None: from none.
_Origins = tuple[frozenset, ...] | None


def _fresh(i: int, shape: Sequence[int]) -> _Origins:
    return tuple(frozenset({(i, d)}) for d in range(len(shape)))


def _union(*sets) -> frozenset:
    return frozenset().union(*sets)


class _Walk:
    """Carries `_Origins` through a jaxpr, recording the contracted parameter dims."""

    def __init__(self):
        self.whole: set[tuple[int, int]] = set()
        self.flops: dict[int, float] = {}

    def run(self, jaxpr, ins: Sequence[_Origins]) -> list[_Origins]:
        env: dict[Any, _Origins] = {}
        for v, o in zip(jaxpr.invars, ins):
            env[v] = o
        for eqn in jaxpr.eqns:
            args = [None if isinstance(v, jcore.Literal) else env.get(v) for v in eqn.invars]
            outs = self._eqn(eqn, args)
            env.update(zip(eqn.outvars, outs))
        return [None if isinstance(v, jcore.Literal) else env.get(v) for v in jaxpr.outvars]

    def _eqn(self, eqn, args: list[_Origins]) -> list[_Origins]:
        name, p = eqn.primitive.name, eqn.params
        shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
        out_shapes = [getattr(v.aval, "shape", ()) for v in eqn.outvars]
        if name == "dot_general":
            return [self._dot(p, args, shapes, out_shapes[0])]
        if name == "scan":
            return self._scan(p, args)
        if name == "while":
            return self._while(p, args)
        if name == "cond":
            branches = [self.run(b.jaxpr, args[1:]) for b in p["branches"]]
            return [_join(outs) for outs in zip(*branches)]
        subs = list(jcore.jaxprs_in_params(p))
        if subs:
            sub = subs[0]
            outs = self.run(sub, args[len(args) - len(sub.invars):])
            return outs if len(outs) == len(eqn.outvars) else [None] * len(eqn.outvars)
        a = args[0] if args else None
        if name in _FACTORISATIONS:  # a matrix factorised (GaLore's SVD): its last two dims
            for x in args:
                if x is not None and len(x) >= 2:
                    self.whole |= x[-2] | x[-1]
            return [None] * len(eqn.outvars)
        if name == "broadcast_in_dim":
            out = [frozenset()] * len(out_shapes[0])
            if a is not None:
                for i, d in enumerate(p["broadcast_dimensions"]):
                    if shapes[0][i] == out_shapes[0][d]:
                        out[d] = a[i]
            return [tuple(out)]
        if name == "transpose":
            return [None if a is None else tuple(a[d] for d in p["permutation"])]
        if name == "reshape":
            return [_reshape(a, shapes[0], out_shapes[0])]
        if name == "squeeze":
            return [None if a is None else tuple(o for d, o in enumerate(a)
                                                 if d not in p["dimensions"])]
        if name.startswith(("reduce_", "arg")) and "axes" in p:
            return [None if a is None else tuple(o for d, o in enumerate(a) if d not in p["axes"])
                    for _ in eqn.outvars]
        # elementwise and everything else: a result dim of an operand's extent is that dim
        outs = []
        for shape in out_shapes:
            per = [frozenset()] * len(shape)
            for x, xs in zip(args, shapes):
                if x is not None and len(xs) == len(shape):
                    per = [o | (x[d] if xs[d] == shape[d] else frozenset())
                           for d, o in enumerate(per)]
            outs.append(tuple(per) if any(per) else None)
        return outs

    def _dot(self, p, args, shapes, out_shape) -> _Origins:
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        lhs = args[0] or tuple(frozenset() for _ in shapes[0])
        rhs = args[1] or tuple(frozenset() for _ in shapes[1])
        if math.prod(out_shape) > 1:  # a product to a scalar (``vdot``) sums partial sums
            for d in lc:
                self.whole |= lhs[d]
            for d in rc:
                self.whole |= rhs[d]
        flops = 2.0 * math.prod(out_shape) * math.prod(shapes[0][d] for d in lc)
        for i in {i for o in lhs + rhs for i, _ in o}:
            self.flops[i] = self.flops.get(i, 0.0) + flops
        lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
        rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
        out = ([lhs[a] | rhs[b] for a, b in zip(lb, rb)] + [lhs[d] for d in lfree]
               + [rhs[d] for d in rfree])
        return tuple(out) if any(out) else None

    def _scan(self, p, args) -> list[_Origins]:
        consts, n_carry = p["num_consts"], p["num_carry"]
        body = p["jaxpr"].jaxpr
        carry = list(args[consts:consts + n_carry])
        xs = [None if x is None else x[1:] for x in args[consts + n_carry:]]
        before = dict(self.flops)
        for _ in range(2):  # a carry's origins reach a fixed point in two passes here
            outs = self.run(body, list(args[:consts]) + carry + xs)
            carry = [_join((c, o)) for c, o in zip(carry, outs[:n_carry])]
        for i, f in self.flops.items():  # each pass counted the body once: length times
            self.flops[i] = before.get(i, 0.0) + (f - before.get(i, 0.0)) / 2 * p["length"]
        ys = [None if y is None else (frozenset(),) + y for y in outs[n_carry:]]
        return carry + ys

    def _while(self, p, args) -> list[_Origins]:
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        carry = list(args[nc + nb:])
        before = dict(self.flops)
        for _ in range(2):
            outs = self.run(p["body_jaxpr"].jaxpr, list(args[nc:nc + nb]) + carry)
            carry = [_join((c, o)) for c, o in zip(carry, outs)]
        for i, f in self.flops.items():  # the trip count is not known: the body once
            self.flops[i] = before.get(i, 0.0) + (f - before.get(i, 0.0)) / 2
        return carry


def _join(values: Sequence[_Origins]) -> _Origins:
    given = [v for v in values if v is not None]
    if not given:
        return None
    n = max(len(v) for v in given)
    return tuple(_union(*(v[d] for v in given if len(v) == n)) for d in range(n))


def _reshape(a: _Origins, src: Sequence[int], dst: Sequence[int]) -> _Origins:
    """A reshape's result dims: each group of operand dims that becomes a group of result dims
    of the same size carries the group's origins (a dim of size 1 carries none)."""
    if a is None:
        return None
    out = [frozenset()] * len(dst)
    i = j = 0
    while i < len(src) or j < len(dst):
        i0, j0, si, sj = i, j, 1, 1
        if i < len(src):
            si, i = src[i], i + 1
        if j < len(dst):
            sj, j = dst[j], j + 1
        while si != sj and (i < len(src) or j < len(dst)):
            if si < sj and i < len(src):
                si, i = si * src[i], i + 1
            elif j < len(dst):
                sj, j = sj * dst[j], j + 1
            else:
                si, i = si * src[i], i + 1
        group = _union(*(a[d] for d in range(i0, i) if src[d] > 1))
        for d in range(j0, j):
            if dst[d] > 1:
                out[d] = group
    return tuple(out)
