"""The randomized exactness suite's fast part for the zoo's subjects (`tests/fuzzing.py`; the
long run, thousands of strategies over every subject, is `scripts/fuzz_exactness.py`).

For the zoo's tiny models with what the corpus lacks (a layer scan, experts, flash attention):
the unsharded data-parallel strategy on one device, and a seeded random strategy on ``cpu8``
(data=2 x model=4) or ``cpu8-nodes`` (node=2 x data=2 x model=2, where pipeline stages cut the
node axis; the subjects alternate), applied and compared with ``jax.grad`` of the user's loss:
the loss and every gradient leaf within 1e-9 of its own scale (`fuzzing.one_device`,
`fuzzing.seeded`). The corpus models' subjects are checked the same way in
tests/test_corpus.py, whose process makes those models anyway. The randomized suite's finds
are kept as tests of their own in tests/test_exactness.py.
"""

from __future__ import annotations

import fuzzing
import numpy as np
import pytest
from fuzzing import CPU8, NODES, TRIES

ZOO = [n for n in fuzzing.MAKE_TEST if n.startswith("zoo:")]


@pytest.mark.parametrize("name", ZOO)
def test_one_device_is_exact(name):
    out = fuzzing.one_device(name)
    assert out.comparison is not None, out.refused
    assert out.comparison.max_error <= fuzzing.subject(name).tolerance, out.comparison.describe()


@pytest.mark.parametrize("name", ZOO)
def test_a_random_strategy_is_exact(name):
    strategy, topology, out = fuzzing.seeded(name)
    assert not out.refused, f"{TRIES} strategies refused; the last: {out.refused}"
    assert not out.failed, (topology.name, fuzzing.describe(strategy, fuzzing.subject(name).graph),
                            out.describe())


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
