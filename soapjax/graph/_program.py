"""The traced function as a flat program of equations over integer value ids.

`trace` (in `soapjax.graph.opgraph`) turns the jaxpr into a `Program`: plain calls inlined, remat
regions opened (and re-wrapped in `jax.checkpoint` when evaluated), scans over stacked
parameters unrolled into layers. The graph stage groups its equations into operators;
`OpGraph.evaluate` and `soapjax.graph._local` run them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend  # noqa: F401  (jax.extend must be imported explicitly)
import numpy as np
from jax.extend import core as jcore

from soapjax.base._dtypes import is_key
from soapjax.graph import _dims

_INLINED = ("jit", "pjit", "closed_call", "core_call")
_REMAT = ("remat2", "checkpoint")
# The user's own layout hints (`jax.lax.with_sharding_constraint`, `nn.with_logical_constraint`
# under a mesh): identities on the numbers, left out of the program (`Program.dropped`).
_LAYOUT_HINTS = ("sharding_constraint",)


@dataclasses.dataclass
class Unit:
    """One equation after inlining plain calls: its operands and results as value ids.

    Attributes:
      region: the remat regions it lies in, outermost first (indices of `Program.regions`).
      iteration: the unrolled layer-scan iterations it belongs to, outermost first, as
        ``(scan index, step)`` pairs (`Program.scans`).
    """

    eqn: jcore.JaxprEqn
    ins: list[int]
    outs: list[int | None]
    stack: str
    region: tuple[int, ...] = ()
    iteration: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass
class OperatorLabels:
    """One operator's own label analysis: enough to rebuild it at any shard shape."""

    units: tuple[int, ...]
    inputs: tuple[int, ...]  # value ids, in `Operator.inputs` order
    exports: tuple[int, ...]  # value ids, in `Operator.outputs` order
    labels: _dims.LabelSet
    lab: dict[int, tuple[int, ...]]  # value id -> labels
    env: dict  # inner jaxpr var -> labels (bodies of scan, remat2, custom_jvp_call, ...)
    iter_of: dict[int, int | None]  # canonical label -> iteration dim (None: never split)

    def dims_of(self, vid: int) -> tuple[int | None, ...]:
        """Per dim of value `vid` (one of this operator's), the iteration dim it follows
        (None: none); () for a value it has no labels of."""
        return tuple(self.labels.lookup(lb, self.iter_of) for lb in self.lab.get(vid, ()))

    def shard_shape(self, labels: Sequence[int], shape: Sequence[int],
                    degrees: Sequence[int]) -> tuple[int, ...]:
        out = []
        for lbl, size in zip(labels, shape):
            out.append(size // self._degree(lbl, size, degrees))
        return tuple(out)

    def _degree(self, lbl: int, size: int, degrees: Sequence[int]) -> int:
        """How many ways dim `lbl` (of extent `size`) is split: its iteration dim's degree, or,
        for a dim a reshape splits into iteration dims (a fused q projection reshaped to heads
        and head dims), the product of theirs."""
        degree = self.split_degree(lbl, degrees)
        return degree if size % degree == 0 else 1

    def split_degree(self, lbl: int, degrees: Sequence[int], depth: int = 0) -> int:
        d = self.labels.lookup(lbl, self.iter_of)
        if d is not None:
            return degrees[d]
        parts = self.labels.parts_of(lbl)
        if parts and depth < 4:  # a key projection split into kv heads that `repeat` merges
            return math.prod(self.split_degree(p, degrees, depth + 1) for p in parts)
        return self._merged_share(lbl, degrees)

    def _merged_share(self, lbl: int, degrees: Sequence[int]) -> int:
        """A dim merged by a reshape into an iteration dim (heads into the hidden dim after
        attention): its share of that dim's degree, the major parts split first."""
        ls = self.labels
        for whole, parts in ls.merged_into(lbl):
            d = ls.lookup(whole, self.iter_of)
            if d is None:
                continue
            left = degrees[d]
            for p in parts:
                share = math.gcd(left, ls.size[p])
                if ls.find(p) == ls.find(lbl):
                    return share
                left //= share
        return 1


class LayerScan(NamedTuple):
    """One unrolled layer scan, as value ids (`Program.layer_scans`; the same index as in
    `Program.scans`): what every layer reads and what flows from layer to layer, so a layer
    can be evaluated as a function of its own (`soapjax.apply._pipelined` does).

    Attributes:
      consts: the ids every layer reads unchanged (the scan's consts).
      carries: ``length + 1`` tuples: the carry the step at that position reads (in execution
        order: ``t = 0, 1, ...``, or ``length - 1, ...`` for a reverse scan), then the final carry.
      slices: per step, in execution order, its slices ``x[t]`` of the scanned inputs.
      ys: per step, in execution order, its per-iteration outputs (stacked after the loop).
      steps: the iteration index ``t`` of each step, in execution order.
      outer: the iterations of the scans around this one (``()`` at top level).
    """

    consts: tuple[int, ...]
    carries: tuple[tuple[int, ...], ...]
    slices: tuple[tuple[int, ...], ...]
    ys: tuple[tuple[int, ...], ...]
    steps: tuple[int, ...]
    outer: tuple[tuple[int, int], ...]


def recompute_in_backward(checkpointed: Callable) -> Callable:
    """`checkpointed` (a `jax.checkpoint`-ed function), whose recomputation cannot start before
    the backward pass reaches it.

    `jax.checkpoint` ties the recomputation to the saved inputs only, so a compiler is free to
    schedule it next to the forward pass: XLA:CPU does (measured on the tiny GPT, batch 64, 8
    layers: the recomputed layers ran beside the originals, their all-reduces merged, and the
    compiled step's temporaries did not fall at all). Here the backward rule passes the saved
    values and the incoming cotangent through one `lax.optimization_barrier`, so the recomputation
    depends on the cotangent and runs where the simulator prices it. Same values, same gradients.
    """

    @jax.custom_vjp
    def fn(*args):
        return checkpointed(*args)

    def fwd(*args):
        return jax.vjp(checkpointed, *args)  # (outputs, the vjp closure: a pytree of residuals)

    def bwd(vjp, cotangent):
        vjp, cotangent = jax.lax.optimization_barrier((vjp, cotangent))
        if jax.default_backend() == "cpu":
            vjp = _after(vjp, cotangent)
        return vjp(cotangent)

    fn.defvjp(fwd, bwd)
    return fn


def _after(saved, cotangent):
    """`saved` (its float arrays) made to depend on `cotangent` by a data edge no compiler folds:
    ``where(isnan(c), nan, x)`` with ``c`` the largest element of a cotangent is ``x`` exactly
    unless the cotangent already holds a NaN. XLA:CPU removes optimization barriers *before* it
    schedules (XLA's `OptimizationBarrierExpander` sits in the CPU pipeline before layout
    assignment; on GPU it runs after scheduling), so there only a real data edge keeps the
    recomputation in the backward pass. The largest element, not the first: of a cotangent
    split over devices, XLA gathered the whole array to take its first element (tiny Llama
    under tensor parallelism: one all-gather of the attention's cotangent per recomputed
    layer); a maximum is a local reduction and an all-reduce of one number."""
    leaves = [c for c in jax.tree.leaves(cotangent)
              if getattr(c, "size", 0) and jax.numpy.issubdtype(c.dtype, jax.numpy.floating)]
    if not leaves:
        return saved
    c = jax.numpy.max(leaves[0])
    nan = jax.numpy.isnan(c)

    def tie(x):
        if not jax.numpy.issubdtype(getattr(x, "dtype", None) or int, jax.numpy.floating):
            return x
        return jax.numpy.where(nan, jax.numpy.asarray(jax.numpy.nan, x.dtype), x)

    return jax.tree.map(tie, saved)


class Program:
    """The traced function with calls inlined, as equations over integer value ids: the program
    representation of an `OpGraph` (`OpGraph.program`), which its operators' equations index.

    Three kinds of higher-order equations are opened up, so that the operators inside them are
    planned one by one:

    * plain calls (`jit`, `closed_call`): inlined;
    * `remat2` (`jax.checkpoint`, `nn.remat`, `nnx.remat`): inlined as a *region*; `run`
      evaluates a region's equations inside `jax.checkpoint` with the traced policy, so what is
      saved and recomputed is what the user asked for;
    * a *layer scan* (a `scan` that slices parameters: `nn.scan` over a block, `nnx.scan` over
      `nnx.vmap`-created layers, `nn.remat_scan`): unrolled, each iteration's parameter slice
      taken by `lax.index_in_dim` and the per-iteration outputs stacked, which computes what
      the scan computes. Its operators are named like unrolled layers (``layers_0/fc1``).

    Other loops (an LSTM's scan over time) stay one equation: one loop operator. The user's
    own sharding constraints (``with_sharding_constraint``) are left out, outside loops
    (`dropped` counts them): the plan sets the layouts.
    """

    def __init__(self, closed: jcore.ClosedJaxpr, param_inputs: frozenset[int] = frozenset()):
        self.local: dict[str, OperatorLabels] = {}
        self.regions: list[Mapping[str, Any]] = []  # the remat2 params of each region
        self.scans: list[tuple[int, ...]] = []  # each unrolled scan's sliced inputs (value ids)
        self.layer_scans: list[LayerScan] = []  # the same scans' steps, as `LayerScan`s
        self.param_like: set[int] = set()  # parameter leaves and their layer slices
        self.slice_units: set[int] = set()  # units that take a layer's slice (no operator)
        self.slice_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # slice -> (stacked, index)
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[str] = []
        self.jax_dtypes: list[Any] = []
        self.literals: dict[int, Any] = {}
        self.units: list[Unit] = []
        self.consts: dict[int, Any] = {}
        # the user's sharding constraints left out (`_LAYOUT_HINTS`): the plan sets the layouts,
        # and a constraint names the user's mesh, which the step's and the reference's need not be
        self.dropped: int = 0
        env: dict[jcore.Var, int] = {}
        for v, c in zip(closed.jaxpr.constvars, closed.consts):
            env[v] = self._new(v)
            self.consts[env[v]] = c
        self.inputs = [self._bind(env, v) for v in closed.jaxpr.invars]
        self.param_like.update(self.inputs[i] for i in param_inputs)
        self._flatten(closed.jaxpr, env, "", (), ())
        self.outputs = [self._read(env, v) for v in closed.jaxpr.outvars]
        self._drop_dead()

    def _drop_dead(self) -> None:
        """Removes the equations the result does not depend on, as XLA does: a cache the loss
        never reads, a log-sum-exp's sign. Kept, they would be evaluated, and one reading a
        value inside an operator that apply computes at once would find no value there.

        An equation of an unrolled layer stays while the same equation of another layer is
        live (a carry only the last layer's result reads), so that every layer keeps one body.
        """
        units = self.units
        sibling: dict[int, tuple] = {}  # unit -> its position in every layer's body
        ordinal: dict[tuple, int] = {}
        for i, u in enumerate(units):
            if u.iteration:
                k = ordinal[u.iteration] = ordinal.get(u.iteration, -1) + 1
                sibling[i] = (tuple(scan for scan, _ in u.iteration), k)
        live = [False] * len(units)
        while True:
            needed = set(self.outputs)
            for i in reversed(range(len(units))):
                u = units[i]
                if live[i] or u.eqn.effects or any(v in needed for v in u.outs if v is not None):
                    live[i] = True
                    needed.update(u.ins)
            kept = {sibling[i] for i in sibling if live[i]}
            more = [i for i in sibling if not live[i] and sibling[i] in kept]
            if not more:
                break
            for i in more:
                live[i] = True
        if all(live):
            return
        index = {i: k for k, i in enumerate(i for i in range(len(units)) if live[i])}
        self.units = [u for u, keep in zip(units, live) if keep]
        self.slice_units = {index[i] for i in self.slice_units if i in index}

    def _new(self, v) -> int:
        self.shapes.append(_dims.shape_of(v))
        dtype = getattr(v.aval, "dtype", np.dtype("float32"))
        self.dtypes.append(str(dtype))
        self.jax_dtypes.append(dtype)  # PRNG key dtypes have no numpy name to rebuild them from
        return len(self.shapes) - 1

    def _bind(self, env, v) -> int:
        env[v] = self._new(v)
        return env[v]

    def _read(self, env, v) -> int:
        if isinstance(v, jcore.Literal):
            vid = self._new(v)
            self.literals[vid] = v.val
            return vid
        return env[v]

    def _flatten(self, jaxpr: jcore.Jaxpr, env: dict, outer_stack: str,
                 region: tuple[int, ...], iteration: tuple[tuple[int, int], ...]) -> None:
        for eqn in jaxpr.eqns:
            stack = "/".join(s for s in (outer_stack, str(eqn.source_info.name_stack)) if s)
            ins = [self._read(env, v) for v in eqn.invars]
            name = eqn.primitive.name
            if name in _INLINED or name in _REMAT:
                if name in _REMAT:
                    self.regions.append(eqn.params)
                    inner_region = region + (len(self.regions) - 1,)
                else:
                    inner_region = region
                sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                outs = self._inline(sub, ins, stack, inner_region, iteration)
                self._assign(env, eqn.outvars, outs)
            elif name == "scan" and self._is_layer_scan(eqn, ins):
                self._assign(env, eqn.outvars, self._unroll(eqn, ins, stack, region, iteration))
            elif name in _LAYOUT_HINTS:
                self.dropped += 1
                self._assign(env, eqn.outvars, ins)
            else:
                outs = [None if isinstance(v, jcore.DropVar) else self._bind(env, v)
                        for v in eqn.outvars]
                self.units.append(Unit(eqn, ins, outs, stack, region, iteration))

    def _inline(self, sub, ins: Sequence[int], stack: str, region, iteration) -> list[int]:
        """Flattens a (closed) jaxpr applied to value ids `ins`; returns its outputs' ids."""
        inner, consts = (sub.jaxpr, sub.consts) if isinstance(sub, jcore.ClosedJaxpr) else (sub, ())
        ienv: dict = {}
        for v, c in zip(inner.constvars, consts):
            self.consts[self._bind(ienv, v)] = c
        for v, vid in zip(inner.invars, ins):
            ienv[v] = vid
        self._flatten(inner, ienv, stack, region, iteration)
        return [self._read(ienv, v) for v in inner.outvars]

    def _assign(self, env: dict, outvars, vids: Sequence[int]) -> None:
        for v, vid in zip(outvars, vids):
            if not isinstance(v, jcore.DropVar):
                env[v] = vid

    def _is_layer_scan(self, eqn, ins: Sequence[int]) -> bool:
        """A scan over stacked parameters (layers), not over time."""
        first_x = sum(_dims.scan_counts(eqn.params))
        return any(v in self.param_like for v in ins[first_x:])

    def _unroll(self, eqn, ins: Sequence[int], stack: str, region, iteration) -> list[int]:
        p = eqn.params
        (nc, nk), length = _dims.scan_counts(p), p["length"]
        consts, carry, xs = list(ins[:nc]), list(ins[nc:nc + nk]), list(ins[nc + nk:])
        scan = len(self.scans)
        self.scans.append(tuple(xs))
        ys: dict[int, list[int]] = {}
        steps = tuple(reversed(range(length))) if p["reverse"] else tuple(range(length))
        carries, slices = [tuple(carry)], []
        for t in steps:
            it = iteration + ((scan, t),)
            x_t = [self._index(x, t, stack, region, it) for x in xs]
            outs = self._inline(p["jaxpr"], consts + carry + x_t, stack, region, it)
            carry, ys[t] = outs[:nk], outs[nk:]
            carries.append(tuple(carry))
            slices.append(tuple(x_t))
        self.layer_scans.append(LayerScan(tuple(consts), tuple(carries), tuple(slices),
                                          tuple(tuple(ys[t]) for t in steps), steps, iteration))
        stacked = [self._stack([ys[t][k] for t in range(length)], stack, region, iteration)
                   for k in range(len(eqn.outvars) - nk)]
        return carry + stacked

    def _index(self, vid: int, t: int, stack: str, region, iteration) -> int:
        """Emits ``x[t]`` (static slices of the leading dims) and returns its value id.

        A slice of a slice (`nn.remat_scan`'s nested scans) is taken from the stacked
        parameter itself, ``x[t0][t1]`` as ``w[t0, t1]``, so every iteration's operators read
        the parameter, not another iteration's slice of it.
        """
        root, index = self._slice_root(vid)
        index = index + (t,)
        aval = jax.ShapeDtypeStruct(self.shapes[root], self.jax_dtypes[root])

        def take(a):
            for k in index:
                a = jax.lax.index_in_dim(a, k, 0, keepdims=False)
            return a

        first = len(self.units)
        out = self._inline(jax.make_jaxpr(take)(aval), [root], stack, region, iteration)[0]
        self.slice_units.update(range(first, len(self.units)))
        if root in self.param_like:
            self.param_like.add(out)
        self.slice_of[out] = (root, index)  # (a value computed before the scan: its slice too)
        return out

    def _slice_root(self, vid: int) -> tuple[int, tuple[int, ...]]:
        return self.slice_of.get(vid, (vid, ()))

    def _stack(self, vids: Sequence[int], stack: str, region, iteration) -> int:
        """Emits ``jnp.stack(values)`` (a scan's stacked per-iteration outputs)."""
        avals = [jax.ShapeDtypeStruct(self.shapes[v], self.jax_dtypes[v]) for v in vids]
        closed = jax.make_jaxpr(lambda *a: jax.numpy.stack(a))(*avals)
        return self._inline(closed, list(vids), stack, region, iteration)[0]

    def run(self, flat_inputs, hook=None, swaps: Mapping[int, tuple] | None = None,
            checkpoints: Mapping[int, Collection[int]] | None = None, keys=None,
            reads: Mapping[int, Sequence[tuple]] | None = None,
            pins: Mapping[int, Callable[[Any], Any]] | None = None) -> list:
        """Evaluates the program and returns the outputs' values.

        `swaps` maps an operator's last unit index to ``(its unit indices, fn, input ids,
        output ids)``: those units are skipped, and at the last one ``fn(*inputs)`` gives the
        outputs instead. Remat regions run inside `jax.checkpoint` with their traced policy.
        `checkpoints` maps a first unit index to the units of one group (outside any remat
        region), which run inside one `jax.checkpoint` saving nothing (recomputation,
        `soapjax.strategy.memory`); other units between the group's first and last run before
        the checkpoint, or after it where they read what the group makes
        (`_checkpoint_order`), so the checkpoint recomputes the group and nothing else.
        `keys`, when given, maps every PRNG key the program makes from constants (a typed-key
        constant, the result of `random_seed` or `random_wrap`) to the key to use instead
        (apply folds the step number in, so dropout draws fresh masks every step).
        `reads` maps a unit index to ``(position, key, fn)`` triples: the unit reads
        ``fn(value)`` at that operand position instead of the value, computed once per value and
        `key` (where that value is in scope) for every unit given the same key. `pins` maps a
        value id to a function applied to the value where it enters one of `checkpoints` from
        outside: what the checkpoint saves for its recomputation (apply keeps a parameter there
        in its stored layout, so the recomputation gathers it again).
        """
        env = dict(self.consts)
        if keys is not None:
            env.update((v, keys(c)) for v, c in self.consts.items() if is_key(str(c.dtype)))
            hook = _key_hook(self, hook, keys)
        env.update(self.literals)
        env.update(zip(self.inputs, flat_inputs))
        swaps = dict(swaps or {})
        skip = frozenset().union(*(sw[0] for sw in swaps.values())) if swaps else frozenset()
        order, spans = self._checkpoint_order(checkpoints or {}, swaps, skip)
        self._run_block(order, 0, env, hook, swaps, skip, spans, reads, pins)
        return [env[v] for v in self.outputs]

    def _warn_not_recomputed(self, group: frozenset[int]) -> None:
        names = sorted({name for name, loc in self.local.items() if group & set(loc.units)})
        warnings.warn(
            f"the plan recomputes {len(names)} operator(s) ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}) whose equations interleave with another "
            f"recomputed segment's, so that no checkpoint can hold them alone: they run without "
            f"recomputation and keep their activations, more memory than the plan's "
            f"prediction; recompute both segments' operators alike to avoid it", stacklevel=4)

    def _checkpoint_order(self, checkpoints: Mapping[int, Collection[int]],
                          swaps: Mapping[int, tuple], skip: frozenset[int]
                          ) -> tuple[list[int], dict[int, frozenset]]:
        """The units in the order `run` runs them, and each checkpoint's first unit -> the
        units its `jax.checkpoint` runs (contiguous in that order).

        Between a group's first and last unit the program may run other operators' units
        (a grouped-query attention's key and value projections between the queries' scaling
        and the scores; a later layer's scalar, traced where the layer before ends): run
        inside the checkpoint, they would be recomputed in the backward pass, with the gathers
        of their inputs, where the group alone recomputes. So the units of the span that read
        nothing the group makes (through units of the span) run before it, the group runs in
        one checkpoint, and the rest after it; groups are taken in program order, and an
        earlier group's checkpoint moves whole. A unit replaced by an operator's function
        (`swaps`) reads and makes that operator's values (its other units, `skip`, nothing).
        A span whose group reads a value made after the group's start by a unit that itself
        reads the group's (the two interleaved both ways) runs all of its units inside the
        checkpoint; a group that would cut an earlier checkpoint in two, or whose span holds
        a remat region, recomputes nothing."""
        order = list(range(len(self.units)))
        pos = {u: u for u in order}
        spans: dict[int, frozenset] = {}
        block_of: dict[int, int] = {}  # a unit in a checkpoint -> that checkpoint's key
        for first in sorted(checkpoints):
            group = frozenset(checkpoints[first])
            if any(k in block_of for k in group):
                continue
            lo, hi = min(pos[k] for k in group), max(pos[k] for k in group)
            span = order[lo:hi + 1]
            if any(self.units[k].region for k in span):
                continue
            tainted, made_after, before, after, crossed = set(), set(), [], [], False
            for k in span:
                ins, outs = ((swaps[k][2], swaps[k][3]) if k in swaps else ((), ()) if k in skip
                             else (self.units[k].ins, self.units[k].outs))
                made = {v for v in outs if v is not None}
                if k in group:
                    crossed = crossed or any(v in made_after for v in ins)
                    tainted |= made
                elif any(v in tainted for v in ins):
                    after.append(k)
                    tainted |= made
                    made_after |= made
                else:
                    before.append(k)
            earlier = {block_of[k] for k in span if k in block_of}
            if crossed:
                if not earlier:
                    spans[span[0]] = frozenset(span)
                    block_of.update((k, span[0]) for k in span)
                continue
            late = {block_of[k] for k in after if k in block_of}
            if late & {block_of[k] for k in before if k in block_of}:
                self._warn_not_recomputed(group)  # an earlier checkpoint would be cut in two
                continue
            body = [k for k in span if k in group]
            order[lo:hi + 1] = before + body + after
            pos.update((k, lo + i) for i, k in enumerate(order[lo:hi + 1]))
            spans[body[0]] = frozenset(body)
            block_of.update((k, body[0]) for k in body)
        return order, spans

    def run_units(self, idxs: Sequence[int], env: dict,
                  calls: Mapping[int, Callable[..., Sequence]] | None = None,
                  hook: Callable[[int, Any], Any] | None = None,
                  reads: Mapping[int, Sequence[tuple]] | None = None) -> None:
        """Evaluates units `idxs` (in program order) into `env` (value id -> value), which must
        hold their inputs (`consts` and `literals` included); remat regions run inside
        `jax.checkpoint` as in `run`. A part of the program as a function of its own: the
        prologue, one layer, the epilogue (`soapjax.apply._pipelined`). `calls` maps a unit to a
        function of its operands that computes its results instead; `hook` is called as
        ``hook(value id, value)`` on every value made, and what it returns is kept instead
        (apply constrains operator outputs to their layouts there); `reads` as in `run` (apply
        constrains operands there)."""
        swaps = self.unit_swaps(calls or {})
        self._run_block(list(idxs), 0, env, hook, swaps, frozenset(swaps), reads=reads)

    def unit_swaps(self, calls: Mapping[int, Callable[..., Sequence]]
                   ) -> dict[int, tuple[frozenset[int], Callable, list[int], list[int]]]:
        """`calls` (unit -> a function of its operands returning its results) as `run`'s
        ``swaps`` entries: each unit replaced alone."""
        return {i: (frozenset({i}), fn, list(self.units[i].ins), list(self.units[i].outs))
                for i, fn in calls.items()}

    def _run_block(self, idxs: list[int], depth: int, env: dict, hook, swaps, skip,
                   checkpoints: Mapping[int, frozenset[int]] | None = None, reads=None,
                   pins=None) -> None:
        i = 0
        while i < len(idxs):
            span = checkpoints.get(idxs[i]) if checkpoints else None
            if span is not None:
                j = i
                while j < len(idxs) and idxs[j] in span:
                    j += 1
                # no remat region in a span: `_checkpoint_order` leaves such groups out
                self._run_checkpointed(idxs[i:j], depth, env, hook, swaps, skip,
                                       {"policy": jax.checkpoint_policies.nothing_saveable},
                                       in_backward=True, reads=reads, pins=pins)
                i = j
                continue
            region = self.units[idxs[i]].region
            if len(region) > depth:  # a nested remat region: as far as it goes
                j = i
                inside = region[:depth + 1]
                while j < len(idxs) and self.units[idxs[j]].region[:depth + 1] == inside:
                    j += 1
                self._run_region(idxs[i:j], depth, region[depth], env, hook, swaps, skip,
                                 reads)
                i = j
                continue
            self._run_unit(idxs[i], env, hook, swaps, skip, reads)
            i += 1

    def _run_region(self, idxs: list[int], depth: int, r: int, env: dict, hook, swaps, skip,
                    reads=None):
        self._run_checkpointed(idxs, depth + 1, env, hook, swaps, skip, self.regions[r],
                               reads=reads, hold_inputs=True)

    def _run_checkpointed(self, idxs: list[int], depth: int, env: dict, hook, swaps, skip,
                          p: Mapping[str, Any], in_backward: bool = False, reads=None,
                          pins=None, hold_inputs: bool = False) -> None:
        """Units `idxs` inside `jax.checkpoint` with remat params `p`, the body at `depth`;
        `in_backward`: the recomputation waits for the cotangent (`recompute_in_backward`);
        `pins`: see `run`; `hold_inputs` (a model's own remat region): the region's inputs
        pass `hook` again inside the checkpoint, so that its recomputation in the backward
        reads each operator's output in the layout the operator gives it. Left to XLA, the
        recomputation took a value in the layout of its first reader inside the region: the
        corpus RWKV's block input, whole, saved as the batch slice its first norm reads and
        gathered again for the residual add (docs/checks.md)."""
        block = set(idxs)
        made = {v for i in idxs for v in self.units[i].outs if v is not None}
        ins = sorted({v for i in idxs for v in self.units[i].ins
                      if v not in made and v not in self.consts and v not in self.literals})
        used_after = set(self.outputs).union(*(self.units[k].ins for k in range(len(self.units))
                                               if k not in block))
        outs = sorted(made & used_after)

        def body(*vals):
            local = dict(self.consts)
            local.update(self.literals)
            local.update((v, hook(v, x)) if hold_inputs and hook is not None else (v, x)
                         for v, x in zip(ins, vals))
            self._run_block(idxs, depth, local, hook, swaps, skip, reads=reads)
            return [local[v] for v in outs]

        fn = jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True), policy=p.get("policy"))
        pins = pins or {}
        vals = (recompute_in_backward(fn) if in_backward else fn)(
            *(pins[v](env[v]) if v in pins else env[v] for v in ins))
        env.update(zip(outs, vals))

    def _run_unit(self, i: int, env: dict, hook, swaps, skip, reads=None) -> None:
        if i in skip:
            if i in swaps:
                _, fn, ins, outs = swaps[i]
                for vid, val in zip(outs, fn(*(env[v] for v in ins))):
                    env[vid] = hook(vid, val) if hook is not None else val
            return
        u = self.units[i]
        args = [env[v] for v in u.ins]
        for pos, key, fn in (reads.get(i, ()) if reads else ()):
            slot = ("read", u.ins[pos], key)  # not a value id: ids are ints
            if slot not in env:
                env[slot] = fn(args[pos])
            args[pos] = env[slot]
        for vid, val in zip(u.outs, bind_as_traced(u.eqn, args)):
            if vid is not None:
                env[vid] = hook(vid, val) if hook is not None else val


KEY_MAKERS = ("random_seed", "random_wrap")


def _key_hook(program: Program, hook, keys):
    """`hook`, with `keys` applied first to the outputs of the units that make keys."""
    made = {v for u in program.units if u.eqn.primitive.name in KEY_MAKERS
            for v in u.outs if v is not None}

    def both(vid, val):
        val = keys(val) if vid in made else val
        return hook(vid, val) if hook is not None else val

    return both



def bind_as_traced(eqn: jcore.JaxprEqn, args: Sequence[Any]) -> list[Any]:
    """Binds one equation with its traced parameters (custom derivative rules intact)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    with eqn.ctx.manager:
        ans = eqn.primitive.bind(*subfuns, *args, **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def shifted_dims(eqn: Any) -> list[tuple[int, ...]]:
    """Per operand of `eqn`, the dims it indexes, slices, pads or concatenates along (empty
    where none). Split there inside a pipeline stage, XLA moves the slices' halos between a
    stage's devices with a collective-permute (a gather aborts), which inside a stage's action
    hangs (`soapjax.apply._pipelined.check_compiled`); whole there, the stage gathers them
    instead (and `soapjax.simulate.pipesim` prices that gather)."""
    name, p = eqn.primitive.name, eqn.params
    shape = getattr(eqn.invars[0].aval, "shape", ()) if eqn.invars else ()
    if name == "gather":
        return [tuple(p["dimension_numbers"].start_index_map)]
    if name == "split":
        return [(p["axis"],)]
    if name == "slice":
        return [tuple(d for d, n in enumerate(shape)
                      if p["start_indices"][d] != 0 or p["limit_indices"][d] != n
                      or (p["strides"] or (1,) * len(shape))[d] != 1)]
    if name == "pad":
        return [tuple(d for d, c in enumerate(p["padding_config"]) if c != (0, 0, 0))]
    if name == "concatenate":
        return [(p["dimension"],)] * len(eqn.invars)
    if name == "rev":
        return [tuple(p["dimensions"])]
    if name in ("dynamic_slice", "dynamic_update_slice"):
        sizes = p["slice_sizes"] if name == "dynamic_slice" else eqn.invars[1].aval.shape
        return [tuple(d for d, n in enumerate(shape) if sizes[d] != n)]
    return []


def picked_dim(eqn: Any) -> int | None:
    """The dim a gather picks one element along per index, where `eqn` is such a gather
    (``jnp.take_along_axis`` with one index per position: the loss's pick of the labels'
    log-probabilities), else None. Each of its operand's other dims is a batch dim of the
    indices or taken whole (a dim of size 1 is), the indices' other dims are of size 1: the
    pick is a masked sum along that dim (`soapjax.apply._pipelined`: split along it, each
    device sums its part and an all-reduce of the picked values adds them, as Megatron-LM's
    vocabulary-parallel loss does)."""
    if eqn.primitive.name != "gather" or len(eqn.invars) != 2:
        return None
    dtype = eqn.invars[0].aval.dtype
    if is_key(dtype) or not jax.dtypes.issubdtype(dtype, np.number):  # booleans: no sum
        return None
    p = eqn.params
    dn, shape = p["dimension_numbers"], eqn.invars[0].aval.shape
    index_shape, sizes = eqn.invars[1].aval.shape, p["slice_sizes"]
    if (len(dn.start_index_map) != 1 or tuple(dn.collapsed_slice_dims) != tuple(dn.start_index_map)
            or not index_shape or index_shape[-1] != 1
            or p["mode"].name not in ("FILL_OR_DROP", "CLIP", "PROMISE_IN_BOUNDS")):
        return None
    d = dn.start_index_map[0]
    batch = dn.operand_batching_dims
    if (sizes[d] != 1 or list(batch) != sorted(batch)
            or any(sizes[k] != (1 if k in batch else shape[k]) for k in range(len(shape)) if k != d)
            or any(n != 1 for j, n in enumerate(index_shape[:-1])
                   if j not in dn.start_indices_batching_dims)):
        return None
    return d
