"""An nnx model as a pure loss of its trained parameters, for tracing and the step.

`soapjax.training.shard_training` and ``--model file.py:fn`` take an `nnx.Module` in place of
the parameters with ``loss_fn(model, batch)``: `pure_loss` splits the model's state into its
`nnx.Param` variables (the step's parameters) and the rest (batch statistics, RNG streams:
held constant) and returns ``loss(params, batch)``. Given ``wrt`` (an nnx filter, as
``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` takes it), only the parameters it selects
are trained: the model's other `nnx.Param` variables (a LoRA's base) stay parameters, so a
plan can split them, and the optimizer leaves them as they are (`optax.set_to_zero` under
`optax.multi_transform`), so no gradient is computed for them
(`soapjax.cost.updates.frozen_leaves`). An `nnx.Optimizer` in place of the optax
transformation says both (`optax_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from soapjax.base.errors import ArgumentError

__all__: list[str] = []


def pure_loss(loss_fn: Callable, params: Any, name: str | None) -> tuple[Callable, Any, Any]:
    """``(loss(params, batch), params, name)``: `loss_fn` and `params` as they are, or for an
    nnx model its `nnx.Param` state and a loss of it (module doc)."""
    from flax import nnx

    if not isinstance(params, nnx.Module):
        return loss_fn, params, name
    model = params
    graphdef, trained, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, batch):
        # A fresh copy of the other state (batch statistics, RNG streams) on every call: merged
        # as it is, its Variables belong to the caller's trace level, and a model that applies
        # nnx.scan or nnx.vmap inside (scan over layers) fails to trace with "Cannot extract
        # graph node from different trace level".
        return loss_fn(nnx.merge(graphdef, p, jax.tree.map(jnp.asarray, rest)), batch)

    return loss, trained, name or type(model).__name__


def optax_of(model: Any, optimizer: Any, wrt: Any = None) -> Any:
    """The optax transformation to train `model` with: `optimizer` itself, restricted to
    `wrt` where given (`trained_only`); an `nnx.Optimizer` (``nnx.Optimizer(model, tx,
    wrt=nnx.LoRAParam)``, as nnx users build one) gives its ``tx`` and, unless `wrt` is
    given, its ``wrt``. Anything else is returned as it is, for the caller to refuse."""
    from flax import nnx

    if isinstance(optimizer, nnx.Optimizer):
        wrt = optimizer.wrt if wrt is None and optimizer.wrt is not nnx.Param else wrt
        optimizer = optimizer.tx
    return optimizer if wrt is None else trained_only(model, wrt, optimizer)


def trained_only(model: Any, wrt: Any, optimizer: optax.GradientTransformation
                 ) -> optax.GradientTransformation:
    """`optimizer` on the `nnx.Param` variables of `model` that the nnx filter `wrt` selects,
    the others left as they are (``optax.set_to_zero``), over the state `pure_loss` trains.

    Raises:
      ArgumentError: `model` is not an nnx model, or `wrt` selects none of its parameters.
    """
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise ArgumentError(
            f"wrt={wrt!r} selects an nnx model's variables, but the parameters are a "
            f"{type(model).__name__}; for a pytree of parameters, freeze the others with "
            "optax.multi_transform({'train': optimizer, 'frozen': optax.set_to_zero()}, labels)")
    wanted = {tuple(path) for path, _ in nnx.to_flat_state(nnx.state(model, wrt))}
    params = nnx.state(model, nnx.Param)
    if not wanted:
        raise ArgumentError(f"wrt={wrt!r} selects none of the {type(model).__name__}'s "
                            "variables; pass the filter nnx.Optimizer would take "
                            "(nnx.LoRAParam, nnx.Param, a path filter)")

    def label(path, _):
        names = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
                      for k in path)
        return "train" if names in wanted else "frozen"

    labels = jax.tree_util.tree_map_with_path(label, params,
                                              is_leaf=lambda x: isinstance(x, nnx.Variable))
    return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)
