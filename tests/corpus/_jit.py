"""Initialisation in one jitted program, as users write it (``jax.jit(model.init)``).

Eagerly, every initialiser and every op of the forward pass that ``init`` runs is compiled on its
own (a ResNet-18's init: ~15 s of compiling on a small CPU); jitted, it is one program, and
with fast-compile XLA options (what tests pass as ``compiler_options``) under 2 s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx


def init_linen(init: Callable, *args: Any, compiler_options: Mapping[str, Any] | None = None):
    """``jax.jit(init)(*args)``, e.g. ``init_linen(model.init, rng, x)``."""
    options = dict(compiler_options) if compiler_options else None
    return jax.jit(init, compiler_options=options)(*args)


def create_nnx(create: Callable[[], nnx.Module], *,
               compiler_options: Mapping[str, Any] | None = None) -> nnx.Module:
    """``create()``'s module, its state computed by one jitted program (nnx's functional API:
    the graph from `nnx.eval_shape`, the state from `jax.jit`, joined by `nnx.merge`)."""
    graphdef = nnx.graphdef(nnx.eval_shape(create))
    options = dict(compiler_options) if compiler_options else None
    state = jax.jit(lambda: nnx.state(create()), compiler_options=options)()
    return nnx.merge(graphdef, state)
