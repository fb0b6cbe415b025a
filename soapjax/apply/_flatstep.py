"""The step without pipeline stages: the traced loss with a sharding constraint on every operator.

The traced forward pass is re-evaluated equation by equation inside `jax.jit`
(`OpGraph.evaluate`), and every operator output gets
``jax.lax.with_sharding_constraint(value, NamedSharding(mesh, config.output_spec(op, k)))``;
an operator whose equations run together (`OpGraph.replaceable`: most of them) is computed by
its own program (`soapjax.graph._local.operator_fn`) with its operands constrained to the specs its
config gives them too (and the values it makes held there in the forward pass:
`_Layouts.held`), and the operands of the others (a loss interleaved with its labels'
preprocessing) are constrained where their equations read them. No model code changes;
autodiff carries the constraints to the backward pass, and XLA's SPMD partitioner inserts the
collectives (`constrained_loss`). `FlatStep` is its `soapjax.apply._shardings.StepProgram`: the
loss's ``jax.value_and_grad`` on the user's mesh, over M microbatches in a ``lax.scan`` where
the strategy has them. `soapjax.apply.step` re-exports the public names.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from soapjax.apply._context_parallel import ContextParallel, context_parallel
from soapjax.apply._manual import manual_calls
from soapjax.apply._validation import (
    Checked,
    check_strategy,
    refuse_spatial_convolutions,
    validate_leaves,
    validate_program_inputs,
)
from soapjax.base.errors import PlanError
from soapjax.graph._local import draws_random_bits, has_custom_rules, operator_fn
from soapjax.graph.opgraph import OpGraph
from soapjax.simulate._flatsim import scatter_target, scattered_operand_axes
from soapjax.strategy import space
from soapjax.strategy.memory import Segments, recomputes
from soapjax.strategy.space import Config, MeshShape, Strategy, reduces_into

__all__ = ["FlatStep", "constrained_loss", "recompute_segments", "step_keys"]


def constrained_loss(graph: OpGraph, strategy: Any, mesh: Mesh, *,
                     mesh_shape: MeshShape | None = None,
                     allow_spatial_convolutions: bool = False,
                     constrain_operands: bool = True) -> Callable[[Any, Any], jax.Array]:
    """The traced loss with the strategy's sharding constraint on every operator output.

    Call the result inside your own jitted step (``jax.value_and_grad`` of it gives gradients
    whose backward pass follows the same shardings).

    Strategies that split a convolution's spatial dims are refused: XLA's SPMD partitioner (jax
    0.10.2) computes such convolutions wrongly. With Shardy, jax's default, a convolution whose
    output is split over height or width loses part of its kernel gradient (and with the
    channels split too, its forward result); with either partitioner, one whose input arrives
    split spatially while its kernel is split over input channels computes a wrong forward
    result. Plan convolutions without attribute splits (`SpaceLimits(allow_attribute=False)`).

    Args:
      graph: the traced graph of ``loss_fn(params, batch)``.
      strategy: a `Strategy` or plan (see `validate_strategy`).
      mesh: the mesh, with Auto axes.
      mesh_shape: the mesh the strategy was planned for, when known.
      allow_spatial_convolutions: apply a strategy that splits convolutions spatially anyway
        (to check whether a newer XLA computes it correctly).
      constrain_operands: constrain every operator's operands to the specs its config gives
        them too (the layouts the simulator reshards them to): inside its own program for an
        operator computed at once (`OpGraph.replaceable`), where its equations read them for
        the others (a dim that does not divide by its axes is left alone). Without these XLA
        chooses how to move an operator's operands itself: for a convolution that splits its
        input channels it often gathers the kernel instead of reducing partial sums (AlexNet
        tiny's searched plan: 89 KB where the plan says 50 KB); for a cross-entropy whose
        vocabulary arrives split it reduces over the split vocabulary instead of the
        all-to-all the plan makes (rnnlm tiny: 11 collectives over all three axis sets where
        the plan has 5 over `data`, 6.4 ms where it runs in 4.3).

    Returns:
      ``loss(params, batch, step=None) -> scalar`` (``-> (loss, aux)`` for a graph traced
      with ``has_aux=True``); params and batch must have the traced leaves. With ``step``
      (an int32 scalar, the training step's number), every PRNG key the program makes from
      constants (dropout's) is folded with it (`step_keys`): step 0 computes exactly the
      traced function, later steps draw fresh masks.

    Raises:
      PlanError: see `validate_strategy`; a convolution split spatially; and, when called, leaves
        that differ from the traced ones.
    """
    check = check_strategy(graph, strategy, mesh, mesh_shape=mesh_shape)
    strategy = check.strategy
    if strategy.pipelined:
        raise PlanError(f"the strategy has {strategy.stages} pipeline stages, and "
                        "constrained_loss is one SPMD loss without stages; run a pipelined "
                        "strategy with sharded_train_step (or training.shard_training)")
    if not allow_spatial_convolutions:
        refuse_spatial_convolutions(check)
    validate_program_inputs(graph)
    layouts = _Layouts(graph, strategy, mesh)
    out_shardings = {op.name: layouts.outputs(j) for j, op in enumerate(graph.operators)}

    def constrain(op, k, value):
        return jax.lax.with_sharding_constraint(value, out_shardings[op.name][k])

    cps = {j: cp for j, (op, cfg) in enumerate(zip(graph.operators, strategy.configs))
           if (cp := context_parallel(graph, op, cfg, mesh, ring=strategy.ring_attention))
           is not None}
    in_shardings = {op.name: ([(s, None) for s in cps[j].operands] if j in cps
                              else layouts.operands(j))
                    for j, op in enumerate(graph.operators)} if constrain_operands else {}

    def constrain_input(op, o, value):
        sharding, back = in_shardings[op.name][o]
        return value if sharding is None else _constrain_operand(value, sharding, back)

    manual = manual_calls(graph, strategy.configs, mesh)
    grouped = _operator_programs(graph, strategy, layouts, constrain_operands, cps, manual)
    calls = {cp.unit: cp.run_unit for cp in cps.values()} | manual
    checkpoints = recompute_segments(graph, strategy)
    stored = stored_inputs(graph, strategy, mesh, checkpoints)

    def stored_input(op, o, value):
        sharding = stored.get((op.name, o))
        return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)

    # Operators that make keys from constants run equation by equation when keys advance.
    keyless = {name: fn for name, fn in grouped.items() if not graph.makes_keys(name)}

    def loss(params: Any, batch: Any, step: Any = None) -> jax.Array:
        flat_params, flat_batch = jax.tree.leaves(params), jax.tree.leaves(batch)
        validate_leaves(graph.params, flat_params, "params")
        validate_leaves(graph.batch, flat_batch, "batch")
        keys = None if step is None else functools.partial(step_keys, step=step)
        return graph.evaluate(*flat_params, *flat_batch, on_output=constrain,
                              replace=grouped if keys is None else keyless,
                              checkpoints=checkpoints, keys=keys,
                              on_input=constrain_input if constrain_operands else None,
                              calls=calls, on_checkpoint_input=stored_input if stored else None)

    return loss


def step_keys(key: jax.Array, *, step: jax.Array) -> jax.Array:
    """`key` (any shape of typed keys) for training step `step`: itself at step 0, else each
    key folded with the step number, so every step draws fresh, independent random bits."""
    flat = key.reshape(-1)
    folded = jax.vmap(lambda k: jax.random.fold_in(k, step))(flat)
    data = jnp.where(step == 0, jax.random.key_data(flat), jax.random.key_data(folded))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key)).reshape(key.shape)


def recompute_segments(graph: OpGraph, strategy: Strategy) -> list[list[str]]:
    """The operators that recompute, as `soapjax.strategy.memory` segments (names in graph order):
    each runs inside one ``jax.checkpoint`` that saves nothing, so what crosses its border is
    kept and what stays inside is recomputed, as the simulator prices it."""
    flags = [recomputes(op, strategy.recompute_of(j)) for j, op in enumerate(graph.operators)]
    out: dict[int, list[str]] = {}
    for j, first in enumerate(Segments(graph).segments(flags)):
        if first >= 0:
            out.setdefault(first, []).append(graph.operators[j].name)
    return list(out.values())


def stored_inputs(graph: OpGraph, strategy: Strategy, mesh: Mesh,
                  checkpoints: Sequence[Sequence[str]]) -> dict[tuple[str, int], NamedSharding]:
    """The parameters a recomputing operator reads in another layout than they are stored in
    (under ZeRO-3, gathered): ``(operator name, operand index)`` -> the stored layout of the
    parameter (its layer's slice), which its segment's ``jax.checkpoint`` takes them in.

    Taken so, the gather runs inside the checkpoint: once in the forward pass and again when
    the segment recomputes, and the gathered copy is not kept between them (as FSDP runs it,
    and as the simulator prices it: `soapjax.strategy.memory`, "Recomputation"). Left to
    itself, XLA's sharding propagation would gather the parameter before the checkpoint and
    keep the whole copy for the backward pass (docs/xla-workarounds.md).
    """
    if not checkpoints:
        return {}
    shape = MeshShape.of(mesh)
    specs = space.param_specs(graph, strategy, shape)
    out = {}
    for group in checkpoints:
        for name in group:
            op, config = graph.operator(name), strategy.configs[graph.index(name)]
            for o, x in enumerate(op.inputs):
                if x.kind != "param":
                    continue
                store = specs[x.leaf_path][len(x.layer):]
                if space.fit_spec(config.operand_axes(x.dims), x.shape, shape) != store:
                    out[(name, o)] = NamedSharding(
                        mesh, PartitionSpec(*(tuple(a) if a else None for a in store)))
    return out


def _operator_programs(graph: OpGraph, strategy: Strategy, layouts: _Layouts,
                       constrain_operands: bool, cps: dict[int, ContextParallel],
                       manual: dict[int, Callable]) -> dict[str, Callable]:
    """Operator name -> the program that computes it at once, for every operator whose
    equations run together (`OpGraph.replaceable`): a loop split over its batch per group of
    samples (`_grouped_loop`), any other its own program (`soapjax.graph._local.operator_fn`,
    the values it makes held in its config's layout: `_Layouts.value_hook`); with
    `constrain_operands`, its operands constrained to the specs its config gives them
    (`_Layouts.operands`); a context-parallel attention operator (`cps`:
    operator index -> `soapjax.apply._context_parallel.ContextParallel`) its attention equation in
    `jax.shard_map`; a top k over split rows and a grouped convolution (`manual`: program
    unit -> its computation, `soapjax.apply._manual`) in `jax.shard_map` too."""
    programs, mesh = {}, layouts.mesh
    for j, (op, cfg) in enumerate(zip(graph.operators, strategy.configs)):
        if not graph.replaceable(op.name):
            continue
        if (cp := cps.get(j)) is not None:  # context parallelism: gathered or a ring
            fn = operator_fn(graph, op.name, attention=cp.attention, calls=manual)[0]
            programs[op.name] = (_with_operand_constraints(fn, [(s, None) for s in cp.operands])
                                 if constrain_operands else fn)
            continue
        fn = (_grouped_loop(graph, op, cfg, mesh)
              or operator_fn(graph, op.name, on_value=layouts.value_hook(j, manual),
                             calls=manual)[0])
        if constrain_operands:
            fn = _with_operand_constraints(
                fn, [(s or NamedSharding(mesh, cfg.operand_spec(o.dims)), back)
                     for o, (s, back) in zip(op.inputs, layouts.operands(j))])
        programs[op.name] = fn
    return programs


class _Layouts:
    """The shardings apply gives every operator's outputs and operands, and the value inside
    an operator it constrains too.

    Each output gets its config's spec, and each operand the spec its config gives it; but
    where an operator's partial sums are reduce-scattered
    (`soapjax.simulate._flatsim.scatter_target`: a row-parallel matmul whose readers take its output
    split further over the axes that split its contraction, as Megatron's sequence parallelism has
    them), its output gets the readers' layout, its matmul's result is constrained to that layout
    inside the operator (before the bias and residual add: otherwise XLA all-reduces the whole
    buffer, adds, and only then slices; tiny GPT on cpu8; docs/xla-workarounds.md), and an
    activation it adds after the matmul (a residual) is read in it too
    (`soapjax.simulate._flatsim.scattered_operand_axes`). These are the layouts the simulator
    prices.
    """

    def __init__(self, graph: OpGraph, strategy: Strategy, mesh: Mesh):
        self.graph, self.strategy, self.mesh = graph, strategy, mesh
        self.shape = MeshShape.of(mesh)
        readers: dict[int, list[tuple[int, Any]]] = {}
        for p, j, o in graph.edges():
            readers.setdefault(p, []).append((j, o))
        self.targets = []
        for p, (op, cfg) in enumerate(zip(graph.operators, strategy.configs)):
            specs = [strategy.configs[j].operand_axes(o.dims) for j, o in readers.get(p, [])]
            self.targets.append(scatter_target(op, cfg, specs, self.shape))

    def _sharding(self, axes: Sequence[Sequence[str]]) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*(tuple(a) if a else None for a in axes)))

    def outputs(self, j: int) -> list[NamedSharding]:
        op, cfg = self.graph.operators[j], self.strategy.configs[j]
        if self.targets[j] is not None:
            return [self._sharding(self.targets[j])]
        return [NamedSharding(self.mesh, cfg.output_spec(op, k)) for k in range(len(op.outputs))]

    def operands(self, j: int) -> list[tuple[NamedSharding | None, NamedSharding | None]]:
        """Per operand of operator `j`, its sharding (None where a dim does not divide by its
        axes: a dim that follows an iteration dim at another extent, which XLA would pad) and
        the sharding its cotangent goes back in: the producer's where the cotangent is a
        partial sum and the producer's layout differs (so XLA reduces it straight into that
        layout: each of Q, K and V's into the sequence split, one reduce-scatter each, where the
        constraint's own transpose makes it all-reduce each whole and slice their sum), else
        None."""
        op, cfg, out = self.graph.operators[j], self.strategy.configs[j], []
        for o, x in enumerate(op.inputs):
            axes = scattered_operand_axes(op, cfg, o, self.targets[j], self.shape)
            if any(size % self.shape.degree(a) for size, a in zip(x.shape, axes)):
                out.append((None, None))
                continue
            sharding, back = self._sharding(axes), None
            partials = cfg.cotangent_partials(x, self.shape.axis_names)
            if x.kind == "activation" and partials:
                p = self.graph.index(x.source)
                src = self.outputs(p)[x.index]
                if x.layer:  # a layer's slice of a stacked value: the slice's own dims
                    spec = tuple(src.spec)
                    spec += (None,) * (len(x.layer) + len(x.shape) - len(spec))
                    src = NamedSharding(self.mesh, PartitionSpec(*x.read_of(spec)))
                if src.spec != sharding.spec and _reduce_scatters(sharding.spec, src.spec,
                                                                  partials, len(x.shape)):
                    back = src
            out.append((sharding, back))
        return out

    def value_hook(self, j: int, manual: Mapping[int, Any] | None = None) -> Callable:
        """``on_value`` for `soapjax.graph._local.operator_fn` of operator `j`: where its partial
        sums are reduce-scattered, its matmul's result constrained to the target layout
        (`_anchor_hook`); else the values `held` gives, held there in the forward pass only,
        so that XLA computes the operator where the plan, and the simulator, put it.

        Left to its sharding propagation, XLA placed values inside an operator by their uses
        in the backward pass too: MobileNet's ReLU6 before a 1x1 projection that reads its
        input whole was computed on the channel shards (where the backward pass masks the
        cotangent), gathered, and its input gathered again for those masks (1.36x the plan's
        collective bytes; `tests/test_apply.py`). The cotangents stay XLA's to place:
        constrained too, they made it all-reduce the projection's input cotangent whole where
        the plan reduce-scatters it into the producer's layout (`operands`' ``back``)."""
        anchor = self._anchor_hook(j)
        if anchor is not None:
            return anchor
        held = self.held(j, manual)

        def hook(v: int, value: Any) -> Any:
            return _held(value, held[v]) if v in held else value
        return hook

    def held(self, j: int, manual: Mapping[int, Any] | None = None
             ) -> dict[int, NamedSharding]:
        """Value id -> its layout under operator `j`'s config (`_value_axes`), for every
        floating value the operator's own equations make whose layout is known, except those
        an equation run in `jax.shard_map` reads (`manual`: program unit -> its computation,
        `soapjax.apply._manual`), whose specs say where they go."""
        op, cfg = self.graph.operators[j], self.strategy.configs[j]
        prog = self.graph.program
        loc = prog.local[op.name]
        read = {v for i in loc.units if i in (manual or {}) for v in prog.units[i].ins}
        out = {}
        for i in loc.units:
            for v in prog.units[i].outs:
                if (v is None or v in read or v not in loc.lab or "float" not in prog.dtypes[v]
                        or len(loc.lab[v]) != len(prog.shapes[v])):
                    continue
                axes = self._value_axes(loc, cfg, v)
                if axes is not None:
                    out[v] = self._sharding(axes)
        return out

    def _value_axes(self, loc: Any, cfg: Config, v: int) -> list[tuple[str, ...]] | None:
        """The axes `cfg` splits each dim of value `v` over (a dim that merges several, as a
        fused projection's columns before the heads are made: those of its major part), or
        None where that is not known or no `PartitionSpec`: a dim the labels tie to no
        iteration dim (a batch dim before windows merge it with others), a merged dim split
        in a minor part, a dim its axes do not divide."""
        def axes_of(lbl: int) -> tuple[str, ...] | None:
            if not any(r in loc.iter_of for r in loc.labels.chain(lbl)):
                return None
            d = loc.labels.lookup(lbl, loc.iter_of)
            return tuple(cfg.axes[d]) if d is not None else ()

        out = []
        for lbl, size in zip(loc.lab[v], self.graph.program.shapes[v]):
            axes = () if size == 1 else axes_of(lbl)
            if axes is None:  # a merged dim: split as its major part, if the rest is whole
                parts = [axes_of(p) for p in loc.labels.parts_of(lbl)]
                if not parts or None in parts or any(parts[1:]):
                    return None
                axes = parts[0]
            if size % self.shape.degree(axes):
                return None
            out.append(axes)
        return out if _distinct(out) else None

    def _anchor_hook(self, j: int) -> Callable | None:
        """Where operator `j`'s partial sums are reduce-scattered, ``on_value`` that constrains
        its matmul's result to the target layout (the one equation of its anchor primitive;
        None where there is no such one, or no target)."""
        target = self.targets[j]
        if target is None:
            return None
        op, cfg = self.graph.operators[j], self.strategy.configs[j]
        prog = self.graph.program
        loc = prog.local[op.name]
        made = [v for i in loc.units if prog.units[i].eqn.primitive.name == op.anchor
                for v in prog.units[i].outs if v is not None]
        if len(made) != 1:
            return None
        vid = made[0]
        by_dim = {d: t for d, t in zip(op.outputs[0].dims, target) if d is not None}
        axes = []
        for lbl, size in zip(loc.lab[vid], prog.shapes[vid]):
            d = loc.labels.lookup(lbl, loc.iter_of)
            a = by_dim.get(d, cfg.axes[d] if d is not None and d < len(op.shape) else ())
            axes.append(a if size % self.shape.degree(a) == 0 else ())
        if not _distinct(axes):
            return None
        sharding = self._sharding(axes)

        def hook(v: int, value: Any) -> Any:
            return jax.lax.with_sharding_constraint(value, sharding) if v == vid else value
        return hook


def _distinct(axes: Sequence[Sequence[str]]) -> bool:
    """Whether no mesh axis splits two of a value's dims: a value whose dims two tie to one
    iteration dim (PointNet's ``A @ A.T - eye``, a square whose rows and columns its labels
    join) has no `PartitionSpec` of that split, and is left to XLA."""
    used = [a for dim in axes for a in dim]
    return len(used) == len(set(used))


def _reduce_scatters(spec: PartitionSpec, producer: PartitionSpec, partials: Sequence[str],
                     ndim: int) -> bool:
    """`soapjax.strategy.space.reduces_into` of two `PartitionSpec`s: only then is a partial
    cotangent constrained to its producer's layout (`_Layouts.operands`); else it goes back
    in the reader's layout, all-reduced there, and XLA moves it."""
    def dims(p: PartitionSpec) -> tuple[tuple[str, ...], ...]:
        out = [(a,) if isinstance(a, str) else tuple(a or ()) for a in p]
        return tuple(out + [()] * (ndim - len(out)))

    return reduces_into(dims(spec), dims(producer), partials)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _constrain_operand(x: jax.Array, sharding: NamedSharding,
                       back: NamedSharding | None) -> jax.Array:
    """``with_sharding_constraint(x, sharding)``, whose cotangent is constrained to `back`
    instead of `sharding` where `back` is given (`_Layouts.operands`)."""
    return jax.lax.with_sharding_constraint(x, sharding)


def _constrain_operand_fwd(x, sharding, back):
    return _constrain_operand(x, sharding, back), None


def _constrain_operand_bwd(sharding, back, _, ct):
    return (jax.lax.with_sharding_constraint(ct, back if back is not None else sharding),)


_constrain_operand.defvjp(_constrain_operand_fwd, _constrain_operand_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _held(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``with_sharding_constraint(x, sharding)`` in the forward pass only: its cotangent goes
    back unconstrained (`_Layouts.value_hook`)."""
    return jax.lax.with_sharding_constraint(x, sharding)


def _held_fwd(x, sharding):
    return _held(x, sharding), None


def _held_bwd(sharding, _, ct):
    return (ct,)


_held.defvjp(_held_fwd, _held_bwd)


def _with_operand_constraints(fn: Callable,
                              shardings: Sequence[tuple[NamedSharding, Any]]) -> Callable:
    def run(*operands):
        return fn(*(_constrain_operand(x, s, b) if b is not None
                    else jax.lax.with_sharding_constraint(x, s)
                    for x, (s, b) in zip(operands, shardings)))
    return run


def _grouped_loop(graph: OpGraph, op: Any, cfg: Config, mesh: Mesh) -> Callable | None:
    """A loop operator split over its batch, computed as one group of samples per device
    group: ``vmap`` of its shard program over a leading group dim split like the batch, with
    its parameters broadcast along that dim.

    Evaluated as traced, a scan whose batch is split makes XLA (both partitioners;
    docs/xla-workarounds.md) all-reduce the gradient of every parameter the loop reads inside the
    backward loop, once per step: T times the bytes of one gradient synchronisation (rnnlm tiny: 549
    KB where data parallelism needs 83 KB). With a group dim the gradient comes out per group,
    summed over the groups once after the loop: one all-reduce, as the simulator prices it. The
    result is the same function (float32 rounding aside). The same for a value the model
    computes from parameters before the loop (RWKV's decays ``-exp(w)``: its cotangent too was
    all-reduced at every step). None where this does not apply: not a loop, batch not split,
    nothing read without the batch dim, an output without the batch dim, equations
    interleaved with other operators', constants that carry the batch, a custom derivative rule
    inside (it was traced for the whole batch and cannot be re-bound per group), or random bits
    drawn inside (dropout: drawn per group, the masks would differ from the traced program's).
    """
    d = space.sample_dim(op)
    if not op.is_loop or d is None or d >= len(cfg.axes) or not cfg.axes[d]:
        return None
    if not any(o.kind != "const" and d not in o.dims for o in op.inputs) or not (
            graph.replaceable(op.name)):
        return None  # nothing read the same by every sample: no gradient summed in the loop
    if has_custom_rules(graph, op.name) or draws_random_bits(graph, op.name):
        return None  # rules traced for the whole batch; random bits drawn at the whole shape
    out_pos = [t.dims.index(d) if d in t.dims else None for t in op.outputs]
    if None in out_pos or any(o.kind == "const" and d in o.dims for o in op.inputs):
        return None
    axes = tuple(cfg.axes[d])
    groups = int(np.prod([mesh.shape[a] for a in axes]))
    degrees = [1] * len(op.iteration_sizes)
    degrees[d] = groups
    shard_fn, _ = operator_fn(graph, op.name, degrees)
    in_pos = [o.dims.index(d) if d in o.dims else None for o in op.inputs]
    by_group = NamedSharding(mesh, PartitionSpec(axes))

    def split(x, p):
        if p is None:
            x = jax.numpy.broadcast_to(x, (groups, *x.shape))
        else:
            x = x.reshape(*x.shape[:p], groups, x.shape[p] // groups, *x.shape[p + 1:])
            x = jax.numpy.moveaxis(x, p, 0)
        return jax.lax.with_sharding_constraint(x, by_group)

    def merge(y, p):
        y = jax.numpy.moveaxis(y, 0, p)
        return y.reshape(*y.shape[:p], y.shape[p] * y.shape[p + 1], *y.shape[p + 2:])

    def run(*operands):
        outs = jax.vmap(lambda *xs: list(shard_fn(*xs)))(
            *(split(x, p) for x, p in zip(operands, in_pos)))
        return [merge(y, p) for y, p in zip(outs, out_pos)]

    return run


# --- the step program ---------------------------------------------------------------------------


class FlatStep:
    """The `soapjax.apply._shardings.StepProgram` of a strategy without pipeline stages: it runs on
    the user's mesh, its configs are over that mesh, its parameters keep the shardings of
    their specs, and its loss and gradients are ``jax.value_and_grad`` of `constrained_loss`.

    Attributes:
      check: the checked strategy.
      mesh: the mesh the step runs on (the one the strategy was checked on).
      config_mesh: the mesh the configs are over: `mesh`'s shape.
    """

    def __init__(self, check: Checked):
        self.check = check
        self.mesh = check.mesh
        self.config_mesh = MeshShape.of(check.mesh)

    def stored(self, strategy: Any) -> Any:
        """The plan's own strategy."""
        return strategy

    def param_layout(self, shardings: list[NamedSharding]) -> list[NamedSharding]:
        """The parameters' shardings: those of their specs, unchanged."""
        return shardings

    def value_and_grad(self, param_shardings: Any, batch_shardings: Any, *,
                       allow_spatial_convolutions: bool = False) -> Callable:
        """``(params, batch, step) -> (loss, grads)`` (`_value_and_grad`)."""
        del param_shardings  # the constraints inside the loss place everything
        return _value_and_grad(self.check, batch_shardings, allow_spatial_convolutions)


def split_microbatches(x: Any, microbatches: int) -> Any:
    """``[B, ...] -> [M, B / M, ...]``, microbatch ``k`` holding samples ``k, k + M, ...``: how
    every microbatched step splits a batch (flat, pipelined, and the reference of
    `soapjax.exactness`), so that a device splits its own shard of the sample dim and no
    data moves."""
    m = microbatches
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _micro_configs(graph: OpGraph, micro: OpGraph, configs: Sequence[Config]) -> tuple:
    """`configs` (of `graph`'s operators) for `micro`, the graph traced at a microbatch's
    size: the same config where an operator keeps its iteration dims; where a dim of the
    microbatch's size 1 vanished (a loss that sums its samples' and tokens' terms, traced at one
    sample, has no sample dim: Llama 3 8B at 128K tokens, 8 sequences in 8 microbatches), that
    dim's entry dropped, which splits it over nothing (one sample divides no further).

    Raises:
      PlanError: an operator's dims at the two sizes do not line up that way, or a dim that
        vanished is split over mesh axes.
    """
    m = graph.batch_size // micro.batch_size
    out = []
    for op, small, config in zip(graph.operators, micro.operators, configs):
        full, sizes = op.iteration_sizes, small.iteration_sizes
        if len(full) == len(sizes):
            out.append(config)
            continue
        axes, k = [], 0
        for n, a in zip(full, config.axes):
            if k < len(sizes) and sizes[k] in (n, n // m):
                axes.append(a)
                k += 1
            elif n == m and not a:  # the sample dim, one sample a microbatch: gone
                continue
            else:
                k = -1
                break
        if k != len(sizes):
            raise PlanError(f"operator {op.name!r} has iteration dims {full} at batch "
                            f"{graph.batch_size} and {sizes} at the microbatch size "
                            f"{micro.batch_size}, which do not line up under its config "
                            f"{config.axes}: plan with fewer microbatches")
        out.append(dataclasses.replace(config, axes=tuple(axes)))
    return tuple(out)


def _on_cpu(mesh: Mesh) -> bool:
    """Whether `mesh`'s devices are XLA:CPU's."""
    return mesh.devices.flat[0].platform == "cpu"


def _value_and_grad(check: Checked, batch_shardings: Any,
                    allow_spatial_convolutions: bool) -> Callable:
    """``(params, batch, step) -> (loss, grads)`` of the constrained loss (its PRNG keys
    advanced by the step number: `step_keys`); with M microbatches
    (`Strategy.microbatches`), the graph traced again at batch / M (same operator names, so
    the same configs), ``value_and_grad`` of it over the M microbatches in a ``lax.scan``,
    losses and gradients summed and divided by M: the mean over the whole batch, for a loss
    that is a mean over its samples (as the zoo's are). Microbatch k holds samples k, k + M,
    k + 2M, ...: each device splits its own shard, no data moves (a graph that draws random
    bits keeps M = 1, `soapjax.strategy.memory.random_operator`, so no keys to advance there)."""
    graph, mesh = check.graph, check.mesh
    strategy, m = check.strategy, check.strategy.microbatches
    if m == 1:  # a graph with aux values (has_aux) keeps M = 1: `microbatch_refusal`
        return jax.value_and_grad(constrained_loss(
            graph, check, mesh, allow_spatial_convolutions=allow_spatial_convolutions),
            has_aux=graph.has_aux)
    micro = graph.at_batch_size(graph.batch_size // m)
    names = [op.name for op in graph.operators]
    if [op.name for op in micro.operators] != names:
        raise PlanError(f"graph {graph.name!r} traced at batch {micro.batch_size} has other "
                        f"operators than at {graph.batch_size}; microbatches need the same "
                        "operators at both sizes: plan with microbatches=1")
    configs = _micro_configs(graph, micro, strategy.configs)
    loss_fn = constrained_loss(micro, Strategy(configs, strategy.zero_axes, 1,
                                               strategy.recompute), mesh,
                               allow_spatial_convolutions=allow_spatial_convolutions)
    grad_fn = jax.value_and_grad(loss_fn)
    # XLA:CPU gives an FFT in a loop body a layout its FFT cannot run (docs/xla-workarounds.md)
    unroll = m if _on_cpu(mesh) and any(op.anchor == "fft" for op in graph.operators) else 1

    def split(x, sharding):
        y = split_microbatches(x, m)
        spec = PartitionSpec(None, *sharding.spec)
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))

    def value_and_grad(params, batch, step=None):
        del step  # no random bits: see above
        micro_batches = jax.tree.map(split, batch, batch_shardings)

        def body(carry, mb):
            loss, grads = grad_fn(params, mb)
            return jax.tree.map(jax.numpy.add, carry, (loss, grads)), None

        first = jax.tree.map(lambda x: x[0], micro_batches)
        zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype),
                             jax.eval_shape(grad_fn, params, first))
        total, _ = jax.lax.scan(body, zeros, micro_batches, unroll=unroll)
        return jax.tree.map(lambda x: x / m, total)

    return value_and_grad

