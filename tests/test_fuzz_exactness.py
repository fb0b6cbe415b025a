"""The randomized exactness suite's fast part (`tests/fuzzing.py`; the long run is
`scripts/fuzz_exactness.py`).

For every subject (every corpus model in float64, and the zoo's tiny models with a layer scan,
experts, flash attention, an LSTM): the unsharded data-parallel strategy on one device, and
`DRAWS` seeded random strategies on ``cpu8`` (data=2 x model=4) and ``cpu8-nodes`` (node=2 x
data=2 x model=2, where pipeline stages cut the node axis), each applied and compared with
``jax.grad`` of the user's loss: the loss and every gradient leaf within 1e-9 of its own
scale. A strategy apply refuses (`PlanError`) is redrawn, up to `TRIES` times.
"""

from __future__ import annotations

from pathlib import Path

import fuzzing
import numpy as np
import pytest

from soapjax import space
from soapjax.topology import load_topology

ROOT = Path(__file__).resolve().parent
CPU8 = load_topology("cpu8")
NODES = load_topology(str(ROOT / "meshes" / "cpu8-nodes.toml"))
ONE = load_topology("cpu8-1")
DRAWS = 1  # per subject and topology, in make test
TRIES = 4


@pytest.mark.parametrize("name", fuzzing.names())
def test_one_device_is_exact(name):
    s = fuzzing.subject(name)
    out = fuzzing.check(s, space.data_parallel(s.graph, space.MeshShape.of(ONE)), ONE)
    assert out.comparison is not None, out.refused
    assert out.comparison.max_error <= fuzzing.TOLERANCE, out.comparison.describe()


@pytest.mark.parametrize("name", fuzzing.names())
def test_random_strategies_are_exact(name):
    s = fuzzing.subject(name)
    rng = np.random.default_rng(_seed(name))
    compared = 0
    for topology in (CPU8, NODES):
        for _ in range(DRAWS):
            for _ in range(TRIES):
                strategy = fuzzing.draw(s, topology, rng)
                out = fuzzing.check(s, strategy, topology)
                if out.comparison is not None:
                    break
            else:
                continue
            compared += 1
            assert out.comparison.passed, (topology.name, fuzzing.describe(strategy, s.graph),
                                           out.comparison.describe())
    assert compared >= 1


def _seed(name: str) -> int:
    """A seed per subject that does not move with Python's string hashing."""
    return sum((k + 1) * ord(c) for k, c in enumerate(name))
