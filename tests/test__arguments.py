"""soapjax.strategy._arguments: an argument of the wrong kind is one ArgumentError saying what to
pass."""

import optax
import pytest

from soapjax import SearchSettings
from soapjax.base.errors import ArgumentError, SoapjaxError
from soapjax.strategy._arguments import check_graph, check_optimizer, check_settings, check_topology
from soapjax.topology.cluster import load_topology


@pytest.mark.parametrize("check, message", [
    (lambda: check_topology("cpu8", "find_plan"),
     (r"find_plan: expected topology to be a soapjax Topology, found str 'cpu8'; pass "
      r"soapjax.load_topology\('cpu8'\) \(see `soapjax meshes`\)")),
    (lambda: check_settings({"budget_s": 1}, SearchSettings, "find_plan"),
     (r"find_plan: expected settings to be a SearchSettings or None, found dict "
      r"\{'budget_s': 1\}; pass settings=SearchSettings\(budget_s=1\)")),
    (lambda: check_optimizer("adam", "shard_training"),
     (r"shard_training: expected optimizer to be an optax GradientTransformation \(with init "
      r"and update\), found str 'adam'; pass e.g. optax.adam\(learning_rate\)")),
    (lambda: check_graph(object(), "find_plan"),
     (r"find_plan: expected graph to be an OpGraph, found object <object object at .*>; make "
      r"one with soapjax.trace\(loss_fn, params, batch\)")),
], ids=["topology-name", "settings-dict", "optimizer-name", "not-a-graph"])
def test_wrong_kinds(check, message):
    with pytest.raises(ArgumentError, match=message):
        check()
    assert issubclass(ArgumentError, SoapjaxError) and issubclass(ArgumentError, TypeError)


def test_right_kinds_pass():
    check_topology(load_topology("cpu8"), "find_plan")
    check_settings(None, SearchSettings, "find_plan")
    check_settings(SearchSettings(budget_s=1), SearchSettings, "find_plan")
    check_optimizer(optax.adam(1e-3), "shard_training")
