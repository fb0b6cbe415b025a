"""An interleaved pipeline's stacked layer parameters kept in the order its chunks run them.

With v > 1 virtual stages, pipeline stage ``s`` of S runs chunks ``s, s + S, .., s + (v - 1) S``
(`soapjax.strategy.pipeline.chunks_of`), so the layers it runs are not one run of the model's
layer dim: kept in the model's order, split over the stages on the layer dim, every step would
move every stacked parameter to the stage that runs it and its gradient back (an all-to-all
each way). Megatron-LM keeps each stage's layers where its chunks run them; so does
`soapjax.apply.step` for an interleaved plan: between steps a stacked parameter ``[L, ...]``
(and its gradient, and the optimizer state that mirrors it) is stored *in chunk order*, its
layer dim permuted so that stage ``s``'s block of ``L / S`` rows holds its own chunks in
order, and the step's reshape to the pipelined layout moves nothing.

Example, L = 8 layers, S = 2 stages, v = 2 (chunks of 2 layers; stage 0 runs chunks 0 and 2,
stage 1 chunks 1 and 3)::

    model order:  0 1 | 2 3 | 4 5 | 6 7        (chunks 0, 1, 2, 3)
    chunk order:  0 1 4 5 | 2 3 6 7            (stage 0's rows | stage 1's rows)

Such a leaf travels wrapped in a `ChunkOrdered` pytree node, so that the order cannot be
mistaken for the model's: inside `jax.jit`, `optax` and every ``jax.tree`` function it is
flattened away (the array inside is an ordinary leaf), but handed to the model as an array
(``model.apply(params, x)``, an nnx model updated with it) it raises a `PlanError` saying what
to do. `model_layout` takes any tree back to the model's order (checkpoints, exports, the
user's own evaluation); `step_layout` puts a tree in the model's order into the order of a
step's shardings (`soapjax.apply.step.device_put_global` does so by itself).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import GetAttrKey

from soapjax.base.errors import PlanError

__all__ = ["ChunkOrdered", "from_chunk_order", "is_chunk_ordered", "model_layout",
           "step_layout", "to_chunk_order", "unwrapped"]

_USE = ("this array is a stacked layer parameter (or its gradient or optimizer state) in an "
        "interleaved pipeline's chunk order, as soapjax's step keeps it between steps, not in "
        "your model's layer order; take the model's layout with "
        "soapjax.apply.model_layout(tree) (or run.model_params(params)) before using it "
        "outside the step")


class ChunkOrdered:
    """A stacked array ``[L, ...]`` stored in chunk order (module doc) for `stages` stages of
    `virtual` virtual stages. A pytree node with one child, ``value``; the numbers are static.
    """

    __slots__ = ("value", "stages", "virtual")

    def __init__(self, value: Any, stages: int, virtual: int):
        self.value, self.stages, self.virtual = value, stages, virtual

    def __jax_array__(self) -> Any:
        raise PlanError(_USE)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise PlanError(_USE)

    def __getattr__(self, name: str) -> Any:  # an array's attribute: .shape, .reshape, ..
        if name.startswith("__"):
            raise AttributeError(name)
        raise PlanError(f"{_USE} (asked for its .{name})")

    def __repr__(self) -> str:
        return (f"ChunkOrdered({self.value!r}, stages={self.stages}, "
                f"virtual={self.virtual})")


jax.tree_util.register_pytree_with_keys(
    ChunkOrdered,
    lambda c: (((GetAttrKey("value"), c.value),), (c.stages, c.virtual)),
    lambda aux, children: ChunkOrdered(children[0], *aux),
    flatten_func=lambda c: ((c.value,), (c.stages, c.virtual)))


def is_chunk_ordered(x: Any) -> bool:
    return isinstance(x, ChunkOrdered)


def unwrapped(tree: Any) -> Any:
    """`tree` with every `ChunkOrdered` node replaced by its value, left in chunk order: the
    structure of the model's layout (a step's own unpacking; `model_layout` reorders too)."""
    return jax.tree.map(lambda x: x.value if is_chunk_ordered(x) else x, tree,
                        is_leaf=is_chunk_ordered)


def _permute(x: Any, first: tuple[int, int], stages: int, virtual: int) -> Any:
    """`x` ``[L, ...]`` viewed as ``[a, b, L / (a b), ...]`` (``first``), its first two dims
    swapped, flat again. NumPy for host values, jax for arrays (under jit too)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    layers = x.shape[0]
    if layers % (stages * virtual):
        raise PlanError(f"a stacked parameter of {layers} layers does not divide into "
                        f"{stages} x {virtual} chunks")
    per = layers // (stages * virtual)
    y = xp.reshape(x, (*first, per, *x.shape[1:]))
    return xp.reshape(xp.swapaxes(y, 0, 1), x.shape)


def to_chunk_order(x: Any, stages: int, virtual: int) -> Any:
    """A stacked array in the model's layer order -> in chunk order (module doc)."""
    return _permute(x, (virtual, stages), stages, virtual)


def from_chunk_order(x: Any, stages: int, virtual: int) -> Any:
    """A stacked array in chunk order -> in the model's layer order."""
    return _permute(x, (stages, virtual), stages, virtual)


@functools.lru_cache(maxsize=64)
def _on_device(to_chunks: bool, stages: int, virtual: int, sharding: Any) -> Any:
    """The permutation as a jitted program onto `sharding` (one per direction, numbers and
    sharding: a checkpoint's dozens of leaves share a few compiles)."""
    permute = to_chunk_order if to_chunks else from_chunk_order
    jitted = jax.jit(lambda a: permute(a, stages, virtual), out_shardings=sharding)
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.Mesh):
        return jitted

    def run(a: Any) -> Any:  # on its own mesh, whatever the caller's context mesh
        with jax.set_mesh(mesh):
            return jitted(a)

    return run


def model_layout(tree: Any) -> Any:
    """`tree` (parameters, gradients, optimizer state or their shardings or shapes) with every
    `ChunkOrdered` leaf back in the model's layer order, unwrapped: what ``loss_fn`` and the
    model take. Identity on a tree without any. Arrays on devices are permuted by a jitted
    program that keeps their sharding; shardings and `jax.ShapeDtypeStruct`s are unwrapped."""
    def back(x: Any) -> Any:
        if not isinstance(x, ChunkOrdered):
            return x
        v = x.value
        if isinstance(v, jax.Array):
            return _on_device(False, x.stages, x.virtual, v.sharding)(v)
        if isinstance(v, (jax.ShapeDtypeStruct, jax.sharding.Sharding)):
            return v  # a sharding, a shape: the same in either order
        return from_chunk_order(np.asarray(v), x.stages, x.virtual)

    return jax.tree.map(back, tree, is_leaf=is_chunk_ordered)


def step_layout(tree: Any, like: Any) -> Any:
    """`tree` in the model's layer order, each leaf at a place where `like` (the step's
    shardings, or a tree in the step's layout) has a `ChunkOrdered` node put in chunk order and
    wrapped so. Leaves already wrapped stay as they are. Identity where `like` has none.
    Arrays on devices are permuted by a jitted program that keeps their sharding (or puts them
    on the one `like` holds)."""
    def put(template: Any, x: Any) -> Any:
        if not isinstance(template, ChunkOrdered) or isinstance(x, ChunkOrdered):
            return x
        s, v = template.stages, template.virtual
        if isinstance(x, jax.Array):
            target = template.value if isinstance(template.value, jax.sharding.Sharding) \
                else x.sharding
            x = _on_device(True, s, v, target)(x)
        elif not isinstance(x, jax.ShapeDtypeStruct):
            x = to_chunk_order(np.asarray(x), s, v)
        return ChunkOrdered(x, s, v)

    if not any(isinstance(t, ChunkOrdered)
               for t in jax.tree.leaves(like, is_leaf=is_chunk_ordered)):
        return tree
    return jax.tree.map(put, like, tree,
                        is_leaf=lambda t: isinstance(t, ChunkOrdered)
                        or isinstance(t, jax.sharding.Sharding))
