"""`soapjax.cost.reshard_steps`: a layout change as permute-free steps, and what XLA makes of
them, compiled on the 8 CPU devices."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from soapjax.cost.reshard import ideal_collectives, permute_free
from soapjax.cost.reshard_steps import steps
from soapjax.strategy.space import MeshShape

_SPEC = importlib.util.spec_from_file_location(
    "bench_reshard_steps", Path(__file__).resolve().parent.parent / "scripts"
    / "bench_reshard_steps.py")
_BENCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_BENCH)

NODES = MeshShape(("node", "data", "model"), (2, 2, 2))
# an embedding's output [M, B, S, D] as a searched plan made it (the hidden dim over `model`),
# and as a pipeline's data groups (`data` and `model`) take it
MADE = ((), (), (), ("model",))
GROUPED = ((), ("data", "model"), (), ())
SHAPE = (1, 8, 8, 32)


def compiled(layouts, shape=SHAPE) -> list[tuple[str, float, tuple[str, ...]]]:
    """XLA's collectives for a value held to each of `layouts` in turn, on ``NODES``
    (`scripts/bench_reshard_steps.py`'s compile)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(NODES.axis_sizes), NODES.axis_names)
    return [(c.kind, c.nbytes, c.axes) for c in _BENCH.compiled(mesh, shape, layouts)]


def ideal(layouts, shape=SHAPE) -> list[tuple[str, float, tuple[str, ...]]]:
    return [(c.kind.replace("_", "-"), c.nbytes, c.axes) for a, b in zip(layouts, layouts[1:])
            for c in ideal_collectives(shape, "float32", a, b, NODES)]


def test_a_permute_free_change_takes_no_steps():
    assert steps((8, 32), "float32", (("data",), ()), (("data",), ("model",)), NODES) == ()
    assert steps((8, 32), "float32", (("model",), ()), ((), ("model",)), NODES) == ()
    # size-1 axes split nothing
    one = MeshShape(("data", "model"), (1, 8))
    assert steps((8, 32), "float32", (("data",), ()), ((), ("data",)), one) == ()


@pytest.mark.parametrize("direction", ["into the groups", "back"])
def test_a_slice_and_a_move_made_in_steps_are_what_the_ideal_model_prices(direction):
    """In one go XLA makes the change by replicating the value (an all-gather of the whole
    value: 8,192 bytes, four times the ideal model's all-to-all into the groups; on the way
    back an all-gather over both axes where the ideal model moves ``model`` and gathers
    ``data``); held to the chain's layouts in turn, it makes exactly the ideal model's
    collectives, step by step."""
    src, dst = (MADE, GROUPED) if direction == "into the groups" else (GROUPED, MADE)
    assert not permute_free(src, dst, NODES)
    chain = steps(SHAPE, "float32", src, dst, NODES)
    assert chain and all(permute_free(a, b, NODES)
                         for a, b in zip((src, *chain), (*chain, dst)))
    layouts = [src, *chain, dst]
    assert compiled(layouts) == ideal(layouts) == ideal([src, dst])
    one_go = compiled([src, dst])
    assert [kind for kind, _, _ in one_go] == ["all-gather"]
    assert one_go[0][1] == 8192 and one_go[0][1] > sum(b for _, b, _ in ideal([src, dst]))


def test_steps_keep_every_dim_divided_by_its_axes():
    """A dim of 2 holds one axis of 2 at a time: from ``data`` to ``model`` on it the chain
    gathers first (no layout with both on it)."""
    chain = steps((2, 2), "float32", (("data",), ()), (("model",), ()), NODES)
    assert chain == (((), ()),)
