"""The randomized exactness suite's fast part (`tests/fuzzing.py`; the long run, thousands of
strategies over every subject, is `scripts/fuzz_exactness.py`).

For every subject whose float64 gradients tests/test_corpus.py does not hold already (the
corpus models with ``gradients_in="fuzz"``, and the zoo's tiny models with a layer scan,
experts, flash attention): the unsharded data-parallel strategy on one device, and a seeded
random strategy on ``cpu8`` (data=2 x model=4) or ``cpu8-nodes`` (node=2 x data=2 x model=2,
where pipeline stages cut the node axis; the subjects alternate), applied and compared with
``jax.grad`` of the user's loss: the loss and every gradient leaf within 1e-9 of its own scale.
A strategy apply refuses (`PlanError`) is redrawn, up to `TRIES` times. The randomized
suite's finds are kept as tests of their own in tests/test_exactness.py.
"""

from __future__ import annotations

from pathlib import Path

import corpus
import fuzzing
import numpy as np
import pytest

from soapjax.strategy import space
from soapjax.topology.cluster import load_topology

ROOT = Path(__file__).resolve().parent
CPU8 = load_topology("cpu8")
NODES = load_topology(str(ROOT / "meshes" / "cpu8-nodes.toml"))
ONE = load_topology("cpu8-1")
TRIES = 4


SUBJECTS = [n for n in fuzzing.names() if not n.startswith("corpus:")
            or corpus.CORPUS[n.split(":", 1)[1]].gradients_in == "fuzz"]


@pytest.mark.parametrize("name", SUBJECTS)
def test_one_device_is_exact(name):
    s = fuzzing.subject(name)
    out = fuzzing.check(s, space.data_parallel(s.graph, space.MeshShape.of(ONE)), ONE)
    assert out.comparison is not None, out.refused
    assert out.comparison.max_error <= s.tolerance, out.comparison.describe()


@pytest.mark.parametrize("name", SUBJECTS)
def test_a_random_strategy_is_exact(name):
    s = fuzzing.subject(name)
    rng = np.random.default_rng(_seed(name))
    topology = (CPU8, NODES)[SUBJECTS.index(name) % 2]
    for _ in range(TRIES):
        strategy = fuzzing.draw(s, topology, rng)
        out = fuzzing.check(s, strategy, topology)
        if not out.refused:
            break
    assert not out.refused, f"{TRIES} strategies refused; the last: {out.refused}"
    assert not out.failed, (topology.name, fuzzing.describe(strategy, s.graph), out.describe())


def _seed(name: str) -> int:
    """A seed per subject that does not move with Python's string hashing."""
    return sum((k + 1) * ord(c) for k, c in enumerate(name))


def test_draws_keep_to_the_schedules_asked_for():
    """`fuzzing.draw(..., schedules=...)` (the long run's ``--schedules``): pipelined
    strategies alone, of those schedules; without it, the same draws as ever."""
    s = fuzzing.subject("zoo:gpt:tiny")
    wanted = ("zb-h1", "zb-interleaved")
    for seed in range(6):
        drawn = fuzzing.draw(s, NODES, np.random.default_rng(seed), wanted)
        assert drawn.pipelined and drawn.schedule in wanted
        assert (fuzzing.draw(s, NODES, np.random.default_rng(seed))
                == fuzzing.draw(s, NODES, np.random.default_rng(seed), None))


def test_an_interleaved_pipeline_is_drawn_and_exact():
    """The four-layer LLaMA draws interleaved pipelines (2 stages of 2 virtual stages on
    ``cpu8``), which the two-layer subjects cannot: its gradients come back with the stacked
    layers in chunk order (`soapjax.apply.model_layout` puts them back) and match
    ``jax.grad``. Before the subject was added, no interleaved pipeline was ever drawn, and the
    check compared chunk-ordered gradients with the model's (a crash, not a comparison)."""
    s = fuzzing.subject("zoo:llama:tiny-deep")
    rng = np.random.default_rng(3)
    for _ in range(TRIES):
        strategy = fuzzing.draw(s, CPU8, rng, ("interleaved", "zb-interleaved"))
        assert strategy.virtual_stages == 2, fuzzing.describe(strategy, s.graph)
        out = fuzzing.check(s, strategy, CPU8)
        if not out.refused:
            break
    assert not out.failed and out.comparison is not None, out.describe()
