"""The sharded step's loss and gradients held against the unsharded ones, leaf by leaf.

A wrong sharding shows in the gradients before it shows anywhere else. The loss can match to
the last bit while one parameter's gradient is off by a constant (a reduction done twice: a
depthwise convolution's kernel gradient 4x on a 4-way channel split), and one step of Adam
hides that, since its first update is ``lr * g / |g|`` whatever the scale of ``g``. So the
gradients are compared themselves, each parameter leaf against its own scale:

    error(leaf) = max |g_sharded - g_ref|  /  max(max |g_ref|, floor)

``floor`` keeps a leaf whose true gradient is zero (a bias a normalisation removes) from
dividing rounding noise by nothing: it is the largest gradient of all leaves times
``min(1, 30 * eps / tolerance)``, where the noise of a sum of a few hundred terms of the
largest gradient's size lies. A gradient scaled by a constant c has error ``|c - 1|``; a
reduction missing over a 2-way split about 0.5; rounding of a different reduction order
about ``eps`` times a small factor. The bar (`rounding_tolerance`) is set by the narrowest
float type the parameters flow through in the traced step (`narrowest_float`): 1e-9 in
float64, 1e-3 in float32, 4e-2 in bfloat16 (10 of its ulps), 1e-2 in float16. A parameter
whose true gradient is zero (`LeafError.noise`) is left out of the step's bar
(`step_difference`): one step of Adam moves it by its learning rate, either way.

The floor is one number for the whole model, so it also lifted the bar of a leaf whose gradient
is real but small (a GRU's recurrent kernels, 1e-5 of the largest gradient): that leaf was
held to a thousandth of the floor, and a gradient of it 30 % off passed. Where the unsharded
step can be run in float64 (`float64_reference`: a float32 model whose loss computes every
float in float64 once its parameters and batch are), the float32 gradients are held against
the float64 ones instead, each leaf's floor its own: `_NOISE_TERMS` times what the unsharded
float32 step itself is off by on that leaf (never above the model-wide floor), so a small
real gradient is held to its own scale, and a leaf is noise only where its float64 gradient
is below the float32 resolution of the largest one.

A model that computes in bfloat16 or float16 has no float64 run (its dtypes are its own), and
its unsharded gradients can be farther from the exact ones than the sharded step's (equal
terms accumulated in bfloat16: a head bias's gradient -0.891 unsharded, -1.008 sharded, about
-0.999 exact; docs/checks.md). Where such a model fails the bar, the unsharded step is run
again with its 2-byte floats widened to float32 (`widened_reference`: the differentiated
step's jaxpr evaluated with every bfloat16 and float16 type float32, so custom derivative
rules are kept as they were applied), and the gradients are held against that, as against
float64 above; `soapjax check` holds the step against the widened step too. In the step
(`step_difference`), a bfloat16 or float16 value may differ by one unit in its last place at
its magnitude: an update of the learning rate's size rounds to a bfloat16 parameter's
resolution (0.0078 at magnitude 1) either way.

`compare_gradients` compares two ``(loss, grads)`` and names the worst leaf with the operator
that reads it; `first_step` runs the sharded step's loss and gradients
(`soapjax.apply.step.sharded_value_and_grad`) and the unsharded ones of the user's own loss on one
device, and compares them. `soapjax check` and ``shard_training(..., verify=True)`` call it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.extend  # noqa: F401  (jax.extend must be imported explicitly)
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.extend import core as jcore
from jax.sharding import Mesh

from soapjax.apply import step as apply
from soapjax.apply._flatstep import split_microbatches
from soapjax.base.errors import SoapjaxError
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy.space import MeshShape

__all__ = ["NUMBERS_TOLERANCE", "TOLERANCE", "GradientComparison", "LeafError",
           "VerificationError", "compare_gradients", "first_step", "float64_reference",
           "narrowest_float",
           "reading_operators", "reference_inputs", "reference_value_and_grad",
           "widened", "widened_reference",
           "rounding_tolerance", "step_difference"]

# The bar per float type: what a different reduction order moves a gradient by, with margin;
# a wrong sharding moves it by the size of the gradient itself (module doc).
TOLERANCE = {"float64": 1e-9, "float32": 1e-3, "float16": 1e-2, "bfloat16": 4e-2}
# The step's bar, absolute, over the updated parameters and optimizer state: float32 sharded
# against unsharded steps of the tiny zoo differ by 1e-7 to 2.2e-4 (inception_v3's deep
# convolutions; the table of docs/checks.md); a wrong sharding differs by the size of the
# values themselves. One step of Adam moves a parameter by about its learning rate whatever the
# gradient's scale, which is why the gradients are compared first.
NUMBERS_TOLERANCE = 1e-3
_NOISE_TERMS = 30.0  # rounding of a sum of ~1000 terms grows like sqrt(n) x eps


class VerificationError(SoapjaxError, ValueError):
    """The sharded step computes other gradients than the unsharded one (`first_step`)."""


@dataclasses.dataclass(frozen=True)
class LeafError:
    """How far one gradient leaf is from the reference.

    Attributes:
      path: the leaf's pytree path (`jax.tree_util.keystr`).
      operator: the first operator that reads the parameter ('' if none does).
      error: ``max |got - want|`` over the leaf, divided by `scale`.
      scale: the leaf's own ``max |want|``, or the floor where that is smaller (module doc).
      noise: the leaf's own ``max |want|`` is under the floor: its true gradient is zero (a
        bias a normalisation removes) and what both sides hold is rounding noise, whose sign
        one step of Adam follows by its whole learning rate (`step_difference` leaves such
        parameters out).
      unsettled: of another leaf, a mask of the elements whose reference gradient is within
        the bar of zero (``|want| <= tolerance * scale``): the bar lets either side hold the
        other sign there, and Adam's first step follows it by the learning rate (bfloat16's
        bar is 4 % of the leaf's scale); None where there are none. `step_difference` leaves
        them out too.
    """

    path: str
    operator: str
    error: float
    scale: float
    noise: bool = False
    unsettled: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The fields, `unsettled` as a count of elements."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["unsettled"] = int(self.unsettled.sum()) if self.unsettled is not None else 0
        return out


@dataclasses.dataclass(frozen=True)
class GradientComparison:
    """`compare_gradients`'s result.

    Attributes:
      loss, reference_loss: the two losses.
      loss_error: ``|loss - reference| / max(|reference|, tiny)``.
      leaves: one `LeafError` per parameter leaf, in ``jax.tree.leaves`` order.
      tolerance: the bar each error is held to.
      aux: for a loss traced with ``has_aux=True``, one `LeafError` per leaf of what it
        returns beside the loss (its path prefixed ``aux``, no operator), each against its
        own scale as the gradients are.
      float64: the gradients were held against the unsharded step's in float64, each leaf
        with its own floor (module doc), rather than against its float32 gradients.
      widened: held so against the unsharded step with its bfloat16 and float16 values
        widened to float32 (`widened_reference`), rather than against its own gradients.
    """

    loss: float
    reference_loss: float
    loss_error: float
    leaves: tuple[LeafError, ...]
    tolerance: float
    aux: tuple[LeafError, ...] = ()
    float64: bool = False
    widened: bool = False

    @property
    def noise_leaves(self) -> tuple[int, ...]:
        """The parameter leaves whose true gradient is zero (`LeafError.noise`), in
        ``jax.tree.leaves`` order: what `step_difference` leaves out."""
        return tuple(k for k, e in enumerate(self.leaves) if e.noise)

    @property
    def worst(self) -> LeafError | None:
        """The leaf with the largest error (None without leaves)."""
        return max(self.leaves, key=lambda e: e.error, default=None)

    @property
    def max_error(self) -> float:
        """The largest of the loss's and every leaf's error."""
        worst = self.worst
        return max(self.loss_error, worst.error if worst else 0.0,
                   max((e.error for e in self.aux), default=0.0))

    @property
    def passed(self) -> bool:
        """Loss and every leaf within `tolerance` (a NaN fails, a NaN reference too)."""
        return bool(self.max_error <= self.tolerance) and not math.isnan(self.reference_loss)

    def describe(self) -> str:
        """One line: PASS or FAIL, the loss's error and the worst leaf with its operator."""
        if math.isnan(self.reference_loss):
            return ("FAIL gradients: the unsharded loss itself is NaN, so there is nothing to "
                    "compare against; check the model and its inputs (parameters, batch) first")
        worst = self.worst
        leaf = (f"; worst gradient leaf {worst.path} (read by operator {worst.operator!r}) "
                f"{worst.error:.3g} of its scale {worst.scale:.3g}" if worst else "")
        aux = max(self.aux, key=lambda e: e.error, default=None)
        if aux is not None:
            leaf += f"; worst aux value {aux.path} {aux.error:.3g} of its scale {aux.scale:.3g}"
        against = (" against float32, the model's 2-byte floats widened" if self.widened else
                   " against float64" if self.float64 else "")
        return (f"{'PASS' if self.passed else 'FAIL'} gradients: loss {self.loss:.8g} against "
                f"{self.reference_loss:.8g} (relative {self.loss_error:.3g}){leaf} (bar "
                f"{self.tolerance:g}, relative per leaf{against})")

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {"loss": self.loss, "reference_loss": self.reference_loss,
                "loss_error": self.loss_error, "tolerance": self.tolerance,
                "passed": self.passed, "max_error": self.max_error, "float64": self.float64,
                "widened": self.widened,
                "worst": worst.to_json() if worst else None,
                "leaves": [e.to_json() for e in self.leaves],
                "aux": [e.to_json() for e in self.aux]}


def narrowest_float(graph: OpGraph) -> str:
    """The narrowest float type of the values of `graph`'s program that its parameters flow
    into (a bfloat16 matmul over float32 parameters: ``"bfloat16"``; a float32 softmax inside
    ``jax.nn.dot_product_attention`` of float64 ones: ``"float32"``): what its gradients'
    rounding is. A float32 mask or padding the batch alone makes (``optax.ctc_loss``'s
    paddings) rounds nothing the gradients pass through."""
    prog = graph.program
    reached = set(prog.param_like)
    for u in prog.units:
        if reached.intersection(u.ins):
            reached.update(v for v in u.outs if v is not None)
    found = {prog.dtypes[v] for v in reached} & set(TOLERANCE)
    found = found or set(prog.dtypes) & set(TOLERANCE)
    return max(found, key=lambda d: TOLERANCE[d], default="float32")


def rounding_tolerance(graph: OpGraph) -> float:
    """The bar for `graph`'s gradients: `TOLERANCE` of its `narrowest_float`."""
    return TOLERANCE[narrowest_float(graph)]


def compare_gradients(loss: Any, grads: Any, reference_loss: Any, reference_grads: Any, *,
                      tolerance: float, operators: Sequence[str] | None = None,
                      computed_in: str | None = None, aux: Any = None,
                      reference_aux: Any = None, truth: Any = None,
                      widened: bool = False) -> GradientComparison:
    """Each gradient leaf's error relative to its own scale (module doc), and the loss's.

    Args:
      loss, grads: the sharded step's loss and gradients (host or device arrays; a global
        array spanning processes is gathered).
      reference_loss, reference_grads: the unsharded ones, of the same pytree structure.
      tolerance: the bar (`rounding_tolerance`).
      operators: per leaf (``jax.tree.leaves`` order), the operator that reads it.
      computed_in: the float type the gradients were computed in, whose rounding sets the
        floor (`narrowest_float`; default: the coarsest of the two trees' leaf types).
      aux, reference_aux: what a loss traced with ``has_aux=True`` returns beside the loss,
        sharded and unsharded (`GradientComparison.aux`); None without.
      truth: the unsharded gradients computed in float64 (`float64_reference`), of the same
        structure: the sharded ones are held against them, each leaf with a floor of its own
        (module doc); None: against `reference_grads`, one floor for all.
      widened: `truth` is `widened_reference`'s float32 run, not a float64 one.

    Raises:
      ValueError: the two gradient pytrees differ in structure or in a leaf's shape.
    """
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(grads)
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(reference_grads)
    if got_tree != want_tree:
        raise ValueError(f"the sharded gradients' pytree {got_tree} is not the reference's "
                         f"{want_tree}")
    got = [_host(x) for _, x in got_leaves]
    want = [_host(x) for _, x in want_leaves]
    for (path, _), g, w in zip(want_leaves, got, want):
        if g.shape != w.shape:
            raise ValueError(f"gradient {jax.tree_util.keystr(path)} has shape {g.shape}, the "
                             f"reference's {w.shape}")
    scales = [float(np.nanmax(np.abs(w), initial=0.0)) for w in want]
    if computed_in is not None:
        eps = float(jnp.finfo(computed_in).eps)
    else:
        dtypes = {jnp.dtype(x.dtype) for _, x in (*got_leaves, *want_leaves)
                  if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)}
        eps = max((float(jnp.finfo(d).eps) for d in dtypes),
                  default=float(jnp.finfo(jnp.float32).eps))
    floors, want, scales = _floors(want, scales, eps, tolerance, truth)
    leaves = []
    for k, ((path, _), g, w, scale, floor) in enumerate(zip(want_leaves, got, want, scales,
                                                            floors)):
        diff = _max_diff(g, w)
        denom = max(scale, floor) or 1.0
        near = np.abs(np.nan_to_num(_wide(w))) <= tolerance * denom
        leaves.append(LeafError(jax.tree_util.keystr(path),
                                operators[k] if operators is not None else "", diff / denom,
                                denom, scale < floor,
                                near if scale >= floor and near.any() else None))
    loss_v, ref_v = float(_host(loss)), float(_host(reference_loss))
    loss_error = abs(loss_v - ref_v) / max(abs(ref_v), np.finfo(np.float64).tiny)
    if math.isnan(loss_v) != math.isnan(ref_v):
        loss_error = math.inf
    return GradientComparison(loss_v, ref_v, loss_error, tuple(leaves), tolerance,
                              _aux_errors(aux, reference_aux),
                              float64=truth is not None and not widened, widened=widened)


def _floors(want: list[np.ndarray], scales: list[float], eps: float, tolerance: float,
            truth: Any) -> tuple[list[float], list[np.ndarray], list[float]]:
    """Each leaf's floor, what the sharded gradients are held against, and its scales (module
    doc).

    Without `truth`: one floor, the largest gradient times ``_NOISE_TERMS * eps / tolerance``,
    and the float32 reference with its `scales`. With it (float64 gradients): the float64
    ones and their scales, and per leaf ``_NOISE_TERMS`` times what the float32 reference is
    off by there (at least an `eps` of the leaf's own scale) over `tolerance`, never above the
    model-wide floor; a leaf whose float64 gradient is below `eps` of the largest one keeps
    the model-wide floor (its true gradient is zero at this precision, and both sides hold
    rounding noise)."""
    if truth is None:
        floor = max(scales, default=0.0) * min(1.0, _NOISE_TERMS * eps / tolerance)
        return [floor] * len(want), want, scales
    exact = [_host(x) for x in jax.tree.leaves(truth)]
    if len(exact) != len(want) or any(t.shape != w.shape for t, w in zip(exact, want)):
        raise ValueError("the float64 gradients' leaves are not the reference's")
    sizes = [float(np.nanmax(np.abs(t), initial=0.0)) for t in exact]
    zero = max(sizes, default=0.0) * eps
    floor = max(sizes, default=0.0) * min(1.0, _NOISE_TERMS * eps / tolerance)
    floors = []
    for t, w, size in zip(exact, want, sizes):
        if size <= zero:
            floors.append(floor)
            continue
        off = max(_max_diff(_wide(w), _wide(t)), eps * size)
        floors.append(min(floor, _NOISE_TERMS * off / tolerance))
    return floors, exact, sizes


def _aux_errors(aux: Any, reference: Any) -> tuple[LeafError, ...]:
    """Each aux leaf's ``max |got - want| / max |want|`` (`GradientComparison.aux`)."""
    if reference is None:
        return ()
    want, tree = jax.tree_util.tree_flatten_with_path(reference)
    got, got_tree = jax.tree.flatten(aux)
    if got_tree != jax.tree.structure(reference):
        raise ValueError(f"the sharded aux pytree {got_tree} is not the reference's")
    out = []
    for (path, w), g in zip(want, got):
        w, g = _wide(_host(w)), _wide(_host(g))
        scale = float(np.nanmax(np.abs(w), initial=0.0)) or 1.0
        out.append(LeafError("aux" + jax.tree_util.keystr(path), "", _max_diff(g, w) / scale,
                             scale))
    return tuple(out)


def first_step(graph: OpGraph, strategy: Any, mesh: Mesh, loss_fn: Callable[[Any, Any], Any],
               params: Any, batch: Any, *, mesh_shape: MeshShape | None = None,
               tolerance: float | None = None,
               compiler_options: dict[str, Any] | None = None,
               sharded: tuple[apply.PartitionedStep, apply.TrainShardings] | None = None
               ) -> GradientComparison:
    """The strategy's sharded loss and gradients against the unsharded ones, on one batch.

    Where some leaf's gradient is under the model-wide floor (module doc) and the bar is
    float32's or coarser, they are held against the unsharded gradients in float64 where the
    loss runs so (`float64_reference`), each leaf with its own floor. The sharded side is
    `soapjax.apply.step.sharded_value_and_grad` of the traced graph on `mesh`; the reference
    is ``jax.value_and_grad(loss_fn)`` of the user's own function, jitted, on one device
    (`reference_inputs`: or the devices the user's own sharding constraints or context mesh
    name): both the cost of one more compile each, and the memory of the whole unsharded step
    on that device.

    Args:
      graph: the traced graph of ``loss_fn(params, batch)``.
      strategy: a `Strategy` or plan.
      mesh: the mesh the strategy runs on.
      loss_fn: ``loss_fn(params, batch) -> scalar``, the function `graph` traced.
      params, batch: host values (or global arrays) of the parameters and the batch.
      mesh_shape: the mesh the strategy was planned for, when known.
      tolerance: the bar (default: `rounding_tolerance` of the graph).
      compiler_options: XLA options for both compiles.
      sharded: the sharded ``(value_and_grad, shardings)`` when built already (a training
        step's ``step.value_and_grad`` and its shardings, `soapjax.apply.step.sharded_train_step`).
    """
    fn, sh = sharded or apply.sharded_value_and_grad(graph, strategy, mesh, params=params,
                                                     batch=batch, mesh_shape=mesh_shape,
                                                     compiler_options=compiler_options)
    loss, grads = fn(apply.device_put_global(params, sh.params),
                     apply.device_put_global(batch, sh.batch))
    loss, aux = graph.loss_and_aux(loss)
    grads = apply.model_layout(grads)  # an interleaved pipeline's stacked layers in chunk order
    options = dict(compiler_options) if compiler_options else None
    ref_loss, ref_grads = jax.jit(reference_value_and_grad(loss_fn, graph, strategy),
                                  compiler_options=options)(*reference_inputs((params, batch)))
    ref_loss, ref_aux = graph.loss_and_aux(ref_loss)
    bar = rounding_tolerance(graph) if tolerance is None else tolerance
    compare = functools.partial(compare_gradients, loss, grads, ref_loss, ref_grads,
                                tolerance=bar, operators=reading_operators(graph),
                                computed_in=narrowest_float(graph), aux=aux,
                                reference_aux=ref_aux)
    out = compare()
    if not out.passed and narrowest_float(graph) in _NARROW_FLOATS:
        wide = widened_reference(loss_fn, graph, strategy, params, batch)
        return out if wide is None else compare(truth=wide, widened=True)
    if not out.noise_leaves or bar < TOLERANCE["float32"]:
        # every leaf is held to its own scale already; or the bar is finer than float32's:
        # the float64 run rounds none of the values the model rounds to float32, so at such
        # a bar it is another function (a float64 model with a float32 input, held to 1e-12)
        return out
    exact = float64_reference(loss_fn, graph, strategy, params, batch)
    return out if exact is None else compare(truth=exact)


def float64_reference(loss_fn: Callable[[Any, Any], Any], graph: OpGraph, strategy: Any,
                      params: Any, batch: Any) -> Any | None:
    """The unsharded step's gradients computed in float64, for a float32 model: its float
    parameters and batch cast to float64 and the loss run under ``jax.enable_x64`` on one
    device (one more compile, and twice the unsharded step's memory). None where that is not
    float64 throughout: the graph's gradients are not float32 (`narrowest_float`: a float64
    model is its own truth; a bfloat16 one is not float32's), or some value of the loss is
    still of a narrower float type (a dtype the model fixes, ``x.astype(jnp.float32)``), so
    its float64 gradients would round as the float32 ones do."""
    if narrowest_float(graph) != "float32":
        return None
    wide = functools.partial(jax.tree.map, lambda x: x.astype(np.float64)
                             if jnp.issubdtype(x.dtype, jnp.floating) else x)
    fn = reference_value_and_grad(loss_fn, graph, strategy)
    with jax.enable_x64(True):
        inputs = wide(jax.tree.map(_host, (params, batch)))
        try:
            jaxpr = jax.make_jaxpr(fn)(*inputs)
        except Exception:  # noqa: BLE001  (a loss that will not run in float64 has no truth)
            return None
        if not _float64_throughout(jaxpr.jaxpr):
            return None
        _, grads = jax.jit(fn)(*reference_inputs(inputs))
        return jax.tree.map(np.asarray, grads)


_NARROW_FLOATS = ("bfloat16", "float16")


def widened_reference(loss_fn: Callable[[Any, Any], Any], graph: OpGraph, strategy: Any,
                      params: Any, batch: Any) -> Any | None:
    """The unsharded step's gradients with the model's bfloat16 and float16 values computed
    in float32 (module doc): ``jax.value_and_grad`` of the user's loss run by `widened`. None
    where the graph computes in no 2-byte float, or the widening cannot follow the program."""
    if narrowest_float(graph) not in _NARROW_FLOATS:
        return None
    try:
        _, grads = widened(reference_value_and_grad(loss_fn, graph, strategy))(params, batch)
    except Exception:  # noqa: BLE001  (a program the widening cannot follow: no truth)
        return None
    return jax.tree.map(np.asarray, grads)


def widened(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with every 2-byte float of its program widened to float32: traced at its
    arguments' own types, its jaxpr then evaluated with the inputs, literals, and the types
    equations convert to or accumulate in widened, jitted on one device (`reference_inputs`).
    Raises where the program holds something the widening cannot follow (a bit cast of a
    2-byte value)."""
    def run(*args: Any) -> Any:
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
        closed = jax.make_jaxpr(fn)(*shapes)
        out_tree = jax.tree.structure(jax.eval_shape(fn, *shapes))
        flat = [_host(x) for x in jax.tree.leaves(args)]  # (2-byte floats come back float32)
        outs = jax.jit(lambda *xs: _eval_widened(closed.jaxpr, closed.consts, xs))(
            *reference_inputs(flat))
        return jax.tree.unflatten(out_tree, outs)

    return run


def _narrow(dtype: Any) -> bool:
    try:
        return np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float16))
    except TypeError:
        return False


def _widened(x: Any) -> Any:
    return x.astype(np.float32) if hasattr(x, "dtype") and _narrow(x.dtype) else x


def _eval_widened(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """`jaxpr` evaluated on `args` with every 2-byte float widened to float32
    (`widened_reference`)."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        if isinstance(v, jcore.Literal):  # at its own type (a Python scalar's is weak)
            return _widened(np.asarray(v.val, dtype=getattr(v.aval, "dtype", None)))
        return env[v]

    env.update(zip(jaxpr.constvars, map(_widened, consts)))
    env.update(zip(jaxpr.invars, map(_widened, args)))
    for eqn in jaxpr.eqns:
        outs = _widened_eqn(eqn, [read(v) for v in eqn.invars])
        env.update((v, x) for v, x in zip(eqn.outvars, outs)
                   if not isinstance(v, jcore.DropVar))
    return [read(v) for v in jaxpr.outvars]


def _closed(closed: Any) -> Callable[..., list[Any]]:
    return lambda *xs: _eval_widened(closed.jaxpr, closed.consts, xs)


def _widened_eqn(eqn: Any, ins: list[Any]) -> list[Any]:
    """One equation of `_eval_widened`: calls and rematerialised regions inline, a
    conditional, a scan and a while loop rebuilt on widened bodies, any other primitive bound
    with its 2-byte float parameters widened."""
    name, p = eqn.primitive.name, eqn.params
    if name in ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call"):
        called = p.get("jaxpr") or p.get("call_jaxpr") or p.get("fun_jaxpr")
        return _closed(called)(*ins)
    if name in ("checkpoint", "remat"):
        return _eval_widened(p["jaxpr"], (), ins)
    if name == "cond":
        return list(jax.lax.switch(ins[0], [_closed(b) for b in p["branches"]], *ins[1:]))
    if name == "scan":
        nc, ncarry, body = p["num_consts"], p["num_carry"], p["jaxpr"]
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]

        def step(c, x):
            outs = _closed(body)(*consts, *c, *x)
            return outs[:ncarry], outs[ncarry:]

        carry, ys = jax.lax.scan(step, list(carry), list(xs), length=p["length"],
                                 reverse=p["reverse"])
        return [*carry, *ys]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        return list(jax.lax.while_loop(lambda s: _closed(p["cond_jaxpr"])(*cc, *s)[0],
                                       lambda s: _closed(p["body_jaxpr"])(*bc, *s),
                                       list(init)))
    if name == "reduce_precision":
        return [ins[0]]
    if name == "bitcast_convert_type" and any(_narrow(getattr(x, "dtype", None)) or
                                              _narrow(p.get("new_dtype")) for x in ins):
        raise ValueError("a bit cast of a 2-byte float has no widened form")
    params = {k: np.dtype(np.float32) if _narrow(v) else _widened_program(v)
              for k, v in p.items()}
    out = eqn.primitive.bind(*ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _widened_program(v: Any) -> Any:
    """A parameter that is a program (a scatter's ``update_jaxpr``) traced again at its
    inputs' widened types; anything else as it is."""
    closed = isinstance(v, jcore.ClosedJaxpr)
    jaxpr = v.jaxpr if closed else v
    if not isinstance(jaxpr, jcore.Jaxpr):
        return v
    consts = v.consts if closed else ()
    avals = [jax.ShapeDtypeStruct(x.aval.shape, np.float32 if _narrow(x.aval.dtype)
                                  else x.aval.dtype) for x in jaxpr.invars]
    again = jax.make_jaxpr(lambda *xs: _eval_widened(jaxpr, consts, xs))(*avals)
    if closed:
        return again
    if again.consts:
        raise ValueError("a widened update program with constants")
    return again.jaxpr


def _float64_throughout(jaxpr: Any) -> bool:
    """No value of `jaxpr` (sub-jaxprs included) is of a float type narrower than float64."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            dtype = getattr(v.aval, "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating) \
                    and jnp.dtype(dtype).itemsize < 8:
                return False
        if not all(_float64_throughout(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
            return False
    return True


def reference_inputs(tree: Any) -> Any:
    """`tree` on the default device, uncommitted, for the unsharded reference: jitted, the
    user's function then runs where it would run for the user (one device; the devices of the
    user's own sharding constraints or ``jax.set_mesh`` context, which inputs committed to one
    device would conflict with: "incompatible devices for jitted computation")."""
    return jax.device_put(jax.tree.map(_host, tree))


def reference_value_and_grad(loss_fn: Callable[[Any, Any], Any], graph: OpGraph,
                             strategy: Any) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``jax.value_and_grad(loss_fn)`` (``has_aux=True`` for a graph traced so): the step a
    strategy must compute. Where the graph
    accepts statistics per microbatch (`soapjax.graph.opgraph.OpGraph.microbatch_statistics`) and
    the strategy has M > 1 microbatches, the mean over the M microbatches of their own loss and
    gradients (what gradient accumulation computes by those semantics), microbatch ``k``
    holding samples ``k, k + M, ...`` as `soapjax.apply` splits them."""
    m = getattr(strategy, "microbatches", 1)
    if not (graph.microbatch_statistics and graph.sample_coupling and m > 1):
        return jax.value_and_grad(loss_fn, has_aux=graph.has_aux)  # has_aux keeps M = 1

    def accumulated(params, batch):
        parts = jax.tree.map(lambda x: split_microbatches(x, m), batch)
        losses, grads = jax.lax.map(lambda b: jax.value_and_grad(loss_fn)(params, b), parts)
        return jnp.mean(losses), jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)

    return accumulated


def step_difference(out: Any, reference: Any, *, skip_params: Collection[int] = (),
                    gradients: GradientComparison | None = None) -> float:
    """The largest ``|a - b|`` over the leaves of two step results ``(parameters, optimizer
    state, loss)``; infinite where one has a NaN the other has not. `skip_params`: the
    parameter leaves (``jax.tree.leaves`` order) left out, those whose gradient is rounding
    noise (`LeafError.noise`): a step of Adam moves them by its learning rate, either way.
    `gradients`: the step's gradient comparison, whose noise leaves are left out so, and
    within the other parameter leaves the elements whose gradient's sign the bar leaves
    open (`LeafError.unsettled`), in the parameters and in every part of the optimizer state
    shaped like them (Adam's moments)."""
    skip = set(skip_params) | set(gradients.noise_leaves if gradients is not None else ())
    masks = [e.unsettled for e in gradients.leaves] if gradients is not None else []

    def masked(got: list, want: list, left_out: Collection[int]) -> list:
        return [(a, b, masks[k] if k < len(masks) else None)
                for k, (a, b) in enumerate(zip(got, want)) if k not in left_out]

    pairs = masked(jax.tree.leaves(out[0]), jax.tree.leaves(reference[0]), skip)
    params = jax.tree.structure(reference[0])
    for got, want in zip(_param_shaped(out[1:], params), _param_shaped(reference[1:], params)):
        # a part of the optimizer state shaped like the parameters: the noise leaves' moments
        # (a tenth of their noise) stay compared, as before the masks
        pairs += masked(got, want, ()) if isinstance(want, list) else [(got, want, None)]
    def difference(a: Any, b: Any, m: np.ndarray | None) -> float:
        got, want = _wide(_host(a)), _wide(_host(b))
        return _max_diff(*_settled(got, want, _one_ulp(a, b, got, want, m)))

    return max((difference(a, b, m) for a, b, m in pairs if np.size(a)), default=0.0)


def _one_ulp(a: Any, b: Any, got: np.ndarray, want: np.ndarray, unsettled: np.ndarray | None
             ) -> np.ndarray | None:
    """`unsettled`, and where `a` or `b` is a bfloat16 or float16 array the elements within
    one unit in the last place of that type at their magnitude (module doc)."""
    narrow = [np.dtype(x.dtype) for x in (a, b) if _narrow(getattr(x, "dtype", None))]
    if not narrow or np.iscomplexobj(want) or got.shape != want.shape:
        return unsettled
    eps = max(float(jnp.finfo(d).eps) for d in narrow)
    size = np.maximum(np.abs(np.nan_to_num(got)), np.abs(np.nan_to_num(want)))
    ulp = eps * np.exp2(np.floor(np.log2(np.where(size > 0, size, 1.0))))
    close = np.abs(np.nan_to_num(got - want)) <= ulp
    return close if unsettled is None or unsettled.shape != close.shape else close | unsettled


def _param_shaped(state: Any, params: Any) -> list[Any]:
    """The leaves of `state`, where a subtree has the parameters' structure `params` (Adam's
    moments) its leaves as one list (parameter order)."""
    subtrees = jax.tree.leaves(state, is_leaf=lambda x: jax.tree.structure(x) == params)
    return [jax.tree.leaves(t) if jax.tree.structure(t) == params else t for t in subtrees]


def _settled(got: np.ndarray, want: np.ndarray, unsettled: np.ndarray | None
             ) -> tuple[np.ndarray, np.ndarray]:
    """`got` and `want` with the `unsettled` elements (a mask of their shape) left out."""
    if unsettled is None or unsettled.shape != want.shape:
        return got, want
    return got[~unsettled], want[~unsettled]


def reading_operators(graph: OpGraph) -> list[str]:
    """Per parameter leaf (``graph.params`` order), the first operator that reads it ('')."""
    paths = {leaf.path for leaf in graph.params}
    first: dict[str, str] = {}
    for op in graph.operators:
        for x in op.inputs:
            if x.kind == "param":
                first.setdefault(_leaf_path(x.source, paths), op.name)
    return [first.get(leaf.path, "") for leaf in graph.params]


def _leaf_path(source: str, paths: set[str]) -> str:
    """An operand's source -> its parameter leaf's path: a layer's slice of a stacked
    parameter (``path[3]``) is that parameter's."""
    while source not in paths and source.endswith("]") \
            and source[source.rfind("[") + 1:-1].isdigit():
        source = source[:source.rfind("[")]
    return source


def _max_diff(got: np.ndarray, want: np.ndarray) -> float:
    """``max |got - want|``; infinite where one has a NaN the other has not."""
    if not want.size:
        return 0.0
    nan = np.isnan(want) if np.issubdtype(want.dtype, np.inexact) else np.zeros(want.shape, bool)
    if np.any(np.isnan(got) != nan) if np.issubdtype(got.dtype, np.inexact) else np.any(nan):
        return math.inf
    return float(np.max(np.abs(np.where(nan, 0, got - want))))


def _wide(x: np.ndarray) -> np.ndarray:
    """`x` in float64, or complex128 where complex: a complex parameter's imaginary part is
    half its value, and of its gradient (a Fourier neural operator's spectral weights)."""
    return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def _host(x: Any) -> np.ndarray:
    """A host copy of `x`; a global array spanning processes is gathered first (a replicated
    one read from this process's copy)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = (x.addressable_data(0) if x.sharding.is_fully_replicated
             else multihost_utils.process_allgather(x, tiled=True))
    arr = np.asarray(x)
    if arr.dtype == jnp.bfloat16 or arr.dtype == np.float16:
        arr = arr.astype(np.float32)
    return arr
