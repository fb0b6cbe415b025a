"""The operator graph: a traced forward pass grouped into operators with dim roles.

`trace(loss_fn, params, batch)` traces the function to a jaxpr, inlines plain function calls
(`jit`, `closed_call`), and groups the equations into *operators* around anchor primitives
(`dot_general`, `conv_general_dilated`, embedding `gather`, `reduce_window_*`, `scan`, ...),
folding the cheap elementwise, broadcast and reshape equations next to an anchor into it, as
XLA's fusion would. Each operator is named by its Flax module path (from the equations'
`source_info.name_stack`, or from the parameters it reads when the name stack is empty, as in
`flax.nnx`), for example `layers_3/mlp/fc1`.

Every operator has *iteration dims*: the dims of its output, then its splittable reduction dims
(a matmul's contracting dim, a convolution's input channels). A config of the operator assigns
mesh axes to iteration dims; each operand records which iteration dim each of its dims follows
(`Operand.dims`), so the shard shape of every input and the sharding of every parameter follow
from the config. Output dims carry the paper's roles (Table 1):

* ``S`` sample: follows the batch dim (dim 0) of the batch inputs;
* ``P`` parameter: splitting it splits a parameter;
* ``A`` attribute: any other divisible dim (sequence, height, width);
* ``-`` not divisible (size 1, a scan's iteration axis, a repeated dim).

Example::

    g = trace(loss_fn, params, batch)
    op = g.operator("fc1")
    op.shape, op.roles, op.reduction_dims   # (256, 4096), ('S', 'P'), (ReductionDim(784, 'P'),)
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.extend  # noqa: F401  (jax.extend must be imported explicitly)
import numpy as np
from jax.extend import core as jcore

from soapjax import _dims
from soapjax._dtypes import itemsize
from soapjax.errors import TraceError

Role = Literal["S", "A", "P", "-"]
OperandKind = Literal["activation", "param", "batch", "const"]

# Primitives an operator is built around, strongest first (an equation that contains one of
# them, e.g. a remat2 or custom_jvp_call around a matmul, is anchored on it).
_ANCHORS = ("scan", "while", "cond", "conv_general_dilated", "dot_general", "reduce_window_max",
            "reduce_window_sum", "reduce_window_min", "reduce_window", "select_and_gather_add",
            "sort", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "fft",
            "scatter", "scatter-add", "scatter_add", "dynamic_update_slice")
# Anchors whose operator holds a loop: its body's communication, if split, is per iteration.
LOOP_ANCHORS = ("scan", "while")
# Anchors only when they start a new module: a reduction opening a layer norm or a loss starts
# an operator, one inside a softmax folds into the matmul before it. A gather that reads a
# parameter (an embedding lookup) is a full anchor.
_SOFT_ANCHORS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
                 "reduce_and", "reduce_or", "gather", "psum")
# Cheap primitives folded into their neighbours (XLA fuses them).
_CHEAP = frozenset("""
add sub mul div rem pow integer_pow max min neg sign floor ceil round is_finite exp exp2 log
log1p expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt
rsqrt cbrt abs erf erfc erf_inv lgamma digamma square eq ne lt le gt ge and or not xor select_n
clamp convert_element_type bitcast_convert_type nextafter shift_left shift_right_logical
shift_right_arithmetic population_count real imag conj complex stop_gradient copy copy_p
broadcast_in_dim reshape squeeze expand_dims transpose rev slice dynamic_slice concatenate stack pad
iota split sharding_constraint mesh_cast reduce_precision random_seed random_bits random_split
random_fold_in random_wrap random_unwrap threefry2x32 custom_jvp_call custom_vjp_call remat2
checkpoint pjit jit closed_call optimization_barrier
""".split())
_INLINED = ("jit", "pjit", "closed_call", "core_call")
_REMAT = ("remat2", "checkpoint")
# Name-stack entries that are module names (not `jit(...)` or an einsum's `...qhd,...khd->...`).
_MODULE_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_PARAM_LEAF_NAMES = ("value",)  # nnx.Variable's attribute in state paths


@dataclasses.dataclass(frozen=True)
class ReductionDim:
    """A splittable reduction dim of an operator (splitting it leaves partial sums).

    Attributes:
      size: its extent.
      role: the role of the dim it reduces (``P`` for a matmul's contracting dim against a
        weight, ``S`` for a loss's mean over the batch, ``A`` otherwise).
    """

    size: int
    role: Role


@dataclasses.dataclass(frozen=True)
class Operand:
    """One input of an operator.

    Attributes:
      kind: ``activation`` (another operator's output), ``param``, ``batch`` or ``const``.
      source: the producing operator's name, or the pytree path of the parameter/batch leaf.
      index: for an activation, which of the producer's `outputs` it is; else 0.
      shape: its global shape.
      dtype: its dtype name.
      dims: for each of its dims, the operator's iteration dim it follows, or None when every
        device needs it whole along that dim.
      value: the value's id in the traced program (used to evaluate and constrain it).
      layer: for one layer's slice of a stacked parameter (a scan over layers), its index
        along the stacked leading dims; `source` then ends with it (``...['kernel'][3]``),
        and `shape` is the slice's.
    """

    kind: OperandKind
    source: str
    index: int
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]
    value: int
    layer: tuple[int, ...] = ()

    @property
    def leaf_path(self) -> str:
        """The pytree path of the parameter or batch leaf (without the layer index)."""
        suffix = "".join(f"[{i}]" for i in self.layer)
        return self.source[: len(self.source) - len(suffix)] if suffix else self.source

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class OutputTensor:
    """A value an operator hands to other operators (or returns from the function).

    Attributes:
      shape: global shape.
      dtype: dtype name.
      dims: for each dim, the operator's iteration dim it follows, or None (replicated).
      value: the value's id in the traced program.
    """

    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]
    value: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Operator:
    """One node of the operator graph.

    Attributes:
      name: unique name from the Flax module path, e.g. ``layers_3/mlp/fc1``.
      module: the module path alone ('' for code outside any module).
      anchor: the primitive the operator is built around.
      shape: the shape of its (primary) output, `outputs[0]`.
      dtype: the dtype of that output.
      roles: one role per output dim.
      reduction_dims: its splittable reduction dims; iteration dim ``len(shape) + k`` is
        ``reduction_dims[k]``.
      flops: forward FLOPs.
      bytes_accessed: bytes read and written by the fused operator (operands and outputs).
      inputs: its operands, activations first in program order.
      outputs: the values it exports; `outputs[0]` is the primary output.
      num_equations: how many (inlined) equations were grouped into it.
      replicate_only: built around a primitive soapjax does not understand: never split.
      block_position: for an operator of one iteration of a scan over layers, its name with
        the layer index replaced by ``*`` (``layers_*/fc1``): the operators of the same
        position in every layer, which share one config (the paper's repeated blocks); ''
        otherwise.
      granularity: for each iteration dim, the greatest common divisor of the extents it
        takes inside the operator (rotary embeddings slice a head dim of 8 into halves of 4:
        4); a split must divide it, or the shards would need data from each other. () means
        `iteration_sizes`.
    """

    name: str
    module: str
    anchor: str
    shape: tuple[int, ...]
    dtype: str
    roles: tuple[Role, ...]
    reduction_dims: tuple[ReductionDim, ...]
    flops: float
    bytes_accessed: float
    inputs: tuple[Operand, ...]
    outputs: tuple[OutputTensor, ...]
    num_equations: int
    replicate_only: bool = False
    block_position: str = ""
    granularity: tuple[int, ...] = ()

    @property
    def split_sizes(self) -> tuple[int, ...]:
        """The sizes a split's degree must divide, per iteration dim (see `granularity`)."""
        return self.granularity or self.iteration_sizes

    @property
    def iteration_sizes(self) -> tuple[int, ...]:
        """Sizes of the iteration dims: output dims, then reduction dims."""
        return self.shape + tuple(r.size for r in self.reduction_dims)

    @property
    def iteration_roles(self) -> tuple[str, ...]:
        """Roles of the iteration dims; reduction dims read ``R``."""
        return self.roles + ("R",) * len(self.reduction_dims)

    @property
    def is_loop(self) -> bool:
        """Built around a loop (``scan``, ``while``): an LSTM layer, say."""
        return self.anchor in LOOP_ANCHORS

    @property
    def divisible_dims(self) -> tuple[int, ...]:
        """The iteration dims a config may split.

        A loop operator splits only its sample dims. Splitting any other dim (an LSTM's hidden
        dim, its input contraction) makes XLA communicate inside the loop body at every step:
        on rnnlm (tiny, 8 CPU devices, hidden split 4 ways) one step moved 449 KB where the
        operator-level model sees 52 KB (`soapjax check`), since the partial sums, gate
        relayouts and weight gradients are all synchronised per iteration. The simulator does
        not price communication inside an operator, so the space leaves those splits out.
        """
        if self.replicate_only:
            return ()
        return tuple(i for i, (r, s) in enumerate(zip(self.iteration_roles, self.split_sizes))
                     if r != "-" and s > 1 and (r == "S" or not self.is_loop))

    @property
    def params(self) -> tuple[str, ...]:
        """Pytree paths of the parameters it reads."""
        return tuple(o.source for o in self.inputs if o.kind == "param")

    @property
    def param_bytes(self) -> int:
        return sum(o.nbytes for o in self.inputs if o.kind == "param")


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """A parameter or batch leaf of the traced function: pytree path, shape, dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    value: int


@dataclasses.dataclass(frozen=True)
class OpGraph:
    """The operators of a traced function, in topological order.

    Attributes:
      name: the model's name.
      operators: the operators, producers before consumers.
      num_equations: equations in the traced jaxpr, nested bodies included.
      params: the parameter leaves, in flattening order.
      batch: the batch leaves, in flattening order.
      unsupported: primitives soapjax did not understand (their operators are replicate-only).
    """

    name: str
    operators: tuple[Operator, ...]
    num_equations: int
    params: tuple[LeafInfo, ...]
    batch: tuple[LeafInfo, ...]
    unsupported: tuple[str, ...]
    program: _Program = dataclasses.field(compare=False, hash=False, repr=False)

    def operator(self, name: str) -> Operator:
        """The operator called `name`; raises KeyError naming close matches."""
        for op in self.operators:
            if op.name == name:
                return op
        near = difflib.get_close_matches(name, [o.name for o in self.operators], n=3)
        hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
        raise KeyError(f"no operator {name!r} in graph {self.name!r}{hint}")

    def index(self, name: str) -> int:
        return self.operators.index(self.operator(name))

    def repeated_blocks(self) -> list[list[int]]:
        """Indices of operators at the same position of every layer of a scan over layers
        (equal `Operator.block_position`, equal iteration dims), in groups of two or more."""
        groups: dict[tuple, list[int]] = {}
        for i, op in enumerate(self.operators):
            if op.block_position:
                key = (op.block_position, op.iteration_sizes, op.iteration_roles, op.anchor)
                groups.setdefault(key, []).append(i)
        return [g for g in groups.values() if len(g) > 1]

    @property
    def batch_size(self) -> int:
        return self.batch[0].shape[0]

    def edges(self) -> list[tuple[int, int, Operand]]:
        """(producer index, consumer index, operand) for every activation edge."""
        pos = {op.name: i for i, op in enumerate(self.operators)}
        return [(pos[o.source], j, o) for j, op in enumerate(self.operators)
                for o in op.inputs if o.kind == "activation"]

    def fingerprint(self) -> str:
        """A stable hash of names, shapes, roles and edges (for plan files)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        """The graph as JSON-ready data (`soapjax graph --json`)."""
        ops = []
        for op in self.operators:
            ops.append({
                "name": op.name, "module": op.module, "anchor": op.anchor,
                "shape": list(op.shape), "dtype": op.dtype, "roles": "".join(op.roles),
                "reduction_dims": [{"dim": len(op.shape) + k, "size": r.size, "role": r.role}
                                   for k, r in enumerate(op.reduction_dims)],
                "flops": op.flops, "bytes_accessed": op.bytes_accessed,
                "param_bytes": op.param_bytes, "params": list(op.params),
                "replicate_only": op.replicate_only, "num_equations": op.num_equations,
            })
        tensors = [{"src": self.operators[i].name, "dst": self.operators[j].name,
                    "shape": list(o.shape), "dtype": o.dtype} for i, j, o in self.edges()]
        return {"model": self.name, "num_equations": self.num_equations,
                "num_operators": len(self.operators), "batch_size": self.batch_size,
                "operators": ops, "tensors": tensors, "unsupported": list(self.unsupported)}

    def table(self) -> str:
        """A readable operator table (`soapjax graph`)."""
        rows = [("operator", "anchor", "output (roles)", "R dims", "GFLOP", "param MB")]
        for op in self.operators:
            shape = "[" + ",".join(f"{s}{r}" for s, r in zip(op.shape, op.roles)) + "]"
            red = ",".join(f"{r.size}" for r in op.reduction_dims) or "-"
            rows.append((op.name + (" (replicate only)" if op.replicate_only else ""), op.anchor,
                         shape, red, f"{op.flops / 1e9:.3f}", f"{op.param_bytes / 2**20:.2f}"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if k < 4 else c.rjust(w) for k, (c, w) in
                           enumerate(zip(r, widths))) for r in rows]
        total = sum(op.flops for op in self.operators)
        lines.append(f"{self.name}: {len(self.operators)} operators from {self.num_equations} "
                     f"equations; forward {total / 1e9:.2f} GFLOP; batch {self.batch_size}")
        if self.unsupported:
            lines.append("replicate-only (primitives soapjax does not understand): "
                         + ", ".join(self.unsupported))
        return "\n".join(lines)

    def evaluate(self, *flat_inputs, on_output: Callable[[Operator, int, Any], Any] | None = None,
                 replace: Mapping[str, Callable[..., Sequence[Any]]] | None = None):
        """Runs the traced function on flat leaves, equation by equation (traceable under jit).

        Args:
          *flat_inputs: the leaves of the example arguments, in `jax.tree.leaves` order.
          on_output: called as ``on_output(op, k, value)`` for every operator output
            `op.outputs[k]` when it is computed; what it returns replaces the value (apply
            inserts `with_sharding_constraint` here).
          replace: operator name -> a function that computes that operator instead of its
            equations: called with the operand values in `Operator.inputs` order, it returns
            the values of `Operator.outputs`. Only operators whose equations are contiguous in
            the program can be replaced (`replaceable`).

        Returns:
          The function's result (a scalar loss).

        Raises:
          ValueError: `replace` names an operator that is unknown or not `replaceable`.
        """
        hook = None
        if on_output is not None:
            where = {t.value: (op, k) for op in self.operators for k, t in enumerate(op.outputs)}

            def hook(vid, val):
                return on_output(*where[vid], val) if vid in where else val

        swaps = {}
        for name, fn in (replace or {}).items():
            if not self.replaceable(name):
                raise ValueError(f"operator {name!r} cannot be replaced: its equations are "
                                 f"interleaved with other operators'")
            op, units = self.operator(name), self.program.local[name].units
            swaps[max(units)] = (frozenset(units), fn, [o.value for o in op.inputs],
                                 [t.value for t in op.outputs])
        return self.program.run(flat_inputs, hook, swaps=swaps)[0]

    def replaceable(self, name: str) -> bool:
        """Whether operator `name` can be computed all at once where its last equation is.

        True when no other operator's equation lies between its first and last, the
        operator-less equations there (parameter preprocessing) read none of its values, and its
        equations all lie in the same remat region.
        """
        prog = self.program
        units = set(prog.local[self.operator(name).name].units)
        if not units or len({prog.units[u].region for u in units}) > 1:
            return False  # straddles a remat region's edge: evaluated equation by equation
        others = set().union(*(prog.local[op.name].units for op in self.operators
                               if op.name != name))
        made = {v for u in units for v in prog.units[u].outs if v is not None}
        for i in range(min(units), max(units)):
            if i in units:
                continue
            if i in others or made & set(prog.units[i].ins):
                return False
        return True


# --- the flattened program --------------------------------------------------------------------


@dataclasses.dataclass
class _Unit:
    """One equation after inlining plain calls: its operands and results as value ids.

    Attributes:
      region: the remat regions it lies in, outermost first (indices of `_Program.regions`).
      iteration: the unrolled layer-scan iterations it belongs to, outermost first, as
        ``(scan index, step)`` pairs (`_Program.scans`).
    """

    eqn: jcore.JaxprEqn
    ins: list[int]
    outs: list[int | None]
    stack: str
    region: tuple[int, ...] = ()
    iteration: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass
class _Local:
    """One operator's own label analysis: enough to rebuild it at any shard shape."""

    units: tuple[int, ...]
    inputs: tuple[int, ...]  # value ids, in `Operator.inputs` order
    exports: tuple[int, ...]  # value ids, in `Operator.outputs` order
    labels: _dims.LabelSet
    lab: dict[int, tuple[int, ...]]  # value id -> labels
    env: dict  # inner jaxpr var -> labels (bodies of scan, remat2, custom_jvp_call, ...)
    iter_of: dict[int, int]  # canonical label -> iteration dim

    def shard_shape(self, labels: Sequence[int], shape: Sequence[int],
                    degrees: Sequence[int]) -> tuple[int, ...]:
        out = []
        for lbl, size in zip(labels, shape):
            d = self.labels.lookup(lbl, self.iter_of)
            out.append(size // degrees[d] if d is not None and size % degrees[d] == 0 else size)
        return tuple(out)


class _Program:
    """The traced function with calls inlined, as equations over integer value ids.

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

    Other loops (an LSTM's scan over time) stay one equation: one loop operator.
    """

    def __init__(self, closed: jcore.ClosedJaxpr, param_inputs: frozenset[int] = frozenset()):
        self.local: dict[str, _Local] = {}
        self.regions: list[Mapping[str, Any]] = []  # the remat2 params of each region
        self.scans: list[tuple[int, ...]] = []  # each unrolled scan's sliced inputs (value ids)
        self.param_like: set[int] = set()  # parameter leaves and their layer slices
        self.slice_units: set[int] = set()  # units that take a layer's slice (no operator)
        self.slice_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # slice -> (stacked, index)
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[str] = []
        self.jax_dtypes: list[Any] = []
        self.literals: dict[int, Any] = {}
        self.units: list[_Unit] = []
        self.consts: dict[int, Any] = {}
        env: dict[jcore.Var, int] = {}
        for v, c in zip(closed.jaxpr.constvars, closed.consts):
            env[v] = self._new(v)
            self.consts[env[v]] = c
        self.inputs = [self._bind(env, v) for v in closed.jaxpr.invars]
        self.param_like.update(self.inputs[i] for i in param_inputs)
        self._flatten(closed.jaxpr, env, "", (), ())
        self.outputs = [self._read(env, v) for v in closed.jaxpr.outvars]

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
            else:
                outs = [None if isinstance(v, jcore.DropVar) else self._bind(env, v)
                        for v in eqn.outvars]
                self.units.append(_Unit(eqn, ins, outs, stack, region, iteration))

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
        first_x = eqn.params["num_consts"] + eqn.params["num_carry"]
        return any(v in self.param_like for v in ins[first_x:])

    def _unroll(self, eqn, ins: Sequence[int], stack: str, region, iteration) -> list[int]:
        p = eqn.params
        nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
        consts, carry, xs = list(ins[:nc]), list(ins[nc:nc + nk]), list(ins[nc + nk:])
        scan = len(self.scans)
        self.scans.append(tuple(xs))
        ys: dict[int, list[int]] = {}
        for t in (reversed(range(length)) if p["reverse"] else range(length)):
            it = iteration + ((scan, t),)
            x_t = [self._index(x, t, stack, region, it) for x in xs]
            outs = self._inline(p["jaxpr"], consts + carry + x_t, stack, region, it)
            carry, ys[t] = outs[:nk], outs[nk:]
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
            self.slice_of[out] = (root, index)
        return out

    def _slice_root(self, vid: int) -> tuple[int, tuple[int, ...]]:
        return self.slice_of.get(vid, (vid, ()))

    def _stack(self, vids: Sequence[int], stack: str, region, iteration) -> int:
        """Emits ``jnp.stack(values)`` (a scan's stacked per-iteration outputs)."""
        avals = [jax.ShapeDtypeStruct(self.shapes[v], self.jax_dtypes[v]) for v in vids]
        closed = jax.make_jaxpr(lambda *a: jax.numpy.stack(a))(*avals)
        return self._inline(closed, list(vids), stack, region, iteration)[0]

    def run(self, flat_inputs, hook=None, swaps: Mapping[int, tuple] | None = None) -> list:
        """Evaluates the program and returns the outputs' values.

        `swaps` maps an operator's last unit index to ``(its unit indices, fn, input ids,
        output ids)``: those units are skipped, and at the last one ``fn(*inputs)`` gives the
        outputs instead. Remat regions run inside `jax.checkpoint` with their traced policy.
        """
        env = dict(self.consts)
        env.update(self.literals)
        env.update(zip(self.inputs, flat_inputs))
        swaps = dict(swaps or {})
        skip = frozenset().union(*(sw[0] for sw in swaps.values())) if swaps else frozenset()
        self._run_block(list(range(len(self.units))), 0, env, hook, swaps, skip)
        return [env[v] for v in self.outputs]

    def _run_block(self, idxs: list[int], depth: int, env: dict, hook, swaps, skip) -> None:
        i = 0
        while i < len(idxs):
            region = self.units[idxs[i]].region
            if len(region) > depth:  # a nested remat region: as far as it goes
                j = i
                while j < len(idxs) and self.units[idxs[j]].region[:depth + 1] == region[:depth + 1]:
                    j += 1
                self._run_region(idxs[i:j], depth, region[depth], env, hook, swaps, skip)
                i = j
                continue
            self._run_unit(idxs[i], env, hook, swaps, skip)
            i += 1

    def _run_region(self, idxs: list[int], depth: int, r: int, env: dict, hook, swaps, skip):
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
            local.update(zip(ins, vals))
            self._run_block(idxs, depth + 1, local, hook, swaps, skip)
            return [local[v] for v in outs]

        p = self.regions[r]
        vals = jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True),
                              policy=p.get("policy"))(*(env[v] for v in ins))
        env.update(zip(outs, vals))

    def _run_unit(self, i: int, env: dict, hook, swaps, skip) -> None:
        if i in skip:
            if i in swaps:
                _, fn, ins, outs = swaps[i]
                for vid, val in zip(outs, fn(*(env[v] for v in ins))):
                    env[vid] = hook(vid, val) if hook is not None else val
            return
        u = self.units[i]
        for vid, val in zip(u.outs, bind_as_traced(u.eqn, [env[v] for v in u.ins])):
            if vid is not None:
                env[vid] = hook(vid, val) if hook is not None else val


def bind_as_traced(eqn: jcore.JaxprEqn, args: Sequence[Any]) -> list[Any]:
    """Binds one equation with its traced parameters (custom derivative rules intact)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    with eqn.ctx.manager:
        ans = eqn.primitive.bind(*subfuns, *args, **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


# --- tracing ------------------------------------------------------------------------------------


def trace(fn: Callable, *example_args, params_argnums: int | Sequence[int] = 0,
          batch_argnums: int | Sequence[int] = 1, name: str | None = None) -> OpGraph:
    """Traces `fn` (a loss: parameters and a batch to a scalar) into an `OpGraph`.

    Args:
      fn: the forward/loss function, e.g. ``loss_fn(params, batch) -> scalar``.
      *example_args: example arguments: arrays or `jax.ShapeDtypeStruct`s (nothing is run).
      params_argnums: which arguments hold trained parameters.
      batch_argnums: which arguments hold the batch; dim 0 of every batch leaf is the sample
        dim. Other arguments are constants.
      name: the graph's name (default: the function's name).

    Returns:
      The operator graph.

    Raises:
      TraceError: no batch argument, arguments that do not fit `fn`, a batch whose leaves
        disagree on the batch size, or a function that does not return a scalar.
    """
    fname = getattr(fn, "__name__", type(fn).__name__)
    pnums, bnums = _argnums(params_argnums, "params_argnums"), _argnums(batch_argnums, "batch_argnums")
    _check_args(fn, fname, example_args, pnums, bnums)
    abstract = jax.tree.map(_abstract, example_args)
    try:
        closed = jax.make_jaxpr(fn)(*abstract)
    except Exception as e:  # the user's function failed on these arguments: say which and why
        raise TraceError(f"tracing {fname} with the example arguments "
                         f"{_describe_args(abstract)} failed: {type(e).__name__}: {e}") from e
    out = closed.jaxpr.outvars
    if len(out) != 1 or _dims.shape_of(out[0]) != ():
        got = ", ".join(str(v.aval) for v in out)
        raise TraceError(f"{fname} must return a scalar loss, but returned ({got})")
    program = _Program(closed, _param_positions(example_args, pnums))
    params, batch = _leaves(example_args, program, pnums, bnums)
    ops, unsupported = _Builder(program, params, batch, name or fname).build()
    return OpGraph(name=name or fname, operators=tuple(ops), num_equations=_count_eqns(closed.jaxpr),
                   params=tuple(params), batch=tuple(batch), unsupported=tuple(unsupported),
                   program=program)


def _param_positions(args, pnums) -> frozenset[int]:
    """Indices, among the flattened arguments, of the parameter leaves."""
    n, out, k = len(args), set(), 0
    pset = {i % n for i in pnums}
    for i, a in enumerate(args):
        count = len(jax.tree.leaves(a))
        if i in pset:
            out.update(range(k, k + count))
        k += count
    return frozenset(out)


def _argnums(x, what: str) -> tuple[int, ...]:
    t = (x,) if isinstance(x, int) else tuple(x)
    if not all(isinstance(i, int) for i in t):
        raise TraceError(f"{what} must be an int or a sequence of ints, got {x!r}")
    return t


def _check_args(fn, fname, args, pnums, bnums) -> None:
    n = len(args)
    if not bnums:
        raise TraceError(f"{fname} needs a batch argument: batch_argnums is empty, so soapjax "
                         "cannot tell the sample dim; pass the index of the batch argument")
    for what, nums in (("params_argnums", pnums), ("batch_argnums", bnums)):
        bad = [i for i in nums if not -n <= i < n]
        if bad:
            raise TraceError(f"{what}={nums} refers to argument {bad[0]}, but {n} example "
                             f"argument(s) were given to {fname}")
    if set(i % n for i in pnums) & set(i % n for i in bnums):
        raise TraceError(f"params_argnums={pnums} and batch_argnums={bnums} overlap; an "
                         "argument is either parameters or batch")
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as e:
        raise TraceError(f"the {n} example argument(s) do not fit {fname}{_signature(fn)}: {e}") from e
    except ValueError:  # builtins without a signature: let tracing speak
        pass
    for i in bnums:
        leaves = jax.tree_util.tree_flatten_with_path(args[i])[0]
        if not leaves:
            raise TraceError(f"batch argument {i} of {fname} has no arrays; expected a pytree "
                             "of arrays whose dim 0 is the batch")
        first = None
        for kp, leaf in leaves:
            shape = tuple(np.shape(leaf))
            where = jax.tree_util.keystr(kp) or f"argument {i}"
            if not shape:
                raise TraceError(f"batch leaf {where} of {fname} is a scalar; expected dim 0 "
                                 "to be the batch (sample) dim")
            if first is None:
                first = (where, shape[0])
            elif shape[0] != first[1]:
                raise TraceError(f"batch leaf {where} has batch size {shape[0]} (shape {shape}), "
                                 f"but {first[0]} has {first[1]}; dim 0 of every batch leaf "
                                 "must be the batch")


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return x


def _describe_args(args) -> str:
    def one(a):
        leaves = jax.tree.leaves(a)
        if len(leaves) == 1 and hasattr(leaves[0], "shape"):
            return f"{leaves[0].dtype}{list(leaves[0].shape)}"
        return f"<pytree of {len(leaves)} leaves>"

    return "(" + ", ".join(one(a) for a in args) + ")"


def _leaves(args, program: _Program, pnums, bnums) -> tuple[list[LeafInfo], list[LeafInfo]]:
    n = len(args)
    pset, bset = {i % n for i in pnums}, {i % n for i in bnums}
    params, batch = [], []
    k = 0
    for i, a in enumerate(args):
        for kp, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            vid = program.inputs[k]
            k += 1
            prefix = f"[{i}]" if (len(pset) > 1 and i in pset) or (len(bset) > 1 and i in bset) else ""
            info = LeafInfo(prefix + jax.tree_util.keystr(kp), program.shapes[vid],
                            program.dtypes[vid], vid)
            if i in pset:
                params.append(info)
            elif i in bset:
                batch.append(info)
    assert k == len(program.inputs), (k, len(program.inputs))
    return params, batch


def _count_eqns(jaxpr: jcore.Jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for sub in jcore.jaxprs_in_params(eqn.params):
            total += _count_eqns(sub)
    return total


def module_of_param(path: str) -> str:
    """The module path of a parameter leaf path.

    ``"['params']['layers_3']['attn']['query']['kernel']"`` (linen) and
    ``"['layers_3']['attn']['query']['kernel'].value"`` (nnx) both give
    ``"layers_3/attn/query"``.
    """

    parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", path)
    keys = [a or b or c for a, b, c in parts]
    if keys and keys[-1] in _PARAM_LEAF_NAMES:
        keys = keys[:-1]
    if keys and keys[0] == "params":
        keys = keys[1:]
    return "/".join(keys[:-1])


def _per_operator_role(global_role: Role, splits_param: bool) -> Role:
    if global_role in ("S", "-"):
        return global_role
    return "P" if splits_param else "A"


def _common_prefix(paths: Sequence[str]) -> str:
    split = [p.split("/") for p in paths if p]
    if not split:
        return ""
    out = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return "/".join(out)


# --- grouping and dim analysis ----------------------------------------------------------------


class _Builder:
    """Groups the program's units into operators and works out their dims."""

    def __init__(self, program: _Program, params: list[LeafInfo], batch: list[LeafInfo],
                 fname: str):
        self.p = program
        self.fname = fname
        self.param_of = {l.value: l for l in params}
        self.batch_of = {l.value: l for l in batch}
        self.consumers: dict[int, list[int]] = {}
        for i, u in enumerate(program.units):
            for v in u.ins:
                self.consumers.setdefault(v, []).append(i)
        self.is_output = set(program.outputs)

    def build(self) -> tuple[list[Operator], list[str]]:
        self._global_labels()
        self._stacks()
        groups, anchors, unsupported = self._group()
        names = self._names(groups, anchors)
        self.exported: dict[int, tuple[str, int]] = {}  # value id -> (operator, output index)
        ops = []
        for g in range(len(groups)):  # producers come first, so their exports are known
            op = self._operator(names[g], groups[g], anchors[g], g)
            self.exported.update({t.value: (op.name, k) for k, t in enumerate(op.outputs)})
            ops.append(op)
        return ops, unsupported

    # The whole program once: roles of every dim, per-unit FLOPs and reductions.
    def _global_labels(self) -> None:
        ls = _dims.LabelSet()
        self.gl: dict[int, tuple[int, ...]] = {}
        for vid in range(len(self.p.shapes)):
            if vid in self.p.literals or vid in self.p.consts or vid in self.p.inputs:
                self.gl[vid] = ls.fresh_many(self.p.shapes[vid])
        for vid, leaf in self.batch_of.items():
            ls.mark(self.gl[vid][0], "S")
        for vid in self.param_of:
            for lbl in self.gl[vid]:
                ls.mark(lbl, "P")
        self.info: list[_dims.EqnInfo] = []
        env: dict = {}
        for u in self.p.units:
            info = _dims.eqn_labels(ls, u.eqn, [self.gl[v] for v in u.ins], env)
            for vid, lb in zip(u.outs, info.outs):
                if vid is not None:
                    self.gl[vid] = lb
            self.info.append(info)
        self.gls = ls

    def role(self, vid: int, d: int) -> Role:
        lbl = self.gl[vid][d]
        if self.gls.size[lbl] <= 1:
            return "-"
        marks = self.gls.marks(lbl)
        return "S" if "S" in marks else "P" if "P" in marks else "-" if "seq" in marks else "A"

    def _stacks(self) -> None:
        """Module path of each unit: its name stack without the root module's class name."""
        stacks = [u.stack.split("/") if u.stack else [] for u in self.p.units]
        roots = {s[0] for s in stacks if s}
        top_modules = {module_of_param(l.path).split("/")[0] for l in self.param_of.values()}
        strip = len(roots) == 1 and not (roots & top_modules)
        self.module = []
        self.position: list[str] = []
        for i, s in enumerate(stacks):
            s = [c for c in (s[1:] if strip and s else s) if _MODULE_NAME.fullmatch(c)]
            mod = "/".join(s)
            if not mod:
                mod = _common_prefix([module_of_param(self._param_leaf(v).path)
                                      for v in self.p.units[i].ins if self._param_leaf(v)])
            it = self.p.units[i].iteration
            self.module.append(self._iteration_module(mod, it))
            self.position.append(self._iteration_module(mod, it, lambda _: "*") if it else "")

    def _param_leaf(self, vid: int) -> LeafInfo | None:
        """The parameter leaf a value is, or is a layer slice of."""
        return self.param_of.get(self.p.slice_of.get(vid, (vid, ()))[0])

    def _iteration_module(self, mod: str, iteration: tuple[tuple[int, int], ...],
                          index: Callable[[int], str] = str) -> str:
        """The module path of a unit of unrolled layer-scan iterations: ``layers/fc1`` in
        iteration 3 of the scan over ``layers`` is ``layers_3/fc1``, as unrolled layers are
        named; a path outside the scanned module gets the index as a new leading component."""
        for scan, t in iteration:
            block = self._scan_block(scan)
            for done_scan, done_t in iteration[:[s for s, _ in iteration].index(scan)]:
                block = self._rename(block, self._scan_block(done_scan), done_t)
            mod = self._rename(mod, block, index(t))
        return mod

    @staticmethod
    def _rename(mod: str, block: str, t: int | str) -> str:
        if block and (mod == block or mod.startswith(block + "/")):
            return f"{block}_{t}{mod[len(block):]}"
        return "/".join(x for x in (f"{block or 'layer'}_{t}", mod) if x)

    def _scan_block(self, scan: int) -> str:
        """The module a layer scan iterates over: the common prefix of its stacked leaves."""
        return _common_prefix([module_of_param(leaf.path) for v in self.p.scans[scan]
                               if (leaf := self._param_leaf(v)) is not None])

    def _kind(self, i: int) -> str:
        u, prims = self.p.units[i], self.info[i].primitives
        name = u.eqn.primitive.name
        if not prims <= (_CHEAP | set(_ANCHORS) | set(_SOFT_ANCHORS)):
            return "unknown"
        if any(a in prims for a in _ANCHORS):
            return "anchor"
        if name == "gather" and self._reads_param(i):
            return "anchor"
        if name in _SOFT_ANCHORS:
            return "soft"
        return "cheap"

    def _reads_param(self, i: int, depth: int = 4) -> bool:
        """Whether unit `i`'s first operand is a parameter, possibly through cheap units."""
        vid = self.p.units[i].ins[0]
        for _ in range(depth):
            if self._param_leaf(vid) is not None:
                return True
            prod = self._producer.get(vid)
            if prod is None or not self.p.units[prod].ins:
                return False
            vid = self.p.units[prod].ins[0]
        return False

    def _group(self) -> tuple[list[list[int]], list[int], list[str]]:
        units = self.p.units
        self._producer = {v: i for i, u in enumerate(units) for v in u.outs if v is not None}
        group_of: list[int | None] = [None] * len(units)
        groups: list[list[int]] = []
        anchors: list[int] = []
        unsupported: list[str] = []
        value_group: dict[int, int] = {}
        open_group: dict[str, int] = {}  # module path -> its latest operator
        live = self.live = self._live()
        for i, u in enumerate(units):
            if i not in live or i in self.p.slice_units:  # dead code (XLA drops it), or a
                continue  # layer's parameter slice, read as that layer's parameter
            kind = self._kind(i)
            ins = [value_group[v] for v in u.ins if v in value_group]
            latest = max(ins) if ins else None
            mod = self.module[i]
            # A unit of the module whose operator is open (a layer norm's second reduction,
            # its squares) joins that operator rather than the producer it reads from.
            same = open_group.get(mod)
            if same is not None and (latest is None or same >= latest) and (mod or kind == "soft"):
                latest = same
            g = latest
            if (kind == "cheap" and mod and latest is not None
                    and mod != self.group_mod(anchors[latest]) and self._feeds_only(i, mod)):
                g = None  # a module's prologue (a norm's squares): decided by its consumer
            if kind in ("anchor", "unknown") or (
                    kind == "soft" and (latest is None or mod != self.module[anchors[latest]])):
                g = len(groups)
                groups.append([])
                anchors.append(i)
                open_group[mod] = g
                if kind == "unknown":
                    for prim in sorted(self.info[i].primitives - _CHEAP - set(_ANCHORS) - set(_SOFT_ANCHORS)):
                        if prim not in unsupported:
                            unsupported.append(prim)
            if g is not None:
                group_of[i] = g
                groups[g].append(i)
                for v in u.outs:
                    if v is not None:
                        value_group[v] = g
        if not groups:  # a function of nothing but cheap equations: one operator
            groups.append([])
            anchors.append(0)
        for i in reversed(range(len(units))):  # equations that only read inputs: join a consumer
            if group_of[i] is not None or i not in live or i in self.p.slice_units:
                continue
            cons = [group_of[c] for v in units[i].outs if v is not None
                    for c in self.consumers.get(v, ()) if group_of[c] is not None]
            g = min(cons) if cons else len(groups) - 1
            srcs = [group_of[self._producer[v]] for v in units[i].ins if v in self._producer]
            g = max([g] + [s for s in srcs if s is not None])  # never before what it reads
            group_of[i] = g
            groups[g].append(i)
        self._sink_side_branches(groups, group_of, anchors)
        for g in groups:
            g.sort()
        return groups, anchors, unsupported

    def _feeds_only(self, i: int, mod: str) -> bool:
        """Whether unit `i`'s results are used only inside module `mod`."""
        cons = [c for v in self.p.units[i].outs if v is not None for c in self.consumers.get(v, ())]
        return bool(cons) and all(self.module[c] == mod or self.module[c].startswith(mod + "/")
                                  for c in cons)

    def _live(self) -> set[int]:
        """Units the function's result depends on."""
        needed = set(self.p.outputs)
        live = set()
        for i in reversed(range(len(self.p.units))):
            u = self.p.units[i]
            if any(v in needed for v in u.outs if v is not None) or u.eqn.effects:
                live.add(i)
                needed.update(u.ins)
        return live

    def _primary(self, exports: list[int], members: set[int], anchor: int) -> int:
        """The main output among exports: computed from the anchor, the largest, the earliest."""
        def key(v):
            return (anchor in self._ancestors(v, members), math.prod(self.p.shapes[v]), -v)
        return max(exports, key=key)

    def _exports(self, members: set[int]) -> list[int]:
        units = self.p.units
        return [v for i in sorted(members) for v in units[i].outs if v is not None and (
            v in self.is_output or any(c not in members and c in self.live
                                       for c in self.consumers.get(v, ())))]

    def _sink_side_branches(self, groups: list[list[int]], group_of: list[int],
                            anchors: list[int]) -> None:
        """Moves equations off an operator's main line into the one operator they feed.

        Flax's LayerNorm squares its input before its first reduction; that square reads the
        previous operator's output and feeds only the norm, so XLA fuses it into the norm.
        """
        units = self.p.units
        for h, members in enumerate(groups):
            mset = set(members)
            exports = self._exports(mset)
            if not exports:
                continue
            main = self._ancestors(self._primary(exports, mset, anchors[h]), mset)
            for i in sorted(members, reverse=True):
                if i in main or any(v in self.is_output for v in units[i].outs if v is not None):
                    continue
                if self.p.units[i].eqn.primitive.name in _ANCHORS or i == min(members):
                    continue
                cons = {group_of[c] for v in units[i].outs if v is not None
                        for c in self.consumers.get(v, ()) if group_of[c] is not None}
                if len(cons) == 1 and (g := cons.pop()) > h:
                    mset.discard(i)
                    group_of[i] = g
                    groups[g].append(i)
            members[:] = sorted(mset)

    def _ancestors(self, vid: int, members: set[int]) -> set[int]:
        """Units of `members` that the value `vid` depends on."""
        out: set[int] = set()
        todo = [vid]
        while todo:
            i = self._producer.get(todo.pop())
            if i is not None and i in members and i not in out:
                out.add(i)
                todo.extend(self.p.units[i].ins)
        return out

    def group_mod(self, anchor: int) -> str:
        return self.module[anchor]

    def _names(self, groups, anchors) -> list[str]:
        mods = []
        for g, a in zip(groups, anchors):
            mod = self.module[a] or _common_prefix(
                [module_of_param(leaf.path) for i in g for v in self.p.units[i].ins
                 if (leaf := self._param_leaf(v)) is not None])
            mods.append(mod)
        self.group_module = mods
        count: dict[str, int] = {}
        for m in mods:
            count[m] = count.get(m, 0) + 1
        names, used = [], set()
        out_groups = {gi for gi, g in enumerate(groups) for i in g
                      for v in self.p.units[i].outs if v in self.is_output}
        for gi, (m, a) in enumerate(zip(mods, anchors)):
            if not m and gi in out_groups:  # the loss itself, outside any module
                base = self.fname
            else:
                base = m if (m and count[m] == 1) else "/".join(x for x in (m, self._anchor_name(a)) if x)
            name, k = base, 1
            while name in used:
                name, k = f"{base}_{k}", k + 1
            used.add(name)
            names.append(name)
        return names

    def _anchor_name(self, i: int) -> str:
        prims = self.info[i].primitives
        for a in _ANCHORS:
            if a in prims:
                return a
        return self.p.units[i].eqn.primitive.name

    def _operator(self, name: str, group: list[int], anchor: int, g: int) -> Operator:
        units = self.p.units
        produced = {v for i in group for v in units[i].outs if v is not None}
        inside = set(group)
        inputs: list[int] = []
        for i in group:
            for v in units[i].ins:
                if v not in produced and v not in inputs and v not in self.p.literals:
                    inputs.append(v)
        exports = self._exports(inside)
        if not exports:
            exports = [v for v in units[anchor].outs if v is not None][:1]
        primary = self._primary(exports, inside, anchor)
        exports.remove(primary)
        exports.insert(0, primary)

        # Local labels: fresh at the operator's inputs, so two operands that the whole program
        # would call alike (a query's and a key's sequence dim) stay apart.
        ls = _dims.LabelSet()
        lab = {v: ls.fresh_many(self.p.shapes[v]) for v in inputs}
        lab.update({v: ls.fresh_many(self.p.shapes[v]) for i in group for v in units[i].ins
                    if v in self.p.literals})
        reduced: list[int] = []
        env: dict = {}
        for i in group:
            info = _dims.eqn_labels(ls, units[i].eqn, [lab.get(v) for v in units[i].ins], env)
            reduced += info.reduced
            for v, lb in zip(units[i].outs, info.outs):
                if v is not None:
                    lab[v] = lb
        out_vid = exports[0]
        out_shape = self.p.shapes[out_vid]
        iter_of: dict[int, int] = {}  # label class -> iteration dim
        roles: list[Role] = []
        for d, lbl in enumerate(lab[out_vid]):
            dup = ls.find(lbl) in iter_of
            roles.append("-" if dup else self.role(out_vid, d))
            if not dup:
                iter_of[ls.find(lbl)] = d
        red_dims: list[ReductionDim] = []
        for lbl in reduced:
            if ls.lookup(lbl, iter_of) is not None or ls.size[lbl] <= 1 or "seq" in ls.marks(lbl):
                continue
            k = len(out_shape) + len(red_dims)
            iter_of[ls.find(lbl)] = k
            red_dims.append(ReductionDim(ls.size[lbl], self._reduction_role(ls, k, iter_of, inputs, lab)))

        def dims_of(v):  # a dim split twice in one tensor (an LSTM's H x 4H kernel): once
            out: list[int | None] = []
            for x in lab[v]:
                d = ls.lookup(x, iter_of)
                out.append(None if d in out else d)
            return tuple(out)

        operands = []
        for v in inputs:
            kind, source, index = self._source(v, g)
            layer = self.p.slice_of[v][1] if kind == "param" and v in self.p.slice_of else ()
            operands.append(Operand(kind, source, index, self.p.shapes[v], self.p.dtypes[v],
                                    dims_of(v), v, layer))
        # P is per operator (the paper's definition): splitting the dim splits a parameter
        # *this* operator reads. A pooling layer's channels are A, though a conv's are P.
        param_dims = {d for o in operands if o.kind == "param" for d in o.dims if d is not None}
        roles = [_per_operator_role(r, d in param_dims) for d, r in enumerate(roles)]
        red_dims = [dataclasses.replace(r, role=_per_operator_role(r.role, len(roles) + k in param_dims))
                    for k, r in enumerate(red_dims)]
        outputs = tuple(OutputTensor(self.p.shapes[v], self.p.dtypes[v], dims_of(v), v)
                        for v in exports)
        self.p.local[name] = _Local(tuple(group), tuple(inputs), tuple(exports), ls, lab, env,
                                    iter_of)
        flops = sum(self.info[i].flops for i in group)
        nbytes = sum(o.nbytes for o in operands) + sum(t.nbytes for t in outputs)
        unknown = self._kind(anchor) == "unknown"
        granularity = self._granularity(out_shape, red_dims, lab, ls, iter_of)
        position = self.position[anchor]
        if position:  # the same position in every layer: the operator's name, layer-free
            position += name[len(self.group_module[g]):]
        return Operator(name=name, module=self.group_module[g], anchor=self._anchor_name(anchor),
                        shape=out_shape, dtype=self.p.dtypes[out_vid], roles=tuple(roles),
                        reduction_dims=tuple(red_dims), flops=float(flops),
                        bytes_accessed=float(nbytes), inputs=tuple(operands), outputs=outputs,
                        num_equations=len(group), replicate_only=unknown,
                        block_position=position, granularity=granularity)

    def _granularity(self, out_shape, red_dims, lab, ls, iter_of) -> tuple[int, ...]:
        sizes = list(out_shape) + [r.size for r in red_dims]
        grain = list(sizes)
        for v, labels in lab.items():
            for lbl, size in zip(labels, self.p.shapes[v]):
                d = ls.lookup(lbl, iter_of)
                if d is not None and size > 1:
                    grain[d] = math.gcd(grain[d], size)
        return () if grain == sizes else tuple(grain)

    def _reduction_role(self, ls, k, iter_of, inputs, lab) -> Role:
        for v in inputs:
            for d, x in enumerate(lab[v]):
                if ls.lookup(x, iter_of) == k and v in self.gl:
                    r = self.role(v, d)
                    return r if r != "-" else "A"
        return "A"

    def _source(self, v: int, g: int) -> tuple[OperandKind, str, int]:
        if v in self.param_of:
            return "param", self.param_of[v].path, 0
        if (leaf := self._param_leaf(v)) is not None:  # a layer's slice of a stacked parameter
            return "param", leaf.path + "".join(f"[{i}]" for i in self.p.slice_of[v][1]), 0
        if v in self.batch_of:
            return "batch", self.batch_of[v].path, 0
        if v in self.exported:
            return "activation", *self.exported[v]
        return "const", f"const_{v}", 0
