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
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from soapjax.base._dtypes import itemsize

__all__ = ["DEFAULT_UPDATE_PASSES", "update_passes", "update_reductions"]

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
