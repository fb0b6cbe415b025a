"""The operator graph: a traced forward pass grouped into operators with dim roles.

`trace(loss_fn, params, batch)` traces the function to a jaxpr, flattens it
(`soapjax.graph._program`: plain calls inlined, `jax.checkpoint` regions opened and kept as regions,
a scan over stacked layer parameters unrolled into its layers, whose operators at one position form
a *repeated block* that shares one config), and groups the equations into *operators* around anchor
primitives (`dot_general`, `conv_general_dilated`, embedding `gather`, `reduce_window_*`, `scan`,
...), folding the cheap elementwise, broadcast and reshape equations next to an anchor into it, as
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
* ``-`` not divisible (size 1, a scan's iteration axis, a dim the output holds twice: both copies,
  as in attention scores whose queries and keys are sliced from one fused QKV projection).

Example::

    g = trace(loss_fn, params, batch)
    op = g.operator("fc1")
    op.shape, op.roles, op.reduction_dims   # (256, 4096), ('S', 'P'), (ReductionDim(784, 'P'),)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.extend  # noqa: F401  (jax.extend must be imported explicitly)
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from soapjax.base._dtypes import is_key
from soapjax.base.errors import TraceError
from soapjax.graph import _dims
from soapjax.graph._constants import constant_bytes, warn_of_constants
from soapjax.graph._grouping import _Builder, module_of_param
from soapjax.graph._ir import (
    LOOP_ANCHORS as LOOP_ANCHORS,
    LeafInfo as LeafInfo,
    Operand as Operand,
    OperandKind as OperandKind,
    Operator as Operator,
    OutputTensor as OutputTensor,
    ReductionDim as ReductionDim,
    Role as Role,
)
from soapjax.graph._program import (
    KEY_MAKERS,
    Program as Program,
    bind_as_traced as bind_as_traced,
)

__all__ = ["LeafInfo", "OpGraph", "Operand", "Operator", "OutputTensor", "Program",
           "ReductionDim", "module_of_param", "trace"]


_MISSING = object()


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
      program: the traced function as a flat `Program` of equations over value ids, which
        the operators' equations and operands index (`evaluate` runs it).
      retrace: traces the same function again at another batch size (`at_batch_size`; None:
        not made by `trace`).
      sample_coupling: where the step's samples interact, so that microbatches would compute
        another step (a batch norm's statistics, a mixture of experts' capacity or
        load-balancing loss, a mean over the unmasked tokens: `soapjax.graph._grouping._Coupling`),
        '' where they do not. Plans then keep one microbatch, unless
        `microbatch_statistics`.
      sample_sums: where the samples interact through sums over them only, the value ids
        of those sums (the reductions' results in `program`): parts of a batch that add these
        across each other compute the whole batch's statistics (`soapjax.apply`'s data groups
        inside pipeline stages); () where nothing sums the samples, None where some
        statistic is not such a sum (a max or a sort over the batch) or it is not known.
      microbatch_statistics: the user accepts statistics per microbatch where the samples
        interact (`trace`'s argument: what Megatron-LM and MaxText do with a mixture of
        experts' capacity and auxiliary loss under gradient accumulation).
      aux_tree: the structure of what the traced function returns beside its loss (`trace`'s
        `has_aux`; None: the loss alone); its leaves are ``program.outputs[1:]``.
      params_tree: the parameters' pytree structure (a tuple of the parameter arguments' when
        there are several; None: not made by `trace`), for `abstract_params`.
      frozen: the paths of the parameter leaves the training step does not train (`with_frozen`):
        the backward pass computes no gradient for them.
    """

    name: str
    operators: tuple[Operator, ...]
    num_equations: int
    params: tuple[LeafInfo, ...]
    batch: tuple[LeafInfo, ...]
    unsupported: tuple[str, ...]
    program: Program = dataclasses.field(compare=False, hash=False, repr=False)
    retrace: Callable[[int], OpGraph] | None = dataclasses.field(
        default=None, compare=False, hash=False, repr=False)
    sample_coupling: str = dataclasses.field(default="", compare=False)
    sample_sums: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)
    microbatch_statistics: bool = dataclasses.field(default=False, compare=False)
    aux_tree: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    params_tree: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    frozen: tuple[str, ...] = ()
    # what later stages work out once per graph (`memo`); not copied by dataclasses.replace
    _memo: dict = dataclasses.field(default_factory=dict, init=False, compare=False,
                                    hash=False, repr=False)

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()``, worked out once per graph and `key` (config-independent structure
        that several simulations of one graph share). The result must not be mutated."""
        out = self._memo.get(key, _MISSING)
        if out is _MISSING:
            out = self._memo[key] = compute()
        return out

    def operator_index(self) -> dict[str, int]:
        """Each operator's index in `operators`, by its name (worked out once: `memo`)."""
        return self.memo("operator_index",
                         lambda: {op.name: j for j, op in enumerate(self.operators)})

    def abstract_params(self) -> Any:
        """The parameters as `jax.ShapeDtypeStruct`s in their own pytree (what an optimizer's
        ``init`` reads: `optax.multi_transform`'s labels and masks follow that structure), or
        a flat list where the structure is not known."""
        leaves = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in self.params]
        return leaves if self.params_tree is None else jax.tree.unflatten(self.params_tree,
                                                                          leaves)

    @property
    def constant_bytes(self) -> int:
        """Bytes of the arrays the traced function closes over (its jaxpr's constants: a
        closed-over table, a base model's weights): the step holds them whole on every
        device, and no plan splits them."""
        return self.memo("constant_bytes", lambda: constant_bytes(self.program))

    def with_frozen(self, frozen: Sequence[bool]) -> OpGraph:
        """This graph with the parameter leaves flagged in `frozen` (one flag per leaf, in
        `params` order) left untrained: the optimizer never reads their gradients
        (`soapjax.cost.updates.frozen_leaves`: ``optax.set_to_zero`` under
        ``optax.multi_transform``), so XLA computes none. The backward pass then
        differentiates only the values the trained parameters reach
        (`soapjax.graph._cotangents`): no weight gradient, synchronisation, gradient buffer
        or update for a frozen leaf, and no backward at all before the first trained one (a
        LoRA's base model below its first adapter). A plan does not depend on them (the
        fingerprint is the same); a plan cache's key names them
        (`soapjax.cost.updates.update_signature`).

        Raises:
          ValueError: not one flag per parameter leaf.
        """
        if len(frozen) != len(self.params):
            raise ValueError(f"with_frozen: expected one flag per parameter leaf "
                             f"({len(self.params)}), got {len(frozen)}")
        paths = tuple(leaf.path for leaf, f in zip(self.params, frozen) if f)
        return self if paths == self.frozen else dataclasses.replace(self, frozen=paths)

    def at_batch_size(self, size: int) -> OpGraph:
        """The same function traced again with `size` samples per batch (microbatches: the
        jaxpr has the batch size in its shapes). Operator names are the same.

        Raises:
          TraceError: the graph was not made by `trace`, or the batch does not divide.
        """
        if self.retrace is None:
            raise TraceError(f"graph {self.name!r} keeps no traced function to trace again at "
                             f"batch size {size}; make it with soapjax.trace")
        if size < 1 or self.batch_size % size:
            raise TraceError(f"batch size {size} does not divide graph {self.name!r}'s batch "
                             f"of {self.batch_size}")
        if size == self.batch_size:
            return self
        again = self.retrace(size)
        return dataclasses.replace(again, frozen=self.frozen) if self.frozen else again

    def operator(self, name: str) -> Operator:
        """The operator called `name`; raises KeyError naming close matches."""
        j = self._positions().get(name)
        if j is not None:
            return self.operators[j]
        near = difflib.get_close_matches(name, [o.name for o in self.operators], n=3)
        hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
        raise KeyError(f"no operator {name!r} in graph {self.name!r}{hint}")

    def index(self, name: str) -> int:
        """The position of the operator called `name`; raises KeyError as `operator`."""
        j = self._positions().get(name)
        if j is None:
            self.operator(name)  # raises the KeyError that names close matches
        return j

    def _positions(self) -> dict[str, int]:
        return self.memo("positions", lambda: {op.name: j for j, op in
                                               reversed(list(enumerate(self.operators)))})

    def repeated_blocks(self) -> list[list[int]]:
        """Indices of operators at the same position of every layer of a scan over layers
        (equal `Operator.block_position`, equal iteration dims), in groups of two or more."""
        def compute() -> tuple[tuple[int, ...], ...]:
            groups: dict[tuple, list[int]] = {}
            for i, op in enumerate(self.operators):
                if op.block_position:
                    key = (op.block_position, op.iteration_sizes, op.iteration_roles, op.anchor)
                    groups.setdefault(key, []).append(i)
            return tuple(tuple(g) for g in groups.values() if len(g) > 1)
        return [list(g) for g in self.memo("repeated_blocks", compute)]

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
        out = {"model": self.name, "num_equations": self.num_equations,
               "num_operators": len(self.operators), "batch_size": self.batch_size,
               "operators": ops, "tensors": tensors, "unsupported": list(self.unsupported)}
        if self.has_aux:  # (only then: the fingerprints of other graphs stay as they were)
            out["aux_outputs"] = self.aux_outputs
        return out

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
                 replace: Mapping[str, Callable[..., Sequence[Any]]] | None = None,
                 checkpoints: Sequence[Sequence[str]] = (),
                 keys: Callable[[Any], Any] | None = None,
                 on_input: Callable[[Operator, int, Any], Any] | None = None,
                 calls: Mapping[int, Callable[..., Sequence[Any]]] | None = None,
                 on_checkpoint_input: Callable[[Operator, int, Any], Any] | None = None):
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
          checkpoints: groups of operator names, each evaluated inside one ``jax.checkpoint``
            that saves nothing (recomputation, `soapjax.strategy.memory`): the group's
            equations, those of other operators between them run before the checkpoint (or
            after it, where they read the group's values; `Program._checkpoint_order`). A
            group interleaved both ways with another operator recomputes every equation from
            its first to its last; one spanning a remat region of the model, or one that would
            cut an earlier group's checkpoint in two, recomputes nothing.
          keys: applied to every PRNG key the program makes from constants (`makes_keys`);
            operators that make keys must then not be replaced.
          on_input: called as ``on_input(op, o, value)`` for operand `op.inputs[o]` (an
            activation, parameter or batch leaf) of every operator not in `replace`; its
            equations read what it returns instead of the value (apply constrains an
            operator's operands to its config here, as `replace`'s functions do themselves).
          calls: program unit index -> a function that computes that one equation instead
            (its operands to its results), outside the operators in `replace` (apply runs a
            context-parallel attention equation in `jax.shard_map` so).
          on_checkpoint_input: called as ``on_checkpoint_input(op, o, value)`` for operand
            `op.inputs[o]` of an operator in one of `checkpoints` where that value enters the
            group's ``jax.checkpoint`` from outside; the checkpoint takes (and saves for its
            recomputation) what it returns instead (apply keeps a parameter there in its stored
            layout, so the recomputation gathers it again, as the simulator prices it).

        Returns:
          The function's result: the scalar loss, or ``(loss, aux)`` (`has_aux`).

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
        replaced = frozenset().union(*(sw[0] for sw in swaps.values()))
        swaps.update((i, sw) for i, sw in self.program.unit_swaps(calls or {}).items()
                     if i not in replaced)
        spans, pins = {}, {}
        for group in checkpoints:
            units = [u for name in group for u in self.program.local[name].units]
            if units:
                spans[min(units)] = units
                if on_checkpoint_input is not None:
                    made = {t.value for name in group for t in self.operator(name).outputs}
                    for name in group:
                        op = self.operator(name)
                        for o, x in enumerate(op.inputs):
                            if x.kind != "const" and x.value not in made:
                                pins.setdefault(x.value, functools.partial(
                                    on_checkpoint_input, op, o))
        reads: dict[int, list[tuple]] = {}
        for op in self.operators if on_input is not None else ():
            if replace and op.name in replace:
                continue
            first: dict[int, int] = {}  # value id -> its first operand (one value, two operands)
            for o, x in enumerate(op.inputs):
                if x.kind != "const":
                    first.setdefault(x.value, o)
            for i in self.program.local[op.name].units:
                for pos, v in enumerate(self.program.units[i].ins):
                    if v in first:
                        o = first[v]
                        reads.setdefault(i, []).append(
                            (pos, (op.name, o), functools.partial(on_input, op, o)))
        out = self.program.run(flat_inputs, hook, swaps=swaps, checkpoints=spans, keys=keys,
                               reads=reads, pins=pins)
        return out[0] if self.aux_tree is None else (out[0], self.aux(out[1:]))

    @property
    def has_aux(self) -> bool:
        """Whether the traced function returns ``(loss, aux)`` (`trace`'s `has_aux`)."""
        return self.aux_tree is not None

    @property
    def aux_outputs(self) -> int:
        """How many leaves the traced function returns beside its loss (0 for the loss alone)."""
        return len(self.program.outputs) - 1

    def aux(self, leaves: Sequence[Any]) -> Any:
        """The aux pytree of its leaves (the program's outputs after the loss)."""
        return jax.tree.unflatten(self.aux_tree, list(leaves))

    def loss_and_aux(self, value: Any) -> tuple[Any, Any]:
        """``(loss, aux)`` of what the traced function returns (a step's loss output): the
        pair itself where it `has_aux`, else ``(value, None)``."""
        return tuple(value) if self.has_aux else (value, None)

    def makes_keys(self, name: str) -> bool:
        """Whether operator `name` makes PRNG keys from constants (reads a typed-key constant,
        or holds `random_seed`/`random_wrap`): dropout's key, before it is split and drawn."""
        prog = self.program
        units = prog.local[self.operator(name).name].units
        return any(prog.units[u].eqn.primitive.name in KEY_MAKERS
                   or any(v in prog.consts and is_key(prog.dtypes[v]) for v in prog.units[u].ins)
                   for u in units)

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


def trace(fn: Callable, *example_args, params_argnums: int | Sequence[int] = 0,
          batch_argnums: int | Sequence[int] = 1, name: str | None = None,
          microbatch_statistics: bool | None = None, has_aux: bool = False) -> OpGraph:
    """Traces `fn` (a loss: parameters and a batch to a scalar) into an `OpGraph`.

    Args:
      fn: the forward/loss function, e.g. ``loss_fn(params, batch) -> scalar``.
      *example_args: example arguments: arrays or `jax.ShapeDtypeStruct`s (nothing is run).
      params_argnums: which arguments hold trained parameters.
      batch_argnums: which arguments hold the batch; dim 0 of every batch leaf is the sample
        dim. Other arguments are constants.
      name: the graph's name (default: the function's name).
      microbatch_statistics: where the samples of a batch interact (`OpGraph.sample_coupling`),
        let plans use microbatches anyway, each computing its statistics over its own samples
        (Megatron-LM's semantics for a mixture of experts' capacity and auxiliary loss); the
        step then computes another function than yours. By default such graphs keep one
        microbatch, and their plans compute exactly your step. None (default): what `fn`
        says in an attribute ``soapjax_microbatch_statistics`` (set on the zoo's mixture of
        experts), else False.
      has_aux: `fn` returns ``(loss, aux)``, as ``jax.value_and_grad(..., has_aux=True)``
        takes it: metrics, a linen model's updated ``batch_stats``. The aux leaves are the
        program's outputs after the loss (`OpGraph.aux_tree`), computed by the operators as
        the loss is, not differentiated; `OpGraph.evaluate` returns ``(loss, aux)``. Such a
        graph keeps one microbatch and no pipeline stages (`soapjax.strategy.memory`).

    Returns:
      The operator graph.

    Raises:
      TraceError: no batch argument, arguments that do not fit `fn`, a batch whose leaves
        disagree on the batch size, or a function that does not return a real floating-point
        scalar (with `has_aux`: a pair whose first element is one).
    """
    fname = getattr(fn, "__name__", type(fn).__name__)
    if microbatch_statistics is None:
        microbatch_statistics = bool(getattr(fn, "soapjax_microbatch_statistics", False))
    pnums = _argnums(params_argnums, "params_argnums")
    bnums = _argnums(batch_argnums, "batch_argnums")
    _check_args(fn, fname, example_args, pnums, bnums)
    abstract = jax.tree.map(_abstract, example_args)
    aux_trees: list[Any] = []
    traced = _flat_loss_and_aux(fn, fname, aux_trees) if has_aux else fn
    try:
        closed = jax.make_jaxpr(traced)(*abstract)
    except TraceError:
        raise
    except Exception as e:  # the user's function failed on these arguments: say which and why
        raise TraceError(f"tracing {fname} with the example arguments "
                         f"{_describe_args(abstract)} failed: {type(e).__name__}: {e}") from e
    out = closed.jaxpr.outvars
    if has_aux and _dims.shape_of(out[0]) != ():
        raise TraceError(f"{fname} (has_aux=True) must return (loss, aux) with a scalar loss, "
                         f"but its loss is {out[0].aval}; return the mean (or sum) over the "
                         "batch as the loss")
    if not has_aux and (len(out) != 1 or _dims.shape_of(out[0]) != ()):
        got = ", ".join(str(v.aval) for v in out)
        aux = (len(out) > 1 and _dims.shape_of(out[0]) == ()
               and jnp.issubdtype(out[0].aval.dtype, jnp.floating))
        raise TraceError(
            f"{fname} must return a scalar loss, but returned ({got})"
            + ("; for a loss with other values (as jax.value_and_grad(..., has_aux=True) "
               "takes it: metrics, updated batch statistics), pass has_aux=True"
               if aux else ""))
    dtype = out[0].aval.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TraceError(f"{fname} must return a real floating-point loss to differentiate, but "
                         f"returned {dtype} ({out[0].aval}); return the loss before casting it "
                         "(jax.grad needs a float: an integer has no gradient, a complex loss "
                         "none that training follows)")
    program = Program(closed, _param_positions(example_args, pnums))
    if program.dropped:
        warnings.warn(
            f"{fname} applies {program.dropped} sharding constraint(s) of its own "
            "(jax.lax.with_sharding_constraint, nn.with_logical_constraint under a mesh); "
            "soapjax's plan sets every layout, so the traced step leaves them out (they change "
            "no number); remove them, or keep them for your own runs", stacklevel=2)
    params, batch = _leaves(example_args, program, pnums, bnums)
    warn_of_constants(program, params, fname)
    builder = _Builder(program, params, batch, name or fname)
    ops, unsupported = builder.build()

    def retrace(size: int) -> OpGraph:
        args = list(abstract)
        for b in bnums:
            args[b] = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype), args[b])
        return trace(fn, *args, params_argnums=params_argnums, batch_argnums=batch_argnums,
                     name=name or fname, microbatch_statistics=microbatch_statistics,
                     has_aux=has_aux)

    return OpGraph(name=name or fname, operators=tuple(ops),
                   num_equations=_count_eqns(closed.jaxpr),
                   params=tuple(params), batch=tuple(batch), unsupported=tuple(unsupported),
                   program=program, retrace=retrace, sample_coupling=builder.sample_coupling(),
                   sample_sums=builder.sample_sums(),
                   microbatch_statistics=bool(microbatch_statistics),
                   aux_tree=aux_trees[0] if has_aux else None,
                   params_tree=jax.tree.structure(
                       example_args[pnums[0]] if len(pnums) == 1
                       else tuple(example_args[i] for i in pnums)))


def _flat_loss_and_aux(fn: Callable, fname: str, trees: list) -> Callable:
    """`fn` returning ``(loss, aux)`` as the flat list ``[loss, *aux leaves]``, the aux's
    structure appended to `trees` when traced."""
    def flat(*args):
        out = fn(*args)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            got = type(out).__name__ + (f" of {len(out)}" if isinstance(out, (tuple, list))
                                        else "")
            raise TraceError(f"{fname} (has_aux=True) must return a pair (loss, aux), but "
                             f"returned a {got}")
        leaves, tree = jax.tree.flatten(out[1])
        trees.append(tree)
        return [out[0], *leaves]

    return flat


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
        raise TraceError(f"the {n} example argument(s) do not fit "
                         f"{fname}{_signature(fn)}: {e}") from e
    except ValueError:  # builtins without a signature: let tracing speak
        pass
    for i in bnums:
        leaves = jax.tree_util.tree_flatten_with_path(args[i])[0]
        if not leaves:
            raise TraceError(f"batch argument {i} of {fname} has no arrays; expected a pytree "
                             "of arrays whose dim 0 is the batch")
        first = None
        # values the batch holds that are not per sample (a temperature, a table of class
        # embeddings) go in through the loss's closure
        closure = (f"; pass values that are not per sample to {fname} another way: "
                   f"functools.partial({fname}, ...) or a closure over them (traced as "
                   "constants of the step)")
        for kp, leaf in leaves:
            shape = tuple(np.shape(leaf))
            where = jax.tree_util.keystr(kp) or f"argument {i}"
            if not shape:
                raise TraceError(f"batch leaf {where} of {fname} is a scalar; expected dim 0 "
                                 "to be the batch (sample) dim" + closure)
            if first is None:
                first = (where, shape[0])
            elif shape[0] != first[1]:
                raise TraceError(f"batch leaf {where} has batch size {shape[0]} (shape {shape}), "
                                 f"but {first[0]} has {first[1]}; dim 0 of every batch leaf "
                                 "must be the batch. Samples of different sizes packed end to "
                                 "end (a batch of graphs' nodes and edges, packed sequences) "
                                 "are laid out per sample instead, padded to one size, with "
                                 "indices local to their sample ([samples, nodes, ...], "
                                 "[samples, edges]; jax.vmap of the per-sample code)" + closure)


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        # weakly typed as jax.jit and jax.eval_shape see it (a parameter made by
        # jnp.array(2.0)): the same jaxpr from arrays as from their `jax.eval_shape`
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                    weak_type=bool(getattr(x, "weak_type", False)))
    return x


def _describe_args(args) -> str:
    def one(a):
        leaves = jax.tree.leaves(a)
        if len(leaves) == 1 and hasattr(leaves[0], "shape"):
            return f"{leaves[0].dtype}{list(leaves[0].shape)}"
        return f"<pytree of {len(leaves)} leaves>"

    return "(" + ", ".join(one(a) for a in args) + ")"


def _leaves(args, program: Program, pnums, bnums) -> tuple[list[LeafInfo], list[LeafInfo]]:
    n = len(args)
    pset, bset = {i % n for i in pnums}, {i % n for i in bnums}
    params, batch = [], []
    k = 0
    for i, a in enumerate(args):
        for kp, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            vid = program.inputs[k]
            k += 1
            several = (len(pset) > 1 and i in pset) or (len(bset) > 1 and i in bset)
            prefix = f"[{i}]" if several else ""
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
