"""FLOPs one device computes in a training step, counted as XLA counts them.

`soapjax check` holds a plan against the compiled step on the attached devices; one of its
questions is whether the devices do the work the plan says. XLA's own count
(``cost_analysis()``, `soapjax.measure.hlo.hlo_flops`) needs a compiled step; this module counts the
same from the graph and the strategy alone: each operator's forward and VJP traced at the
shard shapes its config gives one device, their equations counted by XLA's rules
(`soapjax.graph._dims.xla_flops`: a multiply-add 2, other elementwise work 1 per element,
transcendentals apart, a scan's body once per step), plus the recomputation the strategy asks
for and the optimizer's update of the parameter shards the device stores. On the zoo's plans
it is within 5% of the compiled steps' count; what is left (fusions recomputing elementwise
work) is measured in docs/checks.md. The analytic times (`soapjax.cost.roofline`) still price
``Operator.flops``, a backward twice the forward.

Example: four Dense layers of width 16 on one sample per device (batch 8, data parallel on 8
devices; tests/test_flops.py): the first multiplies ``[1, 16] @ [16, 16]`` and adds its bias,
``2 * 16 * 16 + 16`` FLOPs, and its weight gradient is an outer product, a multiply to XLA::

    counter = FlopCounter(graph, optimizer=optax.sgd(0.1))
    counter.operator(0, degrees).forward   # Flops(flops=528.0, transcendentals=0.0, matmul=512.0)
    counter.step(strategy, mesh).total     # 6913.0 FLOPs per device
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from soapjax.base._dtypes import is_float
from soapjax.cost.updates import update_whole_dims, whole_update_spec
from soapjax.graph._cotangents import differentiated_operands, differentiated_values
from soapjax.graph._cuts import computed_degrees
from soapjax.graph._dims import Flops as Flops, xla_flops
from soapjax.graph._local import CustomRuleError, operator_fn
from soapjax.graph._remat import remat_recomputes
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy.memory import recomputes
from soapjax.strategy.space import MeshShape, optimizer_state_axes, param_specs

__all__ = ["FlopCounter", "Flops", "OperatorFlops", "StepFlops", "step_flops"]

log = logging.getLogger(__name__)


class StepFlops(NamedTuple):
    """FLOPs one device computes in a training step, counted as XLA counts them.

    Each operator's forward and VJP are counted as the HLO their equations lower to
    (`soapjax.graph._dims.xla_flops`: a multiply-add is 2, other elementwise work 1 per element,
    transcendentals apart, a scan's body once per step), at the shard shapes its config gives
    one device (`FlopCounter.operator`): an operator whose config leaves mesh axes unused
    computes its whole shard on each of them. What XLA's compiler adds on its own (fusions
    recomputing elementwise work) is not here: docs/checks.md measures it.

    Attributes:
      forward: the operators' forward passes, with the residuals their backward passes read
        (a tanh's ``1 - y**2``), as JAX's ``value_and_grad`` puts them on the forward side.
      backward: the backward passes: cotangents of the operands that need them (activations
        that depend on parameters, float parameters; never the batch), and the sums of a
        parameter's gradients where several operators read it.
      recompute: forward passes run again in the backward pass (`Strategy.recompute`).
      update: the optimizer's update of the parameter shards the device stores (its storage
        spec, `soapjax.strategy.space.param_specs`): replicated parameters are updated whole on
        every device.
      transcendentals: exp, log, tanh, sqrt, ... in all four, which XLA counts apart.
    """

    forward: float
    backward: float
    recompute: float
    update: float
    transcendentals: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute + self.update


class OperatorFlops(NamedTuple):
    """One operator's FLOPs in a training step (`FlopCounter.operator`), in three parts."""

    forward: Flops  # the primal equations
    residuals: Flops  # what the forward side of the VJP adds for the backward pass
    backward: Flops  # the cotangents

    def split(self, shards: int, matmuls: OperatorFlops | None) -> OperatorFlops:
        """One device's part: everything over `shards`, but the matmuls as counted at the
        device's shard shapes (`matmuls`, where given)."""
        def part(whole: Flops, shard: Flops | None) -> Flops:
            if shard is None:
                return Flops(*(x / shards for x in whole))
            return Flops((whole.flops - whole.matmul) / shards + shard.matmul,
                         whole.transcendentals / shards, shard.matmul)
        return OperatorFlops(*(part(w, m) for w, m in zip(self, matmuls or (None,) * 3)))


class FlopCounter:
    """`StepFlops` of strategies on one graph; each operator is traced once per split.

    Example::

        counter = FlopCounter(graph, optimizer=workload.optimizer)
        counter.step(strategy, MeshShape.of(topo)).total   # FLOPs per device
    """

    def __init__(self, graph: OpGraph, *, optimizer: Any = None, params: Any = None):
        """
        Args:
          graph: the traced graph.
          optimizer: the optax optimizer of the step (None: no update counted).
          params: the parameters or their shapes, as the step takes them (their tree is what
            the optimizer's masks see; default: a dict of `graph.params` by path).
        """
        self.graph = graph
        self.optimizer = optimizer
        self._treedef = jax.tree.structure(
            params if params is not None else {leaf.path: 0 for leaf in graph.params})
        self._whole: dict[int, OperatorFlops] = {}
        self._shard: dict[tuple[int, tuple[int, ...]], OperatorFlops] = {}
        self._updates: dict[tuple, float] = {}
        self._update_whole: tuple[tuple[int, ...], ...] | None = None
        self._diff, self._wanted = _differentiated(graph)

    def operator(self, i: int, degrees: tuple[int, ...] | None = None) -> OperatorFlops:
        """Operator `i`'s FLOPs on one device when split by `degrees` (None: unsplit).

        Counted at the device's shard shapes: a contraction split down to one element is a
        multiply to XLA, not a multiply-add, and parameter-sized work (a scan's sum of its
        weight gradients over the steps) does not shrink with the batch. Where a custom
        derivative rule (a ReLU's, a softmax's) cannot be traced at shard shapes, the unsplit
        count is divided over the shards, but for the matmuls, counted at shard shapes with
        the rules' primal bodies.
        """
        if degrees is not None:  # a transform XLA computes whole (`computed_degrees`)
            degrees = computed_degrees(self.graph, i, tuple(degrees))
        if degrees is None or math.prod(degrees) == 1:
            if i not in self._whole:
                fn, avals = operator_fn(self.graph, self.graph.operators[i].name)
                self._whole[i] = self._count(i, fn, avals)
            return self._whole[i]
        key = (i, tuple(degrees))
        if key not in self._shard:
            self._shard[key] = self._count_shard(i, tuple(degrees))
        return self._shard[key]

    def _count_shard(self, i: int, degrees: tuple[int, ...]) -> OperatorFlops:
        name, shards = self.graph.operators[i].name, math.prod(degrees)
        try:
            return self._count(i, *operator_fn(self.graph, name, degrees))
        except CustomRuleError:
            matmuls = self._count(i, *operator_fn(self.graph, name, degrees, rules="primal"))
            return self.operator(i).split(shards, matmuls)
        except Exception as e:  # noqa: BLE001  an exotic equation: the unsplit count, divided
            log.info("no shard program for %s at degrees %s (%s: %s); its FLOPs are divided",
                     name, degrees, type(e).__name__, e)
            return self.operator(i).split(shards, None)

    def step(self, strategy: Any, mesh: MeshShape, *,
             stored: Sequence[tuple[int, ...]] | None = None) -> StepFlops:
        """The FLOPs one device computes in a step of `strategy` (a `Strategy`) on `mesh`.

        `stored`: the shape of each parameter leaf's shard as the step stores it (what
        `soapjax check` reads off the applied step's shardings); default: as
        `soapjax.strategy.space.param_specs` says the simulator stores it.
        """
        fwd = bwd = again = trans = 0.0
        for i, (op, config) in enumerate(zip(self.graph.operators, strategy.configs)):
            c = self.operator(i, config.degrees(mesh))
            fwd_side = c.forward.plus(c.residuals)
            if recomputes(op, strategy.recompute_of(i)) or remat_recomputes(self.graph, i):
                # saved nothing (the plan's or the model's remat): F, then F + R again
                fwd += c.forward.flops
                again += fwd_side.flops
                trans += c.forward.transcendentals
            else:
                fwd += fwd_side.flops
            bwd += c.backward.flops
            trans += fwd_side.transcendentals + c.backward.transcendentals
        shards = tuple(map(tuple, stored)) if stored is not None \
            else self._stored_shapes(strategy, mesh)
        bwd += self._gradient_sums({leaf.path: math.prod(shape) for leaf, shape
                                    in zip(self.graph.params, shards) if is_float(leaf.dtype)})
        return StepFlops(fwd, bwd, again, self._update(self._update_shapes(strategy, mesh,
                                                                            shards)), trans)

    def _update_shapes(self, strategy: Any, mesh: MeshShape,
                       shards: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """The shards the optimizer updates: the stored ones, but where the update contracts
        a parameter's dims (Muon), the layout apply gives it (`whole_update_spec`)."""
        if self.optimizer is None:
            return shards
        if self._update_whole is None:
            params = jax.tree.unflatten(self._treedef, [jax.ShapeDtypeStruct(leaf.shape,
                                                                              leaf.dtype)
                                                         for leaf in self.graph.params])
            self._update_whole = update_whole_dims(self.optimizer, params).whole
        if not any(self._update_whole):
            return shards
        specs = param_specs(self.graph, strategy, mesh)
        axes = optimizer_state_axes(strategy)
        out = []
        for leaf, shape, whole in zip(self.graph.params, shards, self._update_whole):
            if whole:
                spec = whole_update_spec(specs[leaf.path], leaf.shape, whole, axes, mesh)
                shape = tuple(n // mesh.degree(a) for n, a in zip(leaf.shape, spec))
            out.append(tuple(shape))
        return tuple(out)

    def _stored_shapes(self, strategy: Any, mesh: MeshShape) -> tuple[tuple[int, ...], ...]:
        """The shape of the shard of each parameter leaf one device stores (and updates)."""
        specs = param_specs(self.graph, strategy, mesh)
        return tuple(tuple(n // mesh.degree(axes) for n, axes in zip(leaf.shape, specs[leaf.path]))
                     for leaf in self.graph.params)

    def _update(self, shards: tuple[tuple[int, ...], ...]) -> float:
        """The optimizer's update and ``optax.apply_updates`` of parameter shards of these
        shapes (its masks see the parameters' tree; a global norm sums the device's shards)."""
        if self.optimizer is None:
            return 0.0
        if shards not in self._updates:
            leaves = [jax.ShapeDtypeStruct(shape, leaf.dtype)
                      for leaf, shape in zip(self.graph.params, shards)]
            params = jax.tree.unflatten(self._treedef, leaves)
            optimizer = self.optimizer

            def update(grads, state, params):
                updates, state = optimizer.update(grads, state, params)
                return jax.tree.map(jnp.add, params, updates), state

            state = jax.eval_shape(optimizer.init, params)
            self._updates[shards] = xla_flops(
                jax.make_jaxpr(update)(params, state, params).jaxpr).flops
        return self._updates[shards]

    def _gradient_sums(self, stored: Mapping[str, float]) -> float:
        """Adds of a parameter's gradient contributions, one per reader after the first."""
        readers: dict[str, int] = {}
        leaf_of: dict[str, str] = {}
        for op in self.graph.operators:
            for o in op.inputs:
                if o.kind == "param":
                    readers[o.source] = readers.get(o.source, 0) + 1
                    leaf_of[o.source] = o.leaf_path
        return sum((n - 1) * stored.get(leaf_of[s], 0.0) for s, n in readers.items() if n > 1)

    def _count(self, i: int, fn: Callable, avals: Sequence[Any]) -> OperatorFlops:
        forward = xla_flops(jax.make_jaxpr(fn)(*avals).jaxpr)
        idx = [k for k, d in enumerate(self._diff[i]) if d]
        outs = [k for k in range(len(self.graph.operators[i].outputs)) if (i, k) in self._wanted]
        if not idx or not outs:
            return OperatorFlops(forward, Flops(), Flops())

        def vjp(*args):
            def part(*d):
                full = list(args)
                for k, x in zip(idx, d):
                    full[k] = x
                res = fn(*full)
                return [res[k] for k in outs]

            return jax.vjp(part, *[args[k] for k in idx])

        def both(args, cts):
            return vjp(*args)[1](cts)

        out_avals = jax.eval_shape(fn, *avals)
        fwd_side = xla_flops(jax.make_jaxpr(vjp)(*avals).jaxpr)
        total = xla_flops(jax.make_jaxpr(both)(list(avals), [out_avals[k] for k in outs]).jaxpr)
        return OperatorFlops(forward, _minus(fwd_side, forward), _minus(total, fwd_side))


def step_flops(graph: OpGraph, strategy: Any, mesh: MeshShape, *, optimizer: Any = None,
               params: Any = None, stored: Sequence[tuple[int, ...]] | None = None
               ) -> StepFlops:
    """The FLOPs one device computes in a step of `strategy` (`FlopCounter.step`, with the
    parameters' stored shard shapes if given): what `soapjax check` holds against the
    compiled step's."""
    return FlopCounter(graph, optimizer=optimizer, params=params).step(strategy, mesh,
                                                                        stored=stored)



def _minus(a: Flops, b: Flops) -> Flops:
    return Flops(*(max(x - y, 0.0) for x, y in zip(a, b)))


def _differentiated(graph: OpGraph) -> tuple[list[tuple[bool, ...]], set[tuple[int, int]]]:
    """Which operands of each operator get cotangents, and which outputs ``(operator, k)``
    receive one (`soapjax.graph._cotangents`: from the parameters, and read by the loss not
    through ``stop_gradient``; aux outputs get none)."""
    values = differentiated_values(graph)
    diff = [differentiated_operands(graph, i) for i in range(len(graph.operators))]
    wanted = {(i, k) for i, op in enumerate(graph.operators)
              for k, t in enumerate(op.outputs) if t.value in values}
    return diff, wanted
