"""soapjax.cost.updates: what an optimizer's update reads, writes and reduces, from its jaxpr."""

from __future__ import annotations

import optax
import pytest

from soapjax.cost.updates import DEFAULT_UPDATE_PASSES, update_passes, update_reductions

OPTIMIZERS = {
    # (passes over the parameter bytes, scalars reduced per parameter)
    "none": (None, DEFAULT_UPDATE_PASSES, 0),
    "sgd": (optax.sgd(0.1), 3.0, 0),  # read p, g; write p
    "momentum": (optax.sgd(0.1, momentum=0.9), 5.0, 0),  # and read and write the trace
    # two moments, and the step count's 4 bytes over a 4 KB vector
    "adam": (optax.adam(1e-3), 7.0 + 2 * 4 / 4096, 0),
    "clipped adam": (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
                     7.0 + 2 * 4 / 4096, 1),
    # the trust ratio's two norms: four reductions to a scalar in optax 0.2's jaxpr
    "lamb": (optax.lamb(1e-3), None, 4),
}


@pytest.mark.parametrize("name", OPTIMIZERS, ids=list(OPTIMIZERS))
def test_passes_and_reductions(name):
    optimizer, passes, reductions = OPTIMIZERS[name]
    if passes is not None:
        assert update_passes(optimizer) == passes
    assert update_reductions(optimizer) == reductions
